"""Lock files (linformer_ds.dirlock, issue 45 item 4): opened without following a symbolic
link, anything but a regular file at the lock path refused in one line with every file left
byte for byte, and a stale holder's liveness judged by pid and start time, not pid alone.

Generated: the kind of thing at the lock path (a link to a file, a dangling link, a link to a
directory, a directory, a named pipe) x the lock (a run directory's, an --out's) x the name."""

import os
import socket
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from linformer_ds import dirlock

KINDS = ("link to a file", "dangling link", "link to a directory", "directory", "named pipe")
WHAT = {"link to a file": "a symbolic link", "dangling link": "a symbolic link",
        "link to a directory": "a symbolic link", "directory": "a directory",
        "named pipe": "a named pipe"}  # fmt: skip
NAMES = st.text(alphabet=st.sampled_from("abcxyz_-. é"), min_size=1, max_size=12).filter(
    lambda n: n.strip(". ") == n and n not in (".", "..")
)


def snapshot(root):
    """Every path under ``root`` (links not followed) -> its bytes, link target or kind."""
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(d, n)
            if os.path.islink(p):
                out[p] = ("link", os.readlink(p))
            elif os.path.isdir(p):
                out[p] = "dir"
            elif os.path.isfile(p):
                with open(p, "rb") as f:
                    out[p] = f.read()
            else:
                out[p] = "other"
    return out


def plant(kind, path, root):
    """Put ``kind`` at ``path``; a link's target is a precious file (or directory) in ``root``."""
    precious = root / "precious.txt"
    precious.write_bytes(b"do not overwrite\n")
    if kind == "link to a file":
        os.symlink(precious, path)
    elif kind == "dangling link":
        os.symlink(root / "nothing_here", path)
    elif kind == "link to a directory":
        (root / "adir").mkdir()
        os.symlink(root / "adir", path)
    elif kind == "directory":
        os.mkdir(path)
    else:
        os.mkfifo(path)


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(kind=st.sampled_from(KINDS), lock=st.sampled_from(["run", "out"]), name=NAMES)
def test_a_lock_path_that_is_not_a_regular_file_is_refused(tmp_path_factory, kind, lock, name):
    root = tmp_path_factory.mktemp("locks")
    target = root / name
    if lock == "run":
        target.mkdir()
        lk = dirlock.run_dir_lock(str(target), "logging.dir", "training")
    else:
        lk = dirlock.output_lock(str(target), "data_prep")
    plant(kind, lk.path, root)
    before = snapshot(root)
    with pytest.raises(dirlock.LockError) as e:
        lk.acquire()
    msg = str(e.value)
    assert "\n" not in msg and f"the lock file {lk.path} is {WHAT[kind]}, not a regular" in msg
    assert snapshot(root) == before  # nothing written through the link, nothing made
    assert not (root / "nothing_here").exists()


def test_data_prep_refuses_a_linked_lock_in_one_line(tmp_path):
    """The command's side: data_prep's --out lock is a link to a file: exit 2, one line, the
    file byte for byte."""
    (tmp_path / "corpus.txt").write_text("hello world\n" * 50)
    precious = tmp_path / "precious.txt"
    precious.write_bytes(b"keep\n")
    os.symlink(precious, tmp_path / ".out.lock")
    r = subprocess.run([sys.executable, "-m", "data_prep", "--source", str(tmp_path / "corpus.txt"),
                        "--out", str(tmp_path / "out"), "--vocab-size", "60", "--seq-len", "16", "--quiet"],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "is a symbolic link, not a regular file" in r.stderr
    assert precious.read_bytes() == b"keep\n" and not (tmp_path / "out").exists()


def _stale(tmp_path, record):
    """Take over a lock whose file names ``record`` (its process no longer holds it)."""
    import json

    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    (run / dirlock.LOCK_NAME).write_text(json.dumps(record))
    lk = dirlock.run_dir_lock(str(run), "logging.dir", "training").acquire()
    try:
        return lk.stale_note()
    finally:
        lk.release()


def test_stale_holder_is_judged_by_pid_and_start_time(tmp_path):
    """A live pid with its own start time: still running (it dropped the lock), not "gone";
    a live pid with another start time: the pid was reused; a pid that does not exist: gone;
    another host: no verdict."""
    host, me = socket.gethostname(), os.getpid()
    start = dirlock.process_start(me)
    assert start is not None and start > 0
    rec = {"host": host, "pid": me, "command": "training", "since": 1.0}
    note = _stale(tmp_path, {**rec, "start": start})
    assert note.endswith(f"pid {me} since 1970-01-01 00:00:01 UTC), which is still running but "
                         "no longer holds it"), note  # fmt: skip
    assert "gone" not in note
    note = _stale(tmp_path, {**rec, "start": start + 1})
    assert note.endswith(f"which is gone (pid {me} is now another process)"), note
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert _stale(tmp_path, {**rec, "pid": dead.pid, "start": 5}).endswith(", which is gone")
    assert _stale(tmp_path, {**rec, "host": host + "-x"}).endswith(", which no longer holds it")
    assert _stale(tmp_path, rec).endswith(", which no longer holds it")  # no start recorded
    # the record a holder writes carries its start time and boot
    lk = dirlock.run_dir_lock(str(tmp_path / "r2"), "logging.dir", "training").acquire()
    try:
        held = dirlock.read_holder(lk.path)
        assert held["pid"] == me and held["start"] == start and held["boot"]
        assert dirlock.holder_state(held) == "alive"
    finally:
        lk.release()


@pytest.mark.parametrize("shared", [False, True])
def test_ctrl_c_while_the_record_is_written_leaves_no_lock_file(tmp_path, monkeypatch, shared):
    """A KeyboardInterrupt inside acquire once the lock is held (here: while the holder record
    is made) releases it: no lock file and no directory acquire made are left (a command's
    ``with`` never reaches ``__exit__`` when ``__enter__`` raises). The lock then works."""

    def interrupted() -> str:
        raise KeyboardInterrupt

    out = tmp_path / "new" / "out"
    lock = dirlock.output_lock(str(out), "probe", shared=shared)
    monkeypatch.setattr(dirlock, "_boot_id", interrupted)
    with pytest.raises(KeyboardInterrupt):
        lock.acquire()
    assert lock.fd is None and sorted(os.listdir(tmp_path)) == []
    monkeypatch.undo()
    with dirlock.output_lock(str(out), "probe", shared=shared):
        assert os.listdir(tmp_path / "new") == [".out.lock"]
    assert sorted(os.listdir(tmp_path)) == []
