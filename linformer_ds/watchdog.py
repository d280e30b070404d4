"""The start-up watchdog: what keeps a rank from waiting forever while it starts (a signal ends
start-up at once, exit 75) and whenever its launcher is gone (the rank stops, exit 143 if it
does not within the grace time). Started by the command line's process
(:func:`linformer_ds.train.start_process`), never by the Trainer, which only names its start-up
phases (:class:`StartUpPhases`); docs/reliability.md says what each case prints.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable

from linformer_ds.dist_env import DEFAULT_INIT_TIMEOUT_S
from linformer_ds.log import get_logger

log = get_logger(__name__)


# ------------------------------------------------------------------------------- the launcher
def _proc_cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _proc_parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def launcher_pids() -> list[int]:
    """The processes whose death means this rank must leave: the parent (the launcher, srun's
    step daemon, mpirun's daemon) and, under the deepspeed launcher, its runner too (SIGTERM to
    ``deepspeed`` ends the runner but not its ``deepspeed.launcher.launch`` child)."""
    parent = os.getppid()
    pids = [parent] if parent > 1 else []
    if parent > 1 and "deepspeed.launcher.launch" in _proc_cmdline(parent):
        grand = _proc_parent(parent)
        if grand > 1:
            pids.append(grand)
    return pids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie has exited
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)  # end start-up at once
# the trainer's start-up phases after the first (named in the one line; debug.pause_at)
START_UP_PHASES = ("data loading", "process-group init", "engine build", "checkpoint load")


class StartUpPhases:
    """Where a Trainer's start-up is (:meth:`set_phase`), until :meth:`training_started`; what a
    Trainer built in a caller's process gets (no thread, no signal: ``Trainer``'s quiet
    ``Process``). :class:`Watchdog` adds the thread that acts on them."""

    def __init__(self, phase: str = "start-up") -> None:
        self.phase: str | None = phase
        self.on_leave: Callable[[], None] | None = None  # run before the watchdog ends the process
        self.pause_at: str | None = None

    def set_phase(self, phase: str) -> None:
        """Name what start-up is doing now (shown if a signal ends it). TEST HOOK: at the phase
        ``pause_at`` (job config ``debug.pause_at``) start-up holds (one line) until a signal."""
        self.phase = phase
        if phase == self.pause_at:
            log.info(f"[debug] start-up paused at {phase} (debug.pause_at)")
            time.sleep(3600)

    def training_started(self) -> None:
        """From now on a signal is the trainer's business (checkpoint at the next step)."""
        self.phase = None


class Watchdog(StartUpPhases):
    """A daemon thread that keeps a rank from waiting forever.

    - Start-up (from construction until :meth:`training_started`): SIGTERM/SIGUSR1/SIGINT end
      the process at once (exit 75, one line), also while the main thread is blocked inside a
      rendezvous or builds indices: no optimizer step has run, so the last checkpoint is
      current. A signal recorded before the watchdog started (``pending`` of
      :func:`start_watchdog`) ends it the same way as soon as it starts. ``on_leave`` runs
      first (the trainer releases its directory locks).
    - Always, when ``watch_launcher``: if the launcher process exits (see :func:`launcher_pids`),
      the rank sends itself SIGTERM (the trainer checkpoints at the next step and exits 75) and
      leaves with exit 143 if it is still running ``grace_s`` seconds later.

    Signals reach the thread through ``signal.set_wakeup_fd`` (written by the C-level handler,
    so it works while the main thread is inside a C++ call); the Python handlers still run.
    """

    def __init__(self, exit_code: int = 75, watch_launcher: bool = True, grace_s: float = 300.0,
                 poll_s: float = 1.0, phase: str = "start-up") -> None:  # fmt: skip

        super().__init__(phase)
        self.exit_code, self.grace_s, self.poll_s = exit_code, float(grace_s), poll_s
        self.launchers = launcher_pids() if watch_launcher else []
        self._read, write = os.pipe()
        os.set_blocking(write, False)
        self._write = write
        self._previous_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._run, name="linformer-watchdog", daemon=True)
        self._thread.start()

    def disarm(self) -> None:
        """Neither a signal nor the launcher is this watchdog's business until it is re-armed
        (:func:`start_watchdog`): the run returned to a caller that keeps the process."""
        self.phase = self.on_leave = None
        self.launchers = []

    def stop_for(self, signum: int, when: str) -> None:
        """End start-up on ``signum`` (exit ``exit_code``, one line); ``when``: the phase."""
        where = "" if when == "start-up" else f" ({when})"
        self._leave(
            f"{signal.Signals(signum).name} during start-up{where}: stopped before the first "
            "step (the last checkpoint is current)",
            self.exit_code,
        )

    def _leave(self, message: str, code: int) -> None:
        rank = os.environ.get("RANK", "?")
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        if self.on_leave is not None:
            try:
                self.on_leave()
            except Exception:  # noqa: BLE001 (leaving anyway: the kernel drops the flocks)
                pass
        os.write(2, f"error: rank {rank}: {message}\n".encode())
        os._exit(code)

    def _run(self) -> None:

        orphaned_at: float | None = None
        while True:
            ready, _, _ = select.select([self._read], [], [], self.poll_s)
            if ready:
                for signum in os.read(self._read, 64):
                    phase = self.phase
                    if signum in STOP_SIGNALS and phase is not None:
                        self.stop_for(signum, phase)
            if not self.launchers:  # disarmed: a countdown from before is off
                orphaned_at = None
            elif orphaned_at is None:
                dead = [pid for pid in self.launchers if not _alive(pid)]
                if dead:
                    orphaned_at = time.monotonic()
                    os.write(2, f"[warn] the launcher (pid {dead[0]}) exited: stopping\n".encode())
                    os.kill(os.getpid(), signal.SIGTERM)
            if orphaned_at is not None and time.monotonic() - orphaned_at > self.grace_s:
                self._leave(
                    f"the launcher exited and this rank did not stop within {self.grace_s:g} s",
                    143,
                )


_WATCHDOG: Watchdog | None = None


def start_watchdog(exit_code: int = 75, watch_launcher: bool = True,
                   grace_s: float = DEFAULT_INIT_TIMEOUT_S,
                   pending: Callable[[], int | None] | None = None) -> Watchdog:  # fmt: skip
    """The process's one :class:`Watchdog`, (re)armed for start-up. Call from the main thread.

    ``pending()``: a stop signal the trainer's handler recorded before, read once the watchdog
    listens: start-up then ends at once (no step would run: under SLURM another rank may be
    gone already, and a rank kept for a step-1 checkpoint waited for the cluster's KillWait)."""
    global _WATCHDOG
    if hasattr(signal, "SIGXFSZ"):  # a write past `ulimit -f` fails (EFBIG), not kills the rank
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if _WATCHDOG is None:
        _WATCHDOG = Watchdog(exit_code, watch_launcher, grace_s)
    else:
        _WATCHDOG.exit_code, _WATCHDOG.grace_s = exit_code, float(grace_s)
        _WATCHDOG.launchers = launcher_pids() if watch_launcher else []
        _WATCHDOG.on_leave = _WATCHDOG.pause_at = None
        _WATCHDOG.set_phase("start-up")
    signum = pending() if pending is not None else None  # after set_wakeup_fd: no gap
    if signum in STOP_SIGNALS:
        _WATCHDOG.stop_for(signum, "received before it began")
    return _WATCHDOG


def disarm_watchdog() -> None:
    """Disarm the process's watchdog, if it has one (:meth:`Watchdog.disarm`)."""
    if _WATCHDOG is not None:
        _WATCHDOG.disarm()
