"""Multi-head self-attention: dense, or against projected summaries of the keys and values
(linear, conv, dynamic, registered kinds), optionally joined by an exact sliding window (local +
global attention, Transformer-LS), with rotary positions on exact attention.

Every per-kind question (which summaries hold padding, how the summaries of a document are laid
out) is answered by the projection module (:class:`~.projections.Projection`): no branch here
on a kind's name.
"""

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .documents import Documents, _nonempty
from .kernels import short_attention
from .projections import (
    _make_projection,
    chunk_summaries,
    get_projection,
    span_summaries,
    span_summary_mask,
    summary_mask,
    tracing,
)


class Window(NamedTuple):
    """What every windowed layer of one forward pass shares (built once by the encoder with
    :func:`make_window`): ``radius`` ``r = local_window / 2``; ``query_doc [B, n]`` each query's
    document number (this rank's slice); ``key_doc [B, n + 2r]`` the document number of the keys
    from ``r`` positions before the slice to ``r`` after it, ``-1`` for padding and positions
    outside the row; ``halo(x, r)`` the neighbouring ranks' ``r`` rows either side (None: zeros,
    one rank); ``block_mask [B, 1, nb, r, 3r]`` which of the ``3r`` keys around each block of
    ``r`` queries each query may see (its document, within ``r``, not padding) and ``has_key
    [B, 1, nb, r, 1]`` whether it sees any (None: built on use)."""

    radius: int
    query_doc: torch.Tensor
    key_doc: torch.Tensor
    halo: Callable[[torch.Tensor, int], torch.Tensor] | None = None
    block_mask: torch.Tensor | None = None
    has_key: torch.Tensor | None = None


def make_window(
    radius: int,
    query_doc: torch.Tensor,
    key_doc: torch.Tensor,
    halo: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
) -> Window:
    """A :class:`Window` with its block mask: query block ``j`` (positions ``[j r, j r + r)``)
    reads the keys ``[j r - r, j r + 2r)``; a query may see a key of its own document within
    ``r`` positions that is not padding."""
    r = radius
    b, n = query_doc.shape
    nb = -(-n // r)
    tail = nb * r - n
    key_blocks = F.pad(key_doc, (0, tail), value=-1).unfold(1, 3 * r, r)  # [B, nb, 3r]
    query_blocks = F.pad(query_doc, (0, tail), value=-2).view(b, nb, r)
    valid = (query_blocks[..., :, None] == key_blocks[..., None, :]) & _band(r, query_doc.device)
    return Window(r, query_doc, key_doc, halo, valid[:, None], valid.any(-1)[:, None, :, :, None])


class LocalContext(NamedTuple):
    """Per-forward inputs of the attention layers beyond the mask and the documents:
    ``window`` (None: no layer has one) and ``rotary`` (``cos, sin [B or 1, n, 1, d_h / 2]``,
    None: learned positions)."""

    window: Window | None = None
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None


def rotary_tables(
    positions: torch.Tensor, head_dim: int, base: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``positions [n]`` or ``[B, n]`` -> ``cos, sin [B or 1, n, 1, head_dim / 2]`` (fp32)."""
    inv = base ** (-torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    angles = positions.float()[..., None] * inv  # [.., n, d/2]
    if angles.dim() == 2:
        angles = angles[None]
    return angles.cos()[:, :, None], angles.sin()[:, :, None]


def rotate(x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """RoPE of ``x [B, n, h, d]`` (halves rotated as pairs, GPT-NeoX layout), in fp32."""
    cos, sin = rotary
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def _band(r: int, device: torch.device) -> torch.Tensor:
    """``[r, 3r]`` bool: query ``t`` of a block may see key ``s`` of the three blocks around it
    (key position - query position = ``s - r - t`` in ``[-r, r]``)."""
    t = torch.arange(r, device=device)[:, None]
    s = torch.arange(3 * r, device=device)[None, :]
    return (s - r - t).abs() <= r


class LinformerSelfAttention(nn.Module):
    """Multi-head self-attention of one layer, of kind ``config.projection_schedule()[i]``.

    ``forward(x [B, n, D], attention_mask [B, n] or None, shared_projection, documents, local)
    -> [B, n, D]``. Under ``sharing='layerwise'`` the projection is owned by the encoder and
    passed in as a module; it is always called (never read), so ZeRO-3 gathers its parameters.
    Sequence parallel: ``x`` is the rank's slice; the projections exchange their summaries,
    summary masks and dense masks are gathered, dense layers run DeepSpeed-Ulysses, windows
    read the neighbouring ranks' edge rows (a halo exchange).
    """

    def __init__(self, config: ModelConfig, layer_idx: int = 0):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.kind = config.projection_schedule()[layer_idx]
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.hidden_size = config.hidden_size
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.out = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout_p = config.attention_dropout
        self.windowed = self.kind != "dense" and config.local_window > 0
        self.masked_projection = self.kind != "dense" and get_projection(self.kind).masked
        self.summarised = self.kind != "dense" and get_projection(self.kind).summaries
        self.proj_k: nn.Module | None = None
        self.proj_v: nn.Module | None = None
        # layout, set from outside (linformer_ds.parallelize.apply_sequence_parallel)
        self.sequence_parallel: Any | None = None
        if self.kind != "dense" and config.sharing != "layerwise":
            heads = config.num_heads if config.sharing == "none" else 1
            self.proj_k = _make_projection(config, layer_idx, self.kind, heads)
            if config.sharing in ("none", "headwise"):
                self.proj_v = _make_projection(config, layer_idx, self.kind, heads)

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        shared_projection: nn.Module | None = None,
        documents: Documents | None = None,
        local: LocalContext | None = None,
    ) -> torch.Tensor:
        """``documents`` (:func:`document_spans`): each token attends only within its own
        document (its own summaries, windows or tokens); None: the whole row. ``local``: the
        window and rotary tables of this batch (:class:`LocalContext`)."""
        b, n, _ = x.shape
        h, d = self.num_heads, self.head_dim
        qkv = self.qkv(x)  # [B, n, 3D]
        dropout_p = self.dropout_p if self.training else 0.0
        mask = attention_mask.bool() if attention_mask is not None else None
        isolated = documents is not None and not documents.whole_rows
        local = local if local is not None else LocalContext()
        if self.windowed and local.window is None:
            raise ValueError(f"layer {self.layer_idx} has a window: it needs `local.window`")
        if self.kind == "dense":
            return self._dense(qkv, mask, documents if isolated else None, local, dropout_p)

        # unbind/split rather than slicing: their backward writes the three gradients into one
        # [B, n, 3D] tensor (a stack/cat) instead of zero-filling and summing three of them.
        q, kv = qkv.split([self.hidden_size, 2 * self.hidden_size], dim=-1)
        kv = kv.view(b, n, 2 * h, d)  # keys then values of each token, still a view of qkv
        if mask is not None:  # padded positions contribute nothing to the projected keys/values
            kv = kv * mask[:, :, None, None].to(kv.dtype)
        proj_k = self._projection(shared_projection)
        kp = vp = None  # a kind without summaries (local): the window alone
        if self.summarised:
            kp, vp = self._summaries(proj_k, kv, mask, documents if isolated else None)
        if self.windowed:
            k, v = kv.view(b, n, 2, h, d).unbind(2)
            return self._local_global(
                q.view(b, n, h, d), k, v, proj_k, kp, vp, mask, documents if isolated else None,
                local, dropout_p,
            )  # fmt: skip
        if isolated:
            return self._isolated(q, kp, vp, proj_k, mask, documents, dropout_p)
        q = q.view(b, n, h, d).transpose(1, 2)  # [B, h, n, d] (a strided view, no copy)
        attn_mask = None
        if mask is not None:
            blocks = summary_mask(proj_k, mask)  # the kind says which summaries are padding
            attn_mask = None if blocks is None else _nonempty(blocks)[:, None, None, :]
        # SDPA or the explicit product, by the measured rule for (n, m, dtype) (kernels.py)
        y = short_attention(q, kp.transpose(1, 2), vp.transpose(1, 2), attn_mask, dropout_p)
        return self.out(y.transpose(1, 2).reshape(b, n, self.hidden_size))

    # ------------------------------------------------------------------------------- pieces
    def _projection(self, shared_projection: nn.Module | None) -> nn.Module:
        if self.proj_k is not None:
            return self.proj_k
        if shared_projection is None:
            raise ValueError(
                f"layer {self.layer_idx}: sharing='layerwise' needs the encoder's shared "
                "projection passed as `shared_projection`"
            )
        return shared_projection

    def _summaries(
        self,
        proj_k: nn.Module,
        kv: torch.Tensor,
        mask: torch.Tensor | None,
        documents: Documents | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Projected keys and values: ``[B, m, h, d]`` each (isolated: the kind's per-span
        layout, e.g. ``[S, m, h, d]``)."""
        b, n = kv.shape[:2]
        h, d = self.num_heads, self.head_dim
        extra = {"mask": mask} if self.masked_projection else {}
        if self.proj_v is None:  # E = F: one GEMM projects keys and values together
            y = proj_k(kv, documents, **extra) if documents is not None else proj_k(kv, **extra)
            return y.view(y.shape[:-2] + (2, h, d)).unbind(-3)
        k_in, v_in = kv.view(b, n, 2, h, d).unbind(2)
        if documents is not None:
            return proj_k(k_in, documents, **extra), self.proj_v(v_in, documents, **extra)
        return proj_k(k_in, **extra), self.proj_v(v_in, **extra)

    def _dense(
        self,
        qkv: torch.Tensor,
        mask: torch.Tensor | None,
        documents: Documents | None,
        local: LocalContext,
        dropout_p: float,
    ) -> torch.Tensor:
        """Full softmax attention (each document alone under isolation; Ulysses under sequence
        parallelism); rotary positions on queries and keys when set."""
        b, n, _ = qkv.shape
        h, d = self.num_heads, self.head_dim
        sp = self.sequence_parallel
        q, k, v = qkv.view(b, n, 3, h, d).unbind(2)  # [B, n, h, d]
        if local.rotary is not None:
            q, k = rotate(q, local.rotary), rotate(k, local.rotary)
        if sp is not None:  # Ulysses over the whole rows: the documents' or padding's mask
            if documents is not None:
                attn_mask = documents.block_mask
            else:
                full = sp.gather_mask(mask) if mask is not None else None
                attn_mask = _nonempty(full)[:, None, None, :] if full is not None else None
            y = sp.dense_attention(q, k, v, attn_mask, dropout_p)  # [B, n, h, d]
            return self.out(y.reshape(b, n, self.hidden_size))
        if documents is None:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            attn_mask = _nonempty(mask)[:, None, None, :] if mask is not None else None
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)
            return self.out(y.transpose(1, 2).reshape(b, n, self.hidden_size))
        ys = []
        for s, *qkv_i in zip(documents.spans, *(documents.split(t) for t in (q, k, v))):
            qi, ki, vi = (t.transpose(0, 1)[None] for t in qkv_i)  # [1, h, L, d]
            am = None
            if s.padded and mask is not None:
                am = _nonempty(mask[s.row, s.start : s.end][None])[:, None, None, :]
            y = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=am, dropout_p=dropout_p)
            ys.append(y[0].transpose(0, 1))  # [L, h, d]
        return self.out(torch.cat(ys).view(b, n, self.hidden_size))

    def _isolated(
        self,
        q: torch.Tensor,
        kp: torch.Tensor,
        vp: torch.Tensor,
        proj_k: nn.Module,
        mask: torch.Tensor | None,
        documents: Documents,
        dropout_p: float,
    ) -> torch.Tensor:
        """Document-isolated attention of ``q [B, n, D]`` against each document's own summaries
        (the kind's per-span layout): one attention per span on views (the CPU path), or batched
        over chunks of k document positions (:class:`DocumentChunks`)."""
        b, n, _ = q.shape
        h, d = self.num_heads, self.head_dim
        sdpa = short_attention  # SDPA or the explicit product per span/chunk (kernels.py)
        spans = documents.spans
        if documents.per_span:  # each span's queries (a view) against its own summaries
            ks, vs = span_summaries(proj_k, kp, documents), span_summaries(proj_k, vp, documents)
            ys = []
            for s, qi, ki, vi in zip(spans, documents.split(q.view(b, n, h, d)), ks, vs):
                am = None
                if s.padded and mask is not None:  # the kind says which summaries are padding
                    real = span_summary_mask(proj_k, mask[s.row, s.start : s.end])
                    am = None if real is None else _nonempty(real[None])[:, None, None, :]
                ki, vi = (t.reshape(-1, h, d).transpose(0, 1)[None] for t in (ki, vi))
                y = sdpa(qi.transpose(0, 1)[None], ki, vi, attn_mask=am, dropout_p=dropout_p)
                ys.append(y[0].transpose(0, 1))  # [L, h, d]
            return self.out(torch.cat(ys).view(b, n, self.hidden_size))
        # queries in chunks of k positions of a document, each chunk against its document's
        # summaries (the kind lays them out per chunk, with their mask)
        plan = documents.chunks(self.config.k_for_layer(self.layer_idx), b * n, q.device)
        kc, vc, am = chunk_summaries(proj_k, kp, vp, documents, mask, plan, b * n)
        flat = torch.cat([q.reshape(b * n, h * d), q.new_zeros(1, h * d)])
        qc = flat.index_select(0, plan.tokens.reshape(-1)).view(-1, plan.size, h, d)
        kc, vc = kc.transpose(1, 2), vc.transpose(1, 2)
        y = sdpa(qc.transpose(1, 2), kc, vc, attn_mask=am, dropout_p=dropout_p)  # [C, h, c, d]
        y = y.transpose(1, 2).reshape(-1, h * d).index_select(0, plan.slot)  # [B n, D]
        return self.out(y.view(b, n, self.hidden_size))

    # -------------------------------------------------------------------- local + global
    def _local_global(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        proj_k: nn.Module,
        kp: torch.Tensor | None,
        vp: torch.Tensor | None,
        mask: torch.Tensor | None,
        documents: Documents | None,
        local: LocalContext,
        dropout_p: float,
    ) -> torch.Tensor:
        """Each query against the keys within ``r`` positions of it (its document, no padding)
        and its document's summaries, in one softmax (Transformer-LS). ``q, k, v [B, n, h, d]``.

        The window runs in blocks of ``r`` queries against the ``3r`` keys around them: heads
        first (``[B, h, nb, r, d]``), so each product is one batched GEMM over contiguous blocks
        and the keys of a block are three neighbouring blocks side by side (memory and work
        O(n r)). Scores and softmax stay in the compute dtype, as eager attention does. Rotary
        positions turn the window's queries and keys (the summaries' keys stay unrotated). A
        query with no key in reach (padding among padding) gets no attention output, the same in
        every path."""
        b, n, h, d = q.shape
        win = local.window
        r = win.radius
        if tracing():  # export: the same math as one band-masked product (shape-generic)
            return self._local_global_traced(q, k, v, proj_k, kp, vp, mask, local)
        if win.block_mask is None:
            win = make_window(r, win.query_doc, win.key_doc, win.halo)
        nb = -(-n // r)  # query blocks
        tail = nb * r - n
        qs = q * (1.0 / math.sqrt(d))
        qw, kw = qs, k
        if local.rotary is not None:
            qw, kw = rotate(qs, local.rotary), rotate(k, local.rotary)

        def around(t: torch.Tensor) -> torch.Tensor:
            """``[B, n, h, d]`` -> ``[B, h, nb, 3r, d]``: the keys from ``r`` before each query
            block to ``r`` after it (the neighbouring ranks' rows at the slice's edges)."""
            if win.halo is None:  # heads first and padded in one copy
                t = F.pad(t.transpose(1, 2), (0, 0, r, r + tail))
            else:
                t = F.pad(win.halo(t, r).transpose(1, 2), (0, 0, 0, tail))
            t = t.view(b, h, nb + 2, r, d)
            return torch.cat([t[:, :, :-2], t[:, :, 1:-1], t[:, :, 2:]], dim=3)

        def blocks(t: torch.Tensor) -> torch.Tensor:  # [B, n, h, d] -> [B, h, nb r, d]
            return F.pad(t.transpose(1, 2), (0, 0, 0, tail))

        qb = blocks(qw)
        vb = around(v)
        scores = torch.matmul(qb.view(b, h, nb, r, d), around(kw).transpose(-1, -2))
        neg = torch.finfo(scores.dtype).min  # scores [B, h, nb, r, 3r]
        scores = scores.masked_fill(~win.block_mask, neg)
        has_key = win.has_key if mask is not None else None  # no padding: every query has one
        m = 0
        if kp is not None:
            if documents is None:  # every query against the row's summaries: one product
                qsb = qb if local.rotary is None else blocks(qs)
                s_sum = torch.matmul(qsb, kp.permute(0, 2, 3, 1))  # [B, h, nb r, M]
                real = None if mask is None else summary_mask(proj_k, mask)
                sum_valid = None if real is None else real[:, None, None, :]
            else:
                s_sum, sum_valid = self._summary_scores(qs, proj_k, kp, mask, documents)
                s_sum = F.pad(s_sum, (0, 0, 0, tail))  # [B, h, nb r, M]
                sum_valid = F.pad(sum_valid, (0, 0, 0, tail))
            m = s_sum.shape[-1]
            if sum_valid is not None:
                s_sum = s_sum.masked_fill(~sum_valid, neg)
                if has_key is not None:
                    reach = sum_valid.any(-1)  # [B, 1, nb r or 1]
                    reach = (
                        reach.view(b, 1, -1, r, 1)
                        if reach.shape[-1] > 1
                        else reach[..., None, None]
                    )
                    has_key = has_key | reach
            else:
                has_key = None  # every query reaches a summary
            scores = torch.cat([scores, s_sum.view(b, h, nb, r, m)], dim=-1)
        p = scores.softmax(dim=-1)
        if has_key is not None:
            p = p.masked_fill(~has_key, 0.0)
        if dropout_p:
            p = F.dropout(p, dropout_p)
        p_win, p_sum = p.split([3 * r, m], dim=-1)
        y = torch.matmul(p_win, vb).view(b, h, nb * r, d)
        if m:  # the split's rows stay strided views: no copy of the weights
            p_sum = p_sum.view(b, h, nb * r, m)
            if documents is None:
                y = y + torch.matmul(p_sum, vp.transpose(1, 2))
            else:
                y = y[:, :, :n] + self._summary_values(p_sum[:, :, :n], vp, proj_k, documents)
        y = y[:, :, :n]
        return self.out(y.transpose(1, 2).reshape(b, n, self.hidden_size))

    def _local_global_traced(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        proj_k: nn.Module,
        kp: torch.Tensor,
        vp: torch.Tensor,
        mask: torch.Tensor | None,
        local: LocalContext,
    ) -> torch.Tensor:
        """:meth:`_local_global` for ``torch.export`` (one row = one document, one rank): the
        window as a band mask over the whole ``[n, n]`` scores, no blocks to size."""
        b, n, h, d = q.shape
        win = local.window
        r = win.radius
        qs = q * (1.0 / math.sqrt(d))
        qw, kw = qs, k
        if local.rotary is not None:
            qw, kw = rotate(qs, local.rotary), rotate(k, local.rotary)
        s_win = torch.einsum("bihd,bjhd->bhij", qw, kw).float()
        pos = torch.arange(n, device=q.device)
        band = (pos[:, None] - pos[None, :]).abs() <= r
        key_ok = win.key_doc[:, r : r + n] >= 0  # [B, n]: not padding
        neg = torch.finfo(torch.float32).min
        s_win = s_win.masked_fill(~(band[None, None] & key_ok[:, None, None, :]), neg)
        win_ok = band[None, None] & key_ok[:, None, None, :]
        if kp is None:
            p = s_win.softmax(dim=-1).masked_fill(~win_ok, 0.0).to(q.dtype)
            y = torch.einsum("bhij,bjhd->bihd", p, v)
            return self.out(y.reshape(b, n, self.hidden_size))
        s_sum = torch.einsum("bihd,bmhd->bhim", qs, kp).float()
        blocks = None
        if mask is not None:
            blocks = summary_mask(proj_k, mask)
            if blocks is not None:
                s_sum = s_sum.masked_fill(~blocks[:, None, None, :], neg)
        p = torch.cat([s_win, s_sum], dim=-1).softmax(dim=-1)
        if blocks is not None:  # no key in reach (padding among padding): no output
            reach = win_ok.any(-1, keepdim=True) | blocks.any(-1)[:, None, None, None]
            p = p.masked_fill(~reach, 0.0)
        p_win, p_sum = p.split([n, kp.shape[1]], dim=-1)
        p_win, p_sum = p_win.masked_fill(~win_ok, 0.0).to(q.dtype), p_sum.to(q.dtype)
        y = torch.einsum("bhij,bjhd->bihd", p_win, v) + torch.einsum("bhim,bmhd->bihd", p_sum, vp)
        return self.out(y.reshape(b, n, self.hidden_size))

    def _summary_scores(
        self,
        qs: torch.Tensor,
        proj_k: nn.Module,
        kp: torch.Tensor,
        mask: torch.Tensor | None,
        documents: Documents | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Scores of ``qs [B, n, h, d]`` against each query's summaries ``[B, h, n, M]`` and
        which are valid (``[B, 1, n or 1, M]`` bool, None: all); isolated: each span's against
        its own (padded to the most of one span)."""
        b, n, h, d = qs.shape
        if documents is None:
            s = torch.matmul(qs.transpose(1, 2), kp.permute(0, 2, 3, 1))
            blocks = None if mask is None else summary_mask(proj_k, mask)
            return s, None if blocks is None else blocks[:, None, None, :]
        ks = span_summaries(proj_k, kp, documents)
        most = max(t.shape[0] for t in ks)
        scores: list[torch.Tensor] = []
        valid: list[torch.Tensor] = []
        for s, qi, ki in zip(documents.spans, documents.split(qs), ks):
            si = torch.einsum("lhd,mhd->lhm", qi, ki)
            ok = torch.ones(ki.shape[0], dtype=torch.bool, device=qs.device)
            if s.padded and mask is not None:
                real = span_summary_mask(proj_k, mask[s.row, s.start : s.end])
                ok = ok if real is None else real
            scores.append(F.pad(si, (0, most - ki.shape[0])))
            valid.append(F.pad(ok, (0, most - ki.shape[0])).expand(qi.shape[0], most))
        return (
            torch.cat(scores).view(b, n, h, most).transpose(1, 2),
            torch.cat(valid).view(b, 1, n, most),
        )

    def _summary_values(
        self,
        p: torch.Tensor,
        vp: torch.Tensor,
        proj_k: nn.Module,
        documents: Documents | None,
    ) -> torch.Tensor:
        """``p [B, h, n, M]`` weights of the summaries -> ``[B, h, n, d]``."""
        if documents is None:
            return torch.matmul(p, vp.transpose(1, 2))
        vs = span_summaries(proj_k, vp, documents)
        b, h, n, _ = p.shape
        d = vp.shape[-1]
        ys = [
            torch.einsum("lhm,mhd->lhd", pi[..., : vi.shape[0]], vi)
            for pi, vi in zip(documents.split(p.transpose(1, 2)), vs)
        ]
        return torch.cat(ys).view(b, n, h, d).transpose(1, 2)
