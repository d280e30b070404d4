"""The typed job config: the single source of truth for a pretraining run.

YAML files and ``key=value`` command-line overrides (OmegaConf dotlist) are merged onto the
structured schema below (:func:`load_config`; the files, includes and one-line errors of the
merge are ``linformer_ds.config_yaml``); unknown keys and wrong types are errors naming the key
path.
Loading checks every field and the rules across fields (:func:`validate`, once); what needs
the world size or the data's N is decided once by ``linformer_ds.resolve.resolve``, which returns
the config frozen. The DeepSpeed JSON is derived from it in ``linformer_ds.ds_config``.
"""

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from linformer_ds.config_fields import (
    MAX_BATCH,
    MAX_COUNT,
    MAX_STEPS,
    bounded,
    check_fields,
    field_problem,
    is_host,
    nonempty,
    one_of,
    unusable_dir,
)
from linformer_ds.config_fields import ConfigError as ConfigError  # re-exported
from linformer_ds.config_yaml import (
    LOAD_ERRORS,
    check_shape,
    load_yaml,
    merge,
    omegaconf_message,
    parse_override,
)
from linformer_ds.cpu_threads import MAX_THREADS, WAIT_POLICIES
from linformer_ds.dist_env import DEFAULT_INIT_TIMEOUT_S
from linformer_ds.model import ModelConfig, ModelConfigError
from linformer_ds.watchdog import START_UP_PHASES


class Section:
    """A config section: ``validate`` checks every field's declaration (:func:`check_fields`),
    then the section's own rules across fields (``rules``). ``key`` is its path in the job
    config. What needs the world size or the data is checked by ``linformer_ds.resolve``."""

    key: ClassVar[str] = ""

    def validate(self, job: "JobConfig") -> None:
        check_fields(self, self.key)
        self.rules(job)

    def rules(self, job: "JobConfig") -> None:
        """Checks that involve other fields or sections."""

    def bad(self, name: str, msg: str) -> None:
        raise ConfigError(f"{self.key}.{name}: {msg}")


# ===================================================================================== sections
@dataclass
class SourceConfig:
    """One corpus of a mixture (``data.sources``): a data_prep output and its relative weight
    (>= 0; 0: evaluated, never trained on). Checked by ``data.stages.resolve_stages``."""

    name: str = ""  # a short name for logs and metrics (share/NAME, eval loss/NAME)
    path: str = ""  # a data_prep output directory
    weight: float = bounded(1.0, 0, note="weights are relative: any numbers >= 0")


@dataclass
class StageConfig:
    """One sequence-length stage (``train.stages``): steps up to ``end_step`` train on
    ``sources`` (names from data.sources, re-weighted by ``weights`` if given) or on ``path``
    (one source), ``micro_batch_size`` rows per rank (null: train.micro_batch_size)."""

    # null only for the last stage: train.max_steps
    end_step: int | None = bounded(None, 1, MAX_STEPS)
    sources: list[str] = field(default_factory=list)
    weights: list[float] | None = None
    path: str | None = None
    micro_batch_size: int | None = bounded(
        None, 1, MAX_BATCH, note="or null: train.micro_batch_size"
    )


@dataclass
class DataConfig(Section):
    key: ClassVar[str] = "data"
    path: str = nonempty("data/stdlib")  # a data_prep output directory
    # a weighted mixture of data_prep outputs (same tokenizer and N); when set, path is unused
    sources: list[SourceConfig] = field(default_factory=list)
    train_split: str = nonempty("train")
    valid_split: str = nonempty("valid")
    mlm_probability: float = bounded(0.15, 0, 1, lo_open=True, hi_open=True, text="in (0, 1)")
    verify_checksums: bool = False  # full sha256 of every shard at start (slow on big data)
    # BERT/RoBERTa-style short inputs: this fraction of training rows is cut to a random length
    # in [2, N-1] (the tail becomes unlabelled padding); a function of (seed, epoch, row)
    short_seq_prob: float = bounded(0.0, 0, 1, hi_open=True, text="in [0, 1)")
    # Document isolation in packed rows (issue 29): each document of a row gets positions from 0,
    # its own E/F summaries (conv windows, dense attention) and attends only within itself.
    # auto: on when every source was packed with data_prep --packing full (its manifest); the
    # [setup] line says which. true / false: always on / off (false, the default: unchanged).
    document_isolation: Any = False
    # data.sources and train.stages (names, weights, end steps) are checked by the data layer
    # that builds the stages (resolve_stages)

    def rules(self, job: "JobConfig") -> None:
        iso = self.document_isolation
        if iso not in (True, False, "auto"):
            self.bad("document_isolation", f"must be auto, true or false, got {iso!r}")


@dataclass
class OptimizerConfig(Section):
    key: ClassVar[str] = "optimizer"
    lr: float = bounded(1e-4, 0, lo_open=True)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])
    eps: float = bounded(1e-6, 0, lo_open=True)
    weight_decay: float = bounded(0.01, 0)

    def rules(self, job: "JobConfig") -> None:
        b = self.betas
        if len(b) != 2 or not all(math.isfinite(x) and 0 <= x < 1 for x in b):
            self.bad("betas", f"must be two numbers in [0, 1), got {b}")


DECAYS = ("linear", "cosine", "constant")


@dataclass
class SchedulerConfig(Section):
    key: ClassVar[str] = "scheduler"
    warmup_steps: int = bounded(1000, 0, MAX_STEPS)
    decay: str = one_of("linear", DECAYS)
    # final LR as a fraction of optimizer.lr
    min_lr_ratio: float = bounded(0.0, 0, 1, text="in [0, 1]")


# torch.compile backends that train.compile takes: inductor (code generation), aot_eager
# (traced forward and backward run by eager kernels: a check of the capture), eager (capture only)
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass
class TrainConfig(Section):
    key: ClassVar[str] = "train"
    max_steps: int = bounded(100_000, 1, MAX_STEPS)  # optimizer steps (the LR schedule ends here)
    # end this process early at this step (staged runs)
    stop_at_step: int | None = bounded(None, 1, MAX_STEPS, note="or null: run to max_steps")
    micro_batch_size: int = bounded(8, 1, MAX_BATCH)  # per rank
    gradient_accumulation_steps: int = bounded(1, 1, MAX_BATCH)
    # if set: must equal micro x ranks x accumulation
    global_batch_size: int | None = bounded(None, 1, MAX_STEPS, note="or null")
    seed: int = bounded(42, 0, 2**32, hi_open=True, text="in [0, 2**32)")
    log_interval: int = bounded(10, 1, MAX_STEPS)
    eval_interval: int = bounded(1000, 0, MAX_STEPS, note="0 turns evaluation off")
    # validation micro-batches per rank per evaluation
    eval_batches: int = bounded(20, 0, MAX_COUNT, note="0 turns evaluation off")
    # per rank, for MFU; None: measured at start, a GEMM in the run's precision (~3 s at most)
    peak_tflops: float | None = bounded(None, 0, lo_open=True)
    save_on_signal: bool = True  # SIGUSR1/SIGTERM: checkpoint, then exit with EXIT_PREEMPTED
    # non-finite loss: "stop" (keep last good checkpoint) or "skip"
    nonfinite: str = one_of("stop", ("stop", "skip"))
    # sequence-length stages in step order (see docs/data.md); empty: one stage, all of data
    stages: list[StageConfig] = field(default_factory=list)
    # torch.compile the model through DeepSpeed's engine (engine.compile; docs/observability.md)
    compile: bool = False
    compile_backend: str = one_of("inductor", COMPILE_BACKENDS, note="torch.compile's backend")
    # inductor's mode; null: its default
    compile_mode: str | None = one_of(None, COMPILE_MODES, note="or null: inductor's default")
    # null: static shapes first, dynamic after a shape changes (torch's default); true / false
    compile_dynamic: bool | None = None
    # torch threads per rank. auto: OMP_NUM_THREADS where it is set, else the whole CPUs this
    # rank has (affinity, cgroup CPU quota, ranks on the node; docs/performance.md). The
    # [setup] line says which and why.
    threads: Any = "auto"
    # how idle OpenMP threads wait: passive (sleep at once) or active (spin); auto: passive
    # where the rank's CPUs are shared (other ranks, a quota, a busy machine), else OpenMP's
    # default (spin a while, then sleep). OpenMP reads it when torch loads: an explicit value
    # that the rank did not start with restarts it once (launch/pretrain.py) with it set.
    omp_wait_policy: str = one_of(
        "auto", WAIT_POLICIES, "or auto: passive where the CPUs are shared", also=("auto",)
    )

    def rules(self, job: "JobConfig") -> None:
        t = self.threads
        if t != "auto" and not (
            isinstance(t, int) and not isinstance(t, bool) and 1 <= t <= MAX_THREADS
        ):
            self.bad("threads", f"must be auto or a thread count in [1, {MAX_THREADS}], got {t!r}")
        # (nonfinite=skip and the global batch are checked by resolve: precision, world size)
        if self.compile_mode is not None and self.compile_backend != "inductor":
            self.bad(
                "compile_mode",
                f"is inductor's option; compile_backend is {self.compile_backend!r} (set "
                "compile_mode=null or compile_backend=inductor)",
            )


@dataclass
class ZeroConfig(Section):
    key: ClassVar[str] = "deepspeed.zero"
    stage: int = bounded(2, 0, 3, text="0, 1, 2 or 3")
    offload_optimizer: bool = False  # optimizer state on CPU (ZeRO-Offload)
    offload_param: bool = False  # parameters on CPU (stage 3 only)
    overlap_comm: bool = True
    contiguous_gradients: bool = True
    reduce_bucket_size: int = bounded(50_000_000, 1, MAX_STEPS, note="elements")
    allgather_bucket_size: int = bounded(50_000_000, 1, MAX_STEPS, note="elements")

    def rules(self, job: "JobConfig") -> None:
        if self.offload_param and self.stage != 3:
            self.bad("offload_param", f"needs zero.stage=3, got stage {self.stage}")
        if self.offload_optimizer and self.stage == 0:
            self.bad("offload_optimizer", "needs zero.stage >= 1")


@dataclass
class ActivationCheckpointingConfig(Section):
    key: ClassVar[str] = "deepspeed.activation_checkpointing"
    enabled: bool = False
    partition_activations: bool = False  # DeepSpeed: shard checkpoints across model-parallel ranks
    cpu_checkpointing: bool = False  # DeepSpeed: keep checkpoints in CPU memory
    # checkpoint the first N layers (None: all)
    number_checkpoints: int | None = bounded(None, 1, MAX_COUNT)
    # layer: one checkpoint per layer; sublayer: the attention and the feed-forward sub-layers
    # apart (twice the saved inputs, the backward holds one sub-layer's activations at a time)
    granularity: str = one_of("layer", ("layer", "sublayer"))

    def rules(self, job: "JobConfig") -> None:
        layers = job.model.num_layers
        if self.number_checkpoints is not None and self.number_checkpoints > layers:
            self.bad(
                "number_checkpoints",
                f"must be in [1, model.num_layers={layers}], got {self.number_checkpoints}",
            )
        ds_own = [k for k in ("partition_activations", "cpu_checkpointing") if getattr(self, k)]
        if self.enabled and ds_own and job.deepspeed.zero.stage == 3:
            self.bad(
                ds_own[0],
                "DeepSpeed's own checkpointing (partition_activations / cpu_checkpointing) breaks "
                "the backward pass under zero.stage=3 in deepspeed 0.19 (emptied inputs, lost "
                "autocast); with ZeRO-3 use activation_checkpointing.enabled=true with both off "
                "(torch's non-reentrant checkpointing), or zero.stage <= 2",
            )


PRECISIONS = ("fp32", "bf16", "fp16")
DIST_BACKENDS = ("gloo", "nccl", "mpi", "ccl", "hccl")


@dataclass
class DeepSpeedConfig(Section):
    key: ClassVar[str] = "deepspeed"
    precision: str = one_of(  # auto: decided by linformer_ds.resolve
        "bf16",
        PRECISIONS,
        "or auto: bf16 where this machine multiplies bf16 natively, else fp32",
        also=("auto",),
    )
    auto_precision: str | None = None  # set by resolve when precision was auto: why
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    gradient_clipping: float = bounded(1.0, 0, note="0: no clipping")
    fp32_grad_accum: bool = True  # accumulate gradients in fp32 under bf16/fp16
    # fp16 dynamic loss scaling (loss_scale 0 = dynamic)
    loss_scale: float = bounded(0.0, 0, note="0: dynamic")
    initial_scale_power: int = bounded(16, 0, 63, text="in [0, 63]")
    loss_scale_window: int = bounded(1000, 1, MAX_COUNT)
    hysteresis: int = bounded(2, 1, MAX_COUNT)
    min_loss_scale: float = bounded(1.0, 0, lo_open=True)
    activation_checkpointing: ActivationCheckpointingConfig = field(
        default_factory=ActivationCheckpointingConfig
    )
    # None: nccl on CUDA, gloo on CPU
    dist_backend: str | None = one_of(None, DIST_BACKENDS, "or null: nccl on CUDA, gloo on CPU")
    # merged into the DeepSpeed JSON; only what the job config does not own (checked at
    # resolve: linformer_ds.ds_config.check_deepspeed_extra)
    extra: dict[str, Any] = field(default_factory=dict)

    def rules(self, job: "JobConfig") -> None:  # fp32_grad_accum: resolve (after auto)
        self.zero.validate(job)
        self.activation_checkpointing.validate(job)

    def precision_text(self) -> str:
        """``bf16``, or ``bf16 (auto: amx_bf16)`` when ``auto`` chose it."""
        why = self.auto_precision
        return f"{self.precision} (auto: {why})" if why else self.precision

    def extra_dict(self) -> dict[str, Any]:
        """``extra`` as plain containers."""
        return OmegaConf.to_container(OmegaConf.create(self.extra)) or {}  # type: ignore[return-value]


@dataclass
class LoggingConfig(Section):
    key: ClassVar[str] = "logging"
    dir: str = nonempty("runs/${name}")
    tensorboard: bool = True
    # Prometheus /metrics on every rank at port + local rank (0: free ports, logged); None: off
    prometheus_port: int | None = bounded(
        None, 0, 65535, text="a TCP port in [0, 65535]", note="0: free"
    )
    # the address the endpoints listen on: 0.0.0.0 every interface (a cluster's Prometheus
    # scrapes the nodes), 127.0.0.1 this host only, or one interface's address or name
    prometheus_host: str = nonempty("0.0.0.0")
    # sinks registered by name (linformer_ds.metrics.register_sink, e.g. in a --plugin module),
    # built on every rank beside the built-in ones
    sinks: list[str] = field(default_factory=list)

    def rules(self, job: "JobConfig") -> None:
        if not is_host(self.prometheus_host):
            self.bad("prometheus_host", f"{self.prometheus_host!r} is not an IP address or host "
                     "name (0.0.0.0: every interface, 127.0.0.1: this host only)")  # fmt: skip


@dataclass
class CheckpointConfig(Section):
    key: ClassVar[str] = "checkpoint"
    dir: str = nonempty("${logging.dir}/checkpoints")
    # optimizer steps; 0 = only the final checkpoint
    save_interval: int = bounded(1000, 0, MAX_STEPS, note="0: only the final checkpoint")
    keep_last: int = bounded(3, 0, MAX_COUNT, note="0: all")  # older checkpoints are deleted
    resume: str = "auto"  # auto: latest in dir if any | never | a tag name in dir
    save_final: bool = True
    # Resume although train.seed differs from the checkpoint's (the rest of the epoch is then
    # drawn from the new seed's order: rows may repeat or be skipped; masks change).
    allow_seed_change: bool = False
    # Resume although the data differs from the checkpoint's (another tokenizer, N or manifest:
    # the rest of the epoch then runs over other rows).
    allow_data_change: bool = False
    init_from: str | None = None  # hf:PATH: a fresh start's weights (linformer_ds.warm_start)

    def rules(self, job: "JobConfig") -> None:
        if self.resume not in ("auto", "never") and "/" in self.resume:
            self.bad("resume", "must be auto, never or a tag name inside checkpoint.dir")


@dataclass
class ParallelConfig(Section):
    key: ClassVar[str] = "parallel"
    # P: ranks that share one sequence (each holds N/P consecutive positions); world = DP x P.
    # Groups are consecutive ranks, so with P <= GPUs per node a group stays inside a node.
    sequence_parallel_size: int = bounded(1, 1, 2**16)
    # P > 1: each rank holds, updates and checkpoints only its N/P columns of every E/F and rows
    # of the position table. auto: sharded where the run allows it (model.max_seq_len == N, the
    # ZeRO stage and precision), else whole, the reason on the [setup] line; true: sharded, or
    # an error naming what prevents it; false: every rank holds them whole.
    shard_sequence_parameters: Any = "auto"
    auto_shard: str | None = None  # set by resolve when auto was decided: the choice and why
    # Deadline of every start-up wait (rendezvous, ranks joining); afterwards DeepSpeed's timeout.
    init_timeout_s: float = bounded(DEFAULT_INIT_TIMEOUT_S, 0, 86400, lo_open=True)

    def rules(self, job: "JobConfig") -> None:
        shard = self.shard_sequence_parameters
        if shard not in (True, False, "auto"):
            self.bad("shard_sequence_parameters", f"must be auto, true or false, got {shard!r}")


@dataclass
class EvalConfig(Section):
    """Extra figures of every evaluation. ``context_windows``: the context curve
    (linformer_ds.context_curve) on ``context_rows`` rows of each valid split: the hidden-label
    loss and accuracy of the same masked positions seen through windows of W tokens
    (``context_loss_wW``, ``context_accuracy_wW``) and ``long_context_gain`` = loss(512) -
    loss(longest window); empty: off. Windows longer than the data's rows are left out."""

    key: ClassVar[str] = "eval"
    context_windows: list[int] = field(default_factory=list)
    context_rows: int = bounded(8, 1, MAX_COUNT)

    def rules(self, job: "JobConfig") -> None:
        ws = self.context_windows
        if any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in ws):
            self.bad("context_windows", f"must be window sizes >= 1 (tokens), got {list(ws)}")
        if ws and max(ws) > job.model.max_seq_len:
            self.bad("context_windows", f"{max(ws)} is longer than model.max_seq_len "
                     f"{job.model.max_seq_len}; use windows up to it")  # fmt: skip
        if ws and job.parallel.sequence_parallel_size > 1:
            self.bad("context_windows", "the context curve runs whole windows on each rank, not "
                     "under sequence parallelism; set eval.context_windows=[] or "
                     "parallel.sequence_parallel_size=1")  # fmt: skip


@dataclass
class DebugConfig(Section):
    """Test instruments of the trainer (docs/reliability.md), never set in normal runs; null:
    off. Each rank appends to its own file in the directory."""

    key: ClassVar[str] = "debug"
    sample_log: str | None = None  # DIR: samples.rank{R}.jsonl, the sample indices per step
    sync_log: str | None = None  # DIR: syncs.rank{R}.jsonl, host syncs of sync_steps
    sync_steps: list[int] = field(default_factory=lambda: [2, 3])  # the optimizer steps counted
    # TEST HOOK: the loss of this optimizer step times NaN (on rank nan_rank; null: every rank)
    nan_at_step: int | None = bounded(None, 1, MAX_STEPS, note="or null: off")
    nan_rank: int | None = bounded(None, 0, MAX_COUNT, note="or null: every rank")
    # TEST HOOK: start-up holds at this phase (one line) until a signal ends it
    pause_at: str | None = one_of(None, START_UP_PHASES, note="or null: off")

    def rules(self, job: "JobConfig") -> None:
        for name in ("sample_log", "sync_log"):
            problem = unusable_dir(getattr(self, name))
            if problem:
                self.bad(name, problem)
        if any(s < 1 for s in self.sync_steps):
            self.bad("sync_steps", f"must be optimizer steps >= 1, got {self.sync_steps}")


@dataclass(frozen=True)
class Resolved:
    """What ``linformer_ds.resolve.resolve`` decided for one run: the world it runs in and the
    data's N the sharding choice was made for (``model.max_seq_len`` when not given)."""

    world_size: int
    data_parallel_size: int  # model replicas: world_size / parallel.sequence_parallel_size
    seq_len: int
    document_isolation: bool = False  # data.document_isolation decided for the data
    isolation_why: str = ""  # how it was decided (the [setup] line)
    # data.sources and train.stages resolved (data.stages.Stage, in order): empty when
    # resolve() was not given them (the data is not known there)
    stages: tuple[Any, ...] = ()


@dataclass
class JobConfig:
    name: str = nonempty("linformer")
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    @property
    def resolved(self) -> Resolved:
        """The run's resolved values; only on a config returned by ``resolve``."""
        found = self.__dict__.get("_resolved")
        if found is None:
            raise RuntimeError("the job config is not resolved: use linformer_ds.resolve.resolve")
        return found


# ====================================================================================== loading
def load_config(path: str | None = None, overrides: list[str] | None = None) -> JobConfig:
    """Schema <- YAML file <- ``key=value`` overrides; interpolations resolved; checked once
    (:func:`validate`). Not yet resolved for a world: see ``linformer_ds.resolve.resolve``."""
    merged = OmegaConf.structured(JobConfig)
    if path:
        merged = merge(merged, load_yaml(path), path)
    if overrides:
        for item in overrides:  # each parses, and puts no list or value in place of a section
            check_shape(merged, parse_override(item), f"override {item!r}")
        try:  # one merge (each merge copies the whole config)
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(list(overrides)))
        except LOAD_ERRORS:  # name the override that fails
            for item in overrides:
                merged = merge(merged, parse_override(item), f"override {item!r}")
    try:
        OmegaConf.resolve(merged)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(omegaconf_message(e)) from None
    except ModelConfigError as e:
        raise ConfigError(str(e)) from None
    except (*LOAD_ERRORS, RecursionError) as e:
        raise ConfigError(f"the config cannot be resolved: {e}") from None
    assert isinstance(cfg, JobConfig)
    _check_required(path, overrides or [])
    validate(cfg)
    return cfg


def _check_required(path: str | None, overrides: list[str]) -> None:
    """A config that sets nothing, or leaves ``data.path`` / ``model`` to the schema, is an error
    (the YAML file and the overrides together must set them)."""
    user = load_yaml(path) if path else OmegaConf.create({})
    if path and len(user) == 0:
        raise ConfigError(
            f"{path}: the config file sets nothing; start from one in configs/ (e.g. "
            "configs/tiny_cpu.yaml)"
        )
    user = merge(user, OmegaConf.from_dotlist(list(overrides)), "the overrides")
    if not path and not overrides:
        raise ConfigError(
            "no job config: pass --config FILE (see configs/, e.g. configs/tiny_cpu.yaml) "
            "and/or key=value overrides that set data.path and model.*"
        )
    has_sources = OmegaConf.select(user, "data.sources") or OmegaConf.select(user, "train.stages")
    if OmegaConf.select(user, "data.path") is None and not has_sources:
        raise ConfigError(
            "data.path: not set; name a data_prep output directory (data.path=DIR in the YAML "
            "file or as an override), or a mixture in data.sources"
        )
    model = OmegaConf.select(user, "model")
    if not isinstance(model, DictConfig) or len(model) == 0:
        raise ConfigError(
            "model: not set; the config would train the schema's default 102M-parameter model. "
            "Describe the model (a model: section, e.g. from configs/tiny_cpu.yaml)"
        )


def to_dict(cfg: JobConfig) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]


def to_yaml(cfg: JobConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def from_dict(d: dict[str, Any]) -> JobConfig:
    """Rebuild a JobConfig from ``to_dict`` output (e.g. a checkpoint's saved config)."""
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(JobConfig), d))  # type: ignore[return-value]
    except OmegaConfBaseException as e:
        raise ConfigError(omegaconf_message(e)) from None
    except (ModelConfigError, *LOAD_ERRORS) as e:
        raise ConfigError(str(e)) from None


# =================================================================================== validation
def data_parallel_size(cfg: JobConfig, world_size: int) -> int:
    """Model replicas: the world over the sequence-parallel size."""
    return max(1, world_size // max(1, cfg.parallel.sequence_parallel_size))


SECTIONS = ("data", "optimizer", "scheduler", "train", "deepspeed", "logging", "checkpoint",
            "parallel", "eval", "debug")  # fmt: skip


def validate(cfg: JobConfig) -> None:
    """The first problem of the config as a :class:`ConfigError` naming its key: the model's
    own checks (``ModelConfig.validate``), then each section's ``validate``. Run once, by
    :func:`load_config` (or by ``resolve`` for a config built otherwise)."""
    problem = field_problem(next(f for f in dataclasses.fields(cfg) if f.name == "name"), cfg.name)
    if problem:
        raise ConfigError(f"name: {problem}")
    try:
        cfg.model.validate()
    except ModelConfigError as e:
        raise ConfigError(str(e)) from None
    for name in SECTIONS:
        getattr(cfg, name).validate(cfg)
    cfg.__dict__["_validated"] = True  # not a field: to_dict and from_dict never see it
