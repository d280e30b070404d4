"""linformer_ds.cpu_threads: the threads and OpenMP wait policy of a rank from the CPUs it has
(affinity, cgroup quota v1/v2, ranks on the node), on fake cgroup trees and environments; the
job config's train.threads / train.omp_wait_policy; the restart for an explicit wait policy."""

from pathlib import Path

import pytest

from linformer_ds.config import ConfigError, load_config
from linformer_ds.cpu_threads import (
    RESTARTED_VAR,
    WAIT_REASON_VAR,
    CgroupCpus,
    cgroup_cpus,
    choose_threads,
    cpu_share,
    local_ranks,
    parse_cpu_list,
    prepare_openmp,
    thread_plan,
    wait_policy_restart,
)
from tests.pretrain_utils import TINY_CONFIG


def write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def v2_tree(tmp_path: Path, cpu_max: str, own: str = "", cpuset: str = "0-7") -> tuple:
    """A cgroup v2 mount with this process in ``/job`` (its cpu.max ``own``, the root's
    ``cpu_max``); returns (root, /proc/self/cgroup file)."""
    root = tmp_path / "cg2"
    write(root, "cgroup.controllers", "cpuset cpu memory")
    write(root, "cpu.max", cpu_max)
    write(root, "job/cpuset.cpus.effective", cpuset)
    if own:
        write(root, "job/cpu.max", own)
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/job\n")
    return str(root), str(proc)


def test_cpu_lists():
    assert parse_cpu_list("0-3,8,10-11") == 7
    assert parse_cpu_list("5") == 1
    assert parse_cpu_list("") == 0


def test_cgroup_v2_quota_is_the_tightest_on_the_way_up(tmp_path):
    root, proc = v2_tree(tmp_path, "max 100000", own="150000 100000")
    assert cgroup_cpus(root, proc) == CgroupCpus(quota=1.5, cpuset=8)
    root, proc = v2_tree(tmp_path, "200000 100000", own="max 100000")
    assert cgroup_cpus(root, proc).quota == 2.0
    root, proc = v2_tree(tmp_path, "max 100000")
    assert cgroup_cpus(root, proc).quota is None


def test_cgroup_v1_quota_and_cpuset(tmp_path):
    root = tmp_path / "cg1"
    write(root, "cpu,cpuacct/cpu.cfs_quota_us", "-1")
    write(root, "cpu,cpuacct/cpu.cfs_period_us", "100000")
    write(root, "cpu,cpuacct/slurm/job1/cpu.cfs_quota_us", "300000")
    write(root, "cpu,cpuacct/slurm/job1/cpu.cfs_period_us", "100000")
    write(root, "cpuset/cpuset.cpus", "0-15")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("4:cpu,cpuacct:/slurm/job1\n3:cpuset:/\n1:name=systemd:/\n")
    assert cgroup_cpus(str(root), str(proc)) == CgroupCpus(quota=3.0, cpuset=16)
    # no quota anywhere (-1), a cgroup path the container does not see: the mount's root
    proc.write_text("4:cpu,cpuacct:/host/path/gone\n3:cpuset:/\n")
    assert cgroup_cpus(str(root), str(proc)) == CgroupCpus(quota=None, cpuset=16)
    # nothing mounted: nothing known
    assert cgroup_cpus(str(tmp_path / "none"), str(proc)) == CgroupCpus()


def test_malformed_cgroup_files_mean_no_limit(tmp_path):
    root, proc = v2_tree(tmp_path, "lots 100000")
    assert cgroup_cpus(root, proc).quota is None


@pytest.mark.parametrize(
    "env, want",
    [
        ({}, (1, "")),
        ({"LOCAL_WORLD_SIZE": "4"}, (4, "LOCAL_WORLD_SIZE")),
        ({"LOCAL_SIZE": "2"}, (2, "LOCAL_SIZE")),
        ({"OMPI_COMM_WORLD_LOCAL_SIZE": "3", "SLURM_STEP_ID": "0"}, (3, "OMPI_COMM_WORLD_LOCAL_SIZE")),
        ({"MPI_LOCALNRANKS": "2"}, (2, "MPI_LOCALNRANKS")),
        ({"SLURM_STEP_ID": "0", "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "4(x1),2"},
         (2, "SLURM_STEP_TASKS_PER_NODE")),
        ({"SLURM_STEP_ID": "3", "SLURM_NODEID": "2", "SLURM_STEP_TASKS_PER_NODE": "3(x4)"},
         (3, "SLURM_STEP_TASKS_PER_NODE")),
        # the batch script (no step): its tasks are not this process's siblings
        ({"SLURM_TASKS_PER_NODE": "8"}, (1, "")),
    ],
)  # fmt: skip
def test_local_ranks_from_each_launcher(env, want):
    assert local_ranks(env) == want


def share(env=None, affinity=2, quota=None, cpuset=None, machine=2, load=0.0):
    return cpu_share(env or {}, affinity, CgroupCpus(quota, cpuset), machine, load)


def test_threads_from_affinity_quota_and_ranks():
    assert share(affinity=8, machine=8).threads == 8
    assert share({"LOCAL_WORLD_SIZE": "2"}, affinity=8, machine=8).threads == 4
    assert share({"LOCAL_WORLD_SIZE": "3"}, affinity=8, machine=8).threads == 2  # 2.67 CPUs
    assert share({"LOCAL_WORLD_SIZE": "4"}, affinity=2).threads == 1  # 0.5 CPUs: still 1
    assert share(affinity=16, quota=2.5, machine=64).threads == 2  # the quota caps
    assert share({"LOCAL_SIZE": "2"}, affinity=16, quota=3.0, machine=64).cpus == 1.5
    # bound: affinity narrower than the cpuset is this rank's own (not divided by the ranks)
    bound = share({"LOCAL_WORLD_SIZE": "4"}, affinity=4, cpuset=16, machine=16)
    assert bound.bound and bound.threads == 4
    # affinity = the cpuset (a container's CPUs): shared by the local ranks
    whole = share({"LOCAL_WORLD_SIZE": "4"}, affinity=16, cpuset=16, machine=64)
    assert not whole.bound and whole.threads == 4


def test_wait_policy_auto_is_passive_where_cpus_are_shared():
    assert share(affinity=2).shared(2) is None  # an idle machine, 2 threads on 2 CPUs
    assert "load average 1.2 on 2 CPUs" == share(affinity=2, load=1.2).shared(2)
    assert "3 threads on 2 CPUs" == share(affinity=2).shared(3)
    assert "quota 1.5" in share(affinity=4, quota=1.5, machine=4).shared(1)
    ranks = share({"LOCAL_WORLD_SIZE": "4"}, affinity=2)  # 4 ranks on 2 CPUs
    assert "1 threads on 0.5 CPUs" == ranks.shared(ranks.threads)


def test_choose_threads_order_config_then_env_then_cpus():
    s = share(affinity=8, machine=8)
    assert choose_threads(3, {"OMP_NUM_THREADS": "1"}, s) == (3, "train.threads")
    assert choose_threads("auto", {"OMP_NUM_THREADS": "1"}, s) == (1, "auto: OMP_NUM_THREADS")
    n, why = choose_threads("auto", {"OMP_NUM_THREADS": "junk"}, s)
    assert n == 8 and why.startswith("auto: 8 CPUs per rank: affinity 8, no quota, 1 rank")


def test_prepare_openmp_sets_the_policy_before_torch_unless_the_user_did():
    env = {}
    reason = prepare_openmp(env, share(affinity=2, load=1.5))
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and reason.startswith("passive (auto: load")
    assert env[WAIT_REASON_VAR] == reason
    assert prepare_openmp(env, share(affinity=2)) == reason  # a restart keeps the first reason
    env = {}
    assert prepare_openmp(env, share(affinity=2)) == "default (auto: CPUs to itself)"
    assert "OMP_WAIT_POLICY" not in env
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert prepare_openmp(env, share(affinity=2, load=9.0)) == (
        "active (OMP_WAIT_POLICY=ACTIVE at start)"
    )
    assert env["OMP_WAIT_POLICY"] == "ACTIVE"


def test_thread_plan_reports_the_policy_the_runtime_started_with():
    s = share(affinity=4, machine=4)
    env = {
        "OMP_WAIT_POLICY": "PASSIVE",
        WAIT_REASON_VAR: "passive (auto: load average 3.0 on 4 CPUs)",
    }
    plan = thread_plan("auto", "auto", env, s)
    assert plan.setup_text() == (
        "threads=4 (auto: 4 CPUs per rank: affinity 4, no quota, 1 rank) "
        "omp_wait=passive (auto: load average 3.0 on 4 CPUs)"
    )
    plan = thread_plan(2, "passive", env, s)
    assert plan.threads == 2 and plan.wait_why == "passive (train.omp_wait_policy)"
    assert plan.warning is None
    # asked for active, started passive (no restart possible here): said, not hidden
    plan = thread_plan("auto", "active", env, s)
    assert (
        plan.wait == "passive" and "train.omp_wait_policy=active is not in effect" in plan.warning
    )
    plan = thread_plan("auto", "auto", {}, s)  # in-process (tests): nothing set before torch
    assert plan.wait_why == "default (OMP_WAIT_POLICY unset at start)"


def test_an_explicit_wait_policy_restarts_the_rank_once():
    calls = []
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    argv = ["/usr/bin/python3", "-u", "launch/pretrain.py", "--config", "x.yaml"]
    execv = lambda path, args: calls.append((path, list(args)))  # noqa: E731
    assert wait_policy_restart("passive", env, execv, argv)
    assert calls == [("/usr/bin/python3", argv)]
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and env[RESTARTED_VAR] == "1"
    assert env[WAIT_REASON_VAR] == "passive (train.omp_wait_policy)"
    # after the restart: in effect, nothing to do
    assert not wait_policy_restart("passive", env, execv, argv)
    # auto, or what the runtime started with: no restart; a second restart never happens
    assert not wait_policy_restart("auto", {}, execv, argv)
    assert not wait_policy_restart("active", {"OMP_WAIT_POLICY": "active"}, execv, argv)
    assert not wait_policy_restart("active", dict(env), execv, argv)
    assert len(calls) == 1


def test_config_keys(tmp_path):
    base = ["--config", TINY_CONFIG][1:]
    cfg = load_config(base[0], [f"data.path={tmp_path}"])
    assert cfg.train.threads == "auto" and cfg.train.omp_wait_policy == "auto"
    cfg = load_config(base[0], [f"data.path={tmp_path}", "train.threads=3",
                                "train.omp_wait_policy=passive"])  # fmt: skip
    assert cfg.train.threads == 3 and cfg.train.omp_wait_policy == "passive"
    for bad, words in (("train.threads=0", "train.threads: must be auto or a thread count"),
                       ("train.threads=many", "train.threads: must be auto"),
                       ("train.threads=true", "train.threads: must be auto"),
                       ("train.omp_wait_policy=spin", "train.omp_wait_policy: must be"),
                       ("train.thread=2", "thread")):  # fmt: skip
        with pytest.raises(ConfigError, match=words):
            load_config(base[0], [f"data.path={tmp_path}", bad])
