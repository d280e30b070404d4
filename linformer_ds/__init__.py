"""linformer_ds: pretrain Linformer encoders (Wang et al. 2020) with DeepSpeed.

The model classes are imported on first use (PEP 562), so that torch-free helpers such as
``linformer_ds.fsio`` (used by data_prep's worker processes) do not load torch.
"""

import importlib
from typing import Any

from linformer_ds import entry  # standard library only: Ctrl-C under python -m (arm_under_m)
from linformer_ds.errors import LinformerError  # standard library only: no torch

entry.arm_under_m()

__version__ = "0.1.0"

__all__ = [
    "LinformerError",
    "ModelConfig",
    "LinformerSelfAttention",
    "LinformerEncoder",
    "LinformerForMaskedLM",
    "LinformerForMaskedLMPretraining",
    "LinformerForSequenceClassification",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name in __all__:  # the model's names (LinformerError is bound above)
        return getattr(importlib.import_module("linformer_ds.model"), name)
    raise AttributeError(f"module 'linformer_ds' has no attribute {name!r}")
