"""Linformer encoder (Wang et al. 2020, arXiv 2006.04768) in plain PyTorch.

This file imports nothing but torch and the standard library: the Hugging Face export ships it
verbatim as the model's remote code, so an exported model loads without linformer_ds installed.

Attention variants (per layer, see ``ModelConfig.projection_schedule``):

* ``linear``: keys and values are projected along the sequence axis by learned ``E, F`` of shape
  ``[k, N_max]``: ``softmax(Q (E K)^T / sqrt(d_h)) (F V)``. Cost O(n k), no n x n tensor.
* ``conv`` (Conv-Linformer): keys and values are compressed by a strided 1-D convolution over the
  sequence with kernel = stride = ``N_max / k``.
* ``dense``: full softmax attention (the baseline), through ``scaled_dot_product_attention``.

Sharing modes (the paper's section 4 meaning):

* ``none``: separate ``E_h, F_h`` for every head of every layer.
* ``headwise``: one ``E`` and one ``F`` per layer, shared by all heads.
* ``kv``: one matrix per layer, used for keys and values (``E = F``), shared by all heads.
* ``layerwise``: one matrix for all layers, heads, keys and values (owned by the encoder).
"""

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

MODEL_FORMAT_VERSION = 1

PROJECTIONS = ("linear", "conv", "dense")  # the built-in kinds (more: register_projection)
SCHEDULES = PROJECTIONS + ("hybrid",)
SHARING_MODES = ("none", "headwise", "kv", "layerwise")
PROJECTION_INITS = ("normal", "pooling")
POSITION_INITS = ("normal", "sinusoidal")
LOCAL_MIXERS = ("none", "embed", "layers")
OUTPUT_BIAS_INITS = ("zero", "unigram")
NORM_STYLES = ("pre", "post")

# The range of every numeric option. Integers: (low, high), inclusive. The upper bounds of sizes
# are sanity caps far above any model this code trains: a typo such as vocab_size=2**34 is
# refused here instead of failing inside an allocation.
_MAX_SIZE = 2**24
_INT_RANGES = {
    "vocab_size": (1, _MAX_SIZE),
    "max_seq_len": (1, _MAX_SIZE),
    "hidden_size": (1, 2**16),
    "num_layers": (1, 2**12),
    "num_heads": (1, 2**12),
    "intermediate_size": (1, 2**18),
    "k": (1, _MAX_SIZE),
    "hybrid_linear_layers": (0, 2**12),
    "pad_token_id": (0, _MAX_SIZE),
    "num_labels": (1, _MAX_SIZE),
    "format_version": (1, MODEL_FORMAT_VERSION),
    "local_mixer_kernel": (1, 2**10 + 1),
}
# Floats: (test, the range as the message states it); nan fails every test.
_FLOAT_RANGES = {
    "dropout": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "attention_dropout": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "classifier_dropout": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "layer_norm_eps": (lambda v: 0 < v < math.inf, "> 0"),
    "initializer_range": (lambda v: 0 < v < math.inf, "> 0"),
    "projection_init_std": (lambda v: 0 < v < math.inf, "> 0"),
}


def _range_problem(name: str, value: Any) -> Optional[str]:
    """Why option ``name`` = ``value`` is outside its range (None: inside, or unset)."""
    if value is None:
        return None
    if name in _INT_RANGES:
        lo, hi = _INT_RANGES[name]
        if isinstance(value, bool) or not isinstance(value, int):
            return f"must be an integer, got {value!r}"
        if not lo <= value <= hi:
            return f"must be {'>=' if value < lo else '<='} {lo if value < lo else hi}, got {value}"
        return None
    test, text = _FLOAT_RANGES[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"must be a number {text}, got {value!r}"
    return None if test(value) else f"must be {text}, got {value}"


class ModelConfigError(ValueError):
    """A model option is invalid; the message names the field."""


def _bad(name: str, msg: str) -> None:
    raise ModelConfigError(f"model.{name}: {msg}")


@dataclass
class ModelConfig:
    """Every model option in one place. Sizes follow BERT-base by default."""

    vocab_size: int = 16000
    max_seq_len: int = 4096  # N_max: positions and the width of E/F
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    intermediate_size: int = 3072
    dropout: float = 0.1  # hidden dropout (embeddings, residual branches)
    attention_dropout: float = 0.1
    layer_norm_eps: float = 1e-5
    norm: str = "pre"  # "pre" (pre-LN) or "post" (post-LN, original BERT)
    # Attention schedule: "linear", "conv", "dense" for every layer, or "hybrid": linear in the
    # first `hybrid_linear_layers` layers and conv in the rest (Conv-Linformer hybrid).
    projection: str = "linear"
    hybrid_linear_layers: Optional[int] = None  # default: half of the layers (rounded up)
    layer_projections: Optional[List[str]] = None  # explicit per-layer schedule, overrides above
    k: int = 256  # projected length for linear layers; conv stride = max_seq_len // k
    layer_k: Optional[List[int]] = None  # per-layer k, overrides `k`
    sharing: str = "layerwise"
    freeze_projection: bool = False  # keep E/F (or conv kernels) fixed at their init
    projection_init_std: Optional[float] = None  # default 1/sqrt(max_seq_len) ("normal" init)
    # E/F and conv kernels at init: "normal" (random, std projection_init_std) or "pooling"
    # (summary j = the mean of the j-th window of N/k positions; conv = mean over each block)
    projection_init: str = "normal"
    # The learned position table at init: "normal" (N(0, initializer_range), BERT) or
    # "sinusoidal" (Vaswani et al.'s sin/cos table scaled to RMS initializer_range: every offset
    # is one linear map away, so attention to neighbours is learned early; still trained)
    position_init: str = "normal"
    # The MLM decoder's bias at init: "zero", or "unigram": the log of the train split's token
    # frequencies (add-one smoothed; set by the trainer from the data at a fresh start), so
    # training starts at the context-free level instead of spending its first steps reaching it
    output_bias_init: str = "zero"
    # A local token mixer: each token adds a learned per-channel weighting of its neighbours
    # within +-(local_mixer_kernel // 2) positions of its own document (a depthwise convolution
    # over the sequence that never crosses a document boundary or reads padding): "none";
    # "embed": once, on the embeddings; "layers": a pre-LN sub-layer before every attention.
    local_mixer: str = "none"
    local_mixer_kernel: int = 3
    initializer_range: float = 0.02
    pad_token_id: int = 0
    num_labels: int = 2
    classifier_dropout: Optional[float] = None  # default: `dropout`
    tie_word_embeddings: bool = True
    format_version: int = MODEL_FORMAT_VERSION
    extra: dict = field(default_factory=dict)  # free-form metadata, ignored by the model

    def __post_init__(self) -> None:
        self.validate()

    # ----------------------------------------------------------------------------- schedule
    def projection_schedule(self) -> List[str]:
        """The attention type of every layer."""
        if self.layer_projections is not None:
            return list(self.layer_projections)
        if self.projection == "hybrid":
            n_lin = self.num_hybrid_linear_layers()
            return ["linear"] * n_lin + ["conv"] * (self.num_layers - n_lin)
        return [self.projection] * self.num_layers

    def num_hybrid_linear_layers(self) -> int:
        if self.hybrid_linear_layers is None:
            return (self.num_layers + 1) // 2
        return int(self.hybrid_linear_layers)

    def k_for_layer(self, layer_idx: int) -> int:
        return int(self.layer_k[layer_idx]) if self.layer_k is not None else int(self.k)

    def conv_stride(self, layer_idx: int) -> int:
        return self.max_seq_len // self.k_for_layer(layer_idx)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def validate(self) -> None:
        """Every model option checked here (the job config calls this too): the first problem
        raises a :class:`ModelConfigError` naming ``model.<field>``."""
        for name in (*_INT_RANGES, *_FLOAT_RANGES):
            problem = _range_problem(name, getattr(self, name))
            if problem:
                _bad(name, problem)
        if self.hidden_size % self.num_heads:
            _bad(
                "hidden_size", f"{self.hidden_size} is not divisible by num_heads={self.num_heads}"
            )
        for name, choices in (("norm", NORM_STYLES), ("sharing", SHARING_MODES),
                              ("projection", projection_names() + ("hybrid",)),
                              ("projection_init", PROJECTION_INITS),
                              ("position_init", POSITION_INITS),
                              ("output_bias_init", OUTPUT_BIAS_INITS),
                              ("local_mixer", LOCAL_MIXERS)):  # fmt: skip
            if getattr(self, name) not in choices:
                _bad(name, f"must be one of {choices}, got {getattr(self, name)!r}")
        if not 0 <= self.pad_token_id < self.vocab_size:
            _bad(
                "pad_token_id",
                f"{self.pad_token_id} is outside the vocabulary [0, {self.vocab_size})",
            )
        if self.local_mixer_kernel % 2 == 0:
            _bad(
                "local_mixer_kernel",
                f"must be odd (centred on the token), got {self.local_mixer_kernel}",
            )
        self._validate_schedule()
        self._validate_k()

    def _validate_schedule(self) -> None:
        """The per-layer schedule: hybrid split, explicit ``layer_projections``, ``layer_k``."""
        if (
            self.projection == "hybrid"
            and not 0 <= self.num_hybrid_linear_layers() <= self.num_layers
        ):
            _bad(
                "hybrid_linear_layers",
                f"must be in [0, num_layers={self.num_layers}], got {self.hybrid_linear_layers}",
            )
        if self.layer_projections is not None:
            if len(self.layer_projections) != self.num_layers:
                _bad(
                    "layer_projections",
                    f"has {len(self.layer_projections)} entries, num_layers={self.num_layers}",
                )
            for i, p in enumerate(self.layer_projections):
                if p not in projection_names():
                    _bad(
                        f"layer_projections[{i}]",
                        f"must be one of {projection_names()}, got {p!r}",
                    )
        if self.layer_k is not None:
            if len(self.layer_k) != self.num_layers:
                _bad("layer_k", f"has {len(self.layer_k)} entries, num_layers={self.num_layers}")
            for i, k in enumerate(self.layer_k):
                if isinstance(k, bool) or not isinstance(k, int):
                    _bad(f"layer_k[{i}]", f"must be an integer, got {k!r}")

    def _validate_k(self) -> None:
        """Each projected layer's k: in [1, max_seq_len], the kind's own check (conv: k divides
        N), one k per kind under layerwise sharing."""
        kname = "layer_k" if self.layer_k is not None else "k"
        shared_k: dict = {}
        for i, p in enumerate(self.projection_schedule()):
            if p == "dense":
                continue
            k = self.k_for_layer(i)
            where = f"{kname}[{i}]" if self.layer_k is not None else "k"
            if not 1 <= k <= self.max_seq_len:
                _bad(where, f"k={k} must be in [1, max_seq_len={self.max_seq_len}]")
            kind = get_projection(p)
            problem = kind.check(self, i) if kind.check is not None else None
            if problem:
                _bad(where, problem)
            if self.sharing == "layerwise" and shared_k.setdefault(p, k) != k:
                _bad(
                    kname,
                    f"sharing='layerwise' needs one k for all {p} layers, got {shared_k[p]} and {k}",
                )

    # ---------------------------------------------------------------------------- (de)serialise
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ModelConfigError(f"model: unknown option(s) {unknown}")
        d = dict(d)
        for key in ("layer_projections", "layer_k"):
            if d.get(key) is not None:
                d[key] = list(d[key])
        return cls(**d)

    # -------------------------------------------------------------------------------- counting
    def num_projection_parameters(self) -> int:
        """Parameters in E/F (or conv kernels), by the sharing-mode formulas in README."""
        h = self.num_heads
        total = 0
        seen_layerwise: set = set()
        for i, p in enumerate(self.projection_schedule()):
            if p == "dense":
                continue
            one = get_projection(p).parameters_of(self, i)  # one module shared by all heads
            if self.sharing == "layerwise":
                if p not in seen_layerwise:
                    seen_layerwise.add(p)
                    total += one
            elif self.sharing == "kv":
                total += one
            elif self.sharing == "headwise":
                total += 2 * one
            else:  # none
                total += 2 * h * one
        return total


# ============================================================================ document isolation
class DocumentSpan(NamedTuple):
    """One document's tokens in a ``[B, n]`` batch (this rank's slice under sequence parallelism):
    ``row``, ``[start, end)``, ``column``: the document position (E/F column) of ``start``,
    ``padded``: some of its tokens are masked, ``shared``: the index of its sum over the
    sequence-parallel group (-1: the document lies in this slice only)."""

    row: int
    start: int
    end: int
    column: int = 0
    padded: bool = False
    shared: int = -1


class Documents(NamedTuple):
    """The documents of a packed batch (:func:`document_spans`): spans in row-major order that
    cover every token once. ``whole_rows``: every row (all slices together) is one document, so
    the plain path computes exactly the same thing. ``block_mask [B, 1, N, N]`` (sequence
    parallel dense layers only): token i may attend to key j (same document, j not padding).
    ``per_span``: linear and conv layers run one product and one attention per span on views
    of the row (exactly the work of each document alone: the CPU choice); False: batched over
    :class:`DocumentChunks` (a few large ops, plus the chunks' padding and gathers)."""

    spans: List[DocumentSpan]
    num_shared: int = 0
    whole_rows: bool = False
    block_mask: Optional[torch.Tensor] = None
    plans: Optional[dict] = None  # chunk plans by size (document_chunks), built once per batch
    per_span: bool = False

    def split(self, t: torch.Tensor) -> tuple:
        """``t [B, n, ...]`` -> each span's ``[L_i, ...]`` (views; the backward is one cat, where
        slicing would zero-fill a whole ``[B, n, ...]`` gradient per span)."""
        flat = t.reshape((t.shape[0] * t.shape[1],) + tuple(t.shape[2:]))
        return flat.split([s.end - s.start for s in self.spans])

    def chunks(self, size: int, tokens: int, device: torch.device) -> "DocumentChunks":
        """:func:`document_chunks` of these spans (``tokens`` = B * n), cached per size."""
        plans = self.plans if self.plans is not None else {}
        if size not in plans:
            plans[size] = document_chunks(self.spans, size, tokens, device)
        return plans[size]


class DocumentChunks(NamedTuple):
    """The documents cut into chunks of ``size`` document positions (chunk j of a document holds
    its positions ``[j size, (j+1) size)``), so that per-document work runs as a few batched
    ops: ``tokens [C, size]`` the flat index (into ``B * n`` tokens) of each slot, ``B * n``
    for an empty slot; ``span [C]`` each chunk's span; ``block [C]`` its j; ``slot [B * n]``
    each token's place ``chunk * size + offset``; ``key_index [S, J]`` span i's chunk j (``C``:
    none), J the most chunks of one span."""

    size: int
    tokens: torch.Tensor
    span: torch.Tensor
    block: torch.Tensor
    slot: torch.Tensor
    key_index: torch.Tensor


def document_chunks(
    spans: List[DocumentSpan], size: int, tokens: int, device: torch.device
) -> DocumentChunks:
    """The :class:`DocumentChunks` of ``spans`` (covering ``tokens`` flat tokens in order),
    computed on the host and copied to ``device`` once."""
    num = len(spans)
    lens = torch.tensor([s.end - s.start for s in spans], dtype=torch.long)
    cols = torch.tensor([s.column for s in spans], dtype=torch.long)
    first = cols // size
    count = (cols + lens - 1) // size - first + 1  # chunks of each span
    base = torch.cumsum(count, 0) - count
    total = int(count.sum())
    tok_span = torch.repeat_interleave(torch.arange(num), lens)  # spans cover tokens in order
    flat_start = torch.cumsum(lens, 0) - lens
    pos = cols[tok_span] + torch.arange(tokens) - flat_start[tok_span]  # document position
    chunk = base[tok_span] + pos // size - first[tok_span]
    slot = chunk * size + pos % size
    index = torch.full((total * size,), tokens, dtype=torch.long)
    index[slot] = torch.arange(tokens)
    chunk_span = torch.repeat_interleave(torch.arange(num), count)
    within = torch.arange(total) - base[chunk_span]
    width = int(count.max())
    key_index = torch.full((num * width,), total, dtype=torch.long)
    key_index[chunk_span * width + within] = torch.arange(total)
    def put(t: torch.Tensor) -> torch.Tensor:  # pinned + non_blocking: no wait for the queue
        if device.type == "cuda":
            return t.pin_memory().to(device, non_blocking=True)
        return t.to(device)

    return DocumentChunks(
        size,
        put(index.view(total, size)),
        put(chunk_span),
        put(first[chunk_span] + within),
        put(slot),
        put(key_index.view(num, width)),
    )


def document_starts(
    position_ids: torch.Tensor, attention_mask: Optional[torch.Tensor]
) -> torch.Tensor:
    """``[B, N]`` bool: where a document starts (each row start, every unmasked position 0).
    Masked positions never start one (padding joins the document before it)."""
    starts = position_ids == 0
    if attention_mask is not None:
        starts &= attention_mask.bool()
    starts[:, 0] = True
    return starts


def document_spans(
    position_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    offset: int = 0,
    n_local: Optional[int] = None,
    max_position: Optional[int] = None,
) -> Documents:
    """The documents of ``position_ids [B, N]`` (a new one at every row start and every unmasked
    position 0), read to the host once. With ``n_local`` (sequence parallel) the inputs are the
    whole rows and the spans are those of the slice ``[offset, offset + n_local)``: a document
    in more than one slice gets a ``shared`` index (the same on every rank). ``max_position``:
    ids must lie in ``[0, max_position)`` (ValueError otherwise)."""
    b, n = position_ids.shape
    starts = document_starts(position_ids, attention_mask)
    rows = [starts]
    rows.append(~attention_mask.bool() if attention_mask is not None else torch.zeros_like(starts))
    if max_position is not None:
        rows.append((position_ids < 0) | (position_ids >= max_position))
    host = torch.stack(rows).cpu()  # the one device -> host read
    if max_position is not None and bool(host[2].any()):
        raise ValueError(f"position_ids must lie in [0, max_seq_len={max_position})")
    n_local = n if n_local is None else n_local
    lo, hi = offset, offset + n_local
    spans: List[DocumentSpan] = []
    num_shared, whole = 0, True
    pad = host[1]
    for r in range(b):
        bounds = torch.nonzero(host[0, r]).reshape(-1).tolist() + [n]
        whole = whole and len(bounds) == 2
        for s, e in zip(bounds[:-1], bounds[1:]):
            crosses = s // n_local != (e - 1) // n_local
            shared = -1
            if crosses:
                shared, num_shared = num_shared, num_shared + 1
            ls, le = max(s, lo), min(e, hi)
            if ls < le:
                padded = bool(pad[r, ls:le].any())
                spans.append(DocumentSpan(r, ls - lo, le - lo, ls - s, padded, shared))
    return Documents(spans, num_shared, whole, None, {})


def document_block_mask(
    position_ids: torch.Tensor, attention_mask: Optional[torch.Tensor]
) -> torch.Tensor:
    """``[B, 1, N, N]`` bool: query i may attend to key j (same document, j not padding; a row
    with no allowed key may attend everywhere, its output is ignored)."""
    doc = document_starts(position_ids, attention_mask).cumsum(dim=1)
    allowed = doc[:, :, None] == doc[:, None, :]
    if attention_mask is not None:
        allowed &= attention_mask.bool()[:, None, :]
    return _nonempty(allowed)[:, None]


# ==================================================================================== projections
def tracing() -> bool:
    """True while ``torch.export`` / ``torch.onnx.export`` (dynamo) or ``torch.jit.trace`` records
    the model: shape-generic code (no per-row loops, no branches on sizes or values) replaces the
    eager fast paths, with the same math."""
    return torch.compiler.is_exporting() or torch.jit.is_tracing()


class LinearProjection(nn.Module):
    """Learned projection along the sequence axis: ``[B, n, h, d] -> [B, k, h, d]``.

    ``weight`` is ``[H, k, N_max]`` with ``H = 1`` (shared by all heads) or ``H = num_heads``.
    Inputs shorter than ``N_max`` use the first ``n`` columns (fairseq's slicing).
    Sequence parallel (``sequence_parallel`` set): the rank's slice uses the columns at its
    global offset and the partial products are summed over the group (``E K = sum_r E_r K_r``).
    Sharded (``shard_sequence_parameters``): ``weight`` holds only the columns from
    ``shard_start`` on (``[H, k, N_max / P]``), the ones this rank's slice uses.
    """

    sequence_parallel: Any = None  # set by linformer_ds.parallelize.apply_sequence_parallel
    shard_start = 0  # global column of weight[..., 0] (sequence_parallel.shard_sequence_parameters)
    sequence_dim = 2  # weight's dim indexed by sequence position (sharded under SP)
    projection_kind = "linear"  # its registered kind (_make_projection sets it on every module)

    def __init__(
        self, k: int, max_seq_len: int, heads: int, init_std: float, frozen: bool,
        init: str = "normal",
    ):  # fmt: skip
        super().__init__()
        self.k, self.max_seq_len, self.heads = k, max_seq_len, heads
        self.init_std, self.init = init_std, init
        self.weight = nn.Parameter(torch.empty(heads, k, max_seq_len), requires_grad=not frozen)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``normal``: N(0, init_std). ``pooling``: row j averages the positions
        ``n`` with ``floor(n k / N_max) = j`` (the same for every head; sharded: own columns)."""
        if self.init != "pooling":
            nn.init.normal_(self.weight, std=self.init_std)
            return
        width = self.weight.shape[-1]
        # on the CPU even under torch.device("meta") (export's shape check, transformers'
        # meta init): bincount has no meta kernel; copy_ into a meta weight is a no-op
        cpu = torch.device("cpu")
        slot = torch.arange(self.max_seq_len, device=cpu) * self.k // self.max_seq_len  # [N_max]
        count = torch.bincount(slot, minlength=self.k).clamp(min=1)  # [k] positions per row
        cols = slot[self.shard_start : self.shard_start + width]
        w = (cols[None, :] == torch.arange(self.k, device=cpu)[:, None]) / count[:, None]
        with torch.no_grad():
            self.weight.copy_(w.to(self.weight.dtype).expand_as(self.weight))

    def forward(self, x: torch.Tensor, documents: Optional[Documents] = None) -> torch.Tensor:
        """``[B, n, h, d] -> [B, k, h, d]``; with ``documents``: each span's own summaries
        ``[S, k, h, d]`` (E's columns from the span's document position on; a document split
        over sequence-parallel ranks gets the sum of its parts)."""
        if documents is not None:
            return self._project_documents(x, documents)
        b, n, h, d = x.shape
        sp = self.sequence_parallel
        off = 0 if sp is None else sp.offset(n) - self.shard_start  # column in the local weight
        width = self.weight.shape[-1]
        if not 0 <= off <= width - n:
            raise ValueError(
                f"sequence-parallel slice [{off + self.shard_start}, "
                f"{off + self.shard_start + n}) is outside the E/F columns this rank holds "
                f"[{self.shard_start}, {self.shard_start + width}): sharded E/F need N = max_seq_len"
            )
        if tracing():  # any batch and length: one batched product, E sliced whatever n is
            cols = torch.arange(off, off + n, device=x.device)  # a slice would guard n != N
            w = self.weight.index_select(2, cols)
            if self.heads == 1:  # bmm: matmul and einsum would guard on n == 1 or B == 1
                e = w.expand(b, self.k, n)
                y = torch.bmm(e, x.reshape(b, n, h * d)).view(b, self.k, h, d)
            else:  # one bmm per head (a static count): reshaping x would guard on B == 1
                e = [w[i].expand(b, self.k, n) for i in range(h)]
                y = torch.stack([torch.bmm(e[i], x[:, :, i]) for i in range(h)], dim=2)
            return y if sp is None else sp.reduce_projection(y)
        # Plain views where possible: the backward of slicing/indexing zero-fills a gradient.
        w = self.weight if n == width else self.weight[:, :, off : off + n]
        if self.heads == 1:  # one GEMM over all heads: [k, n] @ [B, n, h*d]
            # One mm per row, not matmul or bmm: matmul runs [k, n] @ [B, n, D] as
            # (x^T E^T)^T, whose input gradient comes out transposed and makes the stack/cat
            # that joins the k, v and q gradients (unbind/split backward) some 10x slower; bmm
            # copies the transposed strided input for E's gradient. mm takes each row as the
            # strided slice of qkv it is and returns contiguous gradients.
            e = w.squeeze(0)
            ys = [torch.mm(e, xi) for xi in x.reshape(b, n, h * d).unbind(0)]
            y = (ys[0][None] if b == 1 else torch.stack(ys)).view(b, self.k, h, d)
        else:
            y = torch.einsum("hkn,bnhd->bkhd", w, x)
        return y if sp is None else sp.reduce_projection(y)

    def _project_documents(self, x: torch.Tensor, documents: Documents) -> torch.Tensor:
        """``x [B, n, h, d]`` -> ``[S, k, h, d]``: span i's tokens times E's columns
        ``[column, column + length)`` (the slicing a lone document of that length uses), as one
        batched product over chunks of k positions (:class:`DocumentChunks`) summed per span."""
        b, n, h, d = x.shape
        if self.shard_start or self.weight.shape[-1] != self.max_seq_len:
            raise ValueError("document isolation needs the whole E/F (not sharded)")
        sp = self.sequence_parallel
        if documents.per_span:  # span i: E[:, col : col + L] @ x[row, start:end], both views
            ys = []
            for s, xi in zip(documents.spans, documents.split(x)):  # xi [L, h, d]
                w = self.weight[:, :, s.column : s.column + s.end - s.start]
                if self.heads == 1:
                    ys.append(torch.mm(w[0], xi.reshape(-1, h * d)))
                else:
                    ys.append(torch.einsum("hkn,nhd->khd", w, xi))
            y = torch.stack(ys).view(len(ys), self.k, h, d)
            return y if sp is None else sp.reduce_documents(y, documents)
        plan = documents.chunks(self.k, b * n, x.device)
        c, num = plan.size, len(documents.spans)
        flat = torch.cat([x.reshape(b * n, h * d), x.new_zeros(1, h * d)])  # + an empty slot
        xc = flat.index_select(0, plan.tokens.reshape(-1)).view(-1, c, h * d)  # [C, c, hd]
        w = self.weight
        if w.shape[-1] % c:
            w = F.pad(w, (0, c - w.shape[-1] % c))
        wc = w.view(self.heads, self.k, -1, c).index_select(2, plan.block)  # [H, k, C, c]
        if self.heads == 1:
            y = torch.bmm(wc[0].transpose(0, 1), xc).view(-1, self.k, h, d)  # [C, k, h, d]
        else:
            y = torch.einsum("hkjc,jchd->jkhd", wc, xc.view(-1, c, h, d))
        y = y.new_zeros((num,) + tuple(y.shape[1:])).index_add(0, plan.span, y)
        return y if sp is None else sp.reduce_documents(y, documents)

    def extra_repr(self) -> str:
        return f"heads={self.heads}, k={self.k}, max_seq_len={self.max_seq_len}"


class ConvProjection(nn.Module):
    """Strided 1-D convolution over the sequence (Conv-Linformer): ``[B, n, h, d] -> [B, c, h, d]``.

    kernel = stride = ``r``; ``c = ceil(n / r)`` (the input is zero-padded to a multiple of r).
    ``weight`` is ``[H, d_out, d_in, r]`` (Conv1d layout per head), ``bias`` is ``[H, d]``;
    ``H = 1`` shares the kernel across heads. Parameters: ``H * (d*d*r + d)``.
    Sequence parallel: the rank's slice (a multiple of r) gives its own blocks, all-gathered.
    """

    sequence_parallel: Any = None  # set by linformer_ds.parallelize.apply_sequence_parallel
    sequence_dim = None  # the kernels are the same for every block: nothing sequence-shaped
    projection_kind = "conv"

    def __init__(self, stride: int, head_dim: int, heads: int, frozen: bool, init: str = "normal"):
        super().__init__()
        self.stride, self.heads, self.head_dim, self.init = stride, heads, head_dim, init
        self.weight = nn.Parameter(
            torch.empty(heads, head_dim, head_dim, stride), requires_grad=not frozen
        )
        self.bias = nn.Parameter(torch.zeros(heads, head_dim), requires_grad=not frozen)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``normal``: N(0, 1/sqrt(r d)); ``pooling``: the block mean (identity / r per tap)."""
        if self.init == "pooling":
            eye = torch.eye(self.head_dim, dtype=self.weight.dtype) / self.stride  # [d_out, d_in]
            with torch.no_grad():
                self.weight.copy_(eye[None, :, :, None].expand_as(self.weight))
        else:
            nn.init.normal_(self.weight, std=1.0 / math.sqrt(self.stride * self.head_dim))
        nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor, documents: Optional[Documents] = None) -> torch.Tensor:
        """``[B, n, h, d] -> [B, c, h, d]``; with ``documents``: every span's blocks, windows
        starting at its own start (its tail zero-padded), concatenated: ``[sum c_i, h, d]``."""
        if documents is not None:
            if self.sequence_parallel is not None:
                raise ValueError("conv projection: document isolation under sequence parallelism")
            b, n, h, d = x.shape
            plan = documents.chunks(self.stride, b * n, x.device)  # one chunk = one window
            # one scatter of every token to its window slot (tails stay zero); its backward is
            # a gather, where index_select's would be a scatter-add
            windows = x.new_zeros(plan.tokens.numel(), h * d)
            windows = windows.index_copy(0, plan.slot, x.reshape(b * n, h * d))
            return self._blocks(windows.view(1, -1, h, d))[0]
        b, n, h, d = x.shape
        r = self.stride
        pad = (n + r - 1) // r * r - n  # to c r: no export guards; // of n >= 0 (ONNX truncates)
        sp = self.sequence_parallel
        if sp is not None and pad:
            raise ValueError(f"sequence parallel conv: slice length {n} is not a multiple of {r}")
        if tracing() or pad:  # traced: padded (by 0 when n is a multiple) for any length
            x = F.pad(x, (0, 0, 0, 0, 0, pad))
        y = self._blocks(x)
        return y if sp is None else sp.gather_blocks(y)

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, c r, h, d]`` (a multiple of the stride) -> ``[B, c, h, d]``."""
        b, n, h, d = x.shape
        r = self.stride
        c = n // r
        # One GEMM contracting the whole window (r taps x d inputs = K of r*d) per output block;
        # einsum would contract d only and then sum the r partial products in a second pass.
        x = x.view(b, c, r, h, d).transpose(2, 3)  # [B, c, h, r, d_in]
        if self.heads == 1:
            w = self.weight.squeeze(0).permute(0, 2, 1).reshape(d, r * d)  # [d_out, (r, d_in)]
            y = torch.matmul(x.reshape(b, c, h, r * d), w.t())  # [B, c, h, d_out]
        else:
            w = self.weight.permute(0, 3, 2, 1).reshape(h, r * d, d)  # [h, (r, d_in), d_out]
            if tracing():  # bmm per head: matmul would guard on B == 1 and c == 1
                xh = x.permute(2, 0, 1, 3, 4).reshape(h, b * c, r * d)
                y = torch.bmm(xh, w).view(h, b, c, d).permute(1, 2, 0, 3)
            else:
                y = torch.matmul(x.reshape(b, c, h, 1, r * d), w).view(b, c, h, d)
        return y + self.bias

    def extra_repr(self) -> str:
        return f"heads={self.heads}, head_dim={self.head_dim}, kernel=stride={self.stride}"


# ============================================================================ projection registry
@dataclass(frozen=True)
class ProjectionKind:
    """A kind of key/value projection along the sequence, named in ``model.projection`` /
    ``layer_projections`` (:func:`register_projection`; see docs/extending.md).

    ``factory(config, layer_idx, heads)`` builds one module mapping ``[B, n, heads, d_h]`` ->
    ``[B, m, heads, d_h]`` (``heads`` is 1 when shared by all heads). Optional rules:
    ``stride(config, layer_idx)``: every length N (and sequence-parallel slice) must be a
    multiple of it (``stride_rule`` says how it is derived); ``check(config, layer_idx)``: a
    problem with the layer's options, or None; ``num_parameters(config, layer_idx)`` of one
    ``heads=1`` module (default: counted on the meta device); ``flops(config, layer_idx, n)``:
    forward FLOPs per token of projecting keys and values and attending to the ``m`` summaries
    (default: dense attention's, an upper bound); ``sequence_parallel``: the module reads its
    ``sequence_parallel`` attribute (set by ``parallelize``) and supports P > 1.
    A module class says whether its ``weight`` is indexed by sequence position with a
    ``sequence_dim`` class attribute (E/F: 2; such weights are sharded under sequence
    parallelism and sliced to the first n positions).
    """

    name: str
    factory: Callable[["ModelConfig", int, int], nn.Module]
    stride: Optional[Callable[["ModelConfig", int], int]] = None
    stride_rule: str = ""
    check: Optional[Callable[["ModelConfig", int], Optional[str]]] = None
    num_parameters: Optional[Callable[["ModelConfig", int], int]] = None
    flops: Optional[Callable[["ModelConfig", int, int], float]] = None
    sequence_parallel: bool = False

    def parameters_of(self, config: "ModelConfig", layer_idx: int) -> int:
        """Parameters of one ``heads=1`` module of layer ``layer_idx``."""
        if self.num_parameters is not None:
            return int(self.num_parameters(config, layer_idx))
        with torch.device("meta"):
            module = self.factory(config, layer_idx, 1)
        return sum(p.numel() for p in module.parameters())


_PROJECTION_KINDS: "dict[str, ProjectionKind]" = {}


def register_projection(
    name: str,
    factory: Callable[["ModelConfig", int, int], nn.Module],
    replace: bool = False,
    **rules: Any,
) -> ProjectionKind:
    """Make ``name`` a projection kind (``rules``: the optional fields of
    :class:`ProjectionKind`); a taken name is a ValueError unless ``replace``."""
    if not name.isidentifier() or name in ("dense", "hybrid"):
        raise ValueError(f"projection kind name must be an identifier, not dense/hybrid: {name!r}")
    if name in _PROJECTION_KINDS and not replace:
        raise ValueError(f"projection kind {name!r} is already registered")
    kind = ProjectionKind(name, factory, **rules)
    _PROJECTION_KINDS[name] = kind
    return kind


def unregister_projection(name: str) -> None:
    """Remove a registered projection kind (no error if absent)."""
    _PROJECTION_KINDS.pop(name, None)


def get_projection(name: str) -> ProjectionKind:
    """The registered kind ``name`` (ModelConfigError if there is none)."""
    try:
        return _PROJECTION_KINDS[name]
    except KeyError:
        raise ModelConfigError(
            f"unknown projection kind {name!r} (registered: {sorted(_PROJECTION_KINDS)})"
        ) from None


def projection_names() -> tuple:
    """Every per-layer attention kind: the registered projections, then ``dense``."""
    return tuple(_PROJECTION_KINDS) + ("dense",)


def projection_stride(config: ModelConfig, layer_idx: int) -> Optional[int]:
    """The stride every N (and sequence-parallel slice) must be a multiple of at layer
    ``layer_idx`` (conv: max_seq_len / k), or None (dense, linear: any N)."""
    kind = config.projection_schedule()[layer_idx]
    rule = None if kind == "dense" else get_projection(kind).stride
    return None if rule is None else int(rule(config, layer_idx))


def _make_projection(config: ModelConfig, layer_idx: int, kind: str, heads: int) -> nn.Module:
    module = get_projection(kind).factory(config, layer_idx, heads)
    module.projection_kind = kind  # init_weights and parallelize find projections by it
    return module


def _linear(config: ModelConfig, layer_idx: int, heads: int) -> nn.Module:
    std = config.projection_init_std or 1.0 / math.sqrt(config.max_seq_len)
    return LinearProjection(
        config.k_for_layer(layer_idx), config.max_seq_len, heads, std, config.freeze_projection,
        config.projection_init,
    )  # fmt: skip


def _conv(config: ModelConfig, layer_idx: int, heads: int) -> nn.Module:
    return ConvProjection(
        config.conv_stride(layer_idx), config.head_dim, heads, config.freeze_projection,
        config.projection_init,
    )  # fmt: skip


def _conv_check(config: ModelConfig, i: int) -> Optional[str]:
    k = config.k_for_layer(i)
    if config.max_seq_len % k:
        return (
            f"conv layer {i}: k={k} does not divide max_seq_len={config.max_seq_len} "
            "(conv kernel = stride = max_seq_len / k)"
        )
    return None


def _linear_flops(config: ModelConfig, i: int, n: int) -> float:
    k, dm = config.k_for_layer(i), config.hidden_size  # k rows even when n < k: E[:, :n] is [k, n]
    return 2 * 2 * k * dm + 2 * 2 * k * dm  # E K and F V; scores and weighted sum over k


def _conv_flops(config: ModelConfig, i: int, n: int) -> float:
    # conv: per head a d_h x d_h kernel per tap; a token is one tap of one block, so it costs
    # d_h^2 multiply-adds per head, D * d_h over all heads (for K and for V)
    dm, c = config.hidden_size, math.ceil(n / config.conv_stride(i))
    return 2 * 2 * config.head_dim * dm + 2 * 2 * c * dm


register_projection(
    "linear", _linear, flops=_linear_flops, sequence_parallel=True,
    num_parameters=lambda c, i: c.k_for_layer(i) * c.max_seq_len,
)  # fmt: skip
register_projection(
    "conv", _conv, stride=lambda c, i: c.conv_stride(i), stride_rule="max_seq_len / k",
    check=_conv_check, flops=_conv_flops, sequence_parallel=True,
    num_parameters=lambda c, i: c.head_dim**2 * c.conv_stride(i) + c.head_dim,
)  # fmt: skip


# ===================================================================================== attention
def _nonempty(mask: torch.Tensor) -> torch.Tensor:
    """Let fully padded rows attend everywhere (their output is ignored) instead of giving NaN."""
    return mask | ~mask.any(dim=-1, keepdim=True)


class LinformerSelfAttention(nn.Module):
    """Multi-head self-attention with linear, conv or dense key/value handling.

    ``forward(x [B, n, D], attention_mask [B, n] or None, shared_projection) -> [B, n, D]``.
    Under ``sharing='layerwise'`` the projection is owned by the encoder and passed in as a
    module; it is always called (never read), so ZeRO-3 gathers its parameters.
    Sequence parallel: ``x`` is the rank's slice; the projections exchange their summaries,
    conv block masks and dense masks are gathered, dense layers run DeepSpeed-Ulysses.
    """

    sequence_parallel: Any = None  # set by linformer_ds.parallelize.apply_sequence_parallel

    def __init__(self, config: ModelConfig, layer_idx: int = 0):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.kind = config.projection_schedule()[layer_idx]
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.hidden_size = config.hidden_size
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.out = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout_p = config.attention_dropout
        self.proj_k: Optional[nn.Module] = None
        self.proj_v: Optional[nn.Module] = None
        if self.kind != "dense" and config.sharing != "layerwise":
            heads = config.num_heads if config.sharing == "none" else 1
            self.proj_k = _make_projection(config, layer_idx, self.kind, heads)
            if config.sharing in ("none", "headwise"):
                self.proj_v = _make_projection(config, layer_idx, self.kind, heads)

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        shared_projection: Optional[nn.Module] = None,
        documents: Optional[Documents] = None,
    ) -> torch.Tensor:
        """``documents`` (:func:`document_spans`): each token attends only within its own
        document (its own summaries, conv blocks or tokens); None: the whole row."""
        b, n, _ = x.shape
        h, d = self.num_heads, self.head_dim
        qkv = self.qkv(x)  # [B, n, 3D]
        dropout_p = self.dropout_p if self.training else 0.0
        mask = attention_mask.bool() if attention_mask is not None else None
        if documents is not None and not documents.whole_rows:
            return self._isolated(qkv, mask, shared_projection, documents, dropout_p)

        # unbind/split rather than slicing: their backward writes the three gradients into one
        # [B, n, 3D] tensor (a stack/cat) instead of zero-filling and summing three of them.
        sp = self.sequence_parallel
        if self.kind == "dense" and sp is not None:  # Ulysses: q, k, v [B, n, h, d] slices
            q, k, v = qkv.view(b, n, 3, h, d).unbind(2)
            full = sp.gather_mask(mask) if mask is not None else None
            attn_mask = _nonempty(full)[:, None, None, :] if full is not None else None
            y = sp.dense_attention(q, k, v, attn_mask, dropout_p)  # [B, n, h, d]
            return self.out(y.reshape(b, n, self.hidden_size))
        if self.kind == "dense":
            q, k, v = (t.transpose(1, 2) for t in qkv.view(b, n, 3, h, d).unbind(2))
            attn_mask = _nonempty(mask)[:, None, None, :] if mask is not None else None
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)
            return self.out(y.transpose(1, 2).reshape(b, n, self.hidden_size))

        q, kv = qkv.split([self.hidden_size, 2 * self.hidden_size], dim=-1)
        q = q.view(b, n, h, d).transpose(1, 2)  # [B, h, n, d] (a strided view, no copy)
        kv = kv.view(b, n, 2 * h, d)  # keys then values of each token, still a view of qkv
        if mask is not None:  # padded positions contribute nothing to the projected keys/values
            kv = kv * mask[:, :, None, None].to(kv.dtype)
        proj_k = self.proj_k
        if proj_k is None:
            if shared_projection is None:
                raise ValueError(
                    f"layer {self.layer_idx}: sharing='layerwise' needs the encoder's shared "
                    "projection passed as `shared_projection`"
                )
            proj_k = shared_projection
        if self.proj_v is None:  # E = F: one GEMM projects keys and values together
            kp, vp = proj_k(kv).view(b, -1, 2, h, d).unbind(2)
        else:
            k_in, v_in = kv.view(b, n, 2, h, d).unbind(2)
            kp, vp = proj_k(k_in), self.proj_v(v_in)
        attn_mask = None
        if self.kind == "conv" and mask is not None:  # blocks made only of padding are ignored
            r = proj_k.stride
            pad = (n + r - 1) // r * r - n  # as ConvProjection pads
            blocks = F.pad(mask, (0, pad)).view(b, -1, r).any(dim=-1)
            if sp is not None:  # the rank's blocks -> every block of the sequence
                blocks = sp.gather_mask(blocks)
            attn_mask = _nonempty(blocks)[:, None, None, :]
        y = F.scaled_dot_product_attention(
            q, kp.transpose(1, 2), vp.transpose(1, 2), attn_mask=attn_mask, dropout_p=dropout_p
        )
        return self.out(y.transpose(1, 2).reshape(b, n, self.hidden_size))

    def _projection(self, shared_projection: Optional[nn.Module]) -> nn.Module:
        if self.proj_k is not None:
            return self.proj_k
        if shared_projection is None:
            raise ValueError(
                f"layer {self.layer_idx}: sharing='layerwise' needs the encoder's shared "
                "projection passed as `shared_projection`"
            )
        return shared_projection

    def _isolated(
        self,
        qkv: torch.Tensor,
        mask: Optional[torch.Tensor],
        shared_projection: Optional[nn.Module],
        documents: Documents,
        dropout_p: float,
    ) -> torch.Tensor:
        """Document-isolated attention of ``qkv [B, n, 3D]`` -> ``[B, n, D]``: each document
        against its own keys (dense: one attention per document), summaries (linear) or
        windows (conv); linear and conv run batched over chunks of k document positions
        (:class:`DocumentChunks`), the work of each document alone plus the chunks' padding."""
        b, n, _ = qkv.shape
        h, d = self.num_heads, self.head_dim
        spans, sp = documents.spans, self.sequence_parallel
        sdpa = F.scaled_dot_product_attention
        ys = []
        if self.kind == "dense":
            q, k, v = qkv.view(b, n, 3, h, d).unbind(2)  # [B, n, h, d]
            if sp is not None:  # Ulysses over the whole rows, the documents' block mask
                y = sp.dense_attention(q, k, v, documents.block_mask, dropout_p)
                return self.out(y.reshape(b, n, self.hidden_size))
            for s, *qkv_i in zip(spans, *(documents.split(t) for t in (q, k, v))):
                qi, ki, vi = (t.transpose(0, 1)[None] for t in qkv_i)  # [1, h, L, d]
                am = None
                if s.padded and mask is not None:
                    am = _nonempty(mask[s.row, s.start : s.end][None])[:, None, None, :]
                y = sdpa(qi, ki, vi, attn_mask=am, dropout_p=dropout_p)
                ys.append(y[0].transpose(0, 1))  # [L, h, d]
            return self.out(torch.cat(ys).view(b, n, self.hidden_size))

        q, kv = qkv.split([self.hidden_size, 2 * self.hidden_size], dim=-1)
        q = q.view(b, n, h, d).transpose(1, 2)  # [B, h, n, d]
        kv = kv.view(b, n, 2 * h, d)
        if mask is not None:
            kv = kv * mask[:, :, None, None].to(kv.dtype)
        proj_k = self._projection(shared_projection)
        if self.proj_v is None:  # E = F
            kvp = proj_k(kv, documents)  # [S, k, 2h, d] or [C, 2h, d]
            kp, vp = kvp.view(kvp.shape[:-2] + (2, h, d)).unbind(-3)
        else:
            k_in, v_in = kv.view(b, n, 2, h, d).unbind(2)
            kp, vp = proj_k(k_in, documents), self.proj_v(v_in, documents)
        if documents.per_span:  # each span's queries (a view) against its own summaries
            counts = [1] * len(spans)  # summaries rows per span: linear [S, k, h, d]
            if self.kind == "conv":  # [sum c_i, h, d] -> c_i = ceil(L_i / r) windows each
                r = proj_k.stride
                counts = [-(-(s.end - s.start) // r) for s in spans]
            ks, vs = kp.split(counts), vp.split(counts)
            qs = documents.split(q.transpose(1, 2))  # [L_i, h, d] views
            for i, s in enumerate(spans):
                am = None
                if self.kind == "conv" and s.padded and mask is not None:  # padding windows
                    real = F.pad(mask[s.row, s.start : s.end], (0, counts[i] * r - s.end + s.start))
                    am = _nonempty(real.view(1, -1, r).any(-1))[:, None, None, :]
                ki, vi = (t[i].reshape(-1, h, d).transpose(0, 1)[None] for t in (ks, vs))
                qi = qs[i].transpose(0, 1)[None]  # [1, h, L, d]
                y = sdpa(qi, ki, vi, attn_mask=am, dropout_p=dropout_p)
                ys.append(y[0].transpose(0, 1))  # [L, h, d]
            return self.out(torch.cat(ys).view(b, n, self.hidden_size))
        # queries in chunks of k positions of a document, each chunk against its document's
        # summaries (linear: k of them; conv: its windows, padded to the most of one document)
        plan = documents.chunks(self.config.k_for_layer(self.layer_idx), b * n, qkv.device)
        am = None
        if self.kind == "conv":  # [C_w, h, d] windows -> [S, J, h, d], empty ones masked
            win = documents.chunks(proj_k.stride, b * n, qkv.device)
            valid = win.key_index < win.tokens.shape[0]  # [S, J]
            if mask is not None:  # windows made only of padding are ignored
                m = torch.cat([mask.reshape(-1), mask.new_zeros(1)])
                real = m.index_select(0, win.tokens.reshape(-1)).view(win.tokens.shape).any(-1)
                real = torch.cat([real, real.new_zeros(1)])
                valid = real.index_select(0, win.key_index.reshape(-1)).view(valid.shape)
            kp, vp = (
                torch.cat([t, t.new_zeros((1,) + tuple(t.shape[1:]))])
                .index_select(0, win.key_index.reshape(-1))
                .view(win.key_index.shape + (h, d))
                for t in (kp, vp)
            )
            am = _nonempty(valid).index_select(0, plan.span)[:, None, None, :]
        flat = torch.cat([q.transpose(1, 2).reshape(b * n, h * d), q.new_zeros(1, h * d)])
        qc = flat.index_select(0, plan.tokens.reshape(-1)).view(-1, plan.size, h, d)
        kc, vc = (t.index_select(0, plan.span).transpose(1, 2) for t in (kp, vp))
        y = sdpa(qc.transpose(1, 2), kc, vc, attn_mask=am, dropout_p=dropout_p)  # [C, h, c, d]
        y = y.transpose(1, 2).reshape(-1, h * d).index_select(0, plan.slot)  # [B n, D]
        return self.out(y.view(b, n, self.hidden_size))


# ======================================================================================= encoder
class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class LocalMixer(nn.Module):
    """Depthwise mixing of neighbouring tokens: ``y[i] = sum_o w[o] * x[i + o]`` over offsets
    ``o`` in ``[-r, r]`` (``r = kernel // 2``), per channel, where ``x[i + o]`` counts only if it
    lies in the row, in ``i``'s document and is not padding (:func:`local_mixer_valid`)."""

    def __init__(self, hidden_size: int, kernel: int):
        super().__init__()
        self.radius = kernel // 2
        self.weight = nn.Parameter(torch.empty(2 * self.radius + 1, hidden_size))
        self.mixer_init = True  # init_weights: normal(std)

    def forward(self, x: torch.Tensor, mixing: "LocalMixing") -> torch.Tensor:
        """``x [B, n, D]`` -> ``[B, n, D]``, with ``mixing`` from ``LinformerEncoder._mixing``."""
        r, n = self.radius, x.shape[1]
        if mixing.valid.shape[0] != 2 * r + 1:
            raise ValueError(f"mixing is for kernel {mixing.valid.shape[0]}, not {2 * r + 1}")
        # the r rows either side: zeros at the row ends, the neighbours' rows under sequence
        # parallelism (their gradients go back to the ranks that hold them)
        xp = F.pad(x, (0, 0, r, r)) if mixing.halo is None else mixing.halo(x, r)
        valid = mixing.valid.to(x.dtype)
        out = None
        for j in range(2 * r + 1):
            term = xp[:, j : j + n] * valid[j, :, :, None] * self.weight[j].to(x.dtype)
            out = term if out is None else out + term
        return out


class LocalMixing(NamedTuple):
    """What every :class:`LocalMixer` of one forward pass shares: ``valid [2r + 1, B, n]`` bool
    (:func:`local_mixer_valid`, this rank's slice) and ``halo(x, r) -> [B, n + 2r, D]`` (None:
    zero padding; sequence parallel: the neighbouring ranks' rows)."""

    valid: torch.Tensor
    halo: Optional[Callable[[torch.Tensor, int], torch.Tensor]] = None


def local_mixer_valid(
    radius: int,
    n: int,
    batch: int,
    attention_mask: Optional[torch.Tensor],
    position_ids: Optional[torch.Tensor],
    device: torch.device,
) -> torch.Tensor:
    """``[2r + 1, B, n]`` bool: True where token ``i + o`` (``o = j - r``) may feed token ``i``:
    inside the row, not padding, and in the same document (a document starts at each row start
    and at every unmasked position 0 of ``position_ids``)."""
    seg = None
    if position_ids is not None:
        seg = torch.cumsum(document_starts(position_ids, attention_mask).long(), dim=1)
    ok = (
        torch.ones(batch, n, dtype=torch.bool, device=device)
        if attention_mask is None
        else attention_mask.bool()
    )
    out = []
    for j in range(2 * radius + 1):
        o = j - radius
        v = torch.zeros(batch, n, dtype=torch.bool, device=device)
        lo, hi = max(0, -o), min(n, n - o)  # i in [lo, hi) has i + o in [0, n)
        if lo < hi:
            src = ok[:, lo + o : hi + o]
            if seg is not None:
                src = src & (seg[:, lo + o : hi + o] == seg[:, lo:hi])
            v[:, lo:hi] = src
        out.append(v)
    return torch.stack(out)


class EncoderLayer(nn.Module):
    """One transformer block; pre-LN or post-LN per ``config.norm``."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.pre_ln = config.norm == "pre"
        self.attention = LinformerSelfAttention(config, layer_idx)
        self.ffn = FeedForward(config)
        self.ln1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.ln2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.drop = nn.Dropout(config.dropout)
        if config.local_mixer == "layers":
            self.mixer = LocalMixer(config.hidden_size, config.local_mixer_kernel)
            self.ln_mix = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        shared_projection: Optional[nn.Module] = None,
        documents: Optional[Documents] = None,
        mixing: Optional[LocalMixing] = None,
    ) -> torch.Tensor:
        return self.ffn_block(
            self.attention_block(x, attention_mask, shared_projection, documents, mixing)
        )

    def attention_block(
        self,
        x: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        shared_projection: Optional[nn.Module] = None,
        documents: Optional[Documents] = None,
        mixing: Optional[LocalMixing] = None,
    ) -> torch.Tensor:
        """The attention sub-layer with its residual and LayerNorm: ``[B, n, D] -> [B, n, D]``
        (``local_mixer: layers``: the mixing sub-layer first, with its own)."""
        args = (attention_mask, shared_projection) + (() if documents is None else (documents,))
        if hasattr(self, "mixer"):
            if mixing is None:
                raise ValueError("a layer with a local mixer needs `mixing` (local_mixing)")
            if self.pre_ln:
                x = x + self.drop(self.mixer(self.ln_mix(x), mixing))
            else:
                x = self.ln_mix(x + self.drop(self.mixer(x, mixing)))
        if self.pre_ln:
            return x + self.drop(self.attention(self.ln1(x), *args))
        return self.ln1(x + self.drop(self.attention(x, *args)))

    def ffn_block(self, x: torch.Tensor) -> torch.Tensor:
        """The feed-forward sub-layer with its residual and LayerNorm: ``[B, n, D] -> [B, n, D]``."""
        if self.pre_ln:
            return x + self.drop(self.ffn(self.ln2(x)))
        return self.ln2(x + self.drop(self.ffn(x)))


def check_inputs(
    config: ModelConfig,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    check_ids: bool = True,
) -> None:
    """Clear errors for bad model input, before anything deep inside torch can fail.
    ``check_ids=False`` leaves out the token-id range check (two device->host reads on a GPU)
    for callers that checked the ids on the host (the trainer's data pipeline)."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must be an integer tensor, got dtype {input_ids.dtype}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}")
    n = input_ids.shape[1]
    if n > config.max_seq_len:
        raise ValueError(
            f"sequence length {n} exceeds the model's max_seq_len {config.max_seq_len}"
        )
    if n == 0:
        raise ValueError("input_ids has sequence length 0")
    if check_ids and not tracing():  # traced: no value-dependent branch in the graph
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= config.vocab_size:
            bad = hi if hi >= config.vocab_size else lo
            raise ValueError(
                f"input_ids contain token id {bad} outside the vocabulary [0, {config.vocab_size})"
            )
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor):
            raise TypeError("attention_mask must be a torch.Tensor")
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} does not match input_ids "
                f"shape {tuple(input_ids.shape)}"
            )


class LinformerEncoder(nn.Module):
    """Embeddings + ``num_layers`` blocks. ``forward(input_ids [B, n], attention_mask) -> [B, n, D]``.

    Activation checkpointing is applied from outside with ``set_activation_checkpointing``.
    """

    position_shard_start = 0  # global position of the table's row 0 (sharded sequence parallel)
    check_token_ids = True  # False: the caller checked the ids on the host (the trainer does)
    # document isolation: one product and attention per span (True), batched over chunks
    # (False), or None: per span on the CPU (measured faster there), chunks on accelerators
    document_per_span: Optional[bool] = None

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.token_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_seq_len, config.hidden_size)
        # init_weights reads the flag (module-local: any order of initialisation gives the table)
        self.position_embeddings.sinusoidal_init = config.position_init == "sinusoidal"
        self.embed_ln = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.drop = nn.Dropout(config.dropout)
        if config.local_mixer == "embed":
            self.mixer = LocalMixer(config.hidden_size, config.local_mixer_kernel)
        schedule = config.projection_schedule()
        # The single owner of each layerwise-shared projection: one per kind in the schedule,
        # ``shared_<kind>`` (shared_linear, shared_conv), in registry order.
        self.shared_linear: Optional[nn.Module] = None
        self.shared_conv: Optional[nn.Module] = None
        if config.sharing == "layerwise":
            for kind in projection_names():
                if kind != "dense" and kind in schedule:
                    shared = _make_projection(config, schedule.index(kind), kind, 1)
                    setattr(self, f"shared_{kind}", shared)
        self.layers = nn.ModuleList(EncoderLayer(config, i) for i in range(config.num_layers))
        self.final_ln = (
            nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
            if config.norm == "pre"
            else nn.Identity()
        )
        self._checkpoint_fn: Optional[Callable[..., Any]] = None
        self._checkpoint_layers: set = set()
        self._checkpoint_granularity = "layer"

    def set_activation_checkpointing(
        self,
        fn: Optional[Callable[..., Any]],
        layers: Optional[List[int]] = None,
        granularity: str = "layer",
    ) -> None:
        """Wrap layer calls in ``fn(layer, x, mask, shared_projection)`` while training.

        ``fn`` is e.g. ``functools.partial(torch.utils.checkpoint.checkpoint,
        use_reentrant=False)``; ``layers`` selects which layers (default: all). ``None`` turns
        checkpointing off. ``granularity="sublayer"`` checkpoints the attention and the
        feed-forward sub-layers of each selected layer separately (``fn(layer.attention_block,
        x, mask, shared_projection)``, then ``fn(layer.ffn_block, x)``): twice the saved inputs,
        but the backward pass recomputes and holds one sub-layer at a time instead of a layer;
        the embeddings too (``fn(self.embed, input_ids, positions)``: only the ids are kept).
        """
        if granularity not in ("layer", "sublayer"):
            raise ValueError(f"granularity must be layer or sublayer, got {granularity!r}")
        self._checkpoint_fn = fn
        self._checkpoint_layers = set(range(len(self.layers)) if layers is None else layers)
        self._checkpoint_granularity = granularity

    def embed(
        self,
        input_ids: Optional[torch.Tensor],
        positions: torch.Tensor,
        inputs_embeds: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Token (or ``inputs_embeds``) plus position embeddings, LayerNorm, dropout:
        ``[B, n]`` ids and ``[n]`` (or per token ``[B, n]``) rows of the position table
        -> ``[B, n, D]``."""
        tokens = self.token_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        pe = self.position_embeddings(positions)
        return self.drop(self.embed_ln(tokens + (pe if pe.dim() == 3 else pe[None])))

    def _documents(
        self,
        position_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        n: int,
        offset: int,
    ) -> Tuple[Documents, Tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """The document spans of this batch (of this rank's slice, from the whole rows gathered
        over the sequence-parallel group), and the ``(position_ids, mask)`` rows they come from
        (whole rows under sequence parallelism; the local mixer reads them too)."""
        if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or (
            position_ids.shape[1] != n
        ):
            raise ValueError(
                f"position_ids must be a [batch, {n}] tensor, got "
                f"{tuple(getattr(position_ids, 'shape', ()))}"
            )
        if position_ids.dtype.is_floating_point or position_ids.dtype == torch.bool:
            raise TypeError(f"position_ids must be an integer tensor, got {position_ids.dtype}")
        if self.position_shard_start or self.position_embeddings.num_embeddings != (
            self.config.max_seq_len
        ):
            raise ValueError("position_ids need the whole position table (not sharded)")
        sp = getattr(self, "sequence_parallel", None)
        if sp is None:
            docs = document_spans(
                position_ids, attention_mask, max_position=self.config.max_seq_len
            )
            return docs, (position_ids, attention_mask)
        pos, mask = sp.gather_documents(position_ids, attention_mask)  # whole rows [B, N]
        docs = document_spans(pos, mask, offset, n, max_position=self.config.max_seq_len)
        if "dense" in self.config.projection_schedule() and not docs.whole_rows:
            docs = docs._replace(block_mask=document_block_mask(pos, mask))
        return docs, (pos, mask)

    def _mixing(
        self,
        batch: int,
        n: int,
        offset: int,
        attention_mask: Optional[torch.Tensor],
        rows: Optional[Tuple[torch.Tensor, Optional[torch.Tensor]]],
        device: torch.device,
    ) -> LocalMixing:
        """The local mixers' shared inputs for this batch: ``rows`` are the ``(position_ids,
        mask)`` of :meth:`_documents` (None: one document per row). Under sequence parallelism
        the validity of the whole rows (documents and padding cross slices), sliced."""
        r = self.config.local_mixer_kernel // 2
        sp = getattr(self, "sequence_parallel", None)
        if sp is not None and n < r:
            raise ValueError(
                f"local_mixer_kernel {self.config.local_mixer_kernel} reaches {r} positions, "
                f"past the sequence-parallel slice of {n}"
            )
        if rows is not None:
            pos, mask = rows
        elif sp is None or attention_mask is None:
            pos, mask = None, attention_mask
        else:
            pos, mask = None, sp.gather_mask(attention_mask)
        length = n if sp is None else n * sp.world_size
        valid = local_mixer_valid(r, length, batch, mask, pos, device)
        if sp is None:
            return LocalMixing(valid)
        return LocalMixing(valid[:, :, offset : offset + n].contiguous(), sp.halo)

    def _shared_for(self, layer: EncoderLayer) -> Optional[nn.Module]:
        kind = layer.attention.kind
        return None if kind == "dense" else getattr(self, f"shared_{kind}", None)

    def forward(
        self,
        input_ids: Optional[torch.Tensor],
        attention_mask: Optional[torch.Tensor] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        hidden_states: Optional[List[torch.Tensor]] = None,
        position_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``inputs_embeds [B, n, D]`` (checked by the caller) replaces the token lookup of
        ``input_ids``; a ``hidden_states`` list receives ``num_layers + 1`` tensors ``[B, n, D]``:
        the embeddings, the input of every later layer, and the final output (after final_ln).

        ``position_ids [B, n]`` (document isolation in packed rows): each document's positions
        from 0; a document starts at each row start and at every unmasked 0. Every token then
        uses its own position and attends only within its document, exactly as if each
        document ran alone (see :func:`document_spans`); None: positions 0..n-1, one document
        per row. Under sequence parallelism ``position_ids`` is this rank's slice."""
        if inputs_embeds is None:
            check_inputs(self.config, input_ids, attention_mask, self.check_token_ids)
            n, device = input_ids.shape[1], input_ids.device
        elif input_ids is not None:
            raise ValueError("pass input_ids or inputs_embeds, not both")
        else:
            n, device = inputs_embeds.shape[1], inputs_embeds.device
        sp = getattr(self, "sequence_parallel", None)  # set by parallelize.apply_sequence_parallel
        off = 0 if sp is None else sp.offset(n)  # the slice's global position
        if off + n > self.config.max_seq_len:
            raise ValueError(
                f"sequence-parallel slice ends at position {off + n}, past the model's "
                f"max_seq_len {self.config.max_seq_len}"
            )
        # sharded: the table holds rows [position_shard_start, ...) only
        start, rows = self.position_shard_start, self.position_embeddings.num_embeddings
        if start and not start <= off <= off + n <= start + rows:
            raise ValueError(
                f"sequence-parallel slice [{off}, {off + n}) is outside the position rows this "
                f"rank holds [{start}, {start + rows}): sharded positions need N = max_seq_len"
            )
        pos = torch.arange(off - start, off - start + n, device=device)
        documents, rows = None, None
        if position_ids is not None:
            documents, rows = self._documents(position_ids, attention_mask, n, off)
            per_span = self.document_per_span
            documents = documents._replace(
                per_span=device.type == "cpu" if per_span is None else per_span
            )
            pos = position_ids.long()
        checkpointed = self._checkpoint_fn is not None and self.training
        if checkpointed and self._checkpoint_granularity == "sublayer" and inputs_embeds is None:
            # recomputed in backward from the ids: no [B, n, D] kept for embed_ln's backward
            x = self._checkpoint_fn(self.embed, input_ids, pos)
        else:
            x = self.embed(input_ids, pos, inputs_embeds)
        mixing = None
        if self.config.local_mixer != "none":
            mixing = self._mixing(x.shape[0], n, off, attention_mask, rows, device)
            if self.config.local_mixer == "embed":
                x = x + self.mixer(x, mixing)
        for i, layer in enumerate(self.layers):
            if hidden_states is not None:
                hidden_states.append(x)
            args = (attention_mask, self._shared_for(layer))
            if documents is not None or mixing is not None:
                args += (documents, mixing)
            if self._checkpoint_fn is not None and self.training and i in self._checkpoint_layers:
                if self._checkpoint_granularity == "sublayer":
                    x = self._checkpoint_fn(layer.attention_block, x, *args)
                    x = self._checkpoint_fn(layer.ffn_block, x)
                else:
                    x = self._checkpoint_fn(layer, x, *args)
            else:
                x = layer(x, *args)
        x = self.final_ln(x)
        if hidden_states is not None:
            hidden_states.append(x)
        return x


# ========================================================================================= heads
# NamedTuples, not dataclasses: ZeRO-3's module hooks see the tensors inside tuples (and warn
# about, and skip, unknown output types)
class MaskedLMOutput(NamedTuple):
    loss: Optional[torch.Tensor]  # mean cross-entropy over positions with label != -100
    logits: torch.Tensor  # [B, n, V], every position


class LabelledMLMOutput(NamedTuple):
    """Training-time MLM output: only the labelled positions went through the head."""

    loss: torch.Tensor  # sum of cross-entropies / loss_denominator (default: M)
    labelled_logits: torch.Tensor  # [M, V] for the M positions with label != -100, row-major
    labelled_targets: torch.Tensor  # [M] their labels


class SequenceClassifierOutput(NamedTuple):
    loss: Optional[torch.Tensor]
    logits: torch.Tensor  # [B, num_labels]


def init_weights(module: nn.Module, std: float) -> None:
    """The initialisation of every task model (project and Hugging Face classes alike)."""
    with torch.no_grad():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding) and getattr(module, "sinusoidal_init", False):
            module.weight.copy_(sinusoidal_positions(*module.weight.shape) * (std * math.sqrt(2.0)))
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif getattr(module, "mixer_init", False):
            nn.init.normal_(module.weight, std=std)
        elif getattr(module, "projection_kind", None) is not None:  # LinearProjection, ...
            module.reset_parameters()


def sinusoidal_positions(n: int, d: int) -> torch.Tensor:
    """``[n, d]`` fp32 sin/cos table of Vaswani et al. (2017): column ``2i`` is
    ``sin(p / 10000^(2i/d))``, column ``2i+1`` its cosine; RMS over a row 1/sqrt(2)."""
    pos = torch.arange(n, dtype=torch.float64)[:, None]
    freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # [ceil(d/2)]
    table = torch.zeros(n, d, dtype=torch.float64)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq[: d // 2])
    return table.float()


def mlm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits [..., V]`` against ``labels [...]`` (``-100`` ignored)."""
    return F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100
    )


def sequence_classification_loss(
    logits: torch.Tensor, labels: torch.Tensor, problem_type: Optional[str] = None
) -> torch.Tensor:
    """Loss of ``logits [B, C]``: regression (C = 1 or ``problem_type='regression'``),
    multi-label (``'multi_label_classification'``, BCE) or single-label cross-entropy."""
    if logits.shape[-1] == 1 or problem_type == "regression":
        return F.mse_loss(logits.squeeze(-1).float(), labels.float())
    if problem_type == "multi_label_classification":
        return F.binary_cross_entropy_with_logits(logits.float(), labels.float())
    return F.cross_entropy(logits.float(), labels.long())


class LinformerPreTrainedModel(nn.Module):
    """Shared init and utilities of the task models."""

    config: ModelConfig

    def _init_weights(self, module: nn.Module) -> None:
        init_weights(module, self.config.initializer_range)

    def num_parameters(self, exclude_embeddings: bool = False, trainable_only: bool = False) -> int:
        """Unique parameters (a tied or shared tensor counts once)."""
        seen, total = set(), 0
        for name, p in self.named_parameters():
            if id(p) in seen or (trainable_only and not p.requires_grad):
                continue
            seen.add(id(p))
            if exclude_embeddings and "embeddings" in name:
                continue
            total += _numel(p)
        return total

    def flops_per_token(self, seq_len: Optional[int] = None, mlm_fraction: float = 1.0) -> float:
        return flops_per_token(self.config, seq_len, mlm_fraction)


def _numel(p: torch.Tensor) -> int:
    """Full size, also for a ZeRO-3 partitioned parameter (whose local numel is 0) and for one
    sharded over sequence-parallel ranks (``sequence_shard = (dim, full size)``)."""
    n = int(getattr(p, "ds_numel", p.numel()))
    shard = getattr(p, "sequence_shard", None)
    if shard is not None:
        dim, size = shard
        n = n // int(getattr(p, "ds_shape", p.shape)[dim]) * int(size)
    return n


class MLMHead(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.ln = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.ln(F.gelu(self.dense(x))))


class ClassificationHead(nn.Module):
    """First-token head laid out as RoBERTa's ``classifier``: ``dense`` (D -> D) + tanh, dropout,
    ``out_proj`` (D -> C). ``forward(hidden [B, n, D]) -> [B, C]`` pools position 0.

    One module holds the whole head (the pooler included), so PEFT's default ``modules_to_save``
    for sequence classification (``classifier``) trains and saves all of it.
    """

    def __init__(self, hidden_size: int, num_labels: int, dropout: float):
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.drop = nn.Dropout(dropout)
        self.out_proj = nn.Linear(hidden_size, num_labels)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.drop(torch.tanh(self.dense(hidden[:, 0]))))


class LinformerForMaskedLM(LinformerPreTrainedModel):
    """Encoder + MLM head (decoder weight tied to the token embeddings).

    ``forward(input_ids, attention_mask=None, labels=None, position_ids=None)``: logits for every
    position
    ``[B, n, V]``; with labels (``-100`` = ignore) also their mean cross-entropy. Training uses
    :class:`LinformerForMaskedLMPretraining`, which runs the head on labelled positions only.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.encoder = LinformerEncoder(config)
        self.lm_head = MLMHead(config)
        self.apply(self._init_weights)
        if config.tie_word_embeddings:
            self.lm_head.decoder.weight = self.encoder.token_embeddings.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
    ) -> MaskedLMOutput:
        _check_labels(labels, input_ids)
        logits = self.lm_head(self.encoder(input_ids, attention_mask, position_ids=position_ids))
        return MaskedLMOutput(
            loss=None if labels is None else mlm_loss(logits, labels), logits=logits
        )


def labelled_positions(labels: torch.Tensor) -> torch.Tensor:
    """Flat row-major indices ``[M]`` (int64, ascending) of the positions of ``labels [B, n]``
    whose label is not ``-100``. Its size depends on the data: on an accelerator computing it
    waits for the device, so the trainer's data pipeline computes it on the host."""
    return torch.nonzero(labels.reshape(-1) != -100).reshape(-1)


class LinformerForMaskedLMPretraining(LinformerForMaskedLM):
    """The MLM model as pretraining runs it (same parameters and state dict as
    :class:`LinformerForMaskedLM`): the head and the softmax run only on labelled positions
    (15 % of them), which saves most of the ``V``-wide work.

    ``forward(input_ids, attention_mask, labels, loss_denominator=None, labelled_index=None)
    -> LabelledMLMOutput``; the loss is the sum of the labelled positions' cross-entropies over
    ``loss_denominator`` (default: their number; sequence parallelism passes the replica's
    global count). ``labelled_index``: :func:`labelled_positions` of ``labels``, computed by
    the caller on the host (the trainer's data pipeline does), so the forward never reads
    from the device; without it the model computes it (one device->host wait on a GPU).
    """

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        loss_denominator: Optional[torch.Tensor] = None,
        labelled_index: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
    ) -> LabelledMLMOutput:
        if labels is None:
            raise ValueError("LinformerForMaskedLMPretraining needs labels ([B, n], -100 = ignore)")
        _check_labels(labels, input_ids)
        hidden = self.encoder(input_ids, attention_mask, position_ids=position_ids)
        if labelled_index is None:
            labelled_index = labelled_positions(labels)
        elif labelled_index.dim() != 1 or labelled_index.dtype != torch.long:
            raise ValueError(
                "labelled_index must be a 1-D int64 tensor (labelled_positions(labels)), got "
                f"shape {tuple(labelled_index.shape)} dtype {labelled_index.dtype}"
            )
        # gathers with a known size: the same rows (and, backward, the same sums) as labels[sel]
        targets = labels.reshape(-1).index_select(0, labelled_index)
        logits = self.lm_head(hidden.reshape(-1, hidden.shape[-1]).index_select(0, labelled_index))
        total = F.cross_entropy(logits.float(), targets, reduction="sum")
        denom = loss_denominator if loss_denominator is not None else max(targets.numel(), 1)
        return LabelledMLMOutput(
            loss=total / denom, labelled_logits=logits, labelled_targets=targets
        )


def _check_labels(labels: Optional[torch.Tensor], input_ids: torch.Tensor) -> None:
    if labels is not None and labels.shape != input_ids.shape:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} does not match input_ids {tuple(input_ids.shape)}"
        )


class LinformerForSequenceClassification(LinformerPreTrainedModel):
    """Encoder + :class:`ClassificationHead` (first token): ``[B, num_labels]``."""

    def __init__(self, config: ModelConfig, problem_type: Optional[str] = None):
        super().__init__()
        self.config = config
        self.problem_type = problem_type
        self.encoder = LinformerEncoder(config)
        p = config.classifier_dropout if config.classifier_dropout is not None else config.dropout
        self.classifier = ClassificationHead(config.hidden_size, config.num_labels, p)
        self.apply(self._init_weights)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
    ) -> SequenceClassifierOutput:
        hidden = self.encoder(input_ids, attention_mask, position_ids=position_ids)
        logits = self.classifier(hidden)
        loss = None
        if labels is not None:
            loss = sequence_classification_loss(logits, labels, self.problem_type)
        return SequenceClassifierOutput(loss=loss, logits=logits)


# ========================================================================================= FLOPs
def flops_per_token(
    config: ModelConfig, seq_len: Optional[int] = None, mlm_fraction: float = 1.0
) -> float:
    """Training FLOPs (forward + backward = 3x forward) per token of an MLM step.

    Counts matrix multiplies only (2 FLOPs per multiply-add): QKV/output/FFN projections,
    sequence projections (E/F or conv), attention scores and weighted sum, and the MLM head on
    ``mlm_fraction`` of the tokens. The benchmark and the trainer's MFU both use this formula.
    """
    n = seq_len or config.max_seq_len
    dm, ff = config.hidden_size, config.intermediate_size
    fwd = 0.0
    for i, kind in enumerate(config.projection_schedule()):
        fwd += 2 * (3 * dm * dm + dm * dm + 2 * dm * ff)  # qkv, out, ffn
        proj = None if kind == "dense" else get_projection(kind).flops
        if proj is None:  # dense, or a registered kind without a formula (an upper bound)
            fwd += 2 * 2 * n * dm  # Q K^T and A V
        else:  # the kind's own: linear E K, F V + k summaries; conv: kernel taps + c blocks
            fwd += proj(config, i, n)
    fwd += mlm_fraction * 2 * (dm * dm + dm * config.vocab_size)
    return 3.0 * fwd
