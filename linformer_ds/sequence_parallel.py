"""Sequence parallelism for the Linformer encoder: one sequence split across P ranks.

Layout: P consecutive ranks form one sequence-parallel (SP) group and hold consecutive slices of
the same rows (rank r of the group holds positions ``[r N/P, (r+1) N/P)``); world = DP x P.

What crosses ranks, per layer (derivation in docs/sequence_parallel.md):

* ``linear``: ``E K = sum_r E[:, s_r] K[s_r]``. Each rank projects its own slice with the columns
  of E at its global offset; one all-reduce (sum) of the ``[B, k, h, d]`` result over the SP
  group gives the exact projected keys/values. Backward: an all-reduce of the incoming gradient.
* ``conv``: slices aligned to the stride (N/P a multiple of r) compress to whole local blocks;
  an all-gather along the block axis gives every block (and the padding-block mask). Backward: a
  reduce-scatter, each rank keeps the summed gradient of its own blocks.
* ``dense``: DeepSpeed-Ulysses (``deepspeed.sequence.layer.DistributedAttention``): all-to-all
  from sequence slices to head slices and back; the full padding mask is all-gathered.

The model stays plain PyTorch: :func:`linformer_ds.parallelize.apply_sequence_parallel`
installs a :class:`SequenceParallel` object on the encoder, attention and projection modules;
they call it where a collective is needed. This module holds the config checks, the process
groups, batch slicing, the collectives (autograd functions and gradient hooks) and the sharding
of the sequence-axis parameters; :mod:`linformer_ds.parallelize` applies them to a model (with
DeepSpeed's mpu, ZeRO-3 partitioning and the loss scaling rule) and lists the trainer's calls.
"""

from __future__ import annotations

import glob
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from linformer_ds.model import LinformerEncoder, ModelConfig, get_projection, projection_stride

KEY = "parallel.sequence_parallel_size"
SHARD_KEY = "parallel.shard_sequence_parameters"


class SequenceParallelConfigError(ValueError):
    """An impossible sequence-parallel setting; the message names the key."""


# =================================================================================== config checks
def config_errors(
    sp_size: int,
    *,
    world_size: Optional[int],
    seq_len: int,
    model: ModelConfig,
    zero_stage: int = 0,
    zero_reduce_scatter: bool = True,
    shard: Any = False,
    precision: str = "fp32",
) -> List[str]:
    """Every reason ``sp_size`` cannot run, as one-line messages (empty: it can).

    ``seq_len`` is the data's sequence length N (every row is N tokens, right-padded);
    ``zero_reduce_scatter`` is ``zero_optimization.reduce_scatter`` of the DeepSpeed config;
    ``shard``: ``parallel.shard_sequence_parameters`` (E/F columns and position rows sharded;
    ``"auto"``: decided later, so no rule of sharding applies); ``precision``:
    ``deepspeed.precision``.
    """
    shard = shard != "auto" and bool(shard)
    p = int(sp_size)
    if p < 1:
        return [f"{KEY}: must be >= 1, got {p}"]
    if p == 1:
        return []
    errors = []
    if world_size is not None and world_size % p:
        errors.append(f"{KEY}: {p} does not divide the world size {world_size}")
    if seq_len % p:
        errors.append(f"{KEY}: {p} does not divide the sequence length N={seq_len}")
    if model.max_seq_len < seq_len:
        errors.append(
            f"{KEY}: {p} > 1 needs model.max_seq_len >= N (got max_seq_len={model.max_seq_len}, "
            f"N={seq_len}): every slice takes its positions and E columns at its global offset"
        )
    n_local = seq_len // p
    r = model.local_mixer_kernel // 2
    if model.local_mixer != "none" and seq_len % p == 0 and n_local < r:
        errors.append(
            f"{KEY}: the slice length N/P={n_local} is shorter than the local mixer's reach "
            f"{r} (model.local_mixer_kernel {model.local_mixer_kernel}); lower P or the kernel"
        )
    w = model.local_window // 2
    if w and seq_len % p == 0 and n_local < w:
        errors.append(
            f"{KEY}: the slice length N/P={n_local} is shorter than the window's reach {w} "
            f"(model.local_window {model.local_window}: W/2 keys each side come from the "
            f"neighbouring rank); use local_window <= {2 * n_local} or a lower P"
        )
    schedule = model.projection_schedule()
    for i, kind in enumerate(schedule):  # the registered kind's own support and stride
        if kind != "dense" and not get_projection(kind).sequence_parallel:
            errors.append(
                f"{KEY}: layer {i}: the {kind} projection does not support sequence parallelism "
                "(its kind is registered without sequence_parallel=True); use P=1"
            )
            break
        r = projection_stride(model, i)
        if r is not None and seq_len % p == 0 and n_local % r:
            rule = get_projection(kind).stride_rule
            errors.append(
                f"{KEY}: {kind} layer {i}: the slice length N/P={n_local} is not a multiple of "
                f"the {kind} stride {r}{f' ({rule})' if rule else ''}; pick N, P or k so it is"
            )
            break
    if "dense" in schedule and model.num_heads % p:
        errors.append(
            f"{KEY}: dense layers (DeepSpeed-Ulysses) need num_heads divisible by P, got "
            f"num_heads={model.num_heads}, P={p}"
        )
    if shard and seq_len != model.max_seq_len:
        errors.append(
            f"{SHARD_KEY}: sharding needs model.max_seq_len == N (got max_seq_len="
            f"{model.max_seq_len}, N={seq_len}): each rank holds the E/F columns and position "
            f"rows of its slice; set model.max_seq_len={seq_len} or {SHARD_KEY}=false"
        )
    if shard and zero_stage == 0 and precision in ("bf16", "fp16"):
        errors.append(
            f"{SHARD_KEY}: zero.stage=0 with {precision} is not supported sharded: DeepSpeed "
            "0.19's BF16_Optimizer reports a wrong gradient norm under the model-parallel mpu "
            f"(measured 1.524 against 1.590); use zero.stage >= 1, fp32, or {SHARD_KEY}=false"
        )
    if shard and model.max_seq_len % p:
        errors.append(f"{SHARD_KEY}: {p} does not divide model.max_seq_len={model.max_seq_len}")
    if zero_stage == 3 and not zero_reduce_scatter and not shard:
        errors.append(
            f"{KEY}: {p} > 1 with zero.stage=3 needs zero_optimization.reduce_scatter=true: with "
            "it off, DeepSpeed 0.19 divides the gradients of parameters that fit a reduce bucket "
            "by DP and of larger ones by DP x P, so no single loss scale is right"
        )
    return errors


ISOLATION_KEY = "data.document_isolation"


def isolation_errors(sp_size: int, model: ModelConfig, shard: Any) -> List[str]:
    """Why document isolation cannot run with ``sp_size`` ranks per sequence (empty: it can):
    linear layers sum each document's partial summaries over the group, dense layers mask the
    gathered documents; conv windows that cross a slice boundary are not implemented, and
    documents need the whole position table and E/F on every rank (no sharding)."""
    if int(sp_size) == 1:
        return []
    errors = []
    if "conv" in model.projection_schedule():
        errors.append(
            f"{ISOLATION_KEY}: conv layers under sequence parallelism (P={sp_size}) are not "
            "supported with document isolation (windows crossing slices); use P=1 or no conv"
        )
    if shard is True:
        errors.append(
            f"{ISOLATION_KEY}: documents start anywhere, so every rank needs every position "
            f"and E/F column; set {SHARD_KEY}=false"
        )
    return errors


def check_config(sp_size: int, **kwargs: Any) -> None:
    """Raise :class:`SequenceParallelConfigError` with the first of :func:`config_errors`."""
    errors = config_errors(sp_size, **kwargs)
    if errors:
        raise SequenceParallelConfigError(errors[0])


# ================================================================================== process groups
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


def group_layout(world_size: int, sp_size: int) -> Tuple[List[List[int]], List[List[int]]]:
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


# ========================================================================================= batches
def shard_batch(
    batch: Dict[str, torch.Tensor], sp_rank: int, sp_size: int
) -> Tuple[Dict[str, torch.Tensor], int]:
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


# ============================================================================================ loss
def global_label_count(labels: torch.Tensor, group: Any) -> torch.Tensor:
    """The replica's number of labelled positions (``labels != -100`` over all P slices).

    ``labels``: this rank's ``[B, N/P]`` labels or ``[M]`` targets.

    A float scalar, summed over ``group`` with no gradient; at least 1.
    """
    count = (labels != -100).sum().to(torch.float32).reshape(1)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(count, group=group)
    return count.clamp_min(1.0)[0]


# ==================================================================================== collectives
class _AllReduceSum(torch.autograd.Function):
    """Sum over the group; backward: the sum of the incoming gradients (every rank used it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        y = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:
        g = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(g, group=ctx.group)
        return g, None


def _gather_dim1(x: torch.Tensor, group: Any, world: int) -> torch.Tensor:
    """All-gather ``[B, c, ...]`` along dim 1 (rank order): ``[B, P c, ...]``."""
    x = x.contiguous()
    b, c, rest = x.shape[0], x.shape[1], tuple(x.shape[2:])
    out = x.new_empty((world * b, c) + rest)  # the ranks' tensors concatenated along dim 0
    dist.all_gather_into_tensor(out, x, group=group)
    return out.view((world, b, c) + rest).movedim(0, 1).reshape((b, world * c) + rest)


class _AllGatherBlocks(torch.autograd.Function):
    """All-gather along dim 1; backward: reduce-scatter, each rank's summed block gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group, ctx.world = group, dist.get_world_size(group)
        return _gather_dim1(x, group, ctx.world)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:
        p = ctx.world
        b, c = grad.shape[0], grad.shape[1] // p
        rest = tuple(grad.shape[2:])
        stacked = grad.reshape((b, p, c) + rest).movedim(1, 0).contiguous()  # [P, B, c, ...]
        out = grad.new_empty((b, c) + rest)
        dist.reduce_scatter_tensor(out, stacked.view((p * b, c) + rest), group=ctx.group)
        return out, None


class _LocalAttention(nn.Module):
    """Softmax attention on ``[B, N, h/P, d]`` (what DistributedAttention hands over)."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: Optional[torch.Tensor] = None,
        dropout_p: float = 0.0,
    ) -> torch.Tensor:
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=attn_mask,
            dropout_p=dropout_p,
        )
        return y.transpose(1, 2)


class SequenceParallel:
    """The hooks the model's layers call when a sequence is split over ``group``.

    A plain object (not a module): installing it changes no parameter or state-dict name.
    """

    def __init__(self, group: Any):
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._ulysses: Optional[nn.Module] = None

    def offset(self, n_local: int) -> int:
        """Global position of this rank's first token (equal slices)."""
        return self.rank * n_local

    def reduce_projection(self, y: torch.Tensor) -> torch.Tensor:
        """``[B, k, h, d]`` partial projection -> the sum over the group (E K exactly)."""
        return _AllReduceSum.apply(y, self.group)

    def gather_blocks(self, y: torch.Tensor) -> torch.Tensor:
        """``[B, c/P, h, d]`` local conv blocks -> ``[B, c, h, d]`` of the whole sequence."""
        return _AllGatherBlocks.apply(y, self.group)

    def halo(self, x: torch.Tensor, r: int) -> torch.Tensor:
        """``x [B, n/P, D]`` -> ``[B, n/P + 2r, D]``: the previous rank's last ``r`` rows, ``x``,
        the next rank's first ``r`` (zeros past the sequence's ends). One all-gather of every
        rank's ``2r`` edge rows; backward: each rank gets the gradients of its edge rows back
        (summed over the ranks that read them)."""
        if r == 0:
            return x
        edges = _AllGatherBlocks.apply(torch.cat([x[:, :r], x[:, -r:]], dim=1), self.group)
        zeros = x.new_zeros((x.shape[0], r) + tuple(x.shape[2:]))
        i = self.rank
        left = edges[:, (2 * i - 1) * r : 2 * i * r] if i > 0 else zeros
        right = edges[:, (2 * i + 2) * r : (2 * i + 3) * r] if i < self.world_size - 1 else zeros
        return torch.cat([left, x, right], dim=1)

    def gather_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """``[B, n/P]`` bool -> ``[B, n]`` bool (no gradient)."""
        return _gather_dim1(mask.to(torch.uint8), self.group, self.world_size).bool()

    def gather_documents(
        self, position_ids: torch.Tensor, mask: Optional[torch.Tensor]
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """This slice's ``position_ids`` and mask ``[B, n/P]`` -> the whole rows ``[B, n]``
        (one all-gather; document isolation finds the documents from them)."""
        local = position_ids.long()
        if mask is not None:
            local = torch.stack([local, mask.long()], dim=-1)  # [B, n/P, 2]
        whole = _gather_dim1(local, self.group, self.world_size)
        return (whole, None) if mask is None else (whole[..., 0], whole[..., 1])

    def reduce_documents(self, y: torch.Tensor, documents: Any) -> torch.Tensor:
        """Per-span summaries ``[S, k, h, d]``: the spans of documents that continue on other
        ranks (``span.shared >= 0``) get the sum of every rank's part (one all-reduce of
        ``[documents.num_shared, k, h, d]``; backward: the sum of the gradients)."""
        if documents.num_shared == 0:
            return y
        mine = [i for i, s in enumerate(documents.spans) if s.shared >= 0]
        rows = torch.tensor(mine, dtype=torch.long, device=y.device)
        slots = torch.tensor(
            [documents.spans[i].shared for i in mine], dtype=torch.long, device=y.device
        )
        parts = y.new_zeros((documents.num_shared,) + tuple(y.shape[1:]))
        if mine:
            parts = parts.index_add(0, slots, y.index_select(0, rows))
        total = _AllReduceSum.apply(parts, self.group)
        return y.index_copy(0, rows, total.index_select(0, slots)) if mine else y

    def dense_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: Optional[torch.Tensor],
        dropout_p: float,
    ) -> torch.Tensor:
        """Ulysses attention: ``q, k, v [B, n/P, h, d]`` -> ``[B, n/P, h, d]``.

        ``attn_mask`` is for the whole sequence, ``[B, 1, 1, n]``.
        """
        if self._ulysses is None:
            from deepspeed.sequence.layer import DistributedAttention

            self._ulysses = DistributedAttention(
                _LocalAttention(), self.group, scatter_idx=2, gather_idx=1
            )
        return self._ulysses(q, k, v, 0, None, attn_mask=attn_mask, dropout_p=dropout_p)


# ================================================================== sharded sequence-axis parameters
SHARD_ATTR = "sequence_shard"  # on a sharded parameter: (dim, full size along dim)


def sequence_parameters(model: nn.Module) -> List[Tuple[str, nn.Module, int]]:
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


def shard_sequence_parameters(model: nn.Module, rank: int, world: int) -> List[str]:
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


def full_state_dict(model: nn.Module, group: Any) -> Dict[str, torch.Tensor]:
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


def sum_over_group(group: Any) -> Any:
    """A gradient hook: the gradient summed over ``group`` (a replicated parameter's shares
    of the P slices, under sharded sequence parallelism)."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        g = grad.contiguous().clone()
        dist.all_reduce(g, group=group)
        return g

    return hook


def sequence_dim(name: str, ndim: int) -> Optional[int]:
    """The sequence dim of a parameter of the Linformer models by its name and rank: 2 for a
    linear projection's E/F ``[H, k, N_max]``, 0 for the position table, None otherwise."""
    if name.endswith("position_embeddings.weight") and ndim == 2:
        return 0
    if ndim == 3 and name.endswith(("proj_k.weight", "proj_v.weight", "shared_linear.weight")):
        return 2
    return None


def mark_universal_sequence_dims(universal_tag_dir: str) -> List[str]:
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
    consolidate_one: Callable[[str, str], Dict[str, torch.Tensor]],
) -> Dict[str, torch.Tensor]:
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
