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
    ``[B, n, h, d]``."""
    B, n, h, d = q.shape
    nb = -(-n // bs)
    tail = nb * bs - n
    m = min(top, nb)
    dev = q.device
    acc = torch.promote_types(q.dtype, torch.float32)  # scores and softmax: at least fp32
    neg = torch.finfo(acc).min
    scale = 1.0 / math.sqrt(d)

    def blocks(t: torch.Tensor) -> torch.Tensor:  # [B, n, h, d] -> [B, h, nb, bs, d]
        return F.pad(t.transpose(1, 2), (0, 0, 0, tail)).view(B, h, nb, bs, d)

    real = torch.ones(B, n, dtype=torch.bool, device=dev) if mask is None else mask.bool()
    real_b = F.pad(real, (0, tail)).view(B, nb, bs)  # padding and the tail: False
    count = real_b.sum(-1)  # [B, nb] real tokens per block
    block_ok = count > 0
    w = real_b.to(k.dtype)[:, None, :, :, None]  # [B, 1, nb, bs, 1]
    denom = count.clamp(min=1).to(k.dtype)[:, None, :, None]
    k_sum = (blocks(k) * w).sum(3) / denom  # [B, h, nb, d]: unrotated key means
    v_sum = (blocks(v) * w).sum(3) / denom

    # summary scores of every query = the routing scores; a query block takes the best of its
    # queries for each summary and reads its m best blocks exactly
    qs = blocks(q) * scale  # [B, h, nb, bs, d]
    s_sum = torch.matmul(qs, k_sum[:, :, None].transpose(-1, -2)).to(acc)  # [B, h, nb, bs, nb]
    s_sum = s_sum.masked_fill(~block_ok[:, None, None, None, :], neg)
    q_ok = real_b[:, None, :, :, None]  # queries that route (padding queries do not)
    route = s_sum.masked_fill(~q_ok, neg).amax(3)  # [B, h, nb, nb]
    sel = route.topk(m, dim=-1).indices  # [B, h, nb, m]
    picked = torch.zeros(B, h, nb, nb, dtype=torch.bool, device=dev).scatter(-1, sel, True)
    s_sum = s_sum.masked_fill(picked[:, :, :, None, :], neg)  # read exactly: no summary

    qr, kr = (q, k) if rotary is None else (rotate(q, rotary), rotate(k, rotary))
    qb = blocks(qr) * scale
    kb, vb = blocks(kr), blocks(v)
    flat = (sel + torch.arange(B * h, device=dev).view(B, h, 1, 1) * nb).reshape(-1)
    kg = kb.reshape(B * h * nb, bs, d).index_select(0, flat).view(B, h, nb, m * bs, d)
    vg = vb.reshape(B * h * nb, bs, d).index_select(0, flat).view(B, h, nb, m * bs, d)
    s_ex = torch.matmul(qb, kg.transpose(-1, -2)).to(acc)  # [B, h, nb, bs, m bs]
    rows = (sel + torch.arange(B, device=dev).view(B, 1, 1, 1) * nb).reshape(-1)
    ex_ok = real_b.reshape(B * nb, bs).index_select(0, rows).view(B, h, nb, 1, m * bs)
    s_ex = s_ex.masked_fill(~ex_ok, neg)
    parts = [s_ex]
    values = [vg]
    if r:  # the window: keys of the blocks before, at and after each query block, |offset| <= r
        kw, vw, win_ok = _window(kb, vb, real_b, picked, r)
        parts.insert(0, torch.matmul(qb, kw.transpose(-1, -2)).to(acc).masked_fill(~win_ok, neg))
        values.insert(0, vw)
    parts.append(s_sum)
    scores = torch.cat(parts, dim=-1)
    p = scores.softmax(dim=-1)
    has_key = scores.amax(-1, keepdim=True) > neg  # padding among padding: no output
    p = p.masked_fill(~has_key, 0.0).to(q.dtype)
    if dropout_p:
        p = F.dropout(p, dropout_p)
    sizes = [t.shape[-2] for t in values] + [nb]
    p_parts = p.split(sizes, dim=-1)
    y = sum(torch.matmul(pi, vi) for pi, vi in zip(p_parts[:-1], values))
    y = y + torch.matmul(p_parts[-1], v_sum[:, :, None])  # [B, h, nb, bs, d]
    return y.view(B, h, nb * bs, d)[:, :, :n].transpose(1, 2)


def _window(
    kb: torch.Tensor, vb: torch.Tensor, real_b: torch.Tensor, picked: torch.Tensor, r: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The window's keys and values ``[B, h, nb, 3 bs, d]`` (the blocks before, at and after each
    query block) and which each query may see ``[B, h, nb, bs, 3 bs]``: within ``r`` positions,
    a real token, in a block the query block did not read exactly."""
    B, h, nb, bs, d = kb.shape
    dev = kb.device

    def around(t: torch.Tensor) -> torch.Tensor:
        t = F.pad(t, (0, 0, 0, 0, 1, 1))  # [B, h, nb + 2, bs, d]
        return torch.cat([t[:, :, :-2], t[:, :, 1:-1], t[:, :, 2:]], dim=3)

    pos_q = torch.arange(bs, device=dev)[:, None]
    pos_k = torch.arange(3 * bs, device=dev)[None, :] - bs
    band = (pos_k - pos_q).abs() <= r  # [bs, 3 bs]
    real = F.pad(real_b, (0, 0, 1, 1))  # [B, nb + 2, bs]
    key_real = torch.cat([real[:, :-2], real[:, 1:-1], real[:, 2:]], dim=2)  # [B, nb, 3 bs]
    near = F.pad(picked, (1, 1))  # [B, h, nb, nb + 2]: picked[j, j - 1 + t] for t = 0, 1, 2
    idx = torch.arange(nb, device=dev)[:, None] + torch.arange(3, device=dev)[None, :]
    read = near.gather(-1, idx.expand(B, h, nb, 3)).repeat_interleave(bs, dim=-1)
    ok = band & key_real[:, None, :, None, :] & ~read[:, :, :, None, :]
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
