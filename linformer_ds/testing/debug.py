"""Test hooks of the trainer (docs/reliability.md), set by the job config's ``debug:`` keys
that normal runs never set, and attached only then: the sample-index log
(``debug.sample_log=DIR``) and the NaN loss of one step (``debug.nan_at_step``, ``nan_rank``)."""

import json
import os
from typing import TextIO

import torch

from linformer_ds.config import ConfigError


class DebugHooks:
    """``sample_observer`` (the sample-index log of ``debug.sample_log``) and ``poison`` (a NaN
    loss at one step); ``active``: whether the step must call ``poison`` at all."""

    def __init__(
        self,
        rank: int,
        sample_log: str | None = None,
        nan_at_step: int | None = None,
        nan_rank: int | None = None,
    ) -> None:
        self.rank = rank
        self.nan_step, self.nan_rank = nan_at_step, nan_rank
        self.active = nan_at_step is not None
        self._sample_log: TextIO | None = None
        if sample_log:
            path = os.path.join(sample_log, f"samples.rank{rank}.jsonl")
            try:
                os.makedirs(sample_log, exist_ok=True)
                self._sample_log = open(path, "a")
            except OSError as e:
                raise ConfigError(f"debug.sample_log: cannot write {path}: {e}") from None

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

    def poison(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        """TEST HOOK: ``loss * NaN`` at the configured step (and rank)."""
        if step == self.nan_step and self.nan_rank in (None, self.rank):
            return loss * float("nan")
        return loss

    def close(self) -> None:
        if self._sample_log is not None:
            self._sample_log.close()
