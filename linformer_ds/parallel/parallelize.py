"""The parallelize step: everything that turns the plain model into this layout's model, in one
place (as torchtitan's ``parallelize_*``). The loss/gradient scaling rule that goes with it is
:class:`linformer_ds.loss.LossScaling`.

The trainer's calls, in order::

    groups = init_sequence_parallel(cfg)         # engine.py; None unless P > 1
    model = build_model(cfg)                     # the plain model, same seed on every rank
    mpu = parallelize(model, cfg, ds_config, groups)
    engine = build_engine(model, cfg, ds_config, mpu)   # deepspeed.initialize(mpu=mpu, ...)
    scaling = LossScaling.for_job(cfg, world_size)      # linformer_ds/loss.py
    denom = scaling.denominator([labels of each micro-batch], device)
    engine.backward(scaling.scale(model(..., loss_denominator=denom).loss))

:func:`parallelize` applies, to the plain model: sequence parallelism (E/F columns and position
rows sharded per SP rank with the gradient hooks and :class:`ShardedSequenceParallelMPU`, or
whole with ZeRO-3 partitioned over all DP x P ranks and :class:`SequenceParallelMPU`; then the
layers' :class:`~linformer_ds.parallel.collectives.SequenceParallel` hooks) and activation
checkpointing; and it installs this engine's ``mpu`` as DeepSpeed's process-wide one. The
collectives, groups and parameter sharding themselves are in the other modules of
:mod:`linformer_ds.parallel`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from linformer_ds.config import JobConfig
from linformer_ds.log import get_logger
from linformer_ds.model import LinformerEncoder, LinformerSelfAttention, get_projection
from linformer_ds.parallel.collectives import SequenceParallel, sum_over_group
from linformer_ds.parallel.groups import (
    SequenceParallelGroups,
    SequenceParallelMPU,
    ShardedSequenceParallelMPU,
)
from linformer_ds.parallel.sharding import shard_sequence_parameters, universal_checkpoint_info

log = get_logger(__name__)


def resolved_shard(cfg: JobConfig) -> bool:
    """``parallel.shard_sequence_parameters`` of a resolved config (``auto`` is decided once,
    where the config is resolved with N known; ``auto_shard`` says why)."""
    shard = cfg.parallel.shard_sequence_parameters
    if shard == "auto":
        raise ValueError(
            "parallel.shard_sequence_parameters is still auto: resolve the config (N known) "
            "before parallelize / LossScaling"
        )
    return bool(shard)


def parallelize(
    model: nn.Module,
    cfg: JobConfig,
    ds_config: dict[str, Any],
    groups: SequenceParallelGroups | None = None,
) -> SequenceParallelMPU | None:
    """Apply this job's layout to the plain ``model`` in place; returns the ``mpu`` to hand to
    ``deepspeed.initialize`` (None without sequence parallelism).

    With ``groups`` (P > 1): sharded, each rank keeps its E/F columns and position rows
    (:func:`shard_for_deepspeed`); whole, ZeRO-3 partitions over all DP x P ranks
    (:func:`partition_for_zero3`); then the layers split the sequence over the SP group
    (:func:`apply_sequence_parallel`). Activation checkpointing as configured, in every layout.
    Call once per model, before ``deepspeed.initialize``."""
    mpu: SequenceParallelMPU | None = None
    if groups is not None:
        sharded = resolved_shard(cfg)
        if cfg.parallel.auto_shard and groups.rank == 0:
            log.info(f"[setup] parallel.shard_sequence_parameters=auto: {cfg.parallel.auto_shard}")
        mpu = ShardedSequenceParallelMPU(groups) if sharded else SequenceParallelMPU(groups)
    use_deepspeed_mpu(mpu)  # before zero.Init and deepspeed.initialize read it
    if groups is not None:
        if isinstance(mpu, ShardedSequenceParallelMPU):  # E/F columns, position rows per rank
            shard_for_deepspeed(model, groups)
        else:
            partition_for_zero3(model, groups, ds_config)
        apply_sequence_parallel(model, groups.sp_group)
    apply_activation_checkpointing(model, cfg, ds_config)
    return mpu


def use_deepspeed_mpu(mpu: SequenceParallelMPU | None) -> None:
    """Make ``mpu`` (None: plain data parallelism) DeepSpeed's process-wide one
    (``deepspeed.utils.groups.mpu``), which its engine and ZeRO optimizers query for the
    data-parallel group and size. ``deepspeed.initialize`` sets it only when given an mpu, so
    without this an engine built with none inherited the previous engine's: a DP = 2 run after
    a sequence-parallel one in the same process reduced over the old groups (twice the
    gradient, or a crash on the sharded mpu's model-parallel rank)."""
    from deepspeed.utils import groups as ds_groups

    ds_groups.mpu = mpu


def apply_sequence_parallel(model: nn.Module, group: Any) -> SequenceParallel | None:
    """Make every encoder, attention and projection module of ``model`` split the sequence over
    ``group`` (an instance attribute per module). ``group=None`` removes it again (the
    unmodified P = 1 path). Returns the hooks."""

    if hasattr(model, "classifier"):
        raise ValueError(
            "sequence parallelism supports the MLM model only: a sequence classifier pools "
            "token 0, which only the first rank of each group holds"
        )
    hooks = SequenceParallel(group) if group is not None else None
    for module in model.modules():
        kind = getattr(module, "projection_kind", None)  # a projection (model.register_projection)
        if isinstance(module, (LinformerEncoder, LinformerSelfAttention)) or (
            kind is not None and get_projection(kind).sequence_parallel
        ):
            module.sequence_parallel = hooks
    return hooks


def shard_for_deepspeed(model: nn.Module, groups: SequenceParallelGroups) -> list[str]:
    """Sharded sequence parallelism under DeepSpeed: shard E/F and the positions
    (:func:`~linformer_ds.parallel.sharding.shard_sequence_parameters`), mark them
    model-parallel, and make every other parameter's gradient the sum over the SP group (a hook
    per parameter, before DeepSpeed's data-parallel reduction). Use with
    :class:`ShardedSequenceParallelMPU` and a backward loss scale of 1 at every ZeRO stage.
    Returns the sharded parameter names."""
    names = shard_sequence_parameters(model, groups.sp_rank, groups.sp_size)
    model.universal_checkpoint_info = universal_checkpoint_info(model, groups.sp_size)
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if name in names:
            p.tensor_model_parallel = True
        elif p.requires_grad:
            p.register_hook(sum_over_group(groups.sp_group))
    return names


def partition_for_zero3(model: nn.Module, groups: SequenceParallelGroups, ds_config: dict):
    """Under ZeRO-3 with P > 1, partition the parameters over all DP x P ranks now.

    Left to ``deepspeed.initialize``, ZeRO-3 partitions over ``mpu.get_data_parallel_group()``
    (DP only), so the P ranks of a replica never sum their gradients. Returns ``model``.
    """
    stage = int(ds_config.get("zero_optimization", {}).get("stage", 0))
    if stage != 3 or groups.sp_size == 1:
        return model
    import deepspeed

    dtype = torch.float32  # what DeepSpeed's own ZeRO-3 conversion would use
    if ds_config.get("bf16", {}).get("enabled"):
        dtype = torch.bfloat16
    elif ds_config.get("fp16", {}).get("enabled"):
        dtype = torch.float16
    for p in model.parameters():  # the engine casts only models it partitions itself
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    # With the mpu, zero.Init's config check counts replicas (DP) as deepspeed.initialize does,
    # so the batch keys (train_batch_size = micro x GAS x DP) pass unchanged.
    deepspeed.zero.Init(
        module=model,
        data_parallel_group=groups.seq_dp_group,
        config_dict_or_path=ds_config,
        mpu=SequenceParallelMPU(groups),
        dtype=dtype,
    )
    return model


def apply_activation_checkpointing(model: nn.Module, cfg: JobConfig, ds_config: dict) -> None:
    """Wrap encoder layers in activation checkpointing as configured (no-op when disabled).

    torch's non-reentrant checkpoint by default: correct with the layerwise-shared projection
    under ZeRO-2/3 (reentrant checkpointing triggers DeepSpeed issue 988). DeepSpeed's own
    (partitioned / CPU) variant when asked for; config.validate refuses it under ZeRO-3.
    """
    ac = cfg.deepspeed.activation_checkpointing
    if not ac.enabled:
        return
    n_layers = ac.number_checkpoints or cfg.model.num_layers
    if ac.partition_activations or ac.cpu_checkpointing:
        import deepspeed
        from deepspeed.runtime.activation_checkpointing.checkpointing import (
            non_reentrant_checkpoint,
        )

        deepspeed.checkpointing.configure(None, deepspeed_config=ds_config)

        def fn(block, x, *rest):
            # Only the activation goes through DeepSpeed's checkpoint: its partitioned path
            # mis-pairs tensors with their sizes when non-tensor arguments (the shared
            # projection module, a None mask) are passed along (deepspeed 0.19).
            return non_reentrant_checkpoint(lambda h: block(h, *rest), x)
    else:
        fn = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    model.encoder.set_activation_checkpointing(
        fn, layers=list(range(n_layers)), granularity=ac.granularity
    )
