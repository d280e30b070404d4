"""The typed job config: the single source of truth for a pretraining run.

YAML files and ``key=value`` command-line overrides (OmegaConf dotlist) are merged onto the
structured schema below; unknown keys and wrong types are errors naming the key path. The
DeepSpeed JSON config is derived from it by ``deepspeed_config``.
"""

import copy
import dataclasses
import difflib
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional, Tuple

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from linformer_ds.model import ModelConfig, ModelConfigError


class ConfigError(ValueError):
    """A job config problem, in one line; the message names the key path."""

    def __init__(self, message: Any):
        super().__init__(" ".join(str(message).split()))


# ============================================================================ declared checks
# Every field states what values it takes next to its definition: numbers a range (``bounded``),
# strings a set of choices (``one_of``) or non-empty (``nonempty``). ``check_fields`` reads these
# declarations; a section's ``validate`` adds only the rules that involve other fields.
# Upper bounds on counts are sanity caps far above any real run: a typo such as
# micro_batch_size=2**62 is refused here, not found by building an index list of that size.
MAX_STEPS = 2**40
MAX_BATCH = 2**20
MAX_COUNT = 2**31 - 1


@dataclass(frozen=True)
class Range:
    """Valid values of a numeric field: ``lo``/``hi`` (None: unbounded), open or closed;
    ``note`` says what a boundary value means; ``text`` replaces the generated wording."""

    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False
    hi_open: bool = False
    note: str = ""
    text: str = ""

    def problem(self, value: Any) -> Optional[str]:
        if value is None:
            return None
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite number, got {value}"
        low = self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo)
        high = self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi)
        if not (low or high):
            return None
        note = f" ({self.note})" if self.note else ""
        if self.text:
            return f"must be {self.text}{note}, got {value}"
        if low:
            return f"must be {'>' if self.lo_open else '>='} {self.lo}{note}, got {value}"
        return f"must be {'<' if self.hi_open else '<='} {self.hi}{note}, got {value}"


def bounded(default: Any, lo: Optional[float] = None, hi: Optional[float] = None, **kw: Any) -> Any:
    """A numeric field with its valid range (see :class:`Range`)."""
    return field(default=default, metadata={"range": Range(lo, hi, **kw)})


def one_of(default: Optional[str], choices: Tuple[str, ...], note: str = "") -> Any:
    """A string field that takes one of ``choices`` (None also when the default is None)."""
    return field(default=default, metadata={"choices": choices, "note": note})


def nonempty(default: str) -> Any:
    return field(default=default, metadata={"nonempty": True})


def _choices_text(choices: Tuple[str, ...]) -> str:
    if len(choices) > 3:
        return "one of " + ", ".join(choices)
    return ", ".join(choices[:-1]) + f" or {choices[-1]}" if len(choices) > 1 else choices[0]


def field_problem(f: dataclasses.Field, value: Any) -> Optional[str]:
    """Why ``value`` breaks the declaration of field ``f`` (None: it does not)."""
    meta = f.metadata
    if isinstance(value, str) and "\x00" in value:
        return "must not contain a NUL character"
    if "range" in meta:
        return meta["range"].problem(value)
    if "choices" in meta and value is not None and value not in meta["choices"]:
        note = f" ({meta['note']})" if meta["note"] else ""
        return f"must be {_choices_text(meta['choices'])}{note}, got {value!r}"
    if meta.get("nonempty") and not str(value or "").strip():
        return "must not be empty"
    return None


def check_fields(section: Any, prefix: str) -> None:
    """Raise a :class:`ConfigError` for the first field of ``section`` outside its declaration
    (nested sections are checked by their own ``validate``)."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        key = f"{prefix}.{f.name}" if prefix else f.name
        problem = field_problem(f, value)
        if problem:
            raise ConfigError(f"{key}: {problem}")
        if isinstance(value, list):  # lists of records (data.sources, train.stages)
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    check_fields(item, f"{key}[{i}]")


class Section:
    """A config section: ``validate`` checks every field's declaration (:func:`check_fields`),
    then the section's own rules across fields (``rules``). ``key`` is its path in the job
    config; ``world_size`` and the data's ``seq_len`` are given once known."""

    key: ClassVar[str] = ""

    def validate(
        self, job: "JobConfig", world_size: Optional[int] = None, seq_len: Optional[int] = None
    ) -> None:
        check_fields(self, self.key)
        self.rules(job, world_size, seq_len)

    def rules(self, job: "JobConfig", world_size: Optional[int], seq_len: Optional[int]) -> None:
        """Checks that involve other fields, sections, the world size or the data."""

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
    end_step: Optional[int] = bounded(None, 1, MAX_STEPS)
    sources: List[str] = field(default_factory=list)
    weights: Optional[List[float]] = None
    path: Optional[str] = None
    micro_batch_size: Optional[int] = bounded(
        None, 1, MAX_BATCH, note="or null: train.micro_batch_size"
    )


@dataclass
class DataConfig(Section):
    key: ClassVar[str] = "data"
    path: str = nonempty("data/stdlib")  # a data_prep output directory
    # a weighted mixture of data_prep outputs (same tokenizer and N); when set, path is unused
    sources: List[SourceConfig] = field(default_factory=list)
    train_split: str = nonempty("train")
    valid_split: str = nonempty("valid")
    mlm_probability: float = bounded(0.15, 0, 1, lo_open=True, hi_open=True, text="in (0, 1)")
    verify_checksums: bool = False  # full sha256 of every shard at start (slow on big data)
    # BERT/RoBERTa-style short inputs: this fraction of training rows is cut to a random length
    # in [2, N-1] (the tail becomes unlabelled padding); a function of (seed, epoch, row)
    short_seq_prob: float = bounded(0.0, 0, 1, hi_open=True, text="in [0, 1)")
    # data.sources and train.stages (names, weights, end steps) are checked by
    # linformer_ds.data.stages.resolve_stages, called by the trainer (config imports no data)


@dataclass
class OptimizerConfig(Section):
    key: ClassVar[str] = "optimizer"
    lr: float = bounded(1e-4, 0, lo_open=True)
    betas: List[float] = field(default_factory=lambda: [0.9, 0.98])
    eps: float = bounded(1e-6, 0, lo_open=True)
    weight_decay: float = bounded(0.01, 0)

    def rules(self, job: "JobConfig", world_size: Optional[int], seq_len: Optional[int]) -> None:
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
    stop_at_step: Optional[int] = bounded(None, 1, MAX_STEPS, note="or null: run to max_steps")
    micro_batch_size: int = bounded(8, 1, MAX_BATCH)  # per rank
    gradient_accumulation_steps: int = bounded(1, 1, MAX_BATCH)
    # if set: must equal micro x ranks x accumulation
    global_batch_size: Optional[int] = bounded(None, 1, MAX_STEPS, note="or null")
    seed: int = bounded(42, 0, 2**32, hi_open=True, text="in [0, 2**32)")
    log_interval: int = bounded(10, 1, MAX_STEPS)
    eval_interval: int = bounded(1000, 0, MAX_STEPS, note="0 turns evaluation off")
    # validation micro-batches per rank per evaluation
    eval_batches: int = bounded(20, 0, MAX_COUNT, note="0 turns evaluation off")
    # per rank, for MFU; None: measured at start, a GEMM in the run's precision (~3 s at most)
    peak_tflops: Optional[float] = bounded(None, 0, lo_open=True)
    save_on_signal: bool = True  # SIGUSR1/SIGTERM: checkpoint, then exit with EXIT_PREEMPTED
    # non-finite loss: "stop" (keep last good checkpoint) or "skip"
    nonfinite: str = one_of("stop", ("stop", "skip"))
    # sequence-length stages in step order (see docs/data.md); empty: one stage, all of data
    stages: List[StageConfig] = field(default_factory=list)
    # torch.compile the model through DeepSpeed's engine (engine.compile; docs/observability.md)
    compile: bool = False
    compile_backend: str = one_of("inductor", COMPILE_BACKENDS, note="torch.compile's backend")
    # inductor's mode; null: its default
    compile_mode: Optional[str] = one_of(None, COMPILE_MODES, note="or null: inductor's default")
    # null: static shapes first, dynamic after a shape changes (torch's default); true / false
    compile_dynamic: Optional[bool] = None

    def rules(self, job: "JobConfig", world_size: Optional[int], seq_len: Optional[int]) -> None:
        ds = job.deepspeed
        if self.compile_mode is not None and self.compile_backend != "inductor":
            self.bad(
                "compile_mode",
                f"is inductor's option; compile_backend is {self.compile_backend!r} (set "
                "compile_mode=null or compile_backend=inductor)",
            )
        if self.nonfinite == "skip" and ds.precision == "fp32" and ds.zero.stage == 0:
            self.bad(
                "nonfinite",
                "'skip' needs an optimizer that DeepSpeed can make skip a step (zero.stage >= 1, "
                "or precision bf16/fp16); ZeRO-0 fp32 applies every update",
            )
        if world_size is None or self.global_batch_size is None:
            return
        replicas = data_parallel_size(job, world_size)
        per_step = self.micro_batch_size * self.gradient_accumulation_steps * replicas
        if self.global_batch_size != per_step:
            sp = job.parallel.sequence_parallel_size
            what = "ranks" if sp == 1 else "replicas = ranks / sequence_parallel_size"
            self.bad(
                "global_batch_size",
                f"{self.global_batch_size} is not micro_batch_size ({self.micro_batch_size}) x "
                f"{what} ({replicas}) x gradient_accumulation_steps "
                f"({self.gradient_accumulation_steps}) = {per_step}",
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

    def rules(self, job: "JobConfig", world_size: Optional[int], seq_len: Optional[int]) -> None:
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
    number_checkpoints: Optional[int] = bounded(None, 1, MAX_COUNT)
    # layer: one checkpoint per layer; sublayer: the attention and the feed-forward sub-layers
    # apart (twice the saved inputs, the backward holds one sub-layer's activations at a time)
    granularity: str = one_of("layer", ("layer", "sublayer"))

    def rules(self, job: "JobConfig", world_size: Optional[int], seq_len: Optional[int]) -> None:
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
    precision: str = one_of(
        "bf16", PRECISIONS, "or auto: bf16 where this machine multiplies bf16 natively, else fp32"
    )
    auto_precision: Optional[str] = None  # set at load when precision was auto: why (amx_bf16)
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
    dist_backend: Optional[str] = one_of(None, DIST_BACKENDS, "or null: nccl on CUDA, gloo on CPU")
    # merged into the DeepSpeed JSON; only what the job config does not own (see OWNED_DS_KEYS)
    extra: Dict[str, Any] = field(default_factory=dict)

    def rules(self, job: "JobConfig", world_size: Optional[int], seq_len: Optional[int]) -> None:
        self.zero.validate(job, world_size, seq_len)
        self.activation_checkpointing.validate(job, world_size, seq_len)
        if self.zero.stage == 0 and self.precision != "fp32" and self.fp32_grad_accum:
            self.bad(
                "fp32_grad_accum",
                f"zero.stage=0 with {self.precision} cannot accumulate gradients in fp32 "
                "(DeepSpeed 0.19 raises 'unsupported mix'); set deepspeed.fp32_grad_accum=false "
                "or deepspeed.zero.stage >= 1",
            )
        extra = self.extra_dict()
        for key, value in _numbers(extra, "deepspeed.extra"):
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{key}: must be a finite number, got {value}")
        check_owned_keys(extra)
        if world_size is not None:
            check_deepspeed_extra(job, world_size)

    def precision_text(self) -> str:
        """``bf16``, or ``bf16 (auto: amx_bf16)`` when ``auto`` chose it."""
        why = self.auto_precision
        return f"{self.precision} (auto: {why})" if why else self.precision

    def extra_dict(self) -> Dict[str, Any]:
        """``extra`` as plain containers."""
        return OmegaConf.to_container(OmegaConf.create(self.extra)) or {}  # type: ignore[return-value]


@dataclass
class LoggingConfig(Section):
    key: ClassVar[str] = "logging"
    dir: str = nonempty("runs/${name}")
    tensorboard: bool = True
    # Prometheus /metrics on every rank at port + local rank (0: free ports, logged); None: off
    prometheus_port: Optional[int] = bounded(
        None, 0, 65535, text="a TCP port in [0, 65535]", note="0: free"
    )


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

    def rules(self, job: "JobConfig", world_size: Optional[int], seq_len: Optional[int]) -> None:
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
    auto_shard: Optional[str] = None  # set when auto was resolved: what it chose and why
    # Deadline of every start-up wait (rendezvous, ranks joining); afterwards DeepSpeed's timeout.
    init_timeout_s: float = bounded(300.0, 0, 86400, lo_open=True)

    def rules(self, job: "JobConfig", world_size: Optional[int], seq_len: Optional[int]) -> None:
        shard = self.shard_sequence_parameters
        if shard not in (True, False, "auto"):
            self.bad("shard_sequence_parameters", f"must be auto, true or false, got {shard!r}")
        if self.sequence_parallel_size == 1 or seq_len is not None:  # N known: decide auto now
            self.resolve_shard(job, world_size, seq_len)
        if self.sequence_parallel_size == 1:
            return
        errors = self._errors(job, world_size, seq_len, self.shard_sequence_parameters)
        if errors:
            raise ConfigError(errors[0])

    def _errors(
        self, job: "JobConfig", world_size: Optional[int], seq_len: Optional[int], shard: Any
    ) -> List[str]:
        from linformer_ds.sequence_parallel import config_errors

        zero_extra = job.deepspeed.extra_dict().get("zero_optimization", {})
        return config_errors(
            self.sequence_parallel_size,
            world_size=world_size,
            seq_len=seq_len or job.model.max_seq_len,
            model=job.model,
            zero_stage=job.deepspeed.zero.stage,
            zero_reduce_scatter=bool(zero_extra.get("reduce_scatter", True)),
            shard=shard,
            precision=job.deepspeed.precision,
        )

    def resolve_shard(
        self, job: "JobConfig", world_size: Optional[int], seq_len: Optional[int]
    ) -> None:
        """``shard_sequence_parameters: auto`` becomes true or false for sequence length
        ``seq_len`` (None: ``model.max_seq_len``): true unless a rule refuses sharding only
        (not the run); ``auto_shard`` records the choice and the reason. No-op unless auto."""
        if self.shard_sequence_parameters != "auto":
            return
        p = self.sequence_parallel_size
        if p == 1:
            self.shard_sequence_parameters, self.auto_shard = False, "whole: P = 1"
            return
        whole = set(self._errors(job, world_size, seq_len, False))
        refused = [e for e in self._errors(job, world_size, seq_len, True) if e not in whole]
        n = seq_len or job.model.max_seq_len
        self.shard_sequence_parameters = not refused
        self.auto_shard = (
            f"whole: {refused[0].split(': ', 1)[1].split('; ')[0]}"  # the rule, not the advice
            if refused
            else f"sharded: P = {p}, N = model.max_seq_len = {n}"
        )


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


# ====================================================================================== loading
# Everything a user wrote passes through this boundary: every YAML, OmegaConf or type error
# becomes one ConfigError naming the file or the override (and the key where it is known).
_LOAD_ERRORS = (OmegaConfBaseException, yaml.YAMLError, TypeError, ValueError, KeyError)


def _load_yaml(path: str, chain: Tuple[str, ...] = ()) -> DictConfig:
    """One YAML file, with its ``defaults: other.yaml`` (relative to it) merged underneath."""
    real = os.path.realpath(path)
    if real in chain:
        cycle = " -> ".join(os.path.basename(p) for p in (*chain, real))
        raise ConfigError(f"{path}: defaults: includes itself ({cycle}); remove the cycle")
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    try:
        cfg = OmegaConf.load(path)
    except Exception as e:  # yaml parse errors, undecodable bytes, unreadable file
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"{path}: top level must be a mapping")
    base = cfg.pop("defaults", None)
    if base is not None:
        if not isinstance(base, str) or not base.strip():
            raise ConfigError(
                f"{path}: defaults: must be one YAML file name (relative to this file), got {base}"
            )
        parent = _load_yaml(os.path.join(os.path.dirname(path), base), (*chain, real))
        cfg = _merge(parent, cfg, path)
    return cfg


def _omegaconf_message(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None)
    msg = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return f"{key}: {msg}" if key else msg


def _shape_mismatch(schema: Any, user: Any, prefix: str = "") -> Optional[str]:
    """The first key where ``user`` puts a mapping, a list or a scalar in place of another kind
    in ``schema`` (OmegaConf's own error names neither the key nor the kinds)."""
    kinds = {DictConfig: "a mapping (a config section)", ListConfig: "a list"}

    def kind(node: Any) -> str:
        return next((v for t, v in kinds.items() if isinstance(node, t)), "a single value")

    if not isinstance(user, DictConfig) or not isinstance(schema, DictConfig):
        return None
    for key in user.keys():
        if key not in schema:
            continue
        path = f"{prefix}.{key}" if prefix else str(key)
        want = schema._get_node(key)
        got = user._get_node(key)
        if isinstance(want, DictConfig) and want._metadata.object_type in (dict, None):
            if not isinstance(got, DictConfig) and not got._is_none():
                return f"{path}: must be {kind(want)}, got {got._value()}"
            continue  # a free-form mapping (deepspeed.extra, model.extra)
        if kind(want) != kind(got) and not got._is_none() and not got._is_interpolation():
            value = (
                OmegaConf.to_container(got) if isinstance(got, (DictConfig, ListConfig)) else got
            )
            return f"{path}: must be {kind(want)}, got {value}"
        deeper = _shape_mismatch(want, got, path)
        if deeper:
            return deeper
    return None


def _check_shape(base: DictConfig, user: Any, source: str) -> None:
    try:
        mismatch = _shape_mismatch(base, user)
    except AttributeError:  # OmegaConf's node API changed: its own merge error still names it
        mismatch = None
    if mismatch:
        raise ConfigError(f"{source}: {mismatch}")


def _merge(base: DictConfig, user: Any, source: str) -> DictConfig:
    """``base`` <- ``user`` (read from ``source``: a file or an override), one line on error."""
    _check_shape(base, user, source)
    try:
        return OmegaConf.merge(base, user)  # type: ignore[return-value]
    except OmegaConfBaseException as e:
        raise ConfigError(f"{source}: {_omegaconf_message(e)}") from None
    except _LOAD_ERRORS as e:
        raise ConfigError(f"{source}: {e}") from None


def _parse_override(item: str) -> DictConfig:
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key=value")
    try:
        return OmegaConf.from_dotlist([item])
    except _LOAD_ERRORS as e:
        if isinstance(e, yaml.MarkedYAMLError):
            msg = ": ".join(str(m) for m in (e.context, e.problem) if m)
        else:
            msg = _omegaconf_message(e) if isinstance(e, OmegaConfBaseException) else str(e)
        raise ConfigError(f"override {item!r}: the value is not valid YAML ({msg})") from None


def load_config(path: Optional[str] = None, overrides: Optional[List[str]] = None) -> JobConfig:
    """Schema <- YAML file <- ``key=value`` overrides; validated; interpolations resolved."""
    merged = OmegaConf.structured(JobConfig)
    if path:
        merged = _merge(merged, _load_yaml(path), path)
    if overrides:
        for item in overrides:  # each parses, and puts no list or value in place of a section
            _check_shape(merged, _parse_override(item), f"override {item!r}")
        try:  # one merge (each merge copies the whole config)
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(list(overrides)))
        except _LOAD_ERRORS:  # name the override that fails
            for item in overrides:
                merged = _merge(merged, _parse_override(item), f"override {item!r}")
    try:
        OmegaConf.resolve(merged)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(_omegaconf_message(e)) from None
    except ModelConfigError as e:
        raise ConfigError(str(e)) from None
    except (*_LOAD_ERRORS, RecursionError) as e:
        raise ConfigError(f"the config cannot be resolved: {e}") from None
    assert isinstance(cfg, JobConfig)
    _check_required(path, overrides or [])
    resolve_precision(cfg)
    validate(cfg)
    return cfg


def resolve_precision(cfg: JobConfig) -> None:
    """``deepspeed.precision: auto`` becomes bf16 where this machine's accelerator multiplies
    bf16 natively (``linformer_ds.perf.native_bf16``) and fp32 elsewhere; ``auto_precision``
    records why (the ``[setup]`` line shows it; checkpoints save the resolved precision)."""
    ds = cfg.deepspeed
    ds.auto_precision = None
    if ds.precision != "auto":
        return
    from deepspeed.accelerator import get_accelerator

    from linformer_ds.perf import native_bf16

    why = native_bf16(get_accelerator().device_name())
    ds.precision = "bf16" if why else "fp32"
    ds.auto_precision = why or "no native bf16"


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
    user = _merge(user, OmegaConf.from_dotlist(list(overrides)), "the overrides")
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
    except (ModelConfigError, *_LOAD_ERRORS) as e:
        raise ConfigError(str(e)) from None


# =================================================================================== validation
def _numbers(obj: Any, prefix: str = "") -> List[Tuple[str, Any]]:
    """``(key path, value)`` of every number in nested dicts and lists."""
    out: List[Tuple[str, Any]] = []
    if isinstance(obj, dict):
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


SECTIONS = ("data", "optimizer", "scheduler", "train", "deepspeed", "logging", "checkpoint",
            "parallel")  # fmt: skip


def validate(
    cfg: JobConfig, world_size: Optional[int] = None, seq_len: Optional[int] = None
) -> None:
    """The first problem of the config as a :class:`ConfigError` naming its key: the model's
    own checks (``ModelConfig.validate``), then each section's ``validate``. ``world_size`` and
    the data's sequence length ``seq_len`` when known (the trainer validates again then)."""
    problem = field_problem(next(f for f in dataclasses.fields(cfg) if f.name == "name"), cfg.name)
    if problem:
        raise ConfigError(f"name: {problem}")
    try:
        cfg.model.validate()
    except ModelConfigError as e:
        raise ConfigError(str(e)) from None
    for name in SECTIONS:
        getattr(cfg, name).validate(cfg, world_size, seq_len)


# ========================================================================= DeepSpeed JSON config
def _deep_update(base: Dict[str, Any], extra: Dict[str, Any]) -> Dict[str, Any]:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_update(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
    return base


def deepspeed_config(cfg: JobConfig, world_size: int, with_extra: bool = True) -> Dict[str, Any]:
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
    return _deep_update(out, ds.extra_dict()) if with_extra else out


# ======================================================================== deepspeed.extra checks
# The DeepSpeed JSON keys that the job config derives (deepspeed_config), and the field that sets
# each. deepspeed.extra cannot set them: a run would train one thing while the checkpoint
# metadata and the resume checks record another (extra.zero_optimization.stage=3 trained ZeRO-3
# under a checkpoint that said 2). A key owns its subtree; the longest listed prefix names the
# field.
OWNED_DS_KEYS: Dict[str, str] = {
    "train_batch_size": "train.global_batch_size",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.gradient_accumulation_steps",
    "gradient_clipping": "deepspeed.gradient_clipping",
    # the optimizer's math; its implementation (params.fused, params.torch_adam) is free
    "optimizer.type": "optimizer.* (the trainer's optimizer is AdamW)",
    "optimizer.params.lr": "optimizer.lr",
    "optimizer.params.betas": "optimizer.betas",
    "optimizer.params.eps": "optimizer.eps",
    "optimizer.params.weight_decay": "optimizer.weight_decay",
    "optimizer.params.adam_w_mode": "optimizer.* (the trainer's optimizer is AdamW)",
    "optimizer.params.amsgrad": "optimizer.* (the trainer's optimizer is AdamW)",
    "optimizer.params.maximize": "optimizer.* (the trainer's optimizer is AdamW)",
    "optimizer.params.bias_correction": "optimizer.* (the trainer's optimizer is AdamW)",
    "scheduler": "scheduler.* (warmup_steps, decay, min_lr_ratio)",
    "bf16": "deepspeed.precision",
    "bfloat16": "deepspeed.precision",
    "fp16": "deepspeed.precision",
    "fp16.loss_scale": "deepspeed.loss_scale",
    "fp16.initial_scale_power": "deepspeed.initial_scale_power",
    "fp16.loss_scale_window": "deepspeed.loss_scale_window",
    "fp16.hysteresis": "deepspeed.hysteresis",
    "fp16.min_loss_scale": "deepspeed.min_loss_scale",
    "amp": "deepspeed.precision",
    "torch_autocast": "deepspeed.precision",
    "data_types.grad_accum_dtype": "deepspeed.fp32_grad_accum",
    "activation_checkpointing": "deepspeed.activation_checkpointing.*",
    "zero_optimization.stage": "deepspeed.zero.stage",
    "zero_optimization.offload_optimizer.device": "deepspeed.zero.offload_optimizer",
    "zero_optimization.offload_param.device": "deepspeed.zero.offload_param",
    "zero_optimization.cpu_offload": "deepspeed.zero.offload_optimizer",
    "zero_optimization.cpu_offload_param": "deepspeed.zero.offload_param",
    "zero_optimization.overlap_comm": "deepspeed.zero.overlap_comm",
    "zero_optimization.contiguous_gradients": "deepspeed.zero.contiguous_gradients",
    "zero_optimization.reduce_bucket_size": "deepspeed.zero.reduce_bucket_size",
    "zero_optimization.allgather_bucket_size": "deepspeed.zero.allgather_bucket_size",
    "allgather_size": "deepspeed.zero.allgather_bucket_size",
}


# DeepSpeed keys the trainer itself sets, whatever the job config says: why.
FIXED_DS_KEYS: Dict[str, str] = {
    "zero_force_ds_cpu_optimizer": "the optimizer DeepSpeed builds is chosen by optimizer.*",
    "zero_allow_untested_optimizer": "the optimizer DeepSpeed builds is chosen by optimizer.*",
    "checkpoint.load_universal": "a checkpoint saved under another world size or layout is "
    "loaded through a universal checkpoint by itself",
    "gradient_allreduce_op": "the loss is normalized over the global batch, which relies on "
    "DeepSpeed averaging gradients over the replicas",
}


def _owner(path: str) -> Optional[str]:
    """The job config field that owns DeepSpeed key ``path`` (dotted), or None."""
    parts = path.split(".")
    for n in range(len(parts), 0, -1):
        owner = OWNED_DS_KEYS.get(".".join(parts[:n]))
        if owner:
            if owner.endswith(".*") and n < len(parts):  # a section: name the closest field
                section = _job_section(owner[:-2])
                near = difflib.get_close_matches(parts[n], section, n=1, cutoff=0.6)
                if near:
                    return f"{owner[:-2]}.{near[0]}"
            return owner
    return None


def _job_section(key: str) -> List[str]:
    """The field names of the job config section at ``key`` (dotted)."""
    node: Any = JobConfig
    for part in key.split("."):
        node = {f.name: f for f in dataclasses.fields(node)}[part].default_factory  # type: ignore[misc]
    return [f.name for f in dataclasses.fields(node)]


def _paths(d: Dict[str, Any], prefix: str = "", leaves: bool = False) -> List[str]:
    """Every key path of a nested dict, parents before children (``leaves``: only the paths to
    values that are not non-empty dicts)."""
    out: List[str] = []
    for key, value in d.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        inner = isinstance(value, dict) and bool(value)
        if not (leaves and inner):
            out.append(path)
        if inner:
            out += _paths(value, path, leaves)
    return out


def check_owned_keys(extra: Dict[str, Any]) -> None:
    """Refuse any key of ``deepspeed.extra`` that the job config owns (:data:`OWNED_DS_KEYS`)."""
    for path in _paths(extra, leaves=True):
        fixed = next(
            (why for key, why in FIXED_DS_KEYS.items() if f"{path}.".startswith(f"{key}.")), None
        )
        if fixed:
            raise ConfigError(f"deepspeed.extra.{path}: the trainer sets it ({fixed}); remove it")
        owner = _owner(path)
        if owner:
            raise ConfigError(
                f"deepspeed.extra.{path}: the job config sets it; use {owner} instead"
            )


class _RecordingDict(dict):
    """A dict that records, in a log shared with its nested dicts, which key paths DeepSpeed's
    config parser looks up, and which dicts it consumes whole (``**d``: pydantic models)."""

    def __init__(self, d: Dict[str, Any], log: set, path: Tuple[str, ...] = ()):
        super().__init__(
            {
                k: _RecordingDict(v, log, (*path, k)) if isinstance(v, dict) else v
                for k, v in d.items()
            }  # fmt: skip
        )
        self.log, self.path = log, path

    def _seen(self, key: Any) -> None:
        self.log.add((*self.path, str(key)))

    def get(self, key, default=None):  # noqa: D102
        self._seen(key)
        return super().get(key, default)

    def __contains__(self, key) -> bool:
        self._seen(key)
        return super().__contains__(key)

    def __getitem__(self, key):
        self._seen(key)
        return super().__getitem__(key)

    def __iter__(self):
        self._seen(WHOLE)
        return super().__iter__()

    def keys(self):  # noqa: D102
        self._seen(WHOLE)
        return super().keys()

    def items(self):  # noqa: D102
        self._seen(WHOLE)
        return super().items()


WHOLE = "*"  # the log's mark of a dict read whole (its keys are checked by whoever read it)


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


def _unknown_key(extra: Dict[str, Any], log: set) -> Optional[Tuple[str, List[str]]]:
    """The first key path of ``extra`` that DeepSpeed never read, with the keys it did read at
    that level (for a suggestion). Top-level keys are known if read or named by DeepSpeed's
    constants; a nested key if read, or if its dict was consumed whole (pydantic validated it)."""
    from deepspeed.runtime import constants

    top_known = {p[0] for p in log if len(p) == 1} | {
        v for k, v in vars(constants).items() if k.isupper() and isinstance(v, str)
    }
    for path in _paths(extra):
        parts = tuple(path.split("."))
        parent = parts[:-1]
        if not parent:
            if parts[0] not in top_known:
                return path, sorted(top_known)
            continue
        siblings = {p[-1] for p in log if p[:-1] == parent}
        if parent == ("pipeline",):  # merged whole into DeepSpeed's defaults: those are the keys
            from deepspeed.runtime.config import get_pipeline_config

            siblings = set(get_pipeline_config({}))
        if (
            WHOLE in siblings
            or not siblings
            or any((*parts[:n], WHOLE) in log for n in range(1, len(parent)))
        ):
            continue  # consumed whole (validated by pydantic), or never looked into
        if parts[-1] not in siblings:
            return path, sorted(siblings)
    return None


def _offload_device(offload: Any) -> Optional[str]:
    device = getattr(offload, "device", None)
    device = getattr(device, "value", device)
    return None if device in (None, "none") else str(device)


def _optimizer_math(parsed: Any) -> Dict[str, Any]:
    """The optimizer parameters that change what it computes (not how: fused, torch_adam)."""
    owned = {k.split(".")[-1] for k in OWNED_DS_KEYS if k.startswith("optimizer.params.")}
    return {k: v for k, v in (parsed.optimizer_params or {}).items() if k in owned}


# What DeepSpeed derives from the owned keys, read back from its parsed config: deepspeed.extra
# must leave all of it as the job config set it, however it is spelled (deprecated aliases such
# as zero_optimization.cpu_offload or zero_optimization: true included).
_OWNED_SETTINGS = {
    "the ZeRO stage": (lambda c: c.zero_optimization_stage, "deepspeed.zero.stage"),
    "optimizer offload": (
        lambda c: _offload_device(c.zero_config.offload_optimizer),
        "deepspeed.zero.offload_optimizer",
    ),
    "parameter offload": (
        lambda c: _offload_device(c.zero_config.offload_param),
        "deepspeed.zero.offload_param",
    ),
    "bf16": (lambda c: c.bfloat16_config.enabled, "deepspeed.precision"),
    "fp16": (lambda c: repr(c.float16_config), "deepspeed.precision and deepspeed.loss_scale*"),
    "torch autocast": (lambda c: c.torch_autocast_enabled, "deepspeed.precision"),
    "gradient clipping": (lambda c: c.gradient_clipping, "deepspeed.gradient_clipping"),
    "the optimizer": (lambda c: (c.optimizer_name, _optimizer_math(c)), "optimizer.*"),
    "the LR scheduler": (lambda c: (c.scheduler_name, c.scheduler_params), "scheduler.*"),
    "the micro-batch size": (lambda c: c.train_micro_batch_size_per_gpu, "train.micro_batch_size"),
    "gradient accumulation": (
        lambda c: c.gradient_accumulation_steps,
        "train.gradient_accumulation_steps",
    ),
    "the gradient accumulation dtype": (lambda c: c.grad_accum_dtype, "deepspeed.fp32_grad_accum"),
    "activation checkpointing": (
        lambda c: repr(c.activation_checkpointing_config),
        "deepspeed.activation_checkpointing.*",
    ),
    "universal checkpoint loading": (lambda c: c.load_universal_checkpoint, "checkpoint.*"),
}


def _parse_deepspeed(ds: Dict[str, Any], extra: Dict[str, Any], log: set) -> Any:
    """DeepSpeed's own parse of ``ds`` (one ConfigError naming the key on refusal)."""
    import pydantic
    from deepspeed.runtime.config import DeepSpeedConfig as DeepSpeedJSONConfig

    ds_logger = logging.getLogger("DeepSpeed")
    level = ds_logger.level
    ds_logger.setLevel(logging.ERROR)  # its deprecation notices are not ours to print
    try:
        return DeepSpeedJSONConfig(_RecordingDict(ds, log))
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        key = _pydantic_key(ds, tuple(err["loc"]), e.title)
        where = f"deepspeed.extra.{key}" if key.split(".")[0] in extra else f"deepspeed ({key})"
        near = None
        if err.get("type") == "extra_forbidden":
            near = _field_suggestion(e.title, tuple(err["loc"]))
        hint = f"; did you mean {near!r}?" if near else ""
        raise ConfigError(f"{where}: {err['msg']} (got {err.get('input')!r}){hint}") from None
    except (AssertionError, ValueError, TypeError, KeyError, AttributeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(
            f"deepspeed.extra: DeepSpeed refuses the derived config: {first}"
        ) from None
    finally:
        ds_logger.setLevel(level)


def _field_suggestion(model_name: str, loc: Tuple[Any, ...]) -> Optional[str]:
    """A close match for the unknown key ``loc`` (one level deep) among the fields (and
    aliases) of DeepSpeed's pydantic config model ``model_name``."""
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    todo, models = [DeepSpeedConfigModel], {}
    while todo:
        cls = todo.pop()
        models[cls.__name__] = cls
        todo += cls.__subclasses__()
    model = models.get(model_name)
    if model is None or len(loc) != 1:
        return None
    names = {n for name, f in model.model_fields.items() for n in (name, f.alias) if n}
    near = difflib.get_close_matches(str(loc[0]), sorted(names), n=1)
    return near[0] if near else None


def _check_optimizer_options(cfg: JobConfig, params: Dict[str, Any]) -> None:
    """``optimizer.params`` reach the optimizer class DeepSpeed picks (torch's AdamW with
    torch_adam, else DeepSpeedCPUAdam under optimizer offload, else FusedAdam) as keywords: an
    option it does not take is refused here instead of failing in the engine's constructor."""
    import inspect

    import torch

    if params.get("torch_adam"):
        cls: Any = torch.optim.AdamW
    else:
        from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

        cls = DeepSpeedCPUAdam if cfg.deepspeed.zero.offload_optimizer else FusedAdam
    taken = set(inspect.signature(cls.__init__).parameters) - {"self", "params", "model_params"}
    taken |= {"torch_adam", "adam_w_mode", "fp32_optimizer_states"}  # DeepSpeed's own
    for key in params:
        if key not in taken:
            near = difflib.get_close_matches(key, sorted(taken), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ConfigError(
                f"deepspeed.extra.optimizer.params.{key}: {cls.__name__} (the optimizer DeepSpeed "
                f"builds here) takes no such option{hint}"
            )


def check_deepspeed_extra(cfg: JobConfig, world_size: int) -> None:
    """Check ``deepspeed.extra`` with DeepSpeed's own config classes before any process group
    starts: owned keys refused (:data:`OWNED_DS_KEYS`), values checked by DeepSpeed's models,
    keys DeepSpeed does not read refused at every level, and nothing the job config owns
    changed however it is spelled. One :class:`ConfigError` naming the key."""
    extra = cfg.deepspeed.extra_dict()
    check_owned_keys(extra)
    # Without a process group DeepSpeed assumes one rank, with one (a trainer built in a
    # process that already trained) all of its ranks: check the batch arithmetic for those.
    import torch.distributed as dist

    seen = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    one_rank = cfg.train.micro_batch_size * cfg.train.gradient_accumulation_steps * seen
    base = deepspeed_config(cfg, world_size, with_extra=False) | {"train_batch_size": one_rank}
    full = deepspeed_config(cfg, world_size) | {"train_batch_size": one_rank}
    log: set = set()
    parsed = _parse_deepspeed(full, extra, log)
    unknown = _unknown_key(extra, log)
    if unknown:
        path, known = unknown
        near = difflib.get_close_matches(path.split(".")[-1], known, n=1)
        hint = ""
        if near:
            owner = _owner(".".join([*path.split(".")[:-1], near[0]]))
            hint = f"; did you mean {near[0]!r}?" + (f" (set by {owner})" if owner else "")
        raise ConfigError(
            f"deepspeed.extra.{path}: DeepSpeed does not read this key{hint} (see "
            "https://www.deepspeed.ai/docs/config-json/)"
        )
    _check_optimizer_options(cfg, full["optimizer"]["params"])
    if extra:
        reference = _parse_deepspeed(base, {}, set())
        for what, (read, owner) in _OWNED_SETTINGS.items():
            if read(parsed) != read(reference):
                raise ConfigError(
                    f"deepspeed.extra changes {what} ({read(reference)!r} -> {read(parsed)!r}), "
                    f"which the job config sets; use {owner} instead"
                )
