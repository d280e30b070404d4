"""What crosses ranks inside the model when one sequence is split over an SP group.

Per layer (derivation in docs/sequence_parallel.md):

* ``linear``: ``E K = sum_r E[:, s_r] K[s_r]``. Each rank projects its own slice with the columns
  of E at its global offset; one all-reduce (sum) of the ``[B, k, h, d]`` result over the SP
  group gives the exact projected keys/values. Backward: an all-reduce of the incoming gradient.
* ``conv``: slices aligned to the stride (N/P a multiple of r) compress to whole local blocks;
  an all-gather along the block axis gives every block (and the padding-block mask). Backward: a
  reduce-scatter, each rank keeps the summed gradient of its own blocks.
* ``dense``: DeepSpeed-Ulysses (``deepspeed.sequence.layer.DistributedAttention``): all-to-all
  from sequence slices to head slices and back; the full padding mask is all-gathered.

The model stays plain PyTorch: :func:`linformer_ds.parallel.parallelize.apply_sequence_parallel`
installs a :class:`SequenceParallel` object on the encoder, attention and projection modules;
they call it where a collective is needed. Also here: the replica's label count
(:func:`global_label_count`) and the gradient hook that sums a replicated parameter's shares
over the group (:func:`sum_over_group`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


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
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
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
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
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
        attn_mask: torch.Tensor | None = None,
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
        self._ulysses: nn.Module | None = None

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
        self, position_ids: torch.Tensor, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
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
        attn_mask: torch.Tensor | None,
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


def sum_over_group(group: Any) -> Any:
    """A gradient hook: the gradient summed over ``group`` (a replicated parameter's shares
    of the P slices, under sharded sequence parallelism)."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        g = grad.contiguous().clone()
        dist.all_reduce(g, group=group)
        return g

    return hook
