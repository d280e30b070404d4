"""The single-dataset training stream from before mixtures (``TrainBatches`` and its
``ResumableDistributedSampler``), kept only as the tests' reference: one source through
:class:`linformer_ds.data.stream.TrainData` must give exactly its rows, masks and state, and
TrainData must load its checkpoint state. Production trains through TrainData."""

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from linformer_ds.data.masking import MLMMasking
from linformer_ds.data.shards import DataError, ShardDataset
from linformer_ds.data.stream import to_device
from linformer_ds.parallel.sharding import shard_batch


class ResumableDistributedSampler(torch.utils.data.Sampler[int]):
    """Deterministic sharded sampling whose position can be saved and restored.

    Epoch ``e`` uses the permutation seeded by ``(seed, e)``. Starting from position ``start``
    (the samples all ranks together have consumed), rank ``r`` yields positions
    ``start + r, start + r + W, ...`` for ``(num_samples - start) // W`` steps (the ragged tail
    of fewer than ``W`` samples is dropped, so every rank yields the same count).

    Consumption is counted as indices are yielded, assuming the ranks advance in lockstep:
    ``consumed = start + W * yielded_by_this_rank``. Iterate it directly (or through a
    ``DataLoader`` without prefetching workers); a prefetching loader would count prefetched
    samples as consumed. :meth:`load_state_dict` accepts a state saved under any world size.
    The iterator ends when the epoch is exhausted; call :meth:`set_epoch` with the next epoch.
    """

    def __init__(
        self, num_samples: int, rank: int, world_size: int, seed: int = 0, shuffle: bool = True
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"bad rank {rank} for world_size {world_size}")
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        self.num_samples = int(num_samples)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.seed = int(seed)
        self.shuffle = shuffle
        self.epoch = 0
        self._start = 0  # consumed by all ranks when the current iterator began
        self._yielded = 0  # indices this rank's current iterator has yielded

    @property
    def consumed(self) -> int:
        """Samples of the current epoch consumed by all ranks together."""
        return self._start + self._yielded * self.world_size

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch`` (from its start); a no-op if already there, keeping the position."""
        if int(epoch) != self.epoch:
            self.epoch = int(epoch)
            self._start = 0
            self._yielded = 0

    def permutation(self, epoch: int | None = None) -> np.ndarray:
        """The order of epoch ``epoch`` (default: the current one)."""
        e = self.epoch if epoch is None else int(epoch)
        if not self.shuffle:
            return np.arange(self.num_samples)
        return np.random.default_rng([self.seed % 2**63, e % 2**63]).permutation(self.num_samples)

    def __len__(self) -> int:
        return (self.num_samples - self.consumed) // self.world_size

    def __iter__(self) -> Iterator[int]:
        start = self.consumed
        self._start, self._yielded = start, 0
        perm = self.permutation()
        for j in range((self.num_samples - start) // self.world_size):
            self._yielded += 1  # counted when handed out
            yield int(perm[start + self.rank + j * self.world_size])

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "consumed"}``: enough to continue under any world size."""
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved position (saved under any world size)."""
        consumed = int(state["consumed"])
        if not 0 <= consumed <= self.num_samples:
            raise ValueError(
                f"sampler state consumed={consumed} is outside [0, {self.num_samples}]: "
                "the dataset changed since the checkpoint"
            )
        self.epoch = int(state["epoch"])
        self._start, self._yielded = consumed, 0


class TrainBatches:
    """The training stream of one rank: sampler -> rows -> MLM masking -> device tensors.

    ``next_batch()`` returns ``input_ids, attention_mask, labels`` ``[micro_batch, N]`` and their
    ``labelled_index`` (see :func:`to_device`); it moves to the next epoch when the current one is exhausted. ``state_dict`` / ``load_state_dict``
    carry the position (any world size). ``on_batch(step_epoch, indices)`` is an optional
    observer (the trainer's sample-log debug hook).

    Sequence parallel: ``rank`` / ``world_size`` are the replica's (data-parallel) rank and
    count, so the ``sp_size`` ranks of a group read the same rows and masks; each keeps its
    ``[B, N / sp_size]`` slice (``sp_rank``).
    """

    def __init__(
        self,
        dataset: ShardDataset,
        masker: MLMMasking,
        rank: int,
        world_size: int,
        micro_batch_size: int,
        seed: int,
        device: str | torch.device = "cpu",
        sp_rank: int = 0,
        sp_size: int = 1,
    ) -> None:
        self.dataset, self.masker = dataset, masker
        self.sp_rank, self.sp_size = int(sp_rank), int(sp_size)
        self.micro_batch_size = int(micro_batch_size)
        self.device = torch.device(device)
        self.sampler = ResumableDistributedSampler(len(dataset), rank, world_size, seed=seed)
        self.world_size = world_size
        self.epoch = 0
        self._it: Iterator[int] | None = None
        self.on_batch = None

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "sampler": {"epoch", "consumed"}}``: the position, for any world size."""
        return {"epoch": self.epoch, "sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s result (a ``ValueError`` if it cannot apply)."""
        self.sampler.load_state_dict(state["sampler"])
        self.epoch = int(state["epoch"])
        self._it = None

    def _next_index(self) -> int:
        if self._it is None:
            self.sampler.set_epoch(self.epoch)
            self._it = iter(self.sampler)
        try:
            return next(self._it)
        except StopIteration:
            self.epoch += 1
            self.sampler.set_epoch(self.epoch)
            self._it = iter(self.sampler)
            if len(self.sampler) == 0:
                raise DataError(
                    f"{self.dataset.path}: the {self.dataset.split} split has {len(self.dataset)} "
                    f"rows: too few for {self.world_size} ranks"
                ) from None
            return next(self._it)

    def next_batch(self) -> dict[str, torch.Tensor]:
        idx = [self._next_index() for _ in range(self.micro_batch_size)]
        if self.on_batch is not None:
            self.on_batch(self.epoch, idx)
        tokens = torch.stack([self.dataset[i] for i in idx])
        batch = self.masker(tokens, torch.tensor(idx), self.epoch)
        if self.sp_size > 1:
            batch, _ = shard_batch(batch, self.sp_rank, self.sp_size)
        return to_device(batch, self.device)  # labelled_index of this rank's slice
