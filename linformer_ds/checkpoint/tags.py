"""Checkpoint tags: naming, listing, validation and choosing the one to resume from.

Layout of ``checkpoint.dir``::

    latest                      name of the newest complete tag (written last, atomically)
    step_00001000/              DeepSpeed's files (model/optimizer states per rank)
        linformer_meta.json     format version, step, model config, resolved job config
        tokenizer.model         the SentencePiece model the data was made with
        COMPLETE                written last: JSON inventory {file: size} of the tag

On load a tag is used only if it validates (marker, metadata, every inventoried file present at
its recorded size, one optimizer shard per saved rank); ``auto`` resume falls back to the newest
tag that does, with a warning.
"""

import glob
import json
import os
import re
import warnings
from typing import Any

from linformer_ds.errors import LinformerError

FORMAT_VERSION = 1
META_FILE = "linformer_meta.json"
COMPLETE_FILE = "COMPLETE"
MODEL_STATES = "mp_rank_00_model_states.pt"  # ZeRO 0-2: one file, written by rank 0
ZERO3_MODEL_STATES = "zero_pp_rank_{rank}_mp_rank_{mp:02d}_model_states.pt"  # ZeRO-3: per rank
UNIVERSAL_DIR = "universal"
TAG_RE = re.compile(r"^step_(\d{8,})$")
META_KEYS = ("format_version", "step", "epoch", "sampler", "world_size", "zero_stage", "model")


class CheckpointError(LinformerError, RuntimeError):
    """A checkpoint cannot be used or written; the message says which and why."""


def tag_for(step: int) -> str:
    """The tag of the checkpoint saved after optimizer step ``step``."""
    return f"step_{step:08d}"


def _tag_step(tag: str) -> int:
    m = TAG_RE.match(tag)
    return int(m.group(1)) if m else -1


def is_complete(ckpt_dir: str, tag: str) -> bool:
    """The tag has its ``COMPLETE`` marker and metadata (cheap; see :func:`tag_problem`)."""
    d = os.path.join(ckpt_dir, tag)
    return os.path.isfile(os.path.join(d, COMPLETE_FILE)) and os.path.isfile(
        os.path.join(d, META_FILE)
    )


def tag_dirs(ckpt_dir: str) -> list[str]:
    """All ``step_*`` tag directories, complete or not, oldest first."""
    if not os.path.isdir(ckpt_dir):
        return []
    tags = [t for t in os.listdir(ckpt_dir) if TAG_RE.match(t)]
    return sorted((t for t in tags if os.path.isdir(os.path.join(ckpt_dir, t))), key=_tag_step)


def complete_tags(ckpt_dir: str) -> list[str]:
    """Tags with a ``COMPLETE`` marker, oldest first."""
    return [t for t in tag_dirs(ckpt_dir) if is_complete(ckpt_dir, t)]


def _read_json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


def tag_problem(ckpt_dir: str, tag: str) -> str | None:
    """Why ``ckpt_dir/tag`` cannot be resumed from, or None if it validates."""
    bad = tag_name_problem(tag)
    if bad:
        return bad
    d = os.path.join(ckpt_dir, tag)
    if not os.path.isdir(d):
        return "no such directory"
    real, root = os.path.realpath(d), os.path.realpath(ckpt_dir)
    if os.path.dirname(real) != root:
        return f"a link to {real}, outside {root} (another run's checkpoint is never used)"
    if not os.path.isfile(os.path.join(d, META_FILE)):
        return f"not a linformer_ds checkpoint (no {META_FILE})"
    if not os.path.isfile(os.path.join(d, COMPLETE_FILE)):
        return f"incomplete (no {COMPLETE_FILE} marker: the save was interrupted)"
    try:
        meta = _read_json(os.path.join(d, META_FILE))
    except (OSError, ValueError) as e:
        return f"{META_FILE} is unreadable ({e})"
    if not isinstance(meta, dict) or any(k not in meta for k in META_KEYS):
        return f"{META_FILE} lacks one of {list(META_KEYS)}"
    ints = {k: meta.get(k, 0) for k in ("world_size", "zero_stage", "step")}
    if any(type(v) is not int or v < 0 for v in ints.values()) or ints["world_size"] < 1:
        return f"{META_FILE} has a bad world_size/zero_stage/step ({ints})"
    try:
        with open(os.path.join(d, COMPLETE_FILE), "rb") as f:
            marker = f.read().decode("utf-8")
        inventory = json.loads(marker).get("files", {}) if marker.strip() != "ok" else {}
        if not isinstance(inventory, dict):
            raise ValueError("'files' is not an object")
    except (OSError, ValueError, AttributeError) as e:
        return f"{COMPLETE_FILE} is unreadable ({e})"
    for name, size in inventory.items():
        path = os.path.join(d, str(name))
        if tag_name_problem(os.path.basename(str(name))) or not isinstance(size, int):
            return f"{COMPLETE_FILE} lists {name!r}: {size!r} (not a file of the tag and its size)"
        if not os.path.isfile(path):
            return f"{name} is missing"
        if os.path.getsize(path) != size:
            return f"{name} has {os.path.getsize(path)} bytes, {size} when saved (truncated)"
    saved_ranks = int(meta["world_size"])
    if int(meta.get("zero_stage", 0)) == 3:  # ZeRO-3: one model-states file per rank
        p = sharded_sp_size(meta)  # sharded SP: DeepSpeed numbers SP ranks as model-parallel
        ranks = [ZERO3_MODEL_STATES.format(rank=r // p, mp=r % p) for r in range(saved_ranks)]
        missing = [name for name in ranks if not os.path.isfile(os.path.join(d, name))]
        if missing:
            return f"{missing[0]} is missing ({len(missing)} of {saved_ranks} rank files)"
    elif not os.path.isfile(os.path.join(d, MODEL_STATES)):
        return f"{MODEL_STATES} is missing"
    shards = glob.glob(os.path.join(d, "*_optim_states.pt"))
    if shards and int(meta.get("zero_stage", 0)) > 0 and len(shards) != saved_ranks:
        return f"{len(shards)} optimizer shards for {saved_ranks} saved ranks"
    return None


def tag_name_problem(tag: str) -> str | None:
    """Why ``tag`` is not a plain name inside a checkpoint directory (a path, ``..``, control
    characters), or None. Tags are never paths: another run's checkpoint cannot be named."""
    if not tag or tag in (".", "..") or "/" in tag or os.sep in tag or "\\" in tag:
        return f"{tag!r} is not a tag name (tags are plain names such as step_00000100)"
    if not tag.isprintable() or len(tag) > 255:
        return f"{tag[:40]!r} is not a tag name (non-printable characters or too long)"
    return None


def read_pointer(ckpt_dir: str) -> str | None:
    """The tag named by ``ckpt_dir/latest``: None when there is none, ``""`` when the file does
    not hold a plain tag name (damaged: bytes that are not UTF-8, a path, ...). A ``latest``
    that is not a regular file is a :class:`CheckpointError` (the next save could not write it).
    """
    pointer = os.path.join(ckpt_dir, "latest")
    if not os.path.lexists(pointer):
        return None
    if os.path.islink(pointer) or not os.path.isfile(pointer):
        raise CheckpointError(
            f"{pointer} is not a regular file (the trainer writes the newest tag's name there): "
            "move it away"
        )
    try:
        with open(pointer, "rb") as f:
            named = f.read(4096).decode("utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return ""
    return "" if tag_name_problem(named) else named


def latest_tag(ckpt_dir: str) -> str | None:
    """The tag named by ``latest`` if it validates, else the newest valid one (with a warning).
    A ``latest`` that does not hold a plain tag name (``../../other/step_4``, bytes that are
    not text) is never followed: it counts as naming an unusable tag."""
    named = read_pointer(ckpt_dir)
    if named == "":
        named = "(not a tag name)"
    elif named and tag_problem(ckpt_dir, named) is None:
        return named
    rejected = []
    for tag in reversed(tag_dirs(ckpt_dir)):
        problem = tag_problem(ckpt_dir, tag)
        if problem is None:
            if rejected or (named and named != tag):
                skipped = "; ".join(rejected) or "none"
                warnings.warn(
                    f"checkpoint fallback in {ckpt_dir}: 'latest' names {named!r}; unusable tags "
                    f"skipped: {skipped}; resuming from {tag}",
                    stacklevel=2,
                )
            return tag
        rejected.append(f"{tag} ({problem})")
    if rejected:
        warnings.warn(f"no usable checkpoint in {ckpt_dir}: {'; '.join(rejected)}", stacklevel=2)
    return None


def resolve_resume_tag(ckpt_dir: str, resume: str) -> str | None:
    """The tag ``checkpoint.resume`` selects (``auto``: newest valid; ``never``: none)."""
    read_pointer(ckpt_dir)  # a 'latest' that is a directory fails now, not at the first save
    if resume == "never":
        return None
    if resume == "auto":
        return latest_tag(ckpt_dir)
    bad = tag_name_problem(resume)
    if bad:
        raise CheckpointError(f"checkpoint.resume: {bad}; or auto / never")
    if not os.path.isdir(os.path.join(ckpt_dir, resume)):
        found = ", ".join(tag_dirs(ckpt_dir)) or "none"
        raise CheckpointError(
            f"checkpoint.resume: tag {resume!r} not found in {ckpt_dir} (tags there: {found})"
        )
    problem = tag_problem(ckpt_dir, resume)
    if problem is not None:
        raise CheckpointError(f"checkpoint.resume: {os.path.join(ckpt_dir, resume)} is {problem}")
    return resume


def read_meta(ckpt_dir: str, tag: str) -> dict[str, Any]:
    """The ``linformer_meta.json`` of a tag (a :class:`CheckpointError` if unusable)."""
    where = os.path.join(ckpt_dir, tag)
    path = os.path.join(where, META_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(f"{where} is not a linformer_ds checkpoint (no {META_FILE})")
    try:
        meta = _read_json(path)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    if not isinstance(meta.get("format_version"), int) or meta["format_version"] > FORMAT_VERSION:
        raise CheckpointError(
            f"{where} has format_version {meta.get('format_version')!r}; this linformer_ds "
            f"reads <= {FORMAT_VERSION}"
        )
    return meta


def sharded_sp_size(layout: dict[str, Any]) -> int:
    """P when a checkpoint's (or a config's) E/F columns and position rows are sharded over P
    sequence-parallel ranks (DeepSpeed writes one model-parallel file per SP rank), else 1."""
    p = int(layout.get("sequence_parallel_size", 1) or 1)
    return p if p > 1 and layout.get("shard_sequence_parameters") else 1


def resolve_checkpoint(checkpoint: str, tag: str | None = None) -> tuple[str, str]:
    """``(checkpoint_dir, tag)`` for a reader (export): ``checkpoint`` is a ``checkpoint.dir`` or
    a tag directory itself; ``tag`` None means the newest usable one. The tag must validate
    like a resume would (marker, metadata, inventory); a :class:`CheckpointError` says why not."""
    ckpt = os.path.abspath(checkpoint)
    if not os.path.isdir(ckpt):
        raise CheckpointError(f"{checkpoint}: no such directory")
    if tag is not None and tag_name_problem(tag):
        raise CheckpointError(f"--tag {tag_name_problem(tag)}")
    if tag is None and os.path.isfile(os.path.join(ckpt, META_FILE)):
        ckpt, tag = os.path.dirname(ckpt), os.path.basename(ckpt)  # given the tag directory
    if tag is None:
        if not tag_dirs(ckpt):
            raise CheckpointError(
                f"{checkpoint} is not a linformer_ds checkpoint directory: no step_* tags in it "
                f"(found: {_listing(ckpt)})"
            )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tag = latest_tag(ckpt)
        if tag is None:
            why = "; ".join(f"{t} ({tag_problem(ckpt, t)})" for t in reversed(tag_dirs(ckpt)))
            raise CheckpointError(f"{checkpoint}: no usable checkpoint: {why}")
        for w in caught:  # the caller shows them (export: after it succeeded)
            warnings.warn(str(w.message), stacklevel=2)
        return ckpt, tag
    if not os.path.isdir(os.path.join(ckpt, tag)):
        raise CheckpointError(
            f"tag {tag!r} not found in {ckpt} (tags there: {', '.join(tag_dirs(ckpt)) or 'none'})"
        )
    problem = tag_problem(ckpt, tag)
    if problem is not None:
        raise CheckpointError(f"{os.path.join(ckpt, tag)} is {problem}")
    return ckpt, tag


def _listing(d: str, n: int = 8) -> str:
    names = sorted(os.listdir(d))
    return ", ".join(names[:n]) + (", ..." if len(names) > n else "") if names else "nothing"
