"""Checkpoints through DeepSpeed, plus what DeepSpeed does not do for us.

- :mod:`~linformer_ds.checkpoint.tags`: the layout of ``checkpoint.dir``, tag names, validation,
  ``latest`` and the choice of the tag to resume from or export.
- :mod:`~linformer_ds.checkpoint.io`: crash-safe saving, the metadata checks against the config
  (model, seed, data), safe loading (``weights_only=True``).
- :mod:`~linformer_ds.checkpoint.reshard`: resuming in another layout or engine config
  (universal checkpoint, ZeRO-0 re-sharding).
- :mod:`~linformer_ds.checkpoint.manager`: :class:`CheckpointManager`, what the trainer saves,
  when, and resuming.

Each module imports only those above it (tags <- io <- reshard <- manager).
"""

from linformer_ds.checkpoint.manager import CheckpointManager, Stateful
from linformer_ds.checkpoint.tags import CheckpointError

__all__ = ["CheckpointError", "CheckpointManager", "Stateful"]
