"""How many threads a rank computes with, and how its OpenMP threads wait between parallel
regions, decided from the CPUs the rank actually has (docs/performance.md).

A rank's CPUs: the CPUs it may run on (``os.sched_getaffinity``), capped by the cgroup's CPU
quota (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us / cpu.cfs_period_us``), shared by the ranks
of the job on this node (``LOCAL_WORLD_SIZE``, ``LOCAL_SIZE``, Open MPI / MPICH / SLURM
variables) unless the rank is bound to CPUs of its own (its affinity narrower than the
cgroup's cpuset). ``train.threads: auto`` is ``OMP_NUM_THREADS`` where it is set, else the
whole CPUs of that share (at least 1).

The wait policy: ``passive`` threads sleep at once when a region ends; ``active`` ones spin;
unset, GNU OpenMP (torch's runtime on Linux) spins a while, then sleeps. When the CPUs are
shared (another rank, another job, a cgroup quota), a spinning thread burns the time its
busy partner needs. ``train.omp_wait_policy: auto`` is passive when the rank's CPUs are
shared or oversubscribed (a fractional share, a quota, a load average that leaves fewer idle
CPUs than the job's threads) and OpenMP's own default otherwise.

GNU OpenMP reads ``OMP_WAIT_POLICY`` once, when the library loads (at ``import torch``): a
later change of the environment has no effect. So :func:`prepare_openmp` runs in
``launch/pretrain.py`` before torch is imported and sets the variable for ``auto``; a policy
the job config names explicitly restarts the rank once with the variable set
(:func:`wait_policy_restart`). This module does not import torch.
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from linformer_ds.log import get_logger

log = get_logger(__name__)

WAIT_POLICIES = ("active", "passive")
WAIT_VAR = "OMP_WAIT_POLICY"
# why the policy in effect was chosen (set with it before torch loads; read by the trainer)
WAIT_REASON_VAR = "LINFORMER_DS_OMP_WAIT_REASON"
RESTARTED_VAR = "LINFORMER_DS_OMP_RESTARTED"  # a rank restarted for its wait policy: once only
CGROUP_ROOT = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"
MAX_THREADS = 4096


# ================================================================================ the CPUs
def parse_cpu_list(text: str) -> int:
    """CPUs in a kernel CPU list such as ``0-3,8,10-11`` (12 -> 1; empty -> 0)."""
    count = 0
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        count += int(hi) - int(lo) + 1 if hi else 1
    return count


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _cgroup_paths(proc_cgroup: str) -> dict[str, str]:
    """Controller -> this process's cgroup path, from /proc/self/cgroup (``""``: cgroup v2)."""
    out: dict[str, str] = {}
    for line in (_read(proc_cgroup) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        for c in controllers.split(",") if controllers else [""]:
            out.setdefault(c, path)
    return out


def _ancestors(mount: str, path: str) -> list[str]:
    """The cgroup directories from this process's own up to the mount's root (a container that
    sees its own cgroup at the root has the host's path in /proc/self/cgroup: the root then)."""
    dirs, parts = [], [p for p in path.split("/") if p]
    while parts:
        dirs.append(os.path.join(mount, *parts))
        parts.pop()
    return dirs + [mount]


def _v2_quota(text: str) -> float | None:
    quota, _, period = text.partition(" ")
    if quota == "max" or not period:
        return None
    return int(quota) / int(period)


@dataclass(frozen=True)
class CgroupCpus:
    """The cgroup's CPU limits: ``quota`` (CPUs' worth of time per period; None: none) and
    ``cpuset`` (CPUs of its cpuset; None: not known)."""

    quota: float | None = None
    cpuset: int | None = None


def cgroup_cpus(root: str = CGROUP_ROOT, proc_cgroup: str = PROC_CGROUP) -> CgroupCpus:
    """This process's cgroup CPU limits (v2 or v1; the tightest quota on the way up to the
    root). Unreadable or malformed files count as no limit."""
    paths = _cgroup_paths(proc_cgroup)
    quotas: list[float] = []
    cpuset: int | None = None
    try:
        if os.path.isfile(os.path.join(root, "cgroup.controllers")):  # cgroup v2 (unified)
            for d in _ancestors(root, paths.get("", "/")):
                text = _read(os.path.join(d, "cpu.max"))
                q = _v2_quota(text) if text else None
                if q is not None:
                    quotas.append(q)
                if cpuset is None:
                    cpus = _read(os.path.join(d, "cpuset.cpus.effective"))
                    cpuset = parse_cpu_list(cpus) if cpus else None
        else:  # cgroup v1: cpu (or cpu,cpuacct) and cpuset hierarchies
            for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
                base = os.path.join(root, mount)
                if not os.path.isdir(base):
                    continue
                for d in _ancestors(base, paths.get("cpu", "/")):
                    q_text = _read(os.path.join(d, "cpu.cfs_quota_us"))
                    p_text = _read(os.path.join(d, "cpu.cfs_period_us"))
                    if q_text and p_text and int(q_text) > 0 and int(p_text) > 0:
                        quotas.append(int(q_text) / int(p_text))
                break
            base = os.path.join(root, "cpuset")
            for d in _ancestors(base, paths.get("cpuset", "/")):
                for name in ("cpuset.effective_cpus", "cpuset.cpus"):
                    cpus = _read(os.path.join(d, name))
                    if cpus and cpuset is None:
                        cpuset = parse_cpu_list(cpus)
    except ValueError:  # a malformed number: no limit known
        pass
    return CgroupCpus(min(quotas) if quotas else None, cpuset or None)


def _tasks_per_node(text: str, node: int) -> int | None:
    """SLURM's ``2(x3),1`` (tasks on each node of the step) at node index ``node``."""
    counts: list[int] = []
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if m is None:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[node] if 0 <= node < len(counts) else None


# (variable, launcher) in the order dist_env discovers launchers: the deepspeed launcher and
# torchrun set RANK; mpirun inside an sbatch job also inherits SLURM's variables
LOCAL_SIZE_VARS = (
    ("LOCAL_WORLD_SIZE", "torchrun"),
    ("LOCAL_SIZE", "deepspeed"),
    ("OMPI_COMM_WORLD_LOCAL_SIZE", "Open MPI"),
    ("MPI_LOCALNRANKS", "MPICH"),
    ("PMI_LOCAL_SIZE", "PMI"),
)


def local_ranks(env: MutableMapping[str, str]) -> tuple[int, str]:
    """Ranks of this job on this node and the variable that says so (``1, ""``: none does)."""
    for name, _ in LOCAL_SIZE_VARS:
        value = env.get(name, "").strip()
        if value.isdigit() and int(value) >= 1:
            return int(value), name
    if env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", "")) != "":
        node = env.get("SLURM_NODEID", "0")
        for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
            n = _tasks_per_node(env.get(name, ""), int(node) if node.isdigit() else 0)
            if n:
                return n, name
    return 1, ""


@dataclass(frozen=True)
class CpuShare:
    """What one rank has: ``affinity`` CPUs it may run on, the cgroup's limits, the node's
    ``local`` ranks (``local_from``: the variable), the machine's CPUs and load average."""

    affinity: int
    cgroup: CgroupCpus
    local: int
    local_from: str
    machine_cpus: int
    load: float | None

    @property
    def bound(self) -> bool:
        """The rank runs on CPUs of its own: its affinity is narrower than the cgroup's cpuset
        (srun --cpu-bind, mpirun --bind-to, numactl). Else every local rank shares them."""
        return self.cgroup.cpuset is not None and self.affinity < self.cgroup.cpuset

    @property
    def cpus(self) -> float:
        """CPUs of this rank: its affinity (or its share of the shared affinity), at most its
        share of the cgroup's quota."""
        cpus = float(self.affinity) if self.bound else self.affinity / self.local
        if self.cgroup.quota is not None:
            cpus = min(cpus, self.cgroup.quota / self.local)
        return cpus

    @property
    def threads(self) -> int:
        """Whole CPUs of this rank, at least 1."""
        return max(1, math.floor(self.cpus + 1e-9))

    def describe(self) -> str:
        quota = self.cgroup.quota
        parts = [f"affinity {self.affinity}" + (" (bound)" if self.bound else "")]
        parts.append(f"quota {quota:g}" if quota is not None else "no quota")
        ranks = f"{self.local} local ranks ({self.local_from})" if self.local_from else "1 rank"
        return f"{self.cpus:g} CPUs per rank: {', '.join(parts)}, {ranks}"

    def shared(self, threads: int) -> str | None:
        """Why this rank's ``threads`` would share CPUs (None: they have CPUs to themselves)."""
        if self.cpus < threads:
            return f"{threads} threads on {self.cpus:g} CPUs"
        reachable = self.affinity * (self.local if self.bound else 1)  # the ranks' CPUs
        if self.cgroup.quota is not None and self.cgroup.quota < reachable:
            return f"cgroup quota {self.cgroup.quota:g} CPUs < {reachable} CPUs"
        demand = threads * self.local
        if self.load is not None and self.load + demand > self.machine_cpus + 0.5:
            return f"load average {self.load:.1f} on {self.machine_cpus} CPUs"
        return None


def cpu_share(
    env: MutableMapping[str, str] | None = None,
    affinity: int | None = None,
    cgroup: CgroupCpus | None = None,
    machine_cpus: int | None = None,
    load: float | None = -1.0,
) -> CpuShare:
    """This rank's :class:`CpuShare`; each argument replaces what is read from the system
    (``load=None``: not known)."""
    env = os.environ if env is None else env
    if affinity is None:
        try:
            affinity = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            affinity = os.cpu_count() or 1
    if load == -1.0:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):
            load = None
    n, name = local_ranks(env)
    return CpuShare(
        affinity=max(1, affinity),
        cgroup=cgroup_cpus() if cgroup is None else cgroup,
        local=n,
        local_from=name,
        machine_cpus=machine_cpus or os.cpu_count() or affinity,
        load=load,
    )


# ============================================================================ the decisions
def env_threads(env: MutableMapping[str, str]) -> int | None:
    """``OMP_NUM_THREADS`` as a thread count (its first level), or None when unset or not one."""
    value = env.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(value) if value.isdigit() and int(value) >= 1 else None


def choose_threads(setting: Any, env: MutableMapping[str, str], share: CpuShare) -> tuple[int, str]:
    """``train.threads`` decided: the number and why (for the ``[setup]`` line)."""
    if setting != "auto":
        return int(setting), "train.threads"
    n = env_threads(env)
    if n is not None:
        return n, "auto: OMP_NUM_THREADS"
    return share.threads, f"auto: {share.describe()}"


def auto_wait_policy(share: CpuShare, threads: int) -> tuple[str | None, str]:
    """``auto``: ``passive`` when the threads would share CPUs, else None (OpenMP's default:
    spin a while, then sleep); and why."""
    why = share.shared(threads)
    return ("passive", why) if why else (None, "CPUs to itself")


def runtime_policy(env: MutableMapping[str, str]) -> str | None:
    """The wait policy the environment gives the OpenMP runtime (lower case; None: unset or
    not one of active/passive, OpenMP's default)."""
    value = env.get(WAIT_VAR, "").strip().lower()
    return value if value in WAIT_POLICIES else None


def prepare_openmp(env: MutableMapping[str, str] | None = None,
                   share: CpuShare | None = None) -> str:  # fmt: skip
    """Before torch loads: set ``OMP_WAIT_POLICY`` for ``auto`` unless the environment sets it
    (then it is the user's), and record why in ``LINFORMER_DS_OMP_WAIT_REASON``. Returns the
    reason. The job config is not read here (it needs torch): an explicit
    ``train.omp_wait_policy`` is applied by :func:`wait_policy_restart`."""
    env = os.environ if env is None else env
    if WAIT_VAR in env:
        recorded = env.get(WAIT_REASON_VAR, "")
        if recorded.startswith(env[WAIT_VAR].strip().lower() + " ("):
            return recorded  # set here by an earlier start of this rank (or its launcher)
        reason = f"{runtime_policy(env) or 'default'} ({WAIT_VAR}={env[WAIT_VAR]} at start)"
    else:
        share = share or cpu_share(env)
        threads = choose_threads("auto", env, share)[0]
        policy, why = auto_wait_policy(share, threads)
        if policy:
            env[WAIT_VAR] = policy.upper()
        reason = f"{policy or 'default'} (auto: {why})"
    env[WAIT_REASON_VAR] = reason
    return reason


@dataclass(frozen=True)
class ThreadPlan:
    """The rank's threads and wait policy, and why (``setup_text``: the ``[setup]`` words)."""

    threads: int
    threads_why: str
    wait: str  # active, passive or default
    wait_why: str
    warning: str | None = None

    def setup_text(self) -> str:
        return f"threads={self.threads} ({self.threads_why}) omp_wait={self.wait_why}"


def thread_plan(threads: Any, wait_policy: str, env: MutableMapping[str, str] | None = None,
                share: CpuShare | None = None) -> ThreadPlan:  # fmt: skip
    """What this rank runs with under ``train.threads`` / ``train.omp_wait_policy``. The wait
    policy is the one the OpenMP runtime started with (the environment at ``import torch``);
    an explicit setting it did not start with gets a ``warning`` (see
    :func:`wait_policy_restart`)."""
    env = os.environ if env is None else env
    share = share or cpu_share(env)
    n, why = choose_threads(threads, env, share)
    running = runtime_policy(env) or "default"
    reason = env.get(WAIT_REASON_VAR, "")
    if not reason.startswith(running + " ("):
        reason = f"{running} ({WAIT_VAR} {'unset' if running == 'default' else 'set'} at start)"
    warning = None
    if wait_policy != "auto":
        if wait_policy == running:
            reason = f"{running} (train.omp_wait_policy)"
        else:
            warning = (
                f"train.omp_wait_policy={wait_policy} is not in effect: the OpenMP runtime "
                f"started with {running} and reads {WAIT_VAR} only when torch loads; start the "
                f"rank with {WAIT_VAR}={wait_policy.upper()} (launch/pretrain.py restarts itself "
                "to do so)"
            )
    return ThreadPlan(n, why, running, reason, warning)


def wait_policy_restart(
    wait_policy: str,
    env: MutableMapping[str, str] | None = None,
    execv: Callable[[str, Sequence[str]], Any] | None = None,
    argv: Sequence[str] | None = None,
) -> bool:
    """An explicit ``train.omp_wait_policy`` the OpenMP runtime did not start with: restart this
    process (``os.execv``: the same pid, arguments and environment, ``OMP_WAIT_POLICY`` set), once.
    Call before anything starts (no process group, no files). Returns False when nothing is
    to do or a restart already happened (then :func:`thread_plan` warns)."""
    env = os.environ if env is None else env
    if wait_policy == "auto" or runtime_policy(env) == wait_policy or env.get(RESTARTED_VAR):
        return False
    env[WAIT_VAR] = wait_policy.upper()
    env[WAIT_REASON_VAR] = f"{wait_policy} (train.omp_wait_policy)"
    env[RESTARTED_VAR] = "1"
    args = list(argv if argv is not None else [sys.executable, *sys.orig_argv[1:]])
    log.info(f"[setup] train.omp_wait_policy={wait_policy}: restarting this rank with "
             f"{WAIT_VAR}={wait_policy.upper()} (OpenMP reads it only at start)")  # fmt: skip
    sys.stdout.flush()  # nothing buffered is lost to execv
    sys.stderr.flush()
    (execv or os.execv)(args[0], args)
    return True


def apply_threads(plan: ThreadPlan) -> None:
    """``torch.set_num_threads`` (takes effect at once, unlike the wait policy)."""
    import torch

    if torch.get_num_threads() != plan.threads:
        torch.set_num_threads(plan.threads)
