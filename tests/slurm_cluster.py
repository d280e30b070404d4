"""A real single-node SLURM cluster (munge + slurmctld + slurmd on loopback) for the tests.

Facts behind the steps: /work/shared/notes/local-slurm-cluster.md. Needs root and Debian's
``slurm-wlm munge openmpi-bin libopenmpi-dev`` (installed in one apt step by scripts/test.sh).
Where either is missing the fixture skips with the reason, unless LINFORMER_DS_REQUIRE_SLURM=1,
which turns the skip into a failure (for CI).

Use from a test module (tests/ on sys.path)::

    @pytest.fixture(scope="module")
    def cluster():
        yield from slurm_cluster.running_cluster()
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

CONF_MARKER = "# written by linformer_ds tests/slurm_cluster.py"
SLURM_CONF = Path("/etc/slurm/slurm.conf")
CTLD_PID = Path("/run/slurmctld.pid")
SLURMD_PID = Path("/run/slurmd.pid")
MUNGE_PID = Path("/run/munge/munged.pid")
STATE_DIRS = (
    Path("/var/lib/slurm/slurmctld"),
    Path("/var/lib/slurm/slurmd"),
    Path("/var/log/slurm"),
)
FINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}


class SlurmUnavailable(RuntimeError):
    """This machine cannot run the local cluster; the message says why."""


def unavailable_reason() -> str | None:
    """Why the local cluster cannot run here, or None when it can."""
    if os.name != "posix" or os.geteuid() != 0:
        return "the local SLURM cluster needs root (slurmd runs jobs as root here)"
    for tool in ("slurmctld", "slurmd", "munged", "sbatch", "scontrol", "sinfo"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            return (
                f"{tool} is not installed; install Debian's slurm-wlm munge openmpi-bin "
                "libopenmpi-dev in one apt step (scripts/test.sh does this when root)"
            )
    return None


def _pid_alive(pid_file: Path) -> int | None:
    """The pid in ``pid_file`` when that process is alive, else None."""
    try:
        pid = int(pid_file.read_text().split()[0])
        os.kill(pid, 0)
    except (OSError, ValueError, IndexError):
        return None
    return pid


def _stop_pid(pid: int, timeout: float = 15.0) -> None:
    """TERM one process we started, wait for it to exit, then KILL it."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def node_line() -> str:
    """The slurm.conf NodeName line for this machine, from ``slurmd -C``, on 127.0.0.1."""
    out = _run(["slurmd", "-C"], check=True).stdout.splitlines()[0]
    fields = dict(kv.split("=", 1) for kv in out.split())
    keep = ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore")
    parts = [f"NodeName={fields['NodeName']}", "NodeAddr=127.0.0.1"]
    parts += [f"{k}={fields[k]}" for k in keep if k in fields]
    parts += ["RealMemory=1000", "State=UNKNOWN"]
    return " ".join(parts)


def slurm_conf_text(host: str, node: str) -> str:
    """The slurm.conf of the notes, for controller ``host`` and node line ``node``."""
    return f"""{CONF_MARKER}
ClusterName=ci
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
# A requeued job waits cred_expire seconds before it may start again (default 120).
AuthInfo=cred_expire=5
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
# Schedule every second (defaults: 30 s backfill, 60 s main) so a requeued job restarts quickly.
SchedulerParameters=bf_interval=1,sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
EnforcePartLimits=ALL
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldPidFile={CTLD_PID}
SlurmdPidFile={SLURMD_PID}
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
{node}
PartitionName=ci Nodes=ALL Default=YES MaxTime=60 State=UP
"""


@dataclass
class JobInfo:
    """One ``scontrol show job -o`` record."""

    job_id: int
    fields: dict[str, str]

    @property
    def state(self) -> str:
        return self.fields.get("JobState", "")

    @property
    def exit_code(self) -> str:
        return self.fields.get("ExitCode", "")

    @property
    def restarts(self) -> int:
        return int(self.fields.get("Restarts", "0"))


@dataclass
class LocalSlurmCluster:
    """Start and stop munged, slurmctld and slurmd; submit and watch jobs."""

    started: list[int] = field(default_factory=list)  # pids of the daemons this object started
    partition: str = "ci"

    # ------------------------------------------------------------------ daemons
    def start(self, timeout: float = 60.0) -> None:
        """Bring the cluster up (reusing daemons that already run) until the node is idle."""
        reason = unavailable_reason()
        if reason:
            raise SlurmUnavailable(reason)
        self._start_munge()
        if _pid_alive(CTLD_PID) is None:
            if SLURM_CONF.exists() and CONF_MARKER not in SLURM_CONF.read_text():
                raise SlurmUnavailable(
                    f"{SLURM_CONF} exists and was not written by these tests; refusing to "
                    "replace a real cluster's configuration"
                )
            SLURM_CONF.parent.mkdir(parents=True, exist_ok=True)
            host = _run(["hostname", "-s"], check=True).stdout.strip()
            SLURM_CONF.write_text(slurm_conf_text(host, node_line()))
            for d in STATE_DIRS:
                d.mkdir(parents=True, exist_ok=True)
            _run(["slurmctld", "-c"], check=True)
            self._remember(CTLD_PID)
        if _pid_alive(SLURMD_PID) is None:
            _run(["slurmd"], check=True)
            self._remember(SLURMD_PID)
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = _run(["sinfo", "-h", "-o", "%T"]).stdout.strip()
            if state in ("idle", "mixed", "allocated"):
                return
            if state.startswith("down") or state.startswith("drain"):
                host = _run(["hostname", "-s"]).stdout.strip()
                _run(["scontrol", "update", f"nodename={host}", "state=resume"])
            time.sleep(0.3)
        raise RuntimeError(f"SLURM node not idle after {timeout:.0f} s (sinfo says {state!r})")

    def _start_munge(self) -> None:
        if _run(["bash", "-c", "munge -n | unmunge"]).returncode == 0:
            return
        run_dir = Path("/run/munge")
        run_dir.mkdir(parents=True, exist_ok=True)
        shutil.chown(run_dir, "munge", "munge")
        key = Path("/etc/munge/munge.key")
        if not key.exists():
            key.parent.mkdir(parents=True, exist_ok=True)
            key.write_bytes(secrets.token_bytes(1024))
            shutil.chown(key, "munge", "munge")
            key.chmod(0o400)
        _run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], check=True)
        self._remember(MUNGE_PID)

    def _remember(self, pid_file: Path) -> None:
        for _ in range(50):
            pid = _pid_alive(pid_file)
            if pid is not None:
                self.started.append(pid)
                return
            time.sleep(0.1)
        raise RuntimeError(f"daemon did not write {pid_file}")

    def stop(self) -> None:
        """Cancel the jobs and stop the daemons this object started (newest first)."""
        if self.started:
            _run(["scancel", "--partition", self.partition])
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and _run(["squeue", "-h"]).stdout.strip():
                time.sleep(0.3)
        for pid in reversed(self.started):
            _stop_pid(pid)
        self.started.clear()

    # --------------------------------------------------------------------- jobs
    def sbatch(self, args: list[str], env: dict[str, str] | None = None, cwd=None) -> int:
        """Submit a batch job; return its id."""
        proc = _run(["sbatch", "--parsable", *args], env=env, cwd=cwd)
        if proc.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)} failed: {proc.stderr.strip()}")
        return int(proc.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> JobInfo:
        """The job's current record (state, exit code, restarts, ...)."""
        out = _run(["scontrol", "show", "job", "-o", str(job_id)]).stdout.strip()
        fields = dict(re.findall(r"(\w+)=(\S*)", out))
        return JobInfo(job_id, fields)

    def wait(self, job_id: int, timeout: float, until=None) -> JobInfo:
        """Poll the job until ``until(info)`` (default: a final state); scancel on timeout."""
        until = until or (lambda info: info.state in FINAL_STATES)
        deadline = time.monotonic() + timeout
        info = self.job(job_id)
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if until(info):
                return info
            time.sleep(0.5)
        _run(["scancel", str(job_id)])
        raise TimeoutError(f"job {job_id} still {info.state} after {timeout:.0f} s: {info.fields}")


def running_cluster() -> Iterator[LocalSlurmCluster]:
    """Fixture body: a running local cluster, stopped afterwards; skips where it cannot run."""
    reason = unavailable_reason()
    if reason:
        if os.environ.get("LINFORMER_DS_REQUIRE_SLURM") == "1":
            pytest.fail(f"LINFORMER_DS_REQUIRE_SLURM=1 but {reason}")
        pytest.skip(reason)
    cluster = LocalSlurmCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
