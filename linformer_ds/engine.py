"""The DeepSpeed side of training: process group, accelerator checks, the final DeepSpeed JSON
and the engine itself (the model's layout is applied before, by
linformer_ds.parallel.parallelize)."""

import functools
import importlib
import importlib.util
import sys
from dataclasses import dataclass
from typing import Any

import torch

from linformer_ds.config import ConfigError, JobConfig
from linformer_ds.dist_env import disable_deepspeed_shm_allreduce, init_process_group
from linformer_ds.ds_config import deepspeed_config
from linformer_ds.model import LinformerForMaskedLMPretraining
from linformer_ds.optim import lr_scheduler, param_groups
from linformer_ds.parallel.groups import build_groups


@dataclass
class World:
    """Where this process runs: ranks, device, collective backend."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def final_deepspeed_config(
    cfg: JobConfig, world_size: int, overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The JSON handed to ``deepspeed.initialize``: the config's, plus what the run needs
    (overflow checks under bf16 so non-finite steps are skipped; checkpoint loading flags)."""
    ds = deepspeed_config(cfg, world_size)
    if cfg.deepspeed.precision == "bf16":
        ds["bf16"]["check_grad_overflow"] = True
    for key, value in (overrides or {}).items():
        ds[key] = value
    return ds


def check_accelerator(cfg: JobConfig) -> None:
    """What only the live accelerator can tell: is the configured precision supported?"""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    precision = cfg.deepspeed.precision
    supported = {"fp16": acc.is_fp16_supported, "bf16": acc.is_bf16_supported}
    if precision in supported and not supported[precision]():
        raise ConfigError(
            f"deepspeed.precision: {precision} is not supported by this machine's "
            f"{acc.device_name()} accelerator (DeepSpeed's check); use "
            f"{'bf16 or fp32' if precision == 'fp16' else 'fp32'}"
        )
    backend, device = cfg.deepspeed.dist_backend, acc.device_name()
    usable = {"nccl": device == "cuda" and torch.distributed.is_nccl_available(),
              "gloo": torch.distributed.is_gloo_available(),
              "mpi": torch.distributed.is_mpi_available()}  # fmt: skip
    if backend in usable and not usable[backend]:
        raise ConfigError(
            f"deepspeed.dist_backend: {backend} is not available with this machine's {device} "
            f"accelerator and torch build; use {'gloo' if device == 'cpu' else 'nccl'} "
            "(or null: the accelerator's default)"
        )


def init_world(cfg: JobConfig, rank: int, world_size: int, local_rank: int) -> World:
    """Start the process group (gloo on CPU unless configured) and pick this rank's device."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    check_accelerator(cfg)
    acc = get_accelerator()
    on_cpu = acc.device_name() == "cpu"
    backend = cfg.deepspeed.dist_backend or ("gloo" if on_cpu else acc.communication_backend_name())
    disable_deepspeed_shm_allreduce()  # training never uses it; it leaks /dev/shm on CPU
    # the rendezvous with its deadline (parallel.init_timeout_s); DeepSpeed adopts the group
    init_process_group(backend, rank, world_size, cfg.parallel.init_timeout_s)
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
    device = torch.device("cpu") if on_cpu else torch.device(acc.device_name(local_rank))
    if not on_cpu:
        acc.set_device(local_rank)
    return World(rank, world_size, local_rank, device, backend)


def all_reduce_sum(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Sum ``t`` (a small statistics tensor) over all ranks, in place; returns it.

    A tensor on another device than ``device`` travels through it: NCCL, the backend on CUDA,
    refuses CPU tensors."""
    import deepspeed.comm as dist

    if t.device.type == torch.device(device).type:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t
    buf = t.to(device)
    dist.all_reduce(buf, op=dist.ReduceOp.SUM)
    return t.copy_(buf.to(t.device))


def build_model(cfg: JobConfig) -> LinformerForMaskedLMPretraining:
    """The plain model, initialised identically on every rank (seeded)."""
    torch.manual_seed(cfg.train.seed)
    return LinformerForMaskedLMPretraining(cfg.model)


def init_sequence_parallel(cfg: JobConfig):
    """The data x sequence parallel process groups (None when ``sequence_parallel_size`` is 1).
    Collective: every rank calls it after :func:`init_world`."""
    if cfg.parallel.sequence_parallel_size == 1:
        return None

    return build_groups(cfg.parallel.sequence_parallel_size)


def build_engine(model: torch.nn.Module, cfg: JobConfig, ds_config: dict[str, Any], mpu=None):
    """``deepspeed.initialize`` with our parameter groups and LR schedule; returns the engine.

    ``model`` is already parallelized and ``mpu`` is what
    :func:`linformer_ds.parallel.parallelize.parallelize` returned for it (None: plain data
    parallelism)."""
    import deepspeed

    kwargs: dict[str, Any] = {} if mpu is None else {"mpu": mpu}
    s = cfg.scheduler
    import_muon_lazily()
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=param_groups(model, cfg.optimizer.weight_decay),
        lr_scheduler=lambda opt: lr_scheduler(
            opt, s.warmup_steps, cfg.train.max_steps, s.decay, s.min_lr_ratio
        ),
        config=ds_config,
        dist_init_required=False,
        **kwargs,
    )
    if not (engine.fp16_enabled() or engine.bfloat16_enabled() or engine.zero_optimization()):
        keep_fp32_grad_norm(engine)
    return engine


MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


def import_muon_lazily() -> None:
    """Import DeepSpeed's Muon optimizer with its ``torch.compile`` put off to the first call.

    DeepSpeed's ZeRO and bf16 optimizers import their Muon module in ``deepspeed.initialize``
    (to ask ``isinstance(optimizer, MuonWithAuxAdam)``) and in every gradient reduction of
    ZeRO 1-2, whatever the optimizer. That module decorates three functions with
    ``deepspeed.runtime.compiler.compile()`` (``torch.compile``), which imports inductor
    when applied (a tiny one-rank run: 3.40-3.75 CPU-s with it, 2.73-2.95 without; BENCHMARKS.md),
    for an optimizer this trainer never builds (it is always AdamW). Here the module is imported
    once with that decorator made lazy: each function is compiled by the same ``torch.compile``
    on its first call, outside a compiled region (inside one it runs as written, to be traced
    with the rest, which is what dynamo does with a compiled function it meets). A process that
    imported the module already keeps it as it is; a DeepSpeed without the module or the
    decorator (an untested release, ``LINFORMER_DS_UNTESTED_DEPS``) is left alone."""
    if MUON_MODULE in sys.modules or importlib.util.find_spec(MUON_MODULE) is None:
        return
    from deepspeed.runtime import compiler

    real = getattr(compiler, "compile", None)
    if real is None:
        return

    def lazy_compile():
        def decorate(fn):
            compiled = None

            @functools.wraps(fn)
            def call(*args, **kwargs):
                nonlocal compiled
                if torch.compiler.is_compiling():
                    return fn(*args, **kwargs)
                if compiled is None:
                    compiled = real()(fn)
                return compiled(*args, **kwargs)

            return call

        return decorate

    compiler.compile = lazy_compile
    try:
        importlib.import_module(MUON_MODULE)
    finally:
        compiler.compile = real


def keep_fp32_grad_norm(engine) -> None:
    """ZeRO-0 in fp32 steps a plain torch optimizer: DeepSpeed clips the gradients there with
    float32 norms (7e-6 relative error measured on a 0.2M-parameter model, where ZeRO 1-3 are
    exact to 1e-8) and drops the norm, so ``get_global_grad_norm()`` would be None. Clip the
    same way (DeepSpeed's model-parallel rules, ``max_norm / (norm + 1e-6)``) with the sum of
    squares in float64, and keep the norm like the other stages do."""
    import deepspeed.comm as dist
    from deepspeed.runtime.utils import is_model_parallel_parameter

    def clip() -> None:
        mpu = engine.mpu
        params = [p for p in engine.module.parameters() if p.grad is not None]
        squares = torch.zeros((), dtype=torch.float64, device=engine.device)
        for p in params:  # a parameter replicated over model-parallel ranks counts once
            if mpu is None or mpu.get_model_parallel_rank() == 0 or is_model_parallel_parameter(p):
                squares += p.grad.detach().double().pow(2).sum()
        if mpu is not None:
            dist.all_reduce(squares, group=mpu.get_model_parallel_group())
        norm = squares.sqrt()
        coef = (engine.gradient_clipping() / (norm + 1e-6)).clamp(max=1.0)
        for p in params:
            p.grad.mul_(coef.to(p.grad.dtype))
        engine._global_grad_norm = norm.float()

    engine.clip_fp32_gradients = clip
