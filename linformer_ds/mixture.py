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

A run on one source is today's single-dataset stream, bit for bit (``legacy``): the
permutation of epoch ``e`` is seeded by ``(seed, e)``, an epoch ends when fewer than ``W`` of
its rows are left (the ragged tail is dropped), and a batch is masked with the epoch of its last
row, as :class:`linformer_ds.data.TrainBatches` does. With several sources (in the run, over
all its stages) every source epoch is whole (no rank count in the stream), each source has its
own seed (``seed`` and a hash of its name) for its permutations and masks, and a row is masked
with its own source epoch.
"""

import math
import os
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import numpy as np
import torch

from linformer_ds.data import DataError, MLMMasking, ShardDataset, check_compatible, to_device
from linformer_ds.metrics import Sink


def source_seed(seed: int, name: str, legacy: bool) -> int:
    """The seed of one source's permutations and masks: ``seed`` itself for the lone source
    of a run (today's stream), else ``seed`` with a hash of the name in the high bits (< 2**63).
    """
    if legacy:
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
        positions: Optional[Dict[str, Dict[str, int]]] = None,
        legacy: Optional[bool] = None,
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
        legacy: Optional[bool] = None,
    ) -> None:
        self.names, self.datasets = list(names), list(datasets)
        self.sampler = MixtureSampler(
            self.names, [len(d) for d in self.datasets], weights, rank, world_size, seed,
            positions=positions, legacy=legacy,
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
            )
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
        """``input_ids, attention_mask, labels`` ``[micro_batch, N]`` and their
        ``labelled_index`` on the device (:func:`linformer_ds.data.to_device`)."""
        tokens, picks = self.next_rows()
        if self.sampler.legacy:
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
        return to_device(batch, self.device)  # labelled_index of this rank's slice

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
    same_seq_len: bool = True,
) -> List[ShardDataset]:
    """Open one split of every source, checked against the model and against each other
    (same tokenizer; same N with ``same_seq_len``); :class:`DataError` names the source."""
    datasets = []
    for name, path in zip(names, paths):
        try:
            d = ShardDataset(path, split, verify_checksums)
            if model_config is not None:
                check_compatible(d, model_config)
        except DataError as e:
            raise DataError(f"source {name!r}: {e}") from None
        datasets.append(d)
    check_same_tokenizer(names, datasets, same_seq_len)
    return datasets


# ==================================================================================== stages
@dataclass
class Stage:
    """One stretch of the run: steps up to ``end_step`` train on a mixture of ``names`` (paths
    ``paths``, normalized ``weights``) with ``micro_batch_size`` rows per rank."""

    end_step: int
    names: List[str]
    paths: List[str]
    weights: List[float]
    micro_batch_size: int


def _fail(msg: str) -> None:
    from linformer_ds.config import ConfigError

    raise ConfigError(msg)


def _path_name(path: str) -> str:
    return os.path.basename(os.path.normpath(str(path))) or str(path)


def _catalogue(cfg: Any) -> Tuple[Dict[str, Tuple[str, float]], List[str]]:
    """``data.sources`` (or ``data.path``, the one-source shorthand) as ``name -> (path,
    weight)`` plus the names in order; a :class:`ConfigError` for a malformed entry."""
    sources = list(getattr(cfg.data, "sources", None) or [])
    if not sources:
        return {_path_name(cfg.data.path): (str(cfg.data.path), 1.0)}, [_path_name(cfg.data.path)]
    cat: Dict[str, Tuple[str, float]] = {}
    for i, s in enumerate(sources):
        key = f"data.sources[{i}]"
        name, path, weight = str(s.name or "").strip(), str(s.path or "").strip(), s.weight
        if not name:
            _fail(f"{key}.name: must not be empty (a short name for logs and metrics)")
        if any(c in name for c in "/ \t=,"):
            _fail(f"{key}.name: {name!r} must not contain '/', blanks, '=' or ','")
        if name in cat:
            _fail(f"{key}.name: {name!r} is used twice; give every source its own name")
        if not path:
            _fail(f"{key}.path: must not be empty (a data_prep output directory)")
        try:
            normalized_weights([weight, 1.0])
        except ValueError as e:
            _fail(f"{key}.weight: {e} (weights are relative: any numbers >= 0)")
        cat[name] = (path, float(weight))
    return cat, [str(s.name).strip() for s in sources]


def resolve_stages(cfg: Any) -> List[Stage]:
    """The run's stages from ``data.sources`` / ``data.path`` and ``train.stages`` (none: one
    stage over every source to ``train.max_steps``); a :class:`ConfigError` naming the key for
    unknown source names, bad weights and end steps."""
    cat, order = _catalogue(cfg)
    t = cfg.train
    max_steps, mb0 = int(t.max_steps), int(t.micro_batch_size)
    raw = list(getattr(t, "stages", None) or [])
    if not raw:
        try:
            weights = normalized_weights([cat[n][1] for n in order])
        except ValueError as e:
            _fail(f"data.sources: {e}")
        return [Stage(max_steps, order, [cat[n][0] for n in order], weights, mb0)]
    stages: List[Stage] = []
    prev = 0
    for k, st in enumerate(raw):
        key = f"train.stages[{k}]"
        names = list(st.sources or [])
        if bool(names) == bool(st.path):
            _fail(f"{key}: give either sources (names from data.sources) or path (one source)")
        if st.path:
            path = str(st.path)
            same = [n for n in order if os.path.normpath(cat[n][0]) == os.path.normpath(path)]
            names, paths, weights = [same[0] if same else _path_name(path)], [path], [1.0]
        else:
            unknown = [n for n in names if n not in cat]
            if unknown:
                _fail(
                    f"{key}.sources: unknown source {unknown[0]!r}; the sources (data.sources) "
                    f"are {', '.join(order)}"
                )
            if len(set(names)) != len(names):
                _fail(f"{key}.sources: a source is listed twice: {names}")
            paths = [cat[n][0] for n in names]
            weights = [cat[n][1] for n in names]
            if st.weights is not None:
                if len(st.weights) != len(names):
                    _fail(
                        f"{key}.weights: {len(st.weights)} weights for {len(names)} sources "
                        f"({names})"
                    )
                weights = list(st.weights)
        try:
            weights = normalized_weights(weights)
        except ValueError as e:
            _fail(f"{key}.weights: {e}")
        end = st.end_step
        last = k == len(raw) - 1
        if end is None and not last:
            _fail(f"{key}.end_step: only the last stage may leave it unset (= train.max_steps)")
        end = max_steps if end is None else int(end)
        if end <= prev:
            _fail(
                f"{key}.end_step: {end} must be greater than the previous stage's end "
                f"({prev}); stages are in step order"
            )
        if last and end != max_steps:
            _fail(
                f"{key}.end_step: the last stage must end at train.max_steps={max_steps} (the "
                f"LR schedule runs over the whole run), got {end}"
            )
        mb = mb0 if st.micro_batch_size is None else int(st.micro_batch_size)
        if mb < 1:
            _fail(f"{key}.micro_batch_size: must be >= 1 (or null: train.micro_batch_size)")
        if mb != mb0 and getattr(t, "global_batch_size", None) is not None:
            _fail(
                f"{key}.micro_batch_size: {mb} changes the global batch, which "
                "train.global_batch_size fixes; unset one of them"
            )
        stages.append(Stage(end, names, paths, weights, mb))
        prev = end
    return stages


def check_stage_lengths(
    cfg: Any, stages: List[Stage], seq_lens: List[int], world_size: int
) -> None:
    """What the data's N per stage must satisfy: N <= model.max_seq_len, every conv layer's
    stride divides N (a staged run; conv windows never straddle padding), and the
    sequence-parallel split of each stage's N."""
    model = cfg.model
    staged = len(list(getattr(cfg.train, "stages", None) or [])) > 0
    for k, (stage, n) in enumerate(zip(stages, seq_lens)):
        where = f"train.stages[{k}] (N={n} from {stage.paths[0]})" if staged else f"data (N={n})"
        if n > model.max_seq_len:
            _fail(f"{where}: N exceeds model.max_seq_len={model.max_seq_len}; size the model "
                  "for the largest stage")  # fmt: skip
        if staged:
            for i, kind in enumerate(model.projection_schedule()):
                r = model.conv_stride(i)
                if kind == "conv" and n % r:
                    _fail(
                        f"{where}: conv layer {i} has stride max_seq_len / k = {r}, which does "
                        f"not divide N; use an N that is a multiple of {r}"
                    )
        sp = int(cfg.parallel.sequence_parallel_size)
        if sp > 1:
            from linformer_ds.sequence_parallel import config_errors

            extra = cfg.deepspeed.extra_dict() if hasattr(cfg.deepspeed, "extra_dict") else {}
            scatter = extra.get("zero_optimization", {}).get("reduce_scatter", True)
            errors = config_errors(
                sp, world_size=world_size, seq_len=n, model=model,
                zero_stage=cfg.deepspeed.zero.stage, zero_reduce_scatter=bool(scatter),
                shard=getattr(cfg.parallel, "shard_sequence_parameters", False),  # or auto
            )  # fmt: skip
            if errors:
                _fail(f"{where}: {errors[0]}")


class TrainData:
    """The trainer's data component: the run's stages, each a :class:`MixtureBatches` over
    its sources. :meth:`begin_step` moves to the stage of a step (sources carry their epoch
    and position into later stages that use them again); the state (one dict) holds the
    stage, the mixture's position and the carried positions.

    ``state_dict()`` is ``{"epoch", "sampler": {"epoch", "consumed", "stage", "mixture",
    "positions"}}`` (the keys of :class:`linformer_ds.data.TrainBatches`'s state, which it
    also loads for one source).
    """

    def __init__(
        self,
        stages: List[Stage],
        datasets: Dict[str, ShardDataset],
        rank: int,
        world_size: int,
        seed: int,
        device: Union[str, torch.device] = "cpu",
        mlm_probability: float = 0.15,
        short_seq_prob: float = 0.0,
        sp_rank: int = 0,
        sp_size: int = 1,
    ) -> None:
        self.stages, self.datasets = stages, datasets
        self._args = dict(
            rank=rank, world_size=world_size, seed=seed, device=device,
            mlm_probability=mlm_probability, short_seq_prob=short_seq_prob, sp_rank=sp_rank,
            sp_size=sp_size,
        )  # fmt: skip
        self._on_batch: Optional[Callable[[Any, List[Any]], None]] = None
        self.positions: Dict[str, Dict[str, int]] = {}  # sources' positions, across stages
        # one source in the whole run: today's stream; else mixture rules in every stage
        self.legacy = len({n for s in stages for n in s.names}) == 1
        self.stage_index = 0
        self.mixture = self._open(0)

    def _open(self, k: int) -> MixtureBatches:
        s = self.stages[k]
        mix = MixtureBatches(
            s.names, [self.datasets[n] for n in s.names], s.weights,
            micro_batch_size=s.micro_batch_size, positions=self.positions, legacy=self.legacy,
            **self._args,
        )  # fmt: skip
        mix.on_batch = self._on_batch
        return mix

    @property
    def stage(self) -> Stage:
        return self.stages[self.stage_index]

    @property
    def seq_len(self) -> int:
        return self.mixture.seq_len

    @property
    def epoch(self) -> int:
        return self.mixture.epoch

    @property
    def on_batch(self) -> Optional[Callable[[Any, List[Any]], None]]:
        return self._on_batch

    @on_batch.setter
    def on_batch(self, fn: Optional[Callable[[Any, List[Any]], None]]) -> None:
        self._on_batch = fn
        self.mixture.on_batch = fn

    def stage_of(self, step: int) -> int:
        """The stage that trains ``step`` (1-based; steps past the end: the last stage)."""
        for k, s in enumerate(self.stages):
            if step <= s.end_step:
                return k
        return len(self.stages) - 1

    def begin_step(self, step: int) -> bool:
        """Before training ``step``: move to its stage; True when the stage changed."""
        k = self.stage_of(step)
        if k == self.stage_index:
            return False
        self._carry()
        self.stage_index = k
        self.mixture = self._open(k)
        return True

    def _carry(self) -> None:
        for name, st in self.mixture.state_dict()["sources"].items():
            self.positions[name] = {"epoch": st["epoch"], "consumed": st["consumed"]}

    def next_batch(self) -> Dict[str, torch.Tensor]:
        return self.mixture.next_batch()

    def log_values(self) -> Dict[str, float]:
        """What the ``[train]`` record adds: ``stage`` and ``seq_len`` (a staged run), the
        realized ``share/NAME`` and ``epochs/NAME`` of each source (a run on several sources);
        nothing for a one-source run."""
        out: Dict[str, float] = {}
        if len(self.stages) > 1:
            out.update(stage=self.stage_index, seq_len=self.seq_len)
        if not self.legacy:
            out.update({f"share/{n}": v for n, v in self.shares().items()})
            out.update({f"epochs/{n}": v for n, v in self.epochs().items()})
        return out

    def tokens_per_step(self, gradient_accumulation_steps: int) -> int:
        """Tokens of one optimizer step of the current stage, all replicas together."""
        mb, n = self.stage.micro_batch_size, self.seq_len
        return mb * int(gradient_accumulation_steps) * int(self._args["world_size"]) * n

    def describe(self) -> str:
        """The ``[stage]`` line of the current stage's start."""
        k, s = self.stage_index, self.stage
        first = self.stages[k - 1].end_step + 1 if k else 1
        mix = " ".join(f"{n}={w:.3g}" for n, w in zip(s.names, s.weights))
        return (
            f"[stage] {k} start: steps {first}-{s.end_step}, N={self.seq_len}, "
            f"micro_batch_size={s.micro_batch_size}, sources {mix}"
        )

    def shares(self) -> Dict[str, float]:
        return self.mixture.shares()

    def epochs(self) -> Dict[str, float]:
        return self.mixture.epochs()

    def state_dict(self) -> Dict[str, Any]:
        mix = self.mixture.state_dict()
        if self.mixture.sampler.legacy:
            only = next(iter(mix["sources"].values()))
            epoch, consumed = only["epoch"], only["consumed"]
        else:
            epoch, consumed = self.epoch, mix["position"]
        self._carry()
        return {
            "epoch": epoch,
            "sampler": {
                "epoch": epoch,
                "consumed": consumed,
                "stage": self.stage_index,
                "mixture": mix,
                "positions": {k: dict(v) for k, v in self.positions.items()},
            },
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` output, or a one-source ``TrainBatches`` state
        (``ValueError`` when it does not fit these sources)."""
        s = dict(state["sampler"])
        k = int(s.get("stage", 0))
        if not 0 <= k < len(self.stages):
            raise ValueError(
                f"the checkpoint is in stage {k}, the config has {len(self.stages)} stage(s)"
            )
        self.positions = {n: dict(v) for n, v in (s.get("positions") or {}).items()}
        self.stage_index = k
        self.mixture = self._open(k)
        mix = s.get("mixture")
        single = self.mixture.sampler.legacy
        name = self.stage.names[0]
        if mix is None:  # a TrainBatches state: one source
            if not single:
                raise ValueError(
                    "the checkpoint was trained on one dataset, the config mixes "
                    f"{len(self.stage.names)} sources; start a new run for the mixture"
                )
            c = int(s["consumed"])
            position = {"epoch": int(state["epoch"]), "consumed": c, "count": c}
            mix = {"position": c, "sources": {name: position}}
        elif single and len(mix["sources"]) == 1:  # one source: its name may change (a path)
            mix = {
                "position": mix["position"],
                "sources": {name: next(iter(mix["sources"].values()))},
            }
        self.mixture.load_state_dict(mix)


class StageMeter(Sink):
    """Throughput, MFU and peak memory of the current stage, from this process's steps (after
    a resume: the steps since it): a metrics sink that counts the step times. On CUDA the peak
    is the stage's (reset at its start); on CPU the process's resident-set peak so far."""

    def __init__(self, device: Union[str, torch.device]) -> None:
        self.device = torch.device(device)
        self.index, self.steps, self.seconds = -1, 0, 0.0
        self.tokens_per_step, self.flops_per_token = 0, 0.0

    def start(self, index: int, tokens_per_step: int, flops_per_token: float) -> None:
        self.index, self.steps, self.seconds = index, 0, 0.0
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def step_done(self, step: int, seconds: float, tokens: float, skipped: bool, eta: float):
        self.steps += 1
        self.seconds += seconds

    def figures(self, world_size: int, peak_tflops: float) -> Dict[str, float]:
        """``tokens_per_s`` (all ranks), ``mfu`` and ``peak_mem_gb`` (this rank)."""
        from linformer_ds.perf import MemoryProbe

        tps = self.steps * self.tokens_per_step / max(self.seconds, 1e-9)
        tflops = self.flops_per_token * tps / world_size / 1e12
        return {
            "tokens_per_s": tps,
            "mfu": tflops / peak_tflops,
            "peak_mem_gb": MemoryProbe(self.device).peak() / 2**30,
        }


def combine_eval(
    stage: Stage, figures: Dict[str, Dict[str, float]], legacy: bool
) -> Dict[str, float]:
    """The ``[eval]`` record of a stage from each source's figures (``loss``, ``perplexity``,
    ``mlm_accuracy``): the mixture's ``loss`` and ``mlm_accuracy`` are the means weighted by the
    training weights (``perplexity`` = exp(loss)), plus ``loss/NAME`` etc. per source (not for
    a one-source run, whose record is the source's)."""
    if legacy:
        return dict(next(iter(figures.values())))
    loss = sum(w * figures[n]["loss"] for n, w in zip(stage.names, stage.weights))
    acc = sum(w * figures[n]["mlm_accuracy"] for n, w in zip(stage.names, stage.weights))
    out = {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "mlm_accuracy": acc}
    for n in stage.names:
        out.update({f"{k}/{n}": v for k, v in figures[n].items()})
    return out


def open_stages(
    cfg: Any, world_size: int, with_valid: bool
) -> Tuple[List[Stage], Dict[str, ShardDataset], Dict[str, ShardDataset]]:
    """The run's stages and the train (and, ``with_valid``, valid) split of every source they
    use, checked: same tokenizer everywhere, one N per stage, each stage's N against the model
    (:func:`check_stage_lengths`). :class:`DataError` / ``ConfigError`` name the problem."""
    stages = resolve_stages(cfg)
    names = list(dict.fromkeys(n for s in stages for n in s.names))
    paths = {n: p for s in stages for n, p in zip(s.names, s.paths)}
    d = cfg.data
    opened = open_sources(names, [paths[n] for n in names], d.train_split, cfg.model,
                          d.verify_checksums, same_seq_len=False)  # fmt: skip
    train = dict(zip(names, opened))
    for s in stages:
        check_same_tokenizer(s.names, [train[n] for n in s.names])
    check_stage_lengths(cfg, stages, [train[s.names[0]].seq_len for s in stages], world_size)
    valid: Dict[str, ShardDataset] = {}
    if with_valid:
        opened = open_sources(names, [paths[n] for n in names], d.valid_split, cfg.model,
                              d.verify_checksums, same_seq_len=False)  # fmt: skip
        valid = dict(zip(names, opened))
    return stages, train, valid
