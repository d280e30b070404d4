"""Hugging Face model classes for Linformer encoders (shipped as remote code with every export).

The classes wrap the plain-PyTorch modules of ``model.py`` under the same parameter names as the
training model (``encoder.*``, ``lm_head.*``, ``pooler.*``, ``classifier.*``), so a consolidated
training state dict loads without renaming. ``lm_head.decoder.weight`` is tied to
``encoder.token_embeddings.weight`` (``tie_word_embeddings``) and is not stored in the weights file.
"""

import functools
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import (
    BaseModelOutput,
    MaskedLMOutput,
    SequenceClassifierOutput,
)

from ..model import ConvProjection, LinearProjection, LinformerEncoder, MLMHead
from .configuration_linformer import LinformerConfig


class LinformerPreTrainedModel(PreTrainedModel):
    """Shared init, config class and activation checkpointing of the Linformer HF models."""

    config_class = LinformerConfig
    base_model_prefix = "encoder"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _no_split_modules = ["EncoderLayer"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            module.weight.normal_(mean=0.0, std=std)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(mean=0.0, std=std)
        elif isinstance(module, nn.LayerNorm):
            module.weight.fill_(1.0)
            module.bias.zero_()
        elif isinstance(module, (LinearProjection, ConvProjection)):
            module.reset_parameters()

    def gradient_checkpointing_enable(
        self, gradient_checkpointing_kwargs: Optional[dict] = None
    ) -> None:
        """Non-reentrant activation checkpointing of every encoder layer."""
        kwargs = {"use_reentrant": False, **(gradient_checkpointing_kwargs or {})}
        fn = functools.partial(torch.utils.checkpoint.checkpoint, **kwargs)
        self.encoder.set_activation_checkpointing(fn)

    def gradient_checkpointing_disable(self) -> None:
        """Turn activation checkpointing off."""
        self.encoder.set_activation_checkpointing(None)

    @property
    def is_gradient_checkpointing(self) -> bool:
        return self.encoder._checkpoint_fn is not None

    def get_input_embeddings(self) -> nn.Module:
        return self.encoder.token_embeddings

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.encoder.token_embeddings = value


class LinformerModel(LinformerPreTrainedModel):
    """The bare encoder: ``last_hidden_state`` ``[B, n, D]``."""

    def __init__(self, config: LinformerConfig):
        super().__init__(config)
        self.encoder = LinformerEncoder(config.to_model_config())
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        return_dict: Optional[bool] = None,
        **kwargs: Any,
    ) -> BaseModelOutput:
        hidden = self.encoder(input_ids, attention_mask)
        if return_dict is False:
            return (hidden,)
        return BaseModelOutput(last_hidden_state=hidden)


class LinformerForMaskedLM(LinformerPreTrainedModel):
    """Encoder + MLM head. ``labels`` ``[B, n]`` with ``-100`` = ignore; logits ``[B, n, V]``."""

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
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        return_dict: Optional[bool] = None,
        **kwargs: Any,
    ) -> MaskedLMOutput:
        logits = self.lm_head(self.encoder(input_ids, attention_mask))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits.float().view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100
            )
        if return_dict is False:
            return (logits,) if loss is None else (loss, logits)
        return MaskedLMOutput(loss=loss, logits=logits)


class LinformerForSequenceClassification(LinformerPreTrainedModel):
    """Encoder + pooler (first token, dense + tanh) + linear classifier: logits ``[B, num_labels]``."""

    def __init__(self, config: LinformerConfig):
        super().__init__(config)
        model_config = config.to_model_config()
        self.num_labels = config.num_labels
        self.encoder = LinformerEncoder(model_config)
        self.pooler = nn.Linear(config.hidden_size, config.hidden_size)
        p = config.classifier_dropout if config.classifier_dropout is not None else config.dropout
        self.drop = nn.Dropout(p)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        return_dict: Optional[bool] = None,
        **kwargs: Any,
    ) -> SequenceClassifierOutput:
        hidden = self.encoder(input_ids, attention_mask)
        pooled = torch.tanh(self.pooler(hidden[:, 0]))
        logits = self.classifier(self.drop(pooled))
        loss = None
        if labels is not None:
            if self.num_labels == 1 or self.config.problem_type == "regression":
                loss = F.mse_loss(logits.squeeze(-1).float(), labels.float())
            elif self.config.problem_type == "multi_label_classification":
                loss = F.binary_cross_entropy_with_logits(logits.float(), labels.float())
            else:
                loss = F.cross_entropy(logits.float(), labels.long())
        if return_dict is False:
            return (logits,) if loss is None else (loss, logits)
        return SequenceClassifierOutput(loss=loss, logits=logits)


__all__ = [
    "LinformerPreTrainedModel",
    "LinformerModel",
    "LinformerForMaskedLM",
    "LinformerForSequenceClassification",
]
