"""The training loss's own small module: the label of an unscored position (:data:`IGNORE_INDEX`)
and :class:`LossScaling`, the rule that makes the update follow the gradient of the step's
global mean cross-entropy in every layout (ranks, sequence parallelism, ZeRO stage,
accumulation). Any layer may import it (the data's masking, the trainer, the benchmarks)
without pulling in the trainer; it imports the engine's all-reduce and the parallelize step's
sharding decision, nothing that imports it back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from linformer_ds.config import JobConfig
from linformer_ds.engine import all_reduce_sum
from linformer_ds.parallel.parallelize import resolved_shard

IGNORE_INDEX = -100  # the label of a position the loss does not score (torch's default)


@dataclass(frozen=True)
class LossScaling:
    """The loss/gradient scaling rule of every layout (ranks, P, ZeRO stage, accumulation).

    Target: the update follows the gradient of the step's global mean cross-entropy
    ``L = (sum of CE over every labelled token of the step) / C``, where ``C`` counts the labelled
    tokens of every micro-batch of every rank (data-parallel replicas and sequence slices: the
    slices partition a row's positions, so each token is counted once).

    1. Each rank's micro-batch loss is its own sum of cross-entropies over the same ``C``
       (:meth:`denominator`, handed to the model as ``loss_denominator``), so ``L`` is the sum
       of the ``W x GAS`` micro-batch losses (W ranks) and ``grad L`` the sum of their
       gradients.
    2. DeepSpeed 0.19 divides each micro-batch's gradient by GAS, sums over its reduction group
       and divides by its data-parallel size: ``DP`` = ranks / P (``SequenceParallelMPU``'s
       ``get_data_parallel_world_size``; plain data parallelism: all ranks). Unsharded
       (``SequenceParallelMPU``) it sums over all DP x P ranks; sharded
       (``ShardedSequenceParallelMPU``) over the DP ranks of a slice position, the P slices'
       shares of a replicated parameter having been summed by the gradient hooks, and a sharded
       parameter's gradient being complete on its rank. Either way every micro-batch term is
       summed once, times ``1 / (GAS x DP)``: :attr:`grad_factor` = ``DP x GAS`` undoes it.
    3. ZeRO-3 unsharded with P > 1 reduce-scatters over DP x P ranks and divides by DP x P
       (``reduce_scatter_coalesced``), one factor P more: :attr:`backward_scale` = P.

    On one rank without accumulation there is nothing to count across: :meth:`denominator`
    returns None and the model counts its own labels (the same number, the same bits).
    """

    world_size: int  # all ranks (DP x P)
    sp_size: int = 1  # P
    zero_stage: int = 0
    sharded: bool = False  # E/F columns and position rows sharded (parallel.shard_...)
    accumulation_steps: int = 1  # GAS

    @classmethod
    def for_job(cls, cfg: JobConfig, world_size: int) -> LossScaling:
        """The rule for ``cfg`` on ``world_size`` ranks (sharding as
        :func:`~linformer_ds.parallel.parallelize.parallelize` chose)."""
        return cls(
            world_size=world_size,
            sp_size=cfg.parallel.sequence_parallel_size,
            zero_stage=cfg.deepspeed.zero.stage,
            sharded=resolved_shard(cfg),
            accumulation_steps=cfg.train.gradient_accumulation_steps,
        )

    @property
    def replicas(self) -> int:
        """DP: the data-parallel replicas (ranks / P)."""
        return self.world_size // self.sp_size

    @property
    def backward_scale(self) -> float:
        """What DeepSpeed divides more than DP: P under ZeRO-3 with P > 1 unsharded, else 1."""
        return float(self.sp_size) if self.zero_stage == 3 and not self.sharded else 1.0

    @property
    def grad_factor(self) -> float:
        """The factor on each micro-batch loss before ``engine.backward``: DP x GAS x
        :attr:`backward_scale`."""
        return float(self.replicas * self.accumulation_steps) * self.backward_scale

    def denominator(
        self, labels: Sequence[torch.Tensor], device: torch.device
    ) -> torch.Tensor | None:
        """``C``: the labelled tokens of the step's micro-batches' ``labels`` (``[B, n]`` each,
        this rank's rows or slices) summed over all ranks by one all-reduce on the device; a
        float32 scalar, at least 1. None on one rank with one micro-batch (the model counts)."""
        if self.world_size == 1 and len(labels) == 1:
            return None
        count = sum((lab != IGNORE_INDEX).sum() for lab in labels).reshape(1)
        if self.world_size > 1:
            all_reduce_sum(count, device)
        return count.to(torch.float32).clamp_min(1.0)[0]

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times :attr:`grad_factor` (the tensor itself when the factor is 1)."""
        return loss * self.grad_factor if self.grad_factor != 1.0 else loss
