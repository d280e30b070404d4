"""Hugging Face configuration for Linformer encoders (shipped as remote code with every export).

Every field of ``ModelConfig`` is a config attribute of the same name, so ``config.json`` holds the
whole model description; ``to_model_config()`` turns it back into the plain ``ModelConfig``.
"""

from dataclasses import fields
from typing import Any

from transformers import PretrainedConfig

from .linformer_model import ModelConfig

# ModelConfig fields that PretrainedConfig already knows (and handles itself)
_HF_OWNED = ("num_labels",)
MODEL_FIELDS = tuple(f.name for f in fields(ModelConfig) if f.name not in _HF_OWNED)
# The fixed special ids of every data_prep tokenizer (the special-token table of the training package; repeated
# here because remote code cannot import data_prep): config.json carries them like BERT's does.
TOKEN_IDS = {
    "bos_token_id": 2,
    "eos_token_id": 3,
    "cls_token_id": 2,
    "sep_token_id": 3,
    "mask_token_id": 4,
}


# Why a Linformer is an encoder only (also raised by LinformerForCausalLM and is_decoder=True).
CAUSAL_REASON = (
    "Linformer cannot be causal: its sequence projections (E/F, or the strided convolution) mix "
    "every position into k summaries, so each output depends on later tokens and no attention "
    "mask can prevent it; use it as an encoder (AutoModel, AutoModelForMaskedLM, "
    "AutoModelForSequenceClassification)"
)


class LinformerConfig(PretrainedConfig):
    """``PretrainedConfig`` carrying every ``ModelConfig`` option (``model_type='linformer'``)."""

    model_type = "linformer"
    attribute_map = {
        "num_hidden_layers": "num_layers",
        "num_attention_heads": "num_heads",
        "max_position_embeddings": "max_seq_len",
        "hidden_dropout_prob": "dropout",
        "attention_probs_dropout_prob": "attention_dropout",
    }

    def __init__(self, **kwargs: Any) -> None:
        defaults = ModelConfig().to_dict()
        for name in MODEL_FIELDS:
            setattr(self, name, kwargs.pop(name, defaults[name]))
        kwargs.setdefault("pad_token_id", self.pad_token_id)
        kwargs.setdefault("tie_word_embeddings", self.tie_word_embeddings)
        for name, value in TOKEN_IDS.items():
            setattr(self, name, kwargs.pop(name, value))
        super().__init__(**kwargs)
        for flag in ("is_decoder", "add_cross_attention"):  # (not attributes in every version)
            if getattr(self, flag, False):
                raise ValueError(f"{flag}=True: {CAUSAL_REASON}")
        self.to_model_config()  # validate early: a bad option fails here, naming the field

    def to_model_config(self) -> ModelConfig:
        """The plain-PyTorch ``ModelConfig`` described by this config."""
        d = {name: getattr(self, name) for name in MODEL_FIELDS}
        d["num_labels"] = int(self.num_labels)
        return ModelConfig.from_dict(d)

    @classmethod
    def from_model_config(cls, model_config: ModelConfig, **kwargs: Any) -> "LinformerConfig":
        """Build from a ``ModelConfig``; ``kwargs`` are extra ``PretrainedConfig`` options."""
        d = model_config.to_dict()
        kwargs.setdefault("num_labels", d.pop("num_labels"))
        return cls(**d, **kwargs)


__all__ = ["LinformerConfig", "CAUSAL_REASON"]
