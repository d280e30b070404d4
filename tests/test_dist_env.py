"""Rank discovery (linformer_ds.dist_env) under each launcher's variables, and a real mpirun."""

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from linformer_ds import cpu_threads
from linformer_ds import dist_env as dist_env_mod
from linformer_ds.dist_env import (
    REQUIRED_VARS,
    DistEnvError,
    _first_host_parse,
    first_host,
    is_launcher_var,
    job_key_port,
    setup_distributed_env,
    slurm_port,
    without_launcher_vars,
)

REPO = Path(__file__).resolve().parents[1]
REQUIRED_VARS_LOWER = ("rank", "world_size", "local_rank", "master_addr", "master_port")


@pytest.fixture
def clean_env(monkeypatch):
    """os.environ without any launcher or rendezvous variable (tests may run under srun)."""
    for name in [k for k in os.environ if is_launcher_var(k)]:
        monkeypatch.delenv(name)
    return monkeypatch


def _set(mp, **values):
    for k, v in values.items():
        mp.setenv(k, str(v))


def _rendezvous():
    return {k: os.environ.get(k) for k in REQUIRED_VARS}


# --------------------------------------------------------------------------------- env (torchrun)
def test_env_launcher_keeps_everything(clean_env):
    _set(clean_env, RANK=3, WORLD_SIZE=8, LOCAL_RANK=1, MASTER_ADDR="10.0.0.1", MASTER_PORT=1234)
    # mpirun and srun variables are present too: RANK/WORLD_SIZE win.
    _set(clean_env, OMPI_COMM_WORLD_RANK=0, OMPI_COMM_WORLD_SIZE=1, OMPI_COMM_WORLD_LOCAL_RANK=0)
    _set(clean_env, SLURM_PROCID=0, SLURM_NTASKS=1, SLURM_LOCALID=0, SLURM_STEP_ID=0)
    info = setup_distributed_env()
    assert info == {
        "launcher": "env",
        "rank": 3,
        "world_size": 8,
        "local_rank": 1,
        "master_addr": "10.0.0.1",
        "master_port": 1234,
        "set": [],
    }
    assert _rendezvous() == {
        "RANK": "3",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "1234",
    }


def test_env_launcher_single_rank_fills_the_rest(clean_env):
    _set(clean_env, RANK=0, WORLD_SIZE=1)
    info = setup_distributed_env(default_port=23456)
    assert (info["launcher"], info["local_rank"], info["master_addr"], info["master_port"]) == (
        "env",
        0,
        "127.0.0.1",
        23456,
    )
    assert info["set"] == ["LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"]
    assert os.environ["MASTER_PORT"] == "23456"


@pytest.mark.parametrize(
    "values, message",
    [
        ({"RANK": 1, "WORLD_SIZE": 2, "MASTER_ADDR": "h", "MASTER_PORT": 1}, "LOCAL_RANK is not"),
        ({"RANK": 1, "WORLD_SIZE": 2, "LOCAL_RANK": 1}, "MASTER_ADDR is not"),
        ({"RANK": 1}, "WORLD_SIZE is missing"),
        ({"WORLD_SIZE": 4}, "RANK is missing"),
        ({"RANK": "one", "WORLD_SIZE": 2}, "RANK must be an integer, got 'one'"),
        ({"RANK": 4, "WORLD_SIZE": 4, "LOCAL_RANK": 0, "MASTER_ADDR": "h"}, "rank 4 is outside"),
        ({"RANK": 0, "WORLD_SIZE": 1, "MASTER_PORT": 70000}, "70000 is not a TCP port"),
    ],
)
def test_env_launcher_errors_name_the_variable(clean_env, values, message):
    _set(clean_env, **values)
    with pytest.raises(DistEnvError, match=message):
        setup_distributed_env()


# -------------------------------------------------------------------------------------- mpirun
def test_open_mpi_inside_sbatch_prefers_ompi_over_slurm(clean_env):
    # mpirun inside a batch job: every rank inherits the batch step's SLURM_PROCID=0.
    _set(clean_env, SLURM_JOB_ID=77, SLURM_PROCID=0, SLURM_NTASKS=2, SLURM_LOCALID=0)
    _set(
        clean_env,
        OMPI_COMM_WORLD_RANK=1,
        OMPI_COMM_WORLD_SIZE=2,
        OMPI_COMM_WORLD_LOCAL_RANK=1,
        OMPI_COMM_WORLD_LOCAL_SIZE=2,
        OMPI_MCA_ess_base_jobid=2072576001,
        PMIX_RANK=1,
    )
    info = setup_distributed_env()
    # single node: loopback; port 15000 + 2072576001 % 15000 = 15000 + 11001
    assert {k: info[k] for k in ("launcher", "rank", "world_size", "local_rank")} == {
        "launcher": "mpi",
        "rank": 1,
        "world_size": 2,
        "local_rank": 1,
    }
    assert (info["master_addr"], info["master_port"]) == ("127.0.0.1", 26001)
    assert _rendezvous() == {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "26001",
    }


def test_mpich_pmi_multi_node_with_given_master(clean_env):
    _set(clean_env, PMI_RANK=2, PMI_SIZE=4, MPI_LOCALRANKID=0, MPI_LOCALNRANKS=1)
    _set(clean_env, MASTER_ADDR="node7", MASTER_PORT=4000)
    info = setup_distributed_env()
    assert info == {
        "launcher": "mpi",
        "rank": 2,
        "world_size": 4,
        "local_rank": 0,
        "master_addr": "node7",
        "master_port": 4000,
        "set": ["RANK", "WORLD_SIZE", "LOCAL_RANK"],
    }


def test_mpi_without_job_id_uses_default_port(clean_env):
    _set(clean_env, PMI_RANK=0, PMI_SIZE=2, PMI_LOCAL_RANK=0, PMI_LOCAL_SIZE=2)
    info = setup_distributed_env(default_port=29511)
    assert (info["master_addr"], info["master_port"]) == ("127.0.0.1", 29511)


def test_mpi_without_local_rank_is_an_error(clean_env):
    _set(clean_env, PMI_RANK=0, PMI_SIZE=2)
    with pytest.raises(DistEnvError, match="no local rank variable"):
        setup_distributed_env()


# --------------------------------------------------------------------------------------- srun
def test_srun_multi_node_step(clean_env):
    _set(
        clean_env,
        SLURM_JOB_ID=123456,
        SLURM_STEP_ID=2,
        SLURM_PROCID=5,
        SLURM_NTASKS=16,  # the job's; the step has 8
        SLURM_STEP_NUM_TASKS=8,
        SLURM_LOCALID=1,
        SLURM_STEP_NUM_NODES=2,
        SLURM_STEP_NODELIST="gpu[007-008]",
        SLURM_JOB_NODELIST="gpu[003,007-008]",
    )
    info = setup_distributed_env()
    # port 15000 + (123456 % 1000) * 15 + 2 % 15
    assert info == {
        "launcher": "slurm",
        "rank": 5,
        "world_size": 8,
        "local_rank": 1,
        "master_addr": "gpu007",
        "master_port": 21842,
        "set": list(REQUIRED_VARS),
    }


def test_srun_pmix_single_node_step(clean_env):
    # srun --mpi=pmix: PMIX_RANK is set as well; SLURM's variables give the size.
    _set(clean_env, SLURM_JOB_ID=7, SLURM_STEPID=0, SLURM_PROCID=1, SLURM_NTASKS=2)
    _set(clean_env, SLURM_LOCALID=1, SLURM_NNODES=1, SLURM_JOB_NODELIST="vm", PMIX_RANK=1)
    info = setup_distributed_env()
    assert {k: info[k] for k in REQUIRED_VARS_LOWER} == {
        "rank": 1,
        "world_size": 2,
        "local_rank": 1,
        "master_addr": "127.0.0.1",
        "master_port": 15105,
    }
    assert info["launcher"] == "slurm"


def test_srun_keeps_an_exported_master(clean_env):
    _set(clean_env, SLURM_JOB_ID=9, SLURM_STEP_ID=0, SLURM_PROCID=0, SLURM_STEP_NUM_TASKS=4)
    _set(clean_env, SLURM_LOCALID=0, SLURM_STEP_NUM_NODES=2, SLURM_STEP_NODELIST="a[1-2]")
    _set(clean_env, MASTER_ADDR="10.1.2.3", MASTER_PORT=40000)
    info = setup_distributed_env()
    assert (info["master_addr"], info["master_port"], info["world_size"]) == ("10.1.2.3", 40000, 4)
    assert info["set"] == ["RANK", "WORLD_SIZE", "LOCAL_RANK"]


@pytest.mark.parametrize("step", [None, 4294967291, 4294967290])  # none, batch, interactive
def test_batch_script_itself_is_a_single_process(clean_env, step):
    # The batch step has SLURM_PROCID=0 and SLURM_NTASKS=2 but is no srun step.
    _set(clean_env, SLURM_JOB_ID=5, SLURM_PROCID=0, SLURM_NTASKS=2, SLURM_LOCALID=0)
    if step is not None:
        _set(clean_env, SLURM_STEP_ID=step)
    info = setup_distributed_env()
    assert (info["launcher"], info["rank"], info["world_size"]) == ("single", 0, 1)


def test_srun_bad_value_names_the_variable(clean_env):
    _set(clean_env, SLURM_JOB_ID=5, SLURM_STEP_ID=0, SLURM_PROCID="x", SLURM_NTASKS=2)
    with pytest.raises(DistEnvError, match="SLURM_PROCID must be an integer, got 'x'"):
        setup_distributed_env()


def test_srun_without_local_id_is_an_error(clean_env):
    _set(clean_env, SLURM_JOB_ID=5, SLURM_STEP_ID=0, SLURM_PROCID=0, SLURM_NTASKS=2)
    with pytest.raises(DistEnvError, match="SLURM_LOCALID is not"):
        setup_distributed_env()


# ------------------------------------------------------------------- a child's own environment
def _names_read(module) -> list[str]:
    """Every upper-case string constant of ``module``'s source that names a variable."""
    text = Path(module.__file__).read_text()
    return sorted(set(re.findall(r'"([A-Z][A-Z0-9]*_[A-Z0-9_]*[A-Z0-9]|RANK)"', text)))


_LAUNCHER_NAMES = [
    n
    for n in {*_names_read(dist_env_mod), *(v for v, _ in cpu_threads.LOCAL_SIZE_VARS)}
    if n not in dist_env_mod.SETTINGS_VARS and n != "SIGXFSZ"
] + ["SLURM_NODEID", "SLURM_TASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE"]  # cpu_threads' SLURM
_OTHER = st.sampled_from(["PATH", "HOME", "SLURM_CONF", "OMPI_ALLOW_RUN_AS_ROOT", "LANG"])


@settings(max_examples=200, deadline=None)
@given(
    launcher=st.dictionaries(st.sampled_from(sorted(_LAUNCHER_NAMES)),
                             st.sampled_from(["0", "1", "2", "3", "7", "a[1-2]", "x"])),
    other=st.dictionaries(_OTHER, st.text("abc/:", max_size=6)),
)  # fmt: skip
def test_without_launcher_vars_leaves_a_job_of_its_own(launcher, other):
    """Whatever a launcher left (any mix of the variables rank discovery and the CPU share read,
    even inconsistent ones), the environment without them is rank 0 of 1 on one local rank,
    and every other variable is kept as it was."""
    env = without_launcher_vars({**launcher, **other})
    assert env == other
    info = setup_distributed_env(environ=env)
    assert (info["launcher"], info["rank"], info["world_size"]) == ("single", 0, 1)
    assert cpu_threads.local_ranks(dict(other)) == (1, "")
    assert all(is_launcher_var(n) for n in launcher)


# ------------------------------------------------------------------------------------- single
def test_single_process_gets_a_free_port(clean_env):
    info = setup_distributed_env()
    assert {k: info[k] for k in ("launcher", "rank", "world_size", "local_rank")} == {
        "launcher": "single",
        "rank": 0,
        "world_size": 1,
        "local_rank": 0,
    }
    assert info["master_addr"] == "127.0.0.1"
    with socket.socket() as s:  # the port is really free
        s.bind(("127.0.0.1", info["master_port"]))
    assert os.environ["MASTER_PORT"] == str(info["master_port"])


def test_explicit_environ_mapping_is_used_instead_of_os_environ(clean_env):
    env = {"SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    env["SLURM_LOCALID"] = "0"
    env["SLURM_NNODES"] = "1"
    info = setup_distributed_env(environ=env)
    assert env["MASTER_PORT"] == "15015" and info["master_port"] == 15015
    assert "RANK" not in os.environ


# --------------------------------------------------------------------------------------- ports
def test_slurm_ports_are_distinct_for_consecutive_jobs_and_steps():
    assert slurm_port(123456, 2) == 21842
    assert slurm_port(1000) == 15000
    assert slurm_port(999, 14) == 15000 + 999 * 15 + 14 == 29999
    ports = {slurm_port(j, s) for j in range(5000, 6000) for s in range(15)}
    assert len(ports) == 15000 and min(ports) == 15000 and max(ports) == 29999


def test_job_key_port():
    assert job_key_port("2072576001") == 26001
    assert job_key_port("15000") == 15000
    assert 15000 <= job_key_port("slurm.pmix.12.0") < 30000
    assert job_key_port("slurm.pmix.12.0") == job_key_port("slurm.pmix.12.0")


# ---------------------------------------------------------------------------------- node lists
NODELISTS = [
    ("gpu[007-009,12],cpu1", "gpu007"),
    ("node1,node2", "node1"),
    ("a[3]", "a3"),
    ("n[10-11]", "n10"),
    ("vm", "vm"),
    ("rack1-n[0001-0004]", "rack1-n0001"),
]


@pytest.mark.parametrize("nodelist, first", NODELISTS)
def test_first_host(nodelist, first):
    assert _first_host_parse(nodelist) == first
    assert first_host(nodelist) == first  # through scontrol where it is installed


def test_first_host_of_empty_list_is_an_error():
    with pytest.raises(DistEnvError, match="node list"):
        first_host(" ")


# ------------------------------------------------------------------------------ a real mpirun
PROBE = r"""
import json, os, sys
if sys.argv[1] == "multinode":  # hide the local size: rank 0's host then comes via mpi4py
    os.environ.pop("OMPI_COMM_WORLD_LOCAL_SIZE", None)
from linformer_ds.dist_env import setup_distributed_env
info = setup_distributed_env()
import torch
import torch.distributed as dist
dist.init_process_group("gloo", init_method="env://")
t = torch.tensor([float(info["rank"] + 1)])
dist.all_reduce(t)
ranks = [None] * info["world_size"]
dist.all_gather_object(ranks, info["rank"])
# one file per rank: the ranks' stdout lines interleave under mpirun
with open(os.path.join(sys.argv[2], f"probe-{info['rank']}.json"), "w") as f:
    json.dump({**info, "sum": t.item(), "gathered": ranks}, f)
dist.destroy_process_group()
"""


def probe_results(out_dir: Path) -> list:
    """The per-rank probe results of a multi-rank run, sorted by rank."""
    rows = [json.loads(p.read_text()) for p in out_dir.glob("probe-*.json")]
    return sorted(rows, key=lambda r: r["rank"])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["single-node", "multinode"])
def test_mpirun_two_ranks_discover_distinct_ranks_and_all_reduce(mode, tmp_path):
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun not installed (apt-get install openmpi-bin libopenmpi-dev)")
    if mode == "multinode":
        pytest.importorskip("mpi4py", reason="the multi-node path broadcasts with mpi4py")
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = without_launcher_vars(os.environ)
    env["PYTHONPATH"] = str(REPO)
    cmd = [mpirun, "-np", "2", "--oversubscribe", "--allow-run-as-root"]
    cmd += [sys.executable, str(script), mode, str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = probe_results(tmp_path)
    assert [r["rank"] for r in rows] == [0, 1]
    assert [r["local_rank"] for r in rows] == [0, 1]
    assert {r["launcher"] for r in rows} == {"mpi"}
    assert {r["world_size"] for r in rows} == {2}
    assert [r["sum"] for r in rows] == [3.0, 3.0]  # 1 + 2
    assert [r["gathered"] for r in rows] == [[0, 1], [0, 1]]
    assert len({r["master_port"] for r in rows}) == 1
    addr = {r["master_addr"] for r in rows}
    assert addr == ({"127.0.0.1"} if mode == "single-node" else {socket.gethostname()})


# =========================================================== nothing waits forever (real ranks)
PRETRAIN = str(REPO / "launch" / "pretrain.py")


def _rank_cmd(data: Path, run: Path, overrides=()) -> list:
    from tests.pretrain_utils import TEST_OVERRIDES, TINY_CONFIG

    return [sys.executable, PRETRAIN, "--config", TINY_CONFIG, *TEST_OVERRIDES,
            f"data.path={data}", f"logging.dir={run}", "train.max_steps=2", *overrides]  # fmt: skip


def _rank_env(rank: int, world: int, port: int, addr: str = "127.0.0.1") -> dict:
    env = without_launcher_vars(os.environ)
    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR=addr,
               MASTER_PORT=str(port), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")  # fmt: skip
    return env


def _one_error_line(stderr: str) -> str:
    """The error line of a rank that failed: no traceback, exactly one 'error' line."""
    assert "Traceback" not in stderr, stderr
    lines = [re.sub(r"^\[rank \d+\] ", "", line) for line in stderr.splitlines()]  # rank R > 0
    errors = [line for line in lines if line.startswith(("error:", "config error:"))]
    assert len(errors) == 1, stderr
    return errors[0]


@contextlib.contextmanager
def _rendezvous_port():
    """A port where "rank 0's store" listens: yields ``(port, wait)``; ``wait(proc, seconds)``
    returns once the rank has connected to it, i.e. is past its imports and data checks and
    inside the rendezvous (fails if the rank exits or the deadline passes first). The accepted
    connection stays open (never answered) until the block ends, so the rank keeps waiting
    there instead of seeing a reset."""
    import time

    conns = []
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        srv.settimeout(0.2)

        def wait(proc: subprocess.Popen, seconds: float) -> None:
            end = time.monotonic() + seconds
            while time.monotonic() < end and proc.poll() is None:
                try:
                    conns.append(srv.accept()[0])
                    break
                except TimeoutError:
                    continue
            assert proc.poll() is None, proc.communicate()
            assert conns, f"the rank did not reach the rendezvous within {seconds:g} s"

        try:
            yield srv.getsockname()[1], wait
        finally:
            for c in conns:
                c.close()


def test_busy_master_port_is_one_line_exit_2(tiny_corpus, tmp_path):
    """Rank 0 cannot host the rendezvous on a port in use: one line, exit 2, no retries."""
    import time

    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        proc = subprocess.run(_rank_cmd(tiny_corpus, tmp_path / "run"), env=_rank_env(0, 2, port),
                              capture_output=True, text=True, timeout=300, cwd=REPO)  # fmt: skip
        elapsed = time.monotonic() - t0
    line = _one_error_line(proc.stderr)
    assert proc.returncode == 2, proc.stderr
    assert f"MASTER_PORT {port} is already in use" in line and "set MASTER_PORT" in line
    print(f"busy port: exit 2 after {elapsed:.1f} s")


def test_unresolvable_master_addr_is_one_line(clean_env):
    from linformer_ds.dist_env import init_process_group

    _set(clean_env, RANK=1, WORLD_SIZE=2, LOCAL_RANK=1, MASTER_ADDR="no-such-host.invalid",
         MASTER_PORT=29999)  # fmt: skip
    with pytest.raises(DistEnvError, match="MASTER_ADDR 'no-such-host.invalid' does not resolve"):
        init_process_group("gloo", 1, 2, timeout_s=5)
    with pytest.raises(DistEnvError, match="init_timeout_s must be > 0"):
        init_process_group("gloo", 1, 2, timeout_s=float("nan"))


def test_rank_0_killed_during_start_up_rank_1_leaves_within_the_deadline(tiny_corpus, tmp_path):
    """Rank 0 dies before the rendezvous: rank 1 ends with one line when
    parallel.init_timeout_s runs out (measured), instead of retrying without end."""
    import signal
    import time

    from linformer_ds.dist_env import free_port

    port, deadline = free_port(), 2.0  # short: the wait is the test's time, not its property
    cmd = _rank_cmd(tiny_corpus, tmp_path / "run", [f"parallel.init_timeout_s={deadline}"])
    r0 = subprocess.Popen(cmd, env=_rank_env(0, 2, port), cwd=REPO,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    r1 = subprocess.Popen(cmd, env=_rank_env(1, 2, port), cwd=REPO, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    time.sleep(1.0)  # rank 0 is importing torch: it never reaches the rendezvous
    r0.send_signal(signal.SIGKILL)
    r0.wait()
    killed = time.monotonic()
    _, err = r1.communicate(timeout=300)
    after = time.monotonic() - killed
    line = _one_error_line(err)
    assert r1.returncode == 2, err
    assert "rendezvous at MASTER_ADDR:MASTER_PORT" in line and "within 2 s" in line, line
    assert after < deadline + 60, after  # imports + data + the deadline (x2 in torch's store)
    print(f"rank 1 left {after:.1f} s after rank 0 was killed (init_timeout_s={deadline:g})")


def test_sigterm_during_rendezvous_ends_the_rank_within_seconds(tiny_corpus, tmp_path):
    """Alone at the rendezvous (deadline 600 s), a rank ends within seconds of SIGTERM: one
    line, exit 75 (nothing to save: no step has run)."""
    import signal
    import time

    cmd = _rank_cmd(tiny_corpus, tmp_path / "run", ["parallel.init_timeout_s=600"])
    with _rendezvous_port() as (port, wait_at_rendezvous):
        proc = subprocess.Popen(cmd, env=_rank_env(1, 2, port), cwd=REPO, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        wait_at_rendezvous(proc, 120.0)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
        after = time.monotonic() - t0
    assert proc.returncode == 75, err
    line = _one_error_line(err)
    assert "SIGTERM during start-up (process-group init)" in line, line
    assert after < 5.0, after
    print(f"SIGTERM during the rendezvous: exit 75 after {after:.2f} s")


LAUNCHER = r"""
import subprocess, sys, time
child = subprocess.Popen(sys.argv[1:])
print(child.pid, flush=True)
child.wait()
"""


def test_rank_leaves_when_its_launcher_dies(tiny_corpus, tmp_path):
    """SIGKILL to the launcher (the rank's parent) while the rank waits at the rendezvous: the
    rank notices within ~1 s and ends (exit 75: no step had run), not an orphan."""
    import signal
    import time

    cmd = _rank_cmd(tiny_corpus, tmp_path / "run", ["parallel.init_timeout_s=600"])
    with _rendezvous_port() as (port, wait_at_rendezvous):
        launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, *cmd], cwd=REPO, text=True,
                                    env=_rank_env(1, 2, port), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE)  # fmt: skip
        rank_pid = int(launcher.stdout.readline())
        wait_at_rendezvous(launcher, 120.0)
        t0 = time.monotonic()
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        while time.monotonic() - t0 < 30:
            try:
                os.kill(rank_pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        after = time.monotonic() - t0
        gone = True
        try:
            os.kill(rank_pid, 0)
            gone = False
            os.kill(rank_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert gone, "the rank outlived its launcher by 30 s"
    assert after < 5.0, after
    err = launcher.stderr.read()
    assert "the launcher (pid" in err, err
    assert "SIGTERM during start-up (process-group init)" in err, err
    print(f"rank left {after:.2f} s after its launcher was killed")


def test_sigterm_to_the_deepspeed_runner_stops_its_ranks(tiny_corpus, tmp_path):
    """issue 21: SIGTERM to the `deepspeed` runner left its ranks training as orphans (the
    runner dies, deepspeed.launcher.launch and the ranks go on). The ranks watch the runner too:
    they checkpoint at the next step and exit 75 within seconds."""
    import contextlib
    import signal
    import time

    from linformer_ds.dist_env import free_port

    run = tmp_path / "run"
    cmd = ["deepspeed", "--num_gpus", "1", "--master_port", str(free_port()), PRETRAIN]
    cmd += _rank_cmd(tiny_corpus, run, ["train.max_steps=100000", "checkpoint.save_interval=0"])[2:]
    env = {k: v for k, v in _rank_env(0, 1, 0).items() if k not in REQUIRED_VARS}
    runner = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        end = time.monotonic() + 300
        while time.monotonic() < end and not (run / "metrics.jsonl").is_file():
            assert runner.poll() is None, runner.communicate()[0][-3000:]
            time.sleep(0.2)
        time.sleep(1.0)  # a few steps into training
        ranks = [int(p) for p in subprocess.run(
            ["pgrep", "-f", f"logging.dir={run}"], capture_output=True, text=True
        ).stdout.split() if int(p) != runner.pid]  # fmt: skip
        rank = [p for p in ranks if "--local_rank" in Path(f"/proc/{p}/cmdline").read_text()]
        assert rank, ranks
        t0 = time.monotonic()
        runner.send_signal(signal.SIGTERM)
        runner.wait(timeout=60)
        while time.monotonic() - t0 < 60 and Path(f"/proc/{rank[0]}").exists():
            time.sleep(0.1)
        after = time.monotonic() - t0
        assert not Path(f"/proc/{rank[0]}").exists(), "the rank outlived its runner by 60 s"
        out = runner.stdout.read()
        assert "the launcher (pid" in out and "[checkpoint] signal 15" in out, out[-3000:]
        print(f"the rank checkpointed and left {after:.1f} s after SIGTERM to the runner")
    finally:
        for p in subprocess.run(["pgrep", "-f", f"logging.dir={run}"], capture_output=True,
                                text=True).stdout.split():  # fmt: skip
            with contextlib.suppress(OSError):
                os.kill(int(p), signal.SIGKILL)
