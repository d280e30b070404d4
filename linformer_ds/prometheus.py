"""The Prometheus sink of the trainer's metrics: ``/metrics`` of one rank on
``logging.prometheus_port + local rank`` (0: a free port), listening on
``logging.prometheus_host`` (default 0.0.0.0: every interface). See docs/observability.md.

Every rank serves its own endpoint: per-rank values (memory, step time, data wait, checkpoint
I/O) stay visible without extra collectives, and a rank that hangs keeps answering with a step
that stops moving. Rank 0 writes ``logging.dir/prometheus_targets.json`` (file_sd format).
"""

import errno
import math
import os
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch
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

from linformer_ds.config import ConfigError, JobConfig
from linformer_ds.fsio import atomic_write_json
from linformer_ds.log import get_logger
from linformer_ds.perf import MemoryProbe

log = get_logger(__name__)

TARGETS_FILE = "prometheus_targets.json"  # under logging.dir: Prometheus file_sd format
STEP_SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300, 600)


class _Snapshot:
    """A collector that reads another registry under a lock: a scrape sees one consistent
    state (the step, tokens and window values of the same moment), never half an update."""

    def __init__(self, registry: Any, lock: threading.Lock):
        self.registry, self.lock = registry, lock

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterable[Any]:
        with self.lock:
            return list(self.registry.collect())


def _gather(obj: Any, world_size: int) -> list[Any]:
    """``obj`` of every rank (all_gather_object), or ``[obj]`` outside a process group."""
    dist = torch.distributed
    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class _Gauges:
    """The metric families of one rank's registry, labelled ``job_name`` and ``rank``."""

    def __init__(self, cfg: JobConfig, rank: int, registry: Any):

        names = ("job_name", "rank")
        self.labels = {"job_name": cfg.name, "rank": str(rank)}
        lv = self.labels

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, names, registry=registry).labels(**lv)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, names, registry=registry).labels(**lv)

        self.step = gauge("linformer_step", "Last completed optimizer step (continues on resume)")
        self.max_steps = gauge("linformer_max_steps", "train.max_steps")
        self.max_steps.set(cfg.train.max_steps)
        self.start_step = gauge("linformer_start_step", "Step this process started from")
        self.resumes = gauge(
            "linformer_resumes", "Times this run resumed from a checkpoint (carried in them)"
        )
        self.tokens = counter("linformer_tokens", "Tokens this rank processed (this process)")
        self.step_seconds = Histogram(
            "linformer_step_seconds",
            "Wall time of one optimizer step on this rank, data included",
            names,
            registry=registry,
            buckets=STEP_SECONDS_BUCKETS,
        ).labels(**lv)
        self.data_wait = counter(
            "linformer_data_wait_seconds", "Time this rank waited for training batches"
        )
        self.skipped = counter(
            "linformer_nonfinite_steps_skipped",
            "Optimizer steps skipped (non-finite loss/gradients, fp16 overflow)",
        )
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
            registry=registry,
        )
        self.ckpt = Summary(
            "linformer_checkpoint_seconds",
            "Checkpoint save/load durations",
            names + ("op",),
            registry=registry,
        )
        self.memory = Gauge(
            "linformer_memory_bytes",
            "Memory of this rank: CUDA allocated on GPU, resident set (RSS) on CPU",
            names + ("kind",),
            registry=registry,
        )
        self.info = Info("linformer_run", "Static facts about the run", names, registry=registry)
        self.info = self.info.labels(**lv)
        # a mixture (data.sources): each source's figures of the last evaluation
        self.eval_source = {
            key: Gauge(f"linformer_eval_source_{key}", f"{doc} of one source at the last "
                       "evaluation", names + ("source",), registry=registry)
            for key, doc in (("loss", "Loss"), ("perplexity", "Perplexity"),
                             ("mlm_accuracy", "MLM accuracy"))
        }  # fmt: skip
        self.share = Gauge(
            "linformer_source_share",
            "Realized share of one source in the current stage's stream",
            names + ("source",),
            registry=registry,
        )


class PrometheusSink:
    """A metrics sink (see :class:`linformer_ds.metrics.Sink`) serving this rank's ``/metrics``.

    Collective (construction only): the ranks gather ``host:port`` or why the port could not be
    bound; any failure is a :class:`ConfigError` on every rank.
    """

    def __init__(
        self,
        cfg: JobConfig,
        rank: int,
        world_size: int,
        local_rank: int,
        memory: MemoryProbe,
        elapsed: Callable[[], float],
    ):

        self.lock = threading.Lock()
        self.rank, self.world = rank, world_size
        self.targets_path = os.path.join(cfg.logging.dir, TARGETS_FILE)
        inner = CollectorRegistry(auto_describe=True)
        g = self.g = _Gauges(cfg, rank, inner)
        g.memory.labels(**g.labels, kind="current").set_function(memory.current)
        g.memory.labels(**g.labels, kind="peak").set_function(memory.peak)
        g.elapsed.set_function(elapsed)
        info = {
            "world_size": str(world_size),
            "device": memory.device.type,
            "zero_stage": str(cfg.deepspeed.zero.stage),
            "precision": cfg.deepspeed.precision,
            "memory": "cuda_allocated" if memory.device.type == "cuda" else "rss",
        }
        g.info.info(info)
        served = CollectorRegistry()
        served.register(_Snapshot(inner, self.lock))
        ProcessCollector(registry=served)
        self.httpd: Any = None
        self.thread: threading.Thread | None = None
        self._serve(cfg, local_rank, served)

    def _serve(self, cfg: JobConfig, local_rank: int, served: Any) -> None:

        base = cfg.logging.prometheus_port
        assert base is not None
        addr = cfg.logging.prometheus_host  # 0.0.0.0 (default): every interface
        host = socket.gethostname()
        port = 0 if base == 0 else base + local_rank
        where = f"(rank {self.rank}, local rank {local_rank})"
        problem = None
        if port > 65535:
            problem = (
                f"logging.prometheus_port: port {base} + local rank {local_rank} is above 65535"
            )
        else:
            try:
                self.httpd, self.thread = start_http_server(port, addr=addr, registry=served)
                port = int(self.httpd.server_port)
            except OSError as e:
                why = e.strerror or str(e)
                if e.errno in (errno.EADDRINUSE, errno.EACCES):  # the port's fault
                    problem = (
                        f"logging.prometheus_port: port {port} on {host} {where} cannot be "
                        f"served: {why}; choose another base port, or 0 for free ports"
                    )
                else:  # no such address here, a name that does not resolve
                    problem = (
                        f"logging.prometheus_host: {addr} on {host} {where} cannot be served: "
                        f"{why}; give an address of this host (0.0.0.0: every interface, "
                        "127.0.0.1: this host only)"
                    )
        # a target is how Prometheus reaches the endpoint: the node's name when every
        # interface listens, else the address it listens on
        shown = host if addr in ("0.0.0.0", "::") else f"[{addr}]" if ":" in addr else addr
        everyone = _gather((shown, port, problem), self.world)
        failed = [p for _, _, p in everyone if p is not None]
        if failed:
            self.close(remove_targets=False)
            more = f" (and {len(failed) - 1} other rank(s))" if len(failed) > 1 else ""
            raise ConfigError(f"{failed[0]}{more}")
        self.endpoints = [f"{h}:{p}" for h, p, _ in everyone]
        self.port = port
        if self.rank == 0:
            self._write_targets(cfg)
            shown = ", ".join(f"{e} (rank {r})" for r, e in enumerate(self.endpoints[:8]))
            more = f", ... {len(self.endpoints) - 8} more" if len(self.endpoints) > 8 else ""
            log.info(f"[prometheus] /metrics on {shown}{more}; targets: {self.targets_path}")

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

    # ------------------------------------------------------------------------ sink events
    def data_wait(self, seconds: float) -> None:
        with self.lock:
            self.g.data_wait.inc(seconds)

    def step_done(self, step: int, seconds: float, tokens: float, skipped: bool, eta: float):
        g = self.g
        with self.lock:
            g.step.set(step)
            g.tokens.inc(tokens)
            g.step_seconds.observe(seconds)
            if skipped:
                g.skipped.inc()
            g.eta.set(eta)

    def checkpoint_done(self, op: str, seconds: float) -> None:
        lv = self.g.labels
        with self.lock:
            self.g.ckpt.labels(lv["job_name"], lv["rank"], op).observe(seconds)
            self.g.ckpt_last.labels(lv["job_name"], lv["rank"], op).set(seconds)

    def resumed(self, step: int, resumes: int) -> None:
        with self.lock:
            self.g.step.set(step)
            self.g.start_step.set(step)
            self.g.resumes.set(resumes)

    def record(
        self, step: int, split: str, values: dict[str, float], console: dict[str, str]
    ) -> None:
        g = self.g
        with self.lock:
            if split == "eval":
                g.eval_loss.set(values["loss"])
                g.eval_step.set(step)
                for key, value in values.items():  # loss/NAME, perplexity/NAME, ...
                    figure, _, source = key.partition("/")
                    if source and figure in g.eval_source:
                        g.eval_source[figure].labels(**g.labels, source=source).set(value)
                return
            for key, value in values.items():  # share/NAME of a mixture
                if key.startswith("share/"):
                    g.share.labels(**g.labels, source=key[len("share/") :]).set(value)
            g.last_log_step.set(step)
            g.loss.set(values["loss"])
            g.accuracy.set(values["mlm_accuracy"])
            g.lr.set(values["lr"])
            g.grad_norm.set(values["grad_norm"])
            g.tokens_per_second.set(values["tokens_per_s"] / self.world)
            g.mfu.set(values["mfu"])

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
