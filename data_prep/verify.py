"""What ``--resume`` checks before it continues: the sources are the ones the interrupted run
started on.

A fresh run records the identity of every source file in ``progress.json`` before it reads a
document: path, size, modification time and sha256 (:func:`source_identity`). ``--resume``
lists the files again and compares (:func:`check_sources`): a file added, gone, of another size
or with other bytes is refused in one line naming it, before any work. The content decides: a
file whose modification time alone changed (``touch``, a copy) is the same corpus and resumes.

What identifies a spec, by its kind: local files and ``stdlib``: the files it reads; ``hf:``
with a local directory (``save_to_disk`` or data files): the files under it; any other kind:
the files under its ``roots()``. A spec with no local file to hash (a Hub dataset name) cannot
be checked: a resume says so in one warning line.

The shards are checked by content too, in :class:`data_prep.shards.ShardWriter` (one process)
and :func:`data_prep.parallel.verified_units` (ranks).
"""

import hashlib
import json
import os
from typing import Any

from data_prep import console
from data_prep.errors import DataPrepError
from data_prep.sources import FilesKind, HFKind, Source, _walk, parse_hf

BLOCK = 1 << 20


def file_digest(path: str, start: int = 0, length: int | None = None) -> "hashlib._Hash":
    """The sha256 object of ``length`` bytes of ``path`` from ``start`` (None: to the end)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        left = length
        while left is None or left > 0:
            block = f.read(BLOCK if left is None else min(BLOCK, left))
            if not block:
                break
            h.update(block)
            if left is not None:
                left -= len(block)
    return h


def same_bytes(path: str, sha256: str | None) -> bool:
    """``path`` is a file whose sha256 is ``sha256`` (False for None)."""
    return sha256 is not None and os.path.isfile(path) and file_digest(path).hexdigest() == sha256


def json_record(path: str) -> dict[str, Any] | None:
    """The JSON object in ``path``; None when it is unreadable or not an object."""
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _spec_files(source: Source, spec: str) -> list[str] | None:
    """The local files that hold ``spec``'s documents, in a fixed order; None: none known."""
    kind = source.kind(spec)
    if isinstance(kind, FilesKind):  # local files, stdlib
        return list(source.files(spec))
    if isinstance(kind, HFKind):
        root = parse_hf(spec).name
        return _walk(root) if os.path.isdir(root) else None
    files: list[str] = []
    for root in kind.roots(spec):  # another kind: the local paths it reads below
        files += _walk(root) if os.path.isdir(root) else [root] if os.path.isfile(root) else []
    return files or None


def _stat(path: str) -> dict[str, Any]:
    try:
        st = os.stat(path)
    except OSError as e:
        raise DataPrepError(f"cannot read source file {path!r}: {e.strerror or e}") from None
    return {"file": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _sha256(path: str) -> str:
    try:
        return file_digest(path).hexdigest()
    except OSError as e:
        raise DataPrepError(f"cannot read source file {path!r}: {e.strerror or e}") from None


def _listing(source: Source) -> list[dict[str, Any]]:
    """Per spec: ``{spec, kind, files}``, each file ``{file, size, mtime_ns}`` (no hash yet);
    ``files`` None where the spec has no local file."""
    out = []
    for spec in source.specs:
        files = _spec_files(source, spec)
        out.append(
            {
                "spec": spec,
                "kind": source.kind(spec).name,
                "files": None if files is None else [_stat(p) for p in files],
            }
        )
    return out


def source_identity(source: Source) -> list[dict[str, Any]]:
    """The record a fresh run keeps in ``progress.json``: :func:`_listing` with each file's
    sha256."""
    out = _listing(source)
    for item in out:
        for f in item["files"] or []:
            f["sha256"] = _sha256(f["file"])
    return out


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def identity_summary(identity: list[dict[str, Any]], seconds: float, resumed: bool) -> str:
    """``sources: 1,834 files (31.2 MB) hashed in 0.41 s, recorded for --resume``."""
    files = [f for item in identity for f in item["files"] or []]
    what = "unchanged since the interrupted run" if resumed else "recorded for --resume"
    return (
        f"sources: {len(files):,} files ({_mb(sum(f['size'] for f in files))}) hashed in "
        f"{seconds:.2f} s, {what}"
    )


def check_sources(recorded: Any, source: Source, where: str) -> list[dict[str, Any]]:
    """Refuse to resume (one line naming the file) unless ``source`` holds the files
    ``recorded`` (by :func:`source_identity` when the run in ``where`` started) with the same
    sizes and bytes; returns ``recorded``. The sizes are compared before any file is hashed."""
    redo = "; restore it or rerun with --overwrite to start over"
    if not isinstance(recorded, list) or len(recorded) != len(source.specs):
        raise DataPrepError(
            f"cannot resume: {where} records no identity of its sources (written by an earlier "
            "data_prep), so they cannot be checked unchanged; rerun with --overwrite"
        )
    now = _listing(source)
    unchecked = []
    for old, new in zip(recorded, now):
        if old.get("files") is None or new["files"] is None:
            if old.get("files") is not None or new["files"] is not None:
                raise DataPrepError(
                    f"cannot resume: --source {new['spec']} is not what the interrupted run "
                    f"read (its local files {'appeared' if new['files'] else 'are gone'}){redo}"
                )
            unchecked.append(new["spec"])
            continue
        before = {f["file"]: f for f in old["files"]}
        after = {f["file"]: f for f in new["files"]}
        for f in new["files"]:
            if f["file"] not in before:
                raise DataPrepError(
                    f"cannot resume: source file {f['file']!r} is new since the interrupted run "
                    f"started (--source {new['spec']}); move it away or rerun with --overwrite"
                )
        for f in old["files"]:
            if f["file"] not in after:
                raise DataPrepError(
                    f"cannot resume: source file {f['file']!r} is gone since the interrupted "
                    f"run started{redo}"
                )
            if after[f["file"]]["size"] != f["size"]:
                raise DataPrepError(
                    f"cannot resume: source file {f['file']!r} changed since the interrupted "
                    f"run started ({f['size']:,} -> {after[f['file']]['size']:,} bytes){redo}"
                )
    for old in recorded:
        for f in old.get("files") or []:
            got = _sha256(f["file"])
            if got != f["sha256"]:
                raise DataPrepError(
                    f"cannot resume: source file {f['file']!r} changed since the interrupted "
                    f"run started (same size, other bytes: sha256 {f['sha256'][:12]} -> "
                    f"{got[:12]}){redo}"
                )
    if unchecked:  # (WARNING: data_prep.console)
        console.warning(
            f"{', '.join(unchecked)} has no local file to check: resumed on the assumption that "
            "it is unchanged since the interrupted run started"
        )
    return recorded
