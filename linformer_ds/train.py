"""Pretraining with DeepSpeed: config, data, model, loop, eval, checkpoint, in a straight line.

Run through any launcher (``deepspeed``, ``torchrun``, ``srun``, ``mpirun``)::

    deepspeed launch/pretrain.py --config configs/base_4096.yaml [key=value ...]

Exactness: randomness of every optimizer step is re-seeded from (seed, step, rank) and MLM
masks depend only on (seed, epoch, sample index), so a resumed run reproduces the losses of an
uninterrupted one.
"""

import argparse
import functools
import json
import math
import os
import shutil
import signal
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from linformer_ds import checkpointing as ckpt
from linformer_ds.config import (
    ConfigError,
    JobConfig,
    deepspeed_config,
    load_config,
    to_dict,
    to_yaml,
    validate,
)
from linformer_ds.model import LinformerForMaskedLM

EXIT_PREEMPTED = 75  # a signal asked us to stop; a checkpoint was written (EX_TEMPFAIL)
EXIT_NONFINITE = 3  # non-finite loss with train.nonfinite=stop

# Debug/test hooks (environment variables, never set in normal runs; see docs/reliability.md).
SAMPLE_LOG_ENV = "LINFORMER_DS_SAMPLE_LOG"  # dir: each rank appends the sample indices per step
TEST_NAN_ENV = "LINFORMER_DS_TEST_HOOK_NAN_AT_STEP"  # "STEP[:RANK]": TEST HOOK, loss *= NaN


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


# ===================================================================================== schedule
def lr_lambda(cfg: JobConfig):
    """Linear warmup, then linear/cosine decay to ``min_lr_ratio`` at ``max_steps``."""
    warm, total = cfg.scheduler.warmup_steps, cfg.train.max_steps
    floor, decay = cfg.scheduler.min_lr_ratio, cfg.scheduler.decay

    def fn(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        if decay == "constant" or total <= warm:
            return 1.0
        frac = min(1.0, (step - warm) / max(1, total - warm))
        if decay == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac))
        return floor + (1 - floor) * (1 - frac)

    return fn


def param_groups(model: torch.nn.Module, weight_decay: float) -> List[Dict[str, Any]]:
    """No weight decay on biases, LayerNorm and position embeddings; frozen parameters left out."""
    decay, no_decay, seen = [], [], set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if p.dim() < 2 or "position_embeddings" in name or ".ln" in name or "_ln" in name:
            no_decay.append(p)
        else:
            decay.append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


# ======================================================================================== state
@dataclass
class Progress:
    step: int = 0
    epoch: int = 0


class SignalFlag:
    """Records SIGUSR1/SIGTERM; the loop checks it at step boundaries (all ranks agree)."""

    def __init__(self, enabled: bool):
        self.signum: Optional[int] = None
        if enabled:
            for s in (signal.SIGUSR1, signal.SIGTERM):
                signal.signal(s, self._handle)

    def _handle(self, signum, frame) -> None:  # noqa: ARG002
        self.signum = signum


def _all_reduce(t: torch.Tensor, op=None) -> torch.Tensor:
    import deepspeed.comm as dist

    dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t


# ========================================================================================= main
def main(argv: Optional[List[str]] = None) -> int:
    """Run a job; returns the process exit code. Bad input exits 2 with a one-line reason."""
    from linformer_ds.data import DataError
    from linformer_ds.dist_env import DistEnvError

    try:
        return _main(argv)
    except (ckpt.CheckpointError, DataError, ConfigError, DistEnvError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2


def run_and_exit(argv: Optional[List[str]] = None) -> None:
    """The command-line entry point: :func:`main`, then leave the process without teardown.

    After a clean end (done, preempted, non-finite stop: every rank got there) the ranks meet
    at a barrier and leave through ``os._exit``. A normal interpreter exit (or
    ``destroy_process_group``) after ZeRO-3 runs destroys gloo's process group while its
    threads are still live and aborts the process ("terminate called without an active
    exception", exit 250; 4 % of 2-rank ZeRO-3 runs here, 20 % with an explicit
    ``destroy_process_group``) after all work, checkpoints included, was done.
    Everything this trainer writes is closed and flushed before main returns.
    """
    code = main(argv)
    dist = torch.distributed
    if (
        code in (0, EXIT_PREEMPTED, EXIT_NONFINITE)
        and dist.is_available()
        and dist.is_initialized()
    ):
        dist.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr, flush=True)
        return 2

    from linformer_ds.dist_env import setup_distributed_env

    env = setup_distributed_env()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    try:
        validate(cfg, world_size=world)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr, flush=True)
        return 2
    ds_config = deepspeed_config(cfg, world)
    if args.print_config:
        rank0_print(to_yaml(cfg))
        rank0_print("# derived DeepSpeed config\n" + json.dumps(ds_config, indent=2))
        return 0

    if cfg.train.nonfinite == "skip" and cfg.deepspeed.precision == "fp32":
        if cfg.deepspeed.zero.stage == 0:
            raise ConfigError(
                "train.nonfinite: 'skip' needs an optimizer that DeepSpeed can make skip a step "
                "(zero.stage >= 1, or precision bf16/fp16); ZeRO-0 fp32 applies every update"
            )

    # Data first: a bad dataset should fail before any collective starts.
    from linformer_ds.data import (
        DataError,
        MLMMasking,
        ResumableDistributedSampler,
        ShardDataset,
        check_compatible,
    )

    train_ds = ShardDataset(cfg.data.path, cfg.data.train_split, cfg.data.verify_checksums)
    check_compatible(train_ds, cfg.model)
    valid_ds = None
    if cfg.train.eval_interval > 0 and cfg.train.eval_batches > 0:
        valid_ds = ShardDataset(cfg.data.path, cfg.data.valid_split, cfg.data.verify_checksums)
        check_compatible(valid_ds, cfg.model)

    # Checkpoints next (also before any collective): writable directories, and the tag to resume
    # from, validated, with its metadata deciding how DeepSpeed must be configured to load it.
    ckpt_dir = cfg.checkpoint.dir
    ckpt.check_writable(ckpt_dir, "checkpoint.dir")
    if rank == 0:
        ckpt.check_writable(cfg.logging.dir, "logging.dir")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tag, meta = ckpt.select_resume(ckpt_dir, cfg.checkpoint.resume, cfg)
    for w in caught:
        rank0_print(f"[warn] {w.message}")
    universal = tag is not None and ckpt.needs_universal(ckpt_dir, tag, meta, world)
    if universal:
        # The engine's config is fixed at initialize: ask for DeepSpeed's universal loader now.
        ds_config["checkpoint"] = {"load_universal": True}
    if cfg.deepspeed.precision == "bf16":
        ds_config["bf16"]["check_grad_overflow"] = True  # skip non-finite steps (the default)

    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from linformer_ds.dist_env import disable_deepspeed_shm_allreduce

    acc = get_accelerator()
    on_cpu = acc.device_name() == "cpu"
    supported = {"fp16": acc.is_fp16_supported, "bf16": acc.is_bf16_supported}
    if cfg.deepspeed.precision in supported and not supported[cfg.deepspeed.precision]():
        raise ConfigError(
            f"deepspeed.precision: {cfg.deepspeed.precision} is not supported by this machine's "
            f"{acc.device_name()} accelerator (DeepSpeed's check); use "
            f"{'bf16 or fp32' if cfg.deepspeed.precision == 'fp16' else 'fp32'}"
        )
    backend = cfg.deepspeed.dist_backend or ("gloo" if on_cpu else acc.communication_backend_name())
    disable_deepspeed_shm_allreduce()  # training never uses it; it leaks /dev/shm on CPU
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
    device = torch.device("cpu") if on_cpu else torch.device(acc.device_name(local_rank))
    if not on_cpu:
        acc.set_device(local_rank)

    # Model: same init on every rank (seeded), wrapped by DeepSpeed from outside.
    torch.manual_seed(cfg.train.seed)
    model = LinformerForMaskedLM(cfg.model)
    ac = cfg.deepspeed.activation_checkpointing
    if ac.enabled:
        n_layers = ac.number_checkpoints or cfg.model.num_layers
        if ac.partition_activations or ac.cpu_checkpointing:
            deepspeed.checkpointing.configure(None, deepspeed_config=ds_config)
            from deepspeed.runtime.activation_checkpointing.checkpointing import (
                non_reentrant_checkpoint,
            )

            def fn(layer, x, mask, shared):
                # Only the activation goes through DeepSpeed's checkpoint: its partitioned path
                # mis-pairs tensors with their sizes when non-tensor arguments (the shared
                # projection module, a None mask) are passed along (deepspeed 0.19).
                return non_reentrant_checkpoint(lambda h: layer(h, mask, shared), x)
        else:
            # Non-reentrant: correct with the layerwise-shared projection under ZeRO-2/3
            # (reentrant checkpointing triggers DeepSpeed issue 988).
            fn = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
        model.encoder.set_activation_checkpointing(fn, layers=list(range(n_layers)))

    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=param_groups(model, cfg.optimizer.weight_decay),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg)),
        config=ds_config,
        dist_init_required=False,
    )

    masker = MLMMasking(
        train_ds.vocab_size,
        train_ds.mask_id,
        train_ds.special_ids,
        mlm_probability=cfg.data.mlm_probability,
        seed=cfg.train.seed,
        pad_id=train_ds.pad_id,
    )
    sampler = ResumableDistributedSampler(len(train_ds), rank, world, seed=cfg.train.seed)
    prog = Progress()

    if tag is not None:
        assert meta is not None
        import deepspeed.comm as dist

        load_dir = None
        if universal:
            rank0_print(
                f"[resume] {ckpt_dir}/{tag} was saved by {meta['world_size']} rank(s), this run "
                f"has {world}: converting it to a universal checkpoint"
            )
            if rank == 0:
                ckpt.convert_to_universal(ckpt_dir, tag)
            dist.barrier()
            load_dir = os.path.join(ckpt_dir, ckpt.UNIVERSAL_DIR)
        client = ckpt.load(engine, ckpt_dir, tag, cfg, load_dir=load_dir)
        if universal:
            dist.barrier()
            if rank == 0:  # derived data: the next save writes a native checkpoint
                shutil.rmtree(os.path.join(ckpt_dir, ckpt.UNIVERSAL_DIR), ignore_errors=True)
        prog.step, prog.epoch = int(client["step"]), int(client["epoch"])
        try:
            sampler.load_state_dict(client["sampler"])
        except ValueError as e:
            raise ckpt.CheckpointError(f"{ckpt_dir}/{tag}: {e}") from None
        rank0_print(
            f"[resume] {ckpt_dir}/{tag}: step {prog.step}, epoch {prog.epoch}, "
            f"sampler consumed {client['sampler']['consumed']} (saved by {meta['world_size']} "
            f"rank(s), now {world})"
        )
    sampler.set_epoch(prog.epoch)

    log = MetricsLogger(cfg, rank)
    if tag is None:
        rank0_print(to_yaml(cfg))
    n_params = model.num_parameters()
    rank0_print(
        f"[setup] launcher={env.get('launcher')} ranks={world} device={device} backend={backend} "
        f"zero={cfg.deepspeed.zero.stage} precision={cfg.deepspeed.precision} "
        f"params={n_params / 1e6:.2f}M schedule={cfg.model.projection_schedule()} "
        f"train_rows={len(train_ds)} seq_len={train_ds.seq_len}"
    )

    if cfg.deepspeed.zero.stage == 3:
        for name, p in model.named_parameters():
            if name.startswith("encoder.shared_"):
                print(
                    f"[zero3] rank {rank} holds {p.ds_tensor.numel()}/{p.ds_numel} of {name}",
                    flush=True,
                )

    peak = cfg.train.peak_tflops
    if peak is None:
        from linformer_ds.perf import measure_matmul_peak_tflops

        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
            cfg.deepspeed.precision, torch.float32
        )
        peak = measure_matmul_peak_tflops(
            dtype, str(device), size=2048 if on_cpu else 8192, repeats=5
        )
    seq_len = train_ds.seq_len
    flops_tok = model.flops_per_token(seq_len, mlm_fraction=cfg.data.mlm_probability)

    stop = SignalFlag(cfg.train.save_on_signal)
    it = iter(sampler)
    sample_log = None
    if os.environ.get(SAMPLE_LOG_ENV):
        os.makedirs(os.environ[SAMPLE_LOG_ENV], exist_ok=True)
        sample_log = open(
            os.path.join(os.environ[SAMPLE_LOG_ENV], f"samples.rank{rank}.jsonl"), "a"
        )
    nan_step, nan_rank = _parse_nan_hook(os.environ.get(TEST_NAN_ENV, ""))

    def next_batch() -> Dict[str, torch.Tensor]:
        nonlocal it
        idx: List[int] = []
        while len(idx) < cfg.train.micro_batch_size:
            try:
                idx.append(next(it))
            except StopIteration:
                prog.epoch += 1
                sampler.set_epoch(prog.epoch)
                it = iter(sampler)
                if len(sampler) == 0:
                    raise DataError(
                        f"{cfg.data.path}: the train split has {len(train_ds)} rows: too few "
                        f"for {world} ranks"
                    ) from None
        if sample_log is not None:
            rec = {"step": prog.step + 1, "epoch": prog.epoch, "rank": rank, "indices": idx}
            sample_log.write(json.dumps(rec) + "\n")
            sample_log.flush()
        tokens = torch.stack([train_ds[i] for i in idx])
        batch = masker(tokens, torch.tensor(idx), prog.epoch)
        return {k: v.to(device) for k, v in batch.items()}

    def save(reason: str) -> None:
        t0 = time.perf_counter()
        ckpt.save(engine, cfg, ckpt_dir, prog.step, prog.epoch, sampler.state_dict(), train_ds)
        rank0_print(
            f"[checkpoint] {reason}: {ckpt_dir}/{ckpt.tag_for(prog.step)} "
            f"({time.perf_counter() - t0:.1f}s)"
        )

    first_loss = last_loss = None
    last_saved = prog.step if tag is not None else -1
    t_last, steps_since = time.perf_counter(), 0
    acc_loss = torch.zeros(4, dtype=torch.float64)  # loss*n, correct, n, nonfinite
    engine.train()
    end = cfg.train.max_steps
    if cfg.train.stop_at_step is not None:
        end = min(end, cfg.train.stop_at_step)
    while prog.step < end:
        # Dropout randomness of this step depends only on (seed, step, rank): exact resume.
        torch.manual_seed(cfg.train.seed * 1_000_003 + prog.step * 1009 + rank)
        stats = torch.zeros(4, dtype=torch.float64)
        gas = cfg.train.gradient_accumulation_steps
        for micro in range(gas):
            batch = next_batch()
            out = engine(batch["input_ids"], batch["attention_mask"], labels=batch["labels"])
            loss_t = out.loss
            if prog.step + 1 == nan_step and nan_rank in (None, rank):
                loss_t = loss_t * float("nan")  # TEST HOOK (LINFORMER_DS_TEST_HOOK_NAN_AT_STEP)
            engine.backward(loss_t)
            with torch.no_grad():
                n = out.labels.numel()
                loss_val = float(loss_t.detach().float())
                correct = (out.logits.argmax(-1) == out.labels).sum().item()
                finite = math.isfinite(loss_val)
                stats += torch.tensor(
                    [loss_val * n if finite else 0.0, correct, n, 0.0 if finite else 1.0],
                    dtype=torch.float64,
                )
            if micro == gas - 1:
                # Before the boundary step applies the update: do all ranks agree it is finite?
                _all_reduce(stats)
                if (
                    stats[3] > 0
                    and cfg.train.nonfinite == "stop"
                    and cfg.deepspeed.precision != "fp16"
                ):
                    return _stop_nonfinite(
                        f"non-finite loss at step {prog.step + 1} on {int(stats[3])} "
                        "micro-batch(es)",
                        ckpt_dir,
                        log,
                    )
            engine.step()
        prog.step += 1
        steps_since += 1
        if not engine.was_step_applied():
            msg = f"step {prog.step}: non-finite {'loss' if stats[3] > 0 else 'gradients'}"
            if cfg.deepspeed.precision == "fp16":
                rank0_print(f"[warn] {msg} (fp16 overflow); step skipped, loss scale lowered")
            elif cfg.train.nonfinite == "skip":
                rank0_print(f"[warn] {msg}; step skipped (train.nonfinite=skip)")
            else:
                return _stop_nonfinite(msg + " (DeepSpeed skipped the update)", ckpt_dir, log)
        elif stats[3] > 0:
            # Only reachable if DeepSpeed applied a non-finite update (a configuration without an
            # overflow check): the weights are no longer trustworthy.
            return _stop_nonfinite(
                f"step {prog.step}: non-finite loss and DeepSpeed applied the update", ckpt_dir, log
            )
        acc_loss += stats
        loss = float(stats[0] / max(stats[2], 1))
        if first_loss is None:
            first_loss = loss
        last_loss = loss

        if prog.step % cfg.train.log_interval == 0 or prog.step == cfg.train.max_steps:
            dt = time.perf_counter() - t_last
            tokens = steps_since * ds_config["train_batch_size"] * seq_len
            tps = tokens / dt
            tflops = flops_tok * tps / world / 1e12
            gn = engine.get_global_grad_norm()
            opt = engine.optimizer
            scale = getattr(opt, "cur_scale", None) or getattr(opt, "loss_scale", None) or 1.0
            mean_loss = float(acc_loss[0] / max(acc_loss[2], 1))
            log.scalars(
                prog.step,
                {
                    "loss": mean_loss,
                    "mlm_accuracy": float(acc_loss[1] / max(acc_loss[2], 1)),
                    "lr": engine.get_lr()[0],
                    "grad_norm": float(gn) if gn is not None else float("nan"),
                    "loss_scale": float(scale),
                    "tokens_per_s": tps,
                    "tflops_per_rank": tflops,
                    "mfu": tflops / peak,
                    "peak_mem_gb": _peak_mem(device) / 2**30,
                    "epoch": prog.epoch,
                },
            )
            t_last, steps_since = time.perf_counter(), 0
            acc_loss.zero_()

        if valid_ds is not None and prog.step % cfg.train.eval_interval == 0:
            ev = evaluate(engine, valid_ds, cfg, rank, world, device)
            log.scalars(prog.step, ev, prefix="eval")
            t_last = time.perf_counter()

        if cfg.checkpoint.save_interval and prog.step % cfg.checkpoint.save_interval == 0:
            save("interval")
            last_saved = prog.step
            t_last = time.perf_counter()

        if cfg.train.save_on_signal:
            flag = _all_reduce(torch.tensor([1.0 if stop.signum else 0.0]))
            if flag.item() > 0:
                if last_saved != prog.step:
                    save(f"signal {stop.signum}")
                rank0_print(f"[preempted] stopped at step {prog.step}; resume continues here")
                log.close()
                return EXIT_PREEMPTED

    if cfg.checkpoint.save_final and last_saved != prog.step:
        save("final")
    log.close()
    if sample_log is not None:
        sample_log.close()
    rank0_print(
        f"[done] step {prog.step}: first loss {first_loss if first_loss is None else round(first_loss, 4)}"
        f", last loss {last_loss if last_loss is None else round(last_loss, 4)}\n"
        f"[done] TensorBoard: tensorboard --logdir {cfg.logging.dir}\n"
        f"[done] checkpoints: {ckpt_dir} (latest: {ckpt.latest_tag(ckpt_dir)})"
    )
    return 0


def _stop_nonfinite(msg: str, ckpt_dir: str, log: "MetricsLogger") -> int:
    """Report a non-finite step under train.nonfinite=stop; nothing is saved after it."""
    last = ckpt.latest_tag(ckpt_dir)
    rank0_print(
        f"[error] {msg}; stopping (train.nonfinite=stop). Last good checkpoint: "
        f"{os.path.join(ckpt_dir, last) if last else 'none'}"
    )
    log.close()
    return EXIT_NONFINITE


def _parse_nan_hook(value: str):
    """``"STEP[:RANK]"`` of the NaN test hook -> (step, rank or None for all); 0 when unset."""
    if not value:
        return 0, None
    step, _, rank = value.partition(":")
    try:
        return int(step), (int(rank) if rank else None)
    except ValueError:
        raise ConfigError(f"{TEST_NAN_ENV}={value!r}: expected STEP or STEP:RANK") from None


def _peak_mem(device: torch.device) -> int:
    from linformer_ds.perf import peak_memory_bytes

    return peak_memory_bytes(str(device))


@torch.no_grad()
def evaluate(engine, valid_ds, cfg: JobConfig, rank: int, world: int, device) -> Dict[str, float]:
    """MLM loss, accuracy and perplexity on a fixed slice of the validation split."""
    from linformer_ds.data import MLMMasking

    masker = MLMMasking(
        valid_ds.vocab_size,
        valid_ds.mask_id,
        valid_ds.special_ids,
        mlm_probability=cfg.data.mlm_probability,
        seed=cfg.train.seed + 1,
        pad_id=valid_ds.pad_id,
    )
    mb = cfg.train.micro_batch_size
    n_rows = min(len(valid_ds), cfg.train.eval_batches * mb * world)
    mine = list(range(rank, n_rows - (n_rows % world), world))
    engine.eval()
    stats = torch.zeros(3, dtype=torch.float64)
    for start in range(0, cfg.train.eval_batches * mb, mb):
        idx = mine[start : start + mb]
        if not idx:
            break
        tokens = torch.stack([valid_ds[i] for i in idx])
        batch = {k: v.to(device) for k, v in masker(tokens, torch.tensor(idx), 0).items()}
        out = engine(batch["input_ids"], batch["attention_mask"], labels=batch["labels"])
        n = out.labels.numel()
        stats += torch.tensor(
            [float(out.loss.float()) * n, (out.logits.argmax(-1) == out.labels).sum().item(), n],
            dtype=torch.float64,
        )
    engine.train()
    _all_reduce(stats)
    loss = float(stats[0] / max(stats[2], 1))
    return {
        "loss": loss,
        "perplexity": math.exp(min(loss, 50.0)),
        "mlm_accuracy": float(stats[1] / max(stats[2], 1)),
    }


class MetricsLogger:
    """Console + TensorBoard + ``metrics.jsonl`` on rank 0."""

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

    def scalars(self, step: int, values: Dict[str, float], prefix: str = "train") -> None:
        if self.rank != 0:
            return
        shown = " ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items()
        )
        print(f"[{prefix}] step {step} {shown}", flush=True)
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


if __name__ == "__main__":
    run_and_exit()
