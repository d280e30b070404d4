"""The GPU kit (scripts/gpu_check.sh, gpu_check.py, gpu_report.py; docs/gpu.md) on CPU.

One dry run (``bash scripts/gpu_check.sh OUT --dry-run``: every step at tiny sizes, DeepSpeed on
the CPU accelerator, data built from the stdlib) is shared by the tests below, which check its
files against the device's limits and its numbers against independent recomputations.
"""

import json
import math
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import yaml

from linformer_ds.model import ModelConfig, flops_per_token
from tests.pretrain_utils import child_env

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import gpu_check  # noqa: E402
import gpu_report  # noqa: E402

# The dry run has no time budget (fixed work, every step to its end): a slow or loaded machine
# takes longer and checks the same results. The limits here only catch a hang.
pytestmark = pytest.mark.timeout(3600)


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    """(out dir, results dict, completed process) of one dry run."""
    tmp = tmp_path_factory.mktemp("gpu_kit")
    out, work = tmp / "out", tmp / "work"
    env = child_env(PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", str(out), "--dry-run", "--work", str(work)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    results = json.loads((out / "results.json").read_text())
    return out, work, results, proc


def test_dry_run_runs_every_step(dry) -> None:
    """Exit 0, every step ok, and OUT within what the device sends back (8 files, 16 MiB
    each, plain names, at most 2 folders down)."""
    out, _, r, proc = dry
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert r["dry_run"] is True
    assert {k: v["status"] for k, v in r["steps"].items()} == dict.fromkeys(gpu_check.STEPS, "ok")
    files = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    assert [str(p) for p in files] == [
        "artifacts.tar.gz",
        "gpu_check.log",
        "report.md",
        "results.json",
    ]
    for p in files:
        assert re.fullmatch(r"[A-Za-z0-9._-]+", p.name)
        assert (out / p).stat().st_size < 16 << 20
    log = (out / "gpu_check.log").read_text()
    assert "no time budgets: fixed work, every step runs to its end" in log
    assert "passed the" not in log  # no hard limit in the dry run
    assert r["budgets_s"] == {"total": None, "reserve": None}
    assert all(s["budget_s"] is None for s in r["steps"].values() if "budget_s" in s)
    assert "[gpu_check.sh] exit 0" in log


def test_dry_run_gpu_tests_ran_on_cpu(dry) -> None:
    """tests/test_gpu.py ran in full on the CPU, and its recorded numbers hold what it asserts."""
    _, _, r, _ = dry
    t = r["steps"]["tests"]
    assert (t["collected"], t["passed"], t["failed"], t["skipped"]) == (14, 14, 0, 0)
    m = t["measured"]
    prec = [x for x in m if x["test"] == "bf16_vs_fp32"]
    assert len(prec) == 10
    assert {(x["kind"], x["sharing"]) for x in prec} >= {("dense", "layerwise"), ("conv", "kv")}
    for x in prec:
        assert x["device"] == "cpu"
        assert 0 < x["logits_rel_err"] < 0.03 and 0 < x["grad_rel_err"] < 0.05
        assert abs(x["loss_fp32"] - math.log(500)) < 0.5  # an untrained model's loss: ln(V)
    fused = [x for x in m if x["test"] == "dense_fused"]
    assert len(fused) == 2
    for x in fused:
        assert x["one_head_nxn_bytes"] == x["n"] ** 2 * 2
        assert 0 < x["transient_bytes"] < x["one_head_nxn_bytes"]
    (control,) = [x for x in m if x["test"] == "dense_math_control"]
    assert control["transient_bytes"] >= control["heads"] * control["n"] ** 2 * 2
    (lin,) = [x for x in m if x["test"] == "linformer_memory"]
    mem = [row["transient_bytes"] for row in lin["rows"]]
    assert [row["n"] for row in lin["rows"]] == [512, 1024, 2048]
    assert all(1.6 < b / a < 2.4 for a, b in zip(mem, mem[1:]))


def test_dry_run_main_job(dry) -> None:
    """The main job ran base_4096.yaml's settings (ZeRO-2, bf16, activation checkpointing) under
    the deepspeed launcher, through the trainer's own entry point (no wrapper); its model TFLOP/s are tokens/s x the model's FLOPs per token."""
    _, work, r, _ = dry
    s = r["steps"]["main"]
    assert s["command"].startswith("deepspeed --num_gpus 1 ")
    assert " launch/pretrain.py --config configs/base_4096.yaml " in s["command"]
    assert "workarounds" not in r
    assert s["logged_steps"] == [2, 4, 6]
    assert (s["zero_stage"], s["precision"], s["activation_checkpointing"]) == (2, "bf16", True)
    assert s["model"] == {"hidden_size": 64, "num_layers": 2, "max_seq_len": 128, "k": 32}
    cfg = json.loads((work / "main" / "config.json").read_text())
    fpt = flops_per_token(ModelConfig(**cfg["model"]), 128, mlm_fraction=0.15)
    for rec in s["train_records"]:
        assert rec["tokens_per_s"] > 0 and math.isfinite(rec["loss"])
    assert s["model_tflops"] == pytest.approx(s["tokens_per_s"] * fpt / 1e12, rel=1e-6)
    assert s["gemm_peak_tflops"] > 0 and s["gemm_peak_source"] == "measured by the trainer"
    assert 0 < s["peak_mem_gib"] < 8
    assert abs(s["first_loss"] - math.log(1000)) < 0.5
    # the plan beside it (linformer_ds.plan): its layout; at the run's own model TFLOP/s the
    # planned tokens/s are the measured ones less the checkpointed forward's recomputation (one
    # rank: no exposed communication); the dry run's peak is the RSS, not comparable
    plan = s["plan"]
    assert plan["layout"] == "P=1 DP=1 ZeRO-2 ckpt=layer B=2" and plan["comparable"] is False
    assert plan["predicted_tokens_per_s"] == pytest.approx(0.75 * s["tokens_per_s"], rel=1e-3)
    assert plan["predicted_peak_gib"] > 0 and set(plan["predicted_mib"]) >= {"activations"}


def test_dry_run_main_job_counts_host_syncs(dry) -> None:
    """The main job's step 2 ran under the sync counters (the trainer's debug.sync_log
    hook), step 3 uncounted: on the CPU the dispatch-mode count fills the field (CUDA's is
    None); the model asked for nothing, the trainer for its one read of the step's statistics,
    and the total is the owners' sum (DeepSpeed's included, the data pipeline's host work not)."""
    _, work, r, _ = dry
    sy = r["steps"]["main"]["syncs"]
    assert [x["step"] for x in sy["steps"]] == list(gpu_check.SYNC_STEPS["dry"]) == [2]
    (step,) = sy["steps"]
    assert step["source"] == sy["source"] == "dispatch_mode" and step["cuda_syncs"] is None
    owners = step["dispatch_by_owner"]
    assert owners.get("model", 0) == 0
    assert step["dispatch_by_reason"]["trainer/copy_to_host"] == owners["trainer"] == 1
    ds = sum(n for k, n in owners.items() if k.startswith("deepspeed"))
    assert sy["per_step"] == step["syncs"] == step["dispatch"] == 1 + ds
    assert (sy["ours_per_step"], sy["deepspeed_per_step"]) == (1, ds)
    assert ds > 0  # ZeRO-2's own reads (its overflow check, the norm's validity)
    assert 0 < sy["counted_step_s"] and 0 < sy["uncounted_step_s"]
    recs = [json.loads(x) for x in (work / "main" / "syncs" / "syncs.rank0.jsonl").open()]
    assert [(x["step"], x["counted"]) for x in recs] == [(2, True), (3, False)]


def test_dry_run_optimizers(dry) -> None:
    """torch's unfused AdamW through deepspeed.extra reproduces the main job's loss (the fused
    kernel, the trainer's default); FusedAdam (a CUDA JIT op) is left to the GPU."""
    _, _, r, _ = dry
    runs = r["steps"]["optimizers"]["runs"]
    assert runs["ds_fused_adam"]["status"] == "skipped"
    t = runs["torch_unfused_adamw"]
    assert t["status"] == "ok"
    assert t["overrides"] == ["deepspeed.extra.optimizer.params.fused=false"]
    assert t["loss_vs_main"]["step"] == 4
    assert t["loss_rel_diff"] < 1e-3


def test_dry_run_bench(dry) -> None:
    """The trimmed benchmark: every variant at both N, through bench/gpu_bench.sh."""
    _, _, r, _ = dry
    b = r["steps"]["bench"]
    assert b["command"].startswith("bash bench/gpu_bench.sh ")
    rows = {(x["variant"], x["n"]) for x in b["rows"] if x["step_s"]}
    assert rows == {(v, n) for v in ("linear", "conv", "hybrid", "dense") for n in (64, 128)}
    assert "| variant | N |" in b["table_md"]


def test_dry_run_peer(dry) -> None:
    """The peer comparison: every sharing mode of ours against lucidrains (equal work, ratios
    recorded), then our dense model against HF BERT; each a bench.peer_bench run."""
    _, work, r, _ = dry
    p = r["steps"]["peer"]
    assert p["status"] == "ok", p
    lin, dense = p["runs"]["peer"], p["runs"]["peer_dense"]
    assert lin["command"].startswith("-m bench.peer_bench ")
    got = {(x["sharing"], x["model"]) for x in lin["rows"] if x["step_s_median"] > 0}
    sharings = ("none", "headwise", "kv", "layerwise")
    assert got == {(s, m) for s in sharings for m in ("ours", "lucidrains", "ours-trainer")}
    for x in lin["rows"]:
        assert (x["speedup_vs_lucidrains"] is None) == (x["model"] == "lucidrains")
        assert x["equal_work"] == (x["sharing"] != "none")
    (d,) = [x for x in dense["rows"] if x["model"] == "ours-dense"]
    assert d["speedup_vs_hf_bert"] > 0
    assert {x["model"] for x in dense["rows"]} == {"ours-dense", "hf-bert"}
    saved = json.loads((work / "peer" / "results.json").read_text())
    assert [x["step_s_median"] for x in saved["rows"]] == [x["step_s_median"] for x in lin["rows"]]


def _unigram_ppl(data: Path, eval_tokens: int) -> float:
    """Independent recomputation: add-0.5 train-split unigram on the first eval tokens."""
    m = json.loads((data / "manifest.json").read_text())
    special = set(m["special_ids"].values())

    def tokens(split):
        return np.concatenate(
            [np.load(data / s["file"]).ravel() for s in m["splits"][split]["shards"]]
        )

    counts = np.bincount(tokens("train"), minlength=m["vocab_size"]) + 0.5
    counts[list(special)] = 0
    p = counts / counts.sum()
    valid = [t for t in tokens("valid")[:eval_tokens] if t not in special]
    return math.exp(-np.mean(np.log(p[valid])))


def test_dry_run_sweep(dry) -> None:
    """The shrunk gpu_quality sweep: both points ran; the summary's mean perplexity is
    exp(final loss) of the run; the unigram reference matches a recomputation."""
    _, work, r, _ = dry
    s = r["steps"]["sweep"]
    assert s["status_counts"] == {"ok": 2}
    assert s["runs"]["started"] == 2 and s["runs"]["killed_at_deadline"] == []
    groups = {(g["variant"], g["n"], g["k"]): g for g in s["groups"]}
    assert set(groups) == {("dense", 128, None), ("linear", 128, 32)}
    for g in groups.values():
        assert (g["ok"], g["runs"], g["steps"]) == (1, 1, 6)
        assert g["ppl_mean"] == pytest.approx(math.exp(g["loss_mean"]), rel=1e-9)
        assert g["ppl_std"] is None  # one seed: no spread
    data = next((work / "data").glob("stdlib-*")) / f"n{gpu_check.DRY_N}"
    uni = _unigram_ppl(data, s["eval_tokens"])
    assert s["unigram_ppl"][str(gpu_check.DRY_N)] == pytest.approx(uni, rel=1e-9)
    assert (work / "sweep" / "report" / "report.md").is_file()


def test_report_renders_every_section(dry) -> None:
    """report.md is gpu_report.py's rendering of results.json, with every step's section."""
    out, _, r, _ = dry
    md = (out / "report.md").read_text()
    assert md == gpu_report.render(r)
    for head in (
        "## GPU check: CPU (dry run)",
        "**DRY RUN**",
        "### GPU tests",
        "### Main job",
        "### Model-speed benchmark",
        "### Equal work against lucidrains and HF BERT",
        "### Quality sweep",
        "### Optimizers",
    ):
        assert head in md
    assert f"**{r['steps']['main']['tokens_per_s']:,.0f} tokens/s**" in md
    assert "14 passed, 0 failed" in md
    cli = subprocess.run(
        [sys.executable, "scripts/gpu_report.py", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert cli.stdout == md


def test_artifacts_hold_the_logs(dry) -> None:
    out, _, _, _ = dry
    with tarfile.open(out / "artifacts.tar.gz") as tar:
        names = set(tar.getnames())
    for name in (
        "gpu_check/main/metrics.jsonl",
        "gpu_check/main.log",
        "gpu_check/tests/junit.xml",
        "gpu_check/bench/results.json",
        "gpu_check/peer/results.json",
        "gpu_check/peer_dense/results.md",
        "gpu_check/sweep/report/report.md",
    ):
        assert name in names
    assert not any("/data/" in n or n.endswith(".npy") for n in names)


# ================================================================= no dry run needed (fast)
def test_gpu_budgets_fit_nine_minutes() -> None:
    """Every step's GPU budget plus the reserve is the total, and the total with the wheel
    install stays under 9 minutes; the wrapper's hard limit is under the device's 600 s."""
    b = gpu_check.BUDGETS["gpu"]
    assert set(b) == set(gpu_check.STEPS) - {"optimizers"}
    assert sum(b.values()) + gpu_check.RESERVE_S == gpu_check.TOTAL_BUDGET_S["gpu"] <= 540 - 15
    wrapper = (REPO / "scripts" / "gpu_check.sh").read_text()
    assert re.search(r"GPU_CHECK_HARD_LIMIT_S:-(\d+)", wrapper).group(1) == "575"


def test_gpu_quality_sweep_file() -> None:
    """dense, linear at k = N/4 and N/8, conv hybrid; 3 seeds; N = 1024 and 4096; seed 0 of every
    point runs first."""
    from studies import sweep

    cfg = sweep.load_sweep(str(gpu_check.SWEEP_FILE))
    pts = cfg.points()
    assert len(pts) == 24
    assert {p.seq_len for p in pts} == {1024, 4096}
    for n in (1024, 4096):
        lin = {p.k for p in pts if p.variant == "linear" and p.seq_len == n}
        assert lin == {n // 4, n // 8}
        assert {p.k for p in pts if p.variant == "dense" and p.seq_len == n} == {None}
        assert {p.k for p in pts if p.variant == "conv_hybrid" and p.seq_len == n} == {n // 8}
    assert [p.seed for p in pts] == [0] * 8 + [1] * 8 + [2] * 8
    raw = yaml.safe_load(gpu_check.SWEEP_FILE.read_text())
    assert raw["data"]["cache_dir"] == "gpu_carry/data"  # the carried folder
    assert "/gpu_carry/" in (REPO / ".gitignore").read_text().splitlines()


def test_bad_input_is_one_line(tmp_path) -> None:
    bad = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", str(tmp_path), "--only", "main"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "step main needs step data" in bad.stderr
    rep = subprocess.run(
        [sys.executable, "scripts/gpu_report.py", str(tmp_path / "nothing")],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert rep.returncode == 2
    assert rep.stderr.strip().endswith("does not exist (run scripts/gpu_check.sh first)")
    usage = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=REPO, capture_output=True)
    assert usage.returncode == 2
