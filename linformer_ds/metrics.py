"""Training metrics: the per-interval window (loss, MLM accuracy), throughput and MFU, elapsed
time and ETA, and the sinks: console ``[train]`` lines, ``metrics.jsonl`` and TensorBoard on
rank 0, and (``logging.prometheus_port``) a Prometheus ``/metrics`` endpoint on every rank.

The window's sums, the elapsed training time and the resume count travel in checkpoints
(:meth:`Metrics.state_dict`), so the first record after a resume averages the same steps as an
uninterrupted run would. See docs/observability.md for the Prometheus side.
"""

import json
import math
import os
import resource
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Dict, List, Optional, Tuple, TypeVar

import torch

from linformer_ds.config import ConfigError, JobConfig, to_dict
from linformer_ds.fsio import atomic_write_json

# Per-step statistics the loop accumulates (float64): sum of loss x labelled tokens, correct
# predictions, labelled tokens, non-finite micro-batches.
STAT_LOSS, STAT_CORRECT, STAT_COUNT, STAT_NONFINITE = range(4)

TARGETS_FILE = "prometheus_targets.json"  # under logging.dir: Prometheus file_sd format
STEP_SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300, 600)

T = TypeVar("T")


def step_stats(
    loss: torch.Tensor,
    logits: torch.Tensor,
    targets: torch.Tensor,
    loss_denominator: Optional[float] = None,
) -> torch.Tensor:
    """``[4]`` float64 statistics of one micro-batch (see ``STAT_*``). ``loss`` is a sum of
    cross-entropies over ``loss_denominator`` (default: the micro-batch's labelled count;
    sequence parallelism divides by the replica's count, summed over the group later)."""
    with torch.no_grad():
        n = targets.numel()
        value = float(loss.detach().float())
        finite = math.isfinite(value)
        weight = n if loss_denominator is None else float(loss_denominator)
        correct = (logits.argmax(-1) == targets).sum().item()
        return torch.tensor(
            [value * weight if finite else 0.0, correct, n, 0.0 if finite else 1.0],
            dtype=torch.float64,
        )


def format_duration(seconds: float) -> str:
    """``H:MM:SS`` (hours unbounded), e.g. 3725.2 -> ``1:02:05``; ``?`` when unknown."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class MemoryProbe:
    """Memory of this process: CUDA allocated on GPU, resident set (RSS) on CPU. The peak is
    never below a current value reported before it (``ru_maxrss`` lags RSS by a few pages)."""

    def __init__(self, device: torch.device):
        self.device = device
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


class MetricsLogger:
    """Console + TensorBoard + ``metrics.jsonl`` on rank 0 (other ranks write nothing)."""

    def __init__(self, cfg: JobConfig, rank: int):
        self.rank = rank
        self.tb = None
        self.jsonl = None
        if rank != 0:
            return
        os.makedirs(cfg.logging.dir, exist_ok=True)
        self.jsonl = open(os.path.join(cfg.logging.dir, "metrics.jsonl"), "a")
        with open(os.path.join(cfg.logging.dir, "config.json"), "w") as f:
            json.dump(to_dict(cfg), f, indent=2)
        if cfg.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(cfg.logging.dir, "tensorboard"))

    def scalars(
        self,
        step: int,
        values: Dict[str, float],
        prefix: str = "train",
        console: Optional[Dict[str, str]] = None,
    ) -> None:
        """One record: every value to jsonl and TensorBoard. On the console a key of ``console``
        shows its text instead of the number, named without its ``_s`` unit suffix."""
        if self.rank != 0:
            return
        console = console or {}
        shown = " ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in values.items()
            if k not in console
        )
        extra = "".join(f" {k.removesuffix('_s')}={v}" for k, v in console.items())
        print(f"[{prefix}] step {step} {shown}{extra}", flush=True)
        assert self.jsonl is not None
        self.jsonl.write(json.dumps({"step": step, "split": prefix, **values}) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(f"{prefix}/{k}", v, step)
            self.tb.flush()

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()


# ============================================================================= Prometheus
class _Snapshot:
    """A collector that reads another registry under a lock: a scrape sees one consistent
    state (the step, tokens and window values of the same moment), never half an update."""

    def __init__(self, registry: Any, lock: threading.Lock):
        self.registry, self.lock = registry, lock

    def describe(self) -> List[Any]:
        return []

    def collect(self) -> Iterable[Any]:
        with self.lock:
            return list(self.registry.collect())


def _gather(obj: Any, world_size: int) -> List[Any]:
    """``obj`` of every rank (all_gather_object), or ``[obj]`` outside a process group."""
    dist = torch.distributed
    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class PrometheusExporter:
    """``/metrics`` of one rank on ``logging.prometheus_port + local rank`` (0: a free port).

    Every rank serves its own endpoint: per-rank values (memory, step time, data wait,
    checkpoint I/O) stay visible without extra collectives, and a rank that hangs keeps
    answering with a step that stops moving. Collective (construction only): the ranks gather
    ``host:port`` or why the port could not be bound; any failure is a :class:`ConfigError` on
    every rank. Rank 0 writes ``logging.dir/prometheus_targets.json`` (file_sd format).
    """

    def __init__(
        self,
        cfg: JobConfig,
        rank: int,
        world_size: int,
        local_rank: int,
        memory: MemoryProbe,
        info: Dict[str, str],
    ):
        from prometheus_client import (
            CollectorRegistry,
            Counter,
            Gauge,
            Histogram,
            Info,
            ProcessCollector,
            Summary,
            start_http_server,
        )

        self.lock = threading.Lock()
        self.rank = rank
        base = cfg.logging.prometheus_port
        assert base is not None
        self.targets_path = os.path.join(cfg.logging.dir, TARGETS_FILE)
        inner = CollectorRegistry(auto_describe=True)
        names = ("job_name", "rank")
        lv = {"job_name": cfg.name, "rank": str(rank)}

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, names, registry=inner).labels(**lv)

        self.step = gauge("linformer_step", "Last completed optimizer step (continues on resume)")
        self.max_steps = gauge("linformer_max_steps", "train.max_steps")
        self.max_steps.set(cfg.train.max_steps)
        self.start_step = gauge("linformer_start_step", "Step this process started from")
        self.resumes = gauge(
            "linformer_resumes", "Times this run resumed from a checkpoint (carried in them)"
        )
        self.tokens = Counter(
            "linformer_tokens", "Tokens this rank processed (this process)", names, registry=inner
        ).labels(**lv)
        self.step_seconds = Histogram(
            "linformer_step_seconds",
            "Wall time of one optimizer step on this rank, data included",
            names,
            registry=inner,
            buckets=STEP_SECONDS_BUCKETS,
        ).labels(**lv)
        self.data_wait = Counter(
            "linformer_data_wait_seconds",
            "Time this rank waited for training batches",
            names,
            registry=inner,
        ).labels(**lv)
        self.skipped = Counter(
            "linformer_nonfinite_steps_skipped",
            "Optimizer steps skipped (non-finite loss/gradients, fp16 overflow)",
            names,
            registry=inner,
        ).labels(**lv)
        self.last_log_step = gauge(
            "linformer_last_log_step", "Step of the [train] record the window gauges hold"
        )
        self.loss = gauge("linformer_loss", "MLM loss over the last [train] window")
        self.accuracy = gauge("linformer_mlm_accuracy", "MLM accuracy over the last window")
        self.lr = gauge("linformer_learning_rate", "Learning rate at the last [train] record")
        self.grad_norm = gauge("linformer_grad_norm", "Global gradient norm at the last record")
        self.tokens_per_second = gauge(
            "linformer_tokens_per_second", "This rank's tokens/s over the last window"
        )
        self.mfu = gauge("linformer_mfu", "Model FLOPs utilisation over the last window")
        self.eval_loss = gauge("linformer_eval_loss", "Loss of the last evaluation")
        self.eval_step = gauge("linformer_eval_step", "Step of the last evaluation")
        self.elapsed = gauge("linformer_elapsed_seconds", "Training wall time up to this step")
        self.eta = gauge("linformer_eta_seconds", "Estimated seconds to train.max_steps")
        for unset in (self.loss, self.accuracy, self.lr, self.grad_norm, self.tokens_per_second):
            unset.set(math.nan)  # NaN (a gap in Grafana) until the first record
        for unset in (self.mfu, self.eval_loss, self.eta):
            unset.set(math.nan)
        self.ckpt_last = Gauge(
            "linformer_checkpoint_last_seconds",
            "Duration of the last checkpoint save/load",
            names + ("op",),
            registry=inner,
        )
        self.ckpt = Summary(
            "linformer_checkpoint_seconds",
            "Checkpoint save/load durations",
            names + ("op",),
            registry=inner,
        )
        mem = Gauge(
            "linformer_memory_bytes",
            "Memory of this rank: CUDA allocated on GPU, resident set (RSS) on CPU",
            names + ("kind",),
            registry=inner,
        )
        mem.labels(**lv, kind="current").set_function(memory.current)
        mem.labels(**lv, kind="peak").set_function(memory.peak)
        Info("linformer_run", "Static facts about the run", names, registry=inner).labels(
            **lv
        ).info(info)

        served = CollectorRegistry()
        served.register(_Snapshot(inner, self.lock))
        ProcessCollector(registry=served)

        self.httpd: Any = None
        self.thread: Optional[threading.Thread] = None
        host = socket.gethostname()
        port = 0 if base == 0 else base + local_rank
        problem = None
        if port > 65535:
            problem = f"port {base} + local rank {local_rank} is above 65535"
        else:
            try:
                self.httpd, self.thread = start_http_server(port, addr="0.0.0.0", registry=served)
                port = int(self.httpd.server_port)
            except OSError as e:
                problem = (
                    f"port {port} on {host} (rank {rank}, local rank {local_rank}) cannot be "
                    f"served: {e.strerror or e}; choose another base port, or 0 for free ports"
                )
        everyone = _gather((host, port, problem), world_size)
        failed = [p for _, _, p in everyone if p is not None]
        if failed:
            self.close(remove_targets=False)
            more = f" (and {len(failed) - 1} other rank(s))" if len(failed) > 1 else ""
            raise ConfigError(f"logging.prometheus_port: {failed[0]}{more}")
        self.endpoints = [f"{h}:{p}" for h, p, _ in everyone]
        self.port = port
        if rank == 0:
            self._write_targets(cfg)
            shown = ", ".join(f"{e} (rank {r})" for r, e in enumerate(self.endpoints[:8]))
            more = f", ... {len(self.endpoints) - 8} more" if len(self.endpoints) > 8 else ""
            print(
                f"[prometheus] /metrics on {shown}{more}; targets: {self.targets_path}",
                flush=True,
            )

    def _write_targets(self, cfg: JobConfig) -> None:
        """``[{"targets": ["host:port", ...], "labels": {...}}]``: Prometheus file_sd_configs."""
        labels = {"linformer_run": cfg.name}
        job = os.environ.get("SLURM_JOB_ID")
        if job:
            labels["slurm_job_id"] = job
        os.makedirs(cfg.logging.dir, exist_ok=True)
        atomic_write_json(
            self.targets_path, [{"targets": self.endpoints, "labels": labels}], indent=1
        )

    def close(self, remove_targets: bool = True) -> None:
        """Stop serving (the port is free when this returns); rank 0 removes the targets file."""
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            if self.thread is not None:
                self.thread.join(timeout=10)
            self.httpd = None
        if remove_targets and self.rank == 0 and os.path.isfile(self.targets_path):
            os.remove(self.targets_path)


# ============================================================================= the component
class Metrics:
    """The trainer's metrics component: accumulate steps, log every ``train.log_interval``.

    ``flops_per_token`` and ``tokens_per_step`` (all ranks together) give throughput and MFU
    against ``peak_tflops`` (per rank; measured at start when the config leaves it unset).
    The loop reports events through :meth:`timed_batch`, :meth:`step_done`,
    :meth:`checkpoint_done` and :meth:`on_resume`; with ``logging.prometheus_port`` set, each
    event also updates this rank's ``/metrics`` (see :class:`PrometheusExporter`).
    """

    def __init__(
        self,
        cfg: JobConfig,
        rank: int,
        world_size: int,
        device: torch.device,
        flops_per_token: float,
        tokens_per_step: int,
        local_rank: Optional[int] = None,
    ):
        self.cfg, self.rank, self.world, self.device = cfg, rank, world_size, device
        self.flops_per_token = flops_per_token
        self.tokens_per_step = tokens_per_step
        self.peak_tflops = cfg.train.peak_tflops or self._measure_peak()
        self.logger = MetricsLogger(cfg, rank)
        self.window = torch.zeros(4, dtype=torch.float64)
        self.first_loss: Optional[float] = None
        self.last_loss: Optional[float] = None
        self._busy, self._steps_since = 0.0, 0
        # elapsed: carried in checkpoints (time up to the saved step) + this process's time
        self._t0 = time.perf_counter()
        self._elapsed_base = 0.0
        self.resumes = 0
        self.eta = float("nan")
        self._rate_from: Optional[Tuple[int, float]] = None  # (step, time) after the 1st step
        self._first_step_seconds = float("nan")
        self.prom: Optional[PrometheusExporter] = None
        if cfg.logging.prometheus_port is not None:
            if local_rank is None:
                local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            info = {
                "world_size": str(world_size),
                "device": device.type,
                "zero_stage": str(cfg.deepspeed.zero.stage),
                "precision": cfg.deepspeed.precision,
                "memory": "cuda_allocated" if device.type == "cuda" else "rss",
            }
            self.prom = PrometheusExporter(
                cfg, rank, world_size, local_rank, MemoryProbe(device), info
            )
            self.prom.elapsed.set_function(self.elapsed)

    def _measure_peak(self) -> float:
        from linformer_ds.perf import measure_matmul_peak_tflops

        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
            self.cfg.deepspeed.precision, torch.float32
        )
        size = 2048 if self.device.type == "cpu" else 8192
        # in the run's precision, within ~3 s (bf16 without native support is ~1000x slower)
        return measure_matmul_peak_tflops(dtype, str(self.device), size, repeats=5, budget_s=3.0)

    def elapsed(self) -> float:
        """Training wall seconds: the resumed checkpoint's figure plus this process's time."""
        return self._elapsed_base + time.perf_counter() - self._t0

    # ------------------------------------------------------------------------------ events
    def timed_batch(self, next_batch: Callable[[], T]) -> T:
        """``next_batch()``, its duration counted as time waiting for data."""
        t0 = time.perf_counter()
        batch = next_batch()
        if self.prom is not None:
            with self.prom.lock:
                self.prom.data_wait.inc(time.perf_counter() - t0)
        return batch

    def step_done(
        self, step: int, stats: torch.Tensor, seconds: float, skipped: bool = False
    ) -> None:
        """Add an optimizer step's all-reduced statistics and its wall time (data included);
        ``skipped``: DeepSpeed did not apply the update (non-finite values)."""
        now = time.perf_counter()
        self.window += stats
        self._busy += seconds
        loss = float(stats[STAT_LOSS] / max(stats[STAT_COUNT], 1))
        if self.first_loss is None:
            self.first_loss = loss
        self.last_loss = loss
        self._steps_since += 1
        # ETA: mean wall time per step since the end of this process's first step (warm-up
        # excluded; evals and checkpoints included), times the steps left to train.max_steps.
        if self._rate_from is None:
            self._rate_from, self._first_step_seconds = (step, now), seconds
        s0, t0 = self._rate_from
        per_step = (now - t0) / (step - s0) if step > s0 else self._first_step_seconds
        self.eta = max(self.cfg.train.max_steps - step, 0) * per_step
        if self.prom is not None:
            p = self.prom
            with p.lock:
                p.step.set(step)
                p.tokens.inc(self.tokens_per_step / self.world)
                p.step_seconds.observe(seconds)
                if skipped:
                    p.skipped.inc()
                p.eta.set(self.eta)

    def checkpoint_done(self, op: str, seconds: float) -> None:
        """A checkpoint ``op`` ("save" or "load") took ``seconds`` on this rank."""
        if self.prom is not None:
            with self.prom.lock:
                self.prom.ckpt.labels(self.cfg.name, str(self.rank), op).observe(seconds)
                self.prom.ckpt_last.labels(self.cfg.name, str(self.rank), op).set(seconds)

    def on_resume(self, step: int, load_seconds: float) -> None:
        """The run resumed at ``step`` (after :meth:`load_state_dict`); loading took
        ``load_seconds``."""
        self.resumes += 1
        self.checkpoint_done("load", load_seconds)
        if self.prom is not None:
            with self.prom.lock:
                self.prom.step.set(step)
                self.prom.start_step.set(step)
                self.prom.resumes.set(self.resumes)

    def should_log(self, step: int) -> bool:
        return step % self.cfg.train.log_interval == 0 or step == self.cfg.train.max_steps

    def log_train(self, step: int, epoch: int, engine: Any) -> None:
        """One ``[train]`` record for the window that ends at ``step``; resets the window."""
        from linformer_ds.perf import peak_memory_bytes

        dt = self._busy
        tps = self._steps_since * self.tokens_per_step / max(dt, 1e-9)
        tflops = self.flops_per_token * tps / self.world / 1e12
        gn = engine.get_global_grad_norm()
        opt = engine.optimizer
        scale = getattr(opt, "cur_scale", None) or getattr(opt, "loss_scale", None) or 1.0
        w = self.window
        elapsed = self.elapsed()
        values = {
            "loss": float(w[STAT_LOSS] / max(w[STAT_COUNT], 1)),
            "mlm_accuracy": float(w[STAT_CORRECT] / max(w[STAT_COUNT], 1)),
            "lr": engine.get_lr()[0],
            "grad_norm": float(gn) if gn is not None else float("nan"),
            "loss_scale": float(scale),
            "tokens_per_s": tps,
            "tflops_per_rank": tflops,
            "mfu": tflops / self.peak_tflops,
            "peak_mem_gb": peak_memory_bytes(str(self.device)) / 2**30,
            "epoch": epoch,
            "elapsed_s": elapsed,
            "eta_s": self.eta,
        }
        console = {"elapsed_s": format_duration(elapsed), "eta_s": format_duration(self.eta)}
        self.logger.scalars(step, values, console=console)
        if self.prom is not None:
            p = self.prom
            with p.lock:
                p.last_log_step.set(step)
                p.loss.set(values["loss"])
                p.accuracy.set(values["mlm_accuracy"])
                p.lr.set(values["lr"])
                p.grad_norm.set(values["grad_norm"])
                p.tokens_per_second.set(tps / self.world)
                p.mfu.set(values["mfu"])
        self.window.zero_()
        self._busy, self._steps_since = 0.0, 0

    def log_eval(self, step: int, values: Dict[str, float]) -> None:
        self.logger.scalars(step, values, prefix="eval")
        if self.prom is not None:
            with self.prom.lock:
                self.prom.eval_loss.set(values["loss"])
                self.prom.eval_step.set(step)

    # ------------------------------------------------------------------------------ state
    def state_dict(self) -> Dict[str, Any]:
        """The open window's sums, elapsed seconds and resume count: saved in checkpoints so
        logs after a resume are exact."""
        return {
            "window": [float(x) for x in self.window],
            "elapsed": self.elapsed(),
            "resumes": self.resumes,
        }

    def load_state_dict(self, state: Optional[Dict[str, Any]]) -> None:
        if not state:
            return
        if "window" in state:
            self.window = torch.tensor(state["window"], dtype=torch.float64)
        self._elapsed_base = float(state.get("elapsed", 0.0))
        self.resumes = int(state.get("resumes", 0))

    def close(self) -> None:
        """Flush and close the sinks; the ``/metrics`` endpoint stops serving."""
        if self.prom is not None:
            self.prom.close()
            self.prom = None
        self.logger.close()
