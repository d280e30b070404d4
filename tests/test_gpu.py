"""GPU checks (``pytest -m gpu``; deselected by default, see pyproject.toml).

* bf16 forward and backward of every attention kind and sharing mode against an fp32 copy of
  the same model on the same device (loss, logits, every gradient);
* dense attention runs through a fused SDPA kernel (flash, or memory-efficient with a padding
  mask) and allocates nothing of size N x N at N = 32k (``torch.cuda.max_memory_allocated``);
* a Linformer training step's peak memory grows linearly in N.

The device is ``$LINFORMER_GPU_TEST_DEVICE`` (default ``cuda``; a missing GPU is a failure, not
a skip). ``cpu`` runs the same code at small sizes (the dry run of scripts/gpu_check.sh, in CI):
there the memory comes from the CPU allocator's profiler (``bench.model_bench.transient_peak``)
and dense uses the CPU flash kernel. Measured numbers are appended as JSON lines to
``$LINFORMER_GPU_TEST_RECORD`` when set (scripts/gpu_report.py prints them).
"""

import copy
import json
import math
import os
from typing import Any

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.model_bench import transient_peak
from linformer_ds.model import (
    SHARING_MODES,
    LinformerForMaskedLM,
    LinformerSelfAttention,
    ModelConfig,
)

pytestmark = pytest.mark.gpu

DEVICE = os.environ.get("LINFORMER_GPU_TEST_DEVICE", "cuda")
ON_GPU = DEVICE.startswith("cuda")
# Sizes: (GPU, CPU). The CPU ones keep the dry run within CI's time.
PREC = (
    dict(hidden=256, heads=4, n=1024, k=128, batch=4, vocab=4000)
    if ON_GPU
    else dict(hidden=32, heads=2, n=64, k=16, batch=2, vocab=500)
)
DENSE_N = 32768 if ON_GPU else 2048
DENSE_WIDTH = (768, 12) if ON_GPU else (64, 2)  # hidden, heads
CONTROL_N = 4096 if ON_GPU else 1024  # the unfused (math) kernel's N x N, as a control
LINEAR_NS = [4096, 8192, 16384, 32768, 65536] if ON_GPU else [512, 1024, 2048]
LINEAR_WIDTH = (768, 12, 256) if ON_GPU else (64, 4, 32)  # hidden, heads, k


@pytest.fixture(scope="module")
def device() -> torch.device:
    """The device under test; fails (not skips) when CUDA is asked for and missing."""
    if ON_GPU and not torch.cuda.is_available():
        pytest.fail(
            "pytest -m gpu needs a CUDA device (torch.cuda.is_available() is False); "
            "LINFORMER_GPU_TEST_DEVICE=cpu runs the small CPU version"
        )
    return torch.device(DEVICE)


def record(test: str, **values: Any) -> None:
    """Append one JSON line of measured numbers to $LINFORMER_GPU_TEST_RECORD (if set)."""
    path = os.environ.get("LINFORMER_GPU_TEST_RECORD")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, "device": DEVICE, **values}) + "\n")


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """||a - ref|| / ||ref|| in fp64."""
    a, ref = a.double(), ref.double()
    return float((a - ref).norm() / ref.norm().clamp_min(1e-30))


# ==================================================================== bf16 against fp32 reference
KINDS = [("linear", s) for s in SHARING_MODES] + [("conv", s) for s in SHARING_MODES]
KINDS += [("hybrid", "headwise"), ("dense", "layerwise")]


def _mlm_batch(p: dict[str, int], device: torch.device, seed: int = 0):
    """ids [B, n], attention mask [B, n] (row 0 has 1/8 padding), labels [B, n] (15 % targets)."""
    g = torch.Generator().manual_seed(seed)
    b, n = p["batch"], p["n"]
    ids = torch.randint(5, p["vocab"], (b, n), generator=g)
    mask = torch.ones(b, n, dtype=torch.long)
    mask[0, n - n // 8 :] = 0
    ids[mask == 0] = 0
    labels = torch.full_like(ids, -100)
    pick = (torch.rand(b, n, generator=g) < 0.15) & (mask == 1)
    labels[pick] = ids[pick]
    return ids.to(device), mask.to(device), labels.to(device)


@pytest.mark.parametrize("kind,sharing", KINDS, ids=[f"{k}-{s}" for k, s in KINDS])
def test_bf16_matches_fp32(device: torch.device, kind: str, sharing: str) -> None:
    """The bf16 model's loss, logits and gradients stay within bf16 rounding of fp32's."""
    p = PREC
    cfg = ModelConfig(
        vocab_size=p["vocab"],
        max_seq_len=p["n"],
        hidden_size=p["hidden"],
        num_layers=2,
        num_heads=p["heads"],
        intermediate_size=4 * p["hidden"],
        dropout=0.0,
        attention_dropout=0.0,
        projection=kind,
        sharing=sharing,
        k=p["k"],
    )
    torch.manual_seed(0)
    ref = LinformerForMaskedLM(cfg).to(device).train()
    low = copy.deepcopy(ref).to(torch.bfloat16)
    ids, mask, labels = _mlm_batch(p, device)
    out_ref = ref(ids, mask, labels=labels)
    out_ref.loss.backward()
    out_low = low(ids, mask, labels=labels)
    out_low.loss.backward()
    assert out_low.logits.dtype == torch.bfloat16
    loss_ref, loss_low = float(out_ref.loss.detach()), float(out_low.loss.detach())
    loss_err = abs(loss_low - loss_ref) / loss_ref
    logit_err = rel_err(out_low.logits.detach(), out_ref.logits.detach())
    names, g_ref, g_low = [], [], []
    for (name, a), (_, b) in zip(ref.named_parameters(), low.named_parameters()):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            assert b.grad.dtype == torch.bfloat16, name
            names.append(name)
            g_ref.append(a.grad.flatten().double())
            g_low.append(b.grad.flatten().double())
    grad_err = rel_err(torch.cat(g_low), torch.cat(g_ref))
    # Per parameter: RMS error over the RMS of ALL reference gradients (a parameter whose exact
    # gradient is ~0, e.g. a key bias under softmax, has no meaningful error of its own).
    rms_all = float(torch.cat(g_ref).norm()) / math.sqrt(sum(g.numel() for g in g_ref))
    per_param = [
        float((b - a).norm()) / math.sqrt(a.numel()) / rms_all for a, b in zip(g_ref, g_low)
    ]
    worst = max(zip(per_param, names))
    record(
        "bf16_vs_fp32",
        kind=kind,
        sharing=sharing,
        loss_fp32=loss_ref,
        loss_rel_err=loss_err,
        logits_rel_err=logit_err,
        grad_rel_err=grad_err,
        worst_param_rms_err=worst[0],
        worst_param=worst[1],
    )
    assert math.isfinite(loss_low)
    assert loss_err < 0.01, f"loss: bf16 {loss_low} vs fp32 {loss_ref}"
    assert logit_err < 0.03, f"logits rel err {logit_err:.3g}"
    assert grad_err < 0.05, f"all gradients: rel err {grad_err:.3g}"
    assert worst[0] < 0.1, f"gradient of {worst[1]}: RMS err {worst[0]:.3g} of the gradient RMS"


# ===================================================================== dense: a fused SDPA kernel
DENSE_CASES = [("flash", False, SDPBackend.FLASH_ATTENTION)]
DENSE_CASES.append(
    ("efficient", True, SDPBackend.EFFICIENT_ATTENTION)
    if ON_GPU
    else ("flash", True, SDPBackend.FLASH_ATTENTION)
)


def _attention_step_bytes(n: int, masked: bool, backend: SDPBackend, device: torch.device) -> int:
    """Transient bytes of one dense attention layer's forward + backward (bf16, batch 1, width
    DENSE_WIDTH) at length ``n``, with SDPA restricted to ``backend`` (another raises)."""
    hidden, heads = DENSE_WIDTH
    cfg = ModelConfig(
        vocab_size=100,
        max_seq_len=n,
        hidden_size=hidden,
        num_layers=1,
        num_heads=heads,
        intermediate_size=hidden,
        attention_dropout=0.0,
        projection="dense",
    )
    torch.manual_seed(0)
    attn = LinformerSelfAttention(cfg).to(device, torch.bfloat16).train()
    x = torch.randn(1, n, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    mask: torch.Tensor | None = None
    if masked:
        mask = torch.ones(1, n, dtype=torch.long, device=device)
        mask[:, n - n // 8 :] = 0
    grad_y = torch.randn(1, n, hidden, device=device, dtype=torch.bfloat16)

    def step() -> None:
        with sdpa_kernel([backend]):
            y = attn(x, mask)
        y.backward(grad_y)

    step()  # warm-up: kernel selection, workspaces, parameter gradients
    x.grad = None
    transient = transient_peak(step, device)
    assert x.grad is not None and torch.isfinite(x.grad.float()).all()
    return transient


@pytest.mark.parametrize(
    "kernel,masked,backend",
    DENSE_CASES,
    ids=[f"{k}-{'mask' if m else 'nomask'}" for k, m, _ in DENSE_CASES],
)
def test_dense_fused_no_n_squared(
    device: torch.device, kernel: str, masked: bool, backend: SDPBackend
) -> None:
    """Dense attention, forward + backward at N = 32k (GPU; 2k on CPU), bf16, through one fused
    SDPA kernel (flash; memory-efficient with a padding mask on GPU, where flash takes none):
    the extra memory is under half of ONE head's N x N score matrix on GPU (O(N D) there: q, k,
    v, output, their gradients, softmax statistics) and under one on CPU (whose flash kernel
    keeps per-thread blocks that are not negligible at N = 2k)."""
    n = DENSE_N
    hidden, heads = DENSE_WIDTH
    transient = _attention_step_bytes(n, masked, backend, device)
    one_head = n * n * 2  # bytes of ONE head's bf16 N x N matrix
    limit = one_head / 2 if ON_GPU else one_head
    record(
        "dense_fused",
        kernel=kernel,
        masked=masked,
        n=n,
        heads=heads,
        transient_bytes=transient,
        one_head_nxn_bytes=one_head,
        all_heads_nxn_bytes=heads * one_head,
        limit_bytes=limit,
    )
    assert transient < limit, (
        f"{kernel}: {transient / 2**20:.0f} MiB transient at N={n}; one head's N x N scores "
        f"are {one_head / 2**20:.0f} MiB"
    )


def test_dense_math_kernel_control(device: torch.device) -> None:
    """The control of the test above: the unfused (math) kernel does allocate every head's N x N
    scores, and the memory reading sees them (at a small N: 4k on GPU, 1k on CPU)."""
    n = CONTROL_N
    heads = DENSE_WIDTH[1]
    transient = _attention_step_bytes(n, True, SDPBackend.MATH, device)
    scores = heads * n * n * 2
    record("dense_math_control", n=n, heads=heads, transient_bytes=transient, scores_bytes=scores)
    assert transient >= scores, f"math kernel: {transient} bytes < the {scores} of its scores"


# ================================================================ Linformer: memory linear in N
def _mlm_step_bytes(cfg: ModelConfig, device: torch.device) -> int:
    """Transient bytes of one bf16 MLM forward + backward (batch 1, N = cfg.max_seq_len)."""
    torch.manual_seed(0)
    model = LinformerForMaskedLM(cfg).to(device, torch.bfloat16).train()
    ids, mask, labels = _mlm_batch(dict(batch=1, n=cfg.max_seq_len, vocab=cfg.vocab_size), device)

    def step() -> None:
        model(ids, mask, labels=labels).loss.backward()

    step()  # warm-up and gradient buffers
    model.zero_grad(set_to_none=True)
    return transient_peak(step, device)


def test_linformer_memory_linear_in_n(device: torch.device) -> None:
    """Transient memory of a Linformer (k fixed) MLM forward + backward is affine in N with a
    small constant part (residuals < 5 %), and doubling N about doubles it."""
    hidden, heads, k = LINEAR_WIDTH
    rows: list[dict[str, int]] = []
    for n in LINEAR_NS:
        cfg = ModelConfig(
            vocab_size=1000,
            max_seq_len=n,
            hidden_size=hidden,
            num_layers=2,
            num_heads=heads,
            intermediate_size=4 * hidden,
            dropout=0.0,
            attention_dropout=0.0,
            projection="linear",
            sharing="layerwise",
            k=k,
        )
        rows.append({"n": n, "transient_bytes": _mlm_step_bytes(cfg, device)})
        if ON_GPU:
            torch.cuda.empty_cache()
    ratios = [b["transient_bytes"] / a["transient_bytes"] for a, b in zip(rows, rows[1:])]
    # Affine fit mem = a + b N: linear means small residuals and a small constant part.
    ns = torch.tensor(LINEAR_NS, dtype=torch.float64)
    mem = torch.tensor([r["transient_bytes"] for r in rows], dtype=torch.float64)
    design = torch.stack([torch.ones_like(ns), ns], dim=1)
    coef = torch.linalg.lstsq(design, mem[:, None]).solution.flatten()
    residual = float(((design @ coef - mem).abs() / mem).max())
    intercept_share = float(coef[0] / mem[-1])
    record(
        "linformer_memory",
        k=k,
        hidden=hidden,
        rows=rows,
        doubling_ratios=ratios,
        bytes_per_token=float(coef[1]),
        fit_max_rel_residual=residual,
        intercept_share_at_max_n=intercept_share,
    )
    assert residual < 0.05, f"memory is not affine in N (max residual {residual:.1%}): {rows}"
    assert abs(intercept_share) < 0.1, f"constant part {intercept_share:.1%} of the largest N's"
    for (a, b), r in zip(zip(LINEAR_NS, LINEAR_NS[1:]), ratios):
        assert 1.6 < r < 2.4, f"N {a} -> {b}: memory x{r:.2f} (linear: x2)"
