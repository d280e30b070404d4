"""Output directories that never destroy what the command did not create.

Used by ``python -m data_prep``, ``launch/export.py`` and ``launch/finetune.py`` before any slow
work. ``--out`` is refused (:class:`OutDirError`, one line) when it

- is, contains or lies inside one of the command's inputs (a source, the checkpoint, the base
  model, a data file);
- lies inside, or is, a directory another tool owns: a training run (``metrics.jsonl``), a
  checkpoint directory (``latest``, ``step_*`` tags), a checkpoint tag, a data_prep output, an
  export or a fine-tuned model;
- is a non-empty directory without this command's own record file (:data:`OWN_FILES`: every
  output of the command holds it): ``--overwrite`` replaces only a directory that carries the
  same command's record, and never one that contains any of the above.

- is itself a symbolic link (to anything: an empty or a non-empty directory, another link, or
  nothing): a command publishes its output by renaming a finished directory onto ``--out``,
  which would replace the link, not fill its target, so the link is refused before any work
  and the message names its target (:func:`link_rule`); links in the parents of ``--out`` are
  followed (the output goes where they lead). A link that appears at ``--out`` while the
  command works is refused at the rename (:func:`swap_in`), and data_prep keeps its finished
  work for ``--resume``.

These rules and those of a command that writes one file (:mod:`linformer_ds.outpath`) are one
contract: :func:`check_path` holds what they share (an empty path or a NUL byte; the wrong kind
of thing already there; an input, a path inside one or a directory holding one, compared after
resolving links; a directory another tool owns above it; a path under a regular file; a nearest
existing parent that is not a writable directory), and each command calls it before any work,
before it takes its lock.

Replacing goes through a sibling temporary directory and renames (:func:`swap_in`), so a failed
write leaves the previous output whole. data_prep stages in a directory of a fixed name,
``.<out>.data_prep-partial`` beside ``--out`` (:func:`data_prep.steps.partial_dir`), so that an
interrupted run can be continued there with ``--resume``; it too is swapped in only when
complete.

The commands' one-line failures come from here too (:func:`error_line`, :func:`write_error`,
:func:`fail`). Standard library only (data_prep imports it).
"""

import contextlib
import errno
import os
import re
import resource
import shutil
import signal
import tempfile
from collections.abc import Sequence

from linformer_ds.errors import LinformerError
from linformer_ds.log import get_logger

log = get_logger(__name__)

# The file every output of a command holds, by which it recognises its own earlier output
# (checked in this order: a fine-tuned model also holds an export's linformer_export.json).
OWN_FILES = {
    "finetune": ("finetune_results.json",),
    "export": ("linformer_export.json",),
    "data_prep": ("manifest.json", "progress.json"),
}
_TAG_RE = re.compile(r"^step_\d{8,}$")
_WALK_LIMIT = 10_000  # entries looked at when checking what an --overwrite target contains


class OutDirError(LinformerError, ValueError):
    """``--out`` cannot be used; the message names what it is and what to do."""


def _names(d: str) -> list[str]:
    try:
        return os.listdir(d)
    except OSError:
        return []


def identify(d: str) -> tuple[str, str | None] | None:
    """``(what d is, the command that made it or None)`` for a directory some tool of this
    project owns, else None."""
    names = _names(d)
    if not names:
        return None
    present = set(names)
    if "linformer_meta.json" in present:
        return "a checkpoint tag", None
    if any(_TAG_RE.match(n) for n in names) or os.path.isfile(os.path.join(d, "latest")):
        return "a checkpoint directory (step_* tags / latest)", None
    if "metrics.jsonl" in present:
        return "a training run directory (metrics.jsonl)", None
    if "finetune_results.json" in present:
        return "a fine-tuned model", "finetune"
    if "linformer_export.json" in present:
        return "an exported model", "export"
    if "manifest.json" in present or "progress.json" in present:
        if "tokenizer.model" in present or "train" in present or "progress.json" in present:
            return "a data_prep output", "data_prep"
    return None


def _under(path: str, root: str) -> bool:
    return path != root and path.startswith(root.rstrip(os.sep) + os.sep)


def check_path(
    out: str,
    inputs: Sequence[tuple[str, str | None]] = (),
    flag: str = "--out",
    directory: bool = True,
    error: type = OutDirError,
) -> None:
    """The rules every command's output shares (the module docstring), checked before any
    work; raises ``error`` (one line naming ``out`` and what to do). ``directory``: the command
    writes a directory (``out`` may be one, never anything else) or a file (``out`` must not
    be a directory or name one). ``inputs``: the ``(flag, path)`` pairs the command reads (None
    entries are skipped)."""
    what = "directory" if directory else "file"
    if not isinstance(out, str) or not out.strip():
        raise error(f"{flag}: an empty path; name the {what} to write")
    if "\0" in out:
        raise error(f"{flag} {out!r}: a path cannot hold a NUL byte")
    if directory:
        is_link = os.path.islink(os.path.abspath(out))  # link_rule's, once inputs are checked
        if os.path.lexists(out) and not os.path.isdir(out) and not is_link:
            raise error(f"{flag} {out} exists and is not a directory; choose a new directory")
    else:
        if out.endswith(os.sep) or os.path.basename(out) in (".", ".."):
            raise error(f"{flag} {out} names a directory; name the file to write")
        if os.path.isdir(out):
            raise error(f"{flag} {out} is a directory; name a file (inside it or elsewhere)")
    real = os.path.realpath(out)
    for label, path in inputs:
        if not path or not os.path.lexists(path):
            continue
        p = os.path.realpath(path)
        if real == p:
            relation = "is"
        elif _under(p, real):
            relation = "contains"
        elif _under(real, p):
            relation = "lies inside"
        else:
            continue
        raise error(f"{flag} {out} {relation} the input {label} {path}: write the output "
                    "outside the inputs")  # fmt: skip
    if directory:
        link_rule(out, flag, error)
    parent = os.path.dirname(real)
    while True:
        found = identify(parent)
        if found is not None:
            raise error(f"{flag} {out} lies inside {found[0]} {parent}: write the output "
                        "outside it")  # fmt: skip
        up = os.path.dirname(parent)
        if up == parent:
            break
        parent = up
    near = os.path.dirname(os.path.abspath(out))
    while not os.path.lexists(near):
        near = os.path.dirname(near)
    if not os.path.isdir(near):
        raise error(f"{flag} {out}: {near} is not a directory")
    if not os.access(near, os.W_OK | os.X_OK):
        try:
            read_only = bool(os.statvfs(near).f_flag & os.ST_RDONLY)
        except OSError:
            read_only = False
        reason = "Read-only file system" if read_only else "Permission denied"
        raise error(f"{flag} {out}: cannot write there: {reason} ({near}); choose a writable "
                    f"{flag}")  # fmt: skip


def _what_is(path: str) -> str:
    """What ``path`` (links followed) is, for a message."""
    if not os.path.lexists(path) or not os.path.exists(path):
        return "which does not exist"
    if os.path.isdir(path):
        return "a non-empty directory" if _names(path) else "an empty directory"
    return "a file" if os.path.isfile(path) else "not a regular file or directory"


def link_rule(out: str, flag: str = "--out", error: type = OutDirError) -> None:
    """An output directory is never a symbolic link, nor a path that resolves elsewhere than
    its name says (a link followed by ``..``); links above it are followed. Raises ``error``
    (one line: what the link leads to and what to pass instead)."""
    path = os.path.abspath(out)
    real = os.path.realpath(out)
    if os.path.islink(path):
        target = os.readlink(path)
        nxt = os.path.join(os.path.dirname(path), target)
        chain = f" (a link too, leading on to {real})" if os.path.islink(nxt) else ""
        raise error(
            f"{flag} {out} is a symbolic link to {target}{chain}, {_what_is(real)}; an output "
            f"is renamed into place, never written through a link: pass {flag} {real} itself "
            "or a new path"
        )
    named = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
    if os.path.basename(path) and named != real:
        raise error(
            f"{flag} {out} resolves through a symbolic link to {real}, not to {named} as "
            f"written; pass {flag} {real} itself or a path without '..' after a link"
        )


def check_out(
    out: str,
    command: str,
    inputs: Sequence[tuple[str, str | None]] = (),
    overwrite: bool = False,
    resume: bool = False,
) -> str:
    """Check ``out`` for ``command`` (see the module docstring); returns its state:
    ``"new"`` (does not exist), ``"empty"`` (an empty directory), ``"replace"`` (an earlier
    output of ``command``, ``overwrite`` given) or ``"resume"`` (the same, ``resume`` given).

    ``inputs``: ``(flag, path)`` pairs the command reads (None entries are skipped).
    """
    flag = "--out"
    check_path(out, inputs, flag, directory=True)
    real = os.path.realpath(out)
    if not os.path.isdir(real):
        return "new"
    if not _names(real):
        return "empty"
    found = identify(real)
    if found is None or found[1] != command:
        what = f"is {found[0]}" if found else "exists and is not empty"
        made = f"{command} did not create it (no {OWN_FILES[command][0]})"
        if overwrite:
            raise OutDirError(
                f"refusing to --overwrite {out}: it {what} and {made}; --overwrite replaces only "
                f"an earlier {command} output: choose a new or empty directory"
            )
        raise OutDirError(
            f"{flag} {out} {what} and {made}; nothing there is replaced: choose a new or empty "
            "directory"
        )
    if not (overwrite or resume):
        return "exists"
    for root, dirs, _files in os.walk(real):
        if len(dirs) > _WALK_LIMIT:
            break
        for name in dirs:
            inner = identify(os.path.join(root, name))
            if inner is not None:
                raise OutDirError(
                    f"{flag} {out} contains {inner[0]} {os.path.join(root, name)}; it is not "
                    "replaced: move that away first or choose another --out"
                )
    return "resume" if resume else "replace"


def staging_dir(out: str, command: str) -> str:
    """A new hidden directory next to ``out`` to write into (swapped in by :func:`swap_in`)."""

    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=f".{command}-", dir=parent)


def swap_in(tmp: str, out: str) -> None:
    """Make the finished ``tmp`` the directory ``out``; a previous ``out`` (checked by
    :func:`check_out`) is moved aside first and deleted only after the rename succeeded."""
    out = os.path.abspath(out)
    if os.path.islink(out):  # appeared since check_out: renaming onto it would drop the link
        raise OutDirError(
            f"--out {out} became a symbolic link (to {os.readlink(out)}) while the command "
            "worked; nothing was renamed onto it"
        )
    old = None
    if os.path.isdir(out) and _names(out):
        old = f"{tmp}.old"
        os.replace(out, old)
    try:
        os.replace(tmp, out)
    except OSError:
        if old is not None:
            os.replace(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    with contextlib.suppress(OSError):
        fd = os.open(os.path.dirname(out), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def error_line(e: BaseException, empty: str = "no detail") -> str:
    """``e`` in one line: ``TypeName: first line of its message`` (``empty`` when it has none),
    for a library's failure (a load, a parse) that the command reports in one line."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else empty}"


def write_error(e: BaseException, what: str) -> str:
    """One line for a failed write of ``what``: the OS's reason (ENOSPC, EFBIG from a file-size
    limit such as ``ulimit -f``, EROFS, ...) and the file, never a library's internal message."""

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    efbig = isinstance(e, OSError) and e.errno == errno.EFBIG
    if efbig or (limit != resource.RLIM_INFINITY and "too large" in str(e).lower()):
        reason = f"a file reached this process's file-size limit (ulimit -f: {limit} bytes)"
    elif isinstance(e, OSError) and e.strerror:
        reason = e.strerror
    else:
        reason = error_line(e, empty="").strip()
        if "space" not in reason.lower() and _disk_full(what):
            reason = f"No space left on device ({reason})"
    where = f" ({e.filename})" if isinstance(e, OSError) and e.filename else ""
    return f"could not write {what}: {reason}{where}"


def _disk_full(path: str) -> bool:
    p = os.path.abspath(path)
    while p and not os.path.exists(p):
        p = os.path.dirname(p)
    try:
        usage = shutil.disk_usage(p)
    except OSError:
        return False
    return usage.free < min(16 * 2**20, usage.total // 100 + 1)


def ignore_file_size_signal() -> None:
    """Make a write beyond ``ulimit -f`` raise ``OSError(EFBIG)`` (reported in one line by
    :func:`write_error`) instead of killing the process with SIGXFSZ."""

    if hasattr(signal, "SIGXFSZ"):
        with contextlib.suppress(ValueError, OSError):  # not the main thread
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def fail(prefix: str, message: str, code: int = 2) -> int:
    """``prefix: message`` as one stderr line (the package logger, ERROR); returns ``code``."""
    log.error(f"{prefix}: {' '.join(str(message).split())}")
    return code
