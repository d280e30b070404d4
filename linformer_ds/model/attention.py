"""Multi-head self-attention over projected (linear, conv, registered kinds) or all (dense) keys."""

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .documents import Documents, _nonempty
from .projections import _make_projection


class LinformerSelfAttention(nn.Module):
    """Multi-head self-attention with linear, conv or dense key/value handling.

    ``forward(x [B, n, D], attention_mask [B, n] or None, shared_projection) -> [B, n, D]``.
    Under ``sharing='layerwise'`` the projection is owned by the encoder and passed in as a
    module; it is always called (never read), so ZeRO-3 gathers its parameters.
    Sequence parallel: ``x`` is the rank's slice; the projections exchange their summaries,
    conv block masks and dense masks are gathered, dense layers run DeepSpeed-Ulysses.
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
        self.proj_k: Optional[nn.Module] = None
        self.proj_v: Optional[nn.Module] = None
        # layout, set from outside (linformer_ds.parallelize.apply_sequence_parallel)
        self.sequence_parallel: Optional[Any] = None
        if self.kind != "dense" and config.sharing != "layerwise":
            heads = config.num_heads if config.sharing == "none" else 1
            self.proj_k = _make_projection(config, layer_idx, self.kind, heads)
            if config.sharing in ("none", "headwise"):
                self.proj_v = _make_projection(config, layer_idx, self.kind, heads)

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        shared_projection: Optional[nn.Module] = None,
        documents: Optional[Documents] = None,
    ) -> torch.Tensor:
        """``documents`` (:func:`document_spans`): each token attends only within its own
        document (its own summaries, conv blocks or tokens); None: the whole row."""
        b, n, _ = x.shape
        h, d = self.num_heads, self.head_dim
        qkv = self.qkv(x)  # [B, n, 3D]
        dropout_p = self.dropout_p if self.training else 0.0
        mask = attention_mask.bool() if attention_mask is not None else None
        if documents is not None and not documents.whole_rows:
            return self._isolated(qkv, mask, shared_projection, documents, dropout_p)

        # unbind/split rather than slicing: their backward writes the three gradients into one
        # [B, n, 3D] tensor (a stack/cat) instead of zero-filling and summing three of them.
        sp = self.sequence_parallel
        if self.kind == "dense" and sp is not None:  # Ulysses: q, k, v [B, n, h, d] slices
            q, k, v = qkv.view(b, n, 3, h, d).unbind(2)
            full = sp.gather_mask(mask) if mask is not None else None
            attn_mask = _nonempty(full)[:, None, None, :] if full is not None else None
            y = sp.dense_attention(q, k, v, attn_mask, dropout_p)  # [B, n, h, d]
            return self.out(y.reshape(b, n, self.hidden_size))
        if self.kind == "dense":
            q, k, v = (t.transpose(1, 2) for t in qkv.view(b, n, 3, h, d).unbind(2))
            attn_mask = _nonempty(mask)[:, None, None, :] if mask is not None else None
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)
            return self.out(y.transpose(1, 2).reshape(b, n, self.hidden_size))

        q, kv = qkv.split([self.hidden_size, 2 * self.hidden_size], dim=-1)
        q = q.view(b, n, h, d).transpose(1, 2)  # [B, h, n, d] (a strided view, no copy)
        kv = kv.view(b, n, 2 * h, d)  # keys then values of each token, still a view of qkv
        if mask is not None:  # padded positions contribute nothing to the projected keys/values
            kv = kv * mask[:, :, None, None].to(kv.dtype)
        proj_k = self.proj_k
        if proj_k is None:
            if shared_projection is None:
                raise ValueError(
                    f"layer {self.layer_idx}: sharing='layerwise' needs the encoder's shared "
                    "projection passed as `shared_projection`"
                )
            proj_k = shared_projection
        if self.proj_v is None:  # E = F: one GEMM projects keys and values together
            kp, vp = proj_k(kv).view(b, -1, 2, h, d).unbind(2)
        else:
            k_in, v_in = kv.view(b, n, 2, h, d).unbind(2)
            kp, vp = proj_k(k_in), self.proj_v(v_in)
        attn_mask = None
        if self.kind == "conv" and mask is not None:  # blocks made only of padding are ignored
            r = proj_k.stride
            pad = (n + r - 1) // r * r - n  # as ConvProjection pads
            blocks = F.pad(mask, (0, pad)).view(b, -1, r).any(dim=-1)
            if sp is not None:  # the rank's blocks -> every block of the sequence
                blocks = sp.gather_mask(blocks)
            attn_mask = _nonempty(blocks)[:, None, None, :]
        y = F.scaled_dot_product_attention(
            q, kp.transpose(1, 2), vp.transpose(1, 2), attn_mask=attn_mask, dropout_p=dropout_p
        )
        return self.out(y.transpose(1, 2).reshape(b, n, self.hidden_size))

    def _projection(self, shared_projection: Optional[nn.Module]) -> nn.Module:
        if self.proj_k is not None:
            return self.proj_k
        if shared_projection is None:
            raise ValueError(
                f"layer {self.layer_idx}: sharing='layerwise' needs the encoder's shared "
                "projection passed as `shared_projection`"
            )
        return shared_projection

    def _isolated(
        self,
        qkv: torch.Tensor,
        mask: Optional[torch.Tensor],
        shared_projection: Optional[nn.Module],
        documents: Documents,
        dropout_p: float,
    ) -> torch.Tensor:
        """Document-isolated attention of ``qkv [B, n, 3D]`` -> ``[B, n, D]``: each document
        against its own keys (dense: one attention per document), summaries (linear) or
        windows (conv); linear and conv run batched over chunks of k document positions
        (:class:`DocumentChunks`), the work of each document alone plus the chunks' padding."""
        b, n, _ = qkv.shape
        h, d = self.num_heads, self.head_dim
        spans, sp = documents.spans, self.sequence_parallel
        sdpa = F.scaled_dot_product_attention
        ys = []
        if self.kind == "dense":
            q, k, v = qkv.view(b, n, 3, h, d).unbind(2)  # [B, n, h, d]
            if sp is not None:  # Ulysses over the whole rows, the documents' block mask
                y = sp.dense_attention(q, k, v, documents.block_mask, dropout_p)
                return self.out(y.reshape(b, n, self.hidden_size))
            for s, *qkv_i in zip(spans, *(documents.split(t) for t in (q, k, v))):
                qi, ki, vi = (t.transpose(0, 1)[None] for t in qkv_i)  # [1, h, L, d]
                am = None
                if s.padded and mask is not None:
                    am = _nonempty(mask[s.row, s.start : s.end][None])[:, None, None, :]
                y = sdpa(qi, ki, vi, attn_mask=am, dropout_p=dropout_p)
                ys.append(y[0].transpose(0, 1))  # [L, h, d]
            return self.out(torch.cat(ys).view(b, n, self.hidden_size))

        q, kv = qkv.split([self.hidden_size, 2 * self.hidden_size], dim=-1)
        q = q.view(b, n, h, d).transpose(1, 2)  # [B, h, n, d]
        kv = kv.view(b, n, 2 * h, d)
        if mask is not None:
            kv = kv * mask[:, :, None, None].to(kv.dtype)
        proj_k = self._projection(shared_projection)
        if self.proj_v is None:  # E = F
            kvp = proj_k(kv, documents)  # [S, k, 2h, d] or [C, 2h, d]
            kp, vp = kvp.view(kvp.shape[:-2] + (2, h, d)).unbind(-3)
        else:
            k_in, v_in = kv.view(b, n, 2, h, d).unbind(2)
            kp, vp = proj_k(k_in, documents), self.proj_v(v_in, documents)
        if documents.per_span:  # each span's queries (a view) against its own summaries
            counts = [1] * len(spans)  # summaries rows per span: linear [S, k, h, d]
            if self.kind == "conv":  # [sum c_i, h, d] -> c_i = ceil(L_i / r) windows each
                r = proj_k.stride
                counts = [-(-(s.end - s.start) // r) for s in spans]
            ks, vs = kp.split(counts), vp.split(counts)
            qs = documents.split(q.transpose(1, 2))  # [L_i, h, d] views
            for i, s in enumerate(spans):
                am = None
                if self.kind == "conv" and s.padded and mask is not None:  # padding windows
                    real = F.pad(mask[s.row, s.start : s.end], (0, counts[i] * r - s.end + s.start))
                    am = _nonempty(real.view(1, -1, r).any(-1))[:, None, None, :]
                ki, vi = (t[i].reshape(-1, h, d).transpose(0, 1)[None] for t in (ks, vs))
                qi = qs[i].transpose(0, 1)[None]  # [1, h, L, d]
                y = sdpa(qi, ki, vi, attn_mask=am, dropout_p=dropout_p)
                ys.append(y[0].transpose(0, 1))  # [L, h, d]
            return self.out(torch.cat(ys).view(b, n, self.hidden_size))
        # queries in chunks of k positions of a document, each chunk against its document's
        # summaries (linear: k of them; conv: its windows, padded to the most of one document)
        plan = documents.chunks(self.config.k_for_layer(self.layer_idx), b * n, qkv.device)
        am = None
        if self.kind == "conv":  # [C_w, h, d] windows -> [S, J, h, d], empty ones masked
            win = documents.chunks(proj_k.stride, b * n, qkv.device)
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
                for t in (kp, vp)
            )
            am = _nonempty(valid).index_select(0, plan.span)[:, None, None, :]
        flat = torch.cat([q.transpose(1, 2).reshape(b * n, h * d), q.new_zeros(1, h * d)])
        qc = flat.index_select(0, plan.tokens.reshape(-1)).view(-1, plan.size, h, d)
        kc, vc = (t.index_select(0, plan.span).transpose(1, 2) for t in (kp, vp))
        y = sdpa(qc.transpose(1, 2), kc, vc, attn_mask=am, dropout_p=dropout_p)  # [C, h, c, d]
        y = y.transpose(1, 2).reshape(-1, h * d).index_select(0, plan.slot)  # [B n, D]
        return self.out(y.view(b, n, self.hidden_size))
