"""The ``routed`` kind: content-routed block attention, a kind that can look things up.

A fixed projection (linear E/F, conv) mixes positions into ``k`` summaries that do not depend on
the input, so no single distant token can be singled out. A routed layer keeps summaries and
adds a content-addressed exact read:

* the row is cut into summary blocks of ``C = max_seq_len / k`` tokens (``k`` at ``N_max``, as
  Conv-Linformer's pooling init) and into routed blocks of ``b = model.routed_block`` tokens
  (default ``C``; ``b`` divides ``C``); a block's key (value) is the mean of its keys (values),
  padding left out;
* each routed block of ``b`` queries scores the routed blocks (``q . mean(K_j) / sqrt(d)``; a
  block takes each score's best over its queries) and attends **exactly** to every token of its
  ``m = model.routed_blocks`` best blocks;
* in the same softmax: each summary block's mean over its tokens that were not read exactly (a
  summary block read whole is left out), and (``model.local_window``, at most ``2 b``) the exact
  window of ``W / 2`` tokens each side, less the tokens already read exactly.

Each key is counted once by the read and the summaries, so with ``m b >= n`` the layer is dense
attention with the same weights. Cost per query: ``n / C`` summaries and ``m b (+ 3 b)`` exact
keys, plus the routing, ``n / b`` scores without a gradient when ``b < C`` (when ``b = C`` the
summary scores are the routing scores, and the routing is trained through the summaries'
softmax): O(n (k + m b + W)) with ``b = C``, O(n (k + n / b + m b + W)) otherwise. Rotary
positions turn the exact keys (picked and window); the summaries and the routing see unrotated
keys. Document isolation: each document alone (its own blocks). Sequence parallelism: not
supported (a block's choice reads every rank's summaries and tokens).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from .documents import Documents, each_document
from .registry import tracing
from .rotary import rotate
from .window import LocalContext

# the routing scores of one chunk of query blocks at most (elements; without a gradient)
_ROUTE_CHUNK = 2**24


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
    bs, cs = routed_sizes(cfg, i)
    top, radius = int(cfg.routed_blocks), cfg.local_window // 2
    q, k, v = qkv.view(b, n, 3, h, d).unbind(2)  # [B, n, h, d]
    if documents is None:
        y = _routed(q, k, v, mask, local.rotary, bs, cs, top, radius, dropout_p)
        return y.reshape(b, n, h * d)
    y = each_document(
        lambda *t: _routed(*t, bs, cs, top, radius, dropout_p), documents, q, k, v, mask,
        local.rotary,
    )  # fmt: skip
    return y.view(b, n, h * d)


def routed_sizes(config: object, layer_idx: int) -> tuple[int, int]:
    """Tokens per routed block and per summary block at layer ``layer_idx``:
    ``(model.routed_block or C, C = max_seq_len / k)``."""
    cs = config.max_seq_len // config.k_for_layer(layer_idx)
    block = getattr(config, "routed_block", None)
    return (int(block) if block is not None else cs), cs


def _routed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None,
    bs: int,
    cs: int,
    top: int,
    r: int,
    dropout_p: float,
) -> torch.Tensor:
    """One row set ``q, k, v [B, n, h, d]`` (``mask [B, n]`` bool, None: no padding) ->
    ``[B, n, h, d]``; routed blocks of ``bs`` tokens, summary blocks of ``cs`` (a multiple of
    ``bs``). Heads and rows are one batch dimension (``G = B h``) and every product one batched
    GEMM: the summary scores of all queries ``[G, n, c]``, the routing scores (``bs < cs``:
    ``[G, n, nb]`` in chunks, no gradient), the exact read of each query block
    ``[G nb, bs, m bs]``."""
    if tracing():
        return _routed_traced(q, k, v, mask, rotary, bs, cs, top, r)
    B, n, h, d = q.shape
    rr = cs // bs  # routed blocks per summary block
    nc = -(-n // cs)  # summary blocks
    nb = nc * rr  # routed blocks (the tail's empty ones included)
    tail = nb * bs - n
    m = min(top, nb)
    G, dev = B * h, q.device
    acc = torch.promote_types(q.dtype, torch.float32)  # softmax and the means: at least fp32
    neg = torch.finfo(q.dtype).min  # scores stay in q's dtype (a GEMM's output) until softmax
    scale = 1.0 / math.sqrt(d)

    def heads(t: torch.Tensor) -> torch.Tensor:  # [B, n, h, d] -> [G, nb bs, d]
        t = t.permute(0, 2, 1, 3).reshape(G, n, d).contiguous()
        return F.pad(t, (0, 0, 0, tail)) if tail else t

    padded = mask is not None or tail > 0
    real = torch.ones(B, n, dtype=torch.bool, device=dev) if mask is None else mask.bool()
    real_b = F.pad(real, (0, tail)).view(B, nb, bs)  # padding and the tail: False
    real_g = real_b.repeat_interleave(h, dim=0)  # [G, nb, bs]
    kh, vh = heads(k), heads(v)
    count = real_g.sum(-1)  # [G, nb]: real tokens per routed block
    if padded:
        w = real_g.to(k.dtype)[..., None]
        k_blk, v_blk = (kh.view(G, nb, bs, d) * w).sum(2), (vh.view(G, nb, bs, d) * w).sum(2)
    else:
        k_blk, v_blk = kh.view(G, nb, bs, d).sum(2), vh.view(G, nb, bs, d).sum(2)
    c_sum = count.view(G, nc, rr).sum(-1)  # [G, nc]: real tokens per summary block
    k_cs, v_cs = k_blk.view(G, nc, rr, d).sum(2), v_blk.view(G, nc, rr, d).sum(2)
    denom = c_sum.clamp(min=1)[..., None]
    k_sum, v_sum = k_cs / denom.to(k.dtype), v_cs / denom.to(v.dtype)  # unrotated means
    qh = heads(q) * scale
    s_sum = torch.bmm(qh, k_sum.transpose(1, 2))  # [G, nb bs, nc]: every query, every summary
    if padded:
        s_sum = s_sum.masked_fill(~(c_sum > 0)[:, None, :], neg)
    if rr == 1:  # the summaries are the routed blocks: their scores are the routing scores
        route = s_sum.view(G, nb, bs, nb)
        route = (route.masked_fill(~real_g[..., None], neg) if padded else route).amax(2)
    else:  # routed blocks inside the summary blocks: their own scores, without a gradient
        route = _route(qh, k_blk / count.clamp(min=1)[..., None].to(k.dtype), count > 0,
                       real_g if padded else None)  # fmt: skip
    if padded:
        route = _no_query_order(route, real_g.any(-1))
    sel = route.topk(m, dim=-1).indices  # [G, nb, m]
    flat = (sel + torch.arange(G, device=dev).view(G, 1, 1) * nb).reshape(-1)
    into = torch.div(sel, rr, rounding_mode="floor") if rr > 1 else sel  # the picks' summaries
    # a summary block a query block picks from is read exactly: its whole mean is left out
    read_c = torch.zeros(G, nb, nc, dtype=torch.bool, device=dev).scatter(-1, into, True)
    s_sum = s_sum.view(G * nb, bs, nc).masked_fill(read_c.view(G * nb, 1, nc), neg)

    q_sum = qh  # unrotated: the summaries' queries
    if rotary is not None:
        qh, kh = heads(rotate(q, rotary)) * scale, heads(rotate(k, rotary))
    # the blocks as rows of an embedding table: its backward (a sorted accumulation) is several
    # times faster on the CPU than index_select's scatter-add
    kg = F.embedding(flat, kh.view(G * nb, bs * d)).view(G * nb, m * bs, d)
    vg = F.embedding(flat, vh.view(G * nb, bs * d)).view(G * nb, m * bs, d)
    qb = qh.view(G * nb, bs, d)
    parts = [torch.bmm(qb, kg.transpose(1, 2))]  # [G nb, bs, m bs]
    if padded:
        ex_ok = real_g.view(G * nb, bs).index_select(0, flat).view(G * nb, 1, m * bs)
        parts[0] = parts[0].masked_fill(~ex_ok, neg)
    values = [vg]
    if r:  # the window: keys of the blocks before, at and after each query block, |offset| <= r
        picked = torch.zeros(G, nb, nb, dtype=torch.bool, device=dev).scatter(-1, sel, True)
        kw, vw, win_ok = _window(kh.view(G, nb, bs, d), vh.view(G, nb, bs, d), real_g, picked, r)
        s_win = torch.bmm(qb, kw.view(G * nb, 3 * bs, d).transpose(1, 2))
        parts.insert(0, s_win.masked_fill(~win_ok.view(G * nb, bs, 3 * bs), neg))
        values.insert(0, vw.view(G * nb, 3 * bs, d))
    if rr > 1:  # and the mean of its tokens that were not read: one column per picked summary
        k_rest, v_rest, live = _unread_means(k_blk, v_blk, k_cs, v_cs, count, c_sum, sel, into)
        s_rest = torch.bmm(q_sum.view(G * nb, bs, d), k_rest.transpose(1, 2))
        parts.append(s_rest.masked_fill(~live, neg))  # [G nb, bs, m]
        values.append(v_rest)
    parts.append(s_sum)
    scores = torch.cat(parts, dim=-1)
    p = scores.softmax(dim=-1, dtype=acc)
    if padded:  # padding among padding: no output
        p = p.masked_fill(~(scores.amax(-1, keepdim=True) > neg), 0.0)
    p = p.to(q.dtype)
    if dropout_p:
        p = F.dropout(p, dropout_p)
    # contiguous parts: a strided slice of p (and its transpose, backward) sends bmm to a slow
    # path on the CPU
    p_parts = [t.contiguous() for t in p.split([t.shape[1] for t in values] + [nc], dim=-1)]
    y = torch.bmm(p_parts[0], values[0])
    for pi, vi in zip(p_parts[1:-1], values[1:]):
        y = y + torch.bmm(pi, vi)
    y = y.view(G, nb * bs, d) + torch.bmm(p_parts[-1].reshape(G, nb * bs, nc), v_sum)
    return y[:, :n].view(B, h, n, d).transpose(1, 2)


def _unread_means(
    k_blk: torch.Tensor,
    v_blk: torch.Tensor,
    k_cs: torch.Tensor,
    v_cs: torch.Tensor,
    count: torch.Tensor,
    c_sum: torch.Tensor,
    sel: torch.Tensor,
    into: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each pick (``sel [G, nb, m]``, in summary block ``into``) of each query block: the
    mean key and value ``[G nb, m, d]`` of its summary block's real tokens that the query block
    does not read exactly (from the routed blocks' sums ``k_blk [G, nb, d]`` and the summary
    blocks' ``k_cs [G, nc, d]``), and whether that column is live ``[G nb, 1, m]``: tokens are
    left and no earlier pick of the query block is in the same summary block (one column per
    summary block)."""
    G, nb, d = k_blk.shape
    nc, m = k_cs.shape[1], sel.shape[-1]
    acc = torch.promote_types(k_blk.dtype, torch.float32)
    same = (into[..., :, None] == into[..., None, :]).view(G * nb, m, m)  # picks of one column
    earlier = torch.ones(m, m, dtype=torch.bool, device=sel.device).tril(-1)
    first = ~(same & earlier).any(-1)  # [G nb, m]
    same = same.to(acc)
    flat = (sel + torch.arange(G, device=sel.device).view(G, 1, 1) * nb).reshape(-1)
    flat_c = (into + torch.arange(G, device=sel.device).view(G, 1, 1) * nc).reshape(-1)
    c_pick = count.view(-1).index_select(0, flat).view(G * nb, m, 1).to(acc)
    left = c_sum.view(-1).index_select(0, flat_c).view(G * nb, m, 1).to(acc)
    left = left - torch.bmm(same, c_pick)  # [G nb, m, 1]: unread tokens of each pick's column
    out = []
    for blk, col in ((k_blk, k_cs), (v_blk, v_cs)):
        pick = F.embedding(flat, blk.view(G * nb, d)).view(G * nb, m, d).to(acc)
        whole = F.embedding(flat_c, col.view(G * nc, d)).view(G * nb, m, d).to(acc)
        out.append(((whole - torch.bmm(same, pick)) / left.clamp(min=1)).to(blk.dtype))
    live = (first & (left[..., 0] > 0.5)).view(G * nb, 1, m)
    return out[0], out[1], live


def _route(
    qh: torch.Tensor, k_mean: torch.Tensor, key_ok: torch.Tensor, real: torch.Tensor | None
) -> torch.Tensor:
    """Routing scores ``[G, nb, nb]`` of every query block (``qh [G, nb bs, d]``, scaled) for
    every routed block (``k_mean [G, nb, d]``): the best over the block's real queries (``real
    [G, nb, bs]``, None: all) of ``q . mean(K_j)``; blocks without a real key (``key_ok``
    False): the lowest score. In chunks of query blocks, without a gradient."""
    G, nb, _ = k_mean.shape
    bs = qh.shape[1] // nb
    low = torch.finfo(qh.dtype).min
    step = max(1, _ROUTE_CHUNK // max(1, G * bs * nb))
    out = []
    with torch.no_grad():
        kt = k_mean.transpose(1, 2)
        for i in range(0, nb, step):
            s = torch.bmm(qh[:, i * bs : (i + step) * bs], kt).view(G, -1, bs, nb)
            if real is not None:
                s = s.masked_fill(~real[:, i : i + step, :, None], low)
            out.append(s.amax(2))
        route = torch.cat(out, dim=1) if len(out) > 1 else out[0]
        return route.masked_fill(~key_ok[:, None, :], low)


def _routed_traced(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None,
    bs: int,
    cs: int,
    top: int,
    r: int,
) -> torch.Tensor:
    """:func:`_routed` for ``torch.export`` (one row = one document): the same function with
    no branch or view on the length, as ``[n, n]`` masks (a block is a one-hot column of each
    token; the routing table gets ``top`` empty blocks, so ``top`` can always be picked; a
    routed block's summary block is a one-hot ``[nb, nc]`` matrix, and what a query block reads
    exactly comes off the summaries by products with it, not a scatter)."""
    B, n, h, d = q.shape
    G, dev = B * h, q.device
    acc = torch.promote_types(q.dtype, torch.float32)
    neg = torch.finfo(acc).min
    scale = 1.0 / math.sqrt(d)
    pos = torch.arange(n, device=dev)
    blk = torch.div(pos, bs, rounding_mode="floor")  # [n]
    nb = (n + bs - 1) // bs
    nc = (n + cs - 1) // cs
    real = torch.ones(B, n, dtype=torch.bool, device=dev) if mask is None else mask.bool()
    real_g = real.repeat_interleave(h, dim=0)  # [G, n]
    member = (blk[:, None] == torch.arange(nb, device=dev)[None, :])[None] & real_g[..., None]

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.permute(0, 2, 1, 3).reshape(G, n, d)

    kh, vh = heads(k), heads(v)
    w = member.to(k.dtype)  # [G, n, nb]
    count = member.to(acc).sum(1)  # [G, nb]
    k_blk = torch.bmm(w.transpose(1, 2), kh)  # [G, nb, d]: key and value sums
    v_blk = torch.bmm(w.transpose(1, 2), vh)
    rr = cs // bs
    into = torch.div(torch.arange(nb, device=dev), rr, rounding_mode="floor")
    one = (into[:, None] == torch.arange(nc, device=dev)[None, :]).to(acc)  # [nb, nc]
    qs = heads(q) * scale
    s_blk = torch.bmm(qs, k_blk.transpose(1, 2)).to(acc)  # [G, n, nb]: q . key sums
    routing = (s_blk / count.clamp(min=1)[:, None, :]).masked_fill(~(count > 0)[:, None, :], neg)
    routing = routing.masked_fill(~real_g[..., None], neg)
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
    # each summary block less what the query reads exactly: sums, counts and scores
    pq = picked_q.to(acc)
    one_g = one[None].expand(G, nb, nc)  # batched products (no folding that guards the length)
    left = torch.bmm(count[:, None, :], one_g) - torch.bmm(pq * count[:, None, :], one_g)
    k_sum = torch.bmm(one_g.transpose(1, 2).to(k.dtype), k_blk)  # [G, nc, d]
    v_sum = torch.bmm(one_g.transpose(1, 2).to(v.dtype), v_blk)
    s_sum = torch.bmm(qs, k_sum.transpose(1, 2)).to(acc) - torch.bmm(s_blk * pq, one_g)
    s_sum = (s_sum / left.clamp(min=1)).masked_fill(left < 0.5, neg)  # [G, n, nc]
    qr, kr = (q, k) if rotary is None else (rotate(q, rotary), rotate(k, rotary))
    s_tok = torch.bmm(heads(qr) * scale, heads(kr).transpose(1, 2)).to(acc)
    scores = torch.cat([s_tok.masked_fill(~ok, neg), s_sum], dim=-1)
    p = scores.softmax(dim=-1)
    p = p.masked_fill(~(scores.amax(-1, keepdim=True) > neg), 0.0)
    p_tok, p_sum = p.split([n, nc], dim=-1)
    p_sum = p_sum / left.clamp(min=1)
    p_blk = (
        torch.bmm(p_sum, one_g.transpose(1, 2)) * pq
    )  # [G, n, nb]: the picked blocks' sums, taken off
    y = torch.bmm(p_tok.to(q.dtype), vh) + torch.bmm(p_sum.to(q.dtype), v_sum)
    y = y - torch.bmm(p_blk.to(q.dtype), v_blk)
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
    """k divides max_seq_len (the summary block); model.routed_block divides the summary
    block; the window within one routed block each side."""
    k = config.k_for_layer(layer_idx)
    if config.max_seq_len % k:
        return (
            f"routed layer {layer_idx}: k={k} does not divide max_seq_len={config.max_seq_len} "
            "(summary block = max_seq_len / k)"
        )
    bs, cs = routed_sizes(config, layer_idx)
    if cs % bs:
        return (
            f"routed layer {layer_idx}: model.routed_block={bs} does not divide the summary "
            f"block of {cs} tokens (max_seq_len / k)"
        )
    if config.local_window // 2 > bs:
        return (
            f"routed layer {layer_idx}: model.local_window={config.local_window} reaches past "
            f"one block of {bs} tokens each side; use local_window <= {2 * bs}, a larger "
            "model.routed_block or a smaller k"
        )
    return None


def routed_flops(config: object, layer_idx: int, n: int) -> float:
    """Forward FLOPs per token: the summary scores and their weighted sum over ``c`` summary
    blocks, the routing scores over the ``n / b`` routed blocks when they are not the summaries
    (a forward only), the exact read of ``m b`` tokens (the window: the generic count)."""
    dm = config.hidden_size
    bs, cs = routed_sizes(config, layer_idx)
    c, nb = math.ceil(n / cs), math.ceil(n / bs)
    exact = min(int(config.routed_blocks), nb) * bs
    route = 2 * nb * dm if bs < cs else 0
    return 2 * 2 * c * dm + route + 2 * 2 * exact * dm
