"""Training FLOPs per token of an MLM step: the benchmark's and the trainer's MFU figure. Each
layer's attention is its kind's own formula (the registry); dense's is the default."""

from .config import ModelConfig
from .registry import layer_kinds


def flops_per_token(
    config: ModelConfig, seq_len: int | None = None, mlm_fraction: float = 1.0
) -> float:
    """Training FLOPs (forward + backward = 3x forward) per token of an MLM step.

    Counts matrix multiplies only (2 FLOPs per multiply-add): QKV/output/FFN projections,
    sequence projections (E/F or conv), attention scores and weighted sum, and the MLM head on
    ``mlm_fraction`` of the tokens. The benchmark and the trainer's MFU both use this formula.
    """
    n = seq_len or config.max_seq_len
    dm, ff = config.hidden_size, config.intermediate_size
    fwd = 0.0
    for i, kind in enumerate(layer_kinds(config)):
        fwd += 2 * (3 * dm * dm + dm * dm + 2 * dm * ff)  # qkv, out, ffn
        proj = kind.flops
        if proj is None:  # dense, or a registered kind without a formula (an upper bound)
            fwd += 2 * 2 * n * dm  # Q K^T and A V
        else:  # the kind's own: linear E K, F V + k summaries; conv: kernel taps + c blocks
            fwd += proj(config, i, n)
        if kind.windowed and config.local_window:  # the window: scores and weighted sum
            fwd += 2 * 2 * min(config.local_window + 1, n) * dm
    fwd += mlm_fraction * 2 * (dm * dm + dm * config.vocab_size)
    return 3.0 * fwd
