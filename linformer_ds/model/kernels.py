"""Which kernel runs softmax attention against a short key axis (Linformer's summaries).

torch's ``scaled_dot_product_attention`` (SDPA) loses on the CPU to the explicit product
``softmax(q k^T / sqrt(d)) v`` when the queries are few and the key axis short, and wins
beyond. The choice is a fixed rule, :data:`EXPLICIT_UP_TO`, measured once by
``bench/attention_kernel_bench.py`` (the table and the run in BENCHMARKS.md, "SDPA or the
explicit product"): never a timing at run time, so a run is deterministic. Both kernels compute the same attention in the inputs' dtype (bf16 or fp32)
and agree within that dtype's rounding (tests/test_attention_kernels.py).

Under sequence parallelism the rule sees the rank's slice of queries (``n``) and the gathered
key axis (``m``); under ``torch.export`` (ONNX) the length is symbolic: SDPA, whatever the
length (:data:`TRACED_KERNEL`; the explicit product's broadcasts guard a conv layer's symbolic
block count against 1, and onnxruntime ran both graphs at the same speed).
"""

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from .registry import tracing

KERNELS = ("sdpa", "explicit")
# (device type, dtype) -> ((m_max, n_max), ...) by ascending m_max: a key axis of m <= m_max
# (the first row that holds it) runs the explicit product while the query axis n <= n_max;
# beyond the last row, and on devices/dtypes not listed, SDPA. Measured with
# bench/attention_kernel_bench.py (BENCHMARKS.md, "SDPA or the explicit product").
EXPLICIT_UP_TO: dict[tuple[str, torch.dtype], tuple[tuple[int, int], ...]] = {
    ("cpu", torch.bfloat16): ((64, 2048), (128, 1024), (256, 512), (512, 256)),
    ("cpu", torch.float32): (),  # SDPA at or above the explicit product at every measured size
}
TRACED_KERNEL = "sdpa"  # torch.export / ONNX: no branch on a symbolic length
_forced: str | None = None


@contextlib.contextmanager
def attention_kernel(name: str | None) -> Iterator[None]:
    """Run every short-key attention inside with kernel ``name`` (one of :data:`KERNELS`;
    None: the rule). For benchmarks and tests."""
    global _forced
    if name is not None and name not in KERNELS:
        raise ValueError(f"attention kernel {name!r}: one of {KERNELS} or None")
    before, _forced = _forced, name
    try:
        yield
    finally:
        _forced = before


def pick_kernel(n: int, m: int, dtype: torch.dtype, device: torch.device) -> str:
    """The kernel :func:`short_attention` runs for ``n`` queries against ``m`` keys."""
    if _forced is not None:
        return _forced
    if tracing():
        return TRACED_KERNEL
    for m_max, n_max in EXPLICIT_UP_TO.get((device.type, dtype), ()):
        if m <= m_max:
            return "explicit" if n <= n_max else "sdpa"
    return "sdpa"


def explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """``softmax(q k^T / sqrt(d) + mask) v`` in the inputs' dtype, SDPA's signature (``[.., n,
    d]`` queries, ``[.., m, d]`` keys and values, a bool mask broadcasting to ``[.., n, m]``
    with at least one key per query)."""
    scores = torch.matmul(q * (1.0 / math.sqrt(q.shape[-1])), k.transpose(-1, -2))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    p = scores.softmax(dim=-1)
    if dropout_p:
        p = F.dropout(p, dropout_p)
    return torch.matmul(p, v)


def short_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Attention of ``q [.., n, d]`` against ``k, v [.., m, d]`` by the kernel
    :func:`pick_kernel` picks (SDPA's signature and results)."""
    if pick_kernel(q.shape[-2], k.shape[-2], q.dtype, q.device) == "explicit":
        return explicit_attention(q, k, v, attn_mask, dropout_p)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)
