"""The task models' losses and the labelled positions of an MLM batch (label ``-100``: none)."""

import torch
import torch.nn.functional as F


def mlm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits [..., V]`` against ``labels [...]`` (``-100`` ignored)."""
    return F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100
    )


def sequence_classification_loss(
    logits: torch.Tensor, labels: torch.Tensor, problem_type: str | None = None
) -> torch.Tensor:
    """Loss of ``logits [B, C]``: regression (C = 1 or ``problem_type='regression'``),
    multi-label (``'multi_label_classification'``, BCE) or single-label cross-entropy."""
    if logits.shape[-1] == 1 or problem_type == "regression":
        return F.mse_loss(logits.squeeze(-1).float(), labels.float())
    if problem_type == "multi_label_classification":
        return F.binary_cross_entropy_with_logits(logits.float(), labels.float())
    return F.cross_entropy(logits.float(), labels.long())


def labelled_positions(labels: torch.Tensor) -> torch.Tensor:
    """Flat row-major indices ``[M]`` (int64, ascending) of the positions of ``labels [B, n]``
    whose label is not ``-100``. Its size depends on the data: on an accelerator computing it
    waits for the device, so the trainer's data pipeline computes it on the host."""
    return torch.nonzero(labels.reshape(-1) != -100).reshape(-1)
