"""Test hooks of the trainer, read from environment variables that normal runs never set
(documented in docs/reliability.md). All of them live behind one small object."""

import json
import os
from typing import List, Optional, TextIO

import torch

from linformer_ds.config import ConfigError

SAMPLE_LOG_ENV = "LINFORMER_DS_SAMPLE_LOG"  # dir: each rank appends the sample indices per step
TEST_NAN_ENV = "LINFORMER_DS_TEST_HOOK_NAN_AT_STEP"  # "STEP[:RANK]": TEST HOOK, loss *= NaN


def _parse_nan_hook(value: str):
    """``"STEP[:RANK]"`` of the NaN test hook -> (step, rank or None for all); 0 when unset."""
    if not value:
        return 0, None
    step, _, rank = value.partition(":")
    try:
        return int(step), (int(rank) if rank else None)
    except ValueError:
        raise ConfigError(f"{TEST_NAN_ENV}={value!r}: expected STEP or STEP:RANK") from None


class DebugHooks:
    """``record_samples`` (sample-index log per step) and ``poison`` (a NaN loss at one step)."""

    def __init__(self, rank: int, environ: Optional[dict] = None):
        env = os.environ if environ is None else environ
        self.rank = rank
        self.nan_step, self.nan_rank = _parse_nan_hook(env.get(TEST_NAN_ENV, ""))
        self._sample_log: Optional[TextIO] = None
        if env.get(SAMPLE_LOG_ENV):
            os.makedirs(env[SAMPLE_LOG_ENV], exist_ok=True)
            path = os.path.join(env[SAMPLE_LOG_ENV], f"samples.rank{rank}.jsonl")
            self._sample_log = open(path, "a")

    def sample_observer(self, step_fn):
        """A ``TrainData.on_batch`` callback logging ``{step, epoch, rank, indices}``, or None.
        ``step_fn()`` gives the step the batch is for."""
        if self._sample_log is None:
            return None
        log = self._sample_log

        def observe(epoch: int, indices: List[int]) -> None:
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
