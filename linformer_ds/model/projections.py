"""Key/value projections along the sequence axis: the built-in kinds and their hooks.

``linear`` (learned ``E, F [k, N_max]``) and ``conv`` (Conv-Linformer's strided convolution) are
built in; more kinds register with :func:`register_projection` (docs/extending.md). A kind's
module answers its own questions (padding of its summaries, sequence parallelism), so attention
never branches on a kind's name.
"""

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .documents import Documents, _nonempty
from .registry import (  # noqa: F401  (re-exported: the kinds' API in one place)
    Config,
    ModelConfigError,
    ProjectionKind,
    _make_projection,
    get_projection,
    projection_names,
    projection_stride,
    register_projection,
    tracing,
    unregister_projection,
)


class Projection(nn.Module):
    """Base of the built-in projection modules: the questions attention asks a kind, answered by
    the kind (attention never branches on a kind's name). A registered module that does not
    derive from it gets these defaults: summaries ``[B, m, h, d]`` (isolated: ``[S, m, h, d]``,
    one set per span) that padding never reaches.

    Layout, set from outside: ``sequence_parallel`` (linformer_ds.parallel.parallelize).
    """

    sequence_dim: int | None = None  # weight's dim indexed by sequence position, if any

    def __init__(self) -> None:
        super().__init__()
        self.sequence_parallel: Any | None = None

    def summary_mask(self, mask: torch.Tensor) -> torch.Tensor | None:
        """``mask [B, n]`` bool (this rank's slice) -> ``[B, m]``: the summaries that hold a real
        token (None: all of them)."""
        return None

    def span_summaries(self, y: torch.Tensor, documents: Documents) -> "list[torch.Tensor]":
        """The output of ``forward(x, documents)`` -> each span's summaries ``[m_i, h, d]``."""
        return list(y.unbind(0))

    def span_summary_mask(self, real: torch.Tensor) -> torch.Tensor | None:
        """``real [L]`` bool (one span's tokens) -> ``[m_i]``: its summaries that hold a real
        token (None: all)."""
        return None

    def chunk_summaries(
        self,
        kp: torch.Tensor,
        vp: torch.Tensor,
        documents: Documents,
        mask: torch.Tensor | None,
        plan: "Any",
        tokens: int,
    ) -> "tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]":
        """Summaries of each query chunk of ``plan`` (:class:`DocumentChunks`): ``[C, m, h, d]``
        keys and values and a ``[C, 1, 1, m]`` mask (None: all valid)."""
        return kp.index_select(0, plan.span), vp.index_select(0, plan.span), None


def summary_mask(proj: nn.Module, mask: torch.Tensor) -> torch.Tensor | None:
    """:meth:`Projection.summary_mask` of any projection module (a registered one that is not a
    :class:`Projection` keeps its summaries clear of padding itself)."""
    return proj.summary_mask(mask) if isinstance(proj, Projection) else None


def span_summaries(proj: nn.Module, y: torch.Tensor, documents: Documents) -> list:
    if isinstance(proj, Projection):
        return proj.span_summaries(y, documents)
    return list(y.unbind(0))


def span_summary_mask(proj: nn.Module, real: torch.Tensor) -> torch.Tensor | None:
    return proj.span_summary_mask(real) if isinstance(proj, Projection) else None


def chunk_summaries(proj: nn.Module, kp, vp, documents, mask, plan, tokens):  # noqa: ANN001
    if isinstance(proj, Projection):
        return proj.chunk_summaries(kp, vp, documents, mask, plan, tokens)
    return Projection.chunk_summaries(proj, kp, vp, documents, mask, plan, tokens)


class LinearProjection(Projection):
    """Learned projection along the sequence axis: ``[B, n, h, d] -> [B, k, h, d]``.

    ``weight`` is ``[H, k, N_max]`` with ``H = 1`` (shared by all heads) or ``H = num_heads``.
    Inputs shorter than ``N_max`` use the first ``n`` columns (fairseq's slicing).
    Sequence parallel (``sequence_parallel`` set): the rank's slice uses the columns at its
    global offset and the partial products are summed over the group (``E K = sum_r E_r K_r``).
    Sharded (``shard_sequence_parameters``): ``weight`` holds only the columns from
    ``shard_start`` on (``[H, k, N_max / P]``), the ones this rank's slice uses.
    """

    sequence_dim = 2  # weight's dim indexed by sequence position (sharded under SP)
    projection_kind = "linear"  # its registered kind (_make_projection sets it on every module)

    def __init__(
        self, k: int, max_seq_len: int, heads: int, init_std: float, frozen: bool,
        init: str = "normal",
    ):  # fmt: skip
        super().__init__()
        self.k, self.max_seq_len, self.heads = k, max_seq_len, heads
        # global column of weight[..., 0] (sequence_parallel.shard_sequence_parameters sets it)
        self.shard_start = 0
        self.init_std, self.init = init_std, init
        self.weight = nn.Parameter(torch.empty(heads, k, max_seq_len), requires_grad=not frozen)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``normal``: N(0, init_std). ``pooling``: row j averages the positions
        ``n`` with ``floor(n k / N_max) = j`` (the same for every head; sharded: own columns)."""
        if self.init != "pooling":
            nn.init.normal_(self.weight, std=self.init_std)
            return
        width = self.weight.shape[-1]
        # on the CPU even under torch.device("meta") (export's shape check, transformers'
        # meta init): bincount has no meta kernel; copy_ into a meta weight is a no-op
        cpu = torch.device("cpu")
        slot = torch.arange(self.max_seq_len, device=cpu) * self.k // self.max_seq_len  # [N_max]
        count = torch.bincount(slot, minlength=self.k).clamp(min=1)  # [k] positions per row
        cols = slot[self.shard_start : self.shard_start + width]
        w = (cols[None, :] == torch.arange(self.k, device=cpu)[:, None]) / count[:, None]
        with torch.no_grad():
            self.weight.copy_(w.to(self.weight.dtype).expand_as(self.weight))

    def forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        """``[B, n, h, d] -> [B, k, h, d]``; with ``documents``: each span's own summaries
        ``[S, k, h, d]`` (E's columns from the span's document position on; a document split
        over sequence-parallel ranks gets the sum of its parts)."""
        if documents is not None:
            return self._project_documents(x, documents)
        b, n, h, d = x.shape
        sp = self.sequence_parallel
        off = 0 if sp is None else sp.offset(n) - self.shard_start  # column in the local weight
        width = self.weight.shape[-1]
        if not 0 <= off <= width - n:
            raise ValueError(
                f"sequence-parallel slice [{off + self.shard_start}, "
                f"{off + self.shard_start + n}) is outside the E/F columns this rank holds "
                f"[{self.shard_start}, {self.shard_start + width}): sharded E/F need N = max_seq_len"
            )
        if tracing():  # any batch and length: one batched product, E sliced whatever n is
            cols = torch.arange(off, off + n, device=x.device)  # a slice would guard n != N
            w = self.weight.index_select(2, cols)
            if self.heads == 1:  # bmm: matmul and einsum would guard on n == 1 or B == 1
                e = w.expand(b, self.k, n)
                y = torch.bmm(e, x.reshape(b, n, h * d)).view(b, self.k, h, d)
            else:  # one bmm per head (a static count): reshaping x would guard on B == 1
                e = [w[i].expand(b, self.k, n) for i in range(h)]
                y = torch.stack([torch.bmm(e[i], x[:, :, i]) for i in range(h)], dim=2)
            return y if sp is None else sp.reduce_projection(y)
        # Plain views where possible: the backward of slicing/indexing zero-fills a gradient.
        w = self.weight if n == width else self.weight[:, :, off : off + n]
        if self.heads == 1:  # one GEMM over all heads: [k, n] @ [B, n, h*d]
            # One mm per row, not matmul or bmm: matmul runs [k, n] @ [B, n, D] as
            # (x^T E^T)^T, whose input gradient comes out transposed and makes the stack/cat
            # that joins the k, v and q gradients (unbind/split backward) several times slower; bmm
            # copies the transposed strided input for E's gradient. mm takes each row as the
            # strided slice of qkv it is and returns contiguous gradients.
            e = w.squeeze(0)
            ys = [torch.mm(e, xi) for xi in x.reshape(b, n, h * d).unbind(0)]
            y = (ys[0][None] if b == 1 else torch.stack(ys)).view(b, self.k, h, d)
        else:
            y = torch.einsum("hkn,bnhd->bkhd", w, x)
        return y if sp is None else sp.reduce_projection(y)

    def _project_documents(self, x: torch.Tensor, documents: Documents) -> torch.Tensor:
        """``x [B, n, h, d]`` -> ``[S, k, h, d]``: span i's tokens times E's columns
        ``[column, column + length)`` (the slicing a lone document of that length uses), as one
        batched product over chunks of k positions (:class:`DocumentChunks`) summed per span."""
        b, n, h, d = x.shape
        if self.shard_start or self.weight.shape[-1] != self.max_seq_len:
            raise ValueError("document isolation needs the whole E/F (not sharded)")
        sp = self.sequence_parallel
        if documents.per_span:  # span i: E[:, col : col + L] @ x[row, start:end], both views
            ys = []
            for s, xi in zip(documents.spans, documents.split(x)):  # xi [L, h, d]
                w = self.weight[:, :, s.column : s.column + s.end - s.start]
                if self.heads == 1:
                    ys.append(torch.mm(w[0], xi.reshape(-1, h * d)))
                else:
                    ys.append(torch.einsum("hkn,nhd->khd", w, xi))
            y = torch.stack(ys).view(len(ys), self.k, h, d)
            return y if sp is None else sp.reduce_documents(y, documents)
        plan = documents.chunks(self.k, b * n, x.device)
        c, num = plan.size, len(documents.spans)
        flat = torch.cat([x.reshape(b * n, h * d), x.new_zeros(1, h * d)])  # + an empty slot
        xc = flat.index_select(0, plan.tokens.reshape(-1)).view(-1, c, h * d)  # [C, c, hd]
        w = self.weight
        if w.shape[-1] % c:
            w = F.pad(w, (0, c - w.shape[-1] % c))
        wc = w.view(self.heads, self.k, -1, c).index_select(2, plan.block)  # [H, k, C, c]
        if self.heads == 1:
            y = torch.bmm(wc[0].transpose(0, 1), xc).view(-1, self.k, h, d)  # [C, k, h, d]
        else:
            y = torch.einsum("hkjc,jchd->jkhd", wc, xc.view(-1, c, h, d))
        y = y.new_zeros((num,) + tuple(y.shape[1:])).index_add(0, plan.span, y)
        return y if sp is None else sp.reduce_documents(y, documents)

    def extra_repr(self) -> str:
        return f"heads={self.heads}, k={self.k}, max_seq_len={self.max_seq_len}"


class ConvProjection(Projection):
    """Strided 1-D convolution over the sequence (Conv-Linformer): ``[B, n, h, d] -> [B, c, h, d]``.

    kernel = stride = ``r``; ``c = ceil(n / r)`` (the input is zero-padded to a multiple of r).
    ``weight`` is ``[H, d_out, d_in, r]`` (Conv1d layout per head), ``bias`` is ``[H, d]``;
    ``H = 1`` shares the kernel across heads. Parameters: ``H * (d*d*r + d)``.
    Sequence parallel: the rank's slice (a multiple of r) gives its own blocks, all-gathered.
    """

    sequence_dim = None  # the kernels are the same for every block: nothing sequence-shaped
    projection_kind = "conv"

    def __init__(self, stride: int, head_dim: int, heads: int, frozen: bool, init: str = "normal"):
        super().__init__()
        self.stride, self.heads, self.head_dim, self.init = stride, heads, head_dim, init
        self.weight = nn.Parameter(
            torch.empty(heads, head_dim, head_dim, stride), requires_grad=not frozen
        )
        self.bias = nn.Parameter(torch.zeros(heads, head_dim), requires_grad=not frozen)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``normal``: N(0, 1/sqrt(r d)); ``pooling``: the block mean (identity / r per tap)."""
        if self.init == "pooling":
            eye = torch.eye(self.head_dim, dtype=self.weight.dtype) / self.stride  # [d_out, d_in]
            with torch.no_grad():
                self.weight.copy_(eye[None, :, :, None].expand_as(self.weight))
        else:
            nn.init.normal_(self.weight, std=1.0 / math.sqrt(self.stride * self.head_dim))
        nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        """``[B, n, h, d] -> [B, c, h, d]``; with ``documents``: every span's blocks, windows
        starting at its own start (its tail zero-padded), concatenated: ``[sum c_i, h, d]``."""
        if documents is not None:
            if self.sequence_parallel is not None:
                raise ValueError("conv projection: document isolation under sequence parallelism")
            b, n, h, d = x.shape
            plan = documents.chunks(self.stride, b * n, x.device)  # one chunk = one window
            # one scatter of every token to its window slot (tails stay zero); its backward is
            # a gather, where index_select's would be a scatter-add
            windows = x.new_zeros(plan.tokens.numel(), h * d)
            windows = windows.index_copy(0, plan.slot, x.reshape(b * n, h * d))
            return self._blocks(windows.view(1, -1, h, d))[0]
        b, n, h, d = x.shape
        r = self.stride
        pad = (n + r - 1) // r * r - n  # to c r: no export guards; // of n >= 0 (ONNX truncates)
        sp = self.sequence_parallel
        if sp is not None and pad:
            raise ValueError(f"sequence parallel conv: slice length {n} is not a multiple of {r}")
        if tracing() or pad:  # traced: padded (by 0 when n is a multiple) for any length
            x = F.pad(x, (0, 0, 0, 0, 0, pad))
        y = self._blocks(x)
        return y if sp is None else sp.gather_blocks(y)

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, c r, h, d]`` (a multiple of the stride) -> ``[B, c, h, d]``."""
        b, n, h, d = x.shape
        r = self.stride
        c = n // r
        # One GEMM contracting the whole window (r taps x d inputs = K of r*d) per output block;
        # einsum would contract d only and then sum the r partial products in a second pass.
        x = x.view(b, c, r, h, d).transpose(2, 3)  # [B, c, h, r, d_in]
        if self.heads == 1:
            w = self.weight.squeeze(0).permute(0, 2, 1).reshape(d, r * d)  # [d_out, (r, d_in)]
            y = torch.matmul(x.reshape(b, c, h, r * d), w.t())  # [B, c, h, d_out]
        else:
            w = self.weight.permute(0, 3, 2, 1).reshape(h, r * d, d)  # [h, (r, d_in), d_out]
            if tracing():  # bmm per head: matmul would guard on B == 1 and c == 1
                xh = x.permute(2, 0, 1, 3, 4).reshape(h, b * c, r * d)
                y = torch.bmm(xh, w).view(h, b, c, d).permute(1, 2, 0, 3)
            else:
                y = torch.matmul(x.reshape(b, c, h, 1, r * d), w).view(b, c, h, d)
        return y + self.bias

    def summary_mask(self, mask: torch.Tensor) -> torch.Tensor | None:
        """Blocks made only of padding are ignored (under sequence parallelism: every block of
        the sequence, gathered)."""
        b, n = mask.shape
        r = self.stride
        blocks = F.pad(mask, (0, (n + r - 1) // r * r - n)).view(b, -1, r).any(dim=-1)
        return (
            blocks if self.sequence_parallel is None else self.sequence_parallel.gather_mask(blocks)
        )

    def span_summaries(self, y: torch.Tensor, documents: Documents) -> list:
        """``[sum c_i, h, d]`` -> span i's ``c_i = ceil(L_i / r)`` windows."""
        return list(y.split([-(-(s.end - s.start) // self.stride) for s in documents.spans]))

    def span_summary_mask(self, real: torch.Tensor) -> torch.Tensor | None:
        r = self.stride
        return F.pad(real, (0, -(-real.shape[0] // r) * r - real.shape[0])).view(-1, r).any(-1)

    def chunk_summaries(self, kp, vp, documents, mask, plan, tokens):  # noqa: ANN001
        """``[C_w, h, d]`` windows -> each chunk's document's windows ``[C, J, h, d]`` (J: the
        most of one document), empty and padding-only ones masked."""
        h, d = kp.shape[-2:]
        win = documents.chunks(self.stride, tokens, kp.device)
        valid = win.key_index < win.tokens.shape[0]  # [S, J]
        if mask is not None:  # windows made only of padding are ignored
            m = torch.cat([mask.reshape(-1), mask.new_zeros(1)])
            real = m.index_select(0, win.tokens.reshape(-1)).view(win.tokens.shape).any(-1)
            real = torch.cat([real, real.new_zeros(1)])
            valid = real.index_select(0, win.key_index.reshape(-1)).view(valid.shape)
        kp, vp = (
            torch.cat([t, t.new_zeros((1,) + tuple(t.shape[1:]))])
            .index_select(0, win.key_index.reshape(-1))
            .view(win.key_index.shape + (h, d))
            .index_select(0, plan.span)
            for t in (kp, vp)
        )
        return kp, vp, _nonempty(valid).index_select(0, plan.span)[:, None, None, :]

    def extra_repr(self) -> str:
        return f"heads={self.heads}, head_dim={self.head_dim}, kernel=stride={self.stride}"


class LocalProjection(Projection):
    """The ``local`` kind: no summaries (``[B, 0, h, d]``); its layers attend through the
    sliding window (``model.local_window``) alone. No parameters."""

    projection_kind = "local"

    def forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        rows = x.shape[0] if documents is None else len(documents.spans)
        return x.new_zeros((rows, 0) + tuple(x.shape[2:]))

    def reset_parameters(self) -> None:
        pass


class DynamicProjection(Projection):
    """Transformer-LS's dynamic projection (Zhu et al. 2021): ``k`` summaries whose weights are
    computed from the input: ``P = softmax_n(x w)`` over the positions of each row (each
    document under isolation; padding never weighs), summaries ``P^T x``:
    ``[B, n, h, d] -> [B, k, h, d]``. ``weight [H, d, k]`` (``H = 1``: shared by all heads).
    No ``N_max``-wide parameter: any length. Sequence parallelism: not supported (the softmax
    over a document split across ranks would need its max and sum from every rank)."""

    projection_kind = "dynamic"

    def __init__(self, k: int, head_dim: int, heads: int):
        super().__init__()
        self.k, self.heads, self.head_dim = k, heads, head_dim
        self.weight = nn.Parameter(torch.empty(heads, head_dim, k))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=1.0 / math.sqrt(self.head_dim))

    def forward(
        self,
        x: torch.Tensor,
        documents: Documents | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x [B, n, h, d]`` (``h`` may be ``2 * heads``: keys and values together, each set
        weighing itself); ``mask [B, n]`` bool; with ``documents``: ``[S, k, h, d]``."""
        b, n, h, d = x.shape
        w = self.weight if self.heads == h else self.weight.expand(h, d, self.k)
        scores = torch.einsum("bnhd,hdk->bnhk", x, w.to(x.dtype)).float()
        if mask is not None:
            scores = scores.masked_fill(~mask[:, :, None, None], torch.finfo(scores.dtype).min)
        if documents is None:
            p = scores.softmax(dim=1).to(x.dtype)
            return torch.einsum("bnhk,bnhd->bkhd", p, x)
        ys = []
        for si, xi in zip(documents.split(scores), documents.split(x)):  # [L, h, k], [L, h, d]
            ys.append(torch.einsum("lhk,lhd->khd", si.softmax(dim=0).to(x.dtype), xi))
        return torch.stack(ys)

    def extra_repr(self) -> str:
        return f"heads={self.heads}, head_dim={self.head_dim}, k={self.k}"
