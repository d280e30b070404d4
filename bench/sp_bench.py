"""Sequence-parallel benchmark: bytes per layer, step time and memory per rank, linear vs Ulysses.

``python -m bench.sp_bench`` launches P CPU ranks (torch.multiprocessing spawn, gloo) per
configuration, in fresh processes, and times full training steps (forward, backward, AdamW step)
of a small real model through DeepSpeed, as the trainer runs it (``build_groups``,
``global_label_count``; from :mod:`linformer_ds.parallel.parallelize` ``shard_for_deepspeed``,
``partition_for_zero3``, ``apply_sequence_parallel``; ``LossScaling`` from :mod:`linformer_ds.loss`;
the mpus from :mod:`linformer_ds.parallel.groups`).

Phases (``--phases``):

* ``comm``: linear-SP vs Ulysses-dense at the same N and P, N from 16k up. Bytes handed to the
  collectives are counted with ``count_collectives`` (split by process group: the SP group's
  calls are the layers' exchange, the rest is DeepSpeed's gradient reduction), checked against
  ``collective_bytes_per_layer``, and the time spent inside the collectives is measured.
* ``memory``: linear at a fixed N for P = 1, 2, 4 (peak RSS per rank), and at P = 2 under
  ZeRO 0-3 (what each rank holds: parameters, optimizer state, E and position table).
* ``frontier``: linear at N = 262,144 / 1,048,576 / 4,194,304 for P = 1, 2, 4, activation
  checkpointing off and on: the time of the second step and each rank's peak RSS during it
  (the optimizer state exists by then), with E/F and the position table sharded over the SP
  ranks (default) or whole on every rank (``--no-shard``: the "before" rows).
* ``trainer``: the real trainer (``launch/pretrain.py`` under the ``deepspeed`` launcher) on
  data made by ``data_prep`` (e.g. 1,048,576-token rows), one step; peak RSS of each rank
  sampled from /proc.

Memory per rank is the process's peak RSS (``getrusage`` ``ru_maxrss``; the trainer phase
samples it every 0.2 s); RSS after imports is given so that the growth can be read off. A
watchdog stops a configuration when the machine's available memory falls under
``--min-available-gb`` (the machine is shared): such rows say so instead of giving numbers.

Writes ``results.json`` and ``results.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from bench.common import (
    BenchError,
    ModelSizes,
    deepspeed_json,
    environment,
    job_config,
    mlm_batch,
    model_config,
    model_overrides,
    parse_max_n,
)
from bench.sp_collectives import collective_bytes_per_layer, count_collectives
from linformer_ds.dist_env import free_port
from linformer_ds.engine import import_muon_lazily
from linformer_ds.fsio import read_jsonl

PHASES = ("comm", "memory", "frontier", "trainer")
VARIANTS = ("linear", "dense")
REPO = Path(__file__).resolve().parents[1]
MIB = 2**20


# The command line's default model: small enough for 1M-token rows on a CPU box.
SMALL_MODEL = ModelSizes(hidden=64, heads=4, k=64, intermediate=128, vocab=512, dropout=0.0)


@dataclass
class SPBenchConfig(ModelSizes):
    """Everything one run depends on (stored in results.json). The model's sizes are those of
    :class:`bench.common.ModelSizes`; the command line's defaults are :data:`SMALL_MODEL`."""

    phases: list[str] = field(default_factory=lambda: ["comm", "memory"])
    # comm: linear vs dense at each N, P ranks
    seq_lens: list[int] = field(default_factory=lambda: [16384, 32768, 65536, 262144, 1048576])
    sp: int = 2
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))
    max_n: dict[str, int] = field(default_factory=lambda: {"dense": 32768})
    # memory: fixed N, P sweep (at --zero) and ZeRO sweep (at --zero-sweep-sp)
    memory_seq_len: int = 131072
    memory_sp: list[int] = field(default_factory=lambda: [1, 2, 4])
    zero_sweep: list[int] = field(default_factory=lambda: [0, 1, 2, 3])
    zero_sweep_sp: int = 2
    # frontier: the second step at long N, P sweep, activation checkpointing off/on
    frontier_seq_lens: list[int] = field(default_factory=lambda: [262144, 1048576, 4194304])
    frontier_sp: list[int] = field(default_factory=lambda: [1, 2, 4])
    frontier_ac: list[int] = field(default_factory=lambda: [0, 1])
    # act. ckpt on: one checkpoint per layer, or the attention and feed-forward sub-layers apart
    ac_granularity: str = "sublayer"
    # P > 1: E/F columns and position rows sharded over the SP ranks (False: --no-shard)
    shard: bool = True
    # trainer: launch/pretrain.py on a data_prep corpus
    trainer_data: str | None = None
    trainer_sp: int = 2
    trainer_zero: int = 2
    trainer_overrides: list[str] = field(default_factory=list)
    # the step
    zero: int = 2
    precision: str = "fp32"
    mlm_fraction: float = 0.15
    warmup: int = 1
    iters: int = 2
    threads: int = 2  # CPU threads shared by the ranks of one configuration
    seed: int = 0
    min_available_gb: float = 1.5
    case_timeout_s: float = 900.0
    out: str = "bench/results/sp"

    def validate(self) -> None:
        """Raise BenchError naming the first bad option."""
        for ph in self.phases:
            if ph not in PHASES:
                raise BenchError(f"--phases: unknown phase {ph!r}, choose from {PHASES}")
        for v in list(self.variants) + list(self.max_n):
            if v not in VARIANTS:
                raise BenchError(f"--variants/--max-n: unknown variant {v!r}, choose {VARIANTS}")
        self.validate_sizes()
        if self.iters < 1:
            raise BenchError(f"--iters: must be >= 1, got {self.iters}")
        if self.ac_granularity not in ("layer", "sublayer"):
            raise BenchError(f"--ac-granularity: layer or sublayer, got {self.ac_granularity!r}")
        if self.precision not in ("fp32", "bf16"):
            raise BenchError(f"--precision: fp32 or bf16, got {self.precision!r}")
        if not 0.0 < self.mlm_fraction <= 1.0:
            raise BenchError(f"--mlm-fraction: must be in (0, 1], got {self.mlm_fraction}")
        sps = [self.sp, self.zero_sweep_sp, self.trainer_sp] + list(self.memory_sp)
        sps += list(self.frontier_sp)
        if any(p < 1 for p in sps):
            raise BenchError(f"--sp/--memory-sp/--zero-sweep-sp/--trainer-sp: >= 1, got {sps}")
        if "dense" in self.variants and self.heads % self.sp:
            raise BenchError(f"--heads {self.heads}: dense (Ulysses) needs heads % --sp == 0")
        for z in [self.zero, self.trainer_zero] + list(self.zero_sweep):
            if z not in (0, 1, 2, 3):
                raise BenchError(f"--zero/--zero-sweep/--trainer-zero: 0-3, got {z}")
        lens = list(self.seq_lens) + [self.memory_seq_len] + list(self.frontier_seq_lens)
        for n in lens:
            for p in sps:
                if n < self.k or n % p:
                    raise BenchError(
                        f"--seq-lens: N={n} must be >= k={self.k} and divisible by P={p}"
                    )
        if "trainer" in self.phases and not self.trainer_data:
            raise BenchError("--trainer-data: the trainer phase needs a data_prep output directory")


@dataclass
class Case:
    """One configuration: a variant at length N on P ranks under one ZeRO stage."""

    phase: str
    variant: str
    n: int
    p: int
    zero: int
    ac: bool = False  # activation checkpointing (torch's non-reentrant, every layer)
    ac_granularity: str = "layer"  # per layer, or per sub-layer (attention, feed-forward apart)
    shard: bool = True  # P > 1: E/F and positions sharded over the SP ranks
    steps: int = 0  # steps to run (0: --warmup + --iters); the first is warmup


# ============================================================================ the ranks' work
class TimedCollectives(count_collectives):
    """``count_collectives`` that also splits bytes and wall time by process group.

    ``sp_bytes``/``sp_seconds``: calls on ``sp_group`` (the layers' exchange, the loss count);
    ``other_bytes``/``other_seconds``: every other group (DeepSpeed's gradient reduction and,
    under ZeRO-3, its parameter gathers). Async calls count their launch time only.
    """

    def __init__(self, sp_group: Any) -> None:
        super().__init__()
        self.sp_group = sp_group
        self.sp_bytes = self.other_bytes = 0
        self.sp_seconds = self.other_seconds = 0.0

    def _wrap(self, fn: Any, name: str, kind: str) -> Any:
        counted = super()._wrap(fn, name, kind)
        sig = inspect.signature(fn)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            group = sig.bind_partial(*args, **kwargs).arguments.get("group")
            before = self.total
            t0 = time.perf_counter()
            out = counted(*args, **kwargs)
            dt = time.perf_counter() - t0
            if self.sp_group is not None and group is self.sp_group:
                self.sp_bytes += self.total - before
                self.sp_seconds += dt
            else:
                self.other_bytes += self.total - before
                self.other_seconds += dt
            return out

        return wrapped


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _reset_peak_rss() -> bool:
    """Reset this process's peak RSS (Linux: VmHWM, by writing 5 to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_since_reset() -> int:
    """VmHWM (bytes): the peak RSS since the last :func:`_reset_peak_rss`."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _holdings(engine: Any, model: torch.nn.Module) -> dict[str, Any]:
    """Bytes this rank holds: model parameters (its ZeRO-3 partition), the optimizer's own
    tensors (fp32 master partitions and AdamW moments), and how much of E and the positions."""

    def local(p: torch.Tensor) -> torch.Tensor:
        return p.ds_tensor if hasattr(p, "ds_tensor") else p

    def whole(p: torch.Tensor) -> int:  # the full matrix's size (ZeRO-3 or SP-sharded)
        n = int(getattr(p, "ds_numel", p.numel()))
        shard = getattr(p, "sequence_shard", None)
        if shard is not None:
            n = n // int(getattr(p, "ds_shape", p.shape)[shard[0]]) * int(shard[1])
        return n

    seen, model_bytes, model_ptrs = set(), 0, set()
    for p in model.parameters():
        t = local(p)
        if id(p) in seen:
            continue
        seen.add(id(p))
        model_bytes += t.numel() * t.element_size()
        model_ptrs.add(t.data_ptr())
    opt = engine.optimizer
    while hasattr(opt, "optimizer") and opt.optimizer is not opt:
        opt = opt.optimizer
    opt_bytes, ptrs = 0, set()
    tensors = [t for grp in opt.param_groups for t in grp["params"]]
    tensors += [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    for t in tensors:
        t = local(t)
        if t.data_ptr() in ptrs or t.data_ptr() in model_ptrs or t.numel() < 2:
            continue
        ptrs.add(t.data_ptr())
        opt_bytes += t.numel() * t.element_size()
    enc = model.encoder
    pos = enc.position_embeddings.weight
    e = enc.shared_linear.weight if enc.shared_linear is not None else None
    return {
        "model_param_bytes": model_bytes,
        "optimizer_bytes": opt_bytes,
        "positions_local": local(pos).numel(),
        "positions_full": whole(pos),
        "E_local": local(e).numel() if e is not None else 0,
        "E_full": whole(e) if e is not None else 0,
    }


def _union_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes covered by ``tensors`` (views of one buffer counted once: the union of their byte
    ranges)."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                   for t in tensors if t is not None and t.numel())  # fmt: skip
    total, end = 0, 0
    for lo, hi in spans:
        lo = max(lo, end)
        if hi > lo:
            total, end = total + hi - lo, hi
    return total


def _grad_bytes(engine: Any, model: torch.nn.Module) -> int:
    """Bytes of gradients held right after backward: the parameters' ``.grad`` and the ZeRO
    optimizer's gradient partitions (DeepSpeed's reduction buckets are not counted)."""
    opt = engine.optimizer
    ts = [p.grad for p in model.parameters() if p.grad is not None]
    for name in ("grads_in_partition", "grad_partitions_flat_buffer"):
        t = getattr(opt, name, None)
        if torch.is_tensor(t):
            ts.append(t)
    ts += [t.grad for t in getattr(opt, "single_partition_of_fp32_groups", []) or []
           if t.grad is not None]  # fmt: skip
    averaged = getattr(opt, "averaged_gradients", None)  # ZeRO 1-2: the partition's gradients
    for g in averaged.values() if isinstance(averaged, dict) else []:
        ts += [g] if torch.is_tensor(g) else [t for t in g or [] if torch.is_tensor(t)]
    return _union_bytes(ts)


def rank_worker(rank: int, bc_dict: dict[str, Any], case_dict: dict[str, Any], port: int,
                out_dir: str) -> None:  # fmt: skip
    """One rank of one configuration: build, train ``warmup + iters`` steps, write its JSON."""
    bc, case = SPBenchConfig(**bc_dict), Case(**case_dict)
    p = case.p
    os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(rank), WORLD_SIZE=str(p), LOCAL_RANK=str(rank),
                      LOCAL_SIZE=str(p))  # fmt: skip
    torch.set_num_threads(max(1, bc.threads // p))
    import deepspeed

    from linformer_ds.dist_env import disable_deepspeed_shm_allreduce
    from linformer_ds.loss import LossScaling
    from linformer_ds.model import LinformerForMaskedLMPretraining
    from linformer_ds.optim import param_groups
    from linformer_ds.parallel import groups as grp
    from linformer_ds.parallel import parallelize as par
    from linformer_ds.parallel import sharding
    from linformer_ds.parallel.collectives import global_label_count

    rss_imports = _rss()
    disable_deepspeed_shm_allreduce()
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    groups = grp.build_groups(p) if p > 1 else None
    sp_group = groups.sp_group if groups is not None else None
    torch.manual_seed(bc.seed)
    job = job_config(model_config(bc, case.variant, case.n), case.zero, bc.precision, sp=p)
    model = LinformerForMaskedLMPretraining(job.model)
    cfg = deepspeed_json(job, world_size=p)  # the trainer's DeepSpeed JSON
    kwargs: dict[str, Any] = {}
    scale = 1.0
    if groups is not None and case.shard:  # as the trainer: E/F and positions per SP rank
        par.shard_for_deepspeed(model, groups)
        kwargs["mpu"] = grp.ShardedSequenceParallelMPU(groups)
    elif groups is not None:
        par.partition_for_zero3(model, groups, cfg)
        kwargs["mpu"] = grp.SequenceParallelMPU(groups)
        scale = LossScaling(p, sp_size=p, zero_stage=case.zero).backward_scale
    if groups is not None:
        par.apply_sequence_parallel(model, sp_group)
    if case.ac:
        from torch.utils.checkpoint import checkpoint

        model.encoder.set_activation_checkpointing(
            functools.partial(checkpoint, use_reentrant=False), granularity=case.ac_granularity
        )
    params = param_groups(model, job.optimizer.weight_decay)
    import_muon_lazily()  # as the trainer: no inductor import for DeepSpeed's Muon
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=cfg, **kwargs)
    # sharded: the replicated parameters' gradients are summed over the SP group in backward,
    # in the training dtype (counted after initialize: bf16 runs cast the parameters there)
    sp_grad_bytes = sum(
        getattr(q, "ds_numel", q.numel()) * q.element_size() for q in model.parameters()
        if q.requires_grad and not hasattr(q, sharding.SHARD_ATTR)
    ) if groups is not None and case.shard else 0  # fmt: skip
    batch = mlm_batch(bc.vocab, 1, case.n, bc.mlm_fraction, bc.seed)
    if groups is not None:
        batch, _ = sharding.shard_batch(batch, groups.sp_rank, p)
    rss_init = _rss()
    steps: list[dict[str, Any]] = []
    n_steps = case.steps or bc.warmup + bc.iters
    warmup = 1 if case.steps else bc.warmup
    for i in range(n_steps):
        torch.distributed.barrier()
        hwm = _reset_peak_rss()
        t0 = time.perf_counter()
        denom = global_label_count(batch["labels"], sp_group) if groups is not None else None
        rss_before = _rss()
        with TimedCollectives(sp_group) as fwd:
            out = engine(batch["input_ids"], batch["attention_mask"], labels=batch["labels"],
                         loss_denominator=denom)  # fmt: skip
        rss_forward = _rss()
        with TimedCollectives(sp_group) as bwd:
            engine.backward(out.loss * scale if scale != 1.0 else out.loss)
        grad_bytes = _grad_bytes(engine, model)
        with TimedCollectives(sp_group) as opt:
            engine.step()
        dt = time.perf_counter() - t0
        steps.append({
            "step_s": dt, "warmup": i < warmup, "loss": float(out.loss.detach()),
            "peak_rss": _peak_rss_since_reset() if hwm else None,
            "rss_before_forward": rss_before, "rss_after_forward": rss_forward,
            "grad_bytes": grad_bytes,
            "sp_fwd_bytes": fwd.sp_bytes, "sp_bwd_bytes": bwd.sp_bytes - sp_grad_bytes,
            "sp_grad_bytes": sp_grad_bytes,
            "sp_comm_s": fwd.sp_seconds + bwd.sp_seconds + opt.sp_seconds,
            "other_bytes": fwd.other_bytes + bwd.other_bytes + opt.other_bytes,
            "other_comm_s": fwd.other_seconds + bwd.other_seconds + opt.other_seconds,
            "fwd_by_kind": dict(fwd.bytes), "bwd_by_kind": dict(bwd.bytes),
        })  # fmt: skip
        del out  # as the trainer's step: this step's logits are not resident in the next one
    res = {
        "rank": rank,
        "steps": steps,
        "rss_after_imports": rss_imports,
        "rss_after_init": rss_init,
        "rss_end": _rss(),
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "threads": torch.get_num_threads(),
        **_holdings(engine, model),
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


# ============================================================================== the parent side
def _available() -> int:
    return psutil.virtual_memory().available


def _tree_rss(procs: list[psutil.Process]) -> dict[int, int]:
    out = {}
    for pr in procs:
        try:
            out[pr.pid] = pr.memory_info().rss
        except psutil.Error:
            pass
    return out


def watch(procs: list[psutil.Process], alive: Any, bc: SPBenchConfig, deadline: float) -> str:
    """Poll until ``alive()`` is False; kill ``procs`` (and return why) if the machine's
    available memory falls under the floor or the deadline passes. Returns '' when done."""
    floor = bc.min_available_gb * 2**30
    while alive():
        if _available() < floor:
            rss = sum(_tree_rss(procs).values())
            why = (f"stopped: machine's available memory under {bc.min_available_gb} GiB "
                   f"(ranks' RSS {rss / MIB:.0f} MiB)")  # fmt: skip
        elif time.monotonic() > deadline:
            why = f"stopped: over --case-timeout-s {bc.case_timeout_s:.0f}"
        else:
            time.sleep(0.2)
            continue
        for pr in procs:
            try:
                pr.kill()
            except psutil.Error:
                pass
        return why
    return ""


def run_case(bc: SPBenchConfig, case: Case) -> dict[str, Any]:
    """Launch the P ranks of ``case`` in fresh processes; their results merged into one row."""
    import torch.multiprocessing as mp

    row: dict[str, Any] = asdict(case)
    with tempfile.TemporaryDirectory(prefix="sp_bench_") as tmp:
        ctx = mp.start_processes(
            rank_worker, args=(asdict(bc), asdict(case), free_port(), tmp), nprocs=case.p,
            join=False, start_method="spawn",
        )  # fmt: skip
        procs = [psutil.Process(pr.pid) for pr in ctx.processes]
        error: list[str] = []

        def alive() -> bool:
            try:
                return not ctx.join(timeout=0.2)
            except Exception as e:  # a rank failed: its exception or its exit signal
                error.append(str(e).strip().splitlines()[-1][:300])
                return False

        why = watch(procs, alive, bc, time.monotonic() + bc.case_timeout_s)
        if why or error:
            for pr in ctx.processes:
                if pr.is_alive():
                    pr.kill()
            row["failed"] = why or f"failed: {error[0]}"
            return row
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(case.p)]
    return summarize(bc, case, ranks, row)


BREAKDOWN = ("params", "grads", "optimizer", "activations", "other", "libraries")


def breakdown(rank: dict[str, Any], step: dict[str, Any]) -> dict[str, int] | None:
    """One rank's peak RSS in ``step`` split into parts that sum to it (bytes): ``params``,
    ``grads`` (counted after backward) and ``optimizer`` (fp32 master and AdamW moments) are
    tensor bytes; ``activations`` is the rest of the step's growth over the memory resident
    before its forward (saved activations, recomputed (sub-)layers and their gradients,
    temporaries); ``libraries`` the RSS after imports; ``other`` what is left (DeepSpeed's
    buckets and buffers, the batch, allocator slack). ``activations_saved``: the growth over
    the forward alone (what the forward leaves for backward). None without a peak."""
    peak = step.get("peak_rss")
    if peak is None:
        return None
    params, opt, grads = rank["model_param_bytes"], rank["optimizer_bytes"], step["grad_bytes"]
    act = max(0, peak - step["rss_before_forward"] - grads)
    libs = rank["rss_after_imports"]
    return {"params": params, "grads": grads, "optimizer": opt, "activations": act,
            "other": peak - libs - params - opt - grads - act, "libraries": libs,
            "activations_saved": step["rss_after_forward"] - step["rss_before_forward"],
            "peak": peak}  # fmt: skip


def summarize(bc: SPBenchConfig, case: Case, ranks: list[dict], row: dict) -> dict[str, Any]:
    """Per-step max over ranks, best of the timed steps, bytes checked against the formula."""
    timed = [i for i, s in enumerate(ranks[0]["steps"]) if not s["warmup"]]
    step_all = [max(r["steps"][i]["step_s"] for r in ranks) for i in timed]
    best = min(range(len(timed)), key=lambda j: step_all[j])
    i = timed[best]
    s0 = ranks[0]["steps"][i]
    e = 2 if bc.precision == "bf16" else 4
    want = collective_bytes_per_layer(
        "linear" if case.variant == "linear" else "dense", seq_len=case.n, sp_size=case.p,
        batch_size=1, hidden_size=bc.hidden, k=bc.k, bytes_per_element=e,
    )  # fmt: skip
    if case.ac:  # the recomputed forward exchanges its summaries again during backward
        want["backward"] += want["forward"]
    # global_label_count (one float32 all-reduce) runs before the counted forward
    fwd_layer = s0["sp_fwd_bytes"] / bc.layers
    bwd_layer = s0["sp_bwd_bytes"] / bc.layers
    row.update(
        step_s=step_all[best],
        step_s_all=step_all,
        tokens_per_s=case.n / step_all[best],
        sp_fwd_bytes_per_layer=fwd_layer,
        sp_bwd_bytes_per_layer=bwd_layer,
        formula_fwd=want["forward"],
        formula_bwd=want["backward"],
        bytes_match=fwd_layer == want["forward"] and bwd_layer == want["backward"],
        sp_comm_s=max(r["steps"][i]["sp_comm_s"] for r in ranks),
        grad_reduce_bytes=s0["other_bytes"],
        sp_grad_bytes=s0["sp_grad_bytes"],  # sharded: replicated gradients summed over SP
        grad_reduce_s=max(r["steps"][i]["other_comm_s"] for r in ranks),
        loss=sum(r["steps"][i]["loss"] for r in ranks),
        loss_first=sum(r["steps"][0]["loss"] for r in ranks),  # before any update
        peak_rss_per_rank=[r["peak_rss"] for r in ranks],
        rss_after_imports=[r["rss_after_imports"] for r in ranks],
        rss_after_init=[r["rss_after_init"] for r in ranks],
        threads_per_rank=ranks[0]["threads"],
        step_peak_rss_per_rank=[r["steps"][i]["peak_rss"] for r in ranks],
        breakdown_per_rank=[breakdown(r, r["steps"][i]) for r in ranks],
    )
    for key in ("model_param_bytes", "optimizer_bytes", "positions_local", "positions_full",
                "E_local", "E_full"):  # fmt: skip
        row[key] = ranks[0][key]
    return row


# ===================================================================================== trainer
def _is_rank(cmdline: list[str]) -> bool:
    return any(a.endswith("pretrain.py") for a in cmdline[:3]) and not any(
        "deepspeed.launcher" in a for a in cmdline
    )


def run_trainer(bc: SPBenchConfig) -> dict[str, Any]:
    """One step of launch/pretrain.py on ``--trainer-data`` with P ranks; per-rank peak RSS."""
    data = Path(bc.trainer_data)  # type: ignore[arg-type]
    manifest = json.loads((data / "manifest.json").read_text())
    n = int(manifest["seq_len"])
    p = bc.trainer_sp
    run_dir = Path(tempfile.mkdtemp(prefix="sp_bench_trainer_"))  # metrics.jsonl, logs
    model = dataclasses.replace(model_config(bc, "linear", n), vocab_size=manifest["vocab_size"])
    overrides = [
        f"data.path={data}", f"logging.dir={run_dir}", *model_overrides(model),
        "train.micro_batch_size=1", "train.gradient_accumulation_steps=1", "train.max_steps=1",
        "train.log_interval=1",
        "train.eval_interval=0", "checkpoint.save_interval=0", "checkpoint.save_final=false",
        f"deepspeed.precision={bc.precision}", f"deepspeed.zero.stage={bc.trainer_zero}",
        f"parallel.sequence_parallel_size={p}", "logging.tensorboard=false",
        "scheduler.warmup_steps=1", f"parallel.shard_sequence_parameters={str(bc.shard).lower()}",
    ] + list(bc.trainer_overrides)  # fmt: skip
    cmd = ["deepspeed", "--num_gpus", str(p), "--master_port", str(free_port()),
           str(REPO / "launch" / "pretrain.py"), "--config", str(REPO / "configs" / "tiny_cpu.yaml"),
           ] + overrides  # fmt: skip
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS=str(max(1, bc.threads // p)),
               PYTHONUNBUFFERED="1")  # fmt: skip
    row: dict[str, Any] = {"phase": "trainer", "n": n, "p": p, "zero": bc.trainer_zero,
                           "command": " ".join(cmd)}  # fmt: skip
    log = Path(bc.out) / "trainer.log"
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
        root = psutil.Process(proc.pid)
        peaks: dict[int, int] = {}

        def alive() -> bool:
            try:  # the rank processes, not the launcher's (whose arguments name the script too)
                kids = [c for c in root.children(recursive=True) if _is_rank(c.cmdline())]
            except psutil.Error:
                kids = []
            for pid, rss in _tree_rss(kids).items():
                peaks[pid] = max(peaks.get(pid, 0), rss)
            return proc.poll() is None

        procs = [root]
        why = watch(procs + root.children(recursive=True), alive, bc,
                    t0 + bc.case_timeout_s)  # fmt: skip
        if why:
            for c in root.children(recursive=True):
                c.kill()
        proc.wait()
    text = log.read_text()
    row["wall_s"] = time.monotonic() - t0
    row["returncode"] = proc.returncode
    row["peak_rss_per_rank_sampled"] = sorted(peaks.values(), reverse=True)
    if why or proc.returncode != 0:
        row["failed"] = why or f"failed: exit {proc.returncode}: " + text.strip()[-400:]
    recs = read_jsonl(run_dir / "metrics.jsonl")
    shutil.rmtree(run_dir, ignore_errors=True)
    train = [r for r in recs if r.get("split") == "train"]
    if train:
        row["metrics"] = train[-1]
    m = re.search(r"params=([\d.]+)M", text)
    row["params_m"] = float(m.group(1)) if m else None
    return row


# ====================================================================================== outputs
def _mib(x: float | None) -> str:
    return "" if x is None else f"{x / MIB:,.0f}"


def _bytes(x: float) -> str:
    if x >= MIB:
        return f"{x / MIB:,.2f} MiB"
    return f"{x / 1024:,.1f} KiB" if x >= 1024 else f"{x:.0f} B"


def _per_rank(xs: list[int | None]) -> str:
    """MiB per rank, ``a / b``; n/a where a rank could not tell."""
    return " / ".join(_mib(x) for x in xs) if None not in xs else "n/a"


def _table(rows: list[dict], columns: str, align: str, head: Any, cells: Any) -> list[str]:
    """One markdown table: ``head(r)`` the leading cells of a row, ``cells(r)`` the rest; a row
    that failed (or was skipped) says why across the rest. Nothing when there are no rows."""
    if not rows:
        return []
    width = align.count("|") - 1
    out = [columns, align]
    for r in rows:
        lead = "| " + " | ".join(head(r)) + " |"
        why = r.get("failed") or r.get("skipped")
        if why:
            out.append(f"{lead} {why} " + "|" * (width - len(head(r))))
        else:
            out.append(f"{lead} " + " | ".join(cells(r)) + " |")
    return out + [""]


def _comm_cells(r: dict) -> list[str]:
    return [
        f"{r['step_s']:.2f}", f"{r['tokens_per_s']:,.0f}",
        _bytes(r["sp_fwd_bytes_per_layer"] + r["sp_bwd_bytes_per_layer"]),
        "equal" if r["bytes_match"] else "DIFFERS", f"{r['sp_comm_s']:.3f}",
        _bytes(r["grad_reduce_bytes"]), f"{r['grad_reduce_s']:.3f}",
        _per_rank(r["peak_rss_per_rank"]),
    ]  # fmt: skip


def _memory_cells(r: dict) -> list[str]:
    return [
        f"{r['step_s']:.2f}", _per_rank(r["peak_rss_per_rank"]),
        _mib(r["rss_after_imports"][0]),
        _mib(r["model_param_bytes"]), _mib(r["optimizer_bytes"]),
        f"{r['positions_local'] / r['positions_full']:.2f}",
        f"{r['E_local'] / max(r['E_full'], 1):.2f}",
    ]  # fmt: skip


def _breakdown_cell(r: dict) -> str:
    """Rank 0's peak in step 2 by part (MiB): params / grads / optimizer / activations / other
    / libraries."""
    b = (r.get("breakdown_per_rank") or [None])[0]
    return " / ".join(_mib(b[k]) for k in BREAKDOWN) if b else "n/a"


def _frontier_cells(r: dict) -> list[str]:
    return [
        f"{r['step_s']:.2f}", f"{r['tokens_per_s']:,.0f}", _per_rank(r["step_peak_rss_per_rank"]),
        _breakdown_cell(r), _per_rank(r["peak_rss_per_rank"]), _mib(r["model_param_bytes"]),
        _mib(r["optimizer_bytes"]),
    ]  # fmt: skip


# phase: header, alignment, leading cells (what the row is), the numbers
TABLES = [
    ("comm",
     "| variant | N | P | step (s) | tokens/s | SP bytes/layer fwd+bwd | formula | SP comm (s) | "
     "grad-reduce bytes/step | grad-reduce (s) | peak RSS/rank (MiB) |",
     "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|",
     lambda r: [r["variant"], f"{r['n']:,}", str(r["p"])], _comm_cells),
    ("memory",
     "| N | P | ZeRO | step (s) | peak RSS per rank (MiB) | RSS after imports | params held (MiB) "
     "| optimizer held (MiB) | positions held | E held |",
     "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
     lambda r: [f"{r['n']:,}", str(r["p"]), str(r["zero"])], _memory_cells),
    ("frontier",
     "| N | P | act. ckpt | E/positions | step 2 (s) | tokens/s | peak RSS in step 2 per rank "
     "(MiB) | rank 0's peak: params / grads / optimizer / activations / other / libraries (MiB) "
     "| peak RSS per rank (MiB) | params held (MiB) | optimizer held (MiB) |",
     "|---:|---:|---|---|---:|---:|---|---|---|---:|---:|",
     lambda r: [f"{r['n']:,}", str(r["p"]), r.get("ac_granularity", "on") if r["ac"] else "off",
                "sharded" if r["shard"] and r["p"] > 1 else "whole"], _frontier_cells),
]  # fmt: skip


def markdown(results: dict[str, Any]) -> str:
    """The rows as markdown tables (one per phase)."""
    bc = results["config"]
    rows = results["rows"]
    out = [f"Model: {bc['layers']} layers, hidden {bc['hidden']}, {bc['heads']} heads, k "
           f"{bc['k']} (layerwise E), FFN {bc['intermediate']}, vocab {bc['vocab']}, "
           f"{bc['precision']}, batch 1, {bc['mlm_fraction']:.0%} labelled; ZeRO-{bc['zero']} "
           f"unless stated; {bc['threads']} threads shared by the ranks.", ""]  # fmt: skip
    for phase, columns, align, head, cells in TABLES:
        out += _table([r for r in rows if r["phase"] == phase], columns, align, head, cells)
    for r in rows:
        if r["phase"] == "trainer":
            m = r.get("metrics", {})
            out += [
                f"Trainer: N={r['n']:,}, P={r['p']}, ZeRO-{r['zero']}, params "
                f"{r.get('params_m')}M: {r.get('failed') or 'one step done'}; loss "
                f"{m.get('loss')}, {m.get('tokens_per_s', 0):,.0f} tokens/s, trainer's peak_mem_gb "
                f"(rank 0) {m.get('peak_mem_gb')}; peak "
                f"RSS per rank (sampled) {[_mib(x) for x in r['peak_rss_per_rank_sampled']]} "
                f"MiB; wall {r['wall_s']:.0f} s", ""]  # fmt: skip
    return "\n".join(out)


def plan(bc: SPBenchConfig) -> list[Case]:
    """The configurations of the comm and memory phases, in run order."""
    cases = []
    if "comm" in bc.phases:
        for n in bc.seq_lens:
            for v in bc.variants:
                cases.append(Case("comm", v, n, bc.sp, bc.zero, shard=bc.shard))
    if "memory" in bc.phases:
        for p in bc.memory_sp:
            cases.append(Case("memory", "linear", bc.memory_seq_len, p, bc.zero, shard=bc.shard))
        for z in bc.zero_sweep:
            if z != bc.zero or bc.zero_sweep_sp not in bc.memory_sp:
                cases.append(Case("memory", "linear", bc.memory_seq_len, bc.zero_sweep_sp, z,
                                  shard=bc.shard))  # fmt: skip
    if "frontier" in bc.phases:  # the second step: the optimizer state exists by then
        for n in bc.frontier_seq_lens:
            for p in bc.frontier_sp:
                for ac in bc.frontier_ac:
                    cases.append(Case("frontier", "linear", n, p, bc.zero, ac=bool(ac),
                                      ac_granularity=bc.ac_granularity, shard=bc.shard,
                                      steps=2))  # fmt: skip
    return cases


def run(bc: SPBenchConfig) -> dict[str, Any]:
    """Every configuration in turn; results.json and results.md written after each."""
    bc.validate()
    out = Path(bc.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"config": asdict(bc), "environment": environment("bench.sp_bench"),
                               "rows": []}  # fmt: skip

    def save() -> None:
        results["environment"]["load_avg_end"] = os.getloadavg()
        (out / "results.json").write_text(json.dumps(results, indent=1))
        (out / "results.md").write_text(markdown(results) + "\n")

    for case in plan(bc):
        limit = bc.max_n.get(case.variant)
        if limit is not None and case.n > limit:
            row = {**asdict(case), "skipped": f"N > --max-n {case.variant}={limit}"}
        else:
            t0 = time.monotonic()
            try:
                row = run_case(bc, case)
            except Exception:  # noqa: BLE001 - one configuration's failure is a row, not a crash
                row = {**asdict(case), "failed": "failed: " + traceback.format_exc()[-300:]}
            row["wall_s"] = time.monotonic() - t0
        results["rows"].append(row)
        print(f"[sp_bench] {json.dumps({k: v for k, v in row.items() if 'all' not in k})}",
              flush=True)  # fmt: skip
        save()
    if "trainer" in bc.phases:
        results["rows"].append(run_trainer(bc))
        save()
    save()
    return results


def parse_args(argv: list[str] | None = None) -> SPBenchConfig:
    d = SPBenchConfig(**asdict(SMALL_MODEL))
    ap = argparse.ArgumentParser(
        prog="python -m bench.sp_bench", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--phases", nargs="+", default=d.phases, choices=PHASES)
    ap.add_argument("--seq-lens", nargs="+", type=int, default=d.seq_lens)
    ap.add_argument("--sp", type=int, default=d.sp, help="P of the comm phase")
    ap.add_argument("--variants", nargs="+", default=d.variants)
    ap.add_argument(
        "--max-n",
        nargs="*",
        default=[f"{k}={v}" for k, v in d.max_n.items()],
        help="VARIANT=N: largest N run for that variant (e.g. dense=32768)",
    )
    ap.add_argument("--memory-seq-len", type=int, default=d.memory_seq_len)
    ap.add_argument("--memory-sp", nargs="+", type=int, default=d.memory_sp)
    ap.add_argument("--zero-sweep", nargs="*", type=int, default=d.zero_sweep)
    ap.add_argument("--zero-sweep-sp", type=int, default=d.zero_sweep_sp)
    ap.add_argument("--frontier-seq-lens", nargs="+", type=int, default=d.frontier_seq_lens)
    ap.add_argument("--frontier-sp", nargs="+", type=int, default=d.frontier_sp)
    ap.add_argument("--frontier-ac", nargs="+", type=int, default=d.frontier_ac, choices=(0, 1),
                    help="activation checkpointing off (0) and/or on (1)")  # fmt: skip
    ap.add_argument("--ac-granularity", default=d.ac_granularity, choices=("layer", "sublayer"),
                    help="act. ckpt on: per layer, or per sub-layer (attention and feed-forward "
                    "apart: the backward holds one sub-layer's activations)")  # fmt: skip
    ap.add_argument("--no-shard", dest="shard", action="store_false",
                    help="P > 1: every rank holds E/F and the position table whole (the "
                    "'before' rows); default: sharded over the SP ranks, as the trainer")  # fmt: skip
    ap.add_argument("--trainer-data", default=d.trainer_data)
    ap.add_argument("--trainer-sp", type=int, default=d.trainer_sp)
    ap.add_argument("--trainer-zero", type=int, default=d.trainer_zero)
    ap.add_argument("--trainer-overrides", nargs="*", default=[])
    for name in ("zero", "layers", "hidden", "heads", "k", "intermediate", "vocab", "warmup",
                 "iters", "threads", "seed"):  # fmt: skip
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    ap.add_argument("--precision", default=d.precision, choices=("fp32", "bf16"))
    ap.add_argument("--mlm-fraction", type=float, default=d.mlm_fraction)
    ap.add_argument("--min-available-gb", type=float, default=d.min_available_gb)
    ap.add_argument("--case-timeout-s", type=float, default=d.case_timeout_s)
    ap.add_argument("--out", default=d.out)
    a = ap.parse_args(argv)
    kw = {k: v for k, v in vars(a).items() if k != "max_n"}
    return SPBenchConfig(**{**asdict(SMALL_MODEL), **kw, "max_n": parse_max_n(a.max_n)})


def main(argv: list[str] | None = None) -> int:
    try:
        bc = parse_args(argv)
        bc.validate()
    except BenchError as e:
        print(f"sp_bench: {e}", file=sys.stderr)
        return 2
    res = run(bc)
    print(markdown(res))
    return 1 if any("failed" in r for r in res["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
