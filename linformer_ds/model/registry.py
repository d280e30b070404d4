"""The registry of attention kinds: a kind is named in ``model.projection`` /
``layer_projections`` and answers every question about itself (:class:`ProjectionKind`,
:func:`register_projection`, docs/extending.md). No code outside a kind's own file compares a
kind's name against a literal: config validation, attention, sequence parallelism, FLOPs,
parameter counts and the ONNX export ask the kind. Torch and the standard library only; the
built-in kinds register in ``kinds.py``."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# A ModelConfig (config.py imports this module for the registry, so not the other way round)
Config = Any


class ModelConfigError(ValueError):
    """A model option is invalid; the message names the field."""


def tracing() -> bool:
    """True while ``torch.export`` / ``torch.onnx.export`` (dynamo) or ``torch.jit.trace`` records
    the model: shape-generic code (no per-row loops, no branches on sizes or values) replaces the
    eager fast paths, with the same math."""
    return torch.compiler.is_exporting() or torch.jit.is_tracing()


@dataclass(frozen=True)
class ProjectionKind:
    """An attention kind, named in ``model.projection`` / ``layer_projections``
    (:func:`register_projection`; see docs/extending.md). Every field but ``name`` is optional.

    How the layer attends:

    * ``factory(config, layer_idx, heads)`` builds one module mapping ``[B, n, heads, d_h]`` ->
      ``[B, m, heads, d_h]`` summaries of the keys and values along the sequence (``heads`` is 1
      when shared by all heads); the layer's queries attend to them (and to the window). None:
      the kind has no projection module.
    * ``attend(layer, qkv, mask, documents, local, dropout_p) -> [B, n, D]``: the kind computes
      the attention itself (dense; routed; selective) from the layer's ``qkv [B, n, 3D]``; the
      layer applies its output projection. None: summaries (and the window) through the generic
      path.

    Its rules (each the kind's answer; nothing else decides them):

    * ``summaries``: the kind projects summaries (counts ``k``: ``model.k`` is checked for it).
    * ``windowed``: ``model.local_window`` applies to its layers; ``needs_window``: its layers
      attend through the window alone, so the window must be set.
    * ``full_attention``: every query sees every key (n x n scores): sequence parallelism runs
      DeepSpeed-Ulysses (heads divisible by P), isolation under SP needs the documents' mask,
      the CPU warns about dropout (its fused kernel).
    * ``freezable``: ``freeze_projection`` applies (False: weights computed from the input).
    * ``masked``: the module's forward takes ``mask=`` ([B, n] bool) and keeps padding out.
    * ``stride(config, layer_idx)``: every length N (and sequence-parallel slice) must be a
      multiple of it (``stride_rule`` says how it is derived).
    * ``sequence_parallel``: supports P > 1 (its modules read their ``sequence_parallel``
      attribute, set by ``parallelize``); ``isolation_under_sp``: document isolation works with
      P > 1 (False: refused at start-up, ``isolation_sp_reason`` says why).
    * ``onnx(config, layer_idx)``: why the layer cannot be exported to ONNX (None: it can),
      asked before any export work.
    * ``check(config, layer_idx)``: a problem with the layer's options, or None.
    * ``num_parameters(config, layer_idx)`` of one ``heads=1`` module (default: counted on the
      meta device; 0 without a factory); ``flops(config, layer_idx, n)``: forward FLOPs per
      token of attending (default: dense attention's, an upper bound).

    A module class says whether its ``weight`` is indexed by sequence position with a
    ``sequence_dim`` class attribute (E/F: 2; such weights are sharded under sequence
    parallelism and sliced to the first n positions).
    """

    name: str
    factory: Callable[[Config, int, int], nn.Module] | None = None
    attend: Callable[..., torch.Tensor] | None = None
    summaries: bool = True
    windowed: bool = True
    needs_window: bool = False
    full_attention: bool = False
    freezable: bool = True
    masked: bool = False
    stride: Callable[[Config, int], int] | None = None
    stride_rule: str = ""
    sequence_parallel: bool = False
    isolation_under_sp: bool = True
    isolation_sp_reason: str = ""
    onnx: Callable[[Config, int], str | None] | None = None
    check: Callable[[Config, int], str | None] | None = None
    num_parameters: Callable[[Config, int], int] | None = None
    flops: Callable[[Config, int, int], float] | None = None

    def parameters_of(self, config: Config, layer_idx: int) -> int:
        """Parameters of one ``heads=1`` module of layer ``layer_idx``."""
        if self.num_parameters is not None:
            return int(self.num_parameters(config, layer_idx))
        if self.factory is None:
            return 0
        with torch.device("meta"):
            module = self.factory(config, layer_idx, 1)
        return sum(p.numel() for p in module.parameters())


_PROJECTION_KINDS: "dict[str, ProjectionKind]" = {}
_RESERVED = ("hybrid",)  # a schedule name (linear then conv layers), not a kind


def register_projection(
    name: str,
    factory: Callable[[Config, int, int], nn.Module] | None = None,
    replace: bool = False,
    **rules: Any,
) -> ProjectionKind:
    """Make ``name`` an attention kind (``rules``: the optional fields of
    :class:`ProjectionKind`); a taken name is a ValueError unless ``replace``."""
    if not name.isidentifier() or name in _RESERVED:
        raise ValueError(f"attention kind name must be an identifier, not {_RESERVED}: {name!r}")
    if name in _PROJECTION_KINDS and not replace:
        raise ValueError(f"attention kind {name!r} is already registered")
    kind = ProjectionKind(name, factory, **rules)
    if kind.factory is None and kind.attend is None:
        raise ValueError(f"attention kind {name!r} needs a factory (summaries) or attend")
    if kind.needs_window and not kind.windowed:
        raise ValueError(f"attention kind {name!r}: needs_window=True needs windowed=True")
    _PROJECTION_KINDS[name] = kind
    return kind


def unregister_projection(name: str) -> None:
    """Remove a registered kind (no error if absent)."""
    _PROJECTION_KINDS.pop(name, None)


def get_projection(name: str) -> ProjectionKind:
    """The registered kind ``name`` (ModelConfigError if there is none)."""
    try:
        return _PROJECTION_KINDS[name]
    except KeyError:
        raise ModelConfigError(
            f"unknown attention kind {name!r} (registered: {sorted(_PROJECTION_KINDS)})"
        ) from None


def projection_names() -> tuple:
    """Every registered per-layer attention kind, in registration order."""
    return tuple(_PROJECTION_KINDS)


def layer_kinds(config: Config) -> "list[ProjectionKind]":
    """The registered kind of every layer of ``config``."""
    return [get_projection(p) for p in config.projection_schedule()]


def projection_stride(config: Config, layer_idx: int) -> int | None:
    """The stride every N (and sequence-parallel slice) must be a multiple of at layer
    ``layer_idx`` (conv: max_seq_len / k), or None (any N)."""
    kind = get_projection(config.projection_schedule()[layer_idx])
    return None if kind.stride is None else int(kind.stride(config, layer_idx))


def onnx_problem(config: Config) -> str | None:
    """Why a model of ``config`` cannot be exported to ONNX, naming the layer and option (None:
    every layer's kind says it can)."""
    for i, kind in enumerate(layer_kinds(config)):
        problem = kind.onnx(config, i) if kind.onnx is not None else None
        if problem:
            return f"layer {i} ({kind.name}): {problem}"
    return None


def _make_projection(config: Config, layer_idx: int, kind: str, heads: int) -> nn.Module | None:
    """The kind's projection module (None: the kind has none)."""
    factory = get_projection(kind).factory
    if factory is None:
        return None
    module = factory(config, layer_idx, heads)
    module.projection_kind = kind  # init_weights and parallelize find projections by it
    return module
