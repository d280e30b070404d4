"""The ``dense`` kind: full softmax attention, the baseline every comparison is made against.

Every query sees every key of its row (its document under isolation) through
``scaled_dot_product_attention``; rotary positions on queries and keys when set; under sequence
parallelism DeepSpeed-Ulysses over the whole rows. Registered in ``kinds.py``.
"""

import torch
import torch.nn.functional as F
from torch import nn

from .documents import Documents, _nonempty
from .rotary import rotate
from .window import LocalContext


def dense_attention(
    layer: nn.Module,
    qkv: torch.Tensor,
    mask: torch.Tensor | None,
    documents: Documents | None,
    local: LocalContext,
    dropout_p: float,
) -> torch.Tensor:
    """Full softmax attention (each document alone under isolation; Ulysses under sequence
    parallelism); rotary positions on queries and keys when set."""
    b, n, _ = qkv.shape
    h, d = layer.num_heads, layer.head_dim
    sp = layer.sequence_parallel
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
        return y.reshape(b, n, h * d)
    if documents is None:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        attn_mask = _nonempty(mask)[:, None, None, :] if mask is not None else None
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)
        return y.transpose(1, 2).reshape(b, n, h * d)
    ys = []
    for s, *qkv_i in zip(documents.spans, *(documents.split(t) for t in (q, k, v))):
        qi, ki, vi = (t.transpose(0, 1)[None] for t in qkv_i)  # [1, h, L, d]
        am = None
        if s.padded and mask is not None:
            am = _nonempty(mask[s.row, s.start : s.end][None])[:, None, None, :]
        y = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=am, dropout_p=dropout_p)
        ys.append(y[0].transpose(0, 1))  # [L, h, d]
    return torch.cat(ys).view(b, n, h * d)
