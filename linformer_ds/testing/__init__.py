"""Test instruments a Trainer runs as hooks (:class:`linformer_ds.trainer.TrainerHook`) when a
``debug.*`` key asks for them: the sample log and injected non-finite losses (``debug``), the
count of device-to-host synchronisations (``hostsync``). The command line passes them
(:func:`trainer_hooks`); the trainer never imports this package. Used by the tests and the GPU
kit, never by a normal run."""

from linformer_ds.config import JobConfig
from linformer_ds.testing.debug import DebugHooks
from linformer_ds.testing.hostsync import StepSyncLog


def trainer_hooks(cfg: JobConfig) -> list:
    """The hooks ``cfg``'s ``debug.*`` keys ask for (none in a normal run), for
    ``Trainer(hooks=...)``; they open their files when attached to the built Trainer."""
    d = cfg.debug
    hooks: list = []
    if d.sample_log or d.nan_at_step is not None:
        hooks.append(DebugHooks(d.sample_log, d.nan_at_step, d.nan_rank))
    if d.sync_log:  # host syncs of debug.sync_steps counted
        hooks.append(StepSyncLog(d.sync_log, d.sync_steps))
    return hooks
