"""Issue 30 item 3: a stop signal during start-up ends it at once (exit 75, one line).

Before the first step (process-group init, data loading, engine build, checkpoint load) a
SIGTERM, SIGINT or SIGUSR1 ends the trainer at once: one ``error:`` line naming the signal and
the phase, exit 75, no checkpoint written, no file of the run directory changed (config.json and
metrics.jsonl as before, no lock file left). A signal before the trainer's start (launch/pretrain.py
handles them from its first line, while torch is imported) ends the process the same way at once:
it was kept for a step-1 checkpoint, and under SLURM, with another rank gone, the rank waited for
the cluster's KillWait. The phases are held open by the test hook ``debug.pause_at=<phase>``
(linformer_ds.watchdog.StartUpPhases.set_phase), so no case depends on the machine's speed; the
deadlines are generous.
"""

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from linformer_ds.dirlock import LOCK_NAME
from linformer_ds.watchdog import START_UP_PHASES
from tests.pretrain_utils import (
    PRETRAIN,
    REPO,
    TEST_OVERRIDES,
    TINY_CONFIG,
    child_env,
    run_pretrain,
)

DEADLINE_S = 60.0  # from the signal to the exit; measured well under 5 s (see the prints)


def tree(root: Path) -> dict:
    """{relative path: (sha256, size, mtime_ns)} of every file below ``root`` (None for a
    directory: a lock file or a writability probe, made and removed, changes its mtime)."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath, name)
            if p.is_file():
                st = p.stat()
                digest = hashlib.sha256(p.read_bytes()).hexdigest()
                out[str(p.relative_to(root))] = (digest, st.st_size, st.st_mtime_ns)
            else:
                out[str(p.relative_to(root))] = None
    return out


def assert_unchanged_but_created(before: dict, after: dict) -> list:
    """Every path of ``before`` is in ``after``, byte-identical (and same mtime); returns the
    paths the command created."""
    changed = [p for p, v in before.items() if after.get(p, "gone") != v]
    assert changed == [], changed
    return sorted(set(after) - set(before))


def catches(pid: int, signum: int) -> bool:
    """The process has a handler installed for ``signum`` (SigCgt in /proc/PID/status)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(int(ln.split()[1], 16) for ln in f if ln.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(caught >> (signum - 1) & 1)


@pytest.fixture(scope="module")
def trained(tiny_corpus, tmp_path_factory) -> Path:
    """A 1-rank run of 2 steps with its final checkpoint (the run directory the cases resume)."""
    run = tmp_path_factory.mktemp("startup") / "run"
    run_pretrain(tiny_corpus, run, ["train.max_steps=2"], nproc=1, launcher="python")
    assert (run / "checkpoints" / "step_00000002" / "COMPLETE").is_file()
    return run


def interrupt(data: Path, run: Path, signum: int, at: str, log: Path) -> tuple:
    """Resume ``run`` (to step 4) and send ``signum`` at start-up point ``at`` (a phase, or
    "launch": as soon as launch/pretrain.py's handler is in place); returns (exit code,
    stdout, stderr, seconds from the signal to the exit)."""
    cmd = [sys.executable, PRETRAIN, "--config", TINY_CONFIG, *TEST_OVERRIDES,
           f"data.path={data}", f"logging.dir={run}", "train.max_steps=4"]  # fmt: skip
    if at != "launch":
        cmd.append(f"debug.pause_at={at}")
    out, err = log.with_suffix(".out"), log.with_suffix(".err")
    with open(out, "w") as fo, open(err, "w") as fe:
        proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=fo, stderr=fe)
    try:
        deadline = time.monotonic() + 300
        if at == "launch":
            while not catches(proc.pid, signal.SIGUSR1):  # the last of the three handlers
                assert proc.poll() is None and time.monotonic() < deadline, err.read_text()
                time.sleep(0.005)
        else:
            while f"[debug] start-up paused at {at} " not in out.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, err.read_text()
                time.sleep(0.1)
        t0 = time.monotonic()
        proc.send_signal(signum)
        rc = proc.wait(timeout=DEADLINE_S + 60)
        took = time.monotonic() - t0
    finally:
        proc.kill()
        proc.wait()
    return rc, out.read_text(), err.read_text(), took


CASES = [
    (signal.SIGTERM, "launch"),
    (signal.SIGINT, "launch"),
    (signal.SIGTERM, "data loading"),
    (signal.SIGINT, "process-group init"),
    (signal.SIGUSR1, "engine build"),
    (signal.SIGINT, "checkpoint load"),
]


def test_cases_cover_every_start_up_phase():
    assert sorted({at for _, at in CASES} - {"launch"}) == sorted(START_UP_PHASES)


@pytest.mark.slow  # six trainer start-ups (one rank each): out of the quick tier, in CI
@pytest.mark.parametrize("signum,at", CASES, ids=[f"{s.name}-{a}" for s, a in CASES])
def test_signal_during_start_up_ends_it_at_once(tiny_corpus, trained, tmp_path, signum, at):
    run = tmp_path / "run"
    shutil.copytree(trained, run)  # copy2: contents and mtimes as the module's run left them
    before = tree(run)
    rc, out, err, took = interrupt(tiny_corpus, run, signum, at, tmp_path / "trainer")
    assert rc == 75, out[-2000:] + err[-3000:]
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in err, err[-3000:]
    errors = [ln for ln in err.splitlines() if ln.startswith("error")]
    assert len(errors) == 1, err[-3000:]
    name = signal.Signals(signum).name
    phase = "received before it began" if at == "launch" else at
    if at == "launch":  # measured: before torch is imported; a phase name if it came later
        assert errors[0].startswith(f"error: rank 0: {name} during start-up ("), errors[0]
    else:
        assert errors[0].startswith(f"error: rank 0: {name} during start-up ({phase}): "), errors
    assert errors[0].endswith("stopped before the first step (the last checkpoint is current)")
    assert took < DEADLINE_S, took
    assert "[checkpoint]" not in out and "[train]" not in out
    created = assert_unchanged_but_created(before, tree(run))
    assert LOCK_NAME not in " ".join(created) and "step_00000003" not in " ".join(created)
    assert sorted(p.name for p in tmp_path.glob(".*")) == [], "a lock left beside the run"
    print(
        f"{name} at {at}: exit 75 after {took:.2f} s ({errors[0].split('(')[1].split(')')[0]});"
        f" created {created}"
    )


def test_signal_pending_when_the_watchdog_starts_ends_at_once(tmp_path):
    """start_watchdog with a signal already recorded: exit 75 and the one line at once, also
    with the launcher watch off (a single process)."""
    code = (
        "import signal, time\n"
        "from linformer_ds.watchdog import start_watchdog\n"
        "start_watchdog(75, False, 600.0, pending=lambda: signal.SIGTERM)\n"
        "print('not stopped', flush=True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=child_env(RANK="3"),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 75, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "error: rank 3: SIGTERM during start-up (received before it began): stopped before the "
        "first step (the last checkpoint is current)"
    ], proc.stderr


def test_a_disarmed_watchdog_drops_the_orphan_countdown(tmp_path):
    """The launcher exits: the watchdog sends the rank SIGTERM and counts ``grace_s`` down to
    exit 143. Disarmed (the run returned to a caller that keeps the process), the countdown is
    off: the process lives on, and a launcher that exits later is not watched either."""
    code = (
        "import signal, subprocess, sys, time\n"
        "from linformer_ds.watchdog import start_watchdog\n"
        "got = []\n"
        "signal.signal(signal.SIGTERM, lambda s, f: got.append(s))\n"
        "launcher = subprocess.Popen([sys.executable, '-c', 'pass'])\n"
        "w = start_watchdog(75, False, 1.0)\n"
        "w.training_started()  # a signal is the trainer's now\n"
        "w.launchers = [launcher.pid]\n"
        "deadline = time.monotonic() + 60\n"
        "while not got and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
        "print('sigterm', got == [signal.SIGTERM], flush=True)\n"
        "w.disarm()\n"
        "time.sleep(3.0)  # three grace periods and many polls\n"
        "print('alive', flush=True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.split() == ["sigterm", "True", "alive"], proc.stdout + proc.stderr
    assert "the launcher (pid" in proc.stderr and "did not stop" not in proc.stderr, proc.stderr


def test_a_trainer_in_the_callers_process_leaves_its_signal_handling(tiny_corpus, tmp_path,
                                                                      _clean_env):  # fmt: skip
    """A Trainer built and run without the command line's process side (a notebook, a test):
    every signal handler, the wakeup fd and the process's watchdog are as they were, during
    the run and after (linformer_ds/trainer.py installs none; linformer_ds/train.py does)."""
    import threading

    from linformer_ds import watchdog
    from linformer_ds.config import load_config
    from linformer_ds.trainer import Trainer

    def process_state() -> tuple:
        handlers = {s: signal.getsignal(s) for s in signal.valid_signals()}
        fd = signal.set_wakeup_fd(-1)
        signal.set_wakeup_fd(fd)
        armed = watchdog._WATCHDOG is not None and watchdog._WATCHDOG.phase is not None
        return handlers, fd, watchdog._WATCHDOG, armed

    threads = {t.ident for t in threading.enumerate()}
    before = process_state()
    cfg = load_config(TINY_CONFIG, [*TEST_OVERRIDES, f"data.path={tiny_corpus}",
                                    f"logging.dir={tmp_path / 'run'}", "train.max_steps=2",
                                    "deepspeed.precision=fp32"])  # fmt: skip
    trainer = Trainer(cfg)
    try:
        assert process_state() == before
        assert type(trainer.watchdog) is watchdog.StartUpPhases  # phases named, nothing acts
        assert trainer.train() == 0
    finally:
        trainer.close()
    assert process_state() == before
    started = [t.name for t in threading.enumerate() if t.ident not in threads]
    assert "linformer-watchdog" not in started, started
