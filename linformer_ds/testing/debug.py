"""Test hooks of the trainer (docs/reliability.md), set by the job config's ``debug:`` keys
that normal runs never set, and attached only then: the sample-index log
(``debug.sample_log=DIR``) and the NaN loss of one step (``debug.nan_at_step``, ``nan_rank``)."""

import contextlib
import json
import os
from typing import Any, TextIO

import torch

from linformer_ds.config import ConfigError


class DebugHooks:
    """A Trainer hook (:class:`linformer_ds.trainer.TrainerHook`): ``sample_observer`` (the
    sample-index log of ``debug.sample_log``, opened when attached) and ``loss`` (a NaN loss at
    one step)."""

    def __init__(
        self,
        sample_log: str | None = None,
        nan_at_step: int | None = None,
        nan_rank: int | None = None,
    ) -> None:
        self.sample_dir = sample_log
        self.nan_step, self.nan_rank = nan_at_step, nan_rank
        self.rank: int | None = None
        self._sample_log: TextIO | None = None

    def attach(self, trainer: Any) -> None:
        """The built Trainer's rank; its data stream logs each batch's sample indices."""
        self.rank = trainer.rank
        if not self.sample_dir:
            return
        path = os.path.join(self.sample_dir, f"samples.rank{self.rank}.jsonl")
        try:
            os.makedirs(self.sample_dir, exist_ok=True)
            self._sample_log = open(path, "a")
        except OSError as e:
            raise ConfigError(f"debug.sample_log: cannot write {path}: {e}") from None
        trainer.batches.on_batch = self.sample_observer(lambda: trainer.step + 1)

    def sample_observer(self, step_fn):
        """A ``TrainData.on_batch`` callback logging ``{step, epoch, rank, indices}``, or None.
        ``step_fn()`` gives the step the batch is for."""
        if self._sample_log is None:
            return None
        log = self._sample_log

        def observe(epoch: int, indices: list[int]) -> None:
            rec = {"step": step_fn(), "epoch": epoch, "rank": self.rank, "indices": indices}
            log.write(json.dumps(rec) + "\n")
            log.flush()

        return observe

    def step(self, step: int) -> contextlib.AbstractContextManager[None]:  # noqa: ARG002
        return contextlib.nullcontext()

    def loss(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        """TEST HOOK: ``loss * NaN`` at the configured step (and rank)."""
        if step == self.nan_step and self.nan_rank in (None, self.rank):
            return loss * float("nan")
        return loss

    def close(self) -> None:
        if self._sample_log is not None:
            self._sample_log.close()
