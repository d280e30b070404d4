"""Hugging Face wrappers of the Linformer model (needs ``transformers``; see ``linformer_ds.export``).

The two modules here are copied, with the ``model/`` package, into every exported model directory as its
remote code (``from ..model`` becomes ``from .linformer_model``).
"""

from .configuration_linformer import LinformerConfig
from .modeling_linformer import (
    LinformerForCausalLM,
    LinformerForMaskedLM,
    LinformerForMultipleChoice,
    LinformerForQuestionAnswering,
    LinformerForSequenceClassification,
    LinformerForTokenClassification,
    LinformerModel,
    LinformerPreTrainedModel,
)

__all__ = [
    "LinformerConfig",
    "LinformerModel",
    "LinformerPreTrainedModel",
    "LinformerForMaskedLM",
    "LinformerForSequenceClassification",
    "LinformerForTokenClassification",
    "LinformerForQuestionAnswering",
    "LinformerForMultipleChoice",
    "LinformerForCausalLM",
]
