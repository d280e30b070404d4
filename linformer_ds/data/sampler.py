"""Weighted corpus mixtures: a deterministic blend of several ``data_prep`` outputs.

The global sample stream (all ranks together) is a function of the sources, their weights
and the seed only. Position ``p`` goes to the source whose realized count lags furthest
behind its share (Megatron's blending rule: ``argmax_i w_i (p + 1) - c_i``, ties to the first
source), so the realized shares track the weights at every prefix of the run: after ``n``
samples ``w_i n - (S - 1) < c_i < w_i n + 1`` for ``S`` sources. Each source walks through its
own seeded permutations, one per epoch, and wraps independently (a small source repeats).

Ranks split the global stream in rounds of ``W`` positions (rank ``r`` takes the ``r``-th of
each round), exactly as the one-dataset sampler before mixtures did (kept as a reference in
``tests/legacy_batches.py``); every rank follows the whole stream, so the state is the same on all ranks and
re-shards to any number of ranks (:meth:`MixtureSampler.state_dict`).

A run on one source is today's single-dataset stream, bit for bit (``legacy``): the
permutation of epoch ``e`` is seeded by ``(seed, e)``, an epoch ends when fewer than ``W`` of
its rows are left (the ragged tail is dropped), and a batch is masked with the epoch of its last
row, as the one-dataset stream did. With several sources (in the run, over
all its stages) every source epoch is whole (no rank count in the stream), each source has its
own seed (``seed`` and a hash of its name) for its permutations and masks, and a row is masked
with its own source epoch.
"""

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from linformer_ds.data.shards import DataError


def source_seed(seed: int, name: str, legacy: bool) -> int:
    """The seed of one source's permutations and masks: ``seed`` itself for the lone source
    of a run (today's stream), else ``seed`` with a hash of the name in the high bits (< 2**63).
    """
    if legacy:
        return int(seed)
    return ((zlib.crc32(name.encode()) & 0x7FFFFFFF) << 32) | (int(seed) & 0xFFFFFFFF)


def check_weight(x: float) -> None:
    """ValueError unless ``x`` is a finite number >= 0 (one mixture weight on its own)."""
    x = float(x)
    if not math.isfinite(x):
        raise ValueError(f"weight {x} is not a finite number")
    if x < 0:
        raise ValueError(f"weight {x} is negative")


def normalized_weights(weights: Sequence[float]) -> list[float]:
    """``weights / sum(weights)``; ValueError for negative, non-finite or all-zero weights,
    weights whose sum overflows, and a positive weight whose share underflows to 0."""
    w = [float(x) for x in weights]
    if not w:
        raise ValueError("a mixture needs at least one source")
    for x in w:
        check_weight(x)
    total = sum(w)
    if total <= 0:
        raise ValueError("all weights are zero; give at least one source a weight > 0")
    if not math.isfinite(total):
        raise ValueError(
            f"weights {', '.join(f'{x:g}' for x in w)} sum to {total} (beyond the largest float), "
            "so they cannot be normalised; weights are relative: scale them down (e.g. to 1)"
        )
    out = [x / total for x in w]
    for x, share in zip(w, out):
        if x > 0 and share == 0:
            raise ValueError(
                f"weight {x:g} is too small next to their sum {total:g}: its share rounds to 0; "
                "give it weight 0 (never trained on) or a larger weight"
            )
    return out


@dataclass
class _SourceState:
    name: str
    size: int  # rows
    seed: int
    epoch: int = 0  # this source's epoch
    consumed: int = 0  # rows of the current epoch drawn (by all ranks)
    count: int = 0  # positions of this mixture's stream given to this source


class MixtureSampler:
    """The blended global stream and this rank's share of it, resumable on any rank count.

    :meth:`next` returns this rank's next ``(source, epoch, row)``; each call advances the
    global stream by one round of ``world_size`` positions (the ranks call it in lockstep).
    ``positions`` starts sources mid-stream (``{name: {"epoch", "consumed"}}``, e.g. carried
    over from an earlier stage); blending counts always start at zero. ``legacy`` (default:
    one source) selects today's one-dataset stream (see the module docstring).
    """

    def __init__(
        self,
        names: Sequence[str],
        sizes: Sequence[int],
        weights: Sequence[float],
        rank: int,
        world_size: int,
        seed: int = 0,
        positions: dict[str, dict[str, int]] | None = None,
        legacy: bool | None = None,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"bad rank {rank} for world_size {world_size}")
        if not len(names) == len(sizes) == len(weights):
            raise ValueError("names, sizes and weights must have the same length")
        if len(set(names)) != len(names):
            raise ValueError(f"source names must be distinct, got {list(names)}")
        self.weights = normalized_weights(weights)
        self.legacy = len(names) == 1 if legacy is None else bool(legacy)
        if self.legacy and len(names) != 1:
            raise ValueError("legacy (one-source) streams have exactly one source")
        self.rank, self.world_size = int(rank), int(world_size)
        self.sources = [
            _SourceState(str(n), int(s), source_seed(seed, str(n), self.legacy))
            for n, s in zip(names, sizes)
        ]
        for src, w in zip(self.sources, self.weights):
            if src.size < 1 and w > 0:
                raise ValueError(f"source {src.name!r} has no rows")
        self.position = 0  # positions of the global stream consumed by all ranks together
        self._perms: dict[int, tuple[int, np.ndarray]] = {}
        if positions:
            for src in self.sources:
                if src.name in positions:
                    self._set_position(src, positions[src.name])

    # ------------------------------------------------------------------------- the stream
    def choose(self) -> int:
        """The source of the next global position (Megatron's rule; ties to the first)."""
        p1 = self.position + 1
        best, best_gap = 0, -math.inf
        for i, (src, w) in enumerate(zip(self.sources, self.weights)):
            gap = w * p1 - src.count
            if gap > best_gap:
                best, best_gap = i, gap
        return best

    def permutation(self, i: int, epoch: int) -> np.ndarray:
        """The row order of source ``i`` in ``epoch`` (the current epoch's is cached)."""
        cached = self._perms.get(i)
        if cached is not None and cached[0] == epoch:
            return cached[1]
        src = self.sources[i]
        perm = np.random.default_rng([src.seed % 2**63, epoch % 2**63]).permutation(src.size)
        self._perms[i] = (epoch, perm)
        return perm

    def next(self) -> tuple[int, int, int]:
        """This rank's next ``(source index, source epoch, row)``; advances one round."""
        w = self.world_size
        if self.legacy:  # today's rule: an epoch ends when fewer than W rows are left
            src = self.sources[0]
            if src.size - src.consumed < w:
                src.epoch, src.consumed = src.epoch + 1, 0
                if src.size < w:
                    raise DataError(
                        f"source {src.name!r} has {src.size} rows: too few for {w} ranks"
                    )
        mine = (0, 0, 0)
        for j in range(w):
            i = self.choose()
            src = self.sources[i]
            if src.consumed >= src.size:  # several sources: whole epochs, wrap on the next draw
                src.epoch, src.consumed = src.epoch + 1, 0
            if j == self.rank:
                mine = (i, src.epoch, src.consumed)
            src.consumed += 1
            src.count += 1
            self.position += 1
        i, epoch, offset = mine
        return i, epoch, int(self.permutation(i, epoch)[offset])

    # ----------------------------------------------------------------------------- reports
    def shares(self) -> dict[str, float]:
        """Realized share of each source in this mixture's stream so far."""
        n = max(self.position, 1)
        return {s.name: s.count / n for s in self.sources}

    def epochs(self) -> dict[str, float]:
        """Epochs of each source seen so far (completed epochs + the current one's fraction)."""
        return {s.name: s.epoch + s.consumed / max(s.size, 1) for s in self.sources}

    # ------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """``{"position", "sources": {name: {"epoch", "consumed", "count", "rows"}}}``: the
        global stream's position, the same on every rank, valid under any world size."""
        return {
            "position": self.position,
            "sources": {
                s.name: {"epoch": s.epoch, "consumed": s.consumed, "count": s.count, "rows": s.size}
                for s in self.sources
            },
        }

    def _set_position(self, src: _SourceState, st: dict[str, Any]) -> None:
        consumed, epoch = int(st["consumed"]), int(st["epoch"])
        if not 0 <= consumed <= src.size or epoch < 0:
            raise ValueError(
                f"source {src.name!r}: saved position epoch={epoch} consumed={consumed} is "
                f"outside its {src.size} rows: the dataset changed since the checkpoint"
            )
        if "rows" in st and int(st["rows"]) != src.size:
            raise ValueError(
                f"source {src.name!r} has {src.size} rows, the checkpoint's had {st['rows']}: "
                "the dataset changed since the checkpoint"
            )
        src.epoch, src.consumed = epoch, consumed

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` output (saved under any world size)."""
        saved = dict(state["sources"])
        names = [s.name for s in self.sources]
        if sorted(saved) != sorted(names):
            raise ValueError(
                f"the checkpoint's mixture has sources {sorted(saved)}, the config {names}; "
                "resume with the same data.sources (or start a new run)"
            )
        for src in self.sources:
            self._set_position(src, saved[src.name])
            src.count = int(saved[src.name].get("count", 0))
        self.position = int(state["position"])
        if sum(s.count for s in self.sources) != self.position:
            raise ValueError(
                f"corrupt mixture state: source counts add up to "
                f"{sum(s.count for s in self.sources)}, not the position {self.position}"
            )
