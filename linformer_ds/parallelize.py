"""The parallelize step's names as they were imported before ``linformer_ds/parallel/``: a
re-export module (existing imports keep working). The code lives in
:mod:`linformer_ds.parallel.parallelize` (the step and ``LossScaling``),
:mod:`linformer_ds.parallel.groups` (the mpus) and :mod:`linformer_ds.parallel.sharding`
(``universal_checkpoint_info``)."""

from linformer_ds.parallel.groups import SequenceParallelMPU, ShardedSequenceParallelMPU
from linformer_ds.parallel.parallelize import (
    LossScaling,
    apply_activation_checkpointing,
    apply_sequence_parallel,
    parallelize,
    partition_for_zero3,
    resolved_shard,
    shard_for_deepspeed,
    use_deepspeed_mpu,
)
from linformer_ds.parallel.sharding import universal_checkpoint_info

__all__ = [
    "LossScaling",
    "SequenceParallelMPU",
    "ShardedSequenceParallelMPU",
    "apply_activation_checkpointing",
    "apply_sequence_parallel",
    "parallelize",
    "partition_for_zero3",
    "resolved_shard",
    "shard_for_deepspeed",
    "universal_checkpoint_info",
    "use_deepspeed_mpu",
]
