"""Checkpoint I/O: writing a tag crash-safely, checking a saved tag against the config, and
loading it without running pickled code.

Crash safety: a save first drops stale incomplete tags (and the marker of the tag it is about to
rewrite), then DeepSpeed writes, every file is fsync'ed, and only then ``COMPLETE`` (with the
inventory) and ``latest`` are written atomically.

Security: DeepSpeed 0.19.8 reads its files with ``torch.load(weights_only=False)``.
:func:`install_safe_loader` replaces the engine's loader by ``weights_only=True`` with only the
three DeepSpeed classes these files hold allowed, so a checkpoint cannot run pickled code.
"""

import contextlib
import errno
import glob
import hashlib
import json
import os
import pickle
import re
import resource
import shutil
from collections.abc import Iterator
from typing import Any

import torch

from linformer_ds.checkpoint.tags import (
    COMPLETE_FILE,
    FORMAT_VERSION,
    META_FILE,
    CheckpointError,
    complete_tags,
    read_meta,
    resolve_resume_tag,
    tag_dirs,
    tag_for,
)
from linformer_ds.config import JobConfig, to_dict
from linformer_ds.data.shards import tokenizer_name
from linformer_ds.dirlock import try_exclusive
from linformer_ds.fsio import atomic_write_text


# ========================================================================================= save
def check_writable(path: str, what: str = "checkpoint.dir") -> None:
    """Create ``path`` and write/remove a probe file in it; a clear error if that fails."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write_probe.{os.getpid()}")
        with open(probe, "w") as f:
            f.write("probe\n")
            f.flush()
            os.fsync(f.fileno())
        os.remove(probe)
    except OSError as e:
        raise CheckpointError(
            f"{what} {path} is not writable: {e.strerror or e}{_free_space(path)}"
        ) from None


def _free_space(path: str) -> str:
    p = path
    while p and not os.path.exists(p):
        p = os.path.dirname(p)
    try:
        free = shutil.disk_usage(p or ".").free
    except OSError:
        return ""
    return f" ({free / 2**20:.1f} MiB free)"


def _reason(e: BaseException, path: str) -> str:
    """One line for a write failure; torch.save reports a full disk only as a stream error."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and (
        not isinstance(e, OSError) or e.errno == errno.EFBIG
    ):  # torch.save says only "unexpected pos" when a write stops at `ulimit -f`
        return f"a file reached this process's file-size limit (ulimit -f: {limit} bytes)"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    try:
        usage = shutil.disk_usage(path)
        full = usage.free < min(64 * 2**20, usage.total // 100)
    except OSError:
        full = False
    return ("No space left on device: " if full else "") + f"{type(e).__name__}: {first}"


def _fsync_tree(d: str) -> dict[str, int]:
    """fsync every file below ``d`` and ``d`` itself; returns {relative path: size}."""
    sizes = {}
    for root, _, files in os.walk(d):
        for name in files:
            path = os.path.join(root, name)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            sizes[os.path.relpath(path, d)] = os.path.getsize(path)
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return sizes


def remove_stale(ckpt_dir: str, keep: str | None = None) -> list[str]:
    """Delete tag directories without ``COMPLETE`` (interrupted saves) except ``keep``."""
    removed = []
    for tag in tag_dirs(ckpt_dir):
        if tag != keep and not os.path.isfile(os.path.join(ckpt_dir, tag, COMPLETE_FILE)):
            shutil.rmtree(os.path.join(ckpt_dir, tag), ignore_errors=True)
            removed.append(tag)
    for tmp in glob.glob(os.path.join(ckpt_dir, "latest.tmp.*")):
        os.remove(tmp)
    return removed


def save(
    engine,
    cfg: JobConfig,
    ckpt_dir: str,
    step: int,
    state: dict[str, Any],
    train_ds,
    extra_meta: dict[str, Any] | None = None,
) -> str:
    """Collective: every rank calls it. ``state``: the components' entries of the client state
    (``epoch`` and ``sampler`` among them, also recorded in the metadata; see
    :class:`CheckpointManager`). Returns the tag; a :class:`CheckpointError` (naming the
    directory) if it cannot be written. Earlier tags and ``latest`` are untouched until the new
    tag is complete."""
    # deepspeed is imported here, not at the top: train.py and export.py start without it
    import deepspeed.comm as dist

    tag = tag_for(step)
    tag_dir = os.path.join(ckpt_dir, tag)
    rank, world = dist.get_rank(), dist.get_world_size()
    # tokenizer.model, or tokenizer/ (a Hugging Face tokenizer): copied into the tag
    tok_name = tokenizer_name(getattr(train_ds, "manifest", {}))
    try:
        if rank == 0:
            os.makedirs(ckpt_dir, exist_ok=True)
            remove_stale(ckpt_dir)
            marker = os.path.join(tag_dir, COMPLETE_FILE)
            if os.path.isfile(marker):  # rewriting a tag: make it incomplete first
                os.remove(marker)
        dist.barrier()
        client = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "world_size": world,
            # Randomness is re-seeded from (seed, step, rank) every step: no RNG state to restore.
            "rng": {"scheme": "reseed(seed, step, rank)", "seed": cfg.train.seed},
            "tokenizer": os.path.join(str(train_ds.path), tok_name),
            **state,
        }
        engine.save_checkpoint(ckpt_dir, tag=tag, client_state=client, save_latest=False)
        dist.barrier()
        if rank == 0:
            meta = {
                "format_version": FORMAT_VERSION,
                "step": step,
                "epoch": state["epoch"],
                "sampler": dict(state["sampler"]),
                "world_size": world,
                "zero_stage": cfg.deepspeed.zero.stage,
                "precision": cfg.deepspeed.precision,
                "model": cfg.model.to_dict(),
                "config": to_dict(cfg),
                "tokenizer": tok_name,
                "special_ids": dict(getattr(train_ds, "manifest", {}).get("special_ids", {})),
                "data": data_identity(cfg),  # resuming on other data is refused
                **(extra_meta or {}),
            }
            tok = os.path.join(str(train_ds.path), tok_name)
            if os.path.isfile(tok):
                shutil.copyfile(tok, os.path.join(tag_dir, tok_name))
            elif os.path.isdir(tok):
                shutil.copytree(tok, os.path.join(tag_dir, tok_name), dirs_exist_ok=True)
            atomic_write_text(os.path.join(tag_dir, META_FILE), json.dumps(meta, indent=2))
            inventory = _fsync_tree(tag_dir)
            atomic_write_text(
                os.path.join(tag_dir, COMPLETE_FILE),
                json.dumps({"files": inventory}, indent=1, sort_keys=True),
            )
            atomic_write_text(os.path.join(ckpt_dir, "latest"), tag)
            prune(ckpt_dir, cfg.checkpoint.keep_last)
    except Exception as e:  # any failure here is a failure to write the checkpoint
        if rank == 0 and not os.path.isfile(os.path.join(tag_dir, COMPLETE_FILE)):
            shutil.rmtree(tag_dir, ignore_errors=True)
        raise CheckpointError(
            f"could not write checkpoint {tag_dir}: {_reason(e, ckpt_dir)}{_free_space(ckpt_dir)}"
            f"; earlier checkpoints in {ckpt_dir} are intact"
        ) from None
    dist.barrier()
    return tag


def prune(ckpt_dir: str, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` complete tags (0 keeps all); a tag pinned by a
    reader (:func:`linformer_ds.dirlock.pin_tag`) is left for a later save to prune."""
    if keep_last <= 0:
        return
    for tag in complete_tags(ckpt_dir)[:-keep_last]:
        # a tag a reader pins (export: shared flock on COMPLETE) stays until a later save
        with try_exclusive(os.path.join(ckpt_dir, tag, COMPLETE_FILE)) as free:
            if free:
                shutil.rmtree(os.path.join(ckpt_dir, tag), ignore_errors=True)


# ========================================================================================= load
def check_model_config(meta: dict[str, Any], cfg: JobConfig, where: str) -> None:
    """A :class:`CheckpointError` listing every model option that differs from the config."""
    saved, now = dict(meta.get("model", {})), cfg.model.to_dict()
    # an option newer than the checkpoint: it was trained with what the option's default does
    # (every new option defaults to the behaviour before it, e.g. model.position_init: normal)
    saved = {**{k: v for k, v in type(cfg.model)().to_dict().items() if k not in saved}, **saved}
    for key in ("extra", "format_version"):
        saved.pop(key, None)
        now.pop(key, None)
    diff = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
    if diff:
        detail = ", ".join(
            f"model.{k}: checkpoint {saved.get(k)!r} vs config {now.get(k)!r}" for k in diff
        )
        raise CheckpointError(f"{where} was trained with a different model config ({detail})")


def check_run_config(meta: dict[str, Any], cfg: JobConfig, where: str) -> None:
    """A :class:`CheckpointError` if resuming would silently change the data order: the
    checkpoint's ``train.seed`` differs from the config's (unless
    ``checkpoint.allow_seed_change``)."""
    saved = (meta.get("config") or {}).get("train", {}).get("seed")
    now = cfg.train.seed
    if not (saved is None or int(saved) == now or cfg.checkpoint.allow_seed_change):
        raise CheckpointError(
            f"train.seed: {where} was trained with seed {saved}, this config has {now}; another "
            "seed reshuffles the rest of the epoch mid-way (rows repeat or are skipped) and "
            f"changes the masks. Set train.seed={saved} to resume exactly, or "
            "checkpoint.allow_seed_change=true to continue with the new seed"
        )
    check_data_change(meta, cfg, where)


def data_identity(cfg: JobConfig) -> list[dict[str, Any]]:
    """What the run trains on, recorded in each checkpoint's metadata (``data``): per data_prep
    output its path, N, vocabulary, tokenizer sha256 and a digest of every shard's sha256 (the
    manifest's content, not its timings: the same data copied elsewhere is the same data)."""
    d, stages = cfg.data, list(getattr(cfg.train, "stages", None) or [])
    sources = [s.path for s in (getattr(d, "sources", None) or [])]
    paths = sources + [st.path for st in stages if st.path] or [d.path]
    out = []
    for path in dict.fromkeys(paths):
        try:
            with open(os.path.join(path, "manifest.json"), encoding="utf-8") as f:
                m = json.load(f)
            shards = {k: [s.get("sha256") for s in v["shards"]] for k, v in m["splits"].items()}
            out.append({
                "path": os.path.abspath(path),
                "seq_len": int(m["seq_len"]),
                "vocab_size": int(m["vocab_size"]),
                "tokenizer_sha256": (m.get("tokenizer") or {}).get("sha256"),
                "shards_sha256": hashlib.sha256(json.dumps(shards, sort_keys=True).encode())
                .hexdigest(),
            })  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # unreadable data is reported when it is opened
    return out


def check_data_change(meta: dict[str, Any], cfg: JobConfig, where: str) -> None:
    """A :class:`CheckpointError` naming what differs if the checkpoint was trained on other data
    (another tokenizer, N or manifest) than the config's, unless checkpoint.allow_data_change."""
    saved, now = meta.get("data"), data_identity(cfg)
    if not saved or not now or cfg.checkpoint.allow_data_change:
        return
    what = (("tokenizer_sha256", "the tokenizer (ids would mean other tokens)"),
            ("seq_len", "N (the row length)"), ("vocab_size", "the vocabulary size"),
            ("shards_sha256", "the data (manifest shards)"))  # fmt: skip
    if len(saved) != len(now):
        diff = f"the number of data sources ({len(saved)} vs {len(now)})"
    else:
        diff = next(
            (f"{text}: checkpoint {_short_value(a[k])} ({a['path']}) vs now "
             f"{_short_value(b[k])} ({b['path']})"
             for k, text in what for a, b in zip(saved, now) if a.get(k) != b.get(k)),
            None,
        )  # fmt: skip
    if diff is None:
        return
    raise CheckpointError(
        f"checkpoint.allow_data_change: {where} was trained on other data; {diff}. Resuming "
        "would continue its epoch over other rows. Point data.path at the checkpoint's data, or "
        "set checkpoint.allow_data_change=true to continue on this data"
    )


def _short_value(v: Any) -> str:
    return f"{v[:12]}..." if isinstance(v, str) and len(v) > 16 else str(v)


def select_resume(
    ckpt_dir: str, resume: str, cfg: JobConfig
) -> tuple[str | None, dict[str, Any] | None]:
    """``(tag, meta)`` to resume from, checked against the model config; ``(None, None)``."""
    tag = resolve_resume_tag(ckpt_dir, resume)
    if tag is None:
        return None, None
    meta = read_meta(ckpt_dir, tag)
    check_model_config(meta, cfg, os.path.join(ckpt_dir, tag))
    return tag, meta


def safe_globals() -> list[Any]:
    """The only non-tensor classes DeepSpeed 0.19.8 pickles into ZeRO 1-3 checkpoints."""
    # deepspeed is imported here, not at the top: train.py and export.py start without it
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def load_refusal(path: Any, e: BaseException) -> str:
    """One line for a checkpoint file ``torch.load(weights_only=True)`` refused: the pickled
    object that is not a tensor (nothing in it ran), or the reason it is unreadable. Torch's
    advice to retry with ``weights_only=False`` (which would run the payload) is never quoted."""
    text = str(e).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    found = re.search(r"GLOBAL ([\w.]+)", text)
    if found:
        return (
            f"{path} cannot be loaded safely (weights_only=True refused it): it holds a pickled "
            f"{found.group(1)}, not tensors, and nothing in it ran; linformer_ds checkpoints hold "
            "only tensors and DeepSpeed's few classes, so this file was altered or written by "
            "another program: use another tag or a checkpoint from a source you trust"
        )
    # torch's explanation and advice lines dropped: what is left says what is wrong
    advice = ("weights_only", "Weights only", "Please file an issue", "documentation of torch")
    useful = [ln.removeprefix("WeightsUnpickler error:").strip() for ln in lines
              if not any(a in ln for a in advice)]  # fmt: skip
    useful = [ln for ln in useful if ln]
    first = useful[0] if useful else type(e).__name__
    return (
        f"{path} cannot be loaded safely (weights_only=True refused it or it is corrupt): {first}"
    )


def safe_torch_load(path: str, map_location: Any = "cpu") -> Any:
    """``torch.load(weights_only=True)`` allowing DeepSpeed's few checkpoint classes."""
    try:
        with torch.serialization.safe_globals(safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        raise CheckpointError(load_refusal(path, e)) from None


def install_safe_loader(engine) -> None:
    """Make the engine read checkpoint files with :func:`safe_torch_load` (no pickled code)."""
    engine.checkpoint_engine.load = lambda path, map_location=None: safe_torch_load(
        path, "cpu" if map_location is None else map_location
    )


def load(
    engine, ckpt_dir: str, tag: str, cfg: JobConfig, load_dir: str | None = None
) -> dict[str, Any]:
    """Load model/optimizer/scheduler states; returns the client state. Collective.

    ``load_dir``: where DeepSpeed reads the tag (default ``ckpt_dir``; the universal directory
    after :func:`convert_to_universal`).
    """
    where = os.path.join(ckpt_dir, tag)
    meta = read_meta(ckpt_dir, tag)
    check_model_config(meta, cfg, where)
    install_safe_loader(engine)
    try:
        path, client = engine.load_checkpoint(
            load_dir or ckpt_dir, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
    except CheckpointError:
        raise
    except (RuntimeError, ValueError, KeyError, OSError, AssertionError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"DeepSpeed could not load {where}: {first}") from None
    if path is None:
        raise CheckpointError(f"DeepSpeed could not load {where}")
    client = dict(client or {})
    for key in ("step", "epoch", "sampler"):  # the universal copy's client state is the same
        client.setdefault(key, meta[key])
    return client


@contextlib.contextmanager
def weights_only_torch_load() -> Iterator[None]:
    """Force every ``torch.load`` inside the block to ``weights_only=True`` (DeepSpeed's few
    checkpoint classes allowed): for DeepSpeed tools that load with ``weights_only=False``
    themselves (``zero_to_fp32``, ``ds_to_universal``)."""
    original = torch.load

    def safe_load(f, *args, **kwargs):
        kwargs["weights_only"] = True
        try:
            with torch.serialization.safe_globals(safe_globals()):
                return original(f, *args, **kwargs)
        except pickle.UnpicklingError as e:  # a payload: one line naming the file, no advice
            raise CheckpointError(load_refusal(f, e)) from None  # to retry without the check

    torch.load = safe_load
    try:
        yield
    finally:
        torch.load = original
