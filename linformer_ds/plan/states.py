"""Model states per rank (parameters, gradients, optimizer states by ZeRO stage and offload),
ZeRO's buffers, and the bytes each rank hands to collectives per step (sequence-parallel
exchange and ZeRO's reduce-scatter / all-gather / all-reduce)."""

from .activations import kind_of

FP32 = 4


_COUNTS: dict[str, tuple[int, int]] = {}


def parameter_counts(config) -> tuple[int, int]:  # noqa: ANN001
    """``(total, sequence_shaped)``: unique parameters of the pretraining model (a tied
    decoder counted once), built on the meta device (shapes only), and those indexed by
    sequence position (a projection module's ``sequence_dim`` weight, the position table),
    which sharded sequence parallelism splits over P ranks."""
    key = repr(sorted(config.to_dict().items()))
    if key not in _COUNTS:
        _COUNTS[key] = _count(config)
    return _COUNTS[key]


def _count(config) -> tuple[int, int]:  # noqa: ANN001
    import torch

    from ..model import LinformerForMaskedLMPretraining

    with torch.device("meta"):
        model = LinformerForMaskedLMPretraining(config)
    seen, total, seq = set(), 0, 0
    for module in model.modules():
        shaped = getattr(module, "sequence_dim", None) is not None or (
            module is model.encoder.position_embeddings
        )
        for p in module.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            total += p.numel()
            seq += p.numel() if shaped else 0
    return total, seq


def model_states(
    config,
    precision: str,
    stage: int,
    dp: int,
    sp: int,
    shard: bool,  # noqa: ANN001
    offload_optimizer: bool = False,
    offload_param: bool = False,
    fp32_grad_accum: bool = True,
) -> dict:
    """Bytes per rank on the device (and ``cpu`` under offload) of parameters, gradients and
    optimizer states, by the ZeRO paper's accounting with DeepSpeed's layouts: 16-bit
    parameters and gradients under bf16/fp16 with an fp32 master copy beside Adam's two
    moments (fp32: the parameters are the master; ZeRO 1-3 keep a flat fp32 partition), the
    fp32 gradient accumulator under ``fp32_grad_accum``; stage s partitions the optimizer
    (s >= 1), gradients (s >= 2) and parameters (s = 3) over the ``dp`` replicas."""
    total, seq = parameter_counts(config)
    psi = total - seq + (seq // sp if shard else seq)
    pe = FP32 if precision == "fp32" else 2
    params = psi * pe / (dp if stage == 3 else 1)
    grad_e = FP32 if (precision == "fp32" or fp32_grad_accum) else 2
    if stage >= 2:
        grads = psi * grad_e / dp
    else:
        grads = psi * grad_e + (psi * pe if (pe != grad_e and stage == 1) else 0)
    moments = 2 * FP32 * psi
    master = FP32 * psi if (pe != FP32 or stage >= 1) else 0
    optim = (moments + master) / (dp if stage >= 1 else 1)
    cpu = 0.0
    if offload_optimizer:
        cpu += optim
        optim = 0.0
    if offload_param:
        cpu += params
        params = 0.0
    return {
        "parameters": int(params),
        "gradients": int(grads),
        "optimizer": int(optim),
        "cpu": int(cpu),
        "count": total,
        "per_rank_count": psi,
    }


def zero_buffers(config, precision: str, stage: int, reduce_bucket: int, allgather_bucket: int,  # noqa: ANN001, E501
                 overlap_comm: bool) -> int:  # fmt: skip
    """DeepSpeed's temporary buffers: the gradient reduce bucket(s) (two with overlap_comm),
    and under ZeRO-3 the all-gather bucket plus one layer's parameters gathered whole."""
    if stage == 0:
        return 0
    pe = FP32 if precision == "fp32" else 2
    out = reduce_bucket * pe * (2 if overlap_comm else 1)
    if stage == 3:
        d, ff = config.hidden_size, config.intermediate_size
        layer = 4 * d * d + 2 * d * ff
        out += allgather_bucket * pe + 2 * layer * pe
    return int(out)


def sp_bytes_per_layer(config, i: int, seq_len: int, sp: int, batch: int, elem: int) -> dict:  # noqa: ANN001, E501
    """Bytes one rank hands to the sequence-parallel collectives in layer ``i`` (forward,
    backward; docs/sequence_parallel.md): summaries all-reduced (``B k 2D``), strided blocks
    all-gathered (``B (N/P/r) 2D`` + a byte of mask each) and reduce-scattered back, or
    Ulysses' four all-to-alls of ``B N/P D`` (+ the mask); windows add two halo all-gathers of
    ``B 2r D`` (keys and values) and their reduce-scatters."""
    if sp == 1:
        return {"forward": 0, "backward": 0}
    d = config.hidden_size
    n = seq_len // sp
    kind = kind_of(config, i, seq_len)
    if kind.full:
        a2a = batch * n * d * elem
        return {"forward": 4 * a2a + batch * n, "backward": 4 * a2a}
    fwd = bwd = 0
    if kind.blocked:
        c = kind.summaries // sp
        fwd, bwd = batch * c * 2 * d * elem + batch * c, batch * c * sp * 2 * d * elem
    elif kind.summaries:
        fwd = bwd = batch * kind.summaries * 2 * d * elem
    if kind.windowed:
        edge = batch * 2 * (config.local_window // 2) * d * elem
        fwd, bwd = fwd + 2 * edge, bwd + 2 * edge * sp
    return {"forward": fwd, "backward": bwd}


def sp_mask_bytes(config, sp: int, batch: int, n: int) -> int:  # noqa: ANN001
    """Bytes one rank hands per forward to gather the whole rows' attention mask for the
    window and for the local mixer (each its own all-gather of ``B N/P`` bytes)."""
    if sp == 1:
        return 0
    uses = int(bool(config.local_window)) + int(config.local_mixer != "none")
    return uses * batch * n
