"""Weighted corpus mixtures: a deterministic blend of several ``data_prep`` outputs.

The global sample stream (all ranks together) is a function of the sources, their weights
and the seed only. Position ``p`` goes to the source whose realized count lags furthest
behind its share (Megatron's blending rule: ``argmax_i w_i (p + 1) - c_i``, ties to the first
source), so the realized shares track the weights at every prefix of the run: after ``n``
samples ``w_i n - (S - 1) < c_i < w_i n + 1`` for ``S`` sources. Each source walks through its
own seeded permutations, one per epoch, and wraps independently (a small source repeats).

Ranks split the global stream in rounds of ``W`` positions (rank ``r`` takes the ``r``-th of
each round), exactly as :class:`linformer_ds.data.ResumableDistributedSampler` does for one
dataset; every rank follows the whole stream, so the state is the same on all ranks and
re-shards to any number of ranks (:meth:`MixtureSampler.state_dict`).

One source is today's single-dataset stream, bit for bit: the permutation of epoch ``e`` is
seeded by ``(seed, e)``, an epoch ends when fewer than ``W`` of its rows are left (the ragged
tail is dropped), and a batch is masked with the epoch of its last row, as
:class:`linformer_ds.data.TrainBatches` does. With several sources every source epoch is whole
(no rank count in the stream), each source has its own seed (``seed`` and a hash of its name)
for its permutations and masks, and a row is masked with its own source epoch.
"""

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import numpy as np
import torch

from linformer_ds.data import DataError, MLMMasking, ShardDataset, check_compatible


def source_seed(seed: int, name: str, single: bool) -> int:
    """The seed of one source's permutations and masks: ``seed`` itself for a lone source
    (today's stream), else ``seed`` with a hash of the name in the high bits (< 2**63)."""
    if single:
        return int(seed)
    return ((zlib.crc32(name.encode()) & 0x7FFFFFFF) << 32) | (int(seed) & 0xFFFFFFFF)


def normalized_weights(weights: Sequence[float]) -> List[float]:
    """``weights / sum(weights)``; ValueError for negative, non-finite or all-zero weights."""
    w = [float(x) for x in weights]
    if not w:
        raise ValueError("a mixture needs at least one source")
    for x in w:
        if not math.isfinite(x):
            raise ValueError(f"weight {x} is not a finite number")
        if x < 0:
            raise ValueError(f"weight {x} is negative")
    total = sum(w)
    if total <= 0:
        raise ValueError("all weights are zero; give at least one source a weight > 0")
    return [x / total for x in w]


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
    over from an earlier stage); blending counts always start at zero.
    """

    def __init__(
        self,
        names: Sequence[str],
        sizes: Sequence[int],
        weights: Sequence[float],
        rank: int,
        world_size: int,
        seed: int = 0,
        positions: Optional[Dict[str, Dict[str, int]]] = None,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"bad rank {rank} for world_size {world_size}")
        if not len(names) == len(sizes) == len(weights):
            raise ValueError("names, sizes and weights must have the same length")
        if len(set(names)) != len(names):
            raise ValueError(f"source names must be distinct, got {list(names)}")
        self.weights = normalized_weights(weights)
        self.single = len(names) == 1
        self.rank, self.world_size = int(rank), int(world_size)
        self.sources = [
            _SourceState(str(n), int(s), source_seed(seed, str(n), self.single))
            for n, s in zip(names, sizes)
        ]
        for src, w in zip(self.sources, self.weights):
            if src.size < 1 and w > 0:
                raise ValueError(f"source {src.name!r} has no rows")
        self.position = 0  # positions of the global stream consumed by all ranks together
        self._perms: Dict[int, Tuple[int, np.ndarray]] = {}
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

    def next(self) -> Tuple[int, int, int]:
        """This rank's next ``(source index, source epoch, row)``; advances one round."""
        w = self.world_size
        if self.single:  # today's rule: an epoch ends when fewer than W rows are left
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
    def shares(self) -> Dict[str, float]:
        """Realized share of each source in this mixture's stream so far."""
        n = max(self.position, 1)
        return {s.name: s.count / n for s in self.sources}

    def epochs(self) -> Dict[str, float]:
        """Epochs of each source seen so far (completed epochs + the current one's fraction)."""
        return {s.name: s.epoch + s.consumed / max(s.size, 1) for s in self.sources}

    # ------------------------------------------------------------------------------- state
    def state_dict(self) -> Dict[str, Any]:
        """``{"position", "sources": {name: {"epoch", "consumed", "count", "rows"}}}``: the
        global stream's position, the same on every rank, valid under any world size."""
        return {
            "position": self.position,
            "sources": {
                s.name: {"epoch": s.epoch, "consumed": s.consumed, "count": s.count, "rows": s.size}
                for s in self.sources
            },
        }

    def _set_position(self, src: _SourceState, st: Dict[str, Any]) -> None:
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

    def load_state_dict(self, state: Dict[str, Any]) -> None:
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


class MixtureBatches:
    """The training stream of one rank over a mixture: sampler -> rows -> MLM masking ->
    device tensors. The drop-in for :class:`linformer_ds.data.TrainBatches` (one source gives
    the same batches) with one state dict for the whole mixture.

    ``datasets`` share the tokenizer and N (see :func:`open_sources`). ``mask_args`` are
    :class:`MLMMasking`'s ``mlm_probability`` and ``short_seq_prob``. ``rank`` /
    ``world_size`` are the replica's; a sequence-parallel group reads the same rows and keeps
    its ``[B, N / sp_size]`` slice. ``on_batch(epoch, indices)`` is an optional observer
    (one source: the batch epoch and row indices; several: per-row epochs and
    ``[source, row]`` pairs).
    """

    def __init__(
        self,
        names: Sequence[str],
        datasets: Sequence[ShardDataset],
        weights: Sequence[float],
        rank: int,
        world_size: int,
        micro_batch_size: int,
        seed: int,
        device: Union[str, torch.device] = "cpu",
        mlm_probability: float = 0.15,
        short_seq_prob: float = 0.0,
        sp_rank: int = 0,
        sp_size: int = 1,
        positions: Optional[Dict[str, Dict[str, int]]] = None,
    ) -> None:
        self.names, self.datasets = list(names), list(datasets)
        self.sampler = MixtureSampler(
            self.names, [len(d) for d in self.datasets], weights, rank, world_size, seed,
            positions=positions,
        )  # fmt: skip
        self.maskers = [
            MLMMasking(
                d.vocab_size,
                d.mask_id,
                d.special_ids,
                mlm_probability=mlm_probability,
                seed=src.seed,
                pad_id=d.pad_id,
                short_seq_prob=short_seq_prob,
            )  # fmt: skip
            for d, src in zip(self.datasets, self.sampler.sources)
        ]
        self.seq_len = self.datasets[0].seq_len
        self.micro_batch_size = int(micro_batch_size)
        self.device = torch.device(device)
        self.sp_rank, self.sp_size = int(sp_rank), int(sp_size)
        self.on_batch: Optional[Callable[[Any, List[Any]], None]] = None

    @property
    def epoch(self) -> int:
        """One source: its epoch. Several: the highest source epoch (the most repeated)."""
        return max(s.epoch for s in self.sampler.sources)

    def shares(self) -> Dict[str, float]:
        return self.sampler.shares()

    def epochs(self) -> Dict[str, float]:
        return self.sampler.epochs()

    def state_dict(self) -> Dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)

    def next_rows(self) -> Tuple[torch.Tensor, List[Tuple[int, int, int]]]:
        """This rank's next micro-batch of rows ``[B, N]`` and their ``(source, epoch, row)``."""
        picks = [self.sampler.next() for _ in range(self.micro_batch_size)]
        tokens = torch.stack([self.datasets[i][row] for i, _, row in picks])
        return tokens, picks

    def next_batch(self) -> Dict[str, torch.Tensor]:
        """``input_ids, attention_mask, labels`` ``[micro_batch, N]`` on the device."""
        tokens, picks = self.next_rows()
        if self.sampler.single:
            epoch, idx = picks[-1][1], [row for _, _, row in picks]
            if self.on_batch is not None:
                self.on_batch(epoch, idx)
            batch = self.maskers[0](tokens, torch.tensor(idx), epoch)
        else:
            if self.on_batch is not None:
                self.on_batch([e for _, e, _ in picks], [[i, row] for i, _, row in picks])
            batch = self._mask_rows(tokens, picks)
        if self.sp_size > 1:
            from linformer_ds.sequence_parallel import shard_batch

            batch, _ = shard_batch(batch, self.sp_rank, self.sp_size)
        return {k: v.to(self.device) for k, v in batch.items()}

    def _mask_rows(
        self, tokens: torch.Tensor, picks: List[Tuple[int, int, int]]
    ) -> Dict[str, torch.Tensor]:
        """Mask each row with its source's masker and epoch (grouped; the masks of a row depend
        only on (source seed, epoch, row), so grouping changes nothing)."""
        groups: Dict[Tuple[int, int], List[int]] = {}
        for r, (i, e, _) in enumerate(picks):
            groups.setdefault((i, e), []).append(r)
        out: Dict[str, torch.Tensor] = {}
        for (i, e), rows in groups.items():
            sel = torch.tensor(rows)
            part = self.maskers[i](tokens[sel], torch.tensor([picks[r][2] for r in rows]), e)
            for k, v in part.items():
                if k not in out:
                    out[k] = torch.empty((len(picks),) + tuple(v.shape[1:]), dtype=v.dtype)
                out[k][sel] = v
        return out


# ================================================================================ opening data
def tokenizer_sha256(dataset: ShardDataset) -> Optional[str]:
    tok = dataset.manifest.get("tokenizer")
    return tok.get("sha256") if isinstance(tok, dict) else None


def check_same_tokenizer(
    names: Sequence[str], datasets: Sequence[ShardDataset], same_seq_len: bool = True
) -> None:
    """Raise :class:`DataError` unless all datasets share the tokenizer (sha256, vocabulary,
    special ids) and, with ``same_seq_len``, N."""
    ref_name, ref = names[0], datasets[0]
    for name, d in zip(names[1:], datasets[1:]):
        a, b = tokenizer_sha256(ref), tokenizer_sha256(d)
        if a != b or d.vocab_size != ref.vocab_size or d.special_ids != ref.special_ids:
            raise DataError(
                f"sources {ref_name!r} ({ref.path}) and {name!r} ({d.path}) have different "
                f"tokenizers (sha256 {str(a)[:12]} vs {str(b)[:12]}, vocab {ref.vocab_size} vs "
                f"{d.vocab_size}); prepare every source with the same tokenizer "
                "(data_prep --tokenizer FIRST/tokenizer.model)"
            )
        if same_seq_len and d.seq_len != ref.seq_len:
            raise DataError(
                f"sources {ref_name!r} ({ref.path}) and {name!r} ({d.path}) have different "
                f"sequence lengths (N={ref.seq_len} vs {d.seq_len}); one mixture needs one N "
                "(put the lengths in separate train.stages)"
            )


def open_sources(
    names: Sequence[str],
    paths: Sequence[str],
    split: str,
    model_config: Any = None,
    verify_checksums: bool = False,
) -> List[ShardDataset]:
    """Open one split of every source, checked against the model and against each other
    (same tokenizer and N); :class:`DataError` names the source."""
    datasets = []
    for name, path in zip(names, paths):
        try:
            d = ShardDataset(path, split, verify_checksums)
            if model_config is not None:
                check_compatible(d, model_config)
        except DataError as e:
            raise DataError(f"source {name!r}: {e}") from None
        datasets.append(d)
    check_same_tokenizer(names, datasets)
    return datasets
