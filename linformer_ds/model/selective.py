"""The ``selective`` kind: each query picks its own blocks and reads them exactly.

The ``routed`` kind lets a block of queries share its picks (the best score over the block's
queries), so one query's key competes with its neighbours' picks. Here every query picks for
itself, from the scores it already computes for the summaries:

* the row is cut into blocks of ``C = max_seq_len / k`` tokens (``k`` at ``N_max``); a block's
  key (value) is the mean of its keys (values), padding left out;
* each query scores every block (``q . mean(K_j) / sqrt(d)``, unrotated) and reads the tokens of
  its ``m = model.routed_blocks`` best blocks **exactly** (rotary positions on those keys);
* in the same softmax, the means of the blocks it did not read.

Each key is counted once by the read and the summaries, so with ``m C >= n`` the layer is dense
attention with the same weights. The routing scores are the summary scores: a block that is not
read is trained through its summary's share of the softmax, a read one through its tokens'
scores (whose mean is the summary's). Cost per query: ``n / C`` summaries and ``m C`` exact
keys, O(n (k + m C) d) for the layer; memory holds the ``m C`` keys and values each query reads.
No window (``model.local_window`` does not apply; the local mixer gives the neighbours).
Document isolation: each document alone (its own blocks). Padding: blocks of padding are never
read or summarised; a padding query picks the first blocks (its output is ignored; so the
exported graph and PyTorch agree on it). ``torch.export`` / ONNX: :func:`_selective_traced`,
the same function with ``[n, n]`` masks. Sequence parallelism: not supported (a query's pick
may lie on any rank). Registered in ``kinds.py``.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from .documents import Documents, each_document
from .registry import tracing
from .rotary import rotate
from .routed import _no_query_order
from .window import LocalContext


def selective_attention(
    layer: nn.Module,
    qkv: torch.Tensor,
    mask: torch.Tensor | None,
    documents: Documents | None,
    local: LocalContext,
    dropout_p: float,
) -> torch.Tensor:
    """``qkv [B, n, 3D]`` -> ``[B, n, D]`` (before the output projection); ``documents``: each
    span attends within itself."""
    b, n, _ = qkv.shape
    h, d = layer.num_heads, layer.head_dim
    cfg, i = layer.config, layer.layer_idx
    cs, top = selective_block(cfg, i), int(cfg.routed_blocks)
    q, k, v = qkv.view(b, n, 3, h, d).unbind(2)  # [B, n, h, d]
    if documents is None:
        return _selective(q, k, v, mask, local.rotary, cs, top, dropout_p).reshape(b, n, h * d)
    y = each_document(
        lambda *t: _selective(*t, cs, top, dropout_p), documents, q, k, v, mask, local.rotary
    )
    return y.view(b, n, h * d)


def selective_block(config: object, layer_idx: int) -> int:
    """Tokens per block at layer ``layer_idx``: ``max_seq_len / k``."""
    return config.max_seq_len // config.k_for_layer(layer_idx)


def _selective(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None,
    cs: int,
    top: int,
    dropout_p: float,
) -> torch.Tensor:
    """One row set ``q, k, v [B, n, h, d]`` (``mask [B, n]`` bool, None: no padding) ->
    ``[B, n, h, d]`` with blocks of ``cs`` tokens. Heads and rows are one batch dimension
    (``G = B h``): the block scores ``[G, n, c]`` are one GEMM; each query's read is a gather of
    its blocks' rows ``[G n, m cs, d]`` and a batched product."""
    if tracing():
        return _selective_traced(q, k, v, mask, rotary, cs, top)
    B, n, h, d = q.shape
    nc = -(-n // cs)
    tail = nc * cs - n
    L, m, G, dev = nc * cs, min(top, nc), B * h, q.device
    acc = torch.promote_types(q.dtype, torch.float32)
    neg = torch.finfo(q.dtype).min
    scale = 1.0 / math.sqrt(d)

    def heads(t: torch.Tensor) -> torch.Tensor:  # [B, n, h, d] -> [G, L, d]
        t = t.permute(0, 2, 1, 3).reshape(G, n, d)
        return F.pad(t, (0, 0, 0, tail)) if tail else t

    padded = mask is not None or tail > 0
    real = torch.ones(B, n, dtype=torch.bool, device=dev) if mask is None else mask.bool()
    real_g = F.pad(real, (0, tail)).repeat_interleave(h, dim=0).view(G, nc, cs)
    kh, vh = heads(k), heads(v)
    count = real_g.sum(-1)  # [G, nc]
    denom = count.clamp(min=1)[..., None]
    if padded:
        w = real_g.to(k.dtype)[..., None]
        k_sum = (kh.view(G, nc, cs, d) * w).sum(2) / denom.to(k.dtype)
        v_sum = (vh.view(G, nc, cs, d) * w).sum(2) / denom.to(v.dtype)
    else:
        k_sum, v_sum = kh.view(G, nc, cs, d).mean(2), vh.view(G, nc, cs, d).mean(2)
    qs = heads(q) * scale
    s_sum = torch.bmm(qs, k_sum.transpose(1, 2))  # [G, L, nc]: every query, every block
    if padded:
        s_sum = s_sum.masked_fill(~(count > 0)[:, None, :], neg)
    route = _no_query_order(s_sum.detach(), real_g.view(G, L)) if padded else s_sum.detach()
    sel = route.topk(m, dim=-1).indices  # [G, L, m]: each query's blocks
    picked = torch.zeros(G, L, nc, dtype=torch.bool, device=dev).scatter(-1, sel, True)
    s_sum = s_sum.masked_fill(picked, neg)  # a block read exactly: its mean left out
    if rotary is not None:
        qs, kh = heads(rotate(q, rotary)) * scale, heads(rotate(k, rotary))
    flat = (sel + torch.arange(G, device=dev).view(G, 1, 1) * nc).reshape(-1)  # [G L m]
    # the blocks as rows of an embedding table: its backward is a sorted accumulation
    kg = F.embedding(flat, kh.reshape(G * nc, cs * d)).view(G * L, m * cs, d)
    vg = F.embedding(flat, vh.reshape(G * nc, cs * d)).view(G * L, m * cs, d)
    s_ex = torch.bmm(qs.reshape(G * L, 1, d), kg.transpose(1, 2)).view(G, L, m * cs)
    if padded:
        ok = real_g.view(G * nc, cs).index_select(0, flat).view(G, L, m * cs)
        s_ex = s_ex.masked_fill(~ok, neg)
    scores = torch.cat([s_ex, s_sum], dim=-1)
    p = scores.softmax(dim=-1, dtype=acc)
    if padded:  # a query with nothing to see: no output
        p = p.masked_fill(~(scores.amax(-1, keepdim=True) > neg), 0.0)
    p = p.to(q.dtype)
    if dropout_p:
        p = F.dropout(p, dropout_p)
    p_ex, p_sum = (t.contiguous() for t in p.split([m * cs, nc], dim=-1))
    y = torch.bmm(p_ex.view(G * L, 1, m * cs), vg).view(G, L, d) + torch.bmm(p_sum, v_sum)
    return y[:, :n].view(B, h, n, d).transpose(1, 2)


def _selective_traced(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None,
    cs: int,
    top: int,
) -> torch.Tensor:
    """:func:`_selective` for ``torch.export`` (one row = one document): the same function with
    no branch or view on the length. A block is a one-hot column of each token ``[n, c]``; the
    block scores get ``top`` empty columns, so ``top`` can always be picked; what a query reads
    is a comparison of its picks with the blocks (no scatter), spread to an ``[n, n]`` mask of
    the exact scores."""
    B, n, h, d = q.shape
    G, dev = B * h, q.device
    acc = torch.promote_types(q.dtype, torch.float32)
    neg = torch.finfo(acc).min
    scale = 1.0 / math.sqrt(d)
    blk = torch.div(torch.arange(n, device=dev), cs, rounding_mode="floor")  # [n]
    nc = (n + cs - 1) // cs
    cols = torch.arange(nc, device=dev)
    real = torch.ones(B, n, dtype=torch.bool, device=dev) if mask is None else mask.bool()
    real_g = real.repeat_interleave(h, dim=0)  # [G, n]
    member = (blk[:, None] == cols[None, :])[None] & real_g[..., None]  # [G, n, c]

    def heads(t: torch.Tensor) -> torch.Tensor:  # [B, n, h, d] -> [G, n, d]
        return t.permute(0, 2, 1, 3).reshape(G, n, d)

    w = member.to(k.dtype).transpose(1, 2)  # [G, c, n]
    count = member.to(acc).sum(1)[..., None]  # [G, c, 1]
    k_sum = (torch.bmm(w, heads(k)) / count.clamp(min=1).to(k.dtype)).transpose(1, 2)
    v_sum = torch.bmm(w, heads(v)) / count.clamp(min=1).to(v.dtype)  # [G, c, d]
    s_sum = torch.bmm(heads(q) * scale, k_sum).to(acc)  # [G, n, c]
    s_sum = s_sum.masked_fill(~(count[..., 0] > 0)[:, None, :], neg)
    route = _no_query_order(s_sum.detach(), real_g)
    sel = F.pad(route, (0, top), value=neg).topk(top, dim=-1).indices  # [G, n, top]
    picked = (sel[..., None] == cols).any(-2)  # [G, n, c]: each query's blocks
    ok = picked.index_select(2, blk) & real_g[:, None, :]  # [G, n, n]: the keys it reads
    qr, kr = (q, k) if rotary is None else (rotate(q, rotary), rotate(k, rotary))
    s_tok = torch.bmm(heads(qr) * scale, heads(kr).transpose(1, 2)).to(acc)
    scores = torch.cat([s_tok.masked_fill(~ok, neg), s_sum.masked_fill(picked, neg)], dim=-1)
    p = scores.softmax(dim=-1)
    p = p.masked_fill(~(scores.amax(-1, keepdim=True) > neg), 0.0).to(q.dtype)
    p_tok, p_sum = p.split([n, nc], dim=-1)
    y = torch.bmm(p_tok, heads(v)) + torch.bmm(p_sum, v_sum)
    return y.view(B, h, n, d).transpose(1, 2)


def selective_check(config: object, layer_idx: int) -> str | None:
    """k divides max_seq_len (the block)."""
    k = config.k_for_layer(layer_idx)
    if config.max_seq_len % k:
        return (
            f"selective layer {layer_idx}: k={k} does not divide max_seq_len="
            f"{config.max_seq_len} (block = max_seq_len / k)"
        )
    return None


def selective_flops(config: object, layer_idx: int, n: int) -> float:
    """Forward FLOPs per token: scores and weighted sum over the ``c`` blocks and the ``m C``
    tokens read exactly."""
    dm, cs = config.hidden_size, selective_block(config, layer_idx)
    c = math.ceil(n / cs)
    return 2 * 2 * c * dm + 2 * 2 * min(int(config.routed_blocks), c) * cs * dm
