"""Checkpoints through DeepSpeed, plus what DeepSpeed does not do for us.

Layout of ``checkpoint.dir``::

    latest                      name of the newest complete tag (written last, atomically)
    step_00001000/              DeepSpeed's files (model/optimizer states per rank)
        linformer_meta.json     format version, step, model config, resolved job config
        tokenizer.model         the SentencePiece model the data was made with
        COMPLETE                marker: every rank finished writing this tag

A tag without ``COMPLETE`` (a save interrupted by a crash) is never picked by ``auto`` resume.
"""

import json
import os
import re
import shutil
import warnings
from typing import Any, Dict, List, Optional

import torch

from linformer_ds.config import JobConfig, to_dict

FORMAT_VERSION = 1
META_FILE = "linformer_meta.json"
COMPLETE_FILE = "COMPLETE"
TAG_RE = re.compile(r"^step_(\d{8,})$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message says which and why."""


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def is_complete(ckpt_dir: str, tag: str) -> bool:
    d = os.path.join(ckpt_dir, tag)
    return os.path.isfile(os.path.join(d, COMPLETE_FILE)) and os.path.isfile(
        os.path.join(d, META_FILE)
    )


def complete_tags(ckpt_dir: str) -> List[str]:
    """Complete tags, oldest first."""
    if not os.path.isdir(ckpt_dir):
        return []
    tags = [t for t in os.listdir(ckpt_dir) if TAG_RE.match(t) and is_complete(ckpt_dir, t)]
    return sorted(tags, key=lambda t: int(TAG_RE.match(t).group(1)))  # type: ignore[union-attr]


def latest_tag(ckpt_dir: str) -> Optional[str]:
    """The tag named by ``latest`` if complete, else the newest complete one (with a warning)."""
    pointer = os.path.join(ckpt_dir, "latest")
    named = None
    if os.path.isfile(pointer):
        with open(pointer) as f:
            named = f.read().strip()
        if named and is_complete(ckpt_dir, named):
            return named
    tags = complete_tags(ckpt_dir)
    if named:
        warnings.warn(
            f"checkpoint {os.path.join(ckpt_dir, named)} named by 'latest' is incomplete; "
            f"falling back to {tags[-1] if tags else 'none'}",
            stacklevel=2,
        )
    return tags[-1] if tags else None


def resolve_resume_tag(ckpt_dir: str, resume: str) -> Optional[str]:
    if resume == "never":
        return None
    if resume == "auto":
        return latest_tag(ckpt_dir)
    if not os.path.isdir(os.path.join(ckpt_dir, resume)):
        raise CheckpointError(f"checkpoint.resume: tag {resume!r} not found in {ckpt_dir}")
    if not is_complete(ckpt_dir, resume):
        raise CheckpointError(f"checkpoint.resume: {os.path.join(ckpt_dir, resume)} is incomplete")
    return resume


def read_meta(ckpt_dir: str, tag: str) -> Dict[str, Any]:
    path = os.path.join(ckpt_dir, tag, META_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(f"{os.path.join(ckpt_dir, tag)} is not a linformer_ds checkpoint")
    with open(path) as f:
        return json.load(f)


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save(
    engine,
    cfg: JobConfig,
    ckpt_dir: str,
    step: int,
    epoch: int,
    sampler_state: Dict[str, Any],
    train_ds,
) -> str:
    """Collective: every rank calls it. Returns the tag."""
    import deepspeed.comm as dist

    tag = tag_for(step)
    client = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "epoch": epoch,
        "sampler": dict(sampler_state),
        "world_size": dist.get_world_size(),
        # Randomness is re-seeded from (seed, step, rank) every step: no RNG state to restore.
        "rng": {"scheme": "reseed(seed, step, rank)", "seed": cfg.train.seed},
        "tokenizer": os.path.join(str(train_ds.path), "tokenizer.model"),
    }
    engine.save_checkpoint(ckpt_dir, tag=tag, client_state=client, save_latest=False)
    dist.barrier()
    if dist.get_rank() == 0:
        tag_dir = os.path.join(ckpt_dir, tag)
        meta = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "epoch": epoch,
            "sampler": dict(sampler_state),
            "world_size": dist.get_world_size(),
            "zero_stage": cfg.deepspeed.zero.stage,
            "model": cfg.model.to_dict(),
            "config": to_dict(cfg),
            "tokenizer": "tokenizer.model",
        }
        tok = os.path.join(str(train_ds.path), "tokenizer.model")
        if os.path.isfile(tok):
            shutil.copyfile(tok, os.path.join(tag_dir, "tokenizer.model"))
        _atomic_write(os.path.join(tag_dir, META_FILE), json.dumps(meta, indent=2))
        _atomic_write(os.path.join(tag_dir, COMPLETE_FILE), "ok\n")
        _atomic_write(os.path.join(ckpt_dir, "latest"), tag)
        prune(ckpt_dir, cfg.checkpoint.keep_last)
    dist.barrier()
    return tag


def prune(ckpt_dir: str, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` complete tags (0 keeps all)."""
    if keep_last <= 0:
        return
    for tag in complete_tags(ckpt_dir)[:-keep_last]:
        shutil.rmtree(os.path.join(ckpt_dir, tag), ignore_errors=True)


def check_model_config(meta: Dict[str, Any], cfg: JobConfig, where: str) -> None:
    saved, now = dict(meta.get("model", {})), cfg.model.to_dict()
    for key in ("extra", "format_version"):
        saved.pop(key, None)
        now.pop(key, None)
    diff = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
    if diff:
        detail = ", ".join(
            f"model.{k}: checkpoint {saved.get(k)!r} vs config {now.get(k)!r}" for k in diff
        )
        raise CheckpointError(f"{where} was trained with a different model config ({detail})")


def load(engine, ckpt_dir: str, tag: str, cfg: JobConfig) -> Dict[str, Any]:
    """Load model/optimizer/scheduler states; returns the client state. Collective."""
    where = os.path.join(ckpt_dir, tag)
    meta = read_meta(ckpt_dir, tag)
    if meta.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{where} has format_version {meta.get('format_version')}, newer than this "
            f"linformer_ds ({FORMAT_VERSION})"
        )
    check_model_config(meta, cfg, where)
    path, client = engine.load_checkpoint(
        ckpt_dir, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if path is None:
        raise CheckpointError(f"DeepSpeed could not load {where}")
    return client or {}


def torch_load_safe(path: str) -> Any:
    """``torch.load`` without executing pickled code."""
    return torch.load(path, map_location="cpu", weights_only=True)
