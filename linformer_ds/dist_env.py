"""Rank discovery for every launcher, before ``deepspeed.init_distributed``.

``deepspeed.init_distributed`` reads only RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT (and falls back to mpi4py, on port 29500, when one is missing). This module fills them
in from whichever launcher started the process, in this order of preference:

1. ``env``: the deepspeed launcher or torchrun already set RANK and WORLD_SIZE; kept as they are.
2. ``mpi``: ``mpirun`` (Open MPI's OMPI_COMM_WORLD_*, MPICH/Intel MPI's PMI_RANK/PMI_SIZE).
   Under ``mpirun`` inside an sbatch job every rank inherits SLURM_PROCID=0, so MPI comes first.
3. ``slurm``: a task of an ``srun`` step (SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID),
   also under ``srun --mpi=pmix``. The batch script itself (no SLURM_STEP_ID) is not a step.
4. ``single``: one process, rank 0 of 1, on 127.0.0.1 and a free port.

A variable that is already set is never overwritten. Also here: the process group's start
(:func:`init_process_group`, its deadline :data:`DEFAULT_INIT_TIMEOUT_S`) and DeepSpeed's CPU
shared-memory op switched off. What keeps a rank from waiting forever (signals during start-up,
the launcher's death) is :mod:`linformer_ds.watchdog`.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import socket
import subprocess
import zlib
from collections.abc import Mapping, MutableMapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from linformer_ds.errors import LinformerError

REQUIRED_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# What else a launcher sets to place a process in its job: torchrun's and the deepspeed
# launcher's other counts, and every variable of the launchers rank discovery reads.
LAUNCHER_VARS = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "GROUP_RANK",
                 "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME")  # fmt: skip
LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "TORCHELASTIC_")
# Set by a user or an administrator, not by a launcher: which cluster, running as root.
SETTINGS_VARS = ("SLURM_CONF", "OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")
PORT_BASE = 15000  # derived ports lie in [15000, 30000): below Linux's ephemeral range
PORT_SPAN = 15000
LOOPBACK = "127.0.0.1"
SLURM_SPECIAL_STEPS = 0xFFFFFFF0  # step ids from here up: batch, extern, interactive (no srun)


class DistEnvError(LinformerError, RuntimeError):
    """The launcher's environment is inconsistent or incomplete; the message names the variable."""


def is_launcher_var(name: str) -> bool:
    """Whether ``name`` places a process in a launched job (a rank, a size, a rendezvous, a
    launcher's job or step); the cluster and user settings in ``SETTINGS_VARS`` do not."""
    if name in SETTINGS_VARS:
        return False
    return name in REQUIRED_VARS or name in LAUNCHER_VARS or name.startswith(LAUNCHER_PREFIXES)


def without_launcher_vars(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` less every launcher variable (:func:`is_launcher_var`): the environment for a
    child process that starts a job of its own. A rank's child that inherited RANK=1 and
    WORLD_SIZE=2 (or an srun step's SLURM_PROCID) would wait for a rank 0 that never comes."""
    return {k: v for k, v in env.items() if not is_launcher_var(k)}


def clear_launcher_vars(env: MutableMapping[str, str]) -> None:
    """Remove every launcher variable (:func:`is_launcher_var`) from ``env`` in place (e.g.
    ``os.environ`` of a process that starts a job of its own)."""
    for name in [k for k in env if is_launcher_var(k)]:
        del env[name]


def _int_var(env: MutableMapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise DistEnvError(
            f"environment variable {name} must be an integer, got {value!r}"
        ) from None


def _first_int(env: MutableMapping[str, str], *names: str) -> int | None:
    """The integer value of the first of ``names`` that is set, or None."""
    for name in names:
        if env.get(name, "") != "":
            return _int_var(env, name)
    return None


def slurm_port(job_id: int, step_id: int = 0) -> int:
    """A port for one SLURM job step: 15000 + (job_id % 1000) * 15 + step_id % 15.

    1000 consecutive jobs, and up to 15 concurrent steps of each, get distinct ports.
    """
    return PORT_BASE + (job_id % 1000) * 15 + step_id % 15


def job_key_port(key: str) -> int:
    """A port in [15000, 30000) from an MPI job id (digits: modulo, other text: CRC32)."""
    number = int(key) if key.isdigit() else zlib.crc32(key.encode())
    return PORT_BASE + number % PORT_SPAN


def free_port() -> int:
    """A TCP port that is free on this host right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list, e.g. ``gpu[007-009,12],cpu1`` -> ``gpu007``.

    Uses ``scontrol show hostnames`` when it is installed, else expands the first entry here.
    """
    nodelist = nodelist.strip()
    if not nodelist:
        raise DistEnvError("the SLURM node list (SLURM_STEP_NODELIST/SLURM_JOB_NODELIST) is empty")
    if shutil.which("scontrol"):
        proc = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True
        )
        hosts = proc.stdout.split()
        if proc.returncode == 0 and hosts:
            return hosts[0]
    return _first_host_parse(nodelist)


def _first_host_parse(nodelist: str) -> str:
    """``first_host`` without scontrol: the prefix plus the first number of the first range."""
    m = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?", nodelist)
    if m is None or not m.group(0):
        raise DistEnvError(f"cannot parse the SLURM node list {nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    if ranges is None:
        return prefix
    first = re.split(r"[,-]", ranges)[0]
    if not first.isdigit():
        raise DistEnvError(f"cannot parse the SLURM node list {nodelist!r}")
    return prefix + first


def _check_ranks(launcher: str, rank: int, world: int, local: int) -> None:
    if world < 1:
        raise DistEnvError(f"{launcher}: world size must be >= 1, got {world}")
    if not 0 <= rank < world:
        raise DistEnvError(f"{launcher}: rank {rank} is outside [0, world size {world})")
    if local < 0:
        raise DistEnvError(f"{launcher}: local rank must be >= 0, got {local}")


def _mpi_bcast_master(port: int | None) -> tuple:
    """Rank 0's hostname and a port (given, or free on rank 0), broadcast with mpi4py."""
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise DistEnvError(
            "a multi-node mpirun launch needs mpi4py to find rank 0's host "
            "(pip install mpi4py), or set MASTER_ADDR and MASTER_PORT yourself"
        ) from e
    comm = MPI.COMM_WORLD
    payload = (socket.gethostname(), port or free_port()) if comm.Get_rank() == 0 else None
    host, port = comm.bcast(payload, root=0)
    return host, int(port)


def _discover_mpi(env: MutableMapping[str, str], default_port: int) -> dict[str, Any] | None:
    """Ranks from Open MPI or PMI (MPICH, Intel MPI) variables, or None when not under mpirun."""
    if "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env:
        rank = _int_var(env, "OMPI_COMM_WORLD_RANK")
        world = _int_var(env, "OMPI_COMM_WORLD_SIZE")
        local = _first_int(env, "OMPI_COMM_WORLD_LOCAL_RANK")
        local_size = _first_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
        job_key = env.get("OMPI_MCA_ess_base_jobid") or env.get("PMIX_NAMESPACE")
    elif "PMI_RANK" in env and "PMI_SIZE" in env:
        rank = _int_var(env, "PMI_RANK")
        world = _int_var(env, "PMI_SIZE")
        local = _first_int(env, "MPI_LOCALRANKID", "PMI_LOCAL_RANK")
        local_size = _first_int(env, "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE")
        job_key = env.get("PMI_KVSNAME") or env.get("PMI_JOBID")
    else:
        return None
    if local is None:
        raise DistEnvError(
            "mpirun: no local rank variable (OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID or "
            "PMI_LOCAL_RANK); set LOCAL_RANK yourself"
        )
    port = _first_int(env, "MASTER_PORT")
    single_node = local_size is not None and local_size == world
    if "MASTER_ADDR" in env:
        addr = env["MASTER_ADDR"]
    elif single_node:
        addr = LOOPBACK
    else:
        addr, port = _mpi_bcast_master(port)
    if port is None:
        port = job_key_port(job_key) if job_key else default_port
    return dict(rank=rank, world_size=world, local_rank=local, master_addr=addr, master_port=port)


def _discover_slurm(env: MutableMapping[str, str]) -> dict[str, Any] | None:
    """Ranks of a task of an ``srun`` step, or None outside a step."""
    step = _first_int(env, "SLURM_STEP_ID", "SLURM_STEPID")
    if step is None or step >= SLURM_SPECIAL_STEPS or "SLURM_PROCID" not in env:
        return None
    rank = _int_var(env, "SLURM_PROCID")
    world = _first_int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
    if world is None:
        raise DistEnvError("srun: SLURM_PROCID is set but SLURM_STEP_NUM_TASKS/SLURM_NTASKS is not")
    local = _first_int(env, "SLURM_LOCALID")
    if local is None:
        raise DistEnvError("srun: SLURM_PROCID is set but SLURM_LOCALID is not")
    nodes = _first_int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    if "MASTER_ADDR" in env:
        addr = env["MASTER_ADDR"]
    elif nodes == 1:
        addr = LOOPBACK
    else:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if not nodelist:
            nodelist = env.get("SLURM_NODELIST", "")
        addr = first_host(nodelist)
    port = _first_int(env, "MASTER_PORT")
    if port is None:
        job = _first_int(env, "SLURM_JOB_ID", "SLURM_JOBID")
        if job is None:
            raise DistEnvError("srun: SLURM_JOB_ID is not set; set MASTER_PORT yourself")
        port = slurm_port(job, step)
    return dict(rank=rank, world_size=world, local_rank=local, master_addr=addr, master_port=port)


def _discover_env(env: MutableMapping[str, str], default_port: int) -> dict[str, Any]:
    """RANK and WORLD_SIZE set by the deepspeed launcher or torchrun; fill in only what's missing."""
    rank = _int_var(env, "RANK")
    world = _int_var(env, "WORLD_SIZE")
    if "LOCAL_RANK" in env:
        local = _int_var(env, "LOCAL_RANK")
    elif world == 1:
        local = 0
    else:
        raise DistEnvError(
            f"RANK={rank} and WORLD_SIZE={world} are set but LOCAL_RANK is not; set LOCAL_RANK "
            "(the deepspeed launcher and torchrun set all three)"
        )
    if "MASTER_ADDR" in env:
        addr = env["MASTER_ADDR"]
    elif world == 1:
        addr = LOOPBACK
    else:
        raise DistEnvError(f"RANK and WORLD_SIZE={world} are set but MASTER_ADDR is not")
    port = _first_int(env, "MASTER_PORT")
    return dict(
        rank=rank,
        world_size=world,
        local_rank=local,
        master_addr=addr,
        master_port=default_port if port is None else port,
    )


def setup_distributed_env(
    default_port: int = 29500, environ: MutableMapping[str, str] | None = None
) -> dict[str, Any]:
    """Make sure RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT are set; say how.

    Returns ``{"launcher": "env"|"mpi"|"slurm"|"single", "rank", "world_size", "local_rank",
    "master_addr", "master_port", "set": [variables this call added]}``. ``default_port`` is
    used when the launcher gives no port and no job id to derive one from.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env or "WORLD_SIZE" in env:
        if not ("RANK" in env and "WORLD_SIZE" in env):
            missing = "WORLD_SIZE" if "RANK" in env else "RANK"
            raise DistEnvError(f"RANK and WORLD_SIZE must be set together; {missing} is missing")
        launcher, info = "env", _discover_env(env, default_port)
    else:
        info = _discover_mpi(env, default_port)
        launcher = "mpi"
        if info is None:
            info, launcher = _discover_slurm(env), "slurm"
        if info is None:
            port = _first_int(env, "MASTER_PORT")
            info = dict(
                rank=0,
                world_size=1,
                local_rank=0,
                master_addr=env.get("MASTER_ADDR", LOOPBACK),
                master_port=free_port() if port is None else port,
            )
            launcher = "single"
    _check_ranks(launcher, info["rank"], info["world_size"], info["local_rank"])
    if not 0 < info["master_port"] < 65536:
        raise DistEnvError(f"{launcher}: MASTER_PORT {info['master_port']} is not a TCP port")
    values = {
        "RANK": info["rank"],
        "WORLD_SIZE": info["world_size"],
        "LOCAL_RANK": info["local_rank"],
        "MASTER_ADDR": info["master_addr"],
        "MASTER_PORT": info["master_port"],
    }
    added = [name for name in values if name not in env]
    for name in added:
        env[name] = str(values[name])
    return {
        "launcher": launcher,
        "rank": _int_var(env, "RANK"),
        "world_size": _int_var(env, "WORLD_SIZE"),
        "local_rank": _int_var(env, "LOCAL_RANK"),
        "master_addr": env["MASTER_ADDR"],
        "master_port": _int_var(env, "MASTER_PORT"),
        "set": added,
    }


# ------------------------------------------------------------------- DeepSpeed's CPU shm all-reduce
SHM_OP = "deepspeed_shm_comm"


def disable_deepspeed_shm_allreduce() -> None:
    """Keep ``deepspeed.init_distributed`` from building and mapping its CPU shared-memory op.

    On the CPU accelerator DeepSpeed JIT-builds ``deepspeed_shm_comm`` and every rank creates a
    ~66 MB segment ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>`` that it
    never unlinks (deepspeed 0.19). The op serves only ``inference_all_reduce`` (tensor-parallel
    inference), none of training's collectives, which go through gloo. Left on, every CPU run
    leaks 66 MB of RAM per rank until /dev/shm fills (then ranks die with SIGBUS or hang on the
    shm flags), and a later job that draws the same port maps a stale peer's segment.
    Call before ``deepspeed.init_distributed``; a no-op where DeepSpeed lacks the op table.
    """
    import deepspeed.ops

    try:
        table = deepspeed.ops.__compatible_ops__  # probed once per process; DeepSpeed reads it
    except AttributeError:
        return
    if SHM_OP in table:
        table[SHM_OP] = False


# ---------------------------------------------------------------------- rendezvous with a deadline
DEFAULT_INIT_TIMEOUT_S = 300.0  # parallel.init_timeout_s


def check_master_addr(addr: str, port: int) -> None:
    """A :class:`DistEnvError` (one line) when MASTER_ADDR does not resolve: without this check
    every rank would retry connecting to it until the deadline."""
    try:
        socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        reason = getattr(e, "strerror", None) or str(e)
        raise DistEnvError(
            f"MASTER_ADDR {addr!r} does not resolve ({reason}): set MASTER_ADDR to rank 0's host "
            "name or IP address"
        ) from None


def init_process_group(
    backend: str, rank: int, world_size: int, timeout_s: float = DEFAULT_INIT_TIMEOUT_S
) -> None:
    """Start torch.distributed (env:// rendezvous at MASTER_ADDR:MASTER_PORT) with a deadline.

    The rendezvous (connecting to rank 0's store, every rank joining, the backend's first
    connections) must complete within ``timeout_s`` (``parallel.init_timeout_s``); afterwards
    collectives get DeepSpeed's usual timeout. Failures are one-line :class:`DistEnvError`:
    a busy MASTER_PORT, an unresolvable MASTER_ADDR, or ranks that did not all arrive in time
    (a rank died or never started). ``deepspeed.init_distributed`` then adopts the group.
    """

    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
        raise DistEnvError(f"parallel.init_timeout_s must be > 0 seconds, got {timeout_s!r}")
    if dist.is_initialized():
        return
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    check_master_addr(addr, port)
    where = f"MASTER_ADDR:MASTER_PORT {addr}:{port}"
    try:
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
        )
    except (RuntimeError, ValueError) as e:  # DistError subclasses RuntimeError
        text = str(e)
        first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
        if "EADDRINUSE" in text or "address already in use" in text.lower():
            raise DistEnvError(
                f"MASTER_PORT {port} is already in use on rank 0's host {addr} (another job, or "
                "a rank of an earlier run still alive): set MASTER_PORT to a free port"
            ) from None
        if "timed out" in text.lower() or "timeout" in text.lower():
            raise DistEnvError(
                f"rank {rank}: the rendezvous at {where} did not complete within "
                f"{timeout_s:g} s (parallel.init_timeout_s): a rank died or never started, or "
                f"the address is not reachable ({first})"
            ) from None
        raise DistEnvError(f"rank {rank}: the rendezvous at {where} failed: {first}") from None
    try:  # collectives: DeepSpeed's timeout (DEEPSPEED_TIMEOUT minutes), not the start-up one
        from deepspeed.constants import default_pg_timeout

        dist.distributed_c10d._set_pg_timeout(default_pg_timeout, None)
    except (ImportError, AttributeError, RuntimeError, ValueError):
        pass
