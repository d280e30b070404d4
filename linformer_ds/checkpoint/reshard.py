"""Resuming in another layout or engine config: which route a checkpoint takes, DeepSpeed's
universal checkpoint (conversion, per-SP-rank copies, ZeRO-3 repairs) and ZeRO-0 re-sharding.

Layout changes (another number of ranks, sequence-parallel size P, or E/F / position sharding;
see :func:`layout_route`): a ZeRO 1-3 checkpoint is converted once with DeepSpeed's universal
checkpoint (``ds_to_universal``) into ``checkpoint.dir/universal/<tag>`` and loaded with
``{"checkpoint": {"load_universal": true}}`` (ZeRO-3: two repairs after DeepSpeed's load, see
:func:`repair_zero3_universal_load`, and per-SP-rank copies for a sharded run). ZeRO-0 has no
optimizer shards for ``ds_to_universal`` to read (its fp32 optimizer is a plain torch AdamW whose
state lies in each model-parallel file), so a P or sharding change is re-sharded by
:func:`reshard_zero0` into native files. Either copy is derived data, removed after the load.
"""

import argparse
import contextlib
import glob
import io
import os
import shutil
from collections.abc import Callable
from typing import Any

import torch

from linformer_ds.checkpoint.io import safe_torch_load, weights_only_torch_load
from linformer_ds.checkpoint.tags import UNIVERSAL_DIR, CheckpointError, sharded_sp_size
from linformer_ds.config import JobConfig
from linformer_ds.parallel.sharding import (
    SHARD_ATTR,
    consolidate_sharded,
    mark_universal_sequence_dims,
    sequence_dim,
    shard_tensor,
)

# Engine changes a universal checkpoint carries (measured, deepspeed 0.19.8, 1 CPU rank, see
# docs/reliability.md): ZeRO stage 1 <-> 2 and precision bf16 <-> fp32 load, losses continue
# within 1e-4; a change to or from ZeRO-3 fails inside DeepSpeed (AssertionError); ZeRO-0 has
# no optimizer shards to convert; fp16 is untested (no CPU support) and refused. Layout changes
# at an unchanged stage (ZeRO 0-3): layout_route.
UNIVERSAL_STAGES = (1, 2)
UNIVERSAL_PRECISIONS = ("bf16", "fp32")


def universal_supports(saved: tuple[int, str], now: tuple[int, str]) -> bool:
    """Whether a checkpoint saved under ``saved`` (ZeRO stage, precision) can be resumed under
    ``now`` through DeepSpeed's universal checkpoint."""
    return all(s in UNIVERSAL_STAGES for s in (saved[0], now[0])) and all(
        p in UNIVERSAL_PRECISIONS for p in (saved[1], now[1])
    )


def check_engine_config(
    ckpt_dir: str, tag: str, meta: dict[str, Any], cfg: JobConfig
) -> str | None:
    """Compare the checkpoint's ZeRO stage and precision with the config. Returns a notice
    when the change is loaded through a universal checkpoint; a :class:`CheckpointError` that
    says what changed and how to proceed when DeepSpeed cannot load it."""
    saved_stage, saved_prec = int(meta.get("zero_stage", 0)), meta.get("precision")
    now_stage, now_prec = cfg.deepspeed.zero.stage, cfg.deepspeed.precision
    saved_prec = saved_prec or now_prec  # checkpoints written before precision was recorded
    changes = []
    if saved_stage != now_stage:
        changes.append(f"deepspeed.zero.stage {saved_stage} -> {now_stage}")
    if saved_prec != now_prec:
        changes.append(f"deepspeed.precision {saved_prec} -> {now_prec}")
    if not changes:
        return None
    where = os.path.join(ckpt_dir, tag)
    shards = glob.glob(os.path.join(where, "*_optim_states.pt"))
    if shards and universal_supports((saved_stage, saved_prec), (now_stage, now_prec)):
        return (
            f"{where} was saved with another engine config ({', '.join(changes)}): loading it "
            "through a universal checkpoint"
        )
    raise CheckpointError(
        f"{where} was saved with zero.stage={saved_stage} precision={saved_prec}; this config "
        f"has {', '.join(changes)}, which DeepSpeed cannot load. Resume with "
        f"deepspeed.zero.stage={saved_stage} deepspeed.precision={saved_prec}"
        + " (ZeRO stage 1 <-> 2 and bf16 <-> fp32 changes load through a universal checkpoint)"
        ", or export the weights (launch/export.py) and start a new run"
    )


def config_layout(cfg: JobConfig) -> dict[str, Any]:
    """The parallel layout recorded in a checkpoint's metadata."""
    p = cfg.parallel.sequence_parallel_size
    return {
        "sequence_parallel_size": p,
        "shard_sequence_parameters": bool(p > 1 and cfg.parallel.shard_sequence_parameters),
    }


# How a checkpoint saved in another layout (world size, P, E/F / position sharding) loads, per
# ZeRO stage (the saved stage and precision equal the run's; check_engine_config handles those):
#   1, 2  DeepSpeed's universal checkpoint (ds_to_universal), every change.
#   3     DeepSpeed's universal checkpoint too (its stage-3 converter merges the DP partitions and,
#         for a sharded save, the SP ranks' pieces as tensor-parallel slices). Its ZeRO-3 loader
#         cuts a tensor-parallel piece only for AutoTP parameters, so for a sharded run each SP
#         rank reads a copy of the universal directory whose E/F and position files hold its
#         own slice already (:func:`cut_universal_per_sequence_rank`).
#   0     no ZeRO optimizer shards to convert (fp32: DeepSpeed keeps the plain torch AdamW
#         state in each model-parallel file, ds_to_universal finds nothing to read), so
#         :func:`reshard_zero0` writes the new layout's files itself: every sharded weight and
#         its exp_avg / exp_avg_sq joined whole, then cut for the new P. A world-size change
#         alone needs nothing (each file is replicated over data-parallel ranks).
RESHARD_DIRECT = "reshard"  # ZeRO-0: reshard_zero0
VIA_UNIVERSAL = "universal"  # ZeRO 1-3: ds_to_universal


def layout_route(
    ckpt_dir: str, tag: str, meta: dict[str, Any], cfg: JobConfig, world_size: int
) -> str | None:
    """How a checkpoint whose layout may differ from the run's loads: None (natively: same
    layout, or a change DeepSpeed's own loading covers), :data:`VIA_UNIVERSAL` or
    :data:`RESHARD_DIRECT`; a :class:`CheckpointError` naming the way out when neither can."""
    where = os.path.join(ckpt_dir, tag)
    saved_p, now_p = sharded_sp_size(meta), sharded_sp_size(config_layout(cfg))
    shards = glob.glob(os.path.join(where, "*_optim_states.pt"))
    world_changed = int(meta["world_size"]) != int(world_size)
    if shards and (world_changed or saved_p != now_p):
        return VIA_UNIVERSAL
    if saved_p == now_p:
        return None
    if int(meta.get("zero_stage", 0)) == 0 and not shards:
        return RESHARD_DIRECT
    raise CheckpointError(
        f"{where} holds E/F and positions sharded over {saved_p} rank(s), this config over "
        f"{now_p} (parallel.sequence_parallel_size / parallel.shard_sequence_parameters), and "
        "it has no optimizer shards to re-shard (a ZeRO-0 bf16/fp16 run cannot be sharded). "
        "Resume with the saved layout, or export the weights and start a new run"
    )


def saved_frozen(meta: dict[str, Any]) -> bool:
    """Whether the checkpoint's model kept E/F (or conv kernels) frozen."""
    return bool((meta.get("model") or {}).get("freeze_projection"))


def _frozen_whole(ckpt_dir: str, tag: str, saved_p: int, stage: int) -> dict[str, torch.Tensor]:
    """Every parameter of the saved model, whole (sharded ones joined along their sequence dim):
    ZeRO 1-2 from the model-parallel files' ``module``, ZeRO-3 by DeepSpeed's zero_to_fp32
    (frozen parameters come from each rank's ``frozen_param_fragments``)."""
    src = os.path.join(ckpt_dir, tag)
    if stage == 3:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        def one(d: str, t: str) -> dict[str, torch.Tensor]:
            with weights_only_torch_load():
                return dict(get_fp32_state_dict_from_zero_checkpoint(d, tag=t))

        return consolidate_sharded(ckpt_dir, tag, saved_p, one)
    modules = [
        safe_torch_load(os.path.join(src, f"mp_rank_{r:02d}_model_states.pt"))["module"]
        for r in range(saved_p)
    ]
    whole = dict(modules[0])
    for name, t in modules[0].items():
        dim = sequence_dim(name, t.dim())
        if saved_p > 1 and dim is not None:
            whole[name] = torch.cat([m[name] for m in modules], dim)
    return whole


def _partition_rank(params: list[torch.nn.Parameter]) -> int:
    """This rank's index in the group ZeRO-3 partitions ``params`` over (the data-parallel
    group of its sequence-parallel rank; 0 without torch.distributed)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    groups = {id(getattr(p, "ds_process_group", None)) for p in params}
    if len(groups) != 1:  # GatheredParameters broadcasts from one group rank for all of them
        raise CheckpointError(f"frozen parameters partitioned over {len(groups)} groups")
    return dist.get_rank(group=getattr(params[0], "ds_process_group", None))


def restore_frozen_params(engine, ckpt_dir: str, tag: str, saved_p: int, stage: int) -> list[str]:
    """After a universal load: DeepSpeed restores weights from the universal copy, which holds
    only parameters with optimizer state, so every frozen parameter is copied from the saved
    files (whole, then cut for this rank's sequence-parallel slice when it is sharded now;
    ZeRO-3: gathered, set on rank 0 of each data-parallel group, the group that partitions that
    slice, and partitioned again). Collective. Returns the names restored."""
    frozen = [(n, p) for n, p in engine.module.named_parameters() if not p.requires_grad]
    if not frozen:
        return []
    mpu = getattr(engine, "mpu", None)
    sp_rank = mpu.get_model_parallel_rank() if mpu is not None else 0
    sp_size = mpu.get_model_parallel_world_size() if mpu is not None else 1
    # ZeRO-3: GatheredParameters(modifier_rank=0) partitions the values of rank 0 of each
    # parameter's own group (global rank 0 is in one sequence-parallel rank's group only)
    setting = stage < 3 or _partition_rank([p for _, p in frozen]) == 0
    whole = _frozen_whole(ckpt_dir, tag, saved_p, stage) if setting else {}
    gathered: Any = contextlib.nullcontext()
    if stage == 3:
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters([p for _, p in frozen], modifier_rank=0)
    with gathered, torch.no_grad():
        for name, p in frozen if setting else []:
            value = whole[name]
            if hasattr(p, SHARD_ATTR):
                value = shard_tensor(value, getattr(p, SHARD_ATTR)[0], sp_rank, sp_size)
            if tuple(value.shape) != tuple(p.shape):
                raise CheckpointError(
                    f"{ckpt_dir}/{tag}: frozen parameter {name} has shape "
                    f"{tuple(value.shape)} in the saved files, this model {tuple(p.shape)}"
                )
            p.copy_(value)
    return [n for n, _ in frozen]


def convert_to_universal(ckpt_dir: str, tag: str, frozen: bool = False) -> str:
    """Rank 0: ``ckpt_dir/tag`` -> ``ckpt_dir/universal/tag`` by DeepSpeed's ds_to_universal.

    Every source file is first read with ``weights_only=True`` (ds_to_universal itself does not).
    ``frozen``: the model has frozen parameters, which have no optimizer state to convert, so
    the patterns that name them go unused (allowed; :func:`restore_frozen_params` restores
    them after the load). Returns the load directory (``ckpt_dir/universal``).
    """
    # deepspeed is imported here, not at the top: train.py and export.py start without it
    from deepspeed.checkpoint import ds_to_universal

    src = os.path.join(ckpt_dir, tag)
    for path in sorted(glob.glob(os.path.join(src, "*.pt"))):
        safe_torch_load(path)
    root = os.path.join(ckpt_dir, UNIVERSAL_DIR)
    out = os.path.join(root, tag)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(root, exist_ok=True)
    args = argparse.Namespace(
        input_folder=src,
        output_folder=out,
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=not frozen,
        inject_missing_state=True,
    )
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            ds_to_universal.main(args)
        mark_universal_sequence_dims(out)  # loadable with E/F and positions sharded, any P
    except Exception as e:
        shutil.rmtree(out, ignore_errors=True)
        with contextlib.suppress(OSError):  # universal/ too when nothing else is in it
            os.rmdir(root)
        raise CheckpointError(
            f"converting {src} to a universal checkpoint failed: {type(e).__name__}: {e}"
        ) from None
    return root


def cut_universal_per_sequence_rank(
    root: str, tag: str, shards: dict[str, tuple[int, list[int]]], sp_size: int
) -> list[str]:
    """ZeRO-3, sharded run: ``root/tag`` (a universal checkpoint) -> ``root/sp<r>/tag`` for each
    SP rank r, the same checkpoint (links) except that the fp32 / exp_avg / exp_avg_sq files of
    every parameter in ``shards`` (name -> (sequence dim, whole shape)) hold rank r's slice.
    DeepSpeed 0.19.8's ZeRO-3 universal loader takes each file as the whole parameter and
    partitions it over the data-parallel group; it cuts tensor-parallel pieces only for AutoTP
    parameters. Returns the load directories, by SP rank."""
    src = os.path.join(root, tag)
    roots = []
    for r in range(sp_size):
        out = os.path.join(root, f"sp{r}", tag)
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(os.path.join(out, "zero"))
        for name in os.listdir(src):
            if name != "zero":
                os.symlink(os.path.abspath(os.path.join(src, name)), os.path.join(out, name))
        for name in sorted(os.listdir(os.path.join(src, "zero"))):
            param_src = os.path.abspath(os.path.join(src, "zero", name))
            if name not in shards:
                os.symlink(param_src, os.path.join(out, "zero", name))
                continue
            dim, shape = shards[name]
            os.makedirs(os.path.join(out, "zero", name))
            for f in sorted(os.listdir(param_src)):
                path = os.path.join(param_src, f)
                if f not in ("fp32.pt", "exp_avg.pt", "exp_avg_sq.pt"):
                    os.symlink(path, os.path.join(out, "zero", name, f))
                    continue
                # a file ds_to_universal has just written (it may hold DeepSpeed's own classes)
                state = torch.load(path, map_location="cpu", weights_only=False)
                whole = (state["param"] if isinstance(state, dict) else state).reshape(shape)
                piece = shard_tensor(whole, dim, r, sp_size).contiguous().clone()
                torch.save(piece, os.path.join(out, "zero", name, f))
        roots.append(os.path.join(root, f"sp{r}"))
    return roots


def repair_zero3_universal_load(engine, universal_dir: str, tag: str) -> None:
    """ZeRO-3 after a universal load, two fixes to DeepSpeed 0.19.8's
    ``load_hp_checkpoint_state_from_checkpoint_dir_stage3`` (measured: without them the losses
    after a resume drift by 3e-5 at the second step, 4e-4 at the fourth):

    - it copies group 0's options (weight decay among them) into every parameter group, so the
      no-decay group would decay: each group gets its own saved options back;
    - it gives every sub-group's state the same ``step`` tensor, which torch's AdamW increments
      in place once per sub-group per step (bias correction of step 4 after step 2): each
      sub-group gets its own copy."""
    path = os.path.join(universal_dir, tag, "zero", "optimizer_state.pt")
    with weights_only_torch_load():
        saved = torch.load(path, map_location="cpu")["optimizer_state_dict"]["param_groups"]
    optimizer = engine.optimizer.optimizer
    if len(saved) != len(optimizer.param_groups):
        raise CheckpointError(
            f"{path}: {len(saved)} optimizer parameter groups, this run has "
            f"{len(optimizer.param_groups)}"
        )
    for group, options in zip(optimizer.param_groups, saved):
        group.update({k: v for k, v in options.items() if k != "params"})
    for flat in engine.optimizer.fp32_partitioned_groups_flat:
        state = optimizer.state.get(flat, {})
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


def sequence_shards(model: Any) -> dict[str, tuple[int, list[int]]]:
    """name -> (sequence dim, whole shape) of every sharded E/F / position parameter of a live
    (possibly ZeRO-3 partitioned) model."""
    out = {}
    for name, p in model.named_parameters():
        if hasattr(p, SHARD_ATTR):
            dim, size = getattr(p, SHARD_ATTR)
            shape = list(getattr(p, "ds_shape", p.shape))
            shape[dim] = size
            out[name] = (dim, shape)
    return out


def optimizer_index_names(engine) -> list[str]:
    """The parameter name behind each index of the optimizer's state dict (torch numbers the
    parameters group by group, in order)."""
    name_of = {id(p): n for n, p in engine.module.named_parameters()}
    return [name_of[id(p)] for g in engine.optimizer.param_groups for p in g["params"]]


def reshard_zero0(
    ckpt_dir: str, tag: str, saved_p: int, now_p: int, index_names: list[str], out_root: str
) -> str:
    """ZeRO-0 fp32: ``ckpt_dir/tag``, saved with E/F and positions sharded over ``saved_p`` ranks
    (1: whole), -> ``out_root/tag`` holding the same model and AdamW state sharded over
    ``now_p``, in DeepSpeed's native files (``mp_rank_<r>_model_states.pt``, one per SP rank).
    Each sharded weight and its exp_avg / exp_avg_sq are joined along their sequence dim in
    rank order, then cut in ``now_p`` equal parts; everything else is copied. ``index_names``:
    :func:`optimizer_index_names` of the engine that will load it. Returns ``out_root``."""
    src = os.path.join(ckpt_dir, tag)
    parts = [
        safe_torch_load(os.path.join(src, f"mp_rank_{r:02d}_model_states.pt"))
        for r in range(saved_p)
    ]
    optims = [p.get("optimizer") for p in parts]
    if not all(isinstance(o, dict) and {"state", "param_groups"} <= set(o) for o in optims):
        raise CheckpointError(f"{src}: its ZeRO-0 files hold no plain optimizer state to re-shard")
    saved_index = [i for g in optims[0]["param_groups"] for i in g["params"]]
    if len(saved_index) != len(index_names):
        raise CheckpointError(
            f"{src}: its optimizer has {len(saved_index)} parameters, this model "
            f"{len(index_names)}; resume with the saved layout"
        )
    dims = {n: sequence_dim(n, t.dim()) for n, t in parts[0]["module"].items()}

    def whole(get: Callable[[dict[str, Any]], torch.Tensor], name: str) -> Any:
        t = get(parts[0])
        if saved_p == 1 or dims.get(name) is None or not torch.is_tensor(t) or t.dim() == 0:
            return t
        return torch.cat([get(p) for p in parts], dim=dims[name])

    def cut(t: Any, name: str, r: int) -> Any:
        if now_p == 1 or dims.get(name) is None or not torch.is_tensor(t) or t.dim() == 0:
            return t
        return shard_tensor(t, dims[name], r, now_p).contiguous().clone()

    module = {n: whole(lambda p, n=n: p["module"][n], n) for n in parts[0]["module"]}
    state = {}
    for i, st in optims[0]["state"].items():
        name = index_names[saved_index.index(i)]
        state[i] = {k: whole(lambda p, i=i, k=k: p["optimizer"]["state"][i][k], name) for k in st}
        for k, v in state[i].items():
            if torch.is_tensor(v) and v.dim() and v.shape != module[name].shape:
                raise CheckpointError(
                    f"{src}: optimizer state {i} ({k}, shape {tuple(v.shape)}) does not match "
                    f"{name} {tuple(module[name].shape)}; resume with the saved layout"
                )
    out = os.path.join(out_root, tag)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    for r in range(now_p):
        files = dict(parts[0], mp_world_size=now_p)
        files["module"] = {n: cut(t, n, r) for n, t in module.items()}
        files["optimizer"] = dict(optims[0], state={
            i: {k: cut(v, index_names[saved_index.index(i)], r) for k, v in st.items()}
            for i, st in state.items()
        })  # fmt: skip
        torch.save(files, os.path.join(out, f"mp_rank_{r:02d}_model_states.pt"))
    return out_root
