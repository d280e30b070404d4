"""The typed job config: the single source of truth for a pretraining run.

YAML files and ``key=value`` command-line overrides (OmegaConf dotlist) are merged onto the
structured schema below; unknown keys and wrong types are errors naming the key path. The
DeepSpeed JSON config is derived from it by ``deepspeed_config``.
"""

import copy
import dataclasses
import difflib
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from linformer_ds.model import ModelConfig, ModelConfigError


class ConfigError(ValueError):
    """A job config problem; the message names the key path."""


@dataclass
class DataConfig:
    path: str = "data/stdlib"  # a data_prep output directory
    train_split: str = "train"
    valid_split: str = "valid"
    mlm_probability: float = 0.15
    verify_checksums: bool = False  # full sha256 of every shard at start (slow on big data)
    # BERT/RoBERTa-style short inputs: this fraction of training rows is cut to a random length
    # in [2, N-1] (the tail becomes unlabelled padding); a function of (seed, epoch, row)
    short_seq_prob: float = 0.0


@dataclass
class OptimizerConfig:
    lr: float = 1e-4
    betas: List[float] = field(default_factory=lambda: [0.9, 0.98])
    eps: float = 1e-6
    weight_decay: float = 0.01


@dataclass
class SchedulerConfig:
    warmup_steps: int = 1000
    decay: str = "linear"  # linear | cosine | constant
    min_lr_ratio: float = 0.0  # final LR as a fraction of optimizer.lr


@dataclass
class TrainConfig:
    max_steps: int = 100_000  # optimizer steps (the LR schedule ends here)
    stop_at_step: Optional[int] = None  # end this process early at this step (staged runs)
    micro_batch_size: int = 8  # per rank
    gradient_accumulation_steps: int = 1
    global_batch_size: Optional[int] = None  # if set: must equal micro x ranks x accumulation
    seed: int = 42
    log_interval: int = 10
    eval_interval: int = 1000
    eval_batches: int = 20  # validation micro-batches per rank per evaluation
    peak_tflops: Optional[float] = None  # per rank, for MFU; None: measure a bf16 GEMM at start
    save_on_signal: bool = True  # SIGUSR1/SIGTERM: checkpoint, then exit with EXIT_PREEMPTED
    nonfinite: str = "stop"  # non-finite loss: "stop" (keep last good checkpoint) or "skip"


@dataclass
class ZeroConfig:
    stage: int = 2  # 0-3
    offload_optimizer: bool = False  # optimizer state on CPU (ZeRO-Offload)
    offload_param: bool = False  # parameters on CPU (stage 3 only)
    overlap_comm: bool = True
    contiguous_gradients: bool = True
    reduce_bucket_size: int = 50_000_000
    allgather_bucket_size: int = 50_000_000


@dataclass
class ActivationCheckpointingConfig:
    enabled: bool = False
    partition_activations: bool = False  # DeepSpeed: shard checkpoints across model-parallel ranks
    cpu_checkpointing: bool = False  # DeepSpeed: keep checkpoints in CPU memory
    number_checkpoints: Optional[int] = None  # checkpoint the first N layers (None: all)


@dataclass
class DeepSpeedConfig:
    precision: str = "bf16"  # fp32 | bf16 | fp16
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    gradient_clipping: float = 1.0
    fp32_grad_accum: bool = True  # accumulate gradients in fp32 under bf16/fp16
    # fp16 dynamic loss scaling (loss_scale 0 = dynamic)
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0
    activation_checkpointing: ActivationCheckpointingConfig = field(
        default_factory=ActivationCheckpointingConfig
    )
    dist_backend: Optional[str] = None  # None: nccl on CUDA, gloo on CPU
    extra: Dict[str, Any] = field(default_factory=dict)  # merged into the DeepSpeed JSON as is


@dataclass
class LoggingConfig:
    dir: str = "runs/${name}"
    tensorboard: bool = True
    # Prometheus /metrics on every rank at port + local rank (0: free ports, logged); None: off
    prometheus_port: Optional[int] = None


@dataclass
class CheckpointConfig:
    dir: str = "${logging.dir}/checkpoints"
    save_interval: int = 1000  # optimizer steps; 0 = only the final checkpoint
    keep_last: int = 3  # older checkpoints are deleted (0 = keep all)
    resume: str = "auto"  # auto: latest in dir if any | never | a tag name in dir
    save_final: bool = True
    # Resume although train.seed differs from the checkpoint's (the rest of the epoch is then
    # drawn from the new seed's order: rows may repeat or be skipped; masks change).
    allow_seed_change: bool = False


@dataclass
class ParallelConfig:
    # P: ranks that share one sequence (each holds N/P consecutive positions); world = DP x P.
    # Groups are consecutive ranks, so with P <= GPUs per node a group stays inside a node.
    sequence_parallel_size: int = 1


@dataclass
class JobConfig:
    name: str = "linformer"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


# ====================================================================================== loading
def _load_yaml(path: str) -> DictConfig:
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    try:
        cfg = OmegaConf.load(path)
    except Exception as e:  # yaml parse errors
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"{path}: top level must be a mapping")
    base = cfg.pop("defaults", None)  # `defaults: other.yaml` (relative to this file)
    if base is not None:
        parent = _load_yaml(os.path.join(os.path.dirname(path), str(base)))
        cfg = OmegaConf.merge(parent, cfg)
    return cfg


def _omegaconf_message(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None)
    msg = str(e).splitlines()[0]
    return f"{key}: {msg}" if key else msg


def load_config(path: Optional[str] = None, overrides: Optional[List[str]] = None) -> JobConfig:
    """Schema <- YAML file <- ``key=value`` overrides; validated; interpolations resolved."""
    schema = OmegaConf.structured(JobConfig)
    try:
        merged = schema
        if path:
            merged = OmegaConf.merge(merged, _load_yaml(path))
        if overrides:
            for item in overrides:
                if "=" not in item:
                    raise ConfigError(f"override {item!r} is not of the form key=value")
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(list(overrides)))
        OmegaConf.resolve(merged)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(_omegaconf_message(e)) from None
    except ModelConfigError as e:
        raise ConfigError(str(e)) from None
    assert isinstance(cfg, JobConfig)
    _check_required(path, overrides or [])
    validate(cfg)
    return cfg


# What a job config must set itself: the schema's defaults for these describe no real run (the
# default model is a 102M-parameter BERT-base; the default data path a README example).
REQUIRED_KEYS = ("data.path", "model")


def _check_required(path: Optional[str], overrides: List[str]) -> None:
    """A config that sets nothing, or leaves ``data.path`` / ``model`` to the schema, is an error
    (the YAML file and the overrides together must set them)."""
    user = _load_yaml(path) if path else OmegaConf.create({})
    if path and len(user) == 0:
        raise ConfigError(
            f"{path}: the config file sets nothing; start from one in configs/ (e.g. "
            "configs/tiny_cpu.yaml)"
        )
    user = OmegaConf.merge(user, OmegaConf.from_dotlist(list(overrides)))
    if not path and not overrides:
        raise ConfigError(
            "no job config: pass --config FILE (see configs/, e.g. configs/tiny_cpu.yaml) "
            "and/or key=value overrides that set data.path and model.*"
        )
    if OmegaConf.select(user, "data.path") is None:
        raise ConfigError(
            "data.path: not set; name a data_prep output directory (data.path=DIR in the YAML "
            "file or as an override)"
        )
    model = OmegaConf.select(user, "model")
    if not isinstance(model, DictConfig) or len(model) == 0:
        raise ConfigError(
            "model: not set; the config would train the schema's default 102M-parameter model. "
            "Describe the model (a model: section, e.g. from configs/tiny_cpu.yaml)"
        )


def to_dict(cfg: JobConfig) -> Dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]


def to_yaml(cfg: JobConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def from_dict(d: Dict[str, Any]) -> JobConfig:
    """Rebuild a JobConfig from ``to_dict`` output (e.g. a checkpoint's saved config)."""
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(JobConfig), d))  # type: ignore[return-value]
    except OmegaConfBaseException as e:
        raise ConfigError(_omegaconf_message(e)) from None


# =================================================================================== validation
DIST_BACKENDS = ("gloo", "nccl", "mpi", "ccl", "hccl")


def _attr(obj: Any, key: str) -> Any:
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def _numbers(obj: Any, prefix: str = "") -> List[Tuple[str, Any]]:
    """``(key path, value)`` of every number in a (nested) config dataclass, lists included."""
    out: List[Tuple[str, Any]] = []
    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            out += _numbers(getattr(obj, f.name), f"{prefix}.{f.name}" if prefix else f.name)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out += _numbers(v, f"{prefix}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out += _numbers(v, f"{prefix}[{i}]")
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        out.append((prefix, obj))
    return out


def data_parallel_size(cfg: JobConfig, world_size: int) -> int:
    """Model replicas: the world over the sequence-parallel size."""
    return max(1, world_size // max(1, cfg.parallel.sequence_parallel_size))


def validate(
    cfg: JobConfig, world_size: Optional[int] = None, seq_len: Optional[int] = None
) -> None:
    """Impossible combinations, with the key path in the message. ``world_size`` and the data's
    sequence length ``seq_len`` when known (the trainer validates again once it knows them)."""

    def bad(key: str, msg: str) -> None:
        raise ConfigError(f"{key}: {msg}")

    for key, value in _numbers(cfg):  # nan/inf anywhere: named before any range check
        if isinstance(value, float) and not math.isfinite(value):
            bad(key, f"must be a finite number, got {value}")
    cfg.model.validate()
    for key in ("layer_norm_eps", "initializer_range", "projection_init_std"):
        value = getattr(cfg.model, key)
        if value is not None and value <= 0:
            bad(f"model.{key}", f"must be > 0, got {value}")
    cd = cfg.model.classifier_dropout
    if cd is not None and not 0.0 <= cd < 1.0:
        bad("model.classifier_dropout", f"must be in [0, 1), got {cd}")
    for key in ("name", "data.path", "data.train_split", "data.valid_split", "logging.dir",
                "checkpoint.dir"):  # fmt: skip
        if not str(_attr(cfg, key) or "").strip():
            bad(key, "must not be empty")
    t, ds, z = cfg.train, cfg.deepspeed, cfg.deepspeed.zero
    for key in ("max_steps", "micro_batch_size", "gradient_accumulation_steps", "log_interval"):
        if getattr(t, key) < 1:
            bad(f"train.{key}", f"must be >= 1, got {getattr(t, key)}")
    for key in ("eval_interval", "eval_batches"):
        if getattr(t, key) < 0:
            bad(f"train.{key}", f"must be >= 0 (0 turns evaluation off), got {getattr(t, key)}")
    if t.stop_at_step is not None and t.stop_at_step < 1:
        bad("train.stop_at_step", f"must be >= 1 (or null: run to max_steps), got {t.stop_at_step}")
    if t.global_batch_size is not None and t.global_batch_size < 1:
        bad("train.global_batch_size", f"must be >= 1 (or null), got {t.global_batch_size}")
    if not 0 <= t.seed < 2**32:
        bad("train.seed", f"must be in [0, 2**32), got {t.seed}")
    if t.nonfinite not in ("stop", "skip"):
        bad("train.nonfinite", f"must be 'stop' or 'skip', got {t.nonfinite!r}")
    if t.nonfinite == "skip" and ds.precision == "fp32" and z.stage == 0:
        bad(
            "train.nonfinite",
            "'skip' needs an optimizer that DeepSpeed can make skip a step (zero.stage >= 1, "
            "or precision bf16/fp16); ZeRO-0 fp32 applies every update",
        )
    if t.peak_tflops is not None and t.peak_tflops <= 0:
        bad("train.peak_tflops", f"must be > 0, got {t.peak_tflops}")
    port = cfg.logging.prometheus_port
    if port is not None and not 0 <= port <= 65535:
        bad("logging.prometheus_port", f"must be a TCP port in [0, 65535] (0: free), got {port}")
    if not 0.0 <= cfg.data.short_seq_prob < 1.0:
        bad("data.short_seq_prob", f"must be in [0, 1), got {cfg.data.short_seq_prob}")
    if not 0.0 < cfg.data.mlm_probability < 1.0:
        bad("data.mlm_probability", f"must be in (0, 1), got {cfg.data.mlm_probability}")
    if cfg.optimizer.lr <= 0:
        bad("optimizer.lr", f"must be > 0, got {cfg.optimizer.lr}")
    if cfg.optimizer.eps <= 0:
        bad("optimizer.eps", f"must be > 0, got {cfg.optimizer.eps}")
    if cfg.optimizer.weight_decay < 0:
        bad("optimizer.weight_decay", f"must be >= 0, got {cfg.optimizer.weight_decay}")
    if len(cfg.optimizer.betas) != 2 or not all(0 <= b < 1 for b in cfg.optimizer.betas):
        bad("optimizer.betas", f"must be two numbers in [0, 1), got {cfg.optimizer.betas}")
    if cfg.scheduler.decay not in ("linear", "cosine", "constant"):
        bad("scheduler.decay", f"must be linear, cosine or constant, got {cfg.scheduler.decay!r}")
    if cfg.scheduler.warmup_steps < 0:
        bad("scheduler.warmup_steps", f"must be >= 0, got {cfg.scheduler.warmup_steps}")
    if not 0.0 <= cfg.scheduler.min_lr_ratio <= 1.0:
        bad("scheduler.min_lr_ratio", f"must be in [0, 1], got {cfg.scheduler.min_lr_ratio}")
    if ds.precision not in ("fp32", "bf16", "fp16"):
        bad("deepspeed.precision", f"must be fp32, bf16 or fp16, got {ds.precision!r}")
    if z.stage not in (0, 1, 2, 3):
        bad("deepspeed.zero.stage", f"must be 0, 1, 2 or 3, got {z.stage}")
    if z.offload_param and z.stage != 3:
        bad("deepspeed.zero.offload_param", f"needs zero.stage=3, got stage {z.stage}")
    if z.offload_optimizer and z.stage == 0:
        bad("deepspeed.zero.offload_optimizer", "needs zero.stage >= 1")
    if z.stage == 0 and ds.precision != "fp32" and ds.fp32_grad_accum:
        bad(
            "deepspeed.fp32_grad_accum",
            f"zero.stage=0 with {ds.precision} cannot accumulate gradients in fp32 (DeepSpeed "
            "0.19 raises 'unsupported mix'); set deepspeed.fp32_grad_accum=false or "
            "deepspeed.zero.stage >= 1",
        )
    if ds.gradient_clipping < 0:
        bad(
            "deepspeed.gradient_clipping",
            f"must be >= 0 (0: no clipping), got {ds.gradient_clipping}",
        )
    for key in ("reduce_bucket_size", "allgather_bucket_size"):
        if getattr(z, key) < 1:
            bad(f"deepspeed.zero.{key}", f"must be >= 1 (elements), got {getattr(z, key)}")
    if ds.loss_scale < 0:
        bad("deepspeed.loss_scale", f"must be >= 0 (0: dynamic), got {ds.loss_scale}")
    if not 0 <= ds.initial_scale_power <= 63:
        bad("deepspeed.initial_scale_power", f"must be in [0, 63], got {ds.initial_scale_power}")
    for key in ("loss_scale_window", "hysteresis"):
        if getattr(ds, key) < 1:
            bad(f"deepspeed.{key}", f"must be >= 1, got {getattr(ds, key)}")
    if ds.min_loss_scale <= 0:
        bad("deepspeed.min_loss_scale", f"must be > 0, got {ds.min_loss_scale}")
    if ds.dist_backend is not None and ds.dist_backend not in DIST_BACKENDS:
        bad(
            "deepspeed.dist_backend",
            f"must be one of {', '.join(DIST_BACKENDS)} (or null: nccl on CUDA, gloo on CPU), "
            f"got {ds.dist_backend!r}",
        )
    ac = ds.activation_checkpointing
    if ac.number_checkpoints is not None and not 1 <= ac.number_checkpoints <= cfg.model.num_layers:
        bad(
            "deepspeed.activation_checkpointing.number_checkpoints",
            f"must be in [1, model.num_layers={cfg.model.num_layers}], got {ac.number_checkpoints}",
        )
    ds_ac = [k for k in ("partition_activations", "cpu_checkpointing") if getattr(ac, k)]
    if ac.enabled and ds_ac and z.stage == 3:
        bad(
            f"deepspeed.activation_checkpointing.{ds_ac[0]}",
            "DeepSpeed's own checkpointing (partition_activations / cpu_checkpointing) breaks "
            "the backward pass under zero.stage=3 in deepspeed 0.19 (emptied inputs, lost "
            "autocast); with ZeRO-3 use activation_checkpointing.enabled=true with both off "
            "(torch's non-reentrant checkpointing), or zero.stage <= 2",
        )
    if cfg.checkpoint.resume not in ("auto", "never") and "/" in cfg.checkpoint.resume:
        bad("checkpoint.resume", "must be auto, never or a tag name inside checkpoint.dir")
    for key, what in (("save_interval", "0: only the final checkpoint"), ("keep_last", "0: all")):
        if getattr(cfg.checkpoint, key) < 0:
            bad(f"checkpoint.{key}", f"must be >= 0 ({what}), got {getattr(cfg.checkpoint, key)}")
    sp_size = cfg.parallel.sequence_parallel_size
    if sp_size < 1:
        bad("parallel.sequence_parallel_size", f"must be >= 1, got {sp_size}")
    if sp_size > 1:
        from linformer_ds.sequence_parallel import config_errors

        errors = config_errors(
            sp_size,
            world_size=world_size,
            seq_len=seq_len or cfg.model.max_seq_len,
            model=cfg.model,
            zero_stage=z.stage,
            zero_reduce_scatter=bool(
                ds.extra.get("zero_optimization", {}).get("reduce_scatter", True)
            ),
        )
        if errors:
            raise ConfigError(errors[0])
    if world_size is not None:
        replicas = data_parallel_size(cfg, world_size)
        per_step = t.micro_batch_size * t.gradient_accumulation_steps * replicas
        if t.global_batch_size is not None and t.global_batch_size != per_step:
            what = "ranks" if sp_size == 1 else "replicas = ranks / sequence_parallel_size"
            bad(
                "train.global_batch_size",
                f"{t.global_batch_size} is not micro_batch_size ({t.micro_batch_size}) x {what} "
                f"({replicas}) x gradient_accumulation_steps ({t.gradient_accumulation_steps})"
                f" = {per_step}",
            )
        check_deepspeed_extra(cfg, world_size)


# ========================================================================= DeepSpeed JSON config
def _deep_update(base: Dict[str, Any], extra: Dict[str, Any]) -> Dict[str, Any]:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_update(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
    return base


def deepspeed_config(cfg: JobConfig, world_size: int) -> Dict[str, Any]:
    """The DeepSpeed JSON config derived from the job config (plus ``deepspeed.extra``)."""
    t, ds, z = cfg.train, cfg.deepspeed, cfg.deepspeed.zero
    zero: Dict[str, Any] = {"stage": z.stage}
    if z.stage > 0:
        zero.update(
            overlap_comm=z.overlap_comm,
            contiguous_gradients=z.contiguous_gradients,
            reduce_bucket_size=int(z.reduce_bucket_size),
            allgather_bucket_size=int(z.allgather_bucket_size),
        )
    if z.stage == 3:
        zero.pop("allgather_bucket_size")
        zero["stage3_gather_16bit_weights_on_model_save"] = False
    if z.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    if z.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    out: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "train_batch_size": t.micro_batch_size
        * t.gradient_accumulation_steps
        * data_parallel_size(cfg, world_size),
        "gradient_clipping": ds.gradient_clipping,
        "zero_optimization": zero,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": cfg.optimizer.lr,
                "betas": list(cfg.optimizer.betas),
                "eps": cfg.optimizer.eps,
                "weight_decay": cfg.optimizer.weight_decay,
                "torch_adam": True,
            },
        },
        "zero_force_ds_cpu_optimizer": False,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if ds.precision == "bf16":
        out["bf16"] = {"enabled": True}
    elif ds.precision == "fp16":
        out["fp16"] = {
            "enabled": True,
            "loss_scale": ds.loss_scale,
            "initial_scale_power": ds.initial_scale_power,
            "loss_scale_window": ds.loss_scale_window,
            "hysteresis": ds.hysteresis,
            "min_loss_scale": ds.min_loss_scale,
        }
    if ds.precision != "fp32" and ds.fp32_grad_accum:
        out["data_types"] = {"grad_accum_dtype": "fp32"}
    ac = ds.activation_checkpointing
    if ac.enabled:
        out["activation_checkpointing"] = {
            "partition_activations": ac.partition_activations,
            "cpu_checkpointing": ac.cpu_checkpointing,
            "contiguous_memory_optimization": False,
            "number_checkpoints": ac.number_checkpoints,
            "synchronize_checkpoint_boundary": False,
            "profile": False,
        }
    return _deep_update(out, OmegaConf.to_container(OmegaConf.create(ds.extra)) or {})


# Keys of the DeepSpeed JSON that the job config owns (set them through train.* instead).
_OWNED_DS_KEYS = {
    "train_batch_size": "train.global_batch_size",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.gradient_accumulation_steps",
}


class _RecordingDict(dict):
    """A dict that records which keys are looked up (DeepSpeed's config parser reads it)."""

    seen: set

    def get(self, key, default=None):  # noqa: D102
        self.seen.add(key)
        return super().get(key, default)

    def __contains__(self, key) -> bool:
        self.seen.add(key)
        return super().__contains__(key)

    def __getitem__(self, key):
        self.seen.add(key)
        return super().__getitem__(key)


def _pydantic_key(ds: Dict[str, Any], loc: Tuple[Any, ...], model: str) -> str:
    """The JSON path of a pydantic error ``loc`` inside the DeepSpeed config ``ds``."""
    path = [str(p) for p in loc]
    for top, value in ds.items():
        node: Any = value
        for part in path[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and (path[-1] in node or not path):
            return ".".join([top, *path])
    return ".".join(path) or model


def check_deepspeed_extra(cfg: JobConfig, world_size: int) -> None:
    """Validate the derived DeepSpeed JSON (``deepspeed.extra`` included) with DeepSpeed's own
    config classes before any process group starts; one :class:`ConfigError` naming the key."""
    extra = OmegaConf.to_container(OmegaConf.create(cfg.deepspeed.extra)) or {}
    for key, owner in _OWNED_DS_KEYS.items():
        if key in extra:
            bad = f"deepspeed.extra.{key}"
            raise ConfigError(f"{bad}: the job config sets it; use {owner} instead")
    import pydantic
    from deepspeed.runtime import constants
    from deepspeed.runtime.config import DeepSpeedConfig

    ds = deepspeed_config(cfg, world_size)
    # Without a process group DeepSpeed assumes one rank: check the batch arithmetic for that.
    ds["train_batch_size"] = cfg.train.micro_batch_size * cfg.train.gradient_accumulation_steps
    probe = _RecordingDict(ds)
    probe.seen = set()
    try:
        DeepSpeedConfig(probe)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        key = _pydantic_key(ds, tuple(err["loc"]), e.title)
        where = f"deepspeed.extra.{key}" if key.split(".")[0] in extra else f"deepspeed ({key})"
        raise ConfigError(f"{where}: {err['msg']} (got {err.get('input')!r})") from None
    except (AssertionError, ValueError, TypeError, KeyError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(
            f"deepspeed.extra: DeepSpeed refuses the derived config: {first}"
        ) from None
    known = set(probe.seen) | {
        v for k, v in vars(constants).items() if k.isupper() and isinstance(v, str)
    }
    for key in extra:
        if key not in known:
            near = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ConfigError(
                f"deepspeed.extra.{key}: DeepSpeed does not read this key{hint} (see "
                "https://www.deepspeed.ai/docs/config-json/)"
            )
