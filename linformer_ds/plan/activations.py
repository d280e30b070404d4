"""Activation memory of one training step, from tensor shapes and dtypes: the bytes each layer
keeps for its backward pass (by attention kind, tokens per rank, checkpointing) and what the
backward pass holds on top of them. The terms follow what the model's operators save (listed
per term below); tests/test_plan.py checks the sum against the live tensor bytes of real steps
(:class:`linformer_ds.plan.measure.LiveBytes`)."""

import math
from dataclasses import dataclass

import torch

from ..model import get_projection
from ..model.kernels import pick_kernel

FP32 = 4  # LayerNorm statistics, log-softmax and attention log-sum-exp stay fp32


@dataclass(frozen=True)
class Step:
    """What the activations depend on besides the model: ``batch`` rows of ``n`` tokens on this
    rank (N / P under sequence parallelism, ``seq_len`` = N), ``elem`` bytes per activation
    (4 fp32, 2 bf16/fp16), ``device`` type (``cpu``: torch's CPU kernels; else fused
    attention), ``labelled`` fraction of tokens through the MLM head, ``masked``: an attention
    mask is passed (keys and values are then multiplied by it, a copy)."""

    batch: int
    n: int
    seq_len: int
    elem: int
    device: str = "cuda"
    labelled: float = 0.15
    sp: int = 1
    masked: bool = True  # an attention mask is passed (the trainer always passes one)


@dataclass(frozen=True)
class Kind:
    """The properties of a layer's attention kind that its activations depend on."""

    full: bool  # every query sees every key (n x n scores)
    summaries: int  # m: summaries each query attends to (the whole sequence's)
    windowed: bool  # the exact window (model.local_window) joins them
    # the kind has a stride: its summaries are blocks of it (a copy of K, V laid out in blocks)
    blocked: bool
    # the kind's module takes the mask: it computes its summary weights from the input (a
    # softmax over positions and copies of K, V for it)
    weighted: bool


def kind_of(config, i: int, seq_len: int) -> Kind:  # noqa: ANN001
    """Layer ``i``'s :class:`Kind`, read from the registry: the one place the planner asks a
    kind anything."""
    kind = get_projection(config.projection_schedule()[i])
    if kind.full_attention:
        return Kind(True, 0, False, False, False)
    stride = kind.stride(config, i) if kind.stride is not None else None
    m = 0
    if kind.summaries:
        m = math.ceil(seq_len / stride) if stride else config.k_for_layer(i)
    windowed = bool(config.local_window) and kind.windowed
    return Kind(False, m, windowed, stride is not None, kind.masked)


def _attention_path(step: Step, config, m: int, full: bool) -> int:  # noqa: ANN001
    """Bytes per element of the scores attention keeps (0: a fused kernel, which keeps its
    output and log-sum-exp only). On the CPU the explicit product (picked for short key axes,
    kernels.py) keeps them in the activations' dtype; SDPA with dropout falls back to its math
    path, which computes in fp32."""
    if step.device != "cpu":
        return 0
    dtype = torch.float32 if step.elem == 4 else torch.bfloat16
    if not full and m and pick_kernel(step.n, m, dtype, torch.device("cpu")) == "explicit":
        return step.elem
    return FP32 if config.attention_dropout > 0 else 0


def attention_saved(config, i: int, step: Step) -> int:  # noqa: ANN001
    """Bytes layer ``i``'s attention keeps for backward, from the qkv product to the output
    projection's input. ``u`` = one ``[B, n, D]`` activation."""
    b, n, e = step.batch, step.n, step.elem
    d, h = config.hidden_size, config.num_heads
    u = b * n * d * e
    kind = kind_of(config, i, step.seq_len)
    drop = config.attention_dropout > 0

    def scores(m: int, es: int) -> int:  # softmax [B, h, n, m] (+ dropout mask, dropped)
        return b * h * n * m * es * (3 if drop else 1)

    if kind.full:
        es = _attention_path(step, config, step.seq_len, True)
        if es:  # q, k, v copies and scores in the math path's dtype, the output
            return 3 * b * n * d * es + scores(step.seq_len, es) + u
        return 3 * u + u + b * h * n * FP32  # qkv (views), output, log-sum-exp
    m = kind.summaries
    summ = 2 * b * m * d * e  # projected keys and values [B, m, 2D]
    # the projection's own: a product over the sequence keeps its input (the qkv whose views
    # K, V are, or their copy multiplied by the mask); conv a copy of K, V in blocks; a
    # computed projection also a copy of K, V, its weights and their softmax
    kv_in = (2 * u if step.masked else 3 * u) if m and not kind.blocked else 0
    if kind.blocked:
        proj = 2 * u
    elif kind.weighted:
        proj = kv_in + 2 * u + 2 * b * h * m * n * e + 2 * b * n * h * m * FP32
    else:
        proj = kv_in
    if kind.windowed:
        r = config.local_window // 2
        nb = -(-n // r)
        keys = 3 * r + m
        out = 6 * b * nb * r * d * e + b * nb * r * d * e + b * nb * r * 3 * r  # K, V around, Q
        out += b * h * nb * r * keys * e * (3 if drop else 1)  # scores over window + summaries
        if m:
            out += u + summ  # queries and summaries laid out for their product
        return proj + out + u
    es = _attention_path(step, config, m, False)
    if es:  # queries, summaries, scores (the path's dtype), the output
        return proj + (u + summ) * es // e + scores(m, es) + u
    flash = 0 if kv_in == 3 * u else 3 * u  # the fused kernel keeps q, a view of qkv
    return proj + flash + summ + u + b * h * n * FP32


def ffn_saved(config, step: Step) -> int:  # noqa: ANN001
    """The feed-forward sub-layer: LayerNorm output, fc1 and GELU outputs ``[B, n, ff]``,
    dropout mask, the residual sum, LayerNorm statistics."""
    b, n, e, d = step.batch, step.n, step.elem, config.hidden_size
    u = b * n * d * e
    drop = u if config.dropout > 0 else 0
    return u + 2 * b * n * config.intermediate_size * e + drop + u + 2 * b * n * FP32


def attention_block_saved(config, i: int, step: Step) -> int:  # noqa: ANN001
    """The attention sub-layer: (mixer), LayerNorm output and statistics, attention, dropout
    mask, the residual sum."""
    b, n, e, d = step.batch, step.n, step.elem, config.hidden_size
    u = b * n * d * e
    drop = u if config.dropout > 0 else 0
    total = u + 2 * b * n * FP32 + attention_saved(config, i, step) + drop + u
    if config.local_mixer == "layers":
        total += mixer_saved(config, step)
    return total


def mixer_saved(config, step: Step) -> int:  # noqa: ANN001
    """A local-mixer sub-layer: LayerNorm statistics, one product per tap, the validity
    weights, dropout mask, the residual sum."""
    b, n, e, d = step.batch, step.n, step.elem, config.hidden_size
    u = b * n * d * e
    taps = 2 * (config.local_mixer_kernel // 2) + 1
    drop = u if config.dropout > 0 else 0
    return 2 * b * n * FP32 + taps * u + taps * b * n * e + drop + u


def embed_saved(config, step: Step) -> int:  # noqa: ANN001
    """Embeddings: their sum (LayerNorm's input), dropout mask, output, statistics."""
    b, n, e, d = step.batch, step.n, step.elem, config.hidden_size
    u = b * n * d * e
    total = u + (u if config.dropout > 0 else 0) + u + 2 * b * n * FP32
    if config.local_mixer == "embed":
        total += mixer_saved(config, step)
    return total


def head_saved(config, step: Step) -> int:  # noqa: ANN001
    """The MLM head on the labelled rows ``M``: the gathered rows, dense, GELU, LayerNorm
    outputs, logits and their fp32 log-softmax; the final LayerNorm's statistics."""
    e, d, v = step.elem, config.hidden_size, config.vocab_size
    rows = math.ceil(step.labelled * step.batch * step.n)
    logits = rows * v * e + rows * v * FP32 + (rows * v * FP32 if e != FP32 else 0)
    return 4 * rows * d * e + logits + 2 * step.batch * step.n * FP32


def attention_transient(config, i: int, step: Step) -> int:  # noqa: ANN001
    """Gradients in flight inside layer ``i``'s attention backward: of the scores where they
    are kept (and of the keys and values laid out around each window block), else of q, k and
    v; and of the output."""
    b, n, e, d, h = step.batch, step.n, step.elem, config.hidden_size, config.num_heads
    u = b * n * d * e
    kind = kind_of(config, i, step.seq_len)
    if kind.windowed:
        keys = 3 * (config.local_window // 2) + kind.summaries  # explicit products anywhere
        return b * h * n * keys * e + 6 * u + u
    keys = step.seq_len if kind.full else kind.summaries
    es = _attention_path(step, config, keys, kind.full)
    out = (b * h * n * keys * es if es else 3 * u) + u
    if kind.weighted:  # the gradients of its fp32 weights over positions, keys and values
        out += b * n * 2 * h * keys * FP32
    return out


def mixer_transient(config, step: Step) -> int:  # noqa: ANN001
    """Gradients in flight inside a local mixer's backward: of its output, one tap's product
    and weight, and the padded input they accumulate into."""
    if config.local_mixer != "layers":
        return 0
    return 4 * step.batch * step.n * config.hidden_size * step.elem


def ffn_transient(config, step: Step) -> int:  # noqa: ANN001
    """Gradients in flight inside a feed-forward backward: one ``[B, n, ff]`` and the output's."""
    return step.batch * step.n * (config.intermediate_size + config.hidden_size) * step.elem


def activation_peak(config, step: Step, checkpoint: str | None = None) -> dict:  # noqa: ANN001
    """Bytes of activations at the peak of one forward + backward: ``saved`` (kept across the
    whole backward), ``head`` (the MLM head's at its backward), ``working`` (at the worst
    moment of one layer's backward: its recomputed activations under checkpointing, and the
    gradients in flight) and ``per_layer`` (each kind's saved bytes per layer).
    ``checkpoint``: None, ``layer`` or ``sublayer`` (every layer)."""
    u = step.batch * step.n * config.hidden_size * step.elem
    L = config.num_layers
    attn = [attention_block_saved(config, i, step) for i in range(L)]
    ffn = ffn_saved(config, step)
    a_tr = [attention_transient(config, i, step) + mixer_transient(config, step)
            for i in range(L)]  # fmt: skip
    f_tr = ffn_transient(config, step)
    by_kind: dict[str, int] = {}
    for i, name in enumerate(config.projection_schedule()):
        by_kind.setdefault(name, attn[i] + ffn)
    # the worst moment inside layer i's backward, over what the layer itself holds
    inside = [max(attn[i] + ffn + f_tr, attn[i] + a_tr[i]) for i in range(L)]
    if checkpoint is None:
        saved = embed_saved(config, step) + sum(attn) + L * ffn
        working = max(f_tr, max(inside[i] - attn[i] - ffn for i in range(L)))
    elif checkpoint == "layer":  # a recomputed layer's own output is not kept inside it
        saved = embed_saved(config, step) + L * u
        working = max(inside) - u
    else:  # nor a recomputed sub-layer's
        saved = 2 * L * u + u
        working = max(max(attn[i] + a_tr[i] for i in range(L)), ffn + f_tr) - u
    # the head's backward comes first: its activations and the logits' gradients (fp32 and
    # the compute dtype) are gone before any layer's backward starts
    rows = math.ceil(step.labelled * step.batch * step.n)
    head = head_saved(config, step) + rows * config.vocab_size * (FP32 + step.elem)
    return {
        "saved": saved,
        "head": head,
        "working": working,
        "per_layer": by_kind,
        "peak": saved + max(head, working),
    }
