"""Pretraining with DeepSpeed, top to bottom: job config -> world -> data -> checkpoints ->
model -> engine -> metrics -> loop. Each concern is one component module (engine, optim,
metrics, checkpointing, data, debug); this file only orders them.

Run through any launcher (``deepspeed``, ``torchrun``, ``srun``, ``mpirun``)::

    deepspeed launch/pretrain.py --config configs/base_4096.yaml [key=value ...]

Exactness: randomness of every optimizer step is re-seeded from (seed, step, rank) and MLM
masks depend only on (seed, epoch, sample index), so a resumed run reproduces the losses (and
logged metrics) of an uninterrupted one.
"""

import argparse
import json
import os
import signal
import sys
import time
from typing import Any, List, Optional

import torch

from linformer_ds import checkpointing as ckpt
from linformer_ds.config import ConfigError, JobConfig, load_config, to_yaml, validate
from linformer_ds.debug import SAMPLE_LOG_ENV, TEST_NAN_ENV  # noqa: F401  (re-exported)

EXIT_PREEMPTED = 75  # a signal asked us to stop; a checkpoint was written (EX_TEMPFAIL)
EXIT_NONFINITE = 3  # non-finite loss with train.nonfinite=stop


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Pretrain a Linformer encoder with DeepSpeed.",
        epilog="Overrides: key=value pairs, e.g. train.max_steps=100 model.k=128",
    )
    p.add_argument("--config", help="YAML job config (see configs/)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    return p.parse_args(argv)


def rank0_print(*args: Any, **kwargs: Any) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(*args, **kwargs, flush=True)


class SignalFlag:
    """Records SIGUSR1/SIGTERM; the loop checks it at step boundaries (all ranks agree)."""

    def __init__(self, enabled: bool):
        self.signum: Optional[int] = None
        for s in (signal.SIGUSR1, signal.SIGTERM):
            # launch/pretrain.py records signals from its first line: adopt what came early
            early = list(getattr(signal.getsignal(s), "pending", None) or [])
            self.signum = self.signum or (early[-1] if early else None)
            signal.signal(s, self._handle if enabled else signal.SIG_DFL)
        if not enabled and self.signum is not None:  # the default action, delayed
            os.kill(os.getpid(), self.signum)

    def _handle(self, signum, frame) -> None:  # noqa: ARG002
        self.signum = signum


def nonfinite_verdict(
    cfg: JobConfig, step: int, nonfinite: int, applied: Optional[bool]
) -> Optional[str]:
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
            rank0_print(f"[warn] {msg} (fp16 overflow); step skipped, loss scale lowered")
        elif cfg.train.nonfinite == "skip":
            rank0_print(f"[warn] {msg}; step skipped (train.nonfinite=skip)")
        else:
            return msg + " (DeepSpeed skipped the update)"
    elif nonfinite:
        # Only reachable if DeepSpeed applied a non-finite update (a configuration without an
        # overflow check): the weights are no longer trustworthy.
        return f"step {step}: non-finite loss and DeepSpeed applied the update"
    return None


# ========================================================================================= main
def main(argv: Optional[List[str]] = None) -> int:
    """Run a job; returns the process exit code. Bad input exits 2 with a one-line reason."""
    from linformer_ds.data import DataError
    from linformer_ds.dist_env import DistEnvError

    try:
        return _main(argv)
    except (ConfigError, DataError, DistEnvError, ckpt.CheckpointError) as e:
        prefix = "config error" if isinstance(e, ConfigError) else "error"
        print(f"{prefix}: {e}", file=sys.stderr, flush=True)
        return 2


def run_and_exit(argv: Optional[List[str]] = None) -> None:
    """The command-line entry point: :func:`main`, then leave the process without teardown.

    After a clean end (done, preempted, non-finite stop: every rank got there) the ranks meet
    at a barrier and leave through ``os._exit``. A normal interpreter exit (or
    ``destroy_process_group``) after ZeRO-3 runs destroys gloo's process group while its
    threads are still live and aborts the process ("terminate called without an active
    exception", exit 250; 4 % of 2-rank ZeRO-3 runs here) after all work was done.
    Everything this trainer writes is closed and flushed before main returns.
    """
    code = main(argv)
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        if code in (0, EXIT_PREEMPTED, EXIT_NONFINITE):
            dist.barrier()  # every rank got here: leave together
        # An error after the process group started (exit 2 from one or all ranks) takes the
        # same exit: no barrier (the other ranks may not come), no gloo teardown abort (250).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _main(argv: Optional[List[str]] = None) -> int:
    from linformer_ds import engine as eng
    from linformer_ds.data import MLMMasking, ShardDataset, TrainBatches, check_compatible
    from linformer_ds.debug import DebugHooks
    from linformer_ds.dist_env import setup_distributed_env, start_watchdog
    from linformer_ds.evaluate import evaluate
    from linformer_ds.metrics import Metrics, step_stats
    from linformer_ds.sequence_parallel import global_label_count

    # ---- job config and world (the signal handler first: a preemption notice is never lost)
    args = parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    stop = SignalFlag(cfg.train.save_on_signal)
    env = setup_distributed_env()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # start-up waits end on a signal at once; a rank leaves when its launcher dies
    watchdog = start_watchdog(
        EXIT_PREEMPTED, env["launcher"] != "single", getattr(cfg.parallel, "init_timeout_s", 300.0)
    )
    validate(cfg, world_size=world)
    if args.print_config:
        rank0_print(to_yaml(cfg))
        rank0_print(
            "# derived DeepSpeed config\n"
            + json.dumps(eng.final_deepspeed_config(cfg, world), indent=2)
        )
        return 0

    # ---- data and checkpoints: checked before any collective starts
    train_ds = ShardDataset(cfg.data.path, cfg.data.train_split, cfg.data.verify_checksums)
    check_compatible(train_ds, cfg.model)
    valid_ds = None
    if cfg.train.eval_interval > 0 and cfg.train.eval_batches > 0:
        valid_ds = ShardDataset(cfg.data.path, cfg.data.valid_split, cfg.data.verify_checksums)
        check_compatible(valid_ds, cfg.model)
    if cfg.parallel.sequence_parallel_size > 1:  # N is known now: slices, conv alignment
        validate(cfg, world_size=world, seq_len=train_ds.seq_len)
    checkpoints = ckpt.CheckpointManager(cfg, rank, world)
    if rank == 0:
        ckpt.check_writable(cfg.logging.dir, "logging.dir")
    resume_tag = checkpoints.prepare()

    # ---- world, model, engine
    w = eng.init_world(cfg, rank, world, int(os.environ.get("LOCAL_RANK", "0")))
    ds_config = eng.final_deepspeed_config(cfg, world, checkpoints.ds_config_overrides())
    groups = eng.init_sequence_parallel(cfg)  # None unless parallel.sequence_parallel_size > 1
    sp_group = groups.sp_group if groups is not None else None
    replica, replicas = (groups.dp_rank, groups.dp_size) if groups is not None else (rank, world)
    model = eng.build_model(cfg)
    engine = eng.build_engine(model, cfg, ds_config, groups)
    loss_scale = eng.backward_scale(cfg)
    masker = MLMMasking(
        train_ds.vocab_size,
        train_ds.mask_id,
        train_ds.special_ids,
        mlm_probability=cfg.data.mlm_probability,
        seed=cfg.train.seed,
        pad_id=train_ds.pad_id,
        short_seq_prob=cfg.data.short_seq_prob,
    )
    batches = TrainBatches(
        train_ds, masker, replica, replicas, cfg.train.micro_batch_size, cfg.train.seed, w.device,
        sp_rank=groups.sp_rank if groups is not None else 0,
        sp_size=cfg.parallel.sequence_parallel_size,
    )  # fmt: skip
    step = 0

    # ---- metrics, then resume
    seq_len = train_ds.seq_len
    metrics = Metrics(
        cfg,
        rank,
        world,
        w.device,
        flops_per_token=model.flops_per_token(seq_len, mlm_fraction=cfg.data.mlm_probability),
        tokens_per_step=ds_config["train_batch_size"] * seq_len,
    )
    if resume_tag is not None:
        t_load = time.perf_counter()
        client = checkpoints.load(engine)
        step = int(client["step"])
        try:
            batches.load_state_dict(int(client["epoch"]), client["sampler"])
        except ValueError as e:
            raise ckpt.CheckpointError(f"{checkpoints.dir}/{resume_tag}: {e}") from None
        metrics.load_state_dict(client.get("metrics"))
        metrics.on_resume(step, time.perf_counter() - t_load)
        rank0_print(
            f"[resume] {checkpoints.dir}/{resume_tag}: step {step}, epoch {batches.epoch}, "
            f"sampler consumed {client['sampler']['consumed']} (saved by "
            f"{checkpoints.meta['world_size']} rank(s), now {world})"
        )
    else:
        rank0_print(to_yaml(cfg))
    rank0_print(
        f"[setup] launcher={env.get('launcher')} ranks={world} device={w.device} backend={w.backend} "
        f"zero={cfg.deepspeed.zero.stage} precision={cfg.deepspeed.precision_text()} "
        f"params={model.num_parameters() / 1e6:.2f}M schedule={cfg.model.projection_schedule()} "
        f"train_rows={len(train_ds)} seq_len={seq_len}"
    )
    if cfg.deepspeed.zero.stage == 3:
        for name, p in model.named_parameters():
            if name.startswith("encoder.shared_"):
                print(
                    f"[zero3] rank {rank} holds {p.ds_tensor.numel()}/{p.ds_numel} of {name}",
                    flush=True,
                )

    debug = DebugHooks(rank)
    batches.on_batch = debug.sample_observer(lambda: step + 1)

    def save(reason: str) -> None:
        t0 = time.perf_counter()
        checkpoints.save(
            engine, step, batches.epoch, batches.sampler.state_dict(), train_ds,
            client_extra={"metrics": metrics.state_dict()},
        )  # fmt: skip
        metrics.checkpoint_done("save", time.perf_counter() - t0)
        rank0_print(
            f"[checkpoint] {reason}: {checkpoints.dir}/{ckpt.tag_for(step)} ({time.perf_counter() - t0:.1f}s)"
        )

    def finish(code: int, msg: Optional[str] = None) -> int:
        if msg is not None:
            rank0_print(
                f"[error] {msg}; stopping (train.nonfinite=stop). Last good checkpoint: "
                f"{checkpoints.latest() or 'none'}"
            )
        metrics.close()
        debug.close()
        return code

    # ---- the loop
    engine.train()
    watchdog.training_started()  # a signal now means: checkpoint at the next step
    end = cfg.train.max_steps
    if cfg.train.stop_at_step is not None:
        end = min(end, cfg.train.stop_at_step)
    gas = cfg.train.gradient_accumulation_steps
    while step < end:
        # Dropout randomness of this step depends only on (seed, step, rank): exact resume.
        torch.manual_seed(cfg.train.seed * 1_000_003 + step * 1009 + rank)
        t0 = time.perf_counter()
        stats = torch.zeros(4, dtype=torch.float64)
        for micro in range(gas):
            batch = metrics.timed_batch(batches.next_batch)
            # P > 1: each rank's loss is its slice's share of the replica's mean
            denom = global_label_count(batch["labels"], sp_group) if sp_group else None
            out = engine(
                batch["input_ids"], batch["attention_mask"], labels=batch["labels"],
                loss_denominator=denom,
            )  # fmt: skip
            loss = debug.poison(out.loss, step + 1)
            engine.backward(loss * loss_scale if loss_scale != 1.0 else loss)
            stats += step_stats(loss, out.labelled_logits, out.labelled_targets, denom)
            if micro == gas - 1:  # before the boundary step applies the update: all ranks agree
                why = nonfinite_verdict(
                    cfg, step + 1, int(eng.all_reduce_sum(stats, w.device)[3]), applied=None
                )
                if why:
                    return finish(EXIT_NONFINITE, why)
            engine.step()
        step += 1
        why = nonfinite_verdict(cfg, step, int(stats[3]), applied=engine.was_step_applied())
        if why:
            return finish(EXIT_NONFINITE, why)
        metrics.step_done(
            step, stats, time.perf_counter() - t0, skipped=not engine.was_step_applied()
        )
        if metrics.should_log(step):
            metrics.log_train(step, batches.epoch, engine)
        if valid_ds is not None and step % cfg.train.eval_interval == 0:
            metrics.log_eval(
                step, evaluate(engine, valid_ds, cfg, replica, replicas, w.device, sp_group)
            )
        if cfg.checkpoint.save_interval and step % cfg.checkpoint.save_interval == 0:
            save("interval")
        if (
            cfg.train.save_on_signal
            and eng.all_reduce_sum(torch.tensor([1.0 if stop.signum else 0.0]), w.device).item()
        ):
            if checkpoints.last_saved_step != step:
                save(f"signal {stop.signum}")
            rank0_print(f"[preempted] stopped at step {step}; resume continues here")
            return finish(EXIT_PREEMPTED)

    if cfg.checkpoint.save_final and checkpoints.last_saved_step != step:
        save("final")
    first, last = metrics.first_loss, metrics.last_loss
    rank0_print(
        f"[done] step {step}: first loss {first if first is None else round(first, 4)}"
        f", last loss {last if last is None else round(last, 4)}\n"
        f"[done] TensorBoard: tensorboard --logdir {cfg.logging.dir}\n"
        f"[done] checkpoints: {checkpoints.dir} (latest: {ckpt.latest_tag(checkpoints.dir)})"
    )
    return finish(0)


if __name__ == "__main__":
    run_and_exit()
