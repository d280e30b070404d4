"""Training metrics: the per-interval window (loss, MLM accuracy), throughput and MFU, elapsed
time and ETA, written to sinks: console ``[train]`` lines, ``metrics.jsonl`` and TensorBoard on
rank 0, and (``logging.prometheus_port``) a Prometheus ``/metrics`` endpoint on every rank
(linformer_ds.prometheus).

The window's sums, the elapsed training time and the resume count travel in checkpoints
(:meth:`Metrics.state_dict`), so the first record after a resume averages the same steps as an
uninterrupted run would. See docs/observability.md for the Prometheus side.
"""

import contextlib
import errno
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from linformer_ds.config import ConfigError, JobConfig
from linformer_ds.errors import LinformerError
from linformer_ds.log import get_logger
from linformer_ds.perf import MemoryProbe, measure_matmul_peak_tflops
from linformer_ds.prometheus import PrometheusSink
from linformer_ds.trackers import TRACKERS

log = get_logger(__name__)

# Per-step statistics the loop accumulates (float64, on the device): sum of loss x labelled
# tokens, correct predictions, labelled tokens, non-finite micro-batches.
STAT_LOSS, STAT_CORRECT, STAT_COUNT, STAT_NONFINITE = range(4)
NUM_STATS = 4
STAT_STOP = NUM_STATS  # the trainer's reduced step record: the statistics, then the stop flag

T = TypeVar("T")


def top1(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest logit (the first of equal maxima), as ``argmax(-1)``:
    torch's CPU ``argmax`` kernel is several times slower than ``max`` over an ``[M, vocab]``
    block (``bench/probes/top1_probe.py``), and the trainer takes it every micro-batch."""
    return logits.max(-1).indices


def step_stats(
    loss: torch.Tensor,
    logits: torch.Tensor,
    targets: torch.Tensor,
    loss_denominator: Any | None = None,
) -> torch.Tensor:
    """``[4]`` float64 statistics of one micro-batch (see ``STAT_*``), on the loss's device and
    without reading anything to the host. ``loss`` is a sum of cross-entropies over
    ``loss_denominator`` (default: the micro-batch's labelled count; a number or a scalar
    tensor when it is a count over several ranks or micro-batches)."""
    with torch.no_grad():
        n = targets.numel()
        value = loss.detach().float().double()
        weight = n if loss_denominator is None else loss_denominator
        if isinstance(weight, torch.Tensor):
            weight = weight.detach().double()
        finite = torch.isfinite(value)
        return torch.stack(
            [
                torch.where(finite, value * weight, torch.zeros_like(value)),
                (top1(logits) == targets).sum().double(),
                torch.full_like(value, float(n)),
                (~finite).double(),
            ]
        )


def format_duration(seconds: float) -> str:
    """``H:MM:SS`` (hours unbounded), e.g. 3725.2 -> ``1:02:05``; ``?`` when unknown."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


# ============================================================================= sinks
class Sink:
    """Where metrics go. A sink implements the events it cares about; the rest are no-ops."""

    def record(
        self, step: int, split: str, values: dict[str, float], console: dict[str, str]
    ) -> None:
        """One ``[train]`` or ``[eval]`` record (``console``: text shown instead of numbers)."""

    def data_wait(self, seconds: float) -> None:
        """This rank waited ``seconds`` for a training batch."""

    def step_done(self, step: int, seconds: float, tokens: float, skipped: bool, eta: float):
        """Optimizer step ``step`` took ``seconds``; this rank processed ``tokens``."""

    def checkpoint_done(self, op: str, seconds: float) -> None:
        """A checkpoint ``op`` ("save" or "load") took ``seconds`` on this rank."""

    def resumed(self, step: int, resumes: int) -> None:
        """The run resumed at ``step`` (the ``resumes``-th time)."""

    def close(self) -> None:
        """Flush and release what the sink holds."""

    def state_dict(self) -> dict[str, Any]:
        """What a ``logging.sinks`` sink keeps across a resume (rank 0's, in every checkpoint;
        e.g. a tracker's run id); ``{}``: nothing."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The checkpoint's :meth:`state_dict`, given back before :meth:`resumed`."""


# A sink named in ``logging.sinks`` is built by its registered factory on every rank:
# ``factory(cfg, rank, world_size) -> Sink`` (or None: no sink on this rank).
SinkFactory = Callable[[JobConfig, int, int], Sink | None]
_SINK_KINDS: dict[str, SinkFactory] = {}


def register_sink(name: str, factory: SinkFactory, replace: bool = False) -> SinkFactory:
    """Make ``logging.sinks: [name]`` build a sink with ``factory`` (per process: register it
    in a ``--plugin`` module, before the trainer starts)."""
    if not replace and name in _SINK_KINDS:
        raise ValueError(f"a sink named {name!r} is registered already (replace=True replaces it)")
    _SINK_KINDS[name] = factory
    return factory


for _name, _factory in TRACKERS.items():  # logging.sinks: [wandb], [mlflow] (trackers.py)
    register_sink(_name, _factory)


def unregister_sink(name: str) -> None:
    _SINK_KINDS.pop(name, None)


def registered_sinks() -> list[str]:
    return sorted(_SINK_KINDS)


def check_sinks(cfg: JobConfig) -> None:
    """Every name of ``logging.sinks`` is a registered sink (a config error naming it) whose
    factory's ``check(cfg)``, if it has one, passes (e.g. a tracker's library installed); a
    check that raises anything else is the same one-line config error, naming the sink."""
    for name in cfg.logging.sinks:
        if name not in _SINK_KINDS:
            known = ", ".join(registered_sinks()) or "none"
            raise ConfigError(
                f"logging.sinks: {name!r} is not a registered sink (registered: {known}); "
                "register it with linformer_ds.metrics.register_sink in a module given as "
                "launch/pretrain.py --plugin MODULE"
            )
        check = getattr(_SINK_KINDS[name], "check", None)
        if check is None:
            continue
        try:
            check(cfg)
        except LinformerError:
            raise
        except Exception as e:  # noqa: BLE001 - a plugin's check: one line naming the sink
            raise ConfigError(f"logging.sinks: sink {name!r} failed its check(cfg) "
                              f"({_one_line(e)})") from None  # fmt: skip


def _one_line(e: BaseException) -> str:
    """``TypeName: message`` of an exception, its message on one line."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


# The names of the built-in sinks in the one-line message of a sink that failed.
_BUILTIN_NAMES = {
    "ConsoleSink": "console",
    "JsonlSink": "metrics.jsonl",
    "TensorBoardSink": "tensorboard",
    "PrometheusSink": "prometheus",
    "StageMeter": "stage meter",
}


class ConsoleSink(Sink):
    """``[train] step 10 loss=...`` lines on stdout (the package logger, INFO)."""

    def record(self, step, split, values, console) -> None:
        shown = " ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in values.items()
            if k not in console
        )
        extra = "".join(f" {k.removesuffix('_s')}={v}" for k, v in console.items())
        log.info(f"[{split}] step {step} {shown}{extra}")


class JsonlSink(Sink):
    """``logging.dir/metrics.jsonl`` (one JSON record a line) beside the run's ``config.json``
    (written by the Trainer once the start succeeded: ``resume_policy.record_start``)."""

    def __init__(self, cfg: JobConfig):
        os.makedirs(cfg.logging.dir, exist_ok=True)
        self.path = os.path.join(cfg.logging.dir, "metrics.jsonl")
        self.fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)

    def record(self, step, split, values, console) -> None:
        """One line per record, written whole: a write that fails (full disk, ``ulimit -f``)
        is cut back to the last whole record, reported in one line, and the sink stops."""
        if self.fd is None:
            return
        line = (json.dumps({"step": step, "split": split, **values}) + "\n").encode()
        size = os.fstat(self.fd).st_size
        try:
            if os.write(self.fd, line) != len(line):
                raise OSError(errno.ENOSPC, "short write (No space left on device?)")
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, size)
            os.close(self.fd)
            self.fd = None
            log.warning(
                f"[warn] {self.path}: {e.strerror or e}; it ends with the last whole record "
                f"(step {step} not written) and no further records are written"
            )

    def resumed(self, step: int, resumes: int) -> None:
        """Resuming after ``step``: records of later steps (written before the run stopped,
        about to be re-run) and a torn last line are cut, so each step is in the file once."""
        if self.fd is None:
            return
        with open(self.path, "rb") as f:
            lines = f.readlines()
        keep = [line for line in lines if _step_of(line) is not None and _step_of(line) <= step]
        if len(keep) == len(lines):
            return
        tmp = f"{self.path}.tmp.{os.getpid()}"
        with open(tmp, "wb") as f:
            f.writelines(keep)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        os.close(self.fd)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        log.info(f"[resume] {self.path}: {len(lines) - len(keep)} record(s) after step {step} "
                 "removed (those steps run again)")  # fmt: skip

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _step_of(line: bytes) -> int | None:
    """The ``step`` of a metrics.jsonl line; None for a torn or foreign line."""
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


class TensorBoardSink(Sink):
    """Scalars ``split/name`` under ``logging.dir/tensorboard``."""

    def __init__(self, cfg: JobConfig):
        from torch.utils.tensorboard import SummaryWriter  # lazy: ~0.4 s, only with TensorBoard on

        self.writer = SummaryWriter(os.path.join(cfg.logging.dir, "tensorboard"))

    def record(self, step, split, values, console) -> None:
        for k, v in values.items():
            self.writer.add_scalar(f"{split}/{k}", v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class StageMeter(Sink):
    """Throughput, MFU and peak memory of the current stage, from this process's steps (after
    a resume: the steps since it): a metrics sink that counts the step times. On CUDA the peak
    is the stage's (reset at its start); on CPU the process's resident-set peak so far."""

    def __init__(self, device: str | torch.device) -> None:
        self.device = torch.device(device)
        self.index, self.steps, self.seconds = -1, 0, 0.0
        self.tokens_per_step, self.flops_per_token = 0, 0.0

    def start(self, index: int, tokens_per_step: int, flops_per_token: float) -> None:
        self.index, self.steps, self.seconds = index, 0, 0.0
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def step_done(self, step: int, seconds: float, tokens: float, skipped: bool, eta: float):
        self.steps += 1
        self.seconds += seconds

    def figures(self, world_size: int, peak_tflops: float) -> dict[str, float]:
        """``tokens_per_s`` (all ranks), ``mfu`` and ``peak_mem_gb`` (this rank)."""
        tps = self.steps * self.tokens_per_step / max(self.seconds, 1e-9)
        tflops = self.flops_per_token * tps / world_size / 1e12
        return {
            "tokens_per_s": tps,
            "mfu": tflops / peak_tflops,
            "peak_mem_gb": MemoryProbe(self.device).peak() / 2**30,
        }


# ============================================================================= the component
class Metrics:
    """The trainer's metrics component: accumulate steps, log every ``train.log_interval``.

    ``flops_per_token`` and ``tokens_per_step`` (all ranks together) give throughput and MFU
    against ``peak_tflops`` (per rank; measured at start when the config leaves it unset).
    The loop reports events through :meth:`timed_batch`, :meth:`step_done`,
    :meth:`checkpoint_done` and :meth:`on_resume`; each event goes to every sink (rank 0:
    console, metrics.jsonl, TensorBoard; every rank: Prometheus when configured, then the
    registered sinks ``logging.sinks`` names, in its order).

    A sink that raises (in its factory, any event, ``state_dict``, ``load_state_dict`` or
    ``close``) is reported in one warning line naming the sink and the event and dropped: it
    gets nothing more (not even ``close``), the run and every other sink go on
    (:meth:`_drop`). A factory that raises a :class:`~linformer_ds.errors.LinformerError`
    (a ``ConfigError``: it refuses the config) stops the run instead, in one line, before any
    step.
    """

    def __init__(
        self,
        cfg: JobConfig,
        rank: int,
        world_size: int,
        device: torch.device,
        flops_per_token: float,
        tokens_per_step: int,
        local_rank: int | None = None,
    ):
        self.cfg, self.rank, self.world, self.device = cfg, rank, world_size, device
        self.flops_per_token = flops_per_token
        self.tokens_per_step = tokens_per_step
        self.peak_tflops = cfg.train.peak_tflops or self._measure_peak()
        self.memory = MemoryProbe(device)
        self.window = torch.zeros(NUM_STATS, dtype=torch.float64)
        self.first_loss: float | None = None
        self.last_loss: float | None = None
        self._busy, self._steps_since = 0.0, 0
        # elapsed: carried in checkpoints (time up to the saved step) + this process's time
        self._t0 = time.perf_counter()
        self._elapsed_base = 0.0
        self.resumes = 0
        self.eta = float("nan")
        self._rate_from: tuple[int, float] | None = None  # (step, time) after the 1st step
        self._first_step_seconds = float("nan")
        self.sinks: list[Sink] = []
        self.stage: StageMeter | None = None  # the current stage's meter (enter_stage)
        if rank == 0:
            self.sinks += [ConsoleSink(), JsonlSink(cfg)]
            if cfg.logging.tensorboard:
                self.sinks.append(TensorBoardSink(cfg))
        if cfg.logging.prometheus_port is not None:  # collective: every rank serves
            if local_rank is None:
                local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            self.sinks.append(
                PrometheusSink(cfg, rank, world_size, local_rank, self.memory, self.elapsed)
            )
        check_sinks(cfg)
        self.stateful_sinks: dict[str, Sink] = {}  # logging.sinks' whose state is checkpointed
        self.names: dict[int, str] = {}  # id(sink) -> its logging.sinks name (messages)
        for name in cfg.logging.sinks:  # built here, so they see every event, resumes included
            try:
                sink = _SINK_KINDS[name](cfg, rank, world_size)
            except LinformerError:  # the factory refuses the config: the run stops, one line
                raise
            except Exception as e:  # noqa: BLE001 - a sink never stops training
                self._warn(name, "its factory", e)
                continue
            if sink is not None:
                self.sinks.append(sink)
                self.names[id(sink)] = name
                if hasattr(sink, "state_dict"):  # a sink of Sink's or of its own events
                    self.stateful_sinks[name] = sink

    def _measure_peak(self) -> float:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
            self.cfg.deepspeed.precision, torch.float32
        )
        size = 2048 if self.device.type == "cpu" else 8192
        # in the run's precision, within ~3 s (bf16 without native support is orders of
        # magnitude slower)
        return measure_matmul_peak_tflops(dtype, str(self.device), size, repeats=5, budget_s=3.0)

    def enter_stage(self, index: int, flops_per_token: float, tokens_per_step: int) -> None:
        """A new stage of ``train.stages`` (or the run's one): throughput and MFU follow its N
        and batch from here on; its own meter (:attr:`stage`, also a sink) starts counting."""
        self.flops_per_token = flops_per_token
        self.tokens_per_step = tokens_per_step
        if self.stage is None:
            self.stage = StageMeter(self.device)
            self.sinks.append(self.stage)  # counts the stage's step times
        self.stage.start(index, tokens_per_step, flops_per_token)

    def elapsed(self) -> float:
        """Training wall seconds: the resumed checkpoint's figure plus this process's time."""
        return self._elapsed_base + time.perf_counter() - self._t0

    def sink_name(self, sink: Sink) -> str:
        """``sink``'s name in messages: its ``logging.sinks`` name, a built-in's name, or its
        class name (a sink appended to :attr:`sinks` by the caller)."""
        name = type(sink).__name__
        return self.names.get(id(sink)) or _BUILTIN_NAMES.get(name, name)

    def _warn(self, name: str, event: str, e: BaseException) -> None:
        where = f" on rank {self.rank}" if self.world > 1 else ""
        log.warning(f"[warn] metrics sink {name!r} failed in {event}{where} ({_one_line(e)}); "
                    "it is dropped (no further events go to it); training goes on")  # fmt: skip

    def _drop(self, sink: Sink, event: str, e: BaseException) -> None:
        """The one line of a sink that raised in ``event``; it gets nothing more."""
        self._warn(self.sink_name(sink), event, e)
        self.sinks[:] = [s for s in self.sinks if s is not sink]  # in place: callers hold it
        self.stateful_sinks = {n: s for n, s in self.stateful_sinks.items() if s is not sink}

    def _emit(self, event: str, *args: Any) -> None:
        for sink in list(self.sinks):
            try:
                getattr(sink, event)(*args)
            except Exception as e:  # noqa: BLE001 - a sink never stops training
                self._drop(sink, event, e)

    # ------------------------------------------------------------------------------ events
    def timed_batch(self, next_batch: Callable[[], T]) -> T:
        """``next_batch()``, its duration counted as time waiting for data."""
        t0 = time.perf_counter()
        batch = next_batch()
        self._emit("data_wait", time.perf_counter() - t0)
        return batch

    def step_done(
        self, step: int, stats: Sequence[float], seconds: float, skipped: bool = False
    ) -> None:
        """Add an optimizer step's all-reduced statistics (``[4]`` numbers on the host: a list
        or a CPU tensor) and its wall time (data included); ``skipped``: DeepSpeed did not
        apply the update."""
        now = time.perf_counter()
        self.window += torch.as_tensor(stats[:NUM_STATS], dtype=torch.float64)
        self._busy += seconds
        loss = float(stats[STAT_LOSS]) / max(float(stats[STAT_COUNT]), 1.0)
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
        self._emit("step_done", step, seconds, self.tokens_per_step / self.world, skipped, self.eta)

    def checkpoint_done(self, op: str, seconds: float) -> None:
        """A checkpoint ``op`` ("save" or "load") took ``seconds`` on this rank."""
        self._emit("checkpoint_done", op, seconds)

    def on_resume(self, step: int, load_seconds: float) -> None:
        """The run resumed at ``step`` (after :meth:`load_state_dict`); loading took
        ``load_seconds``."""
        self.resumes += 1
        self.checkpoint_done("load", load_seconds)
        self._emit("resumed", step, self.resumes)

    def should_log(self, step: int) -> bool:
        return step % self.cfg.train.log_interval == 0 or step == self.cfg.train.max_steps

    def log_train(
        self, step: int, epoch: int, engine: Any, extra: dict[str, float] | None = None
    ) -> None:
        """One ``[train]`` record for the window that ends at ``step``; resets the window.
        ``extra``: more values of the record (the data's stage, N, source shares and epochs)."""
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
            "peak_mem_gb": self.memory.peak() / 2**30,
            "epoch": epoch,
            "elapsed_s": elapsed,
            "eta_s": self.eta,
            **(extra or {}),
        }
        console = {"elapsed_s": format_duration(elapsed), "eta_s": format_duration(self.eta)}
        self._emit("record", step, "train", values, console)
        self.window.zero_()
        self._busy, self._steps_since = 0.0, 0

    def log_eval(self, step: int, values: dict[str, float]) -> None:
        self._emit("record", step, "eval", values, {})

    # ------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The open window's sums, elapsed seconds and resume count: saved in checkpoints so
        logs after a resume are exact."""
        state: dict[str, Any] = {
            "window": [float(x) for x in self.window],
            "elapsed": self.elapsed(),
            "resumes": self.resumes,
        }
        sinks = {}
        for name, sink in list(self.stateful_sinks.items()):
            try:
                sinks[name] = sink.state_dict()
            except Exception as e:  # noqa: BLE001 - the checkpoint is saved without it
                self._drop(sink, "state_dict", e)
        if any(sinks.values()):
            state["sinks"] = {name: s for name, s in sinks.items() if s}
        return state

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if not state:
            return
        if "window" in state:
            self.window = torch.tensor(state["window"], dtype=torch.float64)
        self._elapsed_base = float(state.get("elapsed", 0.0))
        self.resumes = int(state.get("resumes", 0))
        for name, sink_state in state.get("sinks", {}).items():
            sink = self.stateful_sinks.get(name)
            if sink is None:  # a sink the run no longer names: its state dropped
                continue
            try:
                sink.load_state_dict(sink_state)
            except Exception as e:  # noqa: BLE001 - a sink never stops training
                self._drop(sink, "load_state_dict", e)

    def close(self) -> None:
        """Flush and close the sinks; a ``/metrics`` endpoint stops serving. A sink that raises
        is reported in one line; the others are closed all the same."""
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            try:
                sink.close()
            except Exception as e:  # noqa: BLE001 - the run's result stands
                self._warn(self.sink_name(sink), "close", e)
