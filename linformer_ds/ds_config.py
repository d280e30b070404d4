"""The DeepSpeed JSON config derived from the job config, and the checks of ``deepspeed.extra``:
keys the job config owns are refused, the rest is parsed by DeepSpeed's own config classes before
any process group starts (one :class:`~linformer_ds.config.ConfigError` naming the key)."""

import copy
import dataclasses
import difflib
import inspect
import logging
import math
from typing import Any

import torch
import torch.distributed as dist

from linformer_ds.config import ConfigError, JobConfig, data_parallel_size


def _numbers(obj: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """``(key path, value)`` of every number in nested dicts and lists."""
    out: list[tuple[str, Any]] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _numbers(v, f"{prefix}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out += _numbers(v, f"{prefix}[{i}]")
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        out.append((prefix, obj))
    return out


# ========================================================================= DeepSpeed JSON config
def _deep_update(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_update(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
    return base


def deepspeed_config(cfg: JobConfig, world_size: int, with_extra: bool = True) -> dict[str, Any]:
    """The DeepSpeed JSON config derived from the job config (plus ``deepspeed.extra``)."""
    t, ds, z = cfg.train, cfg.deepspeed, cfg.deepspeed.zero
    zero: dict[str, Any] = {"stage": z.stage}
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
    out: dict[str, Any] = {
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
                # torch's fused AdamW kernel: the same update in one pass over the flat fp32
                # partition; the default on CPU is the single-tensor loop (about a dozen passes,
                # several times slower: BENCHMARKS.md "Per-op profile")
                "fused": True,
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
    if not with_extra:
        return out
    return merge_extra(out, ds.extra_dict())


def merge_extra(out: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``extra`` merged into the DeepSpeed JSON ``out`` (in place; returned): nested keys
    update, others replace. With ``torch_adam`` off the trainer's ``fused`` is dropped unless
    ``extra`` sets it: DeepSpeed's FusedAdam / DeepSpeedCPUAdam take no ``fused``."""
    out = _deep_update(out, extra)
    params = out.get("optimizer", {}).get("params", {})
    if not params.get("torch_adam") and "fused" not in extra.get("optimizer", {}).get("params", {}):
        params.pop("fused", None)
    return out


# ======================================================================== deepspeed.extra checks
# The DeepSpeed JSON keys that the job config derives (deepspeed_config), and the field that sets
# each. deepspeed.extra cannot set them: a run would train one thing while the checkpoint
# metadata and the resume checks record another (extra.zero_optimization.stage=3 trained ZeRO-3
# under a checkpoint that said 2). A key owns its subtree; the longest listed prefix names the
# field.
OWNED_DS_KEYS: dict[str, str] = {
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
FIXED_DS_KEYS: dict[str, str] = {
    "zero_force_ds_cpu_optimizer": "the optimizer DeepSpeed builds is chosen by optimizer.*",
    "zero_allow_untested_optimizer": "the optimizer DeepSpeed builds is chosen by optimizer.*",
    "checkpoint.load_universal": "a checkpoint saved under another world size or layout is "
    "loaded through a universal checkpoint by itself",
    "gradient_allreduce_op": "the loss is normalized over the global batch, which relies on "
    "DeepSpeed averaging gradients over the replicas",
}


def _owner(path: str) -> str | None:
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


def _job_section(key: str) -> list[str]:
    """The field names of the job config section at ``key`` (dotted)."""
    node: Any = JobConfig
    for part in key.split("."):
        node = {f.name: f for f in dataclasses.fields(node)}[part].default_factory  # type: ignore[misc]
    return [f.name for f in dataclasses.fields(node)]


def _items(d: dict[str, Any], prefix: str = "", leaves: bool = False) -> list[tuple[str, Any]]:
    """``(key path, value)`` of every key of a nested dict, parents before children
    (``leaves``: only those whose values are not non-empty dicts)."""
    out: list[tuple[str, Any]] = []
    for key, value in d.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        inner = isinstance(value, dict) and bool(value)
        if not (leaves and inner):
            out.append((path, value))
        if inner:
            out += _items(value, path, leaves)
    return out


def check_owned_keys(extra: dict[str, Any]) -> None:
    """Refuse any key of ``deepspeed.extra`` that the job config owns (:data:`OWNED_DS_KEYS`)."""
    for path, value in _items(extra, leaves=True):
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
        inside = [k for k in OWNED_DS_KEYS if k.startswith(f"{path}.")]
        # a scalar would replace the whole section (zero_optimization: a bool is DeepSpeed's
        # old spelling of a stage, compared with the job config's by check_deepspeed_extra)
        if inside and not isinstance(value, dict) and path != "zero_optimization":
            raise ConfigError(
                f"deepspeed.extra.{path}: must be a section (a mapping), got {value!r}; the "
                f"job config sets {path}.{inside[0][len(path) + 1 :]} ({OWNED_DS_KEYS[inside[0]]})"
            )


class _RecordingDict(dict):
    """A dict that records, in a log shared with its nested dicts, which key paths DeepSpeed's
    config parser looks up, and which dicts it consumes whole (``**d``: pydantic models)."""

    def __init__(self, d: dict[str, Any], log: set, path: tuple[str, ...] = ()):
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


def _pydantic_key(ds: dict[str, Any], loc: tuple[Any, ...], model: str) -> str:
    """The JSON path of a pydantic error ``loc`` inside the DeepSpeed config ``ds``."""
    path = [str(p) for p in loc]
    for top, value in ds.items():
        node: Any = value
        for part in path[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and (path[-1] in node or not path):
            return ".".join([top, *path])
    return ".".join(path) or model


def _unknown_key(extra: dict[str, Any], log: set) -> tuple[str, list[str]] | None:
    """The first key path of ``extra`` that DeepSpeed never read, with the keys it did read at
    that level (for a suggestion). Top-level keys are known if read or named by DeepSpeed's
    constants; a nested key if read, or if its dict was consumed whole (pydantic validated it)."""
    from deepspeed.runtime import constants

    top_known = {p[0] for p in log if len(p) == 1} | {
        v for k, v in vars(constants).items() if k.isupper() and isinstance(v, str)
    }
    for path, _ in _items(extra):
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


def _offload_device(offload: Any) -> str | None:
    device = getattr(offload, "device", None)
    device = getattr(device, "value", device)
    return None if device in (None, "none") else str(device)


def _optimizer_math(parsed: Any) -> dict[str, Any]:
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


def _parse_deepspeed(ds: dict[str, Any], extra: dict[str, Any], log: set) -> Any:
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


def _field_suggestion(model_name: str, loc: tuple[Any, ...]) -> str | None:
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


def _check_optimizer_options(cfg: JobConfig, params: dict[str, Any]) -> None:
    """``optimizer.params`` reach the optimizer class DeepSpeed picks (torch's AdamW with
    torch_adam, else DeepSpeedCPUAdam under optimizer offload, else FusedAdam) as keywords: an
    option it does not take is refused here instead of failing in the engine's constructor."""
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
    for key, value in _numbers(extra, "deepspeed.extra"):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}: must be a finite number, got {value}")
    check_owned_keys(extra)
    # Without a process group DeepSpeed assumes one rank, with one (a trainer built in a
    # process that already trained) all of its ranks: check the batch arithmetic for those.
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
