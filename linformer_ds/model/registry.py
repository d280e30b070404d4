"""The registry of projection kinds: a kind is named in ``model.projection`` /
``layer_projections`` and built by its factory (:func:`register_projection`, docs/extending.md).
Torch and the standard library only; the built-in kinds register in ``projections.py``."""

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
    factory: Callable[[Config, int, int], nn.Module]
    stride: Callable[[Config, int], int] | None = None
    stride_rule: str = ""
    check: Callable[[Config, int], str | None] | None = None
    num_parameters: Callable[[Config, int], int] | None = None
    flops: Callable[[Config, int, int], float] | None = None
    sequence_parallel: bool = False
    summaries: bool = (
        True  # False: no summaries, the layer attends through its window alone (local)
    )
    freezable: bool = True  # freeze_projection applies (False: weights computed from the input)
    masked: bool = False  # forward takes ``mask=`` ([B, n] bool) and keeps padding out itself

    def parameters_of(self, config: Config, layer_idx: int) -> int:
        """Parameters of one ``heads=1`` module of layer ``layer_idx``."""
        if self.num_parameters is not None:
            return int(self.num_parameters(config, layer_idx))
        with torch.device("meta"):
            module = self.factory(config, layer_idx, 1)
        return sum(p.numel() for p in module.parameters())


_PROJECTION_KINDS: "dict[str, ProjectionKind]" = {}


def register_projection(
    name: str,
    factory: Callable[[Config, int, int], nn.Module],
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


def projection_stride(config: Config, layer_idx: int) -> int | None:
    """The stride every N (and sequence-parallel slice) must be a multiple of at layer
    ``layer_idx`` (conv: max_seq_len / k), or None (dense, linear: any N)."""
    kind = config.projection_schedule()[layer_idx]
    rule = None if kind == "dense" else get_projection(kind).stride
    return None if rule is None else int(rule(config, layer_idx))


def _make_projection(config: Config, layer_idx: int, kind: str, heads: int) -> nn.Module:
    module = get_projection(kind).factory(config, layer_idx, heads)
    module.projection_kind = kind  # init_weights and parallelize find projections by it
    return module
