"""Training-step time, peak memory and MFU of Linformer attention variants against dense.

``python -m bench.model_bench`` times one full MLM training step (forward, backward, AdamW)
for each attention variant (linear, conv, hybrid, dense) at each sequence length N, in one
process, alternating the variants in the inner loop so that machine drift hits all of them
alike; a row's step time is the best of its timed steps (warm-up steps excluded), since load
from other work can only add time. Model FLOP/s come from ``flops_per_token`` in
``linformer_ds/model/heads.py`` (the trainer's MFU uses the same formula); MFU is taken against the
best bf16 GEMM rate measured in the same run (before, between the lengths, and after).

Peak memory is "own persistent bytes + transient peak of one step": the bytes of the model's
parameters, optimizer state and inputs, plus the highest net allocation during a training step.
On CUDA the transient part is ``torch.cuda.max_memory_allocated`` minus the bytes allocated
before the step; on CPU it is the running total of tensor allocations that the PyTorch CPU
allocator reports to ``torch.profiler`` (``profile_memory=True``) during one step. Both count
tensor memory only (not the allocator's cache, the code, or oneDNN's private scratch buffers).

Writes ``results.json``, ``results.md``, ``time_per_token.png`` and ``peak_memory.png`` to
``--out``.
"""

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    BenchError,
    ModelSizes,
    add_size_options,
    environment,
    mlm_batch,
    model_config,
    parse_max_n,
    write_results,
)
from linformer_ds.model import LinformerForMaskedLMPretraining, flops_per_token, labelled_positions
from linformer_ds.perf import measure_matmul_peak_tflops, time_call

VARIANTS = (
    "linear",
    "conv",
    "hybrid",
    "local",
    "local_linear",
    "routed",
    "routed_b4",
    "routed_b8",
    "selective",
    "selective_b8",
    "modern",
    "dense",
)  # every --variants
# routed with its own routed blocks (model.routed_block) inside the k summary blocks: blocks of 4
# tokens reading 8 (the configuration that retrieves in docs/capability.md's induction probe) and
# blocks of 8 reading 4 (the same 32 exact keys)
ROUTED = {
    "routed_b4": {"routed_block": 4, "routed_blocks": 8},
    "routed_b8": {"routed_block": 8, "routed_blocks": 4},
}
# selective (each query reads its own best blocks exactly): blocks of N / k tokens (--k), and
# blocks of 8 tokens (k = N / 8 summaries), both reading 8 blocks
SELECTIVE_BLOCK = {"selective": None, "selective_b8": 8}
DEFAULT_VARIANTS = ("linear", "conv", "hybrid", "dense")
PRECISIONS = ("autocast", "bf16")
DEFAULT_SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384)
ADAMW = {"lr": 1e-4, "weight_decay": 0.01}


@dataclass
class BenchConfig(ModelSizes):
    """Everything one benchmark run depends on (stored in results.json); the model's sizes
    (base width by default) come from :class:`bench.common.ModelSizes`."""

    seq_lens: list[int] = field(default_factory=lambda: list(DEFAULT_SEQ_LENS))
    variants: list[str] = field(default_factory=lambda: list(DEFAULT_VARIANTS))
    batch: int = 1
    tokens: int | None = None  # if set, batch = max(1, tokens // N) at each N
    warmup: int = 1
    iters: int = 3
    precision: str = "bf16"  # bf16 params + fp32 master weights, as DeepSpeed's bf16 mode
    compile: bool = False
    mlm_fraction: float = 0.15
    max_n: dict[str, int] = field(default_factory=dict)  # per-variant largest N
    step_budget_s: float = 120.0  # a variant whose step exceeds this is not run at larger N
    device: str = "auto"
    gemm_n: int = 4096
    gemm_reps: int = 10
    seed: int = 0
    out: str = "bench/results"
    plots: bool = True

    def batch_for(self, n: int) -> int:
        """Sequences per step at length ``n``."""
        return max(1, self.tokens // n) if self.tokens is not None else self.batch

    def validate(self) -> None:
        """Raise BenchError naming the first bad option."""
        for v in self.variants:
            if v not in VARIANTS:
                raise BenchError(f"--variants: unknown variant {v!r}, choose from {VARIANTS}")
        if not self.variants:
            raise BenchError("--variants: give at least one variant")
        if not self.seq_lens:
            raise BenchError("--seq-lens: give at least one sequence length")
        for n in self.seq_lens:
            if (
                n < 1
                or n % self.k
                and any(
                    v in ("conv", "hybrid", "routed", *ROUTED, *SELECTIVE_BLOCK)
                    for v in self.variants
                )
            ):
                raise BenchError(
                    f"--seq-lens: N={n} must be >= 1 and a multiple of k={self.k} "
                    "(conv stride = N / k)"
                )
            if n < self.k:
                raise BenchError(f"--seq-lens: N={n} is smaller than k={self.k}")
        self.validate_sizes()
        for name in ("batch", "iters"):
            if getattr(self, name) < 1:
                raise BenchError(f"--{name}: must be >= 1, got {getattr(self, name)}")
        if self.tokens is not None and self.tokens < 1:
            raise BenchError(f"--tokens: must be >= 1, got {self.tokens}")
        if self.warmup < 0:
            raise BenchError(f"--warmup: must be >= 0, got {self.warmup}")
        if self.precision not in PRECISIONS:
            raise BenchError(f"--precision: must be one of {PRECISIONS}, got {self.precision!r}")
        if not 0.0 < self.mlm_fraction <= 1.0:
            raise BenchError(f"--mlm-fraction: must be in (0, 1], got {self.mlm_fraction}")
        for v in self.max_n:
            if v not in VARIANTS:
                raise BenchError(f"--max-n: unknown variant {v!r}, choose from {VARIANTS}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise BenchError(f"--device: must be auto, cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise BenchError("--device cuda: torch.cuda.is_available() is False")


def bench_model_config(bc: BenchConfig, variant: str, n: int) -> Any:
    """:func:`bench.common.model_config`, with the routed variants of :data:`ROUTED`."""
    if variant in ROUTED:
        return replace(model_config(bc, "routed", n), **ROUTED[variant])
    if variant in SELECTIVE_BLOCK:
        block = SELECTIVE_BLOCK[variant]
        cfg = model_config(bc, "selective", n)
        return cfg if block is None else replace(cfg, k=n // block)
    return model_config(bc, variant, n)


# ==================================================================================== measuring
def resolve_device(name: str) -> torch.device:
    """``auto`` means CUDA when available, else CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def measure_gemm_peak(device: torch.device, n: int = 4096, reps: int = 10) -> float:
    """Best-of-``reps`` FLOP/s of an ``n x n x n`` bf16 matrix multiply."""
    return measure_matmul_peak_tflops(torch.bfloat16, device, n, reps) * 1e12


def tensor_bytes(tensors: Iterator[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (shared or tied ones count once)."""
    seen, total = set(), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        s = t.untyped_storage()
        if s.data_ptr() in seen:
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total


def _cpu_allocation_peak(prof: torch.profiler.profile) -> int:
    """Highest running total of CPU tensor bytes allocated within a profiled window."""
    peak, stack = 0, list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        ev = stack.pop()
        stack.extend(ev.children)
        ef = ev.extra_fields
        if type(ef).__name__ == "_ExtraFields_Allocation" and ef.device.type == "cpu":
            peak = max(peak, int(ef.total_allocated))
    return peak


def transient_peak(fn: Callable[[], Any], device: torch.device) -> int:
    """Highest net bytes allocated while ``fn`` runs, above what was allocated before it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return _cpu_allocation_peak(prof)


# ===================================================================================== one model
class MasterWeightAdamW:
    """bf16 model parameters with fp32 master copies updated by AdamW (DeepSpeed's bf16 mode)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], **kw: Any):
        self.params = [p for p in params if p.requires_grad]
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.opt = _adamw(self.master, **kw)

    def step(self) -> None:
        for p, m in zip(self.params, self.master):
            m.grad = p.grad.float() if p.grad is not None else None
        self.opt.step()
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.master)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        self.opt.zero_grad(set_to_none=set_to_none)

    def state_tensors(self) -> Iterator[torch.Tensor]:
        yield from self.master
        for st in self.opt.state.values():
            yield from (v for v in st.values() if isinstance(v, torch.Tensor))


def _adamw(params: Sequence[torch.Tensor], **kw: Any) -> torch.optim.AdamW:
    """Fused AdamW where this torch has it (CPU and CUDA since 2.4), else the foreach one."""
    try:
        return torch.optim.AdamW(params, fused=True, **kw)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.AdamW(params, foreach=True, **kw)


class Trainee:
    """One model + optimizer + a fixed MLM batch; ``step()`` runs one training step."""

    def __init__(self, bc: BenchConfig, variant: str, n: int, device: torch.device):
        self.variant, self.n, self.device = variant, n, device
        self.config = bench_model_config(bc, variant, n)
        torch.manual_seed(bc.seed)
        model = LinformerForMaskedLMPretraining(self.config).to(device).train()
        self.model = model
        if bc.precision == "bf16":
            model.to(torch.bfloat16)
            self.opt: Any = MasterWeightAdamW(list(model.parameters()), **ADAMW)
            self.autocast: Callable[[], Any] = contextlib.nullcontext
        else:
            self.opt = _adamw(list(model.parameters()), **ADAMW)
            self.autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16)
        # as the trainer runs it: ids and labelled positions known on the host, so the forward
        # never reads from the device (and compiles as one graph)
        model.encoder.check_token_ids = False
        self.forward = torch.compile(model) if bc.compile else model
        batch = bc.batch_for(n)
        rows = mlm_batch(bc.vocab, batch, n, bc.mlm_fraction, seed=bc.seed + n)
        self.ids, self.labels = rows["input_ids"].to(device), rows["labels"].to(device)
        self.labelled_index = labelled_positions(rows["labels"]).to(device)
        self.mlm_fraction = int((rows["labels"][0] != -100).sum()) / n
        self.batch, self.tokens = batch, batch * n
        self.flops_per_token = flops_per_token(self.config, n, self.mlm_fraction)

    def step(self) -> float:
        """One forward + backward + AdamW step; returns the loss."""
        with self.autocast():
            loss = self.forward(
                self.ids, labels=self.labels, labelled_index=self.labelled_index
            ).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())  # also synchronises the device

    def persistent_bytes(self) -> int:
        """Parameters, optimizer state and inputs (gradients are freed between steps)."""
        opt_state: Iterator[torch.Tensor]
        if isinstance(self.opt, MasterWeightAdamW):
            opt_state = self.opt.state_tensors()
        else:
            opt_state = (
                v for st in self.opt.state.values() for v in st.values() if torch.is_tensor(v)
            )
        params = list(self.model.parameters())
        return tensor_bytes(iter(params + list(opt_state) + [self.ids, self.labels]))


# ========================================================================================== run
def run_benchmark(bc: BenchConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the grid; returns the results dict that ``write_outputs`` stores."""
    bc.validate()
    device = resolve_device(bc.device)
    log(f"device {device}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    gemm_before = measure_gemm_peak(device, bc.gemm_n, bc.gemm_reps)
    log(f"bf16 GEMM {bc.gemm_n}^3: {gemm_before / 1e12:.3f} TFLOP/s")
    rows: list[dict[str, Any]] = []
    gemm_seen = [gemm_before]
    active = list(bc.variants)
    for n in sorted(bc.seq_lens):
        runnable = [v for v in active if n <= bc.max_n.get(v, n)]
        for v in bc.variants:
            if v not in active:
                rows.append(_skipped(v, n, bc, "a shorter N took over --step-budget-s"))
            elif v not in runnable:
                rows.append(_skipped(v, n, bc, f"N > --max-n {v}={bc.max_n[v]}"))
        trainees = {}
        for v in runnable:
            t = Trainee(bc, v, n, device)
            t0 = time.perf_counter()
            for _ in range(max(bc.warmup, 1)):  # also creates the optimizer state
                loss = t.step()
            first = time.perf_counter() - t0
            if not math.isfinite(loss):
                raise RuntimeError(f"{v} N={n}: loss is {loss} after warm-up")
            trainees[v] = t
            log(f"N={n:6d} {v:7s} warm-up {first:.2f}s")
        times: dict[str, list[float]] = {v: [] for v in trainees}
        for _ in range(bc.iters):  # variants alternate so drift cancels in the ratios
            for v, t in trainees.items():
                times[v].append(time_call(t.step, device))
        # The GEMM rate under the same machine load as this N's steps (the peak is the best of
        # all of these and the ones before and after the grid).
        gemm_here = measure_gemm_peak(device, bc.gemm_n, max(2, bc.gemm_reps // 3))
        gemm_seen.append(gemm_here)
        for v, t in trainees.items():
            transient = transient_peak(t.step, device)
            rows.append(_row(t, bc, times[v], t.persistent_bytes() + transient, transient))
            r = rows[-1]
            r["gemm_flops_nearby"] = gemm_here
            log(
                f"N={n:6d} {v:7s} {r['step_s']:.3f}s/step {r['us_per_token']:.2f}us/tok "
                f"{r['model_tflops']:.3f} TFLOP/s mem {r['peak_mem_mib']:.0f} MiB"
            )
            if r["step_s"] > bc.step_budget_s:
                log(f"{v}: step {r['step_s']:.1f}s > --step-budget-s; not run at larger N")
                active.remove(v)
        del trainees
        if device.type == "cuda":
            torch.cuda.empty_cache()
    gemm_after = measure_gemm_peak(device, bc.gemm_n, bc.gemm_reps)
    peak = max(gemm_seen + [gemm_after])
    log(f"bf16 GEMM {bc.gemm_n}^3 after: {gemm_after / 1e12:.3f} TFLOP/s")
    for r in rows:
        if r["step_s"] is not None:
            r["mfu"] = r["model_tflops"] * 1e12 / peak
            r["mfu_vs_nearby_gemm"] = r["model_tflops"] * 1e12 / r["gemm_flops_nearby"]
    return {
        "config": asdict(bc),
        "environment": environment("bench.model_bench", device),
        "gemm_peak_flops": peak,
        "gemm_flops_before": gemm_before,
        "gemm_flops_after": gemm_after,
        "gemm_flops_all": gemm_seen + [gemm_after],
        "rows": rows,
        "summary": summarize(rows),
    }


def _row(
    t: Trainee, bc: BenchConfig, times: list[float], peak_mem: int, transient: int
) -> dict[str, Any]:
    step = min(times)  # best of the alternated steps: load from other work only adds time
    return {
        "variant": t.variant,
        "n": t.n,
        "batch": t.batch,
        "tokens": t.tokens,
        "step_s": step,
        "step_s_median": statistics.median(times),
        "step_s_all": times,
        "us_per_token": step / t.tokens * 1e6,
        "tokens_per_s": t.tokens / step,
        "flops_per_token": t.flops_per_token,
        "model_tflops": t.flops_per_token * t.tokens / step / 1e12,
        "mfu": None,
        "mfu_vs_nearby_gemm": None,
        "gemm_flops_nearby": None,
        "peak_mem_bytes": peak_mem,
        "peak_mem_mib": peak_mem / 2**20,
        "transient_mem_bytes": transient,
        "skipped": None,
    }


def _skipped(variant: str, n: int, bc: BenchConfig, why: str) -> dict[str, Any]:
    keys = ("step_s", "step_s_median", "step_s_all", "us_per_token", "tokens_per_s")
    keys += ("flops_per_token", "model_tflops", "mfu", "mfu_vs_nearby_gemm", "gemm_flops_nearby")
    keys += ("peak_mem_bytes", "peak_mem_mib")
    batch = bc.batch_for(n)
    row: dict[str, Any] = {"variant": variant, "n": n, "batch": batch, "tokens": batch * n}
    row.update(dict.fromkeys(keys + ("transient_mem_bytes",)))
    row["skipped"] = why
    return row


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Speed-ups over dense, linear scaling and memory growth (the issue's targets)."""
    by = {(r["variant"], r["n"]): r for r in rows if r["step_s"] is not None}
    ns = sorted({r["n"] for r in rows})
    out: dict[str, Any] = {
        "speedup_vs_dense": {},
        "flop_ratio_vs_dense": {},
        "mem_ratio_vs_dense": {},
    }
    for v in VARIANTS:
        if v == "dense":
            continue
        for n in ns:
            a, d = by.get((v, n)), by.get(("dense", n))
            if a and d:
                out["speedup_vs_dense"].setdefault(v, {})[str(n)] = d["step_s"] / a["step_s"]
                out["flop_ratio_vs_dense"].setdefault(v, {})[str(n)] = (
                    d["flops_per_token"] / a["flops_per_token"]
                )
                out["mem_ratio_vs_dense"].setdefault(v, {})[str(n)] = (
                    d["peak_mem_bytes"] / a["peak_mem_bytes"]
                )
    lin = {n: by[("linear", n)] for n in ns if ("linear", n) in by}
    if len(lin) > 1:
        n_lo, n_hi = (1024 if 1024 in lin else min(lin)), max(lin)
        out["linear_time_per_token_ratio"] = {
            "n_hi": n_hi,
            "n_lo": n_lo,
            "ratio": lin[n_hi]["us_per_token"] / lin[n_lo]["us_per_token"],
        }
        n_mid = 4096 if 4096 in lin and n_hi != 4096 else min(lin)
        out["linear_mem_ratio"] = {
            "n_hi": n_hi,
            "n_lo": n_mid,
            "ratio": lin[n_hi]["peak_mem_bytes"] / lin[n_mid]["peak_mem_bytes"],
            "n_ratio": n_hi / n_mid,
        }
    return out


# ====================================================================================== outputs
def markdown_table(results: dict[str, Any]) -> str:
    """The results as a markdown table plus the target ratios."""
    peak = results["gemm_peak_flops"]
    lines = [
        f"bf16 GEMM peak ({results['config']['gemm_n']}^3, best of run): {peak / 1e12:.3f} TFLOP/s. "
        "MFU is against that peak; the GEMM rate measured right after each N's steps shows how "
        "loaded the machine was then.",
        "",
        "| variant | N | batch | step (s) | us/token | tokens/s | model TFLOP/s | MFU "
        "| GEMM TFLOP/s at this N | peak mem (MiB) | speed-up vs dense |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    sp = results["summary"]["speedup_vs_dense"]
    for r in sorted(results["rows"], key=lambda r: (r["n"], VARIANTS.index(r["variant"]))):
        if r["step_s"] is None:
            lines.append(
                f"| {r['variant']} | {r['n']} | {r['batch']} | skipped: {r['skipped']} ||||||||"
            )
            continue
        s = sp.get(r["variant"], {}).get(str(r["n"]))
        lines.append(
            f"| {r['variant']} | {r['n']} | {r['batch']} | {r['step_s']:.3f} | {r['us_per_token']:.1f} | "
            f"{r['tokens_per_s']:.0f} | {r['model_tflops']:.3f} | {100 * r['mfu']:.1f}% | "
            f"{r['gemm_flops_nearby'] / 1e12:.3f} | "
            f"{r['peak_mem_mib']:.0f} | {'' if s is None else f'{s:.2f}x'} |"
        )
    summ = results["summary"]
    lines.append("")
    for v, by_n in summ["speedup_vs_dense"].items():
        flop = summ["flop_ratio_vs_dense"][v]
        lines.append(
            f"- {v} vs dense, speed-up (FLOP ratio): "
            + ", ".join(f"N={n} {x:.2f}x ({flop[n]:.2f})" for n, x in by_n.items())
        )
    if "linear_time_per_token_ratio" in summ:
        t, m = summ["linear_time_per_token_ratio"], summ["linear_mem_ratio"]
        lines += [
            f"- linear time/token N={t['n_hi']} / N={t['n_lo']}: {t['ratio']:.2f}",
            f"- linear peak memory N={m['n_hi']} / N={m['n_lo']}: {m['ratio']:.2f} "
            f"(N grows {m['n_ratio']:.0f}x)",
        ]
    return "\n".join(lines) + "\n"


def write_outputs(results: dict[str, Any], out: Path, plots: bool = True) -> list[Path]:
    """Write results.json, results.md and (with matplotlib) the two PNG plots."""
    written = write_results(results, out, markdown_table)
    if plots:
        written += _plots(results, out)
    return written


def _plots(results: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    env = results["environment"]
    where = env.get("gpu") or env["cpu"]
    paths = []
    for key, ylabel, name, scale in (
        ("us_per_token", "training step time per token (us)", "time_per_token.png", 1.0),
        ("peak_mem_bytes", "peak memory (MiB)", "peak_memory.png", 2.0**-20),
    ):
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        for v in VARIANTS:
            pts = sorted(
                (r["n"], r[key] * scale)
                for r in results["rows"]
                if r["variant"] == v and r[key] is not None
            )
            if pts:
                ax.plot(*zip(*pts), marker="o", label=v)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N")
        ax.set_ylabel(ylabel)
        c = results["config"]
        ax.set_title(
            f"{c['layers']} layers, d={c['hidden']}, k={c['k']}, {c['precision']}, {where}",
            fontsize=8,
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        paths.append(out / name)
    return paths


# ========================================================================================== CLI
def parse_args(argv: Sequence[str] | None = None) -> BenchConfig | Path:
    """Command line -> BenchConfig (defaults: the CPU benchmark), or the ``--replot`` folder."""
    d = BenchConfig()
    p = argparse.ArgumentParser(
        prog="python -m bench.model_bench", description=__doc__.split("\n")[0]
    )
    p.add_argument("--seq-lens", type=int, nargs="+", default=d.seq_lens)
    p.add_argument("--variants", nargs="+", default=d.variants)
    add_size_options(p, d, "batch")
    p.add_argument("--tokens", type=int, default=None, help="tokens per step (overrides --batch)")
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--iters", type=int, default=d.iters, help="timed steps per variant and N")
    p.add_argument("--precision", default=d.precision, help=f"one of {PRECISIONS}")
    p.add_argument("--compile", action="store_true", help="wrap the model in torch.compile")
    p.add_argument("--mlm-fraction", type=float, default=d.mlm_fraction)
    p.add_argument("--dropout", type=float, default=d.dropout)
    p.add_argument("--attention-dropout", type=float, default=d.attention_dropout)
    p.add_argument("--max-n", nargs="*", default=[], help="per-variant largest N, e.g. dense=8192")
    p.add_argument("--step-budget-s", type=float, default=d.step_budget_s)
    p.add_argument("--device", default=d.device, help="auto, cpu or cuda")
    p.add_argument("--gemm-n", type=int, default=d.gemm_n)
    p.add_argument("--gemm-reps", type=int, default=d.gemm_reps)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", default=d.out)
    p.add_argument("--no-plots", action="store_true")
    p.add_argument(
        "--replot", metavar="DIR", help="only rewrite results.md and the PNGs from DIR/results.json"
    )
    a = p.parse_args(argv)
    if a.replot:
        return Path(a.replot)
    given = {k: v for k, v in vars(a).items() if k not in ("max_n", "no_plots", "replot")}
    bc = BenchConfig(**given, max_n=parse_max_n(a.max_n), plots=not a.no_plots)
    bc.validate()
    return bc


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m bench.model_bench``."""
    try:
        bc = parse_args(argv)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if isinstance(bc, Path):
        src = bc / "results.json"
        if not src.is_file():
            print(f"error: --replot: {src} does not exist", file=sys.stderr)
            return 2
        results = json.loads(src.read_text())
        for path in write_outputs(results, bc, plots=True)[1:]:
            print(f"wrote {path}")
        return 0
    results = run_benchmark(bc)
    for path in write_outputs(results, Path(bc.out), bc.plots):
        print(f"wrote {path}")
    print(markdown_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
