"""Per-op profile of one bf16 training step: where the time goes besides the GEMMs.

``python -m bench.profile_step`` runs ``torch.profiler`` over training steps of

* ``equal-work``: :class:`LinformerForMaskedLM` with logits for every position and the mean
  cross-entropy of the labelled ones (``bench.peer_bench``'s ``ours``), bf16 parameters with
  fp32 master weights and torch's fused AdamW per parameter
  (:class:`bench.model_bench.MasterWeightAdamW`);
* ``trainer``: :class:`LinformerForMaskedLMPretraining` (the head on the labelled positions,
  their indices computed on the host) through the trainer's own DeepSpeed engine
  (``deepspeed.initialize`` with the trainer's JSON, ZeRO ``--zero``, bf16, one rank): the
  optimizer is what ``linformer_ds/ds_config.py`` asks DeepSpeed for (torch's AdamW over
  DeepSpeed's flat fp32 partition), plus ``--ds-extra`` settings (e.g. ``fused=true``).

Every profiled step is split into ``forward``, ``backward`` and ``optimizer`` (record_function
ranges; an op belongs to the range its start falls in). Each op's **self** CPU time goes to one
category (:func:`category`): GEMM, SDPA attention kernel, softmax, cross-entropy, layer norm,
GELU, dtype casts/copies, optimizer math, embedding, other. The time no op accounts for (Python,
DeepSpeed's bookkeeping between ops) is ``unattributed``. GEMM FLOPs come from the profiler
(``with_flops``): their rate against the best bf16 GEMM probed in the run says how close the
GEMMs themselves run to the peak.

Writes ``results.json`` and ``results.md`` (one table per path and N) to ``--out``.
"""

import argparse
import contextlib
import json
import os
import socket
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from bench.common import (
    BenchError,
    ModelSizes,
    add_size_options,
    environment,
    job_config,
    mlm_batch,
    write_results,
)
from bench.model_bench import ADAMW, MasterWeightAdamW
from bench.peer_bench import full_logits_loss
from linformer_ds.ds_config import merge_extra
from linformer_ds.engine import import_muon_lazily
from linformer_ds.model import (
    LinformerForMaskedLM,
    LinformerForMaskedLMPretraining,
    ModelConfig,
    flops_per_token,
    labelled_positions,
)
from linformer_ds.perf import measure_matmul_peak_tflops

PATHS = ("equal-work", "trainer")
PHASES = ("forward", "backward", "optimizer")
CATEGORIES = (
    "GEMM (mm/addmm/bmm/matmul/linear)",
    "attention kernel (SDPA flash, fwd/bwd)",
    "softmax",
    "cross-entropy (log_softmax, nll)",
    "layer_norm",
    "gelu",
    "dtype casts / copies (to, _to_copy, copy_)",
    "optimizer math (AdamW, grad norm, clipping)",
    "embedding",
    "other ops",
    "unattributed (Python, framework between ops)",
)
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear",
            "aten::baddbmm", "aten::addbmm", "aten::einsum", "aten::addmv", "aten::mv"}  # fmt: skip
CAST_OPS = {"aten::to", "aten::_to_copy", "aten::copy_", "aten::_foreach_copy_"}
MARK = "profile_step::"  # prefix of our record_function ranges


@dataclass
class ProfileConfig(ModelSizes):
    """Everything one run depends on (stored in results.json)."""

    seq_lens: list[int] = field(default_factory=lambda: [4096])
    paths: list[str] = field(default_factory=lambda: list(PATHS))
    sharing: str = "layerwise"
    dropout: float = 0.0
    batch: int = 1
    warmup: int = 1
    timed: int = 5
    iters: int = 2
    mlm_fraction: float = 0.15
    zero: int = 2
    ds_extra: list[str] = field(default_factory=list)
    gemm_n: int = 4096
    gemm_budget_s: float = 10.0
    beside: str = ""
    seed: int = 0
    out: str = "bench/results/profile_step"

    def validate(self) -> None:
        """Raise BenchError naming the first bad option."""
        self.validate_sizes()
        if not self.paths or any(p not in PATHS for p in self.paths):
            raise BenchError(f"--paths: choose one or more of {PATHS}, got {self.paths}")
        if not self.seq_lens or any(n < self.k for n in self.seq_lens):
            raise BenchError(f"--seq-lens: give lengths >= k={self.k}, got {self.seq_lens}")
        if self.iters < 1 or self.warmup < 0 or self.timed < 1:
            raise BenchError("--iters and --timed must be >= 1 and --warmup >= 0")
        for item in self.ds_extra:
            if "=" not in item:
                raise BenchError(f"--ds-extra: expected KEY=VALUE, got {item!r}")


def model_config(pc: ProfileConfig, n: int) -> ModelConfig:
    """The profiled model: linear projection in every layer, ``pc.sharing``, pre-LN."""
    return ModelConfig(
        vocab_size=pc.vocab, max_seq_len=n, hidden_size=pc.hidden, num_layers=pc.layers,
        num_heads=pc.heads, intermediate_size=pc.intermediate, dropout=pc.dropout,
        attention_dropout=0.0, projection="linear", k=pc.k, sharing=pc.sharing,
    )  # fmt: skip


def category(name: str, phase: str) -> str:
    """The category of an op (its profiler name) run in ``phase``."""
    if name in CAST_OPS:
        return CATEGORIES[6]
    if phase == "optimizer":
        return CATEGORIES[7]
    if name in GEMM_OPS:
        return CATEGORIES[0]
    if "scaled_dot_product" in name or "flash_attention" in name:
        return CATEGORIES[1]
    if "log_softmax" in name or "nll_loss" in name or "cross_entropy" in name:
        return CATEGORIES[3]
    if "softmax" in name:
        return CATEGORIES[2]
    if "layer_norm" in name:
        return CATEGORIES[4]
    if "gelu" in name:
        return CATEGORIES[5]
    if "embedding" in name:
        return CATEGORIES[8]
    return CATEGORIES[9]


# ======================================================================================= steps
class EqualWorkStep:
    """Full logits + mean CE of the labelled positions, bf16 + fp32 master AdamW (peer_bench)."""

    def __init__(self, pc: ProfileConfig, n: int):
        torch.manual_seed(pc.seed)
        self.config = model_config(pc, n)
        self.model = LinformerForMaskedLM(self.config).train()
        params = list(self.model.parameters())
        self.model.to(torch.bfloat16)
        self.opt = MasterWeightAdamW(params, **ADAMW)
        rows = mlm_batch(pc.vocab, pc.batch, n, pc.mlm_fraction, seed=pc.seed + n)
        self.ids, self.labels = rows["input_ids"], rows["labels"]
        self.flops_per_token = flops_per_token(self.config, n, 1.0)

    def forward(self) -> torch.Tensor:
        return full_logits_loss(self.model(self.ids).logits, self.labels)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def optimizer(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def close(self) -> None:
        del self.model, self.opt


def _init_one_rank() -> None:
    """torch.distributed with one gloo rank on a free local port (for deepspeed.initialize)."""
    import deepspeed

    from linformer_ds.dist_env import disable_deepspeed_shm_allreduce

    if torch.distributed.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    disable_deepspeed_shm_allreduce()
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class TrainerStep:
    """The trainer's step: its model, its DeepSpeed JSON and engine (one rank)."""

    def __init__(self, pc: ProfileConfig, n: int):
        import deepspeed

        from bench.common import deepspeed_json
        from linformer_ds.optim import param_groups

        _init_one_rank()
        torch.manual_seed(pc.seed)
        self.config = model_config(pc, n)
        job = job_config(self.config, pc.zero, "bf16")
        model = LinformerForMaskedLMPretraining(job.model)
        model.encoder.check_token_ids = False  # the trainer checks ids on the host
        extra: dict[str, Any] = {}
        for item in pc.ds_extra:  # e.g. optimizer.params.fused=true
            key, _, value = item.partition("=")
            node = extra
            *parents, leaf = key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = _parse_value(value)
        # merged as the trainer merges deepspeed.extra (torch_adam=false drops `fused`)
        ds = merge_extra(deepspeed_json(job, world_size=1), extra)
        self.ds_config = ds
        params = param_groups(model, job.optimizer.weight_decay)
        import_muon_lazily()  # as the trainer: no inductor import for DeepSpeed's Muon
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=ds)
        self.optimizer_class = type(self.engine.optimizer).__name__
        inner = getattr(self.engine.optimizer, "optimizer", None)
        self.inner_optimizer = None if inner is None else type(inner).__name__
        self.inner_defaults = {
            k: v for k, v in getattr(inner, "defaults", {}).items() if k in ("foreach", "fused")
        }
        rows = mlm_batch(pc.vocab, pc.batch, n, pc.mlm_fraction, seed=pc.seed + n)
        self.ids, self.mask, self.labels = rows["input_ids"], rows["attention_mask"], rows["labels"]
        self.labelled_index = labelled_positions(self.labels)
        frac = int((self.labels != -100).sum()) / self.labels.numel()
        self.flops_per_token = flops_per_token(self.config, n, frac)

    def forward(self) -> torch.Tensor:
        return self.engine(
            self.ids, self.mask, labels=self.labels, labelled_index=self.labelled_index
        ).loss

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def optimizer(self) -> None:
        self.engine.step()

    def close(self) -> None:
        self.engine.destroy()
        del self.engine


def build_step(path: str, pc: ProfileConfig, n: int) -> Any:
    return EqualWorkStep(pc, n) if path == "equal-work" else TrainerStep(pc, n)


def run_step(step: Any, mark: Callable[[str], Any]) -> dict[str, float]:
    """One training step, each phase inside ``mark(phase)``; wall seconds per phase."""
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    with mark("forward"):
        loss = step.forward()
    t1 = time.perf_counter()
    with mark("backward"):
        step.backward(loss)
    t2 = time.perf_counter()
    with mark("optimizer"):
        step.optimizer()
    t3 = time.perf_counter()
    out.update(forward=t1 - t0, backward=t2 - t1, optimizer=t3 - t2, total=t3 - t0)
    return out


# ===================================================================================== analysis
def breakdown(events: Sequence[Any]) -> tuple[dict[str, dict[str, float]], dict[str, Any]]:
    """Self CPU seconds per (category, phase) of the profiled ``events`` (the main thread's ops,
    each in the phase its start falls in), and per-op totals, the phases' wall time and the
    GEMM FLOPs."""
    ranges = [(e.time_range.start, e.time_range.end, e.name[len(MARK) :])
              for e in events if e.name.startswith(MARK)]  # fmt: skip
    table: dict[str, dict[str, float]] = {c: defaultdict(float) for c in CATEGORIES}
    per_op: dict[str, float] = defaultdict(float)
    phase_wall: dict[str, float] = defaultdict(float)
    gemm_flops = 0.0
    for start, end, phase in ranges:
        phase_wall[phase] += (end - start) / 1e6
    for e in events:
        if e.name.startswith(MARK):
            continue
        start = e.time_range.start
        phase = next((p for s, t, p in ranges if s <= start < t), None)
        if phase is None:  # outside the step (profiler start/stop)
            continue
        cat = category(e.name, phase)
        self_s = e.self_cpu_time_total / 1e6
        table[cat][phase] += self_s
        per_op[f"{phase} {e.name}"] += self_s
        if cat == CATEGORIES[0]:
            gemm_flops += getattr(e, "flops", 0) or 0
    attributed = {p: sum(table[c][p] for c in CATEGORIES) for p in PHASES}
    for p in PHASES:
        table[CATEGORIES[10]][p] = max(phase_wall[p] - attributed[p], 0.0)
    extra = {
        "phase_wall_s": dict(phase_wall),
        "gemm_flops": gemm_flops,
        "top_ops": sorted(per_op.items(), key=lambda kv: -kv[1])[:25],
    }
    return {c: dict(v) for c, v in table.items()}, extra


def profile_path(
    pc: ProfileConfig, path: str, n: int, log: Callable[[str], None]
) -> dict[str, Any]:
    """Build ``path`` at ``n``, run ``warmup`` steps, time ``timed`` steps without the profiler
    (the step time and MFU: the profiler stretches the trainer step, by 7-9 % at 4,096 and some
    20 % at 16,384 on a 2-core EPYC), then profile ``iters`` steps (the shares)."""
    load_before = os.getloadavg()
    step = build_step(path, pc, n)
    plain = contextlib.nullcontext
    for _ in range(pc.warmup):
        run_step(step, lambda _: plain())
    timed = [run_step(step, lambda _: plain())["total"] for _ in range(pc.timed)]
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        walls = [run_step(step, lambda p: record_function(MARK + p)) for _ in range(pc.iters)]
    table, extra = breakdown(prof.events())
    info: dict[str, Any] = {}
    if isinstance(step, TrainerStep):
        info = {
            "engine_optimizer": step.optimizer_class,
            "inner_optimizer": step.inner_optimizer,
            "inner_defaults": step.inner_defaults,
            "ds_optimizer": step.ds_config.get("optimizer"),
            "zero_stage": pc.zero,
        }
    fpt = step.flops_per_token
    step.close()
    per_step = {c: {p: v / pc.iters for p, v in ph.items()} for c, ph in table.items()}
    wall = statistics.median(w["total"] for w in walls)
    row = {
        "path": path,
        "n": n,
        "iters": pc.iters,
        "self_s_per_step": per_step,
        "phase_wall_s_per_step": {p: v / pc.iters for p, v in extra["phase_wall_s"].items()},
        "step_wall_s": statistics.median(timed),
        "step_wall_s_timed": timed,
        "step_wall_s_profiled": wall,
        "gemm_flops_per_step": extra["gemm_flops"] / pc.iters,
        "model_flops_per_step": fpt * pc.batch * n,
        "top_ops_s_per_step": [(k, v / pc.iters) for k, v in extra["top_ops"]],
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),
        **info,
    }
    gemm_s = sum(per_step[CATEGORIES[0]].values())
    log(f"{path} N={n}: step {row['step_wall_s']:.3f} s (profiled {wall:.3f} s), GEMM self "
        f"{gemm_s:.3f} s "
        f"({gemm_s / max(wall, 1e-9) * 100:.0f} %)")  # fmt: skip
    return row


def run_profile(pc: ProfileConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    pc.validate()
    env = environment("bench.profile_step", torch.device("cpu"))
    env["beside"] = pc.beside
    peaks = [
        measure_matmul_peak_tflops(torch.bfloat16, "cpu", pc.gemm_n, budget_s=pc.gemm_budget_s)
    ]
    log(f"bf16 GEMM peak {peaks[0]:.3f} TFLOP/s")
    rows = [profile_path(pc, path, n, log) for n in pc.seq_lens for path in pc.paths]
    peaks.append(
        measure_matmul_peak_tflops(torch.bfloat16, "cpu", pc.gemm_n, budget_s=pc.gemm_budget_s)
    )
    env["load_avg_end"] = os.getloadavg()
    return {"config": asdict(pc), "environment": env, "gemm_peak_tflops": max(peaks),
            "gemm_peak_tflops_all": peaks, "rows": rows}  # fmt: skip


def _load(x: Sequence[float]) -> str:
    return "/".join(f"{v:.1f}" for v in x)


def markdown(results: dict[str, Any]) -> str:
    """One table per (path, N): self CPU ms per step by category x phase, and the share."""
    c, env = results["config"], results["environment"]
    lines = [
        f"{c['layers']} layers, d={c['hidden']}, {c['heads']} heads, k={c['k']}, FFN "
        f"{c['intermediate']}, V={c['vocab']}, sharing {c['sharing']}, bf16, batch {c['batch']}; "
        f"{env['cpu']} ({env['cpu_count']} CPUs, {env['torch_threads']} threads), torch "
        f"{env['torch']}, deepspeed {env.get('deepspeed')}; {c['warmup']} warm-up, "
        f"{c.get('timed', 0)} timed steps without the profiler (step time, MFU), then "
        f"{c['iters']} profiled steps (self CPU time per step); bf16 GEMM peak "
        f"{results['gemm_peak_tflops']:.2f} TFLOP/s; load average {_load(env['load_avg_start'])} "
        f"at start, {_load(env['load_avg_end'])} at end; beside: {env.get('beside') or '-'}",
        "",
    ]
    for r in results["rows"]:
        t = r["self_s_per_step"]
        total = sum(sum(ph.values()) for ph in t.values())
        gemm_s = sum(t[CATEGORIES[0]].values())
        rate = r["gemm_flops_per_step"] / max(gemm_s, 1e-9) / 1e12
        frac = rate / max(results["gemm_peak_tflops"], 1e-12)
        # a loaded machine starves the short probe more than the long step: no fraction then
        share = f"{frac * 100:.0f} % of the probed peak" if frac <= 1 else "probe invalid: load"
        opt = ""
        if "inner_optimizer" in r:
            opt = (f"; DeepSpeed ZeRO-{r['zero_stage']} {r['engine_optimizer']} over torch "
                   f"{r['inner_optimizer']} {r['inner_defaults']}")  # fmt: skip
        mfu = ""
        if "step_wall_s" in r:
            rate_step = r["model_flops_per_step"] / r["step_wall_s"] / 1e12
            mfu = (f"step {r['step_wall_s']:.3f} s (median of {len(r['step_wall_s_timed'])} "
                   f"unprofiled), model FLOPs / step time {rate_step:.3f} TFLOP/s = **MFU "
                   f"{rate_step / results['gemm_peak_tflops'] * 100:.1f} %** of the probed peak; ")  # fmt: skip
        lines += [
            f"**{r['path']}, N = {r['n']}**: {mfu}profiled step {r['step_wall_s_profiled']:.3f} s "
            f"(median); GEMMs {rate:.3f} TFLOP/s while they run ({share}); load "
            f"{_load(r['load_avg_before'])} -> {_load(r['load_avg_after'])}{opt}",
            "",
            "| category | forward (ms) | backward (ms) | optimizer (ms) | total (ms) | share |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for cat in CATEGORIES:
            ph = t[cat]
            tot = sum(ph.values())
            cells = " | ".join(f"{ph.get(p, 0.0) * 1e3:.0f}" for p in PHASES)
            lines.append(
                f"| {cat} | {cells} | {tot * 1e3:.0f} | {tot / max(total, 1e-9) * 100:.1f} % |"
            )
        sums = " | ".join(f"{sum(t[c].get(p, 0.0) for c in CATEGORIES) * 1e3:.0f}" for p in PHASES)
        lines += [f"| **all** | {sums} | {total * 1e3:.0f} | 100 % |", ""]
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> ProfileConfig:
    d = ProfileConfig()
    p = argparse.ArgumentParser(
        prog="python -m bench.profile_step", description=__doc__.split("\n")[0]
    )
    p.add_argument("--seq-lens", type=int, nargs="+", default=d.seq_lens)
    p.add_argument("--paths", nargs="+", default=d.paths, help=f"some of {PATHS}")
    p.add_argument("--sharing", default=d.sharing)
    add_size_options(p, d, "batch", "zero")
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--timed", type=int, default=d.timed, help="unprofiled timed steps")
    p.add_argument("--iters", type=int, default=d.iters, help="profiled steps")
    p.add_argument("--mlm-fraction", type=float, default=d.mlm_fraction)
    p.add_argument(
        "--ds-extra", nargs="*", default=d.ds_extra,
        help="KEY=VALUE into the trainer's DeepSpeed JSON, e.g. optimizer.params.fused=true",
    )  # fmt: skip
    p.add_argument("--gemm-n", type=int, default=d.gemm_n)
    p.add_argument("--gemm-budget-s", type=float, default=d.gemm_budget_s)
    p.add_argument("--beside", default=d.beside, help="what else ran on the machine (recorded)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", default=d.out)
    pc = ProfileConfig(**vars(p.parse_args(argv)))
    pc.validate()
    return pc


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m bench.profile_step``."""
    try:
        pc = parse_args(argv)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results = run_profile(pc)
    for path in write_results(results, Path(pc.out), markdown):
        print(f"wrote {path}")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
