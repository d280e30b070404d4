"""Counting device->host synchronisations of the training step, on any device.

On an accelerator the host runs ahead of the device, queueing kernels; an operation whose
result the host needs (a scalar read, a size known only from the data, a copy to the CPU)
makes it wait until the device's queue has drained. Two counters:

- :class:`SyncCounter`, a ``TorchDispatchMode``: sees every aten operation and counts those
  that force such a wait on an accelerator (:func:`sync_reason`). It works on the CPU too, so
  tests count what a GPU step would wait for, and it says whose code asked: the model
  (forward, the autograd graph of backward, our autograd functions), the trainer, the data
  pipeline (host tensors by design) or DeepSpeed, from the Python stack of each counted call.
- :func:`count_cuda_syncs`: ``torch.cuda.set_sync_debug_mode("warn")``, counting the
  warnings: CUDA's own count (it also sees waits inside kernels' launch code, e.g. a
  non-pinned copy from the host), for the GPU kit.

The trainer's hook (``debug.sync_log=DIR``, steps ``debug.sync_steps``, default ``[2, 3]``:
job config keys) runs those steps under both and appends one record per step to
``DIR/syncs.rank{R}.jsonl``.
"""

import contextlib
import json
import os
import sys
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from linformer_ds.config import ConfigError

aten = torch.ops.aten
# Operations that always wait for the device: a value or a data-dependent size reaches the host.
_ALWAYS = {
    aten._local_scalar_dense.default: "item",  # .item(), int(t), float(t), bool(t)
    aten.is_nonzero.default: "item",
    aten.equal.default: "equal",
    aten.nonzero.default: "nonzero",
    aten.nonzero.out: "nonzero",
    aten.masked_select.default: "masked_select",
    aten._unique2.default: "unique",
    aten.unique_dim.default: "unique",
    aten.unique_consecutive.default: "unique",
    aten.bincount.default: "bincount",
    aten.histc.default: "histc",
}
_INDEX = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}
_INDEX.add(aten._index_put_impl_.default)
_MASK_DTYPES = (torch.bool, torch.uint8)


def sync_reason(func: Any, args: tuple, kwargs: dict) -> str | None:
    """Why ``func(*args, **kwargs)`` makes the host wait for an accelerator, or None.

    Also counted on the CPU (where nothing waits): boolean-mask indexing (its size comes from
    a ``nonzero``), copies to the CPU (on the CPU: ``.to("cpu", copy=True)``, the only form of
    ``.to("cpu")`` that dispatches there; a dtype conversion is not counted) and blocking
    copies from the host to a device."""
    why = _ALWAYS.get(func)
    if why is not None:
        return why
    if func in _INDEX:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype in _MASK_DTYPES for i in indices or ()):
            return "boolean_mask_index"
        return None
    if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
        return "repeat_interleave"
    if func is aten._to_copy.default:
        src, dst = args[0], kwargs.get("device")
        if dst is None:
            return None
        dst = torch.device(dst)
        if dst.type == "cpu" and src.device.type != "cpu":
            return "copy_to_host"
        if dst.type == "cpu":  # on the CPU: a plain copy is what a read to the host looks like
            dtype = kwargs.get("dtype")
            return "copy_to_host" if dtype is None or dtype == src.dtype else None
        if src.device.type == "cpu" and not (kwargs.get("non_blocking") and src.is_pinned()):
            return "blocking_copy_from_host"
        return None
    if func is aten.copy_.default:
        dst, src = args[0], args[1]
        if dst.device.type == "cpu" and src.device.type != "cpu":
            return "copy_to_host"
        if dst.device.type != "cpu" and src.device.type == "cpu":
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            if not (non_blocking and src.is_pinned()):
                return "blocking_copy_from_host"
    return None


_SEP = os.sep
_OURS = f"{_SEP}linformer_ds{_SEP}"
_MODEL_DIR = f"{_OURS}model{_SEP}"  # the model package
_MODEL_FILES = tuple(  # the model's side of sequence parallelism
    f"{_SEP}parallel{_SEP}{m}.py" for m in ("checks", "groups", "collectives", "sharding")
)
_DATA_DIR = f"{_OURS}data{_SEP}"  # the data pipeline: the package linformer_ds/data/


def owner(frame: Any) -> str:
    """Whose code asked for an operation, from the Python stack at ``frame`` outwards:
    ``data`` (inside the data pipeline: host tensors by design), ``model`` (the model's
    forward, our autograd functions, or the autograd graph of backward itself), ``trainer``
    (the rest of linformer_ds), ``deepspeed.forward`` / ``.backward`` / ``.step`` (DeepSpeed's
    code, under the engine method called), or ``other``; the innermost of those wins."""
    frames = []
    while frame is not None:
        frames.append(frame.f_code)
        frame = frame.f_back
    for code in frames:
        path = code.co_filename
        if _DATA_DIR in path:
            return "data"
    for i, code in enumerate(frames):
        path = code.co_filename
        if _OURS in path:
            return "model" if _MODEL_DIR in path or path.endswith(_MODEL_FILES) else "trainer"
        if f"{_SEP}deepspeed{_SEP}" in path:
            return _deepspeed_phase(frames[i:])
        if code.co_name == "_engine_run_backward":  # torch.autograd: the graph's own nodes
            return "model"
    return "other"


def _deepspeed_phase(frames: list[Any]) -> str:
    """``deepspeed.forward`` / ``.backward`` / ``.step``: the engine method (outermost) that
    the call came from, so per-micro-batch work and per-step work are told apart."""
    phase = ""
    for code in frames:
        if code.co_filename.endswith(f"runtime{_SEP}engine.py") and code.co_name in _PHASES:
            phase = "." + code.co_name
    return "deepspeed" + phase


_PHASES = ("forward", "backward", "step")


def _site(frame: Any) -> str:
    """``file:line`` of the innermost frame outside torch (where the call came from)."""
    while frame is not None:
        path = frame.f_code.co_filename
        if f"{_SEP}torch{_SEP}" not in path and not path.endswith("hostsync.py"):
            parts = path.split(_SEP)
            return f"{_SEP.join(parts[-3:])}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _on_host(args: tuple) -> bool:
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return bool(tensors) and all(t.device.type == "cpu" for t in tensors)


class SyncCounter(TorchDispatchMode):
    """Counts the operations of :func:`sync_reason` while active (``with SyncCounter() as c``).

    ``device``: the training device; on an accelerator, operations on host tensors only (the
    data pipeline's, reads of statistics already copied) are not counted; on the CPU every
    operation counts as it would on an accelerator. ``counts``: ``Counter`` of owner (see
    :func:`owner`) -> operations; ``ops``: of ``(owner, reason)``; ``sites``: of ``(owner,
    reason, file:line)``."""

    def __init__(self, device: Any = "cpu") -> None:
        super().__init__()
        self.accelerator = torch.device(device).type != "cpu"
        self.counts: Counter = Counter()
        self.ops: Counter = Counter()
        self.sites: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        why = sync_reason(func, args, kwargs)
        if why is not None and self.accelerator and why != "copy_to_host" and _on_host(args):
            why = None
        if why is not None:
            frame = sys._getframe(1)
            who = owner(frame)
            self.counts[who] += 1
            self.ops[(who, why)] += 1
            self.sites[(who, why, _site(frame))] += 1
        return func(*args, **kwargs)

    def summary(self) -> dict[str, Any]:
        """JSON-ready: totals per owner, per owner and reason, and the call sites."""
        return {
            "by_owner": dict(self.counts),
            "by_reason": {f"{w}/{r}": n for (w, r), n in sorted(self.ops.items())},
            "sites": {f"{w}/{r} {s}": n for (w, r, s), n in sorted(self.sites.items())},
        }


CUDA_SYNC_WARNING = "called a synchronizing CUDA operation"


@contextlib.contextmanager
def count_cuda_syncs(device: Any) -> Iterator[dict[str, Any]]:
    """CUDA's own count of synchronizing operations inside the block (``set_sync_debug_mode
    ("warn")``, the warnings counted and their Python call sites); ``{"count": None}`` on
    other devices. The dict is filled when the block ends."""
    result: dict[str, Any] = {"count": None, "sites": {}}
    if torch.device(device).type != "cuda":
        yield result
        return
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield result
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    hits = [w for w in caught if CUDA_SYNC_WARNING in str(w.message)]
    sites = Counter(f"{os.sep.join(w.filename.split(os.sep)[-3:])}:{w.lineno}" for w in hits)
    result.update(count=len(hits), sites=dict(sites.most_common()))


class StepSyncLog:
    """The trainer's hook (:class:`linformer_ds.trainer.TrainerHook`, passed only with
    ``debug.sync_log``): the optimizer ``steps`` run under :class:`SyncCounter` and
    :func:`count_cuda_syncs`; one JSON line per step (counts, step seconds) per rank, in
    ``directory/syncs.rank{R}.jsonl``."""

    def __init__(self, directory: str, steps: list[int]) -> None:
        self.dir, self.steps = directory, list(steps)
        self.rank, self.device, self.run, self.path = 0, "cpu", "", ""

    def attach(self, trainer: Any) -> None:
        """The built Trainer's rank, device and run directory; the file is created here."""
        self.rank, self.device = trainer.rank, trainer.device
        self.run = trainer.cfg.logging.dir
        self.path = os.path.join(self.dir, f"syncs.rank{self.rank}.jsonl")
        try:
            os.makedirs(self.dir, exist_ok=True)
            open(self.path, "a").close()
        except OSError as e:
            raise ConfigError(f"debug.sync_log: cannot write {self.path}: {e}") from None

    def loss(self, loss: torch.Tensor, step: int) -> torch.Tensor:  # noqa: ARG002
        return loss

    def close(self) -> None:
        pass

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Around one ``Trainer.train_step`` (``step``: the optimizer step it trains). The
        step after the last counted one is timed without counting (``counted: false``): the
        counters' own cost shows beside it."""
        last = max(self.steps, default=0)
        if not (step in self.steps or step == last + 1):
            yield
            return
        cuda = torch.device(self.device).type == "cuda"
        if cuda:  # the step's time starts with an empty queue
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        if step in self.steps:
            counter: SyncCounter | None = SyncCounter(self.device)
            with count_cuda_syncs(self.device) as syncs, counter:
                yield
        else:
            counter, syncs = None, {"count": None, "sites": {}}
            yield
        if cuda:
            torch.cuda.synchronize(self.device)
        rec = {
            "run": self.run,
            "step": step,
            "rank": self.rank,
            "device": str(self.device),
            "counted": counter is not None,
            "step_s": time.perf_counter() - t0,
            "dispatch": counter.summary() if counter is not None else None,
            "cuda_syncs": syncs["count"],
            "cuda_sync_sites": syncs["sites"],
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
