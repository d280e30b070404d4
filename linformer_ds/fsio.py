"""File helpers shared by the trainer, data_prep and the tools: atomic writes and the
JSON-lines reader, a file's sha256. Standard library only (data_prep's worker processes import it).

An atomic write goes to ``PATH.tmp.<pid>`` in the same directory, is fsynced and renamed over
``PATH``: a reader sees the old file or the new one, never a torn one, and a crash leaves at
most a ``.tmp.<pid>`` file behind (removed here when the write itself fails).
"""

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Union

PathLike = Union[str, "os.PathLike[str]"]


def file_sha256(path: PathLike) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fsync_dir(path: PathLike) -> None:
    """Make a rename in ``path`` durable (best effort on filesystems without directory fsync)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: PathLike, text: str) -> None:
    """Replace ``path`` with ``text`` atomically and durably (fsync of the file and directory)."""
    path = os.fspath(path)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def atomic_write_json(path: PathLike, obj: Any, indent: int = 2) -> None:
    """:func:`atomic_write_text` of ``obj`` as JSON (with a final newline)."""
    atomic_write_text(path, json.dumps(obj, indent=indent) + "\n")


def read_jsonl(path: PathLike) -> list[dict[str, Any]]:
    """The records of a JSON-lines file such as ``metrics.jsonl``, in order; lines that do not
    parse (a torn last line of a killed writer) are skipped; ``[]`` when the file is missing."""
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    with open(path) as f:
        for line in f:
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
    return out
