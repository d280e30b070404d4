"""``train.compile``: torch.compile of the model through DeepSpeed's engine, and what it cost.

:func:`compile_engine` calls ``engine.compile`` (DeepSpeed compiles the module it wraps in
place: ``nn.Module.compile``, so parameter names, checkpoints and ZeRO's hooks stay as they
are) after ``deepspeed.initialize``. Compilation itself happens at the first forward (and the
first backward); :class:`CompileReport`, a metrics sink, then reads dynamo's own counters:

- ``compile_graph_breaks``: graph breaks (dynamo's ``counters["graph_break"]``, summed);
- ``compile_graphs``: graphs compiled (recompilations for a new shape included);
- ``compile_seconds``: dynamo's and the backend's compile time, forward and backward.

A ``[compile]`` line after the first step gives the figures and each break's reason (once per
reason, also for reasons that appear later, e.g. at the first evaluation); every ``[train]``
record of metrics.jsonl carries the figures so far. ``TORCH_LOGS=graph_breaks`` shows where
in the code each break is.
"""

import re
from typing import Any

from linformer_ds.config import JobConfig
from linformer_ds.log import get_logger
from linformer_ds.metrics import Sink

log = get_logger(__name__)

# dynamo's timings (torch._dynamo.utils.compilation_time_metrics): the forward's compilation
# (tracing and the backend) and the backward's, which AOTAutograd compiles at the first backward
_COMPILE_TIMERS = ("_compile.compile_inner", "backward._backward_impl")


def compile_kwargs(cfg: JobConfig) -> dict[str, Any]:
    """torch.compile's keyword arguments from the ``train.compile_*`` fields."""
    t = cfg.train
    kwargs: dict[str, Any] = {"dynamic": t.compile_dynamic}
    if t.compile_mode is not None:
        kwargs["mode"] = t.compile_mode
    return kwargs


def compile_engine(engine: Any, cfg: JobConfig, metrics: Any) -> "CompileReport":
    """Compile ``engine``'s module when ``train.compile`` is set (after ``deepspeed.initialize``)
    and add a :class:`CompileReport` to ``metrics``' sinks; its ``log_values`` are the figures
    for the ``[train]`` records (none when compilation is off).

    Dynamo's caches and counters start empty here: the figures are this engine's (one engine
    per process; a second engine in the same process would otherwise count against the first
    one's recompilation limit)."""
    report = CompileReport(cfg, metrics.rank)
    if not report.enabled:
        return report
    import torch._dynamo  # lazy: ~1.5 s to import, only with train.compile

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch._dynamo.utils.compilation_time_metrics.clear()
    engine.compile(backend=cfg.train.compile_backend, compile_kwargs=compile_kwargs(cfg))
    metrics.sinks.append(report)
    return report


def _reason(key: str) -> str:
    """One line for dynamo's graph-break reason ``key``: its first line and its gbNNNN code."""
    first = key.strip().splitlines()[0].strip() if key.strip() else "unknown"
    code = re.search(r"\b(gb\d{4})\b", key)
    return f"{first} ({code.group(1)})" if code else first


class CompileReport(Sink):
    """Dynamo's figures for the compiled model; a ``[compile]`` line (rank 0) after the first
    optimizer step and whenever a new graph-break reason appears."""

    def __init__(self, cfg: JobConfig, rank: int):
        t = cfg.train
        self.enabled, self.rank = t.compile, rank
        self.what = f"backend={t.compile_backend} mode={t.compile_mode} dynamic={t.compile_dynamic}"
        self.shown: set = set()  # reasons already printed
        self.reported = False

    @staticmethod
    def figures() -> dict[str, float]:
        """Graph breaks, graphs and compile seconds so far (this process)."""
        from torch._dynamo.utils import compilation_time_metrics, counters  # lazy: see above

        times = compilation_time_metrics
        return {
            "compile_graph_breaks": sum(counters["graph_break"].values()),
            "compile_graphs": counters["stats"]["unique_graphs"],
            "compile_seconds": float(sum(sum(times.get(k, ())) for k in _COMPILE_TIMERS)),
        }

    @staticmethod
    def reasons() -> dict[str, int]:
        """Each graph-break reason (one line) and how many times it broke a graph."""
        from torch._dynamo.utils import counters  # lazy: see above

        out: dict[str, int] = {}
        for key, n in counters["graph_break"].items():
            out[_reason(key)] = out.get(_reason(key), 0) + n
        return out

    def log_values(self) -> dict[str, float]:
        """The figures for the ``[train]`` records (none when compilation is off)."""
        return self.figures() if self.enabled else {}

    def step_done(self, step, seconds, tokens, skipped, eta) -> None:  # noqa: ARG002
        reasons = self.reasons()
        new = {r: n for r, n in reasons.items() if r not in self.shown}
        if self.reported and not new:
            return
        self.shown.update(new)
        if self.rank != 0:
            self.reported = True
            return
        f = self.figures()
        if not self.reported:
            log.info(
                f"[compile] step {step}: {self.what} graphs={f['compile_graphs']:.0f} "
                f"graph_breaks={f['compile_graph_breaks']:.0f} "
                f"compile_s={f['compile_seconds']:.1f}"
            )
        for r, n in new.items():
            log.info(f"[compile] graph break x{n}: {r}")
        if new and not self.reported:
            log.info("[compile] TORCH_LOGS=graph_breaks shows where each break is")
        self.reported = True
