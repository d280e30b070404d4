"""The model's options (:class:`ModelConfig`) and their validation: every check names
``model.<field>``. Torch-free; the projection registry answers for each kind's own rules."""

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .kinds import BUILTIN_KINDS
from .registry import ModelConfigError, get_projection, layer_kinds, projection_names

MODEL_FORMAT_VERSION = 1

PROJECTIONS = BUILTIN_KINDS  # the built-in kinds (more: register_projection)
SCHEDULES = PROJECTIONS + ("hybrid",)
SHARING_MODES = ("none", "headwise", "kv", "layerwise")
PROJECTION_INITS = ("normal", "pooling")
POSITION_INITS = ("normal", "sinusoidal")
POSITIONS = ("learned", "rope")
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
    "local_window": (0, _MAX_SIZE),
    "routed_blocks": (1, _MAX_SIZE),
    "routed_block": (1, _MAX_SIZE),
}
# Floats: (test, the range as the message states it); nan fails every test.
_FLOAT_RANGES = {
    "dropout": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "attention_dropout": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "classifier_dropout": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "layer_norm_eps": (lambda v: 0 < v < math.inf, "> 0"),
    "initializer_range": (lambda v: 0 < v < math.inf, "> 0"),
    "projection_init_std": (lambda v: 0 < v < math.inf, "> 0"),
    "rope_base": (lambda v: 1 < v < math.inf, "> 1"),
}


def _range_problem(name: str, value: Any) -> str | None:
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
    hybrid_linear_layers: int | None = None  # default: half of the layers (rounded up)
    layer_projections: list[str] | None = None  # explicit per-layer schedule, overrides above
    k: int = 256  # projected length for linear layers; conv stride = max_seq_len // k
    layer_k: list[int] | None = None  # per-layer k, overrides `k`
    sharing: str = "layerwise"
    freeze_projection: bool = False  # keep E/F (or conv kernels) fixed at their init
    projection_init_std: float | None = None  # default 1/sqrt(max_seq_len) ("normal" init)
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
    # Local + global attention (Transformer-LS): every non-dense layer's queries also attend
    # exactly to the keys within local_window / 2 positions on each side (their own document,
    # never padding), in the same softmax as the layer's projected summaries; 0 = off. The
    # projection kind "local" is the window alone (no summaries).
    local_window: int = 0
    # The routed kind (content-routed block attention, routed.py): how many blocks of
    # `routed_block` tokens each block of queries reads exactly (beside the k summaries, means of
    # max_seq_len / k tokens), and the tokens per routed block (None: max_seq_len / k, the
    # summaries' blocks; else it divides max_seq_len / k)
    routed_blocks: int = 8
    routed_block: int | None = None
    # "learned": a position table added to the embeddings (BERT); "rope": no table, queries and
    # keys of exact attention (windows, dense layers) rotated by their position (RoFormer);
    # projected summaries see unrotated keys (E/F columns are positional already)
    positions: str = "learned"
    rope_base: float = 10000.0
    initializer_range: float = 0.02
    pad_token_id: int = 0
    num_labels: int = 2
    classifier_dropout: float | None = None  # default: `dropout`
    tie_word_embeddings: bool = True
    format_version: int = MODEL_FORMAT_VERSION
    extra: dict = field(default_factory=dict)  # free-form metadata, ignored by the model

    def __post_init__(self) -> None:
        self.validate()

    # ----------------------------------------------------------------------------- schedule
    def projection_schedule(self) -> list[str]:
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
                              ("positions", POSITIONS),
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
        if self.positions == "rope" and self.head_dim % 2:
            _bad("positions", f"rope rotates pairs of channels: head_dim {self.head_dim} is odd")
        self._validate_schedule()
        self._validate_k()
        self._validate_window()
        if self.freeze_projection:
            for kind in layer_kinds(self):
                if not kind.freezable:
                    _bad(
                        "freeze_projection",
                        f"the {kind.name!r} kind computes its summary weights from the input: there "
                        "is no fixed projection to freeze (set it to false)",
                    )

    def _validate_window(self) -> None:
        """``local_window``: even (W/2 positions each side), at most max_seq_len, used by some
        layer; a kind that attends through the window alone (``needs_window``) needs one."""
        kinds = layer_kinds(self)
        w = self.local_window
        if w:
            if w % 2:
                _bad("local_window", f"must be even (W/2 keys on each side of a query), got {w}")
            if w > self.max_seq_len:
                _bad("local_window", f"{w} is wider than max_seq_len={self.max_seq_len}")
            if not any(kind.windowed for kind in kinds):
                takes = [name for name in projection_names() if get_projection(name).windowed]
                # the layers' kinds in schedule order: a message that does not hang on their names
                here = list(dict.fromkeys(k.name for k in kinds))
                _bad(
                    "local_window",
                    f"applies to the layers of windowed kinds {takes} and no layer is one "
                    f"({here}): set it to 0 or change the schedule",
                )
        else:
            for kind in kinds:
                if kind.needs_window:
                    where = (
                        "layer_projections" if self.layer_projections is not None else "projection"
                    )
                    _bad(
                        where,
                        f"the {kind.name!r} kind attends through the sliding window: set "
                        "model.local_window (e.g. 128)",
                    )

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
            if not get_projection(p).summaries:
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
        """Parameters in E/F (or conv kernels), by the sharing-mode formulas in docs/model.md."""
        h = self.num_heads
        total = 0
        seen_layerwise: set = set()
        for i, p in enumerate(self.projection_schedule()):
            one = get_projection(p).parameters_of(self, i)
            if not one:
                continue  # one module shared by all heads
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
