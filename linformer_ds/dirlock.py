"""One owner per directory: advisory ``fcntl.flock`` locks held for a command's life.

- :func:`run_dir_lock`: the trainer's ``logging.dir`` and ``checkpoint.dir`` (rank 0), a lock
  file inside the directory (:data:`LOCK_NAME`); :func:`run_dir_locks` adds the ``--out`` lock
  beside it, so data_prep, export and finetune cannot write there while a run does.
- :func:`output_lock`: the ``--out`` of data_prep, export and finetune; those directories are
  replaced by a rename, so the lock file lies beside them (``.<name>.lock``).
- :func:`pin_tag`: a reader (export) holds a shared lock on a checkpoint tag's ``COMPLETE``
  marker; the trainer's pruning (:func:`try_exclusive`) skips a tag it cannot lock.

The kernel releases a flock when its process dies (kill -9 included), so a lock left by a
process that is gone is taken over at once ("stale"); the file names the last holder (host,
pid, command) for the one-line refusal. A lock file is removed by its last holder. Standard
library only (data_prep imports it).
"""

import contextlib
import fcntl
import json
import os
import socket
import stat
import time
from collections.abc import Iterator
from typing import Any

from linformer_ds import outdir
from linformer_ds.errors import LinformerError

LOCK_NAME = ".linformer.lock"


class LockError(LinformerError, RuntimeError):
    """The directory is in use by another process; the message names the holder."""


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "another process (holder unknown)"
    since = holder.get("since")
    when = time.strftime(" since %Y-%m-%d %H:%M:%S UTC", time.gmtime(since)) if since else ""
    return (f"{holder.get('command', 'a process')} (host {holder.get('host', '?')}, "
            f"pid {holder.get('pid', '?')}{when})")  # fmt: skip


def _await_holder(path: str, deadline_s: float = 5.0) -> dict[str, Any]:
    """The holder of a lock just found taken: a process that has locked the file but not yet
    written its record (a few system calls apart) is waited for, up to ``deadline_s``."""
    end = time.monotonic() + deadline_s
    holder = read_holder(path)
    while not holder and time.monotonic() < end:
        time.sleep(0.02)
        holder = read_holder(path)
    return holder


def read_holder(path: str) -> dict[str, Any]:
    """The holder recorded in the lock file ``path`` ({} when none or unreadable); a symbolic
    link is not followed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, encoding="utf-8") as f:
            holder = json.loads(f.read(1 << 16) or "{}")
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, /proc/PID/stat field 22), None
    when it does not exist or there is no /proc: with the pid it names one process, a pid
    reused by a later process has another start."""
    try:
        with open(f"/proc/{int(pid)}/stat", encoding="utf-8", errors="replace") as f:
            stat = f.read()
        return int(stat[stat.rindex(")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return None


def holder_state(holder: dict[str, Any]) -> str:
    """Whether the process a lock record names is alive, judged by pid and start time (and the
    host's boot): ``"gone"``, ``"alive"`` (the same process: it no longer holds the lock),
    ``"reused"`` (the pid now names another process) or ``"unknown"`` (another host, or a
    record without a start time whose pid is alive)."""
    if holder.get("host") != socket.gethostname():
        return "unknown"
    try:
        pid = int(holder.get("pid"))
    except (TypeError, ValueError):
        return "unknown"
    if holder.get("boot") and holder.get("boot") != _boot_id():
        return "gone"  # recorded before a reboot
    now = process_start(pid)
    if now is None:
        if os.path.isdir("/proc/self"):
            return "gone"  # /proc has no such pid
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "gone"
        except OSError:  # EPERM: it exists (another user's)
            pass
        return "unknown"
    if holder.get("start") is None:
        return "unknown"
    return "alive" if int(holder["start"]) == now else "reused"


class DirLock:
    """An exclusive (or ``shared``) flock on the file ``path``, taken without waiting.

    :meth:`acquire` raises :class:`LockError` naming the holder when another process holds it;
    :meth:`release` (also at exit of a ``with``) unlocks and, as the last holder, removes the
    file. ``stale``: after acquire, the holder the file named before, when that process is gone.
    """

    def __init__(self, path: str, what: str, command: str, shared: bool = False):
        self.path, self.what, self.command, self.shared = path, what, command, shared
        self.fd: int | None = None
        self.stale: dict[str, Any] = {}
        self.created: list[str] = []  # directories acquire made (removed again when empty)

    def acquire(self) -> "DirLock":
        mode = (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB
        parent, missing = os.path.dirname(self.path), []
        while parent and not os.path.isdir(parent):
            missing.append(parent)
            parent = os.path.dirname(parent)
        try:
            for d in reversed(missing):
                try:
                    os.mkdir(d)
                except FileExistsError:  # made by someone else meanwhile: not ours to remove
                    continue
                self.created.append(d)
            return self._lock(mode)
        except BaseException as e:  # Ctrl-C while the record is written included: no lock file left
            if self.fd is not None:
                self.release()
            elif isinstance(e, KeyboardInterrupt):
                self._remove_unheld_empty()
            self._remove_created()
            raise

    def _remove_unheld_empty(self) -> None:
        """After a Ctrl-C between the lock file's creation and its lock: the file, if nobody
        holds it and it holds no record (ours was not written yet; a dead holder's stays)."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.fstat(fd).st_size == 0 and os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                os.remove(self.path)
        except OSError:
            pass
        finally:
            os.close(fd)

    def _remove_created(self) -> None:
        for d in reversed(self.created):
            with contextlib.suppress(OSError):  # not empty: the command's output is in it
                os.rmdir(d)
        self.created = []

    def _lock(self, mode: int) -> "DirLock":
        for _ in range(100):  # the file may be removed by its last holder between open and lock
            fd = self._open()
            try:
                try:
                    fcntl.flock(fd, mode)
                except BlockingIOError:
                    os.close(fd)
                    raise LockError(
                        f"{self.what} is in use by {_describe(_await_holder(self.path))}: one "
                        f"owner per directory; wait for it to end or choose another directory "
                        f"(lock file {self.path})"
                    ) from None
                except OSError:
                    os.close(fd)
                    raise
                self.fd = fd  # held: a Ctrl-C from here on releases it (acquire, __del__)
                try:
                    same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
                except FileNotFoundError:
                    same = False
                if same:
                    break
                self.fd = None
                os.close(fd)  # locked a file its last holder had just removed: take the new one
            except KeyboardInterrupt:  # between open and lock: the file is ours if nobody holds it
                if self.fd is None:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        self.fd = fd  # acquire's handler removes it
                    except OSError:
                        os.close(fd)
                raise
        else:
            raise LockError(f"{self.what}: cannot take the lock file {self.path}")
        if not self.shared:  # a record left behind: its process died holding the lock
            self.stale = read_holder(self.path)
        record = {"host": socket.gethostname(), "pid": os.getpid(), "command": self.command,
                  "since": round(time.time(), 1), "start": process_start(os.getpid()),
                  "boot": _boot_id()}  # fmt: skip
        os.ftruncate(fd, 0)  # (shared holders: the last one to start is named)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        return self

    def _open(self) -> int:
        """The lock file, opened (made) without following a symbolic link; anything but a
        regular file there is refused in one line (LockError), never written through."""
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            fd = os.open(self.path, flags, 0o666)
        except OSError:
            kind = _kind(self.path)
            if kind is None:
                raise
            raise LockError(f"{self.what}: the lock file {self.path} is {kind}, not a regular "
                            "file; nothing is written through it: remove it and run again"
                            ) from None  # fmt: skip
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise LockError(f"{self.what}: the lock file {self.path} is "
                            f"{_kind(self.path) or 'not a regular file'}, not a regular file; "
                            "remove it and run again")  # fmt: skip
        return fd

    def stale_note(self) -> str | None:
        """One line about the stale lock taken over (its holder no longer holds it), or None:
        the holder's process is called gone only when its pid and start time say so."""
        if not self.stale:
            return None
        state = holder_state(self.stale)
        why = {
            "gone": "which is gone",
            "alive": "which is still running but no longer holds it",
            "reused": f"which is gone (pid {self.stale.get('pid')} is now another process)",
            "unknown": "which no longer holds it",
        }[state]
        return f"[lock] {self.what}: took over the lock of {_describe(self.stale)}, {why}"

    def release(self) -> None:
        """Unlock; the last holder removes the lock file first (while still holding it)."""
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:
            with contextlib.suppress(OSError):
                if not self.shared:
                    os.remove(self.path)
                else:  # the last shared holder can take it exclusively: then nobody else holds it
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                        os.remove(self.path)
        finally:
            os.close(fd)
            self._remove_created()

    def __enter__(self) -> "DirLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.release()


def _kind(path: str) -> str | None:
    """What ``path`` is when it is not a regular file ("a symbolic link", "a directory", ...);
    None when it is one or does not exist."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):  # fmt: skip
        if test(mode):
            return name
    return None


def run_dir_lock(directory: str, what: str, command: str) -> DirLock:
    """The lock of a directory that keeps its identity (a training run's ``logging.dir`` /
    ``checkpoint.dir``): ``directory/.linformer.lock``; the directory is created (and kept, as
    the trainer always did)."""
    os.makedirs(directory, exist_ok=True)
    return DirLock(os.path.join(directory, LOCK_NAME), f"{what} {directory}", command)


def run_dir_locks(directory: str, what: str, command: str) -> list[DirLock]:
    """A training run's locks on ``directory`` (``what``: logging.dir or checkpoint.dir), held
    for the run's life: the one data_prep, export and finetune take on an ``--out`` (beside it;
    skipped where no lock file can be made there) and :func:`run_dir_lock` (another run). The
    output of another command is refused (a run inside it would make two owners)."""
    found = outdir.identify(directory)
    if found is not None and found[1] is not None:
        raise LockError(f"{what} {directory} is {found[0]} (made by {found[1]}): a run writes to "
                        "a new directory or its own; choose another")  # fmt: skip
    beside: DirLock | None = output_lock(directory, command, what)
    try:
        beside.acquire()
    except OSError:
        beside = None
    try:
        return [lk for lk in (beside, run_dir_lock(directory, what, command).acquire()) if lk]
    except BaseException:
        if beside is not None:
            beside.release()
        raise


def output_lock(out: str, command: str, flag: str = "--out", shared: bool = False) -> DirLock:
    """The lock of an output directory that is replaced by a rename: ``.<name>.lock`` beside it
    (acquire creates the parent; directories it made are removed again if they stay empty).
    ``shared``: a reader's lock (finetune's ``--model``)."""
    out = os.path.abspath(out)
    parent, name = os.path.dirname(out), os.path.basename(out)
    return DirLock(os.path.join(parent, f".{name}.lock"), f"{flag} {out}", command, shared)


@contextlib.contextmanager
def pin_tag(tag_dir: str, marker: str = "COMPLETE") -> Iterator[bool]:
    """Hold a shared lock on ``tag_dir/marker`` while reading the tag (read-only access is
    enough); yields False when the tag has no marker (any more). The trainer's pruning skips a
    pinned tag (:func:`try_exclusive`)."""
    try:
        fd = os.open(os.path.join(tag_dir, marker), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a pruner is deleting this tag
        yield os.path.isfile(os.path.join(tag_dir, marker))
    finally:
        os.close(fd)


@contextlib.contextmanager
def try_exclusive(path: str) -> Iterator[bool]:
    """An exclusive flock on ``path`` without waiting: yields True when taken (nobody pins it,
    or the file is missing), False when a reader holds it (:func:`pin_tag`)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        yield True
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)
