"""The one place a job config is resolved for a run: what ``auto`` means on this machine and in
this world, the checks that need the world size or the data's N, and the frozen result.

``load_config`` checks every field once (``config.validate``); :func:`resolve` then decides
``deepspeed.precision: auto``, ``parallel.shard_sequence_parameters: auto``,
``data.document_isolation: auto`` (each with the reason for the ``[setup]`` line) and the
data-parallel size, once, before any component that holds the config is built, and returns a
frozen copy: nothing changes it afterwards.
"""

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any

from linformer_ds.config import ConfigError, JobConfig, Resolved, data_parallel_size, validate
from linformer_ds.ds_config import check_deepspeed_extra
from linformer_ds.errors import LinformerError
from linformer_ds.parallel.checks import config_errors, isolation_errors
from linformer_ds.perf import native_bf16


def resolve(
    cfg: JobConfig,
    world_size: int,
    seq_len: None | int | Sequence[int] = None,
    packings: Sequence[str] | None = None,
    stages: Sequence[Any] = (),
) -> JobConfig:
    """``cfg`` resolved for ``world_size`` ranks and the data's sequence length ``seq_len`` (the
    N of every stage in order, or one N; None: ``model.max_seq_len``), frozen; ``cfg`` itself is
    left as it was. ``packings``: the ``packing`` of every training source's manifest, which
    decides ``data.document_isolation`` into ``result.resolved`` (:func:`decide_isolation`;
    None: the data is not known here, isolation off). ``stages``: the run's resolved stages
    (``data.stages.resolve_stages``), kept in ``result.resolved.stages``. The first problem is a :class:`ConfigError` naming its key (the
    data layer checks the later stages' N). ``result.resolved`` holds the world's figures."""
    job = thawed_copy(cfg)
    if not cfg.__dict__.get("_validated"):  # built by from_dict or by hand, not load_config
        validate(job)
    resolve_precision(job)
    _check_precision_rules(job)
    _check_global_batch(job, world_size)
    check_deepspeed_extra(job, world_size)
    ns = [int(n) for n in ([seq_len] if isinstance(seq_len, int) else seq_len or [])]
    ns = ns or [int(job.model.max_seq_len)]
    n = ns[0]
    _resolve_shard(job, world_size, ns)
    if job.parallel.sequence_parallel_size > 1:
        errors = _sp_errors(job, world_size, n, job.parallel.shard_sequence_parameters)
        if errors:
            raise ConfigError(errors[0])
    isolated, why = False, ""
    if packings is not None:  # the setting stays as written (resume compares it as written)
        isolated, why = decide_isolation(job, packings)
    job.__dict__["_resolved"] = Resolved(
        world_size, data_parallel_size(job, world_size), n, isolated, why, tuple(stages)
    )
    return freeze(job)


def decide_isolation(job: JobConfig, packings: Sequence[str]) -> tuple[bool, str]:
    """``data.document_isolation`` decided and why: ``auto`` is on when every training source
    is packed ``full``; a combination the model cannot run (:func:`isolation_errors`) is refused
    (``true``) or turns ``auto`` off."""
    setting = job.data.document_isolation
    if setting is False:
        return False, "off"
    if setting == "auto":
        kinds = sorted({str(p) for p in packings})
        if kinds != ["full"]:
            return False, f"off (auto: packing {'/'.join(kinds)})"
    errors = isolation_errors(
        job.parallel.sequence_parallel_size, job.model, job.parallel.shard_sequence_parameters
    )
    if errors and setting is True:
        raise ConfigError(errors[0])
    if errors:
        return False, f"off (auto: {errors[0].split(': ', 1)[1].split(';')[0]})"
    return True, "on" if setting is True else "on (auto: full packing)"


# ================================================================================ resolutions
def resolve_precision(job: JobConfig) -> None:
    """``deepspeed.precision: auto`` becomes bf16 where this machine's accelerator multiplies
    bf16 natively (``linformer_ds.perf.native_bf16``) and fp32 elsewhere; ``auto_precision``
    records why (the ``[setup]`` line shows it; checkpoints save the resolved precision)."""
    ds = job.deepspeed
    ds.auto_precision = None
    if ds.precision != "auto":
        return
    from deepspeed.accelerator import get_accelerator  # heavy: only when auto

    why = native_bf16(get_accelerator().device_name())
    ds.precision = "bf16" if why else "fp32"
    ds.auto_precision = why or "no native bf16"


def _sp_errors(job: JobConfig, world_size: int, n: int, shard: Any) -> list[str]:
    zero_extra = job.deepspeed.extra_dict().get("zero_optimization", {})
    errors = config_errors(
        job.parallel.sequence_parallel_size,
        world_size=world_size,
        seq_len=n,
        model=job.model,
        zero_stage=job.deepspeed.zero.stage,
        zero_reduce_scatter=bool(zero_extra.get("reduce_scatter", True)),
        shard=shard,
        precision=job.deepspeed.precision,
    )
    if job.data.document_isolation is True:  # auto is decided with the data (decide_isolation)
        errors += isolation_errors(job.parallel.sequence_parallel_size, job.model, shard)
    return errors


def _resolve_shard(job: JobConfig, world_size: int, ns: list[int]) -> None:
    """``shard_sequence_parameters: auto`` becomes true or false for the sequence lengths ``ns``
    (every stage's N): true unless a rule refuses sharding only (not the run) for one of them;
    ``auto_shard`` records the choice and the reason. Nothing changes unless auto."""
    par = job.parallel
    par.auto_shard = None
    if par.shard_sequence_parameters != "auto":
        return
    p = par.sequence_parallel_size
    if p == 1:
        par.shard_sequence_parameters, par.auto_shard = False, "whole: P = 1"
        return
    refused = []
    for n in ns:
        whole = set(_sp_errors(job, world_size, n, False))
        refused += [e for e in _sp_errors(job, world_size, n, True) if e not in whole]
    par.shard_sequence_parameters = not refused
    par.auto_shard = (
        f"whole: {refused[0].split(': ', 1)[1].split('; ')[0]}"  # the rule, not the advice
        if refused
        else f"sharded: P = {p}, N = model.max_seq_len = {ns[0]}"
    )


# ===================================================================== checks of the run's values
def _check_precision_rules(job: JobConfig) -> None:
    """The rules that read the precision (known once ``auto`` is decided)."""
    ds, t = job.deepspeed, job.train
    if t.nonfinite == "skip" and ds.precision == "fp32" and ds.zero.stage == 0:
        raise ConfigError(
            "train.nonfinite: 'skip' needs an optimizer that DeepSpeed can make skip a step "
            "(zero.stage >= 1, or precision bf16/fp16); ZeRO-0 fp32 applies every update"
        )
    if ds.zero.stage == 0 and ds.precision != "fp32" and ds.fp32_grad_accum:
        raise ConfigError(
            f"deepspeed.fp32_grad_accum: zero.stage=0 with {ds.precision} cannot accumulate "
            "gradients in fp32 (DeepSpeed 0.19 raises 'unsupported mix'); set "
            "deepspeed.fp32_grad_accum=false or deepspeed.zero.stage >= 1"
        )


def _check_global_batch(job: JobConfig, world_size: int) -> None:
    t = job.train
    if t.global_batch_size is None:
        return
    replicas = data_parallel_size(job, world_size)
    per_step = t.micro_batch_size * t.gradient_accumulation_steps * replicas
    if t.global_batch_size != per_step:
        sp = job.parallel.sequence_parallel_size
        what = "ranks" if sp == 1 else "replicas = ranks / sequence_parallel_size"
        raise ConfigError(
            f"train.global_batch_size: {t.global_batch_size} is not micro_batch_size "
            f"({t.micro_batch_size}) x {what} ({replicas}) x gradient_accumulation_steps "
            f"({t.gradient_accumulation_steps}) = {per_step}"
        )


# ====================================================================================== freezing
# A resolved config's records (JobConfig, its sections, ModelConfig, lists of sources/stages)
# get a subclass whose __setattr__ refuses while the instance is marked frozen; isinstance,
# dataclasses.fields/asdict/replace (which gives an unfrozen copy), ==, copy and pickle work.
_FROZEN_CLASSES: dict[type, type] = {}


class FrozenConfigError(LinformerError, dataclasses.FrozenInstanceError):
    """An attempt to change a resolved (frozen) job config."""


def _refuse(self: Any, name: str) -> None:
    raise FrozenConfigError(
        f"{type(self).__name__}.{name}: the job config is frozen once resolved "
        "(linformer_ds.resolve); change a copy (dataclasses.replace) and resolve that"
    )


def _frozen_class(cls: type) -> type:
    base = cls.__dict__.get("_frozen_of", cls)
    if base not in _FROZEN_CLASSES:

        def __setattr__(self: Any, name: str, value: Any) -> None:
            if self.__dict__.get("_frozen"):
                _refuse(self, name)
            base.__setattr__(self, name, value)

        def __delattr__(self: Any, name: str) -> None:
            if self.__dict__.get("_frozen"):
                _refuse(self, name)
            base.__delattr__(self, name)

        def __eq__(self: Any, other: Any) -> Any:
            if not isinstance(other, base):
                return NotImplemented
            return all(getattr(self, f.name) == getattr(other, f.name)
                       for f in dataclasses.fields(base))  # fmt: skip

        def __reduce_ex__(self: Any, protocol: Any) -> Any:
            return _rebuild, (base, dict(self.__dict__))

        _FROZEN_CLASSES[base] = type(base.__name__, (base,), {
            "__setattr__": __setattr__, "__delattr__": __delattr__, "__eq__": __eq__,
            "__hash__": None, "__reduce_ex__": __reduce_ex__, "_frozen_of": base,
            "__module__": base.__module__, "__qualname__": base.__qualname__,
        })  # fmt: skip
    return _FROZEN_CLASSES[base]


def _rebuild(base: type, state: dict[str, Any]) -> Any:
    """Unpickle / copy a record: frozen again if it was."""
    obj = object.__new__(base)
    obj.__dict__.update(state)
    if state.get("_frozen"):
        obj.__class__ = _frozen_class(base)
    return obj


def _records(obj: Any) -> list[Any]:
    """``obj`` and every dataclass instance inside it (fields, lists, dicts)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = [obj]
        for f in dataclasses.fields(obj):
            out += _records(getattr(obj, f.name))
        return out
    if isinstance(obj, (list, tuple)):
        return [r for item in obj for r in _records(item)]
    if isinstance(obj, dict):
        return [r for item in obj.values() for r in _records(item)]
    return []


def freeze(cfg: JobConfig) -> JobConfig:
    """Mark ``cfg`` and every record inside it frozen (in place); returns it."""
    for rec in _records(cfg):
        if not isinstance(rec, Resolved):
            rec.__class__ = _frozen_class(type(rec))
            rec.__dict__["_frozen"] = True
    return cfg


def thawed_copy(cfg: JobConfig) -> JobConfig:
    """A deep copy of ``cfg`` that can be changed (and resolved), frozen or not."""
    job = copy.deepcopy(cfg)
    for rec in _records(job):
        if "_frozen" in rec.__dict__:
            del rec.__dict__["_frozen"]
            rec.__class__ = type(rec).__dict__.get("_frozen_of", type(rec))
    job.__dict__.pop("_resolved", None)
    return job
