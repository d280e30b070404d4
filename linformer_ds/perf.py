"""Throughput helpers shared by the trainer and the benchmark: call timing, GEMM peak (within a
time budget), memory, and whether this machine multiplies bf16 natively."""

import functools
import os
import resource
import time
from collections.abc import Callable
from typing import Any

import torch

from linformer_ds.model import layer_kinds


def time_call(fn: Callable[[], Any], device: torch.device | str) -> float:
    """Seconds one call of ``fn`` takes (CUDA events on GPU, perf_counter on CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure_matmul_peak_tflops(
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    size: int = 4096,
    repeats: int = 10,
    budget_s: float | None = None,
) -> float:
    """Best-of-``repeats`` TFLOP/s of one ``size^3`` matmul: the achievable peak on this device.

    With ``budget_s`` the size is at most ``size`` and small enough for the whole probe to take
    about that long (:func:`matmul_probe_size`): a CPU without native bf16 multiplies bf16
    orders of magnitude slower, where a full-size probe alone would take minutes."""
    if budget_s is not None:
        size = matmul_probe_size(dtype, device, size, budget_s / (repeats + 1))
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    c = torch.empty(size, size, device=device, dtype=dtype)
    torch.matmul(a, b, out=c)  # warm up kernels
    best = min(time_call(lambda: torch.matmul(a, b, out=c), device) for _ in range(repeats))
    return 2 * size**3 / best / 1e12


def matmul_probe_size(
    dtype: torch.dtype, device: torch.device | str, max_size: int, per_call_s: float
) -> int:
    """The largest power-of-two size from 256 up to ``max_size`` whose ``size^3`` multiply takes
    at most ``per_call_s`` (each doubling costs 8x: timed at the size below)."""
    size = min(256, max_size)
    while size * 2 <= max_size:
        a = torch.randn(size, size, device=device).to(dtype)
        torch.matmul(a, a)  # warm up kernels at this size
        if time_call(functools.partial(torch.matmul, a, a), device) * 8 > per_call_s:
            break
        size *= 2
    return size


NATIVE_BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")  # x86 AMX / AVX-512, Arm (Features)


def native_bf16(device_type: str, flags: set[str] | None = None) -> str | None:
    """Why bf16 matrix multiplies are native on this machine's ``device_type`` accelerator (the
    CPU flag, e.g. ``amx_bf16``, or the CUDA architecture, ``sm_80`` and later), or None where
    they are emulated. ``flags``: the CPU's feature flags (default: :func:`cpu_flags`)."""
    if device_type == "cuda":
        if not torch.cuda.is_available():
            return None
        # this rank's own GPU: a context the query may create is one the rank makes anyway
        local = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        major, minor = torch.cuda.get_device_capability(local)
        return f"sm_{major}{minor}" if major >= 8 else None
    if device_type != "cpu":
        return None
    flags = cpu_flags() if flags is None else flags
    return next((f for f in NATIVE_BF16_CPU_FLAGS if f in flags), None)


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The CPU's feature flags (the ``flags`` line on x86, ``Features`` on Arm); empty where
    /proc/cpuinfo is missing."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        pass
    return set()


class MemoryProbe:
    """Memory of this process: CUDA allocated on GPU, resident set (RSS) on CPU. The peak is
    never below a current value reported before it (``ru_maxrss`` lags RSS by a few pages)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._max_seen = 0

    def current(self) -> int:
        if self.device.type == "cuda":
            value = int(torch.cuda.memory_allocated(self.device))
        else:
            try:
                with open("/proc/self/statm") as f:
                    value = int(f.read().split()[1]) * resource.getpagesize()
            except (OSError, ValueError, IndexError):
                value = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
        self._max_seen = max(self._max_seen, value)
        return value

    def peak(self) -> int:
        if self.device.type == "cuda":
            value = int(torch.cuda.max_memory_allocated(self.device))
        else:
            value = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB
        return max(value, self._max_seen)


DENSE_DROPOUT_ON_CPU = (
    "model.attention_dropout > 0 with dense attention on the CPU: torch's SDPA has no fused CPU "
    "kernel with dropout and takes its math path (the N x N scores and an N x N dropout mask "
    "per head), several times slower at long N; model.attention_dropout=0 keeps the fused kernel"
)


def slow_kernels(model: Any, device: torch.device | str) -> list[str]:
    """One line per setting of ``model`` (a ModelConfig) that runs a slow kernel on ``device``:
    said once at the start of a run, never changed behind the user's back."""
    lines = []
    dense = any(kind.full_attention for kind in layer_kinds(model))
    if torch.device(device).type == "cpu" and dense and model.attention_dropout > 0:
        lines.append(DENSE_DROPOUT_ON_CPU)
    return lines
