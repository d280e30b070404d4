"""The exact sliding window (local + global attention, Transformer-LS): each query of a
windowed layer attends to the keys within ``local_window / 2`` positions of it (its document,
never padding), in one softmax with the layer's summaries. The window's inputs are built once per
forward by the encoder (:func:`make_window`); :func:`local_global` is the attention.
"""

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .documents import Documents
from .projections import span_summaries, span_summary_mask, summary_mask, tracing
from .rotary import rotate


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


def _band(r: int, device: torch.device) -> torch.Tensor:
    """``[r, 3r]`` bool: query ``t`` of a block may see key ``s`` of the three blocks around it
    (key position - query position = ``s - r - t`` in ``[-r, r]``)."""
    t = torch.arange(r, device=device)[:, None]
    s = torch.arange(3 * r, device=device)[None, :]
    return (s - r - t).abs() <= r


def local_global(
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
        return local_global_traced(q, k, v, proj_k, kp, vp, mask, local)
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
            s_sum, sum_valid = _summary_scores(qs, proj_k, kp, mask, documents)
            s_sum = F.pad(s_sum, (0, 0, 0, tail))  # [B, h, nb r, M]
            sum_valid = F.pad(sum_valid, (0, 0, 0, tail))
        m = s_sum.shape[-1]
        if sum_valid is not None:
            s_sum = s_sum.masked_fill(~sum_valid, neg)
            if has_key is not None:
                reach = sum_valid.any(-1)  # [B, 1, nb r or 1]
                reach = (
                    reach.view(b, 1, -1, r, 1) if reach.shape[-1] > 1 else reach[..., None, None]
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
            y = y[:, :, :n] + _summary_values(p_sum[:, :, :n], vp, proj_k, documents)
    y = y[:, :, :n]
    return y.transpose(1, 2).reshape(b, n, h * d)


def local_global_traced(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    proj_k: nn.Module,
    kp: torch.Tensor,
    vp: torch.Tensor,
    mask: torch.Tensor | None,
    local: LocalContext,
) -> torch.Tensor:
    """:func:`local_global` for ``torch.export`` (one row = one document, one rank): the
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
        return y.reshape(b, n, h * d)
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
    return y.reshape(b, n, h * d)


def _summary_scores(
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
