"""Rank discovery (linformer_ds.dist_env) under each launcher's variables, and a real mpirun."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from linformer_ds.dist_env import (
    REQUIRED_VARS,
    DistEnvError,
    _first_host_parse,
    first_host,
    job_key_port,
    setup_distributed_env,
    slurm_port,
)

REPO = Path(__file__).resolve().parents[1]
LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL")
REQUIRED_VARS_LOWER = ("rank", "world_size", "local_rank", "master_addr", "master_port")


@pytest.fixture
def clean_env(monkeypatch):
    """os.environ without any launcher or rendezvous variable (tests may run under srun)."""
    for name in list(os.environ):
        if name in REQUIRED_VARS or name.startswith(LAUNCHER_PREFIXES):
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
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES)}
    env = {k: v for k, v in env.items() if k not in REQUIRED_VARS}
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
