"""Throughput helpers shared by the trainer and the benchmark: GEMM peak, MFU, memory."""

import resource
import time
from typing import Optional

import torch


def measure_matmul_peak_tflops(
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    size: int = 2048,
    repeats: int = 5,
) -> float:
    """Best-of-``repeats`` TFLOP/s of one ``size^3`` matmul: the achievable peak on this device."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    torch.matmul(a, b)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        torch.matmul(a, b)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best / 1e12


def sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def peak_memory_bytes(device: str) -> int:
    """Peak memory of this process: CUDA max allocated on GPU, peak RSS on CPU."""
    if str(device).startswith("cuda"):
        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def mfu(tflops_achieved: float, peak_tflops: Optional[float]) -> Optional[float]:
    return tflops_achieved / peak_tflops if peak_tflops else None
