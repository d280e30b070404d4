"""The FLOP formula behind MFU (``model.flops_per_token``) against torch's own counter.

``torch.utils.flop_counter.FlopCounterMode`` counts the matrix multiplies of a real forward
pass; attention runs on SDPA's math backend so that its two batched products are counted too
(the fused CPU kernel is not). Issue 14 suspected the conv term (``2 * 2 * h * D``) to count
``h`` heads instead of a ``d_h x d_h`` kernel per head; ``h`` there is the head width, and the
measurement agrees with the formula.
"""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from linformer_ds.model import ConvProjection, LinformerForMaskedLM, ModelConfig, flops_per_token

B, N = 2, 64


def _forward_flops(module: torch.nn.Module, *args: torch.Tensor) -> float:
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        module(*args)
    return float(fc.get_total_flops())


@pytest.mark.parametrize("heads", [1, 4])
def test_conv_projection_costs_d_times_head_dim_per_token(heads):
    """One strided conv over ``[B, n, H, d_h]``: 2 * D * d_h FLOPs per token (kernel shared
    across heads or one per head: the same work)."""
    d_h, h, r = 16, 4, 4
    conv = ConvProjection(r, d_h, heads, frozen=False)
    measured = _forward_flops(conv, torch.randn(B, N, h, d_h)) / (B * N)
    assert measured == 2 * (h * d_h) * d_h  # 2048; counting h * D would give 512


@pytest.mark.parametrize("projection", ["linear", "conv", "dense", "hybrid"])
@pytest.mark.parametrize("sharing", ["headwise", "layerwise"])
def test_flops_per_token_equals_counted_forward(projection, sharing):
    """The whole MLM forward (head on every position): formula / 3 == counted FLOPs exactly."""
    cfg = ModelConfig(
        vocab_size=300, max_seq_len=N, hidden_size=64, num_layers=2, num_heads=4,
        intermediate_size=128, k=16, projection=projection, sharing=sharing, dropout=0.0,
        attention_dropout=0.0,
    )  # fmt: skip
    model = LinformerForMaskedLM(cfg).eval()
    measured = _forward_flops(model, torch.randint(5, 300, (B, N))) / (B * N)
    assert measured == flops_per_token(cfg, N, mlm_fraction=1.0) / 3
