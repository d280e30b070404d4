"""The Trainer: pretraining with DeepSpeed as an object, top to bottom: job config -> world ->
data -> checkpoints -> model -> engine -> metrics -> loop. Each concern is one component module
(engine, optim, metrics, checkpointing, data, loss); this file only orders them.

The process around it (the command line, signal handlers, the start-up watchdog, exit) is
:mod:`linformer_ds.train`, which hands it in (:class:`Process`); test instruments come in as
hooks (:class:`TrainerHook`). This module installs no signal handler: a Trainer built in a
caller's own process (a notebook, a test) leaves the process's signal handling as it was.

Exactness: randomness of every optimizer step is re-seeded from (seed, step, rank) and MLM
masks depend only on (seed, epoch, sample index), so a resumed run reproduces the losses (and
logged metrics) of an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from linformer_ds import engine as eng
from linformer_ds.checkpoint.io import check_writable
from linformer_ds.checkpoint.manager import CheckpointManager
from linformer_ds.checkpoint.tags import latest_tag
from linformer_ds.compile import compile_engine
from linformer_ds.config import ConfigError, JobConfig, to_yaml
from linformer_ds.context_meter import set_output_bias, train_meters, with_mixture_meter
from linformer_ds.cpu_threads import apply_threads, thread_plan
from linformer_ds.data.shards import DataError, ShardDataset
from linformer_ds.data.stages import Stage, combine_eval, open_stages, resolve_stages
from linformer_ds.data.stream import TrainData
from linformer_ds.dirlock import LOCK_NAME, DirLock, run_dir_locks
from linformer_ds.dist_env import setup_distributed_env
from linformer_ds.engine import all_reduce_sum
from linformer_ds.evaluate import evaluate
from linformer_ds.log import get_logger
from linformer_ds.loss import LossScaling
from linformer_ds.metrics import (
    NUM_STATS,
    STAT_NONFINITE,
    STAT_STOP,
    Metrics,
    check_sinks,
    step_stats,
)
from linformer_ds.parallel.parallelize import parallelize
from linformer_ds.perf import slow_kernels
from linformer_ds.resolve import resolve
from linformer_ds.resume_policy import record_start
from linformer_ds.versions import check_versions
from linformer_ds.warm_start import WarmStart
from linformer_ds.watchdog import StartUpPhases

EXIT_PREEMPTED = 75  # a signal asked us to stop; a checkpoint was written (EX_TEMPFAIL)
EXIT_NONFINITE = 3  # non-finite loss with train.nonfinite=stop
WARN = logging.WARNING  # [warn] lines (stderr); progress is INFO (stdout): linformer_ds.log

log = get_logger(__name__)


def rank0_log(msg: str, level: int = logging.INFO) -> None:
    """``msg`` through the package logger, on rank 0 only (RANK unset: a single process)."""
    if int(os.environ.get("RANK", "0")) == 0:
        log.log(level, msg)


@dataclasses.dataclass
class Process:
    """What a Trainer needs of the process it runs in, made once the versions are checked
    (``Trainer(start_process=...)``; the command line's: :func:`linformer_ds.train.start_process`).

    ``env``: the launcher's answer (:func:`~linformer_ds.dist_env.setup_distributed_env`);
    ``stop_signal()``: the stop signal received so far (SIGUSR1/SIGTERM/SIGINT) or None, the
    loop checkpoints and stops at the next step when a rank has one; ``watchdog``: told each
    start-up phase, it releases the Trainer's locks (``on_leave``) before it ends the process.
    """

    env: dict[str, Any]
    stop_signal: Callable[[], int | None]
    watchdog: StartUpPhases

    @classmethod
    def quiet(cls, cfg: JobConfig) -> Process:  # noqa: ARG003 (a start_process)
        """A Trainer in a caller's process: the launcher's answer only; no signal handler, no
        watchdog thread (a signal does what the caller's handlers do)."""
        return cls(setup_distributed_env(), lambda: None, StartUpPhases())


class TrainerHook(Protocol):
    """A test instrument the Trainer runs (``Trainer(hooks=[...])``); the command line passes
    those the job config's ``debug.*`` keys ask for (:func:`linformer_ds.testing.trainer_hooks`),
    a normal run none."""

    def attach(self, trainer: Trainer) -> None:
        """Once the Trainer is built (resumed, before its first step)."""

    def step(self, step: int) -> AbstractContextManager[None]:
        """Around the optimizer step ``step`` (:meth:`Trainer.train_step`)."""

    def loss(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        """Each micro-batch's loss of step ``step``, before backward."""

    def close(self) -> None: ...


def nonfinite_verdict(
    cfg: JobConfig, step: int, nonfinite: int, applied: bool | None
) -> str | None:
    """The non-finite policy in one place. ``applied`` is None before the optimizer step (the
    all-reduced count of non-finite micro-batches is known), else whether DeepSpeed applied it.
    Returns why the run must stop, or None (a skipped step is reported here)."""
    fp16 = cfg.deepspeed.precision == "fp16"
    if applied is None:
        if nonfinite and cfg.train.nonfinite == "stop" and not fp16:
            return f"non-finite loss at step {step} on {nonfinite} micro-batch(es)"
        return None
    if not applied:
        msg = f"step {step}: non-finite {'loss' if nonfinite else 'gradients'}"
        if fp16:
            rank0_log(f"[warn] {msg} (fp16 overflow); step skipped, loss scale lowered", WARN)
        elif cfg.train.nonfinite == "skip":
            rank0_log(f"[warn] {msg}; step skipped (train.nonfinite=skip)", WARN)
        else:
            return msg + " (DeepSpeed skipped the update)"
    elif nonfinite:
        # Only reachable if DeepSpeed applied a non-finite update (a configuration without an
        # overflow check): the weights are no longer trustworthy.
        return f"step {step}: non-finite loss and DeepSpeed applied the update"
    return None


class StopTraining(Exception):
    """The run ends before ``train.max_steps`` with exit ``code`` (every rank raises it at the
    same step); ``message``: why, for a stop by the non-finite policy."""

    def __init__(self, code: int, message: str | None = None):
        super().__init__(message)
        self.code, self.message = code, message


def data_facts(cfg: JobConfig, stages: list[Stage]) -> tuple[list[int], list[str] | None]:
    """N of every stage of the run (its first source's train split) and the packing of every
    training source, read from the manifests before the data is opened so the config is
    resolved first; empty and None when one cannot be read (opening the data then says why)."""
    try:
        # each source's train split opened once for both facts
        opened = {p: ShardDataset(p, cfg.data.train_split) for s in stages for p in s.paths}
        seq_lens = [opened[s.paths[0]].seq_len for s in stages]
        return seq_lens, [str(d.manifest.get("packing")) for d in opened.values()]
    except (ConfigError, DataError, OSError):
        return [], None


class Trainer:
    """Pretraining as an object: construction builds the components from the job config
    (world, data, checkpoints, model and engine, metrics) and resumes; :meth:`train_step` is one
    optimizer step, :meth:`train` the loop, :meth:`close` releases the sinks and hooks.

    The components own their state: the data stream and the metrics window register with the
    checkpoint manager, which decides when to save (interval, final, signal) and restores them.
    """

    def __init__(
        self,
        cfg: JobConfig,
        stages: list[Stage] | None = None,
        *,
        start_process: Callable[[JobConfig], Process] = Process.quiet,
        hooks: Sequence[TrainerHook] = (),
    ):
        """``stages``: ``resolve_stages(cfg)``'s result when the caller already has it (the
        launcher checks them before any work); otherwise resolved here. ``start_process``: the
        process's side (signals, watchdog), called once the versions are checked; by default
        none (:meth:`Process.quiet`). ``hooks``: test instruments (:class:`TrainerHook`)."""
        self.run_locks: list[DirLock] = []  # rank 0: logging.dir and checkpoint.dir
        self.hooks = list(hooks)
        try:
            self._init(cfg, stages, start_process)
        except BaseException:  # a failed start leaves the directories to the next owner
            release_locks(self.run_locks)
            raise

    def _init(self, cfg: JobConfig, stages: list[Stage] | None,
              start_process: Callable[[JobConfig], Process]) -> None:  # fmt: skip

        check_versions()  # deepspeed/torch in the tested range (LINFORMER_DS_UNTESTED_DEPS=1)
        self.cfg = cfg
        self.process = start_process(cfg)  # the command line's: signal handler, then watchdog
        self.env, self.watchdog = self.process.env, self.process.watchdog
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        # threads from the CPUs this rank has (or train.threads); the wait policy it started with
        self.threads = thread_plan(cfg.train.threads, cfg.train.omp_wait_policy)
        apply_threads(self.threads)
        if self.threads.warning:
            rank0_log(f"[warn] {self.threads.warning}", WARN)
        self.watchdog.on_leave = lambda: release_locks(self.run_locks)  # no stale lock left
        self.watchdog.set_phase("data loading")
        # the config's one resolution (auto precision and sharding for the data's N, the checks
        # that need the world or N); every component is built from the frozen result
        if stages is None:  # data.sources and train.stages, once for the run
            stages = resolve_stages(cfg)
        seq_lens, packings = data_facts(cfg, stages)
        self.cfg = cfg = resolve(cfg, self.world, seq_lens, packings, stages)
        check_sinks(cfg)  # logging.sinks: before any data or engine work
        self._build_data()  # data and checkpoints: checked before any collective starts
        self._build_engine()
        self._build_metrics()
        self.compiled = compile_engine(self.engine, cfg, self.metrics)  # train.compile
        self.watchdog.set_phase("checkpoint load")
        self.step = self.checkpoints.resume(self.engine)
        if self.checkpoints.tag is not None:
            self.metrics.on_resume(self.step, self.checkpoints.load_seconds)
        else:
            rank0_log(to_yaml(cfg))
        self._print_setup()
        for line in slow_kernels(cfg.model, self.device):  # a setting that costs speed here
            rank0_log(f"[warn] {line}", WARN)
        self._enter_stage(self.step + 1)  # a resumed run: the stage of its next step
        for hook in self.hooks:  # test instruments (debug.*): sample log, host-sync counts
            hook.attach(self)
        self.end = cfg.train.max_steps
        if cfg.train.stop_at_step is not None:
            self.end = min(self.end, cfg.train.stop_at_step)
        self.stop_requested = False
        # a signal from here on checkpoints at the next step (config.json is then current)
        self.watchdog.training_started()
        if self.rank == 0:  # the start succeeded: config.json is what this segment uses
            record_start(cfg, self.step, self.checkpoints.tag, self.checkpoints.changes)

    # ------------------------------------------------------------------------- components
    def _build_data(self) -> None:
        cfg = self.cfg
        # data.path or data.sources, in train.stages (one stage by default): every source opened
        # and checked (tokenizer, N per stage, N against the model) before any collective
        evaluating = cfg.train.eval_interval > 0 and cfg.train.eval_batches > 0
        self.stages, self.train_sets, self.valid_sets = open_stages(
            cfg, self.world, evaluating, cfg.resolved.stages
        )
        self.train_ds = self.train_sets[self.stages[0].names[0]]  # the tokenizer is shared
        self.isolation = cfg.resolved.document_isolation  # decided by resolve()
        self.run_locks = hold_run_dirs(cfg, self.rank)  # one owner per directory, run's life
        self.checkpoints = CheckpointManager(cfg, self.rank, self.world, self.train_ds)
        if self.rank == 0:
            check_writable(cfg.logging.dir, "logging.dir")
        self.checkpoints.prepare()
        self.warm = WarmStart.for_run(cfg, self.checkpoints.tag, self.train_ds)  # checked here
        self.unigram = self._context_meters() if evaluating else {}

    def _context_meters(self) -> dict[str, Any]:
        """The context meter of each source (linformer_ds.context_meter): its train split's
        unigram counts from the manifest, the run directory's cache, or counted (and cached by
        rank 0) here."""
        t0 = time.perf_counter()
        meters, how = train_meters(self.train_sets, self.cfg.logging.dir, self.rank == 0)
        rank0_log(f"[meter] unigram counts of the train split: {how}; "
                    f"{time.perf_counter() - t0:.1f} s")  # fmt: skip
        return meters

    def _build_engine(self) -> None:

        cfg = self.cfg
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.watchdog.set_phase("process-group init")
        self.w = eng.init_world(cfg, self.rank, self.world, local_rank)
        self.watchdog.set_phase("engine build")
        self.device = self.w.device
        overrides = self.checkpoints.ds_config_overrides()
        self.ds_config = eng.final_deepspeed_config(cfg, self.world, overrides)
        self.groups = eng.init_sequence_parallel(cfg)  # None unless sequence_parallel_size > 1
        g = self.groups
        self.sp_group = g.sp_group if g is not None else None
        self.replica, self.replicas = (g.dp_rank, g.dp_size) if g else (self.rank, self.world)
        self.model = eng.build_model(cfg)
        if cfg.model.output_bias_init == "unigram" and self.checkpoints.tag is None:  # fresh
            meters = self.unigram or self._context_meters()  # (a resumed run loads its bias)
            rank0_log(set_output_bias(self.model, meters, self.stages[0], cfg.model.vocab_size))
        self.warm.load(self.model, rank0_log)  # checkpoint.init_from at a fresh start
        # ids are checked on the host: every row against the data's vocabulary when read
        # (ShardDataset), the data's vocabulary against the model's (check_compatible); the
        # model's own check would read min and max back from the device every micro-batch
        self.model.encoder.check_token_ids = False
        mpu = parallelize(self.model, cfg, self.ds_config, g)  # SP, ZeRO-3 partitions, AC
        self.engine = eng.build_engine(self.model, cfg, self.ds_config, mpu)
        self.loss_scaling = LossScaling.for_job(cfg, self.world)  # the step's count, DeepSpeed's
        self.batches = TrainData(
            self.stages, self.train_sets, self.replica, self.replicas, cfg.train.seed,
            self.device, mlm_probability=cfg.data.mlm_probability,
            short_seq_prob=cfg.data.short_seq_prob, sp_rank=g.sp_rank if g is not None else 0,
            sp_size=cfg.parallel.sequence_parallel_size, document_isolation=self.isolation,
        )  # fmt: skip

    def _build_metrics(self) -> None:

        cfg, n = self.cfg, self.batches.seq_len
        self.metrics = Metrics(
            cfg, self.rank, self.world, self.device,
            flops_per_token=self.model.flops_per_token(n, mlm_fraction=cfg.data.mlm_probability),
            tokens_per_step=self.batches.tokens_per_step(cfg.train.gradient_accumulation_steps),
        )  # fmt: skip
        self.checkpoints.register("data", self.batches)
        self.checkpoints.register("metrics", self.metrics)
        self.checkpoints.on_io = self.metrics.checkpoint_done

    def _print_setup(self) -> None:
        cfg, w = self.cfg, self.w
        rank0_log(
            f"[setup] launcher={self.env.get('launcher')} ranks={self.world} device={w.device} "
            f"backend={w.backend} zero={cfg.deepspeed.zero.stage} "
            f"precision={cfg.deepspeed.precision_text()} "
            f"params={self.model.num_parameters() / 1e6:.2f}M "
            f"schedule={cfg.model.projection_schedule()} "
            f"train_rows={self._train_rows()} seq_len={self.train_ds.seq_len} "
            f"isolation={self.cfg.resolved.isolation_why} {self.threads.setup_text()}"
        )

    def _train_rows(self) -> str:
        """Train rows of every source: ``1200``, or ``1700 (web=1200 code=500)`` for several."""
        rows = {name: len(ds) for name, ds in self.train_sets.items()}
        each = " ".join(f"{name}={n}" for name, n in rows.items())
        return f"{sum(rows.values())} ({each})" if len(rows) > 1 else str(sum(rows.values()))

    # ------------------------------------------------------------------------------- loop
    def train_step(self) -> None:
        """One optimizer step: ``gradient_accumulation_steps`` micro-batches, then the update.

        The step's loss is the sum of cross-entropies over every labelled token of the global
        batch (all ranks, all micro-batches, all sequence slices) over their global count, in
        every layout (see :class:`linformer_ds.loss.LossScaling`). Statistics stay on
        the device; one all-reduce (statistics, non-finite count and the stop request together)
        and one read to the host follow the micro-batches. Raises :class:`StopTraining` when
        the non-finite policy stops the run."""

        cfg, step = self.cfg, self.step + 1
        # Dropout randomness of this step depends only on (seed, step, rank): exact resume.
        torch.manual_seed(cfg.train.seed * 1_000_003 + self.step * 1009 + self.rank)
        t0 = time.perf_counter()
        gas = cfg.train.gradient_accumulation_steps
        micro = [self.metrics.timed_batch(self.batches.next_batch) for _ in range(gas)]
        denom = self.loss_scaling.denominator([b["labels"] for b in micro], self.device)
        stats = torch.zeros(NUM_STATS, dtype=torch.float64, device=self.device)
        for i, batch in enumerate(micro):
            stats += self._forward_backward(batch, step, denom)
            if i < gas - 1:
                self.engine.step()
        agreed = self._all_reduce_to_host(stats)  # Python floats from here on
        nonfinite = int(agreed[STAT_NONFINITE])
        why = nonfinite_verdict(cfg, step, nonfinite, applied=None)
        if why:  # before the boundary step applies the update: all ranks agree
            raise StopTraining(EXIT_NONFINITE, why)
        self.engine.step()
        self.step = step
        applied = self.engine.was_step_applied()
        why = nonfinite_verdict(cfg, step, nonfinite, applied=applied)
        if why:
            raise StopTraining(EXIT_NONFINITE, why)
        self.stop_requested = bool(agreed[STAT_STOP])
        self.metrics.step_done(
            step, agreed[:STAT_STOP], time.perf_counter() - t0, skipped=not applied
        )

    def _forward_backward(
        self, batch: dict[str, torch.Tensor], step: int, denom: torch.Tensor | None
    ) -> torch.Tensor:
        """Forward and backward of one micro-batch; its ``[4]`` statistics (on the device).

        The loss is this micro-batch's sum of cross-entropies over the step's global count
        ``denom``; ``loss_scaling.scale`` undoes DeepSpeed's division by the accumulation steps
        and the data-parallel ranks, so the update follows the gradient of the global mean."""

        extra = {"position_ids": batch["position_ids"]} if "position_ids" in batch else {}
        out = self.engine(
            batch["input_ids"], batch["attention_mask"], labels=batch["labels"],
            loss_denominator=denom, labelled_index=batch["labelled_index"], **extra,
        )  # fmt: skip
        loss = out.loss
        for hook in self.hooks:  # a test instrument may change it (debug.nan_at_step)
            loss = hook.loss(loss, step)
        # statistics first, then the logits go: backward does not need them (cross-entropy
        # keeps its own softmax), and at 1M tokens they are ~150 MiB held through backward
        stats = step_stats(loss, out.labelled_logits, out.labelled_targets, denom)
        del out
        self.engine.backward(self.loss_scaling.scale(loss))
        return stats

    def _all_reduce_to_host(self, stats: torch.Tensor) -> list[float]:
        """``stats`` and this rank's stop request, summed over all ranks: one small
        all-reduce and one read to the host per optimizer step (the step's only one in this
        code; tests/test_host_sync.py counts)."""

        flag = 1.0 if self.cfg.train.save_on_signal and self.process.stop_signal() else 0.0
        # the flag by a fill on the device (a tensor made from a Python list would be a copy
        # from pageable host memory: on CUDA a wait for the device)
        both = torch.cat([stats, torch.full_like(stats[:1], flag)])
        # copy=True: a real copy also on the CPU, where the sync counter sees the read
        return all_reduce_sum(both, self.device).to("cpu", copy=True).tolist()

    def _after_step(self) -> None:
        """Log, evaluate and checkpoint as configured; stop (exit 75) when a rank was signalled."""

        step, cfg = self.step, self.cfg
        if self.metrics.should_log(step):
            extra = self.batches.log_values()  # stage, N, share and epochs of each source
            extra.update(self.compiled.log_values())  # graph breaks, compile time (if compiled)
            self.metrics.log_train(step, self.batches.epoch, self.engine, extra=extra)
        if self.valid_sets and step % cfg.train.eval_interval == 0:
            self.metrics.log_eval(step, self._evaluate_sources(evaluate))
        self.checkpoints.after_step(self.engine, step)
        self._leave_stage(step)
        if self.stop_requested:
            self.checkpoints.on_signal(self.engine, step, self.process.stop_signal())
            rank0_log(f"[preempted] stopped at step {step}; resume continues here")
            raise StopTraining(EXIT_PREEMPTED)

    # ------------------------------------------------------ stages and mixtures (data.stages)
    def _enter_stage(self, step: int) -> None:
        """Move the data to the stage of ``step``; throughput and MFU follow its N and batch;
        the ``[stage]`` line says what it trains on."""
        self.batches.begin_step(step)
        cfg, n = self.cfg, self.batches.seq_len
        self.metrics.enter_stage(
            self.batches.stage_index,
            self.model.flops_per_token(n, mlm_fraction=cfg.data.mlm_probability),
            self.batches.tokens_per_step(cfg.train.gradient_accumulation_steps),
        )
        if len(self.stages) > 1 or not self.batches.legacy:
            rank0_log(self.batches.describe())

    def _leave_stage(self, step: int) -> None:
        """At the end of a stage (or of this process): its ``[stage]`` summary; then the next."""
        stage_end = step == self.batches.stage.end_step
        if len(self.stages) > 1 and (stage_end or step == self.end):
            meter = self.metrics.stage
            f = meter.figures(self.world, self.metrics.peak_tflops)
            rank0_log(
                f"[stage] {self.batches.stage_index} {'done' if stage_end else 'so far'} at "
                f"step {step}: "
                f"steps={meter.steps} N={self.batches.seq_len} "
                f"tokens_per_s={f['tokens_per_s']:.1f} mfu={f['mfu']:.4f} "
                f"peak_mem_gb={f['peak_mem_gb']:.3f}"
            )
        if stage_end and step < self.end:
            self._enter_stage(step + 1)

    def _evaluate_sources(self, evaluate) -> dict[str, float]:
        """Each source of the current stage on its valid split (at the stage's micro-batch);
        the record holds the mixture's figures and each source's (see data.stages.combine_eval)."""

        stage, cfg = self.batches.stage, self.cfg
        if stage.micro_batch_size != cfg.train.micro_batch_size:
            train = dataclasses.replace(cfg.train, micro_batch_size=stage.micro_batch_size)
            cfg = dataclasses.replace(cfg, train=train)
        figures = {
            name: evaluate(self.engine, self.valid_sets[name], cfg, self.replica, self.replicas,
                           self.device, self.sp_group, unigram=self.unigram.get(name),
                           document_isolation=self.isolation)
            for name in stage.names
        }  # fmt: skip
        record = combine_eval(stage, figures, self.batches.legacy)
        return with_mixture_meter(record, stage.names, stage.weights, figures)

    def train(self) -> int:
        """Train to ``train.max_steps`` (or ``stop_at_step``); returns the exit code."""
        self.engine.train()
        self.watchdog.training_started()  # a signal now means: checkpoint at the next step
        if self.step >= self.end:  # resumed at or after the end: say so, train nothing
            rank0_log(self._nothing_to_train() + "\n" + self._where_lines())
            return 0
        try:
            while self.step < self.end:
                with self._hooked(self.step + 1):  # test instruments: debug.sync_log counts it
                    self.train_step()
                self._after_step()
        except StopTraining as stop:
            if stop.message is not None:
                rank0_log(
                    f"[error] {stop.message}; stopping (train.nonfinite=stop). Last good "
                    f"checkpoint: {self.checkpoints.latest() or 'none'}",
                    logging.ERROR,
                )
            return stop.code
        self.checkpoints.on_finish(self.engine, self.step)
        first, last = self.metrics.first_loss, self.metrics.last_loss
        rank0_log(
            f"[done] step {self.step}: first loss {first if first is None else round(first, 4)}"
            f", last loss {last if last is None else round(last, 4)}\n" + self._where_lines()
        )
        return 0

    @contextlib.contextmanager
    def _hooked(self, step: int) -> Iterator[None]:
        """Optimizer step ``step`` inside every hook's :meth:`TrainerHook.step`."""
        with contextlib.ExitStack() as stack:
            for hook in self.hooks:
                stack.enter_context(hook.step(step))
            yield

    def _nothing_to_train(self) -> str:
        """The ``[done]`` line of a run resumed at or after its last step (``self.end``)."""
        t = self.cfg.train
        stop = t.stop_at_step is not None and t.stop_at_step < t.max_steps
        key, end = (
            ("train.stop_at_step", t.stop_at_step) if stop else ("train.max_steps", t.max_steps)
        )
        where = "at" if self.step == end else "past"
        return (
            f"[done] step {self.step}: nothing trained: the checkpoint {self.checkpoints.tag} is "
            f"already {where} {key}={end}; raise {key} to train further"
        )

    def _where_lines(self) -> str:
        """The ``[done]`` lines naming where the results are (TensorBoard only when on)."""
        tb = self.cfg.logging.tensorboard
        return (
            (f"[done] TensorBoard: tensorboard --logdir {self.cfg.logging.dir}\n" if tb else "")
            + f"[done] checkpoints: {self.checkpoints.dir} "
            f"(latest: {latest_tag(self.checkpoints.dir)})"
        )

    def close(self) -> None:
        """Flush and close the metrics sinks (a ``/metrics`` endpoint stops) and the hooks;
        release the run directories' locks."""
        try:
            self.metrics.close()
            for hook in self.hooks:
                hook.close()
        finally:
            release_locks(self.run_locks)


def hold_run_dirs(cfg: JobConfig, rank: int) -> list[DirLock]:
    """Rank 0: lock ``logging.dir`` and ``checkpoint.dir`` for the run's life (another run,
    data_prep or export writing there is refused in one line naming the holder; a lock whose
    holder died is taken over with a note). Other ranks: nothing."""
    if rank != 0:
        return []
    locks: list[DirLock] = []
    try:
        for what, d in (("logging.dir", cfg.logging.dir), ("checkpoint.dir", cfg.checkpoint.dir)):
            if any(os.path.join(os.path.realpath(d), LOCK_NAME) == lk.path for lk in locks):
                continue  # checkpoint.dir = logging.dir: one lock
            check_writable(d, what)
            new = run_dir_locks(os.path.realpath(d), what, "training")  # + the --out lock
            locks += new
            for note in filter(None, (lk.stale_note() for lk in new)):
                rank0_log(note, WARN)
    except BaseException:
        release_locks(locks)
        raise
    return locks


def release_locks(locks: list[DirLock]) -> None:
    for lock in reversed(locks):
        lock.release()
