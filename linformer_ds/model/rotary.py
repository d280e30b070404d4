"""Rotary positions (RoFormer, Su et al. 2021) on the queries and keys of exact attention:
dense layers and windows; projected summaries see unrotated keys (E/F columns are positional
already)."""

import torch


def rotary_tables(
    positions: torch.Tensor, head_dim: int, base: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``positions [n]`` or ``[B, n]`` -> ``cos, sin [B or 1, n, 1, head_dim / 2]`` (fp32)."""
    inv = base ** (-torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    angles = positions.float()[..., None] * inv  # [.., n, d/2]
    if angles.dim() == 2:
        angles = angles[None]
    return angles.cos()[:, :, None], angles.sin()[:, :, None]


def rotate(x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """RoPE of ``x [B, n, h, d]`` (halves rotated as pairs, GPT-NeoX layout), in fp32."""
    cos, sin = rotary
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
