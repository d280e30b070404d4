"""Task heads and models (MLM, pretraining MLM, sequence classification) over the encoder.
Beside them: their losses (``losses.py``), the weight initialisation (``init.py``) and the
FLOPs count (``flops.py``)."""

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .encoder import LinformerEncoder
from .flops import flops_per_token
from .init import init_weights
from .losses import labelled_positions, mlm_loss, sequence_classification_loss
from .registry import tracing


# NamedTuples, not dataclasses: ZeRO-3's module hooks see the tensors inside tuples (and warn
# about, and skip, unknown output types)
class MaskedLMOutput(NamedTuple):
    loss: torch.Tensor | None  # mean cross-entropy over positions with label != -100
    logits: torch.Tensor  # [B, n, V], every position


class LabelledMLMOutput(NamedTuple):
    """Training-time MLM output: only the labelled positions went through the head."""

    loss: torch.Tensor  # sum of cross-entropies / loss_denominator (default: M)
    labelled_logits: torch.Tensor  # [M, V] for the M positions with label != -100, row-major
    labelled_targets: torch.Tensor  # [M] their labels


class SequenceClassifierOutput(NamedTuple):
    loss: torch.Tensor | None
    logits: torch.Tensor  # [B, num_labels]


class LinformerPreTrainedModel(nn.Module):
    """Shared init and utilities of the task models."""

    config: ModelConfig

    def _init_weights(self, module: nn.Module) -> None:
        init_weights(module, self.config.initializer_range)

    def num_parameters(self, exclude_embeddings: bool = False, trainable_only: bool = False) -> int:
        """Unique parameters (a tied or shared tensor counts once)."""
        seen, total = set(), 0
        for name, p in self.named_parameters():
            if id(p) in seen or (trainable_only and not p.requires_grad):
                continue
            seen.add(id(p))
            if exclude_embeddings and "embeddings" in name:
                continue
            total += _numel(p)
        return total

    def flops_per_token(self, seq_len: int | None = None, mlm_fraction: float = 1.0) -> float:
        return flops_per_token(self.config, seq_len, mlm_fraction)


def _numel(p: torch.Tensor) -> int:
    """Full size, also for a ZeRO-3 partitioned parameter (whose local numel is 0) and for one
    sharded over sequence-parallel ranks (``sequence_shard = (dim, full size)``)."""
    n = int(getattr(p, "ds_numel", p.numel()))
    shard = getattr(p, "sequence_shard", None)
    if shard is not None:
        dim, size = shard
        n = n // int(getattr(p, "ds_shape", p.shape)[dim]) * int(size)
    return n


class MLMHead(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.ln = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(F.gelu(self.dense(x)))
        if tracing() and self.decoder.bias is not None:  # export: the bias inside the product
            # ([h, 1] @ [W, b]^T): one MatMul writes the logits, where onnxruntime ran MatMul +
            # Add over [B, n, V] (or a Gemm whose reshaped output it copied)
            w = torch.cat([self.decoder.weight, self.decoder.bias[:, None]], dim=1)
            return torch.matmul(torch.cat([h, h.new_ones(h.shape[:-1] + (1,))], dim=-1), w.t())
        return self.decoder(h)


class ClassificationHead(nn.Module):
    """First-token head laid out as RoBERTa's ``classifier``: ``dense`` (D -> D) + tanh, dropout,
    ``out_proj`` (D -> C). ``forward(hidden [B, n, D]) -> [B, C]`` pools position 0.

    One module holds the whole head (the pooler included), so PEFT's default ``modules_to_save``
    for sequence classification (``classifier``) trains and saves all of it.
    """

    def __init__(self, hidden_size: int, num_labels: int, dropout: float):
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.drop = nn.Dropout(dropout)
        self.out_proj = nn.Linear(hidden_size, num_labels)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.drop(torch.tanh(self.dense(hidden[:, 0]))))


class LinformerForMaskedLM(LinformerPreTrainedModel):
    """Encoder + MLM head (decoder weight tied to the token embeddings).

    ``forward(input_ids, attention_mask=None, labels=None, position_ids=None)``: logits for every
    position
    ``[B, n, V]``; with labels (``-100`` = ignore) also their mean cross-entropy. Training uses
    :class:`LinformerForMaskedLMPretraining`, which runs the head on labelled positions only.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.encoder = LinformerEncoder(config)
        self.lm_head = MLMHead(config)
        self.apply(self._init_weights)
        if config.tie_word_embeddings:
            self.lm_head.decoder.weight = self.encoder.token_embeddings.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> MaskedLMOutput:
        _check_labels(labels, input_ids)
        logits = self.lm_head(self.encoder(input_ids, attention_mask, position_ids=position_ids))
        return MaskedLMOutput(
            loss=None if labels is None else mlm_loss(logits, labels), logits=logits
        )


class LinformerForMaskedLMPretraining(LinformerForMaskedLM):
    """The MLM model as pretraining runs it (same parameters and state dict as
    :class:`LinformerForMaskedLM`): the head and the softmax run only on labelled positions
    (15 % of them), which saves most of the ``V``-wide work.

    ``forward(input_ids, attention_mask, labels, loss_denominator=None, labelled_index=None)
    -> LabelledMLMOutput``; the loss is the sum of the labelled positions' cross-entropies over
    ``loss_denominator`` (default: their number; sequence parallelism passes the replica's
    global count). ``labelled_index``: :func:`labelled_positions` of ``labels``, computed by
    the caller on the host (the trainer's data pipeline does), so the forward never reads
    from the device; without it the model computes it (one device->host wait on a GPU).
    """

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        loss_denominator: torch.Tensor | None = None,
        labelled_index: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> LabelledMLMOutput:
        if labels is None:
            raise ValueError("LinformerForMaskedLMPretraining needs labels ([B, n], -100 = ignore)")
        _check_labels(labels, input_ids)
        hidden = self.encoder(input_ids, attention_mask, position_ids=position_ids)
        if labelled_index is None:
            labelled_index = labelled_positions(labels)
        elif labelled_index.dim() != 1 or labelled_index.dtype != torch.long:
            raise ValueError(
                "labelled_index must be a 1-D int64 tensor (labelled_positions(labels)), got "
                f"shape {tuple(labelled_index.shape)} dtype {labelled_index.dtype}"
            )
        # gathers with a known size: the same rows (and, backward, the same sums) as labels[sel]
        targets = labels.reshape(-1).index_select(0, labelled_index)
        logits = self.lm_head(hidden.reshape(-1, hidden.shape[-1]).index_select(0, labelled_index))
        total = F.cross_entropy(logits.float(), targets, reduction="sum")
        denom = loss_denominator if loss_denominator is not None else max(targets.numel(), 1)
        return LabelledMLMOutput(
            loss=total / denom, labelled_logits=logits, labelled_targets=targets
        )


def _check_labels(labels: torch.Tensor | None, input_ids: torch.Tensor) -> None:
    if labels is not None and labels.shape != input_ids.shape:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} does not match input_ids {tuple(input_ids.shape)}"
        )


class LinformerForSequenceClassification(LinformerPreTrainedModel):
    """Encoder + :class:`ClassificationHead` (first token): ``[B, num_labels]``."""

    def __init__(self, config: ModelConfig, problem_type: str | None = None):
        super().__init__()
        self.config = config
        self.problem_type = problem_type
        self.encoder = LinformerEncoder(config)
        p = config.classifier_dropout if config.classifier_dropout is not None else config.dropout
        self.classifier = ClassificationHead(config.hidden_size, config.num_labels, p)
        self.apply(self._init_weights)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> SequenceClassifierOutput:
        hidden = self.encoder(input_ids, attention_mask, position_ids=position_ids)
        logits = self.classifier(hidden)
        loss = None
        if labels is not None:
            loss = sequence_classification_loss(logits, labels, self.problem_type)
        return SequenceClassifierOutput(loss=loss, logits=logits)
