"""The sweep runner: real trainer runs on a tiny grid, divergence marking, resume, SLURM array."""

import csv
import json
import math
import os
import subprocess
import sys

import pytest
import yaml

from linformer_ds.fsio import read_jsonl
from studies import sweep
from tests.pretrain_utils import REPO, child_env

SWEEP_CLI = str(REPO / "studies" / "run_sweep.py")

TINY_SWEEP = {
    "name": "tiny",
    "base_config": "configs/tiny_cpu.yaml",
    "base_overrides": [
        "model.vocab_size=2000",
        "model.hidden_size=64",
        "model.num_layers=2",
        "model.num_heads=4",
        "model.intermediate_size=128",
        "model.dropout=0.0",
        "train.max_steps=4",
        "train.log_interval=1",
        "train.eval_interval=2",
        "train.eval_batches=1",
        "train.micro_batch_size=4",
        "scheduler.warmup_steps=1",
        "train.peak_tflops=1.0",
        "deepspeed.precision=fp32",
        "deepspeed.zero.stage=1",
        "checkpoint.save_interval=0",
        "checkpoint.save_final=false",
        "checkpoint.resume=never",
    ],
    "variants": {
        "linear": ["model.projection=linear", "model.sharing=layerwise"],
        "conv_hybrid": ["model.projection=hybrid", "model.sharing=headwise"],
    },
    "grids": [
        {
            "name": "main",
            "variants": ["linear", "conv_hybrid"],
            "seq_len": [128],
            "k": [32],
            "lr": [1.0e-3],
        },
        # Adam moves every weight by ~lr per step: at lr=1e3 the loss explodes at once.
        {"name": "diverge", "variants": ["linear"], "seq_len": [128], "k": [32], "lr": [1.0e3]},
    ],
}
IDS = ["linear_n128_k32_lr0.001_s0", "conv_hybrid_n128_k32_lr0.001_s0", "linear_n128_k32_lr1000_s0"]


def _cli(args, env_extra=None, timeout=300):
    env = child_env(**(env_extra or {}))
    return subprocess.run(
        [sys.executable, SWEEP_CLI, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """SLURM array task 0 run by hand, then the whole sweep (which must skip point 0)."""
    tmp = tmp_path_factory.mktemp("sweep")
    spec = dict(
        TINY_SWEEP,
        data={
            "source": ["stdlib"],
            "vocab_size": 2000,
            "cache_dir": str(tmp / "data"),
            "args": ["--max-docs", "60", "--valid-fraction", "0.05"],
        },
    )
    path = tmp / "tiny.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = tmp / "out"
    gen = _cli([str(path), "--out", str(out), "--slurm"])
    assert gen.returncode == 0, gen.stderr
    script = out / "sweep_array.sbatch"
    syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    array = subprocess.run(
        ["bash", str(script)],
        cwd=tmp,
        capture_output=True,
        text=True,
        env=dict(os.environ, SLURM_ARRAY_TASK_ID="0"),
        timeout=300,
    )
    first = json.loads((out / "runs" / IDS[0] / "result.json").read_text())
    mtime = (out / "runs" / IDS[0] / "result.json").stat().st_mtime_ns
    full = _cli([str(path), "--out", str(out)])
    return {
        "path": path,
        "out": out,
        "script": script,
        "syntax": syntax,
        "array": array,
        "first": first,
        "mtime0": mtime,
        "full": full,
    }


def test_slurm_script_is_valid_and_runs_one_array_task(swept):
    text = swept["script"].read_text()
    assert swept["syntax"].returncode == 0, swept["syntax"].stderr
    assert "#SBATCH --array=0-2\n" in text
    assert '--point "${SLURM_ARRAY_TASK_ID' in text
    assert swept["array"].returncode == 0, swept["array"].stdout + swept["array"].stderr
    assert swept["first"]["status"] == "ok"
    assert swept["first"]["index"] == 0 and swept["first"]["id"] == IDS[0]
    # without an array id the script refuses to run
    bare = subprocess.run(
        ["bash", str(swept["script"])],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "SLURM_ARRAY_TASK_ID"},
    )
    assert bare.returncode != 0 and "SLURM array task" in bare.stderr


def test_sweep_runs_skips_finished_and_marks_divergence(swept):
    full = swept["full"]
    assert full.returncode == 0, full.stdout[-3000:] + full.stderr[-3000:]
    assert f"[skip] {IDS[0]}: already ok" in full.stdout
    assert (swept["out"] / "runs" / IDS[0] / "result.json").stat().st_mtime_ns == swept["mtime0"]
    results = {
        r["id"]: r
        for r in sweep.collect(sweep.load_sweep(str(swept["path"]), out=str(swept["out"])))
    }
    assert list(results) == IDS
    assert results[IDS[0]]["status"] == results[IDS[1]]["status"] == "ok"
    div = results[IDS[2]]
    assert div["status"] == "diverged", div
    assert div["reason"]
    for pid in IDS[:2]:
        r = results[pid]
        assert r["steps"] == 4 and [s for s, _, _ in r["eval_curve"]] == [2, 4]
        assert r["final_eval_loss"] < math.log(2000) + 0.5  # learned, not diverged
        assert (swept["out"] / "runs" / pid / "tensorboard").is_dir()


def test_report_files_have_one_row_per_point(swept):
    rdir = swept["out"] / "report"
    rows = list(csv.DictReader(open(rdir / "results.csv")))
    assert [r["id"] for r in rows] == IDS
    assert [r["status"] for r in rows] == ["ok", "ok", "diverged"]
    # the numbers come from the trainer's metrics.jsonl, unchanged
    for r in rows[:2]:
        evals = read_jsonl(swept["out"] / "runs" / r["id"] / "metrics.jsonl")
        last = [e for e in evals if e["split"] == "eval"][-1]
        assert float(r["final_eval_loss"]) == last["loss"]
        assert float(r["final_eval_ppl"]) == pytest.approx(last["perplexity"], rel=1e-12)
    md = (rdir / "report.md").read_text()
    table = [line for line in md.splitlines() if line.startswith("| ") and "_n128_" in line]
    assert [line.split("|")[1].strip() for line in table] == IDS
    assert "**diverged" in table[2] and "**" not in table[0] + table[1]
    assert "Points: 2 ok, 1 diverged, 0 failed, 0 pending." in md
    for png in ("val_ppl_vs_step.png", "final_ppl_vs_lr.png"):  # lr: linear at 1e-3 and 1e3
        assert (rdir / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({png})" in md


# ----------------------------------------------------------------------------- pure functions
def _rec(split, step, loss):
    return {"split": split, "step": step, "loss": loss}


def test_classify_statuses():
    ok = [_rec("train", 1, 7.0), _rec("eval", 2, 6.5), _rec("eval", 4, 6.0)]
    assert sweep.classify(0, ok, 13.5, 1.0)["status"] == "ok"
    assert sweep.classify(0, ok, 13.5, 1.0)["final_eval_ppl"] == pytest.approx(math.exp(6.0))
    r = sweep.classify(3, ok[:1], 13.5, 1.0)
    assert (r["status"], r["reason"]) == ("diverged", "non-finite loss (trainer exit 3)")
    nan = ok + [_rec("train", 5, float("nan"))]
    assert sweep.classify(0, nan, 13.5, 1.0)["reason"] == "non-finite train loss at step 5"
    high = ok + [_rec("eval", 6, 20.0)]
    assert sweep.classify(0, high, 13.5, 1.0)["reason"] == "eval loss 20 > 13.5 at step 6"
    rise = ok + [_rec("eval", 6, 7.5)]
    assert sweep.classify(0, rise, 13.5, 1.0)["status"] == "diverged"
    assert sweep.classify(0, rise, 13.5, 2.0)["status"] == "ok"
    assert sweep.classify(1, ok, 13.5, 1.0)["status"] == "failed"


def test_points_dedupe_and_dense_ignores_k(tmp_path):
    spec = {
        "base_config": "configs/tiny_cpu.yaml",
        "variants": {
            "dense": {"overrides": ["model.projection=dense"], "uses_k": False},
            "lin": ["model.projection=linear"],
        },
        "grids": [
            {
                "name": "a",
                "variants": ["dense", "lin"],
                "seq_len": [256],
                "k": [32, 64],
                "lr": [1e-3],
            },
            {"name": "b", "variants": ["lin"], "seq_len": [256], "k": [64], "lr": [1e-3]},
        ],
    }
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(spec))
    pts = sweep.load_sweep(str(path)).points()
    assert [p.id for p in pts] == [
        "dense_n256_lr0.001_s0",
        "lin_n256_k32_lr0.001_s0",
        "lin_n256_k64_lr0.001_s0",
    ]
    assert pts[2].grids == ["a", "b"] and [p.index for p in pts] == [0, 1, 2]


@pytest.mark.parametrize(
    "patch, message",
    [
        (
            {"grids": [{"variants": ["nope"], "seq_len": [256], "lr": [1e-3]}]},
            "unknown variant 'nope'",
        ),
        ({"base_overrides": ["model.k=3"]}, "sets a key that the sweep sets per point"),
        ({"variants": {"lin": ["model.projection"]}}, "is not of the form key=value"),
        ({"bogus": 1}, "unknown key(s) ['bogus']"),
        ({"grids": [{"variants": ["lin"], "seq_len": [256], "lr": [0]}]}, "lr: must be > 0"),
    ],
)
def test_bad_sweep_files_name_the_problem(tmp_path, patch, message):
    spec = {
        "base_config": "configs/tiny_cpu.yaml",
        "variants": {"lin": ["model.projection=linear"]},
        "grids": [{"variants": ["lin"], "seq_len": [256], "lr": [1e-3]}],
        **patch,
    }
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(sweep.SweepError, match=None) as e:
        sweep.load_sweep(str(path))
    assert message in str(e.value)
    proc = _cli([str(path), "--dry-run"])
    assert proc.returncode == 2 and message in proc.stderr


def test_unigram_reference_matches_a_direct_count(swept):
    """The report's context-free perplexity, against a plain-Python count of the same shards."""
    import collections

    import numpy as np

    cfg = sweep.load_sweep(str(swept["path"]), out=str(swept["out"]))
    path = sweep.data_dir(cfg.data, 128)
    m = json.loads((path / "manifest.json").read_text())
    special = set(m["special_ids"].values())

    def ids(split):
        return [
            int(t) for s in m["splits"][split]["shards"] for t in np.load(path / s["file"]).ravel()
        ]

    counts = collections.Counter(t for t in ids("train") if t not in special)
    total = sum(counts.values()) + 0.5 * (2000 - len(special))
    valid = [t for t in ids("valid") if t not in special]
    nll = -sum(math.log((counts[t] + 0.5) / total) for t in valid) / len(valid)
    assert sweep.unigram_perplexity(path) == pytest.approx(math.exp(nll), rel=1e-9)
    md = (swept["out"] / "report" / "report.md").read_text()
    assert f"is {sweep.unigram_perplexity(path):.1f}." in md


def test_classify_keeps_the_last_evals_context_meter():
    meter = {"unigram_loss": 7.2, "unigram_accuracy": 0.03, "context_gain_nats": 0.5}
    recs = [_rec("eval", 2, 7.0), {**_rec("eval", 4, 6.7), **meter, "context_gain_accuracy": 0.1}]
    r = sweep.classify(0, recs, 13.5, 1.0)
    assert (r["final_unigram_loss"], r["final_context_gain_nats"]) == (7.2, 0.5)
    assert r["final_context_gain_accuracy"] == 0.1
    assert sweep.classify(0, recs[:1], 13.5, 1.0)["final_context_gain_nats"] is None


def test_prebuilt_data_paths_per_sweep_and_variant(tmp_path):
    """data.path and a variant's data_path are used as they are, after checking their N."""
    for name, n in (("full", 256), ("pad", 256), ("short", 128)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text(json.dumps({"seq_len": n}))
    spec = {
        "base_config": "configs/tiny_cpu.yaml",
        "data": {"path": str(tmp_path / "full")},
        "variants": {
            "lin": ["model.projection=linear"],
            "lin_pad": {
                "overrides": ["model.projection=linear"],
                "data_path": str(tmp_path / "pad"),
            },
        },
        "grids": [{"variants": ["lin", "lin_pad"], "seq_len": [256], "lr": [1e-3]}],
    }
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(spec))
    cfg = sweep.load_sweep(str(path))
    assert cfg.variants["lin_pad"].data_path == str(tmp_path / "pad")
    assert cfg.variants["lin"].data_path is None
    assert sweep.ensure_data(cfg.data, 256) == tmp_path / "full"
    assert sweep.data_dir(cfg.data, 256) == tmp_path / "full"
    assert sweep.prebuilt_data(tmp_path / "pad", 256) == tmp_path / "pad"
    with pytest.raises(sweep.SweepError, match="rows of 128 tokens, the point needs N=256"):
        sweep.prebuilt_data(tmp_path / "short", 256)
    with pytest.raises(sweep.SweepError, match="no manifest.json"):
        sweep.prebuilt_data(tmp_path, 256)
