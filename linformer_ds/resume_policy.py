"""What a resumed run may change: the resume policy of every job-config key (issue 30).

Every key of :class:`linformer_ds.config.JobConfig` (``[]`` marks the fields of a list's items:
``data.sources[].weight``) has one policy in :data:`POLICY`:

- ``identity``: what the run *is* (model, data, tokenizer, seed...). A change is refused before
  anything is loaded or written: one line naming each changed key with the saved and the new
  value (exit 2). ``allow`` names the switch that turns the refusal off (then it is applied).
- ``adjustable``: a hyper-parameter of how the run continues (optimizer, schedule, clipping,
  batch, steps, intervals, mixture weights, layout). DeepSpeed restores the optimizer's param
  groups (lr, betas, eps, weight_decay), the LR scheduler's base LRs and the ZeRO optimizer's
  ``clip_grad`` from the checkpoint, so :func:`apply_changes` writes the config's values back
  after the load; the rest is built from the config. A change is printed as one
  ``[resume] changed: optimizer.lr 0.001 -> 0.01`` line. ``how`` says where it takes effect.
- ``free``: nothing of the trained state depends on it (logging, paths, instruments, speed).

``tests/test_resume_policy.py`` fails when a config key has no policy here, and resumes with
generated changes: refused, or the value read back from the engine equals the new one.
"""

import dataclasses
import json
import os
import re
import time
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from linformer_ds.config import JobConfig, to_dict
from linformer_ds.fsio import atomic_write_json
from linformer_ds.optim import lr_lambda

IDENTITY, ADJUSTABLE, FREE = "identity", "adjustable", "free"
HISTORY_FILE = "config_history.jsonl"  # in logging.dir, beside config.json


@dataclass(frozen=True)
class Policy:
    """One key's resume policy. ``how``: where an adjustable value takes effect (optimizer,
    scheduler, clipping, loss_scaler: re-applied after the load; engine, layout, data, sampler,
    loop: built from the config); for identity keys who checks it (policy, model, seed, data)."""

    kind: str
    how: str = ""
    allow: str | None = None  # identity only: the config switch that permits the change


def _i(how: str = "policy", allow: str | None = None) -> Policy:
    return Policy(IDENTITY, how, allow)


def _a(how: str) -> Policy:
    return Policy(ADJUSTABLE, how)


_F = Policy(FREE)
_MODEL = _i("model")  # check_model_config: every model option
_DATA = _i("data", "checkpoint.allow_data_change")  # check_data_change: compared by content

POLICY: dict[str, Policy] = {
    "name": _F,
    # ---- model: the weights' meaning (checkpoint.io.check_model_config)
    **{
        f"model.{k}": _MODEL
        for k in (
            "vocab_size",
            "max_seq_len",
            "hidden_size",
            "num_layers",
            "num_heads",
            "intermediate_size",
            "dropout",
            "attention_dropout",
            "layer_norm_eps",
            "norm",
            "projection",
            "hybrid_linear_layers",
            "layer_projections",
            "k",
            "layer_k",
            "sharing",
            "freeze_projection",
            "projection_init_std",
            "projection_init",
            "position_init",
            "output_bias_init",
            "local_mixer",
            "local_mixer_kernel",
            "local_window",
            "routed_blocks",
            "routed_block",
            "positions",
            "rope_base",
            "initializer_range",
            "pad_token_id",
            "num_labels",
            "classifier_dropout",
            "tie_word_embeddings",
        )
    },  # fmt: skip
    "model.format_version": _F,  # the schema version: older formats load (check_model_config)
    "model.extra": _F,  # free-form metadata, ignored by the model
    # ---- data: what is trained on (paths compared by content: a copy elsewhere is the same)
    "data.path": _DATA,
    "data.sources": _i("policy", "checkpoint.allow_data_change"),  # the number of sources
    "data.sources[].name": _i(),  # the sampler's state is kept per source name
    "data.sources[].path": _DATA,
    "data.sources[].weight": _a("sampler"),  # MixtureSampler.weights from the config
    "data.train_split": _i("policy", "checkpoint.allow_data_change"),
    "data.valid_split": _F,  # evaluation only
    "data.mlm_probability": _a("data"),  # the masking of the rows still to come
    "data.verify_checksums": _F,
    "data.short_seq_prob": _a("data"),
    "data.document_isolation": _i(),  # positions and attention of every row: the model's input
    # ---- optimizer: DeepSpeed restores the param groups; re-applied after the load
    "optimizer.lr": _a("optimizer"),
    "optimizer.betas": _a("optimizer"),
    "optimizer.eps": _a("optimizer"),
    "optimizer.weight_decay": _a("optimizer"),
    # ---- scheduler: the LambdaLR's function is rebuilt from the config, its base LRs restored
    # (re-applied), the current LR re-derived at the restored step
    "scheduler.warmup_steps": _a("scheduler"),
    "scheduler.decay": _a("scheduler"),
    "scheduler.min_lr_ratio": _a("scheduler"),
    # ---- train
    "train.max_steps": _a("scheduler"),  # the schedule's end and the loop's
    "train.stop_at_step": _a("loop"),
    "train.micro_batch_size": _a("engine"),  # the sampler's position is in rows: any batch
    "train.gradient_accumulation_steps": _a("engine"),
    "train.global_batch_size": _a("engine"),
    "train.seed": _i("seed", "checkpoint.allow_seed_change"),  # check_run_config
    "train.log_interval": _a("loop"),
    "train.eval_interval": _a("loop"),
    "train.eval_batches": _a("loop"),
    "train.peak_tflops": _F,  # MFU's denominator
    "train.save_on_signal": _F,
    "train.nonfinite": _a("loop"),
    "train.stages": _i("policy", "checkpoint.allow_data_change"),  # the number of stages
    "train.stages[].end_step": _i(),  # the saved stream position belongs to its stage
    "train.stages[].sources": _i("policy", "checkpoint.allow_data_change"),
    "train.stages[].weights": _a("sampler"),
    "train.stages[].path": _DATA,
    "train.stages[].micro_batch_size": _a("data"),
    "train.compile": _F,
    "train.compile_backend": _F,
    "train.compile_mode": _F,
    "train.compile_dynamic": _F,
    "train.threads": _F,  # speed (the [setup] line says how many)
    "train.omp_wait_policy": _F,
    # ---- deepspeed: the layout loads through checkpoint.reshard (or is refused there)
    "deepspeed.precision": _a("layout"),
    "deepspeed.auto_precision": _F,  # derived: why auto chose
    "deepspeed.zero.stage": _a("layout"),
    "deepspeed.zero.offload_optimizer": _a("layout"),
    "deepspeed.zero.offload_param": _a("layout"),
    "deepspeed.zero.overlap_comm": _F,
    "deepspeed.zero.contiguous_gradients": _F,
    "deepspeed.zero.reduce_bucket_size": _F,
    "deepspeed.zero.allgather_bucket_size": _F,
    "deepspeed.gradient_clipping": _a("clipping"),  # ZeRO/bf16 optimizers restore clip_grad
    "deepspeed.fp32_grad_accum": _a("layout"),
    # fp16 only (no effect in bf16/fp32): the loss scaler is restored with the optimizer
    "deepspeed.loss_scale": _i(),  # static <-> dynamic: another scaler kind
    "deepspeed.initial_scale_power": _a("loss_scaler"),  # the scale restarts at 2**power
    "deepspeed.loss_scale_window": _a("loss_scaler"),
    "deepspeed.hysteresis": _a("loss_scaler"),
    "deepspeed.min_loss_scale": _a("loss_scaler"),
    "deepspeed.activation_checkpointing.enabled": _F,  # memory for compute, same numbers
    "deepspeed.activation_checkpointing.partition_activations": _F,
    "deepspeed.activation_checkpointing.cpu_checkpointing": _F,
    "deepspeed.activation_checkpointing.number_checkpoints": _F,
    "deepspeed.activation_checkpointing.granularity": _F,
    "deepspeed.dist_backend": _F,
    "deepspeed.extra": _F,  # only keys the job config does not own (check_deepspeed_extra)
    # ---- logging, checkpoint, parallel, debug
    "logging.dir": _F,
    "logging.tensorboard": _F,
    "logging.prometheus_port": _F,
    "logging.prometheus_host": _F,
    "logging.sinks": _F,
    "checkpoint.dir": _F,
    "checkpoint.save_interval": _a("loop"),
    "checkpoint.keep_last": _F,
    "checkpoint.resume": _F,
    "checkpoint.save_final": _F,
    "checkpoint.allow_seed_change": _F,
    "checkpoint.allow_data_change": _F,
    "checkpoint.init_from": _F,  # read at a fresh start only: a resume loads its weights
    "parallel.sequence_parallel_size": _a("layout"),
    "parallel.shard_sequence_parameters": _a("layout"),
    "parallel.auto_shard": _F,  # derived: why auto chose
    "parallel.init_timeout_s": _F,
    "eval.context_windows": _F,  # evaluation only (the context curve)
    "eval.context_rows": _F,
    "debug.sample_log": _F,
    "debug.sync_log": _F,
    "debug.sync_steps": _F,
    "debug.nan_at_step": _F,  # a test instrument (poisons one step's loss)
    "debug.nan_rank": _F,
    "debug.pause_at": _F,  # a test instrument (holds start-up for a signal)
}


# ======================================================================================= keys
def _item_type(tp: Any) -> Any:
    """The dataclass of ``list[Section]`` (else None)."""
    if typing.get_origin(tp) is list:
        (arg,) = typing.get_args(tp) or (None,)
        return arg if dataclasses.is_dataclass(arg) else None
    return None


def config_keys(cls: Any = JobConfig, prefix: str = "") -> Iterator[str]:
    """Every key of the job config: leaves, lists of sections (``data.sources``) and their
    items' fields (``data.sources[].weight``)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, key = hints[f.name], f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            yield from config_keys(tp, key + ".")
        elif _item_type(tp) is not None:
            yield key
            yield from config_keys(_item_type(tp), key + "[].")
        else:
            yield key


def policy_of(key: str) -> Policy:
    """The policy of a concrete key (``data.sources[1].weight`` -> ``data.sources[].weight``)."""
    return POLICY[re.sub(r"\[\d+\]", "[]", key)]


def counts() -> dict[str, int]:
    """Keys per policy."""
    out = {IDENTITY: 0, ADJUSTABLE: 0, FREE: 0}
    for p in POLICY.values():
        out[p.kind] += 1
    return out


# ================================================================================ differences
@dataclass(frozen=True)
class Change:
    key: str  # concrete: data.sources[1].weight
    saved: Any
    now: Any

    @property
    def policy(self) -> Policy:
        return policy_of(self.key)

    def text(self) -> str:
        return f"{self.key} {_show(self.saved)} -> {_show(self.now)}"


def _show(v: Any) -> str:
    return json.dumps(v) if isinstance(v, (str, list, dict)) or v is None else str(v)


def _walk(saved: Any, now: Any, key: str) -> Iterator[Change]:
    if (
        isinstance(saved, dict)
        and isinstance(now, dict)
        and key not in ("model.extra", "deepspeed.extra")
    ):
        for k in now:  # a key the checkpoint did not record (added since): nothing to compare
            if k in saved:
                yield from _walk(saved[k], now[k], f"{key}.{k}" if key else k)
        return
    if isinstance(now, list) and isinstance(saved, list) and now and isinstance(now[0], dict):
        if len(saved) != len(now):
            yield Change(key, saved, now)
            return
        for i, (a, b) in enumerate(zip(saved, now)):
            yield from _walk(a, b, f"{key}[{i}]")
        return
    if not _same(saved, now):
        yield Change(key, saved, now)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or (a == b and type(a) is type(b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return a == b


def changes(meta: dict[str, Any], cfg: JobConfig) -> list[Change]:
    """Every key whose value differs between the checkpoint's recorded config and ``cfg``."""
    saved = meta.get("config") or {}
    return list(_walk(saved, to_dict(cfg), ""))


def _allowed(cfg: JobConfig, p: Policy) -> bool:
    if p.allow is None:
        return False
    section, name = p.allow.split(".")
    return bool(getattr(getattr(cfg, section), name))


def effective(found: list[Change], cfg: JobConfig) -> list[Change]:
    """The changes that act on the resumed run: adjustable ones and permitted identity ones."""
    return [c for c in found if c.policy.kind == ADJUSTABLE
            or (c.policy.kind == IDENTITY and _allowed(cfg, c.policy))]  # fmt: skip


def refusal(found: list[Change], cfg: JobConfig, where: str) -> str | None:
    """One line naming every identity key that changed (saved and new value), or None. Model,
    seed and data keys are checked first by their own functions (their messages); data paths
    are compared by content there (``check_data_change``), not here."""
    refused = [c for c in found if c.policy.kind == IDENTITY and c.policy.how != "data"
               and not _allowed(cfg, c.policy)]  # fmt: skip
    if not refused:
        return None
    keys = "; ".join(
        f"{c.key}: checkpoint {_show(c.saved)}, config {_show(c.now)}" for c in refused
    )
    allows = sorted({c.policy.allow for c in refused if c.policy.allow})
    hint = f" (or set {' / '.join(f'{a}=true' for a in allows)})" if allows else ""
    return (
        f"{keys}: {where} was trained with the saved value, and such a key names what the run "
        f"is (a new value cannot apply to a resumed run). Resume with the saved value{hint}, or "
        "start a new run (another checkpoint.dir, or checkpoint.resume=never)"
    )


# =================================================================================== applying
def torch_optimizer(engine: Any) -> Any:
    """The torch optimizer DeepSpeed steps (its param groups are what the step reads)."""
    return getattr(engine, "basic_optimizer", None) or engine.optimizer


def apply_changes(engine: Any, cfg: JobConfig, found: list[Change]) -> None:
    """After a checkpoint load: the config's optimizer hyper-parameters, base LRs, current LR
    (the schedule of ``cfg`` at the restored step), clipping and fp16 loss-scaler settings
    written over what DeepSpeed restored. Idempotent: unchanged values are rewritten equal;
    ``found`` (the changes) only decides whether an fp16 loss scale restarts."""
    o = cfg.optimizer
    opt = torch_optimizer(engine)
    groups = [opt.param_groups]
    outer = getattr(engine.optimizer, "param_groups", None)
    if outer is not None and outer is not opt.param_groups:
        groups.append(outer)
    for gs in groups:
        for i, g in enumerate(gs):  # engine.param_groups: [decay, no_decay]
            g["betas"] = tuple(float(b) for b in o.betas)
            g["eps"] = float(o.eps)
            if i == 0:
                g["weight_decay"] = float(o.weight_decay)
            g["initial_lr"] = float(o.lr)
    sched = getattr(engine, "lr_scheduler", None)
    if sched is not None and hasattr(sched, "base_lrs"):
        n = len(sched.optimizer.param_groups)
        sched.base_lrs = [float(o.lr)] * n
        fns = getattr(sched, "lr_lambdas", None) or [_schedule(cfg)] * n
        lrs = [base * f(sched.last_epoch) for base, f in zip(sched.base_lrs, fns)]
        for gs in groups:
            for g, lr in zip(gs, lrs):
                g["lr"] = lr
        sched._last_lr = list(lrs)
    if hasattr(engine.optimizer, "clip_grad"):
        engine.optimizer.clip_grad = float(cfg.deepspeed.gradient_clipping)
    if cfg.deepspeed.precision == "fp16":
        _apply_loss_scaler(engine, cfg)
        if any(c.key == "deepspeed.initial_scale_power" for c in found):
            restart_loss_scale(engine, cfg)


def _schedule(cfg: JobConfig):
    s = cfg.scheduler
    return lr_lambda(s.warmup_steps, cfg.train.max_steps, s.decay, s.min_lr_ratio)


def _apply_loss_scaler(engine: Any, cfg: JobConfig) -> None:
    """fp16 dynamic loss scaling: DeepSpeed restores the scaler object with its settings."""
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    ds = cfg.deepspeed
    if scaler is None or not getattr(scaler, "dynamic", False):
        return
    scaler.scale_window = int(ds.loss_scale_window)
    scaler.min_scale = float(ds.min_loss_scale)
    if getattr(scaler, "delayed_shift", None) != ds.hysteresis:
        scaler.delayed_shift = scaler.cur_hysteresis = int(ds.hysteresis)


def restart_loss_scale(engine: Any, cfg: JobConfig) -> None:
    """``deepspeed.initial_scale_power`` changed on an fp16 resume: the scale restarts there."""
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if scaler is not None and getattr(scaler, "dynamic", False):
        scaler.cur_scale = float(2**cfg.deepspeed.initial_scale_power)


def changed_line(found: list[Change], cfg: JobConfig) -> str | None:
    """``[resume] changed: optimizer.lr 0.001 -> 0.01, ...`` (None when nothing acts)."""
    acting = effective(found, cfg)
    if not acting:
        return None
    return "[resume] changed: " + ", ".join(c.text() for c in acting)


# ============================================================================ the run's record
def record_start(
    cfg: JobConfig, step: int, tag: str | None, found: list[Change]
) -> tuple[str, str]:
    """After a start succeeded (rank 0): ``logging.dir/config.json`` is the config in use and
    ``config_history.jsonl`` gains ``{step, time, resumed_from, changed}`` (``changed``: key ->
    [saved, new], every policy). Returns both paths."""
    d = cfg.logging.dir
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "config.json")
    atomic_write_json(path, to_dict(cfg))
    record = {
        "step": step,
        "time": round(time.time(), 3),
        "resumed_from": tag,
        "changed": {c.key: [c.saved, c.now] for c in found},
    }
    history = os.path.join(d, HISTORY_FILE)
    with open(history, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    return path, history
