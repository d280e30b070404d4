"""The weight initialisation of every task model (project and Hugging Face classes alike)."""

import math

import torch
from torch import nn


def init_weights(module: nn.Module, std: float) -> None:
    """The initialisation of every task model (project and Hugging Face classes alike)."""
    with torch.no_grad():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding) and getattr(module, "sinusoidal_init", False):
            module.weight.copy_(sinusoidal_positions(*module.weight.shape) * (std * math.sqrt(2.0)))
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif getattr(module, "mixer_init", False):
            nn.init.normal_(module.weight, std=std)
        elif getattr(module, "projection_kind", None) is not None:  # LinearProjection, ...
            module.reset_parameters()


def sinusoidal_positions(n: int, d: int) -> torch.Tensor:
    """``[n, d]`` fp32 sin/cos table of Vaswani et al. (2017): column ``2i`` is
    ``sin(p / 10000^(2i/d))``, column ``2i+1`` its cosine; RMS over a row 1/sqrt(2)."""
    pos = torch.arange(n, dtype=torch.float64)[:, None]
    freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # [ceil(d/2)]
    table = torch.zeros(n, d, dtype=torch.float64)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq[: d // 2])
    return table.float()
