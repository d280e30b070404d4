"""The trainer's data component: the training stream of one rank over the run's stages
(:class:`TrainData`), each a mixture of sources (:class:`MixtureBatches`): sampler -> rows ->
MLM masking -> device tensors."""

from collections.abc import Callable, Sequence
from typing import Any

import torch

from linformer_ds.data.masking import MLMMasking
from linformer_ds.data.sampler import MixtureSampler
from linformer_ds.data.shards import ShardDataset
from linformer_ds.data.stages import Stage
from linformer_ds.model import labelled_positions
from linformer_ds.parallel.sharding import shard_batch


def to_device(batch: dict[str, torch.Tensor], device: str | torch.device) -> dict[str, Any]:
    """A host batch (``input_ids, attention_mask, labels`` ``[B, n]``) on ``device``, with
    ``labelled_index``: the flat indices ``[M]`` of its labelled positions, computed here on
    the host (:func:`linformer_ds.model.labelled_positions`) so that the model's forward never
    waits for the device to learn M. On CUDA the tensors go through pinned memory with
    ``non_blocking``: a pageable copy would wait for the device's queue to drain."""
    device = torch.device(device)
    batch = dict(batch, labelled_index=labelled_positions(batch["labels"]))
    if device.type == "cuda":
        return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}
    return {k: v.to(device) for k, v in batch.items()}


class MixtureBatches:
    """The training stream of one rank over a mixture: sampler -> rows -> MLM masking ->
    device tensors. One source gives the batches of the one-dataset stream before mixtures
    (``tests/legacy_batches.py``), with one state dict for the whole mixture.

    ``datasets`` share the tokenizer and N (see :func:`~linformer_ds.data.shards.open_sources`).
    ``mask_args`` are :class:`MLMMasking`'s ``mlm_probability`` and ``short_seq_prob``. ``rank`` /
    ``world_size`` are the replica's; a sequence-parallel group reads the same rows and keeps
    its ``[B, N / sp_size]`` slice. ``on_batch(epoch, indices)`` is an optional observer
    (one source: the batch epoch and row indices; several: per-row epochs and
    ``[source, row]`` pairs). ``document_isolation``: batches also hold ``position_ids``
    restarting after every sep (:func:`~linformer_ds.data.masking.document_positions`).
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
        device: str | torch.device = "cpu",
        mlm_probability: float = 0.15,
        short_seq_prob: float = 0.0,
        sp_rank: int = 0,
        sp_size: int = 1,
        positions: dict[str, dict[str, int]] | None = None,
        legacy: bool | None = None,
        document_isolation: bool = False,
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
                document_sep_id=d.sep_id if document_isolation else None,
            )
            for d, src in zip(self.datasets, self.sampler.sources)
        ]
        self.seq_len = self.datasets[0].seq_len
        self.micro_batch_size = int(micro_batch_size)
        self.device = torch.device(device)
        self.sp_rank, self.sp_size = int(sp_rank), int(sp_size)
        self.on_batch: Callable[[Any, list[Any]], None] | None = None

    @property
    def epoch(self) -> int:
        """One source: its epoch. Several: the highest source epoch (the most repeated)."""
        return max(s.epoch for s in self.sampler.sources)

    def shares(self) -> dict[str, float]:
        return self.sampler.shares()

    def epochs(self) -> dict[str, float]:
        return self.sampler.epochs()

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)

    def next_rows(self) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """This rank's next micro-batch of rows ``[B, N]`` and their ``(source, epoch, row)``."""
        picks = [self.sampler.next() for _ in range(self.micro_batch_size)]
        tokens = torch.stack([self.datasets[i][row] for i, _, row in picks])
        return tokens, picks

    def next_batch(self) -> dict[str, torch.Tensor]:
        """``input_ids, attention_mask, labels`` ``[micro_batch, N]`` and their
        ``labelled_index`` on the device (:func:`to_device`)."""
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
            batch, _ = shard_batch(batch, self.sp_rank, self.sp_size)
        return to_device(batch, self.device)  # labelled_index of this rank's slice

    def _mask_rows(
        self, tokens: torch.Tensor, picks: list[tuple[int, int, int]]
    ) -> dict[str, torch.Tensor]:
        """Mask each row with its source's masker and epoch (grouped; the masks of a row depend
        only on (source seed, epoch, row), so grouping changes nothing)."""
        groups: dict[tuple[int, int], list[int]] = {}
        for r, (i, e, _) in enumerate(picks):
            groups.setdefault((i, e), []).append(r)
        out: dict[str, torch.Tensor] = {}
        for (i, e), rows in groups.items():
            sel = torch.tensor(rows)
            part = self.maskers[i](tokens[sel], torch.tensor([picks[r][2] for r in rows]), e)
            for k, v in part.items():
                if k not in out:
                    out[k] = torch.empty((len(picks),) + tuple(v.shape[1:]), dtype=v.dtype)
                out[k][sel] = v
        return out


class TrainData:
    """The trainer's data component: the run's stages, each a :class:`MixtureBatches` over
    its sources. :meth:`begin_step` moves to the stage of a step (sources carry their epoch
    and position into later stages that use them again); the state (one dict) holds the
    stage, the mixture's position and the carried positions.

    ``state_dict()`` is ``{"epoch", "sampler": {"epoch", "consumed", "stage", "mixture",
    "positions"}}`` (the keys of the one-dataset stream's state before mixtures, which it
    also loads for one source).
    """

    def __init__(
        self,
        stages: list[Stage],
        datasets: dict[str, ShardDataset],
        rank: int,
        world_size: int,
        seed: int,
        device: str | torch.device = "cpu",
        mlm_probability: float = 0.15,
        short_seq_prob: float = 0.0,
        sp_rank: int = 0,
        sp_size: int = 1,
        document_isolation: bool = False,
    ) -> None:
        self.stages, self.datasets = stages, datasets
        self._args = dict(
            rank=rank, world_size=world_size, seed=seed, device=device,
            mlm_probability=mlm_probability, short_seq_prob=short_seq_prob, sp_rank=sp_rank,
            sp_size=sp_size, document_isolation=document_isolation,
        )  # fmt: skip
        self._on_batch: Callable[[Any, list[Any]], None] | None = None
        self.positions: dict[str, dict[str, int]] = {}  # sources' positions, across stages
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
    def on_batch(self) -> Callable[[Any, list[Any]], None] | None:
        return self._on_batch

    @on_batch.setter
    def on_batch(self, fn: Callable[[Any, list[Any]], None] | None) -> None:
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

    def next_batch(self) -> dict[str, torch.Tensor]:
        return self.mixture.next_batch()

    def log_values(self) -> dict[str, float]:
        """What the ``[train]`` record adds: ``stage`` and ``seq_len`` (a staged run), the
        realized ``share/NAME`` and ``epochs/NAME`` of each source (a run on several sources);
        nothing for a one-source run."""
        out: dict[str, float] = {}
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

    def shares(self) -> dict[str, float]:
        return self.mixture.shares()

    def epochs(self) -> dict[str, float]:
        return self.mixture.epochs()

    def state_dict(self) -> dict[str, Any]:
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

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` output, or a one-source state from before mixtures
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
        if mix is None:  # a state from before mixtures: one source
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
