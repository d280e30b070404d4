"""Ranks of a multi-process data_prep run: who am I, and collectives that never hang.

Detected from the environment, so a plain ``python -m data_prep`` never imports MPI:

* ``mpirun``/``mpiexec`` (``OMPI_COMM_WORLD_SIZE``, ``PMI_SIZE``, ``PMIX_RANK``): mpi4py carries
  the collectives;
* ``srun`` (``SLURM_STEP_NUM_TASKS`` > 1 with ``SLURM_PROCID``, no MPI variables): a file-based
  transport on the shared output file system, because plain ``srun`` gives Open MPI no PMI
  (``srun --mpi=pmix`` would, where the cluster has it; the MPI variables win then);
* neither: ``None`` (the single-process pipeline).

Both transports keep their bookkeeping in one directory next to ``--out``
(``.<out>.data_prep-sync/<run id>/``): a heartbeat per rank (a counter a thread rewrites every
few seconds), an error file per failed rank, and, for the file transport, one file per rank and
collective. Every wait polls with a deadline: it fails when a rank reports an error, when a
rank's heartbeat stops changing for ``rank_timeout`` seconds (a rank that died or hangs), or
when a rank never starts within ``rank_timeout``. The directory is removed after a successful
run.
"""

import os
import pickle
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from data_prep.errors import DataPrepError

MPI_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")
DONE = "done"  # the heartbeat of a rank that finished its part
POLL_S = 0.05
MAX_POLL_S = 0.5


@dataclass
class World:
    """How this process was launched: ``kind`` is ``"mpi"`` or ``"slurm"``."""

    kind: str
    rank: int
    size: int
    run_id: str | None = None  # slurm: job.step (the same on every rank without talking)


def detect_world(env: dict[str, str] | None = None) -> World | None:
    """The launcher this process runs under, or None for a plain single-process run."""
    env = os.environ if env is None else env
    if any(k in env for k in MPI_ENV):
        rank = env.get("OMPI_COMM_WORLD_RANK") or env.get("PMIX_RANK") or env.get("PMI_RANK")
        return World("mpi", int(rank or 0), -1)  # the size (and the rank) come from mpi4py
    ntasks = env.get("SLURM_STEP_NUM_TASKS")  # set by srun for a job step, not in the batch script
    if ntasks is not None and "SLURM_PROCID" in env:
        size = int(ntasks)
        if size > 1:
            run_id = "{}.{}.{}".format(  # a requeued job restarts its step ids: count restarts
                env.get("SLURM_JOB_ID", "0"),
                env.get("SLURM_RESTART_COUNT", "0"),
                env.get("SLURM_STEP_ID", "0"),
            )
            return World("slurm", int(env["SLURM_PROCID"]), size, run_id)
    return None


class PeerFailed(DataPrepError):
    """Another rank failed (``died``: stopped without a word); the message says which and why."""

    def __init__(self, message: str, rank: int, died: bool, printed: bool = False) -> None:
        super().__init__(message)
        self.rank = rank
        self.died = died
        self.printed = printed  # the failed rank printed its message itself


class Transport:
    """Collectives among the ranks of one run, each wait bounded (see the module docstring)."""

    def __init__(self, rank: int, size: int, sync_dir: str, rank_timeout: float) -> None:
        self.rank = rank
        self.size = size
        self.dir = sync_dir
        self.timeout = rank_timeout
        self.seq = 0
        self.started = time.monotonic()
        os.makedirs(self.dir, exist_ok=True)
        self._seen: dict[int, Any] = {}  # rank -> (last heartbeat value, local time it changed)
        self._stop = threading.Event()
        self._beat = 0
        self._write_heartbeat()
        self._thread = threading.Thread(target=self._heartbeat_loop, daemon=True)
        self._thread.start()
        self._last_check = 0.0

    # ---------------------------------------------------------------------------- liveness
    def _path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def _write_heartbeat(self, value: str | None = None) -> None:
        self._beat += 1
        tmp = self._path(f"hb.{self.rank}.tmp")
        with open(tmp, "w") as f:
            f.write(value or str(self._beat))
        os.replace(tmp, self._path(f"hb.{self.rank}"))

    def _heartbeat_loop(self) -> None:
        interval = max(0.2, min(5.0, self.timeout / 6))
        while not self._stop.wait(interval):
            try:
                self._write_heartbeat()
            except OSError:
                pass  # the directory went away at the end of the run

    def stop_heartbeat(self, done: bool = True) -> None:
        """Stop beating. ``done``: the heartbeat file says so (this rank's part is over and it
        waits for nothing but the last collective); otherwise it just goes stale (a failure)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=10)
        if done:
            try:
                self._write_heartbeat(DONE)
            except OSError:
                pass

    def _check_alive(self, ranks: list[int]) -> None:
        """Raise :class:`PeerFailed` if any rank reported an error, or one of ``ranks`` stopped."""
        for r in range(self.size):
            err = self._path(f"error.{r}")
            if r != self.rank and os.path.exists(err):
                with open(err) as f:
                    printed, _, msg = f.read().partition("\t")
                raise PeerFailed(f"rank {r} failed: {msg.strip()}", r, False, printed == "1")
        now = time.monotonic()
        for r in ranks:
            if r == self.rank:
                continue
            try:
                with open(self._path(f"hb.{r}")) as f:
                    beat = f.read()
            except OSError:
                beat = None
            if beat == DONE:
                continue
            last = self._seen.get(r)
            if last is None or last[0] != beat:  # changed: alive (a first look counts from start)
                self._seen[r] = (beat, self.started if last is None and beat is None else now)
                continue
            if now - last[1] > self.timeout:
                what = "never started" if beat is None else "stopped responding"
                raise PeerFailed(
                    f"rank {r} of {self.size} {what} (no heartbeat for {self.timeout:.0f} s: "
                    "killed, out of memory, or its node failed)",
                    r,
                    True,
                )

    def check_peers(self) -> None:
        """Cheap (at most once a second): raise if another rank reported a failure."""
        now = time.monotonic()
        if now - self._last_check >= 1.0:
            self._last_check = now
            self._check_alive([])

    def report_failure(self, message: str, printed: bool) -> None:
        """Tell the other ranks this one failed (they stop at their next wait or check);
        ``printed``: this rank prints the message itself."""
        try:
            tmp = self._path(f"error.{self.rank}.tmp")
            with open(tmp, "w") as f:
                f.write(f"{int(printed)}\t{message}")
            os.replace(tmp, self._path(f"error.{self.rank}"))
        except OSError:
            pass

    def _wait(self, done: Callable[[], Any], ranks: Callable[[], list[int]], what: str) -> Any:
        sleep = POLL_S
        while True:
            result = done()
            if result is not None and result is not False:
                return result
            self._check_alive(ranks())
            time.sleep(sleep)
            sleep = min(MAX_POLL_S, sleep * 1.5)

    # ------------------------------------------------------------------------- collectives
    def allgather(self, obj: Any, what: str = "") -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        raise NotImplementedError

    def gather(self, obj: Any, what: str = "") -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (None elsewhere)."""
        raise NotImplementedError

    def bcast(self, obj: Any, what: str = "") -> Any:
        """Rank 0's ``obj`` on every rank."""
        raise NotImplementedError

    def close(self, ok: bool) -> None:
        """Stop the heartbeat; rank 0 removes the sync directory after a successful run."""
        self.stop_heartbeat(done=ok)


class FileTransport(Transport):
    """Collectives through files in the shared sync directory (``srun`` without MPI)."""

    def _exchange(self, obj: Any, readers: str) -> list[Any] | None:
        self.seq += 1
        name = f"c{self.seq:05d}"
        tmp = self._path(f"{name}.{self.rank}.tmp")
        with open(tmp, "wb") as f:
            pickle.dump(obj, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, self._path(f"{name}.{self.rank}"))
        if readers == "root" and self.rank != 0:
            return None
        paths = [self._path(f"{name}.{r}") for r in range(self.size)]

        def missing() -> list[int]:
            return [r for r, p in enumerate(paths) if not os.path.exists(p)]

        self._wait(lambda: not missing(), missing, name)
        out = []
        for p in paths:
            with open(p, "rb") as f:
                out.append(pickle.load(f))
        return out

    def allgather(self, obj: Any, what: str = "") -> list[Any]:
        out = self._exchange(obj, "all")
        assert out is not None
        return out

    def gather(self, obj: Any, what: str = "") -> list[Any] | None:
        return self._exchange(obj, "root")

    def bcast(self, obj: Any, what: str = "") -> Any:
        self.seq += 1
        path = self._path(f"c{self.seq:05d}.0")
        if self.rank == 0:
            with open(path + ".tmp", "wb") as f:
                pickle.dump(obj, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(path + ".tmp", path)
            return obj
        self._wait(lambda: os.path.exists(path), lambda: [0], "bcast")
        with open(path, "rb") as f:
            return pickle.load(f)


class MPITransport(Transport):
    """Collectives over mpi4py; every wait is a non-blocking barrier polled with the deadline."""

    def __init__(self, comm: Any, sync_dir: str, rank_timeout: float) -> None:
        self.comm = comm
        super().__init__(comm.Get_rank(), comm.Get_size(), sync_dir, rank_timeout)

    def _barrier(self, what: str) -> None:
        req = self.comm.Ibarrier()
        everyone = list(range(self.size))
        self._wait(lambda: req.Test(), lambda: everyone, what)

    def allgather(self, obj: Any, what: str = "") -> list[Any]:
        self._barrier(what)
        return self.comm.allgather(obj)

    def gather(self, obj: Any, what: str = "") -> list[Any] | None:
        self._barrier(what)
        return self.comm.gather(obj, root=0)

    def bcast(self, obj: Any, what: str = "") -> Any:
        self._barrier(what)
        return self.comm.bcast(obj, root=0)


def sync_root(out: str) -> str:
    """The directory next to ``out`` that holds the runs' sync directories."""
    out = os.path.abspath(out)
    return os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.data_prep-sync")


def connect(world: World, out: str, rank_timeout: float) -> Transport:
    """The transport for ``world`` (imports mpi4py only for an MPI world)."""
    root = sync_root(out)
    if world.kind == "mpi":
        try:
            from mpi4py import MPI
        except ImportError:
            raise DataPrepError(
                "launched under MPI (OMPI_COMM_WORLD_SIZE/PMI_SIZE/PMIX_RANK is set) but mpi4py "
                "is not installed: pip install mpi4py (or install the [mpi] extra)"
            ) from None
        comm = MPI.COMM_WORLD
        run_id = comm.bcast(uuid.uuid4().hex[:12] if comm.Get_rank() == 0 else None, root=0)
        world.rank, world.size = comm.Get_rank(), comm.Get_size()
        return MPITransport(comm, os.path.join(root, run_id), rank_timeout)
    return FileTransport(world.rank, world.size, os.path.join(root, world.run_id), rank_timeout)


def remove_sync_root(out: str) -> None:
    """Remove every run's sync directory (rank 0, after a successful run)."""
    shutil.rmtree(sync_root(out), ignore_errors=True)
