"""The encoder: embeddings, the layers, document isolation and local mixing set up per batch."""

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .documents import Documents, document_block_mask, document_spans, document_starts
from .layers import EncoderLayer, LocalMixer, LocalMixing, local_mixer_valid
from .registry import _make_projection, get_projection, layer_kinds, projection_names, tracing
from .rotary import rotary_tables
from .window import LocalContext, Window, make_window


def check_inputs(
    config: ModelConfig,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    check_ids: bool = True,
) -> None:
    """Clear errors for bad model input, before anything deep inside torch can fail.
    ``check_ids=False`` leaves out the token-id range check (two device->host reads on a GPU)
    for callers that checked the ids on the host (the trainer's data pipeline)."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must be an integer tensor, got dtype {input_ids.dtype}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}")
    n = input_ids.shape[1]
    if n > config.max_seq_len:
        raise ValueError(
            f"sequence length {n} exceeds the model's max_seq_len {config.max_seq_len}"
        )
    if n == 0:
        raise ValueError("input_ids has sequence length 0")
    if check_ids and not tracing():  # traced: no value-dependent branch in the graph
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= config.vocab_size:
            bad = hi if hi >= config.vocab_size else lo
            raise ValueError(
                f"input_ids contain token id {bad} outside the vocabulary [0, {config.vocab_size})"
            )
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor):
            raise TypeError("attention_mask must be a torch.Tensor")
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} does not match input_ids "
                f"shape {tuple(input_ids.shape)}"
            )


class LinformerEncoder(nn.Module):
    """Embeddings + ``num_layers`` blocks. ``forward(input_ids [B, n], attention_mask) -> [B, n, D]``.

    Activation checkpointing is applied from outside with ``set_activation_checkpointing``.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        # Layout and run-time switches, set from outside:
        # global position of the position table's row 0 (sharded sequence parallelism)
        self.position_shard_start = 0
        # False: the caller checked the token ids on the host (the trainer does)
        self.check_token_ids = True
        # document isolation: one product and attention per span (True), batched over chunks
        # (False), or None: per span on the CPU (measured faster there), chunks on accelerators
        self.document_per_span: bool | None = None
        # linformer_ds.parallel.parallelize.apply_sequence_parallel
        self.sequence_parallel: Any | None = None
        self.token_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings: nn.Embedding | None = None
        if config.positions == "learned":
            self.position_embeddings = nn.Embedding(config.max_seq_len, config.hidden_size)
            # init_weights reads the flag (module-local: any order of initialisation gives it)
            self.position_embeddings.sinusoidal_init = config.position_init == "sinusoidal"
        self.embed_ln = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.drop = nn.Dropout(config.dropout)
        self.mixer: LocalMixer | None = None
        if config.local_mixer == "embed":
            self.mixer = LocalMixer(config.hidden_size, config.local_mixer_kernel)
        schedule = config.projection_schedule()
        # The single owner of each layerwise-shared projection: one per kind in the schedule,
        # ``shared_<kind>`` (shared_linear, shared_conv), in registry order.
        self.shared = {}  # kind -> its module (the same modules as the shared_<kind> attributes)
        for kind in projection_names():  # every kind with a projection: a module or None
            if get_projection(kind).factory is None:
                continue
            if kind in schedule and config.sharing == "layerwise":
                self.shared[kind] = _make_projection(config, schedule.index(kind), kind, 1)
            setattr(self, f"shared_{kind}", self.shared.get(kind))
        self.layers = nn.ModuleList(EncoderLayer(config, i) for i in range(config.num_layers))
        self.final_ln = (
            nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
            if config.norm == "pre"
            else nn.Identity()
        )
        self._checkpoint_fn: Callable[..., Any] | None = None
        self._checkpoint_layers: set = set()
        self._checkpoint_granularity = "layer"

    def set_activation_checkpointing(
        self,
        fn: Callable[..., Any] | None,
        layers: list[int] | None = None,
        granularity: str = "layer",
    ) -> None:
        """Wrap layer calls in ``fn(layer, x, mask, shared_projection)`` while training.

        ``fn`` is e.g. ``functools.partial(torch.utils.checkpoint.checkpoint,
        use_reentrant=False)``; ``layers`` selects which layers (default: all). ``None`` turns
        checkpointing off. ``granularity="sublayer"`` checkpoints the attention and the
        feed-forward sub-layers of each selected layer separately (``fn(layer.attention_block,
        x, mask, shared_projection)``, then ``fn(layer.ffn_block, x)``): twice the saved inputs,
        but the backward pass recomputes and holds one sub-layer at a time instead of a layer;
        the embeddings too (``fn(self.embed, input_ids, positions)``: only the ids are kept).
        """
        if granularity not in ("layer", "sublayer"):
            raise ValueError(f"granularity must be layer or sublayer, got {granularity!r}")
        self._checkpoint_fn = fn
        self._checkpoint_layers = set(range(len(self.layers)) if layers is None else layers)
        self._checkpoint_granularity = granularity

    def embed(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token (or ``inputs_embeds``) plus position embeddings, LayerNorm, dropout:
        ``[B, n]`` ids and ``[n]`` (or per token ``[B, n]``) rows of the position table
        -> ``[B, n, D]``."""
        tokens = self.token_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        if self.position_embeddings is not None:
            pe = self.position_embeddings(positions)
            tokens = tokens + (pe if pe.dim() == 3 else pe[None])
        return self.drop(self.embed_ln(tokens))

    def _documents(
        self,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        n: int,
        offset: int,
    ) -> tuple[Documents, tuple[torch.Tensor, torch.Tensor | None]]:
        """The document spans of this batch (of this rank's slice, from the whole rows gathered
        over the sequence-parallel group), and the ``(position_ids, mask)`` rows they come from
        (whole rows under sequence parallelism; the local mixer reads them too)."""
        if (
            not isinstance(position_ids, torch.Tensor)
            or position_ids.dim() != 2
            or (position_ids.shape[1] != n)
        ):
            raise ValueError(
                f"position_ids must be a [batch, {n}] tensor, got "
                f"{tuple(getattr(position_ids, 'shape', ()))}"
            )
        if position_ids.dtype.is_floating_point or position_ids.dtype == torch.bool:
            raise TypeError(f"position_ids must be an integer tensor, got {position_ids.dtype}")
        table = self.position_embeddings
        if self.position_shard_start or (
            table is not None and table.num_embeddings != self.config.max_seq_len
        ):
            raise ValueError("position_ids need the whole position table (not sharded)")
        sp = self.sequence_parallel
        if sp is None:
            docs = document_spans(
                position_ids, attention_mask, max_position=self.config.max_seq_len
            )
            return docs, (position_ids, attention_mask)
        pos, mask = sp.gather_documents(position_ids, attention_mask)  # whole rows [B, N]
        docs = document_spans(pos, mask, offset, n, max_position=self.config.max_seq_len)
        full = any(kind.full_attention for kind in layer_kinds(self.config))
        if full and not docs.whole_rows:
            docs = docs._replace(block_mask=document_block_mask(pos, mask))
        return docs, (pos, mask)

    def _mixing(
        self,
        batch: int,
        n: int,
        offset: int,
        attention_mask: torch.Tensor | None,
        rows: tuple[torch.Tensor, torch.Tensor | None] | None,
        device: torch.device,
    ) -> LocalMixing:
        """The local mixers' shared inputs for this batch: ``rows`` are the ``(position_ids,
        mask)`` of :meth:`_documents` (None: one document per row). Under sequence parallelism
        the validity of the whole rows (documents and padding cross slices), sliced."""
        r = self.config.local_mixer_kernel // 2
        sp = self.sequence_parallel
        if sp is not None and n < r:
            raise ValueError(
                f"local_mixer_kernel {self.config.local_mixer_kernel} reaches {r} positions, "
                f"past the sequence-parallel slice of {n}"
            )
        pos, mask, length = self._whole_rows(n, attention_mask, rows)
        valid = local_mixer_valid(r, length, batch, mask, pos, device)
        if sp is None:
            return LocalMixing(valid)
        return LocalMixing(valid[:, :, offset : offset + n].contiguous(), sp.halo)

    def _whole_rows(
        self,
        n: int,
        attention_mask: torch.Tensor | None,
        rows: tuple[torch.Tensor, torch.Tensor | None] | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
        """``(position_ids, mask, length)`` of the whole rows this slice belongs to: ``rows``
        from :meth:`_documents` (None: one document per row; the mask gathered over the
        sequence-parallel group)."""
        sp = self.sequence_parallel
        length = n if sp is None else n * sp.world_size
        if rows is not None:
            return rows[0], rows[1], length
        if sp is None or attention_mask is None:
            return None, attention_mask, length
        return None, sp.gather_mask(attention_mask), length

    def _window(
        self,
        batch: int,
        n: int,
        offset: int,
        attention_mask: torch.Tensor | None,
        rows: tuple[torch.Tensor, torch.Tensor | None] | None,
        device: torch.device,
    ) -> Window:
        """The windowed layers' shared inputs (:class:`Window`): each token's document number
        and its keys' (``-1``: padding or outside the row), from the whole rows under sequence
        parallelism (documents and padding cross slices)."""
        r = self.config.local_window // 2
        sp = self.sequence_parallel
        if sp is not None and n < r:
            raise ValueError(
                f"model.local_window {self.config.local_window} reaches {r} positions, past the "
                f"sequence-parallel slice of {n}: use a window of at most {2 * n} or fewer ranks"
            )
        pos, mask, length = self._whole_rows(n, attention_mask, rows)
        if pos is None:
            doc = torch.zeros(batch, length, dtype=torch.long, device=device)
        else:
            doc = torch.cumsum(document_starts(pos, mask).long(), dim=1)
        key_doc = doc if mask is None else doc.masked_fill(~mask.bool(), -1)
        key_doc = F.pad(key_doc, (r, r), value=-1)[:, offset : offset + n + 2 * r]
        halo = None if sp is None else sp.halo
        if tracing():  # export: one band-masked product, no blocks to size
            return Window(r, doc[:, offset : offset + n], key_doc, halo)
        return make_window(r, doc[:, offset : offset + n], key_doc, halo)

    def _shared_for(self, layer: EncoderLayer) -> nn.Module | None:
        return self.shared.get(layer.attention.kind)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        hidden_states: list[torch.Tensor] | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``inputs_embeds [B, n, D]`` (checked by the caller) replaces the token lookup of
        ``input_ids``; a ``hidden_states`` list receives ``num_layers + 1`` tensors ``[B, n, D]``:
        the embeddings, the input of every later layer, and the final output (after final_ln).

        ``position_ids [B, n]`` (document isolation in packed rows): each document's positions
        from 0; a document starts at each row start and at every unmasked 0. Every token then
        uses its own position and attends only within its document, exactly as if each
        document ran alone (see :func:`document_spans`); None: positions 0..n-1, one document
        per row. Under sequence parallelism ``position_ids`` is this rank's slice."""
        if inputs_embeds is None:
            check_inputs(self.config, input_ids, attention_mask, self.check_token_ids)
            n, device = input_ids.shape[1], input_ids.device
        elif input_ids is not None:
            raise ValueError("pass input_ids or inputs_embeds, not both")
        else:
            n, device = inputs_embeds.shape[1], inputs_embeds.device
        sp = self.sequence_parallel
        off = 0 if sp is None else sp.offset(n)  # the slice's global position
        if off + n > self.config.max_seq_len:
            raise ValueError(
                f"sequence-parallel slice ends at position {off + n}, past the model's "
                f"max_seq_len {self.config.max_seq_len}"
            )
        # sharded: the table holds rows [position_shard_start, ...) only
        start = self.position_shard_start
        rows = (
            self.config.max_seq_len
            if self.position_embeddings is None
            else (self.position_embeddings.num_embeddings)
        )
        if start and not start <= off <= off + n <= start + rows:
            raise ValueError(
                f"sequence-parallel slice [{off}, {off + n}) is outside the position rows this "
                f"rank holds [{start}, {start + rows}): sharded positions need N = max_seq_len"
            )
        pos = torch.arange(off - start, off - start + n, device=device)
        documents, rows = None, None
        if position_ids is not None:
            documents, rows = self._documents(position_ids, attention_mask, n, off)
            per_span = self.document_per_span
            documents = documents._replace(
                per_span=device.type == "cpu" if per_span is None else per_span
            )
            pos = position_ids.long()
        checkpointed = self._checkpoint_fn is not None and self.training
        if checkpointed and self._checkpoint_granularity == "sublayer" and inputs_embeds is None:
            # recomputed in backward from the ids: no [B, n, D] kept for embed_ln's backward
            x = self._checkpoint_fn(self.embed, input_ids, pos)
        else:
            x = self.embed(input_ids, pos, inputs_embeds)
        mixing = None
        if self.config.local_mixer != "none":
            mixing = self._mixing(x.shape[0], n, off, attention_mask, rows, device)
            if self.mixer is not None:
                x = x + self.mixer(x, mixing)
        local = None
        if self.config.local_window or self.config.positions == "rope":
            window = None
            if self.config.local_window:
                window = self._window(x.shape[0], n, off, attention_mask, rows, device)
            rotary = None
            if self.config.positions == "rope":
                rotary = rotary_tables(pos + start, self.config.head_dim, self.config.rope_base)
            local = LocalContext(window, rotary)
        for i, layer in enumerate(self.layers):
            if hidden_states is not None:
                hidden_states.append(x)
            args = (attention_mask, self._shared_for(layer))
            if documents is not None or mixing is not None or local is not None:
                args += (documents, mixing, local)
            if self._checkpoint_fn is not None and self.training and i in self._checkpoint_layers:
                if self._checkpoint_granularity == "sublayer":
                    x = self._checkpoint_fn(layer.attention_block, x, *args)
                    x = self._checkpoint_fn(layer.ffn_block, x)
                else:
                    x = self._checkpoint_fn(layer, x, *args)
            else:
                x = layer(x, *args)
        x = self.final_ln(x)
        if hidden_states is not None:
            hidden_states.append(x)
        return x
