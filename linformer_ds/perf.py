"""Throughput helpers shared by the trainer and the benchmark: call timing, GEMM peak, memory."""

import resource
import time
from collections.abc import Callable
from typing import Any, Union

import torch


def time_call(fn: Callable[[], Any], device: Union[torch.device, str]) -> float:
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
    device: Union[torch.device, str] = "cpu",
    size: int = 4096,
    repeats: int = 10,
) -> float:
    """Best-of-``repeats`` TFLOP/s of one ``size^3`` matmul: the achievable peak on this device."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    c = torch.empty(size, size, device=device, dtype=dtype)
    torch.matmul(a, b, out=c)  # warm up kernels
    best = min(time_call(lambda: torch.matmul(a, b, out=c), device) for _ in range(repeats))
    return 2 * size**3 / best / 1e12


def peak_memory_bytes(device: Union[torch.device, str]) -> int:
    """Peak memory of this process: CUDA max allocated on GPU, peak RSS on CPU."""
    if str(device).startswith("cuda"):
        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
