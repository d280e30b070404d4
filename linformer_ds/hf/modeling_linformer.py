"""Hugging Face model classes for Linformer encoders (shipped as remote code with every export).

The classes are thin adapters over the plain-PyTorch modules of ``model/``, under the same
parameter names as the training model (``encoder.*``, ``lm_head.*``, ``classifier.*``), so a
consolidated training state dict loads without renaming. ``lm_head.decoder.weight`` is tied to
``encoder.token_embeddings.weight`` and is not stored. Task heads follow BERT/RoBERTa's names
(``classifier``, ``qa_outputs``), the ones PEFT's defaults and users' recipes expect.

What the adapters add to ``model/``: the HF calling conventions (``return_dict``,
``output_hidden_states``, ``inputs_embeds``), clear refusals of the arguments a Linformer cannot
honour (``output_attentions``, ``head_mask``, ...), and padding on any side: a
row whose padding is not all on the right is compacted (real tokens first, in order) before the
encoder and its outputs are put back, so positions and the columns of ``E``/``F`` are those of
the unpadded sequence (like RoBERTa's position ids) and the classifier pools the first real token.
``attn_implementation``: ``"sdpa"`` (default) lets torch pick the fused kernel, ``"eager"`` runs
the same attention through SDPA's math backend (plain matmul + softmax).
``position_ids [B, n]`` (optional): several documents in one row, each with positions restarting
at 0 (document isolation, as pretraining with packed rows): every token gets its own position and
attends only within its document, as if each document were its own row. None, or 0..n-1 per
row: one document per row (unchanged).
"""

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel
from transformers.modeling_outputs import (
    BaseModelOutput,
    MaskedLMOutput,
    MultipleChoiceModelOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)

from ..model import (
    ClassificationHead,
    LinformerEncoder,
    MLMHead,
    init_weights,
    mlm_loss,
    sequence_classification_loss,
    tracing,
)
from .configuration_linformer import CAUSAL_REASON, LinformerConfig

# Arguments other HF encoders take that a Linformer cannot honour: name -> why.
UNSUPPORTED = {
    "output_attentions": "Linformer attention has no n x n attention weights to return",
    "head_mask": "heads cannot be masked",
    "encoder_hidden_states": "the model is an encoder without cross-attention",
    "encoder_attention_mask": "the model is an encoder without cross-attention",
    "past_key_values": "the model is an encoder without a cache",
    "use_cache": "the model is an encoder without a cache",
    "is_causal": CAUSAL_REASON,
}


def _check_kwargs(kwargs: dict[str, Any]) -> None:
    """Refuse, by name, any argument this model would otherwise silently ignore.

    ``None``/``False`` values are accepted (callers pass defaults), and so are all-zero
    ``token_type_ids`` (the model has no segment embeddings).
    """
    for name, value in kwargs.items():
        if value is None or value is False:
            continue
        if name == "token_type_ids":
            if isinstance(value, torch.Tensor) and not value.any():
                continue
            raise ValueError(
                "token_type_ids: this model has no segment embeddings; pass none (or all zeros)"
            )
        why = UNSUPPORTED.get(name, "not an argument of this model")
        raise ValueError(f"{name} is not supported: {why}")


def _compaction_order(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """``[B, n]`` gather order that moves every row's real tokens to the front (stable), or
    ``None`` when all padding is already on the right. Traced (ONNX export): always the order
    (the identity on right-padded rows), from distinct keys, with no branch on the mask's values."""
    if attention_mask is None:
        return None
    real = attention_mask != 0
    if tracing():  # key: padding after every real token, then the position (ties impossible)
        n = real.shape[1]
        key = (~real).long() * n + torch.arange(n, device=real.device)
        return torch.argsort(key, dim=1)
    if bool((real[:, 1:] <= real[:, :-1]).all()):  # every row: ones, then zeros
        return None
    return torch.argsort((~real).to(torch.int8), dim=1, stable=True)


def _gather(x: torch.Tensor | None, order: torch.Tensor) -> torch.Tensor | None:
    """``x [B, n, ...]`` reordered along dim 1 by ``order [B, n]``."""
    if x is None:
        return None
    idx = order.view(*order.shape, *([1] * (x.dim() - 2))).expand_as(x)
    return x.gather(1, idx)


def _restore(x: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """Undo :func:`_gather`: ``out[b, order[b, j]] = x[b, j]``, as whole rows: the inverse
    order (a ``[B, n]`` scatter) picks the rows of ``x [B, n, ...]`` (one ``index_select``; an
    element-wise scatter of the logits took much of onnxruntime's time: BENCHMARKS.md)."""
    if order is None:
        return x
    b, n = order.shape
    pos = torch.arange(n, device=order.device).expand(b, n)
    inverse = torch.empty_like(order).scatter(1, order, pos)
    rows = (inverse + torch.arange(b, device=order.device)[:, None] * n).reshape(-1)
    return x.reshape((b * n,) + x.shape[2:]).index_select(0, rows).view(x.shape)


class LinformerPreTrainedModel(PreTrainedModel):
    """Shared init, config class, activation checkpointing and input handling."""

    config_class = LinformerConfig
    base_model_prefix = "encoder"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _supports_sdpa = True  # attention is torch's scaled_dot_product_attention ("eager": its math)
    accepts_loss_kwargs = False  # the losses are means; Trainer need not pass num_items_in_batch
    _no_split_modules = ["EncoderLayer"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        init_weights(module, self.config.initializer_range)

    def _set_gradient_checkpointing(
        self,
        enable: bool = True,
        gradient_checkpointing_func: Callable = checkpoint,
        every_n_layers: int = 1,
    ) -> None:
        """Where transformers' ``activation_checkpointing_enable`` / ``gradient_checkpointing_enable``
        (every argument: ``gradient_checkpointing_kwargs``, ``every_n_layers``, ``offload``) and
        ``..._disable`` land: checkpoint every ``every_n_layers``-th encoder layer with
        ``gradient_checkpointing_func`` (transformers builds it: non-reentrant by default)."""
        layers = range(0, len(self.encoder.layers), max(1, int(every_n_layers)))
        self.encoder.set_activation_checkpointing(
            gradient_checkpointing_func if enable else None, list(layers)
        )

    @property
    def is_activation_checkpointing(self) -> bool:
        return self.encoder._checkpoint_fn is not None

    @property
    def is_gradient_checkpointing(self) -> bool:
        return self.encoder._checkpoint_fn is not None

    def _attention_backend(self) -> contextlib.AbstractContextManager:
        """``attn_implementation="eager"``: SDPA's math backend; otherwise torch's choice."""
        if getattr(self.config, "_attn_implementation", None) == "eager":
            return sdpa_kernel(SDPBackend.MATH)
        return contextlib.nullcontext()

    def get_input_embeddings(self) -> nn.Module:
        return self.encoder.token_embeddings

    def set_input_embeddings(self, value: nn.Module) -> None:
        """Also keeps the encoder's ``ModelConfig`` (which checks input ids) at the new size."""
        self.encoder.token_embeddings = value
        self.encoder.config.vocab_size = int(value.num_embeddings)

    def _encode(
        self,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None,
        output_hidden_states: bool | None,
        kwargs: dict[str, Any],
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None, torch.Tensor | None]:
        """Run the encoder on compacted rows.

        Returns ``hidden [B, n, D]`` in compacted order (row ``b``'s real tokens first), the
        hidden states (``num_layers + 1`` tensors ``[B, n, D]``, caller's order) or ``None``,
        and the compaction order (``None`` = identity) for :func:`_restore`.
        """
        position_ids = kwargs.pop("position_ids", None)  # documents restarting at 0 (isolation)
        _check_kwargs(kwargs)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is not None:
            self._check_embeds(inputs_embeds, attention_mask)
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() != 2:
            raise ValueError(
                f"attention_mask must be [batch, seq_len] (1 = token, 0 = padding), got shape "
                f"{tuple(attention_mask.shape)}; a per-query mask (e.g. causal) cannot be "
                f"applied: {CAUSAL_REASON}"
            )
        if output_hidden_states is None:
            output_hidden_states = bool(getattr(self.config, "output_hidden_states", False))
        order = _compaction_order(attention_mask)
        if order is not None:
            input_ids, inputs_embeds = _gather(input_ids, order), _gather(inputs_embeds, order)
            attention_mask = attention_mask.gather(1, order)
            position_ids = _gather(position_ids, order)
        states: list | None = [] if output_hidden_states else None
        with self._attention_backend():
            hidden = self.encoder(
                input_ids, attention_mask, inputs_embeds, states, position_ids=position_ids
            )
        all_states = tuple(_restore(h, order) for h in states) if states is not None else None
        return hidden, all_states, order

    def _check_embeds(self, embeds: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        d, n_max = self.config.hidden_size, self.config.max_seq_len
        if not isinstance(embeds, torch.Tensor) or not embeds.is_floating_point():
            raise TypeError("inputs_embeds must be a floating-point torch.Tensor [batch, seq, D]")
        if embeds.dim() != 3 or embeds.shape[-1] != d or not 0 < embeds.shape[1] <= n_max:
            raise ValueError(
                f"inputs_embeds must be [batch, seq_len <= {n_max}, {d}], "
                f"got shape {tuple(embeds.shape)}"
            )
        if attention_mask is not None and attention_mask.shape != embeds.shape[:2]:
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} does not match inputs_embeds "
                f"shape {tuple(embeds.shape[:2])}"
            )

    def _return_dict(self, return_dict: bool | None) -> bool:
        return return_dict if return_dict is not None else getattr(self.config, "return_dict", True)


class LinformerModel(LinformerPreTrainedModel):
    """The bare encoder: ``last_hidden_state [B, n, D]`` (and ``hidden_states`` on request)."""

    def __init__(self, config: LinformerConfig):
        super().__init__(config)
        self.encoder = LinformerEncoder(config.to_model_config())
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> BaseModelOutput:
        hidden, states, order = self._encode(
            input_ids, attention_mask, inputs_embeds, output_hidden_states, kwargs
        )
        hidden = _restore(hidden, order)
        if not self._return_dict(return_dict):
            return (hidden,) if states is None else (hidden, states)
        return BaseModelOutput(last_hidden_state=hidden, hidden_states=states)


class LinformerForMaskedLM(LinformerPreTrainedModel):
    """Encoder + MLM head. ``labels [B, n]`` with ``-100`` = ignore; logits ``[B, n, V]``."""

    _tied_weights_keys = {"lm_head.decoder.weight": "encoder.token_embeddings.weight"}

    def __init__(self, config: LinformerConfig):
        super().__init__(config)
        model_config = config.to_model_config()
        self.encoder = LinformerEncoder(model_config)
        self.lm_head = MLMHead(model_config)
        self.post_init()

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head.decoder

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.lm_head.decoder = value

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> MaskedLMOutput:
        hidden, states, order = self._encode(
            input_ids, attention_mask, inputs_embeds, output_hidden_states, kwargs
        )
        # rows back in the caller's order before the head: a [B n, D] copy, not [B n, V]
        logits = self.lm_head(_restore(hidden, order))
        if labels is not None and labels.shape != logits.shape[:2]:
            raise ValueError(
                f"labels shape {tuple(labels.shape)} does not match the input {tuple(logits.shape[:2])}"
            )
        loss = None if labels is None else mlm_loss(logits, labels)
        if not self._return_dict(return_dict):
            out = (logits,) if states is None else (logits, states)
            return out if loss is None else (loss, *out)
        return MaskedLMOutput(loss=loss, logits=logits, hidden_states=states)


# Weight names of exports written before the head took RoBERTa's layout (pooler + a linear
# classifier) -> today's names; transformers applies them while loading (regex -> replacement).
# (Plain strings: transformers reverses a renaming when saving, and cannot reverse regex syntax.)
LEGACY_CLASSIFIER_KEYS = {
    "pooler.": "classifier.dense.",
    "classifier.weight": "classifier.out_proj.weight",
    "classifier.bias": "classifier.out_proj.bias",
}


def _classifier_dropout(config: LinformerConfig) -> float:
    return config.classifier_dropout if config.classifier_dropout is not None else config.dropout


def _output(return_dict: bool, loss: torch.Tensor | None, outputs: tuple, cls: type, **kw: Any):
    """``cls(loss=..., **kw)``, or the tuple ``(loss?, *outputs)`` (``None`` entries dropped)."""
    if return_dict:
        return cls(loss=loss, **kw)
    out = tuple(o for o in outputs if o is not None)
    return out if loss is None else (loss, *out)


class LinformerForSequenceClassification(LinformerPreTrainedModel):
    """Encoder + RoBERTa-style head on the first real token (``classifier.dense`` + tanh,
    dropout, ``classifier.out_proj``): ``[B, num_labels]``. Exports that store the head as
    ``pooler.*`` + ``classifier.{weight,bias}`` load through :data:`LEGACY_CLASSIFIER_KEYS`."""

    def __init__(self, config: LinformerConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.encoder = LinformerEncoder(config.to_model_config())
        self.classifier = ClassificationHead(
            config.hidden_size, config.num_labels, _classifier_dropout(config)
        )
        self.post_init()

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> "LinformerForSequenceClassification":
        """``PreTrainedModel.from_pretrained``, renaming old head weights on the way in; the
        renaming is then forgotten, so ``save_pretrained`` writes today's names."""
        if kwargs.get("key_mapping") is not None:
            return super().from_pretrained(*args, **kwargs)
        model = super().from_pretrained(*args, key_mapping=dict(LEGACY_CLASSIFIER_KEYS), **kwargs)
        done = getattr(model, "_weight_conversions", None)  # what transformers reverts on save
        if done:
            model._weight_conversions = [
                c for c in done if list(getattr(c, "source_patterns", ()))[:1]
                not in ([k] for k in LEGACY_CLASSIFIER_KEYS)
            ]  # fmt: skip
        return model

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> SequenceClassifierOutput:
        hidden, states, _ = self._encode(
            input_ids, attention_mask, inputs_embeds, output_hidden_states, kwargs
        )
        logits = self.classifier(hidden)  # compacted order: position 0 is the first real token
        loss = None
        if labels is not None:
            if self.config.problem_type is None:  # as BERT infers it
                self.config.problem_type = (
                    "regression"
                    if self.num_labels == 1
                    else "single_label_classification"
                    if not labels.is_floating_point()
                    else "multi_label_classification"
                )
            loss = sequence_classification_loss(logits, labels, self.config.problem_type)
        return _output(
            self._return_dict(return_dict), loss, (logits, states), SequenceClassifierOutput,
            logits=logits, hidden_states=states,
        )  # fmt: skip


class LinformerForTokenClassification(LinformerPreTrainedModel):
    """Encoder + dropout + linear ``classifier`` on every token: ``[B, n, num_labels]``;
    ``labels [B, n]`` with ``-100`` = ignore (sub-word continuations, padding)."""

    def __init__(self, config: LinformerConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.encoder = LinformerEncoder(config.to_model_config())
        self.drop = nn.Dropout(_classifier_dropout(config))
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> TokenClassifierOutput:
        hidden, states, order = self._encode(
            input_ids, attention_mask, inputs_embeds, output_hidden_states, kwargs
        )
        logits = _restore(self.classifier(self.drop(hidden)), order)
        if labels is not None and labels.shape != logits.shape[:2]:
            raise ValueError(
                f"labels shape {tuple(labels.shape)} does not match the input {tuple(logits.shape[:2])}"
            )
        loss = None if labels is None else mlm_loss(logits, labels)  # mean CE, -100 ignored
        return _output(
            self._return_dict(return_dict), loss, (logits, states), TokenClassifierOutput,
            logits=logits, hidden_states=states,
        )  # fmt: skip


class LinformerForQuestionAnswering(LinformerPreTrainedModel):
    """Extractive QA: ``qa_outputs`` (D -> 2) gives ``start_logits`` and ``end_logits [B, n]``;
    the loss is BERT's (mean of the start and end cross-entropies; positions outside the input
    are ignored)."""

    def __init__(self, config: LinformerConfig):
        super().__init__(config)
        self.num_labels = 2
        self.encoder = LinformerEncoder(config.to_model_config())
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        start_positions: torch.Tensor | None = None,
        end_positions: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> QuestionAnsweringModelOutput:
        hidden, states, order = self._encode(
            input_ids, attention_mask, inputs_embeds, output_hidden_states, kwargs
        )
        logits = _restore(self.qa_outputs(hidden), order)  # [B, n, 2], caller's positions
        start_logits, end_logits = (t.squeeze(-1).contiguous() for t in logits.split(1, dim=-1))
        loss = None
        if start_positions is not None and end_positions is not None:
            n = start_logits.shape[1]  # out-of-range positions (truncated answers) are ignored
            start = start_positions.reshape(-1).clamp(0, n)
            end = end_positions.reshape(-1).clamp(0, n)
            loss = 0.5 * (
                F.cross_entropy(start_logits.float(), start, ignore_index=n)
                + F.cross_entropy(end_logits.float(), end, ignore_index=n)
            )
        return _output(
            self._return_dict(return_dict), loss, (start_logits, end_logits, states),
            QuestionAnsweringModelOutput, start_logits=start_logits, end_logits=end_logits,
            hidden_states=states,
        )  # fmt: skip


class LinformerForMultipleChoice(LinformerPreTrainedModel):
    """Multiple choice: ``input_ids [B, C, n]`` (each choice encoded with its context), the
    :class:`ClassificationHead` scores each choice's first real token, logits ``[B, C]``;
    ``labels [B]`` index the right choice. Hidden states are ``[B * C, n, D]`` (as BERT's)."""

    def __init__(self, config: LinformerConfig):
        super().__init__(config)
        self.encoder = LinformerEncoder(config.to_model_config())
        self.classifier = ClassificationHead(config.hidden_size, 1, _classifier_dropout(config))
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> MultipleChoiceModelOutput:
        given = input_ids if input_ids is not None else inputs_embeds
        if given is None or given.dim() != (3 if input_ids is not None else 4):
            raise ValueError(
                "multiple choice takes input_ids [batch, choices, seq_len] (or inputs_embeds "
                f"[batch, choices, seq_len, D]), got {None if given is None else tuple(given.shape)}"
            )
        b, c = given.shape[:2]
        flat = lambda t: None if t is None else t.reshape(b * c, *t.shape[2:])  # noqa: E731
        if isinstance(kwargs.get("position_ids"), torch.Tensor):
            kwargs["position_ids"] = flat(kwargs["position_ids"])
        hidden, states, _ = self._encode(
            flat(input_ids), flat(attention_mask), flat(inputs_embeds), output_hidden_states,
            kwargs,
        )  # fmt: skip
        logits = self.classifier(hidden).view(b, c)
        loss = None if labels is None else F.cross_entropy(logits.float(), labels.long())
        return _output(
            self._return_dict(return_dict), loss, (logits, states), MultipleChoiceModelOutput,
            logits=logits, hidden_states=states,
        )  # fmt: skip


class LinformerForCausalLM(LinformerPreTrainedModel):
    """Not a model: the ``AutoModelForCausalLM`` entry of an export, so that asking for a causal
    LM gets the reason (:data:`CAUSAL_REASON`) instead of transformers' generic list of model
    types."""

    def __init__(self, config: LinformerConfig, *args: Any, **kwargs: Any) -> None:
        raise ValueError(CAUSAL_REASON)

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> "LinformerForCausalLM":
        raise ValueError(CAUSAL_REASON)


__all__ = [
    "LEGACY_CLASSIFIER_KEYS",
    "LinformerForCausalLM",
    "LinformerPreTrainedModel",
    "LinformerModel",
    "LinformerForMaskedLM",
    "LinformerForSequenceClassification",
    "LinformerForTokenClassification",
    "LinformerForQuestionAnswering",
    "LinformerForMultipleChoice",
]
