"""Parameter groups and learning-rate schedules: one set of rules for pretraining and fine-tuning."""

import math
from collections.abc import Callable
from typing import Any

import torch

DECAYS = ("linear", "cosine", "constant")


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: no weight decay on biases, LayerNorm weights and position embeddings.

    Frozen parameters are left out; a parameter shared by several modules (tied embeddings,
    layerwise projections) appears once. Decided on the parameters' real shapes, so the groups
    are the same in every layout: a ZeRO-3 partitioned parameter (``zero.Init``) is a 1-D
    placeholder whose shape is ``p.ds_shape``.
    """
    decay, no_decay, seen = [], [], set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        dim = len(getattr(p, "ds_shape", p.shape))
        if dim < 2 or "position_embeddings" in name or ".ln" in name or "_ln" in name:
            no_decay.append(p)
        else:
            decay.append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def lr_lambda(
    warmup_steps: int, total_steps: int, decay: str = "linear", min_lr_ratio: float = 0.0
) -> Callable[[int], float]:
    """LR multiplier per step: linear warmup over ``warmup_steps``, then linear / cosine decay to
    ``min_lr_ratio`` at ``total_steps`` (or constant)."""
    if decay not in DECAYS:
        raise ValueError(f"decay must be one of {DECAYS}, got {decay!r}")
    warm, total, floor = int(warmup_steps), int(total_steps), float(min_lr_ratio)

    def fn(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        if decay == "constant" or total <= warm:
            return 1.0
        frac = min(1.0, (step - warm) / max(1, total - warm))
        if decay == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac))
        return floor + (1 - floor) * (1 - frac)

    return fn


def lr_scheduler(
    optimizer: torch.optim.Optimizer,
    warmup_steps: int,
    total_steps: int,
    decay: str = "linear",
    min_lr_ratio: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` over :func:`lr_lambda`."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(warmup_steps, total_steps, decay, min_lr_ratio)
    )
