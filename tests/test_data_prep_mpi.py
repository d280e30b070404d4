"""data_prep on many ranks (mpirun, srun) gives the bytes of one process; dead ranks resume.

One corpus of every input kind (a glob of text files, a .jsonl file, a saved Hugging Face
dataset and a directory of parquet files read by ``load_dataset``), about 250 KB, cut into
~16 KB work units so that every rank gets several. The reference is the single-process run.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slurm_cluster import running_cluster  # noqa: E402
from test_data_prep import make_docs, write_text_corpus  # noqa: E402

from data_prep.__main__ import main as data_prep_main  # noqa: E402
from data_prep.distributed import detect_world, sync_root  # noqa: E402
from data_prep.parallel import DIE_ENV, reservoir_indices  # noqa: E402
from data_prep.tokenizer import sample_sentences  # noqa: E402
from tests.pretrain_utils import run_ranks_in_threads  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FLAGS = [
    "--seq-len", "32", "--vocab-size", "150", "--max-sentences-for-tokenizer", "1500",
    "--shard-rows", "40", "--valid-fraction", "0.2", "--quiet",
]  # fmt: skip
RANK_FLAGS = ["--workers", "0", "--unit-bytes", "16384", "--rank-timeout", "10"]
LAUNCH_VARS = ("OMPI_", "PMI", "PMIX_", "SLURM_")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_VARS)}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONPATH=str(REPO), **extra)
    return env


def mpirun_cmd(ranks: int) -> list[str]:
    exe = shutil.which("mpirun")
    if exe is None:
        if os.environ.get("LINFORMER_DS_REQUIRE_SLURM") == "1":
            pytest.fail("mpirun is not installed (apt-get install openmpi-bin libopenmpi-dev)")
        pytest.skip("mpirun is not installed (apt-get install openmpi-bin libopenmpi-dev)")
    return [exe, "--allow-run-as-root", "--oversubscribe", "-np", str(ranks)]


def tree(out: Path) -> dict[str, str]:
    """sha256 of every file under ``out``; the manifest without its timing field."""
    files = {}
    for p in sorted(out.rglob("*")):
        if p.is_file():
            files[str(p.relative_to(out))] = hashlib.sha256(p.read_bytes()).hexdigest()
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["tokenizer"]["trained"].pop("seconds")
    files["manifest.json"] = json.dumps(manifest, sort_keys=True)
    return files


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    import datasets

    tmp = tmp_path_factory.mktemp("mpi_corpus")
    write_text_corpus(tmp / "text", make_docs(160, seed=11))
    jsonl = tmp / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in make_docs(40, seed=12)))
    saved = tmp / "saved"
    datasets.Dataset.from_dict({"text": make_docs(60, seed=13)}).save_to_disk(str(saved))
    pq = tmp / "pq"
    pq.mkdir()
    for i in range(2):
        table = {"text": make_docs(30, seed=14 + i)}
        datasets.Dataset.from_dict(table).to_parquet(str(pq / f"part-{i}.parquet"))
    sources = [str(tmp / "text" / "*.txt"), str(jsonl), f"hf:{saved}", f"hf:{pq}"]
    refs = {}
    for name, extra in (
        ("default", []),
        ("limited", ["--max-bytes", "150000", "--packing", "pad"]),
        ("local", []),  # the files only (the kill tests: fewer processes loading datasets)
    ):
        out = tmp / f"ref_{name}"
        srcs = sources[:2] if name == "local" else sources
        argv = ["--source", *srcs, "--out", str(out), *FLAGS, *extra, "--workers", "0"]
        old = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith(LAUNCH_VARS)}
        try:
            assert data_prep_main(argv) == 0
        finally:
            os.environ.update(old)
        refs[name] = tree(out)
    return {"tmp": tmp, "sources": sources, "refs": refs}


def args(corpus: dict, out: Path, local: bool = False) -> list[str]:
    sources = corpus["sources"][:2] if local else corpus["sources"]
    return ["-m", "data_prep", "--source", *sources, "--out", str(out), *FLAGS]


def launch(cmd: list[str], env: dict[str, str], timeout: float = 120):
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------------------------------ the sample
@settings(max_examples=60, deadline=None)
@given(
    total=st.integers(0, 30_000),
    k=st.integers(1, 2_000),
    seed=st.integers(0, 2**32 - 1),
)
def test_reservoir_replay_equals_the_sequential_sample(total, k, seed):
    """Which lines the single-process reservoir keeps follows from the line count alone."""
    lines = [str(i) for i in range(total)]
    want = sample_sentences(["\n".join(lines)] if lines else [], k, seed)
    assert [str(i) for i in reservoir_indices(total, k, seed)] == want


def test_launcher_detection():
    assert detect_world({}) is None
    assert detect_world({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}) is None  # a batch script
    w = detect_world({"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_JOB_ID": "9"})
    assert (w.kind, w.rank, w.size) == ("slurm", 3, 4)
    w = detect_world(
        {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "SLURM_PROCID": "0"}
    )
    assert (w.kind, w.rank) == ("mpi", 1)  # mpirun inside an allocation: MPI wins


# ------------------------------------------------- the invariant on generated corpora, in-process
@settings(max_examples=12, deadline=None)
@given(
    n_docs=st.integers(1, 40),
    doc_seed=st.integers(0, 1000),
    ranks=st.integers(1, 3),
    unit_bytes=st.integers(200, 5000),
    shard_rows=st.integers(1, 30),
    packing=st.sampled_from(["full", "pad"]),
    max_docs=st.one_of(st.none(), st.integers(1, 40)),
    max_bytes=st.one_of(st.none(), st.integers(1, 20_000)),
    k=st.integers(60, 400),
)
def test_ranks_equal_one_process_on_generated_corpora(
    tmp_path_factory, n_docs, doc_seed, ranks, unit_bytes, shard_rows, packing, max_docs,
    max_bytes, k,
):  # fmt: skip
    """Any corpus, R, unit size, shard size, packing and --max-* cut: the same bytes."""
    tmp = tmp_path_factory.mktemp("gen")
    docs = make_docs(n_docs, seed=doc_seed)
    write_text_corpus(tmp / "a", docs[: n_docs // 2])
    (tmp / "b.jsonl").write_text(
        "".join(json.dumps({"text": d}) + "\n" for d in docs[n_docs // 2 :])
    )
    kw = dict(
        sources=[str(tmp / "a" / "*.txt"), str(tmp / "b.jsonl")] if n_docs > 1 else [str(tmp / "b.jsonl")],
        seq_len=16, vocab_size=60, max_sentences_for_tokenizer=k, shard_rows=shard_rows,
        packing=packing, max_docs=max_docs, max_bytes=max_bytes, valid_fraction=0.3,
        workers=0, progress=False,
    )  # fmt: skip
    from data_prep import DataPrepError, PrepConfig, prepare

    try:
        prepare(PrepConfig(out=str(tmp / "one"), **kw))
    except DataPrepError:  # too little text for this vocabulary: not this test's subject
        return
    many = {**kw, "out": str(tmp / "many"), "unit_bytes": unit_bytes, "rank_timeout": 30.0}
    run_ranks_in_threads(many, ranks, "g")
    assert tree(tmp / "many") == tree(tmp / "one")


# ---------------------------------------------------------------------------------- mpirun
@pytest.mark.parametrize(
    "ranks,name", [(2, "default"), (4, "default"), (3, "limited")], ids=["R2", "R4", "R3-limits"]
)
def test_mpirun_equals_one_process(corpus, tmp_path, ranks, name):
    extra = ["--max-bytes", "150000", "--packing", "pad"] if name == "limited" else []
    out = tmp_path / "out"
    cmd = [*mpirun_cmd(ranks), sys.executable, *args(corpus, out), *extra, *RANK_FLAGS]
    proc = launch(cmd, clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert tree(out) == corpus["refs"][name]
    assert not Path(sync_root(str(out))).exists()  # the ranks' bookkeeping is gone


def test_mpirun_rank_killed_then_resumed_on_other_ranks(corpus, tmp_path):
    out = tmp_path / "out"
    base = [sys.executable, *args(corpus, out, local=True), *RANK_FLAGS]
    proc = launch([*mpirun_cmd(2), *base], clean_env(**{DIE_ENV: "1:1"}))
    assert proc.returncode != 0
    assert "rank 1" in proc.stderr and "signal 9" in proc.stderr, proc.stderr[-2000:]
    work = tmp_path / ".out.data_prep-partial"  # the run's work until it is complete
    assert not out.exists() and (work / "progress.json").exists()
    done = len(list((work / ".units").glob("u*.json")))
    assert done >= 1
    one_process = [*args(corpus, out, local=True)[2:], "--workers", "0", "--resume"]
    assert data_prep_main(one_process) == 2  # resumed the way it was started, or not at all
    assert not out.exists() and (work / "progress.json").exists()
    proc = launch([*mpirun_cmd(4), *base, "--resume"], clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert tree(out) == corpus["refs"]["local"]
    assert not work.exists()


# ------------------------------------------------------------------- srun's file transport
def start_tasks(cmd: list[str], ntasks: int, step: int, **extra: str) -> list[subprocess.Popen]:
    """The environment srun gives its tasks (what data_prep reads of it), one process each."""
    procs = []
    for r in range(ntasks):
        env = clean_env(
            SLURM_JOB_ID="4242", SLURM_STEP_ID=str(step), SLURM_PROCID=str(r),
            SLURM_STEP_NUM_TASKS=str(ntasks), **extra,
        )  # fmt: skip
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True))
    return procs


def test_srun_transport_dead_rank_fails_the_run_in_time_then_resumes(corpus, tmp_path):
    """Without MPI (srun's ranks meet through files), a rank that dies stops the others within
    --rank-timeout with one clear line and no manifest; --resume on 2 ranks ends identical."""
    out = tmp_path / "out"
    cmd = [sys.executable, *args(corpus, out, local=True), *RANK_FLAGS]
    procs = start_tasks(cmd, 3, 0, **{DIE_ENV: "2:1"})
    procs[2].wait(timeout=600)  # rank 2 SIGKILLs itself after its first unit
    died = time.monotonic()  # timed from the death, not from the start-up (a loaded machine)
    errs = [p.communicate(timeout=600)[1] for p in procs]
    codes = [p.returncode for p in procs]
    assert codes[0] == 2 and codes[1] == 2 and codes[2] == -9, (codes, errs)
    assert time.monotonic() - died < 60  # --rank-timeout 10 plus the survivors' next wait
    assert "rank 2 of 3 stopped responding (no heartbeat for 10 s" in errs[0], errs[0]
    assert "--resume" in errs[0] and errs[1] == "", errs
    assert not (out / "manifest.json").exists()
    procs = start_tasks([*cmd, "--resume"], 2, 1)
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    assert tree(out) == corpus["refs"]["local"]


# --------------------------------------------------------------------- srun on a real cluster
@pytest.fixture(scope="module")
def slurm():
    yield from running_cluster()


@pytest.mark.slurm
def test_sbatch_srun_equals_one_process(corpus, tmp_path, slurm):
    """launch/slurm/data_prep.sbatch on the local cluster: 2 tasks of srun, same bytes."""
    out = tmp_path / "out"
    flags = [a for a in args(corpus, out)[2:] if a != "--quiet"] + RANK_FLAGS
    sbatch_args = [
        "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--time=5", "--partition=ci",
        f"--output={tmp_path}/%x-%j.out", str(REPO / "launch" / "slurm" / "data_prep.sbatch"),
        *flags,
    ]  # fmt: skip
    job = slurm.sbatch(sbatch_args, env=clean_env(PYTHON=sys.executable), cwd=REPO)
    info = slurm.wait(job, timeout=180)
    log = "\n".join(p.read_text() for p in tmp_path.glob("*.out"))
    assert info.state == "COMPLETED" and info.exit_code == "0:0", (info.fields, log[-3000:])
    assert "2 ranks on 1 node(s)" in log and "rank 1/2:" in log and "on 2 ranks" in log, log
    assert tree(out) == corpus["refs"]["default"]
