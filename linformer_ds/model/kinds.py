"""The built-in attention kinds, one registration each (what a kind answers: ``registry.py``).

* ``linear``: learned ``E, F [k, N_max]`` (``LinearProjection``), the paper's Linformer.
* ``conv``: Conv-Linformer's strided convolution, kernel = stride = ``N_max / k``.
* ``local``: no summaries, the sliding window alone (``model.local_window``).
* ``dynamic``: Transformer-LS's input-dependent projection.
* ``dense``: full softmax attention (``dense.py``), the baseline.
* ``routed``: content-routed block attention (``routed.py``): block summaries plus an exact
  read of the ``routed_blocks`` blocks (of ``routed_block`` tokens) each query block's scores
  pick; it retrieves.
* ``selective``: each query reads its own ``routed_blocks`` best blocks exactly, beside the
  means of the rest (``selective.py``).

A new kind is one file (its module or attention function) and one call here (or in a plugin
module: :func:`register_projection`, docs/extending.md).
"""

import math

from torch import nn

from .dense import dense_attention
from .projections import (
    ConvProjection,
    DynamicProjection,
    LinearProjection,
    LocalProjection,
)
from .registry import Config, projection_names, register_projection
from .routed import routed_attention, routed_check, routed_flops
from .selective import selective_attention, selective_check, selective_flops


def _linear(config: Config, layer_idx: int, heads: int) -> nn.Module:
    std = config.projection_init_std or 1.0 / math.sqrt(config.max_seq_len)
    return LinearProjection(
        config.k_for_layer(layer_idx), config.max_seq_len, heads, std, config.freeze_projection,
        config.projection_init,
    )  # fmt: skip


def _conv(config: Config, layer_idx: int, heads: int) -> nn.Module:
    return ConvProjection(
        config.conv_stride(layer_idx), config.head_dim, heads, config.freeze_projection,
        config.projection_init,
    )  # fmt: skip


def _conv_check(config: Config, i: int) -> str | None:
    k = config.k_for_layer(i)
    if config.max_seq_len % k:
        return (
            f"conv layer {i}: k={k} does not divide max_seq_len={config.max_seq_len} "
            "(conv kernel = stride = max_seq_len / k)"
        )
    return None


def _linear_flops(config: Config, i: int, n: int) -> float:
    k, dm = config.k_for_layer(i), config.hidden_size  # k rows even when n < k: E[:, :n] is [k, n]
    return 2 * 2 * k * dm + 2 * 2 * k * dm  # E K and F V; scores and weighted sum over k


def _dynamic_flops(config: Config, i: int, n: int) -> float:
    k, dm = config.k_for_layer(i), config.hidden_size  # scores x w, P^T K, P^T V; attention
    return 2 * k * dm * 3 + 2 * 2 * k * dm


def _conv_flops(config: Config, i: int, n: int) -> float:
    # conv: per head a d_h x d_h kernel per tap; a token is one tap of one block, so it costs
    # d_h^2 multiply-adds per head, D * d_h over all heads (for K and for V)
    dm, c = config.hidden_size, math.ceil(n / config.conv_stride(i))
    return 2 * 2 * config.head_dim * dm + 2 * 2 * c * dm


def _conv_onnx(config: Config, i: int) -> str | None:
    if config.local_window:
        return (
            "conv layers with model.local_window do not export to ONNX (torch.export cannot hold "
            "the strided blocks beside the window over a dynamic sequence axis: 'Constraints "
            "violated (seq)'); set model.local_window=0 or use linear layers"
        )
    return None


def _dynamic_onnx(config: Config, i: int) -> str | None:
    if config.local_window and config.sharing == "layerwise":
        return (
            "a layerwise-shared dynamic projection with model.local_window does not export to "
            "ONNX ('Constraints violated (seq)'); use model.sharing=headwise or no window"
        )
    return None


register_projection(
    "linear", _linear, flops=_linear_flops, sequence_parallel=True,
    num_parameters=lambda c, i: c.k_for_layer(i) * c.max_seq_len,
)  # fmt: skip
register_projection(
    "conv", _conv, stride=lambda c, i: c.conv_stride(i), stride_rule="max_seq_len / k",
    check=_conv_check, flops=_conv_flops, sequence_parallel=True, onnx=_conv_onnx,
    num_parameters=lambda c, i: c.head_dim**2 * c.conv_stride(i) + c.head_dim,
    isolation_under_sp=False,
    isolation_sp_reason="conv windows that cross a slice boundary are not implemented",
)  # fmt: skip
register_projection(
    "local", lambda c, i, h: LocalProjection(), summaries=False, needs_window=True,
    sequence_parallel=True, num_parameters=lambda c, i: 0, flops=lambda c, i, n: 0.0,
)  # fmt: skip
register_projection(
    "dynamic", lambda c, i, h: DynamicProjection(c.k_for_layer(i), c.head_dim, h),
    freezable=False, masked=True, flops=_dynamic_flops, onnx=_dynamic_onnx,
    num_parameters=lambda c, i: c.head_dim * c.k_for_layer(i),
)  # fmt: skip
register_projection(
    "dense", attend=dense_attention, summaries=False, windowed=False, full_attention=True,
    sequence_parallel=True, num_parameters=lambda c, i: 0,
)  # fmt: skip
register_projection(
    "routed", attend=routed_attention, check=routed_check, flops=routed_flops,
    num_parameters=lambda c, i: 0,
    isolation_under_sp=False, isolation_sp_reason="not implemented",
)  # fmt: skip

register_projection(
    "selective", attend=selective_attention, check=selective_check, flops=selective_flops,
    windowed=False, num_parameters=lambda c, i: 0,
    isolation_under_sp=False, isolation_sp_reason="not implemented",
)  # fmt: skip

BUILTIN_KINDS = projection_names()  # the kinds above, in registration order
