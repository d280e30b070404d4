"""Multi-head self-attention of one layer, of the kind its schedule names (the registry,
``registry.py``): a kind that attends itself (``attend``: dense, routed, selective) is called
with the layer's queries, keys and values; otherwise the queries attend to the kind's projected
summaries of the keys and values (linear, conv, dynamic, registered kinds), optionally joined by
the exact sliding window (``window.py``, local + global attention, Transformer-LS).

Every per-kind question (which summaries hold padding, how the summaries of a document are laid
out) is answered by the kind or its projection module (:class:`~.projections.Projection`): no
branch here on a kind's name.
"""

from typing import Any

import torch
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
)
from .window import LocalContext, local_global


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
        kind = get_projection(self.kind)
        self.attend = kind.attend  # the kind attends itself (dense, routed, selective), or None
        self.windowed = kind.windowed and config.local_window > 0
        self.masked_projection = kind.masked
        self.summarised = kind.summaries and kind.factory is not None
        self.proj_k: nn.Module | None = None
        self.proj_v: nn.Module | None = None
        # layout, set from outside (linformer_ds.parallel.parallelize.apply_sequence_parallel)
        self.sequence_parallel: Any | None = None
        if kind.factory is not None and config.sharing != "layerwise":
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
        if self.attend is not None:  # the kind's own attention
            y = self.attend(self, qkv, mask, documents if isolated else None, local, dropout_p)
            return self.out(y)

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
            y = local_global(
                q.view(b, n, h, d), k, v, proj_k, kp, vp, mask, documents if isolated else None,
                local, dropout_p,
            )  # fmt: skip
            return self.out(y)
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
