"""The DP x P grid: P consecutive ranks form one sequence-parallel (SP) group and hold
consecutive slices of the same rows; world = DP x P. Its process groups
(:class:`SequenceParallelGroups`, :func:`build_groups`) and the ``mpu`` objects DeepSpeed
queries for them (:class:`SequenceParallelMPU`, :class:`ShardedSequenceParallelMPU`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from linformer_ds.parallel.checks import KEY, SequenceParallelConfigError


@dataclass
class SequenceParallelGroups:
    """This rank's place in the DP x P grid and the process groups it belongs to.

    ``sp_group``: the P consecutive ranks holding slices of the same rows.
    ``dp_group``: the DP ranks with the same slice position (one per replica).
    ``seq_dp_group``: all DP x P ranks (DeepSpeed reduces and partitions over it).
    """

    sp_size: int
    dp_size: int
    sp_rank: int
    dp_rank: int
    rank: int
    world_size: int
    sp_group: Any
    dp_group: Any
    seq_dp_group: Any
    single_group: Any  # this rank alone (DeepSpeed's model-parallel group of size 1)


def group_layout(world_size: int, sp_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """``(sp_groups, dp_groups)`` as rank lists: SP groups are consecutive ranks."""
    if sp_size < 1 or world_size % sp_size:
        raise SequenceParallelConfigError(
            f"{KEY}: {sp_size} does not divide the world size {world_size}"
        )
    dp = world_size // sp_size
    sp_groups = [list(range(g * sp_size, (g + 1) * sp_size)) for g in range(dp)]
    dp_groups = [list(range(r, world_size, sp_size)) for r in range(sp_size)]
    return sp_groups, dp_groups


def build_groups(sp_size: int) -> SequenceParallelGroups:
    """Create the process groups (every rank must call this, in the same order)."""
    if not dist.is_initialized():
        raise RuntimeError(
            "build_groups needs torch.distributed (deepspeed.init_distributed) first"
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    sp_groups, dp_groups = group_layout(world, sp_size)
    sp_group = dp_group = single = None
    for ranks in sp_groups:
        g = dist.new_group(ranks)
        if rank in ranks:
            sp_group = g
    for ranks in dp_groups:
        g = dist.new_group(ranks)
        if rank in ranks:
            dp_group = g
    seq_dp_group = dist.new_group(list(range(world)))
    for r in range(world):
        g = dist.new_group([r])
        if r == rank:
            single = g
    return SequenceParallelGroups(
        sp_size=sp_size,
        dp_size=world // sp_size,
        sp_rank=rank % sp_size,
        dp_rank=rank // sp_size,
        rank=rank,
        world_size=world,
        sp_group=sp_group,
        dp_group=dp_group,
        seq_dp_group=seq_dp_group,
        single_group=single,
    )


# ========================================================================================== mpus
class SequenceParallelMPU:
    """The ``mpu`` for ``deepspeed.initialize``: data x sequence parallel, no model parallelism.

    DeepSpeed reduces gradients over ``get_sequence_data_parallel_group`` (all DP x P ranks) and
    divides by the DP size (ZeRO 0-2), and counts the batch with ``get_data_parallel_world_size``.
    """

    def __init__(self, groups: SequenceParallelGroups):
        self.groups = groups

    def get_sequence_parallel_world_size(self) -> int:
        return self.groups.sp_size

    def get_sequence_parallel_rank(self) -> int:
        return self.groups.sp_rank

    def get_sequence_parallel_group(self) -> Any:
        return self.groups.sp_group

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.groups.world_size

    def get_sequence_data_parallel_rank(self) -> int:
        return self.groups.rank

    def get_sequence_data_parallel_group(self) -> Any:
        return self.groups.seq_dp_group

    def get_data_parallel_world_size(self) -> int:
        return self.groups.dp_size

    def get_data_parallel_rank(self) -> int:
        return self.groups.dp_rank

    def get_data_parallel_group(self) -> Any:
        return self.groups.dp_group

    # No tensor or pipeline model parallelism: groups of one rank. DeepSpeed's universal loading
    # (base_optimizer.load_hp_checkpoint_state_from_checkpoint_dir) asks for the tensor-parallel
    # size and rank to cut each saved parameter into its TP shard (here: the whole parameter).
    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_group(self) -> Any:
        return self.groups.single_group

    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.groups.rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_pipeline_model_parallel_rank(self) -> int:
        return 0


class ShardedSequenceParallelMPU(SequenceParallelMPU):
    """The ``mpu`` when the sequence-axis parameters are sharded (:func:`shard_for_deepspeed`).

    DeepSpeed sees the SP group as a tensor-parallel group and reduces every gradient over the
    data-parallel group only (DP ranks: the same slice position, so the same shards). Sharded
    parameters carry ``tensor_model_parallel = True``: the gradient norm counts them on every
    rank and the replicated ones once (DeepSpeed sums the norm over the model-parallel group).
    The replicated parameters' gradients are summed over the SP group by hooks beforehand.
    """

    def get_sequence_parallel_world_size(self) -> int:  # DeepSpeed: no sequence-data group
        return 1

    def get_sequence_parallel_rank(self) -> int:
        return 0

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.groups.dp_size

    def get_sequence_data_parallel_rank(self) -> int:
        return self.groups.dp_rank

    def get_sequence_data_parallel_group(self) -> Any:
        return self.groups.dp_group

    def get_model_parallel_world_size(self) -> int:
        return self.groups.sp_size

    def get_model_parallel_rank(self) -> int:
        return self.groups.sp_rank

    def get_model_parallel_group(self) -> Any:
        return self.groups.sp_group

    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.groups.rank - self.groups.sp_rank
