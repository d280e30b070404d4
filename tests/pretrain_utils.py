"""Helpers shared by tests that run the real trainer (a small corpus and 2-rank launches) and
data_prep's ranks (as threads of the test's process)."""

import json
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from data_prep import PrepConfig
from data_prep.distributed import World
from data_prep.parallel import prepare_distributed
from linformer_ds.dist_env import free_port, without_launcher_vars
from linformer_ds.fsio import read_jsonl

REPO = Path(__file__).resolve().parents[1]
PRETRAIN = str(REPO / "launch" / "pretrain.py")
WORKER = str(REPO / "tests" / "layout_worker.py")
TINY_CONFIG = str(REPO / "configs" / "tiny_cpu.yaml")
RUN_MARK = "[layout_worker] run "  # tests/layout_worker.py's line before each run


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child that starts a job of its own: no launcher
    variables (``dist_env.without_launcher_vars``: an earlier in-process run leaves RANK and the
    rest in os.environ), the CPU accelerator, one OpenMP thread, unbuffered output; ``extra``
    on top."""
    env = without_launcher_vars(os.environ)
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


# A small, fast variant of configs/tiny_cpu.yaml for tests.
TEST_OVERRIDES = [
    "model.vocab_size=2000",
    "model.max_seq_len=128",
    "model.hidden_size=64",
    "model.num_heads=4",
    "model.intermediate_size=128",
    "model.k=32",
    "model.dropout=0.0",
    "deepspeed.precision=bf16",  # what the tests were written for (tiny_cpu.yaml says auto)
    "train.micro_batch_size=4",
    "train.log_interval=1",
    "train.eval_interval=0",
    "train.peak_tflops=1.0",
    "scheduler.warmup_steps=2",
    "logging.tensorboard=false",
]


def make_corpus(out: Path, seq_len: int = 128, vocab: int = 2000, max_docs: int = 120) -> Path:
    """data_prep on the first stdlib modules: a real tokenizer and real shards in seconds."""
    cmd = [
        sys.executable, "-m", "data_prep", "--source", "stdlib", "--out", str(out),
        "--seq-len", str(seq_len), "--vocab-size", str(vocab), "--max-docs", str(max_docs),
        "--valid-fraction", "0.05", "--quiet",
    ]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=REPO, timeout=600)
    return out


def run_pretrain(
    data: Path,
    run_dir: Path,
    overrides: list[str] | None = None,
    nproc: int = 2,
    launcher: str = "torchrun",
    check: bool = True,
    timeout: int = 600,
    config: str = TINY_CONFIG,
    script: str = PRETRAIN,
) -> subprocess.CompletedProcess:
    """Run launch/pretrain.py (or ``script``) with ``nproc`` CPU ranks; returns the completed
    process. ``launcher``: ``torchrun`` (the default: 7-8 s and 12.5 CPU-s a tiny 2-rank run on
    2 cores), ``deepspeed`` (13.5-15 s and 17.5 CPU-s: its runner and launch processes import
    deepspeed too; for the tests of what that launcher does: its exit code, its tear-down, the
    ranks' lines when it stops them) or ``python`` (one process)."""
    ov = TEST_OVERRIDES + [f"data.path={data}", f"logging.dir={run_dir}"] + list(overrides or [])
    env = child_env()
    port = str(free_port())
    if launcher == "deepspeed":
        cmd = ["deepspeed", "--num_gpus", str(nproc), "--master_port", port, script]
    elif launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_port", port, script]  # fmt: skip
    elif launcher == "python":
        cmd = [sys.executable, script]
    else:
        raise ValueError(launcher)
    cmd += ["--config", config] + ov
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"pretrain failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def start_worker_ranks(
    ranks: int, runs: Sequence[dict], out: Path, name: str, merge_stderr: bool = False
) -> list[subprocess.Popen]:
    """Start tests/layout_worker.py on ``ranks`` gloo ranks: one process group that trains
    ``runs`` (``{"name", "overrides"}``, each logging to ``out/<name>``) one after the other,
    so the start-up is paid once. Spec ``out/<name>.json``; rank r's stdout in
    ``out/<name>.rank<r>``, its stderr in ``.err`` beside it (``merge_stderr``: in the same
    file, in the order written). :func:`wait_worker_ranks` waits."""
    spec = out / f"{name}.json"
    spec.write_text(json.dumps({"out": str(out), "runs": list(runs)}))
    env = child_env()
    env.update(WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    procs = []
    for r in range(ranks):
        log_path = out / f"{name}.rank{r}"
        with open(log_path, "w") as log, open(f"{log_path}.err", "w") as err:
            procs.append(subprocess.Popen([sys.executable, WORKER, str(spec)], cwd=REPO,
                                          env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                                          stdout=log,
                                          stderr=subprocess.STDOUT if merge_stderr else err))  # fmt: skip
    return procs


def wait_worker_ranks(
    procs: list[subprocess.Popen], out: Path, name: str, timeout: int = 1800
) -> dict[str, str]:
    """Wait for :func:`start_worker_ranks`' ranks (asserts every rank exited 0); returns each
    run's stdout, every rank's part of it (rank 0's first), as a launcher prints them."""
    codes = [p.wait(timeout=timeout) for p in procs]
    logs = [(out / f"{name}.rank{r}").read_text() for r in range(len(procs))]
    err = (out / f"{name}.rank0.err").read_text()
    assert not any(codes), f"{name}: exit codes {codes}\n{logs[0][-3000:]}\n{err[-3000:]}"
    runs: dict[str, str] = {}
    for log in logs:
        run = None
        for line in log.splitlines(keepends=True):
            if line.startswith(RUN_MARK):
                run = line[len(RUN_MARK) :].strip()
                runs.setdefault(run, "")
            elif run is not None:
                runs[run] += line
    return runs


def run_worker_ranks(ranks: int, runs: Sequence[dict], out: Path, name: str) -> dict[str, str]:
    """:func:`start_worker_ranks`, then :func:`wait_worker_ranks`: each run's stdout."""
    return wait_worker_ranks(start_worker_ranks(ranks, runs, out, name), out, name)


def worker_run(name: str, data: Path, overrides: Sequence[str]) -> dict:
    """A run for :func:`start_worker_ranks`: the overrides :func:`run_pretrain` would give it
    (TEST_OVERRIDES and ``logging.dir`` come from the worker)."""
    return {"name": name, "overrides": [f"data.path={data}", *overrides]}


def read_metrics(run_dir: Path, split: str = "train") -> dict[int, dict]:
    """step -> metrics record (the last one written for that step)."""
    return {r["step"]: r for r in read_jsonl(run_dir / "metrics.jsonl") if r["split"] == split}


def run_ranks_in_threads(
    cfg_kw: dict[str, Any], ranks: int, run_id: str, timeout: float = 120.0
) -> None:
    """``ranks`` ranks of data_prep.parallel with ``PrepConfig(**cfg_kw)`` as threads of this
    process (srun's file transport, run ``run_id``), each joined within ``timeout`` seconds;
    asserts that no rank raised."""
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            prepare_distributed(PrepConfig(**cfg_kw), World("slurm", r, ranks, run_id))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not errors, errors


def init_gloo_rank(rank: int, world: int, port: int):
    """Join a single-node gloo group as ``rank`` of ``world`` (a worker process of a test);
    returns the ``deepspeed`` module."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import deepspeed

    from linformer_ds.dist_env import disable_deepspeed_shm_allreduce

    disable_deepspeed_shm_allreduce()
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    return deepspeed
