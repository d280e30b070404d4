"""linformer_ds: pretrain Linformer encoders (Wang et al. 2020) with DeepSpeed."""

from linformer_ds.model import (
    LinformerEncoder,
    LinformerForMaskedLM,
    LinformerForMaskedLMPretraining,
    LinformerForSequenceClassification,
    LinformerSelfAttention,
    ModelConfig,
)

__version__ = "0.1.0"

__all__ = [
    "ModelConfig",
    "LinformerSelfAttention",
    "LinformerEncoder",
    "LinformerForMaskedLM",
    "LinformerForMaskedLMPretraining",
    "LinformerForSequenceClassification",
    "__version__",
]
