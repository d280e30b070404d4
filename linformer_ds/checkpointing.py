"""Checkpoints through DeepSpeed, plus what DeepSpeed does not do for us.

Layout of ``checkpoint.dir``::

    latest                      name of the newest complete tag (written last, atomically)
    step_00001000/              DeepSpeed's files (model/optimizer states per rank)
        linformer_meta.json     format version, step, model config, resolved job config
        tokenizer.model         the SentencePiece model the data was made with
        COMPLETE                written last: JSON inventory {file: size} of the tag

Crash safety: a save first drops stale incomplete tags (and the marker of the tag it is about to
rewrite), then DeepSpeed writes, every file is fsync'ed, and only then ``COMPLETE`` (with the
inventory) and ``latest`` are written atomically. On load a tag is used only if it validates
(marker, metadata, every inventoried file present at its recorded size, one optimizer shard per
saved rank); ``auto`` resume falls back to the newest tag that does, with a warning.

Layout changes (another number of ranks, sequence-parallel size P, or E/F / position sharding;
see :func:`layout_route`): a ZeRO 1-3 checkpoint is converted once with DeepSpeed's universal
checkpoint (``ds_to_universal``) into ``checkpoint.dir/universal/<tag>`` and loaded with
``{"checkpoint": {"load_universal": true}}`` (ZeRO-3: two repairs after DeepSpeed's load, see
:func:`repair_zero3_universal_load`, and per-SP-rank copies for a sharded run). ZeRO-0 has no
optimizer shards for ``ds_to_universal`` to read (its fp32 optimizer is a plain torch AdamW whose
state lies in each model-parallel file), so a P or sharding change is re-sharded by
:func:`reshard_zero0` into native files. Either copy is derived data, removed after the load.

Security: DeepSpeed 0.19.8 reads its files with ``torch.load(weights_only=False)``.
:func:`install_safe_loader` replaces the engine's loader by ``weights_only=True`` with only the
three DeepSpeed classes these files hold allowed, so a checkpoint cannot run pickled code.
"""

import contextlib
import glob
import json
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Dict, List, Optional, Protocol, Tuple

import torch

from linformer_ds.config import JobConfig, to_dict
from linformer_ds.fsio import atomic_write_text

FORMAT_VERSION = 1
META_FILE = "linformer_meta.json"
COMPLETE_FILE = "COMPLETE"
MODEL_STATES = "mp_rank_00_model_states.pt"  # ZeRO 0-2: one file, written by rank 0
ZERO3_MODEL_STATES = "zero_pp_rank_{rank}_mp_rank_{mp:02d}_model_states.pt"  # ZeRO-3: per rank
UNIVERSAL_DIR = "universal"
TAG_RE = re.compile(r"^step_(\d{8,})$")
META_KEYS = ("format_version", "step", "epoch", "sampler", "world_size", "zero_stage", "model")


class CheckpointError(RuntimeError):
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


def tag_dirs(ckpt_dir: str) -> List[str]:
    """All ``step_*`` tag directories, complete or not, oldest first."""
    if not os.path.isdir(ckpt_dir):
        return []
    tags = [t for t in os.listdir(ckpt_dir) if TAG_RE.match(t)]
    return sorted((t for t in tags if os.path.isdir(os.path.join(ckpt_dir, t))), key=_tag_step)


def complete_tags(ckpt_dir: str) -> List[str]:
    """Tags with a ``COMPLETE`` marker, oldest first."""
    return [t for t in tag_dirs(ckpt_dir) if is_complete(ckpt_dir, t)]


def _read_json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


def tag_problem(ckpt_dir: str, tag: str) -> Optional[str]:
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


def tag_name_problem(tag: str) -> Optional[str]:
    """Why ``tag`` is not a plain name inside a checkpoint directory (a path, ``..``, control
    characters), or None. Tags are never paths: another run's checkpoint cannot be named."""
    if not tag or tag in (".", "..") or "/" in tag or os.sep in tag or "\\" in tag:
        return f"{tag!r} is not a tag name (tags are plain names such as step_00000100)"
    if not tag.isprintable() or len(tag) > 255:
        return f"{tag[:40]!r} is not a tag name (non-printable characters or too long)"
    return None


def read_pointer(ckpt_dir: str) -> Optional[str]:
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


def latest_tag(ckpt_dir: str) -> Optional[str]:
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


def resolve_resume_tag(ckpt_dir: str, resume: str) -> Optional[str]:
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


def read_meta(ckpt_dir: str, tag: str) -> Dict[str, Any]:
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


def select_resume(
    ckpt_dir: str, resume: str, cfg: JobConfig
) -> Tuple[Optional[str], Optional[Dict[str, Any]]]:
    """``(tag, meta)`` to resume from, checked against the model config; ``(None, None)``."""
    tag = resolve_resume_tag(ckpt_dir, resume)
    if tag is None:
        return None, None
    meta = read_meta(ckpt_dir, tag)
    check_model_config(meta, cfg, os.path.join(ckpt_dir, tag))
    return tag, meta


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
    import errno
    import resource

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


def _fsync_tree(d: str) -> Dict[str, int]:
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


def remove_stale(ckpt_dir: str, keep: Optional[str] = None) -> List[str]:
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
    state: Dict[str, Any],
    train_ds,
    extra_meta: Optional[Dict[str, Any]] = None,
) -> str:
    """Collective: every rank calls it. ``state``: the components' entries of the client state
    (``epoch`` and ``sampler`` among them, also recorded in the metadata; see
    :class:`CheckpointManager`). Returns the tag; a :class:`CheckpointError` (naming the
    directory) if it cannot be written. Earlier tags and ``latest`` are untouched until the new
    tag is complete."""
    import deepspeed.comm as dist

    tag = tag_for(step)
    tag_dir = os.path.join(ckpt_dir, tag)
    rank, world = dist.get_rank(), dist.get_world_size()
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
            "tokenizer": os.path.join(str(train_ds.path), "tokenizer.model"),
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
                "tokenizer": "tokenizer.model",
                "special_ids": dict(getattr(train_ds, "manifest", {}).get("special_ids", {})),
                "data": data_identity(cfg),  # resuming on other data is refused
                **(extra_meta or {}),
            }
            tok = os.path.join(str(train_ds.path), "tokenizer.model")
            if os.path.isfile(tok):
                shutil.copyfile(tok, os.path.join(tag_dir, "tokenizer.model"))
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
    """Delete all but the newest ``keep_last`` complete tags (0 keeps all)."""
    if keep_last <= 0:
        return
    for tag in complete_tags(ckpt_dir)[:-keep_last]:
        shutil.rmtree(os.path.join(ckpt_dir, tag), ignore_errors=True)


# ========================================================================================= load
def check_model_config(meta: Dict[str, Any], cfg: JobConfig, where: str) -> None:
    """A :class:`CheckpointError` listing every model option that differs from the config."""
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


def check_run_config(meta: Dict[str, Any], cfg: JobConfig, where: str) -> None:
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


def data_identity(cfg: JobConfig) -> List[Dict[str, Any]]:
    """What the run trains on, recorded in each checkpoint's metadata (``data``): per data_prep
    output its path, N, vocabulary, tokenizer sha256 and a digest of every shard's sha256 (the
    manifest's content, not its timings: the same data copied elsewhere is the same data)."""
    import hashlib

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


def check_data_change(meta: Dict[str, Any], cfg: JobConfig, where: str) -> None:
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


# Engine changes a universal checkpoint carries (measured, deepspeed 0.19.8, 1 CPU rank, see
# docs/reliability.md): ZeRO stage 1 <-> 2 and precision bf16 <-> fp32 load, losses continue
# within 1e-4; a change to or from ZeRO-3 fails inside DeepSpeed (AssertionError); ZeRO-0 has
# no optimizer shards to convert; fp16 is untested (no CPU support) and refused. Layout changes
# at an unchanged stage (ZeRO 0-3): layout_route.
UNIVERSAL_STAGES = (1, 2)
UNIVERSAL_PRECISIONS = ("bf16", "fp32")


def universal_supports(saved: Tuple[int, str], now: Tuple[int, str]) -> bool:
    """Whether a checkpoint saved under ``saved`` (ZeRO stage, precision) can be resumed under
    ``now`` through DeepSpeed's universal checkpoint."""
    return all(s in UNIVERSAL_STAGES for s in (saved[0], now[0])) and all(
        p in UNIVERSAL_PRECISIONS for p in (saved[1], now[1])
    )


def check_engine_config(
    ckpt_dir: str, tag: str, meta: Dict[str, Any], cfg: JobConfig
) -> Optional[str]:
    """Compare the checkpoint's ZeRO stage and precision with the config. Returns a notice
    when the change is loaded through a universal checkpoint; a :class:`CheckpointError` that
    says what changed and how to proceed when DeepSpeed cannot load it."""
    saved_stage, saved_prec = int(meta.get("zero_stage", 0)), meta.get("precision")
    now_stage, now_prec = cfg.deepspeed.zero.stage, cfg.deepspeed.precision
    saved_prec = saved_prec or now_prec  # checkpoints written before precision was recorded
    changes = []
    if saved_stage != now_stage:
        changes.append(f"deepspeed.zero.stage {saved_stage} -> {now_stage}")
    if saved_prec != now_prec:
        changes.append(f"deepspeed.precision {saved_prec} -> {now_prec}")
    if not changes:
        return None
    where = os.path.join(ckpt_dir, tag)
    shards = glob.glob(os.path.join(where, "*_optim_states.pt"))
    if shards and universal_supports((saved_stage, saved_prec), (now_stage, now_prec)):
        return (
            f"{where} was saved with another engine config ({', '.join(changes)}): loading it "
            "through a universal checkpoint"
        )
    raise CheckpointError(
        f"{where} was saved with zero.stage={saved_stage} precision={saved_prec}; this config "
        f"has {', '.join(changes)}, which DeepSpeed cannot load. Resume with "
        f"deepspeed.zero.stage={saved_stage} deepspeed.precision={saved_prec}"
        + " (ZeRO stage 1 <-> 2 and bf16 <-> fp32 changes load through a universal checkpoint)"
        ", or export the weights (launch/export.py) and start a new run"
    )


def sharded_sp_size(layout: Dict[str, Any]) -> int:
    """P when a checkpoint's (or a config's) E/F columns and position rows are sharded over P
    sequence-parallel ranks (DeepSpeed writes one model-parallel file per SP rank), else 1."""
    p = int(layout.get("sequence_parallel_size", 1) or 1)
    return p if p > 1 and layout.get("shard_sequence_parameters") else 1


def config_layout(cfg: JobConfig) -> Dict[str, Any]:
    """The parallel layout recorded in a checkpoint's metadata."""
    p = cfg.parallel.sequence_parallel_size
    return {
        "sequence_parallel_size": p,
        "shard_sequence_parameters": bool(p > 1 and cfg.parallel.shard_sequence_parameters),
    }


# How a checkpoint saved in another layout (world size, P, E/F / position sharding) loads, per
# ZeRO stage (the saved stage and precision equal the run's; check_engine_config handles those):
#   1, 2  DeepSpeed's universal checkpoint (ds_to_universal), every change.
#   3     DeepSpeed's universal checkpoint too (its stage-3 converter merges the DP partitions and,
#         for a sharded save, the SP ranks' pieces as tensor-parallel slices). Its ZeRO-3 loader
#         cuts a tensor-parallel piece only for AutoTP parameters, so for a sharded run each SP
#         rank reads a copy of the universal directory whose E/F and position files hold its
#         own slice already (:func:`cut_universal_per_sequence_rank`).
#   0     no ZeRO optimizer shards to convert (fp32: DeepSpeed keeps the plain torch AdamW
#         state in each model-parallel file, ds_to_universal finds nothing to read), so
#         :func:`reshard_zero0` writes the new layout's files itself: every sharded weight and
#         its exp_avg / exp_avg_sq joined whole, then cut for the new P. A world-size change
#         alone needs nothing (each file is replicated over data-parallel ranks).
RESHARD_DIRECT = "reshard"  # ZeRO-0: reshard_zero0
VIA_UNIVERSAL = "universal"  # ZeRO 1-3: ds_to_universal


def layout_route(
    ckpt_dir: str, tag: str, meta: Dict[str, Any], cfg: JobConfig, world_size: int
) -> Optional[str]:
    """How a checkpoint whose layout may differ from the run's loads: None (natively: same
    layout, or a change DeepSpeed's own loading covers), :data:`VIA_UNIVERSAL` or
    :data:`RESHARD_DIRECT`; a :class:`CheckpointError` naming the way out when neither can."""
    where = os.path.join(ckpt_dir, tag)
    saved_p, now_p = sharded_sp_size(meta), sharded_sp_size(config_layout(cfg))
    shards = glob.glob(os.path.join(where, "*_optim_states.pt"))
    world_changed = int(meta["world_size"]) != int(world_size)
    if shards and (world_changed or saved_p != now_p):
        return VIA_UNIVERSAL
    if saved_p == now_p:
        return None
    if int(meta.get("zero_stage", 0)) == 0 and not shards:
        return RESHARD_DIRECT
    raise CheckpointError(
        f"{where} holds E/F and positions sharded over {saved_p} rank(s), this config over "
        f"{now_p} (parallel.sequence_parallel_size / parallel.shard_sequence_parameters), and "
        "it has no optimizer shards to re-shard (a ZeRO-0 bf16/fp16 run cannot be sharded). "
        "Resume with the saved layout, or export the weights and start a new run"
    )


def safe_globals() -> List[Any]:
    """The only non-tensor classes DeepSpeed 0.19.8 pickles into ZeRO 1-3 checkpoints."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def safe_torch_load(path: str, map_location: Any = "cpu") -> Any:
    """``torch.load(weights_only=True)`` allowing DeepSpeed's few checkpoint classes."""
    try:
        with torch.serialization.safe_globals(safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{path} cannot be loaded safely (weights_only=True refused it or it is corrupt): "
            f"{first}"
        ) from None


def install_safe_loader(engine) -> None:
    """Make the engine read checkpoint files with :func:`safe_torch_load` (no pickled code)."""
    engine.checkpoint_engine.load = lambda path, map_location=None: safe_torch_load(
        path, "cpu" if map_location is None else map_location
    )


def convert_to_universal(ckpt_dir: str, tag: str) -> str:
    """Rank 0: ``ckpt_dir/tag`` -> ``ckpt_dir/universal/tag`` by DeepSpeed's ds_to_universal.

    Every source file is first read with ``weights_only=True`` (ds_to_universal itself does not).
    Returns the load directory (``ckpt_dir/universal``).
    """
    import argparse
    import contextlib
    import io

    from deepspeed.checkpoint import ds_to_universal

    src = os.path.join(ckpt_dir, tag)
    for path in sorted(glob.glob(os.path.join(src, "*.pt"))):
        safe_torch_load(path)
    root = os.path.join(ckpt_dir, UNIVERSAL_DIR)
    out = os.path.join(root, tag)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(root, exist_ok=True)
    args = argparse.Namespace(
        input_folder=src,
        output_folder=out,
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            ds_to_universal.main(args)
        from linformer_ds.sequence_parallel import mark_universal_sequence_dims

        mark_universal_sequence_dims(out)  # loadable with E/F and positions sharded, any P
    except Exception as e:
        shutil.rmtree(out, ignore_errors=True)
        raise CheckpointError(
            f"converting {src} to a universal checkpoint failed: {type(e).__name__}: {e}"
        ) from None
    return root


def cut_universal_per_sequence_rank(
    root: str, tag: str, shards: Dict[str, Tuple[int, List[int]]], sp_size: int
) -> List[str]:
    """ZeRO-3, sharded run: ``root/tag`` (a universal checkpoint) -> ``root/sp<r>/tag`` for each
    SP rank r, the same checkpoint (links) except that the fp32 / exp_avg / exp_avg_sq files of
    every parameter in ``shards`` (name -> (sequence dim, whole shape)) hold rank r's slice.
    DeepSpeed 0.19.8's ZeRO-3 universal loader takes each file as the whole parameter and
    partitions it over the data-parallel group; it cuts tensor-parallel pieces only for AutoTP
    parameters. Returns the load directories, by SP rank."""
    from linformer_ds.sequence_parallel import shard_tensor

    src = os.path.join(root, tag)
    roots = []
    for r in range(sp_size):
        out = os.path.join(root, f"sp{r}", tag)
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(os.path.join(out, "zero"))
        for name in os.listdir(src):
            if name != "zero":
                os.symlink(os.path.abspath(os.path.join(src, name)), os.path.join(out, name))
        for name in sorted(os.listdir(os.path.join(src, "zero"))):
            param_src = os.path.abspath(os.path.join(src, "zero", name))
            if name not in shards:
                os.symlink(param_src, os.path.join(out, "zero", name))
                continue
            dim, shape = shards[name]
            os.makedirs(os.path.join(out, "zero", name))
            for f in sorted(os.listdir(param_src)):
                path = os.path.join(param_src, f)
                if f not in ("fp32.pt", "exp_avg.pt", "exp_avg_sq.pt"):
                    os.symlink(path, os.path.join(out, "zero", name, f))
                    continue
                # a file ds_to_universal has just written (it may hold DeepSpeed's own classes)
                state = torch.load(path, map_location="cpu", weights_only=False)
                whole = (state["param"] if isinstance(state, dict) else state).reshape(shape)
                piece = shard_tensor(whole, dim, r, sp_size).contiguous().clone()
                torch.save(piece, os.path.join(out, "zero", name, f))
        roots.append(os.path.join(root, f"sp{r}"))
    return roots


def repair_zero3_universal_load(engine, universal_dir: str, tag: str) -> None:
    """ZeRO-3 after a universal load, two fixes to DeepSpeed 0.19.8's
    ``load_hp_checkpoint_state_from_checkpoint_dir_stage3`` (measured: without them the losses
    after a resume drift by 3e-5 at the second step, 4e-4 at the fourth):

    - it copies group 0's options (weight decay among them) into every parameter group, so the
      no-decay group would decay: each group gets its own saved options back;
    - it gives every sub-group's state the same ``step`` tensor, which torch's AdamW increments
      in place once per sub-group per step (bias correction of step 4 after step 2): each
      sub-group gets its own copy."""
    path = os.path.join(universal_dir, tag, "zero", "optimizer_state.pt")
    with weights_only_torch_load():
        saved = torch.load(path, map_location="cpu")["optimizer_state_dict"]["param_groups"]
    optimizer = engine.optimizer.optimizer
    if len(saved) != len(optimizer.param_groups):
        raise CheckpointError(
            f"{path}: {len(saved)} optimizer parameter groups, this run has "
            f"{len(optimizer.param_groups)}"
        )
    for group, options in zip(optimizer.param_groups, saved):
        group.update({k: v for k, v in options.items() if k != "params"})
    for flat in engine.optimizer.fp32_partitioned_groups_flat:
        state = optimizer.state.get(flat, {})
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


def sequence_shards(model: Any) -> Dict[str, Tuple[int, List[int]]]:
    """name -> (sequence dim, whole shape) of every sharded E/F / position parameter of a live
    (possibly ZeRO-3 partitioned) model."""
    from linformer_ds.sequence_parallel import SHARD_ATTR

    out = {}
    for name, p in model.named_parameters():
        if hasattr(p, SHARD_ATTR):
            dim, size = getattr(p, SHARD_ATTR)
            shape = list(getattr(p, "ds_shape", p.shape))
            shape[dim] = size
            out[name] = (dim, shape)
    return out


def optimizer_index_names(engine) -> List[str]:
    """The parameter name behind each index of the optimizer's state dict (torch numbers the
    parameters group by group, in order)."""
    name_of = {id(p): n for n, p in engine.module.named_parameters()}
    return [name_of[id(p)] for g in engine.optimizer.param_groups for p in g["params"]]


def reshard_zero0(
    ckpt_dir: str, tag: str, saved_p: int, now_p: int, index_names: List[str], out_root: str
) -> str:
    """ZeRO-0 fp32: ``ckpt_dir/tag``, saved with E/F and positions sharded over ``saved_p`` ranks
    (1: whole), -> ``out_root/tag`` holding the same model and AdamW state sharded over
    ``now_p``, in DeepSpeed's native files (``mp_rank_<r>_model_states.pt``, one per SP rank).
    Each sharded weight and its exp_avg / exp_avg_sq are joined along their sequence dim in
    rank order, then cut in ``now_p`` equal parts; everything else is copied. ``index_names``:
    :func:`optimizer_index_names` of the engine that will load it. Returns ``out_root``."""
    from linformer_ds.sequence_parallel import sequence_dim, shard_tensor

    src = os.path.join(ckpt_dir, tag)
    parts = [
        safe_torch_load(os.path.join(src, f"mp_rank_{r:02d}_model_states.pt"))
        for r in range(saved_p)
    ]
    optims = [p.get("optimizer") for p in parts]
    if not all(isinstance(o, dict) and {"state", "param_groups"} <= set(o) for o in optims):
        raise CheckpointError(f"{src}: its ZeRO-0 files hold no plain optimizer state to re-shard")
    saved_index = [i for g in optims[0]["param_groups"] for i in g["params"]]
    if len(saved_index) != len(index_names):
        raise CheckpointError(
            f"{src}: its optimizer has {len(saved_index)} parameters, this model "
            f"{len(index_names)}; resume with the saved layout"
        )
    dims = {n: sequence_dim(n, t.dim()) for n, t in parts[0]["module"].items()}

    def whole(get: Callable[[Dict[str, Any]], torch.Tensor], name: str) -> Any:
        t = get(parts[0])
        if saved_p == 1 or dims.get(name) is None or not torch.is_tensor(t) or t.dim() == 0:
            return t
        return torch.cat([get(p) for p in parts], dim=dims[name])

    def cut(t: Any, name: str, r: int) -> Any:
        if now_p == 1 or dims.get(name) is None or not torch.is_tensor(t) or t.dim() == 0:
            return t
        return shard_tensor(t, dims[name], r, now_p).contiguous().clone()

    module = {n: whole(lambda p, n=n: p["module"][n], n) for n in parts[0]["module"]}
    state = {}
    for i, st in optims[0]["state"].items():
        name = index_names[saved_index.index(i)]
        state[i] = {k: whole(lambda p, i=i, k=k: p["optimizer"]["state"][i][k], name) for k in st}
        for k, v in state[i].items():
            if torch.is_tensor(v) and v.dim() and v.shape != module[name].shape:
                raise CheckpointError(
                    f"{src}: optimizer state {i} ({k}, shape {tuple(v.shape)}) does not match "
                    f"{name} {tuple(module[name].shape)}; resume with the saved layout"
                )
    out = os.path.join(out_root, tag)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    for r in range(now_p):
        files = dict(parts[0], mp_world_size=now_p)
        files["module"] = {n: cut(t, n, r) for n, t in module.items()}
        files["optimizer"] = dict(optims[0], state={
            i: {k: cut(v, index_names[saved_index.index(i)], r) for k, v in st.items()}
            for i, st in state.items()
        })  # fmt: skip
        torch.save(files, os.path.join(out, f"mp_rank_{r:02d}_model_states.pt"))
    return out_root


def load(
    engine, ckpt_dir: str, tag: str, cfg: JobConfig, load_dir: Optional[str] = None
) -> Dict[str, Any]:
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
        with torch.serialization.safe_globals(safe_globals()):
            return original(f, *args, **kwargs)

    torch.load = safe_load
    try:
        yield
    finally:
        torch.load = original


def resolve_checkpoint(checkpoint: str, tag: Optional[str] = None) -> Tuple[str, str]:
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


# ============================================================================ checkpoint manager
# Components whose state lies at the top level of the client state (and in the metadata), as
# checkpoints of format 1 have always stored it: name -> its state_dict's keys.
TOP_LEVEL_STATE = {"data": ("epoch", "sampler")}


class Stateful(Protocol):
    def state_dict(self) -> Dict[str, Any]: ...

    def load_state_dict(self, state: Dict[str, Any]) -> None: ...


class CheckpointManager:
    """The trainer's checkpoints: what is saved, when, and resuming.

    Components :meth:`register` their state (symmetric ``state_dict`` / ``load_state_dict``);
    the manager writes it into every checkpoint's client state and restores it on resume.
    Use: ``prepare()`` before any collective (writability, tag choice, metadata checks), then
    ``ds_config_overrides`` for the engine, then (collective) :meth:`resume`, and after each
    step :meth:`after_step`; :meth:`on_signal` and :meth:`on_finish` at the end. A checkpoint
    saved in another layout (ranks, P, sharding) is converted first (:func:`layout_route`).
    ``on_io(op, seconds)`` observes every save and load.
    """

    def __init__(self, cfg: JobConfig, rank: int, world_size: int, dataset: Any = None):
        self.cfg, self.rank, self.world = cfg, rank, world_size
        self.dir = cfg.checkpoint.dir
        self.dataset = dataset  # its tokenizer.model and special ids go into each checkpoint
        self.tag: Optional[str] = None
        self.meta: Optional[Dict[str, Any]] = None
        self.universal = False  # loaded through DeepSpeed's universal checkpoint
        self.route: Optional[str] = None  # see layout_route
        self.last_saved_step = -1
        self.load_seconds = 0.0
        self.components: Dict[str, Stateful] = {}
        self.on_io: Optional[Callable[[str, float], None]] = None

    def register(self, name: str, component: Stateful) -> None:
        """Save ``component.state_dict()`` as ``name`` in every checkpoint; on resume give it
        back to ``component.load_state_dict`` (a checkpoint without it leaves it as it is)."""
        self.components[name] = component

    def _state(self) -> Dict[str, Any]:
        state: Dict[str, Any] = {}
        for name, component in self.components.items():
            if name in TOP_LEVEL_STATE:
                state.update(component.state_dict())
            else:
                state[name] = component.state_dict()
        return state

    def _restore(self, client: Dict[str, Any]) -> None:
        for name, component in self.components.items():
            keys = TOP_LEVEL_STATE.get(name)
            sd = {k: client[k] for k in keys} if keys else client.get(name)
            if sd is None:
                continue
            try:
                component.load_state_dict(sd)
            except ValueError as e:
                raise CheckpointError(f"{self.dir}/{self.tag}: {e}") from None

    def prepare(self) -> Optional[str]:
        """Check the directories and choose the tag to resume from (None: a fresh start)."""
        check_writable(self.dir, "checkpoint.dir")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.tag, self.meta = select_resume(self.dir, self.cfg.checkpoint.resume, self.cfg)
        if self.rank == 0:
            for w in caught:
                print(f"[warn] {w.message}", flush=True)
        if self.tag is not None:
            assert self.meta is not None
            where = os.path.join(self.dir, self.tag)
            check_run_config(self.meta, self.cfg, where)
            notice = check_engine_config(self.dir, self.tag, self.meta, self.cfg)
            route = layout_route(self.dir, self.tag, self.meta, self.cfg, self.world)
            self.route = VIA_UNIVERSAL if notice is not None else route
            self.universal = self.route == VIA_UNIVERSAL
            same_world = int(self.meta["world_size"]) == self.world
            saved_p, now_p = sharded_sp_size(self.meta), sharded_sp_size(config_layout(self.cfg))
            if saved_p != now_p and self.rank == 0 and same_world:
                how = "a universal checkpoint" if self.universal else "re-sharded ZeRO-0 files"
                print(
                    f"[resume] {where}: E/F and positions were sharded over {saved_p} rank(s), "
                    f"now {now_p}: loading it through {how}",
                    flush=True,
                )
            if notice and self.rank == 0 and same_world:
                print(f"[resume] {notice}", flush=True)
            self.last_saved_step = int(self.meta["step"])
        return self.tag

    def ds_config_overrides(self) -> Dict[str, Any]:
        """What the DeepSpeed config must say to load the chosen tag (fixed at initialize)."""
        return {"checkpoint": {"load_universal": True}} if self.universal else {}

    def load(self, engine) -> Dict[str, Any]:
        """Collective: load the prepared tag into ``engine``; returns its client state."""
        import deepspeed.comm as dist

        assert self.tag is not None and self.meta is not None
        load_dir = None
        if self.route is not None:
            root = os.path.join(self.dir, UNIVERSAL_DIR)
            now_p = sharded_sp_size(config_layout(self.cfg))
            per_sp_rank = self.universal and self.cfg.deepspeed.zero.stage == 3 and now_p > 1
            if self.rank == 0:
                if int(self.meta["world_size"]) != self.world:  # (else prepare said why)
                    how = (
                        "converting it to a universal checkpoint"
                        if self.universal
                        else "re-sharding its ZeRO-0 files"
                    )
                    print(
                        f"[resume] {self.dir}/{self.tag} was saved by {self.meta['world_size']} "
                        f"rank(s), this run has {self.world}: {how}",
                        flush=True,
                    )
                self._convert(engine, root, now_p, per_sp_rank)
            dist.barrier()
            load_dir = root
            if per_sp_rank:
                load_dir = os.path.join(root, f"sp{engine.mpu.get_model_parallel_rank()}")
        client = load(engine, self.dir, self.tag, self.cfg, load_dir=load_dir)
        if self.universal and self.cfg.deepspeed.zero.stage == 3:
            assert load_dir is not None
            repair_zero3_universal_load(engine, load_dir, self.tag)
        if self.route is not None:
            dist.barrier()
            if self.rank == 0:  # derived data: the next save writes a native checkpoint
                shutil.rmtree(os.path.join(self.dir, UNIVERSAL_DIR), ignore_errors=True)
        return client

    def _convert(self, engine, root: str, now_p: int, per_sp_rank: bool) -> None:
        """Rank 0: write the prepared tag in a form this layout loads, under ``root``."""
        assert self.tag is not None and self.meta is not None
        try:
            if self.universal:
                convert_to_universal(self.dir, self.tag)
                if per_sp_rank:
                    shards = sequence_shards(engine.module)
                    cut_universal_per_sequence_rank(root, self.tag, shards, now_p)
            else:
                saved_p = sharded_sp_size(self.meta)
                names = optimizer_index_names(engine)
                reshard_zero0(self.dir, self.tag, saved_p, now_p, names, root)
        except CheckpointError:
            raise
        except (OSError, RuntimeError, KeyError, ValueError) as e:
            shutil.rmtree(root, ignore_errors=True)
            raise CheckpointError(
                f"re-sharding {self.dir}/{self.tag} for this layout failed: {_reason(e, root)}"
                f"{_free_space(self.dir)}; the checkpoint itself is intact"
            ) from None

    def resume(self, engine) -> int:
        """Collective: load the prepared tag into ``engine`` and every registered component;
        returns the step it was saved after (0: a fresh start, nothing loaded)."""
        if self.tag is None:
            return 0
        t0 = time.perf_counter()
        client = self.load(engine)
        self._restore(client)
        self.load_seconds = time.perf_counter() - t0
        step = int(client["step"])
        if self.rank == 0:
            assert self.meta is not None
            print(
                f"[resume] {self.dir}/{self.tag}: step {step}, epoch {int(client['epoch'])}, "
                f"sampler consumed {client['sampler']['consumed']} (saved by "
                f"{self.meta['world_size']} rank(s), now {self.world})",
                flush=True,
            )
        return step

    def save(self, engine, step: int, reason: str) -> str:
        """Collective: write ``step``'s checkpoint with every component's state (see
        :func:`save`); returns the tag."""
        t0 = time.perf_counter()
        layout = config_layout(self.cfg)
        tag = save(engine, self.cfg, self.dir, step, self._state(), self.dataset, layout)
        self.last_saved_step = step
        if self.on_io is not None:
            self.on_io("save", time.perf_counter() - t0)
        if self.rank == 0:
            print(
                f"[checkpoint] {reason}: {self.dir}/{tag} ({time.perf_counter() - t0:.1f}s)",
                flush=True,
            )
        return tag

    def after_step(self, engine, step: int) -> None:
        """Collective: the interval save (``checkpoint.save_interval``) when ``step`` is due."""
        interval = self.cfg.checkpoint.save_interval
        if interval and step % interval == 0:
            self.save(engine, step, "interval")

    def on_signal(self, engine, step: int, signum: Optional[int]) -> None:
        """Collective: a signal asked the run to stop after ``step``: save it (once)."""
        if self.last_saved_step != step:
            self.save(engine, step, f"signal {signum}")

    def on_finish(self, engine, step: int) -> None:
        """Collective: the end of training: the final save (``checkpoint.save_final``)."""
        if self.cfg.checkpoint.save_final and self.last_saved_step != step:
            self.save(engine, step, "final")

    def latest(self) -> Optional[str]:
        """Path of the newest complete checkpoint, or None."""
        tag = latest_tag(self.dir)
        return os.path.join(self.dir, tag) if tag else None
