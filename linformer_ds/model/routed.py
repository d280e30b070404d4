"""The ``routed`` kind: content-routed block attention, a kind that can look things up.

A fixed projection (linear E/F, conv) mixes positions into ``k`` summaries that do not depend on
the input, so no single distant token can be singled out. A routed layer keeps the summaries
and adds a content-addressed exact read:

* the row is cut into ``c = ceil(n / b)`` blocks of ``b = max_seq_len / k`` tokens; each block's
  summary is the mean of its keys and of its values (padding left out): ``k`` summaries at
  ``N_max``, as Conv-Linformer's pooling init;
* each block of ``b`` queries scores the ``c`` summaries (``q . mean(K_j) / sqrt(d)``; a block
  takes each summary's best score over its queries) and attends **exactly** to every token of its
  ``m = model.routed_blocks`` best blocks;
* in the same softmax: the summaries of the blocks it did not pick, and (``model.local_window``,
  at most ``2 b``) the exact window of ``W / 2`` tokens each side, less the tokens already read
  exactly.

Each key is counted once, so with ``m >= c`` (``m b >= n``) the layer is dense attention with the
same weights. Cost per query: ``c + m b (+ 3 b)`` keys instead of ``n``: O(n (k + m b + W)).
The summary scores are the routing scores, so the routing is trained through the summaries'
softmax. Rotary positions turn the exact keys (picked and window); the summaries and the routing
see unrotated keys. Document isolation: each document alone (its own blocks). Sequence
parallelism: not supported (a block's choice reads every rank's summaries and tokens).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from .documents import Documents
from .registry import tracing
from .rotary import rotate
from .window import LocalContext


def routed_attention(
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
    block = routed_block(cfg, i)
    top, radius = int(cfg.routed_blocks), cfg.local_window // 2
    q, k, v = qkv.view(b, n, 3, h, d).unbind(2)  # [B, n, h, d]
    if documents is None:
        y = _routed(q, k, v, mask, local.rotary, block, top, radius, dropout_p)
        return y.reshape(b, n, h * d)
    ys = []
    for s, qi, ki, vi in zip(documents.spans, *(documents.split(t) for t in (q, k, v))):
        mi = mask[s.row, s.start : s.end][None] if mask is not None and s.padded else None
        rot = None
        if local.rotary is not None:
            row = s.row if local.rotary[0].shape[0] > 1 else 0
            rot = tuple(t[row, s.start : s.end][None] for t in local.rotary)
        ys.append(_routed(qi[None], ki[None], vi[None], mi, rot, block, top, radius, dropout_p)[0])
    return torch.cat(ys).view(b, n, h * d)


def routed_block(config: object, layer_idx: int) -> int:
    """Tokens per block at layer ``layer_idx``: ``max_seq_len / k``."""
    return config.max_seq_len // config.k_for_layer(layer_idx)


def _routed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None,
    bs: int,
    top: int,
    r: int,
    dropout_p: float,
) -> torch.Tensor:
    """One row set ``q, k, v [B, n, h, d]`` (``mask [B, n]`` bool, None: no padding) ->
    ``[B, n, h, d]``. Heads and rows are one batch dimension (``G = B h``) and every product
    one batched GEMM: the summary scores of all queries ``[G, n, c]``, the exact read of each
    query block ``[G c, b, m b]``."""
    if tracing():
        return _routed_traced(q, k, v, mask, rotary, bs, top, r)
    B, n, h, d = q.shape
    nb = -(-n // bs)
    tail = nb * bs - n
    m = min(top, nb)
    G, dev = B * h, q.device
    acc = torch.promote_types(q.dtype, torch.float32)  # scores and softmax: at least fp32
    neg = torch.finfo(acc).min
    scale = 1.0 / math.sqrt(d)

    def heads(t: torch.Tensor) -> torch.Tensor:  # [B, n, h, d] -> [G, nb bs, d]
        t = t.permute(0, 2, 1, 3).reshape(G, n, d).contiguous()
        return F.pad(t, (0, 0, 0, tail)) if tail else t

    padded = mask is not None or tail > 0
    real = torch.ones(B, n, dtype=torch.bool, device=dev) if mask is None else mask.bool()
    real_b = F.pad(real, (0, tail)).view(B, nb, bs)  # padding and the tail: False
    real_g = real_b.repeat_interleave(h, dim=0)  # [G, nb, bs]
    kh, vh = heads(k), heads(v)
    if padded:
        count = real_g.sum(-1, keepdim=True)  # [G, nb, 1]
        w = real_g.to(k.dtype)[..., None]
        denom = count.clamp(min=1).to(k.dtype)
        k_sum = (kh.view(G, nb, bs, d) * w).sum(2) / denom  # [G, nb, d]: unrotated key means
        v_sum = (vh.view(G, nb, bs, d) * w).sum(2) / denom
    else:
        k_sum, v_sum = kh.view(G, nb, bs, d).mean(2), vh.view(G, nb, bs, d).mean(2)

    # summary scores of every query = the routing scores; a query block takes the best of its
    # queries for each summary and reads its m best blocks exactly
    qh = heads(q) * scale
    s_sum = torch.bmm(qh, k_sum.transpose(1, 2)).to(acc).view(G, nb, bs, nb)
    if padded:
        s_sum = s_sum.masked_fill(~(count > 0).view(G, 1, 1, nb), neg)
        route = s_sum.masked_fill(~real_g[..., None], neg).amax(2)  # [G, nb, nb]
        route = _no_query_order(route, real_g.any(-1))
    else:
        route = s_sum.amax(2)
    sel = route.topk(m, dim=-1).indices  # [G, nb, m]
    picked = torch.zeros(G, nb, nb, dtype=torch.bool, device=dev).scatter(-1, sel, True)
    s_sum = s_sum.masked_fill(picked[:, :, None, :], neg)  # read exactly: no summary

    if rotary is not None:
        qh, kh = heads(rotate(q, rotary)) * scale, heads(rotate(k, rotary))
    flat = (sel + torch.arange(G, device=dev).view(G, 1, 1) * nb).reshape(-1)
    # the blocks as rows of an embedding table: its backward (a sorted accumulation) is several
    # times faster on the CPU than index_select's scatter-add
    kg = F.embedding(flat, kh.view(G * nb, bs * d)).view(G * nb, m * bs, d)
    vg = F.embedding(flat, vh.view(G * nb, bs * d)).view(G * nb, m * bs, d)
    qb = qh.view(G * nb, bs, d)
    parts = [torch.bmm(qb, kg.transpose(1, 2)).to(acc)]  # [G nb, bs, m bs]
    if padded:
        ex_ok = real_g.view(G * nb, bs).index_select(0, flat).view(G * nb, 1, m * bs)
        parts[0] = parts[0].masked_fill(~ex_ok, neg)
    values = [vg]
    if r:  # the window: keys of the blocks before, at and after each query block, |offset| <= r
        kw, vw, win_ok = _window(kh.view(G, nb, bs, d), vh.view(G, nb, bs, d), real_g, picked, r)
        s_win = torch.bmm(qb, kw.view(G * nb, 3 * bs, d).transpose(1, 2)).to(acc)
        parts.insert(0, s_win.masked_fill(~win_ok.view(G * nb, bs, 3 * bs), neg))
        values.insert(0, vw.view(G * nb, 3 * bs, d))
    parts.append(s_sum.view(G * nb, bs, nb))
    scores = torch.cat(parts, dim=-1)
    p = scores.softmax(dim=-1)
    if padded:  # padding among padding: no output
        p = p.masked_fill(~(scores.amax(-1, keepdim=True) > neg), 0.0)
    p = p.to(q.dtype)
    if dropout_p:
        p = F.dropout(p, dropout_p)
    # contiguous parts: a strided slice of p (and its transpose, backward) sends bmm to a slow
    # path on the CPU
    p_parts = [t.contiguous() for t in p.split([t.shape[1] for t in values] + [nb], dim=-1)]
    y = torch.bmm(p_parts[0], values[0])
    for pi, vi in zip(p_parts[1:-1], values[1:]):
        y = y + torch.bmm(pi, vi)
    y = y.view(G, nb * bs, d) + torch.bmm(p_parts[-1].reshape(G, nb * bs, nb), v_sum)
    return y[:, :n].view(B, h, n, d).transpose(1, 2)


def _routed_traced(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None,
    bs: int,
    top: int,
    r: int,
) -> torch.Tensor:
    """:func:`_routed` for ``torch.export`` (one row = one document): the same function with
    no branch or view on the length, as ``[n, n]`` masks (a block is a one-hot column of each
    token; the routing table gets ``top`` empty blocks, so ``top`` can always be picked)."""
    B, n, h, d = q.shape
    G, dev = B * h, q.device
    acc = torch.promote_types(q.dtype, torch.float32)
    neg = torch.finfo(acc).min
    scale = 1.0 / math.sqrt(d)
    pos = torch.arange(n, device=dev)
    blk = torch.div(pos, bs, rounding_mode="floor")  # [n]
    nb = (n + bs - 1) // bs
    real = torch.ones(B, n, dtype=torch.bool, device=dev) if mask is None else mask.bool()
    real_g = real.repeat_interleave(h, dim=0)  # [G, n]
    member = (blk[:, None] == torch.arange(nb, device=dev)[None, :])[None] & real_g[..., None]

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.permute(0, 2, 1, 3).reshape(G, n, d)

    kh, vh = heads(k), heads(v)
    w = member.to(k.dtype)  # [G, n, nb]
    count = w.sum(1)  # [G, nb]
    k_sum = torch.bmm(w.transpose(1, 2), kh) / count.clamp(min=1)[..., None]
    v_sum = torch.bmm(w.transpose(1, 2), vh) / count.clamp(min=1)[..., None]
    s_sum = torch.bmm(heads(q) * scale, k_sum.transpose(1, 2)).to(acc)  # [G, n, nb]
    s_sum = s_sum.masked_fill(~(count > 0)[:, None, :], neg)
    routing = s_sum.masked_fill(~real_g[..., None], neg)
    in_block = (blk[None, :] == torch.arange(nb, device=dev)[:, None])[None, :, :, None]
    route = routing[:, None].masked_fill(~in_block, neg).amax(2)  # [G, nb, nb]
    route = _no_query_order(route, route.amax(-1) > neg)
    sel = F.pad(route, (0, top), value=neg).topk(top, dim=-1).indices
    # a comparison, not a scatter: the graph's one ScatterElements stays the row order's
    picked = (sel[..., None] == torch.arange(nb, device=dev)).any(-2)  # [G, nb, nb]
    picked_q = picked.index_select(1, blk)  # [G, n, nb]: the query's blocks
    read = picked_q.index_select(2, blk)  # [G, n, n]: keys in the query's read blocks
    ok = read & real_g[:, None, :]
    if r:
        near = (pos[:, None] - pos[None, :]).abs() <= r
        ok = ok | (near[None] & real_g[:, None, :] & ~read)
    qr, kr = (q, k) if rotary is None else (rotate(q, rotary), rotate(k, rotary))
    s_tok = torch.bmm(heads(qr) * scale, heads(kr).transpose(1, 2)).to(acc)
    scores = torch.cat([s_tok.masked_fill(~ok, neg), s_sum.masked_fill(picked_q, neg)], dim=-1)
    p = scores.softmax(dim=-1)
    p = p.masked_fill(~(scores.amax(-1, keepdim=True) > neg), 0.0).to(q.dtype)
    p_tok, p_sum = p.split([n, nb], dim=-1)
    y = torch.bmm(p_tok, vh) + torch.bmm(p_sum, v_sum)
    return y.view(B, h, n, d).transpose(1, 2)


def _no_query_order(route: torch.Tensor, has_query: torch.Tensor) -> torch.Tensor:
    """A block of padding queries (``has_query [G, nb]`` False) picks the first blocks, not
    whichever equal scores the kernel returns first: its outputs are the same everywhere."""
    order = -torch.arange(route.shape[-1], device=route.device, dtype=route.dtype)
    return torch.where(has_query[..., None], route, order)


def _window(
    kb: torch.Tensor, vb: torch.Tensor, real_b: torch.Tensor, picked: torch.Tensor, r: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The window's keys and values ``[G, nb, 3 bs, d]`` (the blocks before, at and after each
    query block) and which each query may see ``[G, nb, bs, 3 bs]``: within ``r`` positions,
    a real token, in a block the query block did not read exactly."""
    G, nb, bs, d = kb.shape
    dev = kb.device

    def around(t: torch.Tensor) -> torch.Tensor:
        t = F.pad(t, (0, 0, 0, 0, 1, 1))  # [G, nb + 2, bs, ...]
        return torch.cat([t[:, :-2], t[:, 1:-1], t[:, 2:]], dim=2)

    pos_q = torch.arange(bs, device=dev)[:, None]
    pos_k = torch.arange(3 * bs, device=dev)[None, :] - bs
    band = (pos_k - pos_q).abs() <= r  # [bs, 3 bs]
    key_real = around(real_b[..., None])[..., 0]  # [G, nb, 3 bs]
    near = F.pad(picked, (1, 1))  # [G, nb, nb + 2]: picked[j, j - 1 + t] for t = 0, 1, 2
    idx = torch.arange(nb, device=dev)[:, None] + torch.arange(3, device=dev)[None, :]
    read = near.gather(-1, idx.expand(G, nb, 3)).repeat_interleave(bs, dim=-1)
    ok = band & (key_real & ~read)[:, :, None, :]
    return around(kb), around(vb), ok


def routed_check(config: object, layer_idx: int) -> str | None:
    """k divides max_seq_len (the block size); the window within one block each side."""
    k = config.k_for_layer(layer_idx)
    if config.max_seq_len % k:
        return (
            f"routed layer {layer_idx}: k={k} does not divide max_seq_len={config.max_seq_len} "
            "(block size = max_seq_len / k)"
        )
    bs = config.max_seq_len // k
    if config.local_window // 2 > bs:
        return (
            f"routed layer {layer_idx}: model.local_window={config.local_window} reaches past "
            f"one block of {bs} tokens each side; use local_window <= {2 * bs} or a smaller k"
        )
    return None


def routed_flops(config: object, layer_idx: int, n: int) -> float:
    """Forward FLOPs per token: routing/summary scores and their weighted sum over ``c`` blocks,
    and the exact read of ``m b`` tokens (the window: the generic count)."""
    dm, bs = config.hidden_size, routed_block(config, layer_idx)
    c = math.ceil(n / bs)
    exact = min(int(config.routed_blocks), c) * bs
    return 2 * 2 * c * dm + 2 * 2 * exact * dm
