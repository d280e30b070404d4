"""What each rank of an SP group holds: its slice of every batch (:func:`shard_batch`), its
``N_max / P`` columns of every E/F and rows of the position table
(:func:`shard_sequence_parameters`), the whole state dict again (:func:`full_state_dict`,
:func:`consolidate_sharded`), and the universal-checkpoint metadata that lets DeepSpeed merge
and re-cut the shards (:func:`universal_checkpoint_info`, :func:`mark_universal_sequence_dims`).
"""

from __future__ import annotations

import glob
import os
import re
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from linformer_ds.model import LinformerEncoder
from linformer_ds.parallel.checks import KEY, SequenceParallelConfigError


# ========================================================================================= batches
def shard_batch(
    batch: dict[str, torch.Tensor], sp_rank: int, sp_size: int
) -> tuple[dict[str, torch.Tensor], int]:
    """This rank's ``[B, N/P]`` slice of every ``[B, N]`` tensor in ``batch``, and its offset.

    Tensors of another shape (none in an MLM batch) are kept whole.
    """
    n = batch["input_ids"].shape[1]
    if n % sp_size:
        raise SequenceParallelConfigError(
            f"{KEY}: {sp_size} does not divide the batch's sequence length {n}"
        )
    n_local = n // sp_size
    offset = sp_rank * n_local
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[1] == n:
            out[key] = value[:, offset : offset + n_local].contiguous()
        else:
            out[key] = value
    return out, offset


# ================================================================== sharded sequence-axis parameters
SHARD_ATTR = "sequence_shard"  # on a sharded parameter: (dim, full size along dim)


def sequence_parameters(model: nn.Module) -> list[tuple[str, nn.Module, int]]:
    """``(name, module, dim)`` of every parameter indexed by sequence position: the weight of
    every projection whose class sets ``sequence_dim`` (linear E/F, any sharing mode, per-layer
    ones too; columns, dim 2) and the position table (rows, dim 0). Conv kernels are not: they
    are the same for every block."""

    out = []
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if _sequence_shaped(module):
            out.append((f"{prefix}weight", module, int(module.sequence_dim)))
        elif isinstance(module, LinformerEncoder) and module.position_embeddings is not None:
            out.append((f"{prefix}position_embeddings.weight", module.position_embeddings, 0))
    return out


def _sequence_shaped(module: nn.Module) -> bool:
    """A projection module (``projection_kind`` set) whose ``weight`` has a ``sequence_dim``."""
    return (
        getattr(module, "projection_kind", None) is not None
        and getattr(module, "sequence_dim", None) is not None
    )


def shard_sequence_parameters(model: nn.Module, rank: int, world: int) -> list[str]:
    """Keep only this rank's ``N_max / P`` columns of every E/F and rows of the position table.

    Rank r of the SP group keeps positions ``[r N_max / P, (r+1) N_max / P)``: with N = N_max,
    exactly the ones its slice uses, so its gradient of them is complete on the rank (no other
    rank's slice touches them) and needs only the data-parallel reduction. The parameters keep
    their names; each carries ``sequence_shard = (dim, full size)``. Call after initialising
    the whole model identically on every rank, before the model runs split. Returns
    the sharded parameter names.
    """

    names = []
    for name, module, dim in sequence_parameters(model):
        full = module.weight
        size = full.shape[dim]
        if size % world:
            raise SequenceParallelConfigError(
                f"{KEY}: {world} does not divide model.max_seq_len={size}: E/F columns and "
                "position rows are sharded in equal parts"
            )
        width = size // world
        piece = full.detach().narrow(dim, rank * width, width).clone()
        module.weight = nn.Parameter(piece, requires_grad=full.requires_grad)
        setattr(module.weight, SHARD_ATTR, (dim, size))
        if isinstance(module, nn.Embedding):
            module.num_embeddings = width
        names.append(name)
    for module in model.modules():
        if isinstance(module, LinformerEncoder):
            module.position_shard_start = rank * (module.config.max_seq_len // world)
        elif _sequence_shaped(module):  # E/F: the global column of its local column 0
            module.shard_start = rank * (getattr(module.weight, SHARD_ATTR)[1] // world)
    return names


def shard_tensor(full: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s equal part of ``full`` along ``dim`` (how a whole matrix is sharded)."""
    width = full.shape[dim] // world
    return full.narrow(dim, rank * width, width)


def full_state_dict(model: nn.Module, group: Any) -> dict[str, torch.Tensor]:
    """The model's state dict with every sharded parameter whole again (all-gathered over the
    SP ``group`` in rank order): what one rank holding the whole model has. Collective."""
    sd = model.state_dict()
    sharded = {n: getattr(p, SHARD_ATTR) for n, p in model.named_parameters()
               if hasattr(p, SHARD_ATTR)}  # fmt: skip
    world = dist.get_world_size(group)
    for name, (dim, _size) in sharded.items():
        local = sd[name].detach().contiguous()
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local, group=group)
        sd[name] = torch.cat(parts, dim=dim)
    return sd


def sequence_dim(name: str, ndim: int) -> int | None:
    """The sequence dim of a parameter of the Linformer models by its name and rank: 2 for a
    linear projection's E/F ``[H, k, N_max]``, 0 for the position table, None otherwise."""
    if name.endswith("position_embeddings.weight") and ndim == 2:
        return 0
    if ndim == 3 and name.endswith(("proj_k.weight", "proj_v.weight", "shared_linear.weight")):
        return 2
    return None


def mark_universal_sequence_dims(universal_tag_dir: str) -> list[str]:
    """Make a universal checkpoint written from an unsharded run loadable by a sharded one:
    each E/F and position-table state file gets ``cat_dim`` = its sequence dim, along which
    DeepSpeed's universal loading cuts the rank's piece (``chunk(P, cat_dim)[sp_rank]``).
    Files with a sub-parameter shape (written from a sharded run) already say it. Returns the
    parameter names marked."""

    from deepspeed.checkpoint.constants import CAT_DIM, PARAM, SUB_PARAM_SHAPE

    marked = []
    for folder in sorted(glob.glob(os.path.join(universal_tag_dir, "zero", "*"))):
        name = os.path.basename(folder)
        for path in sorted(glob.glob(os.path.join(folder, "*.pt"))):
            if os.path.basename(path) == "step.pt":
                continue
            # a file ds_to_universal has just written (it holds DeepSpeed's own classes)
            state = torch.load(path, map_location="cpu", weights_only=False)
            if not isinstance(state, dict) or PARAM not in state or SUB_PARAM_SHAPE in state:
                continue
            dim = sequence_dim(name, state[PARAM].dim())
            if dim is None:
                continue
            state[CAT_DIM] = dim
            torch.save(state, path)
            if name not in marked:
                marked.append(name)
    return marked


def consolidate_sharded(
    checkpoint_dir: str,
    tag: str,
    sp_size: int,
    consolidate_one: Callable[[str, str], dict[str, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """The whole fp32 state dict of a checkpoint saved with E/F and positions sharded over
    ``sp_size`` ranks. DeepSpeed wrote each SP rank's files as model-parallel rank ``r``; each
    rank's files are linked, as rank 00, into a temporary directory and consolidated there by
    ``consolidate_one(dir, tag)`` (DeepSpeed's own, ZeRO 0-3), then the sharded parameters are
    concatenated in rank order along their sequence dim (the rest is the same on every rank)."""

    tag_dir = os.path.join(checkpoint_dir, tag)
    parts = []
    with tempfile.TemporaryDirectory(prefix="linformer_sp_consolidate_") as tmp:
        for r in range(sp_size):
            root = os.path.join(tmp, f"sp{r}")
            os.makedirs(os.path.join(root, tag))
            mine = f"mp_rank_{r:02d}"
            for path in glob.glob(os.path.join(tag_dir, "*")):
                name = os.path.basename(path)
                if "mp_rank_" in name:
                    if mine not in name:
                        continue
                    name = name.replace(mine, "mp_rank_00")
                os.symlink(os.path.abspath(path), os.path.join(root, tag, name))
            parts.append(consolidate_one(root, tag))  # materialised before tmp goes away
    out = dict(parts[0])
    for name, t in parts[0].items():
        dim = sequence_dim(name, t.dim())
        if dim is not None:
            out[name] = torch.cat([p[name] for p in parts], dim=dim)
    return out


def universal_checkpoint_info(model: nn.Module, sp_size: int) -> dict[str, Any]:
    """How DeepSpeed's ``ds_to_universal`` merges the SP ranks' pieces (they are its "tensor
    parallel" slices under :class:`ShardedSequenceParallelMPU`): every sharded parameter
    is one sub-parameter split evenly along its sequence dim (columns of E/F: dim 2, rows of the
    position table: dim 0), every other parameter is replicated. Loading cuts the whole
    tensor again for any P (``tp_world_size`` = P), or keeps it whole at P = 1."""

    from deepspeed.checkpoint import constants as c

    shards, shard_widths, replicated = [], {}, []
    for name, p in model.named_parameters():
        pattern = f"^{re.escape(name)}$"
        if not hasattr(p, SHARD_ATTR):
            replicated.append(pattern)
            continue
        dim, size = getattr(p, SHARD_ATTR)
        shape: list[Any] = list(p.shape)
        shape[dim] = (size,)
        shards.append({"patterns": [pattern], "shape": shape, "partition_dim": dim})
        shard_widths[pattern] = [[size // sp_size] * sp_size]
    return {
        c.UNIVERSAL_CHECKPOINT_VERSION_KEY: c.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
        c.TP_REPLICATED_PARAMETER_PATTERNS: replicated,
        c.PARAMETER_WITH_SUB_PARAMS: shards,
        c.SUB_PARAM_SHARD_WIDTHS: shard_widths,
    }
