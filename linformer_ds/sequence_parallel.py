"""Sequence parallelism's names as they were imported before ``linformer_ds/parallel/``: a
re-export module (existing imports keep working). The code lives in :mod:`linformer_ds.parallel`:
``checks`` (config checks), ``groups`` (process groups), ``collectives`` (what crosses ranks),
``sharding`` (batch slices, sharded sequence-axis parameters, whole state dicts)."""

from linformer_ds.parallel.checks import (
    ISOLATION_KEY,
    KEY,
    SHARD_KEY,
    SequenceParallelConfigError,
    check_config,
    config_errors,
    isolation_errors,
)
from linformer_ds.parallel.collectives import (
    SequenceParallel,
    _AllGatherBlocks,
    _AllReduceSum,
    _gather_dim1,
    _LocalAttention,
    global_label_count,
    sum_over_group,
)
from linformer_ds.parallel.groups import SequenceParallelGroups, build_groups, group_layout
from linformer_ds.parallel.sharding import (
    SHARD_ATTR,
    _sequence_shaped,
    consolidate_sharded,
    full_state_dict,
    mark_universal_sequence_dims,
    sequence_dim,
    sequence_parameters,
    shard_batch,
    shard_sequence_parameters,
    shard_tensor,
)

__all__ = [
    "ISOLATION_KEY",
    "KEY",
    "SHARD_ATTR",
    "SHARD_KEY",
    "SequenceParallel",
    "SequenceParallelConfigError",
    "SequenceParallelGroups",
    "_AllGatherBlocks",
    "_AllReduceSum",
    "_LocalAttention",
    "_gather_dim1",
    "_sequence_shaped",
    "build_groups",
    "check_config",
    "config_errors",
    "consolidate_sharded",
    "full_state_dict",
    "global_label_count",
    "group_layout",
    "isolation_errors",
    "mark_universal_sequence_dims",
    "sequence_dim",
    "sequence_parameters",
    "shard_batch",
    "shard_sequence_parameters",
    "shard_tensor",
    "sum_over_group",
]
