"""Running points: each one the real trainer (``launch/pretrain.py``) in its own process,
classified ok / diverged / failed from its exit code and metrics.jsonl."""

import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from linformer_ds.fsio import atomic_write_json, read_jsonl
from studies.sweep.config import EXIT_NONFINITE, FINISHED, PRETRAIN, REPO, Point, SweepConfig
from studies.sweep.data import ensure_data, prebuilt_data


def run_dir(cfg: SweepConfig, point: Point) -> Path:
    """Where a point's trainer output and result.json live."""
    return cfg.out / "runs" / point.id


def point_overrides(cfg: SweepConfig, point: Point, data_path: Path) -> list[str]:
    """The trainer's ``key=value`` overrides for one point (base, variant, then per point)."""
    ov = list(cfg.base_overrides) + list(cfg.variants[point.variant].overrides)
    ov += [f"model.max_seq_len={point.seq_len}", f"optimizer.lr={point.lr}"]
    if point.k is not None:
        ov.append(f"model.k={point.k}")
    ov += [f"train.seed={point.seed}", f"data.path={data_path}"]
    ov += [f"logging.dir={run_dir(cfg, point)}", f"name={cfg.name}-{point.id}"]
    if cfg.tokens_per_step is not None:
        mb = max(1, cfg.tokens_per_step // point.seq_len)
        ov.append(f"train.micro_batch_size={mb}")
        if cfg.eval_tokens is not None:
            ov.append(f"train.eval_batches={max(1, cfg.eval_tokens // (mb * point.seq_len))}")
    return ov


def classify(
    returncode: int | None, records: list[dict], max_loss: float, max_rise: float
) -> dict[str, Any]:
    """Status (ok/diverged/failed), reason and summary numbers of one finished run."""
    evals = [r for r in records if r.get("split") == "eval"]
    trains = [r for r in records if r.get("split") == "train"]
    curve = [[r["step"], r["loss"], r.get("perplexity", _ppl(r["loss"]))] for r in evals]
    status, reason = "ok", ""
    bad_train = [r for r in trains if not math.isfinite(r["loss"])]
    bad_eval = [r for r in evals if not math.isfinite(r["loss"])]
    high = [r for r in trains + evals if math.isfinite(r["loss"]) and r["loss"] > max_loss]
    if returncode == EXIT_NONFINITE:
        status, reason = "diverged", "non-finite loss (trainer exit 3)"
    elif bad_train or bad_eval:
        r = (bad_train or bad_eval)[0]
        status, reason = "diverged", f"non-finite {r['split']} loss at step {r['step']}"
    elif high:
        r = high[0]
        status = "diverged"
        reason = f"{r['split']} loss {r['loss']:.3g} > {max_loss:.3g} at step {r['step']}"
    elif evals and min(e["loss"] for e in evals) + max_rise < evals[-1]["loss"]:
        best = min(e["loss"] for e in evals)
        status = "diverged"
        reason = f"final eval loss {evals[-1]['loss']:.3f} > best {best:.3f} + {max_rise}"
    elif returncode != 0:
        status, reason = "failed", f"trainer exit code {returncode}"
    finite = [e for e in evals if math.isfinite(e["loss"])]
    tps = [r["tokens_per_s"] for r in trains if "tokens_per_s" in r]
    return {
        "status": status,
        "reason": reason,
        "steps": max((r["step"] for r in records), default=0),
        "final_eval_loss": evals[-1]["loss"] if evals else None,
        "final_eval_ppl": _ppl(evals[-1]["loss"]) if evals else None,
        "best_eval_ppl": _ppl(min(e["loss"] for e in finite)) if finite else None,
        "final_eval_accuracy": evals[-1].get("mlm_accuracy") if evals else None,
        # the context meter of the last eval (absent from older trainers' records)
        **{f"final_{m}": evals[-1].get(m) if evals else None for m in CONTEXT_METER},
        "final_train_loss": trains[-1]["loss"] if trains else None,
        "tokens_per_s": statistics.median(tps) if tps else None,
        "eval_curve": curve,
    }


CONTEXT_METER = (
    "hidden_loss", "hidden_accuracy", "unigram_loss", "unigram_accuracy", "context_gain_nats",
    "context_gain_accuracy",
)  # fmt: skip


def _ppl(loss: float) -> float:
    return math.exp(min(loss, 50.0)) if math.isfinite(loss) else float("inf")


def run_point(cfg: SweepConfig, point: Point, log: Any = print) -> dict[str, Any]:
    """Train one point (unless already finished); writes and returns its result.json dict."""
    rdir = run_dir(cfg, point)
    result_path = rdir / "result.json"
    if result_path.is_file():
        old = json.loads(result_path.read_text())
        if old.get("status") in FINISHED:
            log(f"[skip] {point.id}: already {old['status']}")
            return old
    vpath = cfg.variants[point.variant].data_path
    data_path = (
        prebuilt_data(Path(vpath), point.seq_len)
        if vpath
        else ensure_data(cfg.data, point.seq_len, log)
    )
    if rdir.exists():  # an interrupted or failed attempt: start clean (metrics.jsonl appends)
        shutil.rmtree(rdir)
    rdir.mkdir(parents=True)
    cmd = [*cfg.launcher, str(PRETRAIN), "--config", str(cfg.base_config)]
    cmd += point_overrides(cfg, point, data_path)
    log(f"[run] {point.index}: {point.id}")
    t0 = time.perf_counter()
    returncode = _train(cfg, cmd, rdir / "train.log")
    wall = time.perf_counter() - t0
    res = classify(
        returncode, read_jsonl(rdir / "metrics.jsonl"), cfg.divergence_loss(), cfg.max_rise
    )
    if returncode is None and res["status"] == "ok":
        res["status"], res["reason"] = "failed", f"timeout after {cfg.point_timeout_s}s"
    if res["status"] == "failed":
        tail = (rdir / "train.log").read_text().splitlines()[-5:]
        res["reason"] += ": " + " | ".join(tail)[-500:]
    result = {
        **asdict(point),
        **res,
        "returncode": returncode,
        "wall_s": round(wall, 2),
        "command": shlex.join(cmd),
    }
    atomic_write_json(result_path, result)
    ppl = result["final_eval_ppl"]
    log(
        f"[{result['status']}] {point.id}: {wall:.0f}s, final eval ppl "
        f"{'-' if ppl is None else f'{ppl:.4g}'} {result['reason']}"
    )
    return result


def _train(cfg: SweepConfig, cmd: list[str], log_path: Path) -> int | None:
    """Run the trainer command (output to ``log_path``); its exit code, None on timeout."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **cfg.env)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    with open(log_path, "w") as logf:
        logf.write("$ " + shlex.join(cmd) + "\n")
        logf.flush()
        try:
            proc = subprocess.run(
                cmd,
                cwd=REPO,
                env=env,
                stdout=logf,
                stderr=subprocess.STDOUT,
                timeout=cfg.point_timeout_s,
            )
        except subprocess.TimeoutExpired:
            return None
    return proc.returncode


def run_sweep(
    cfg: SweepConfig,
    only: Sequence[int] | None = None,
    max_minutes: float | None = None,
    log: Any = print,
) -> list[dict[str, Any]]:
    """Run the points in order (skipping finished ones); stop starting new ones after
    ``max_minutes``. Returns the result dicts of the points run or skipped."""
    points = cfg.points()
    if only is not None:
        points = [points[i] for i in only]
    t0 = time.perf_counter()
    results = []
    for p in points:
        if max_minutes is not None and (time.perf_counter() - t0) / 60 > max_minutes:
            log(f"[budget] {max_minutes} min spent; not starting {p.id} and later points")
            break
        results.append(run_point(cfg, p, log))
    return results


def collect(cfg: SweepConfig) -> list[dict[str, Any]]:
    """result.json of every point (``status='pending'`` for points not run yet), in grid order."""
    out = []
    for p in cfg.points():
        path = run_dir(cfg, p) / "result.json"
        if path.is_file():
            res = json.loads(path.read_text())
            res["grids"] = p.grids
            out.append(res)
        else:
            out.append({**asdict(p), "status": "pending", "reason": "", "eval_curve": []})
    return out


SERIES_AXES = ("variant", "seq_len", "k", "lr", "seed")  # what identifies a run


def series(results: list[dict[str, Any]], axis: str) -> dict[tuple, dict[Any, list[dict]]]:
    """Group finished results by everything but ``axis``: key -> axis value -> runs (one series
    per seed: seeds shift all variants alike, so a mean over unequal seed sets would mislead)."""
    keys = [a for a in SERIES_AXES if a != axis]
    out: dict[tuple, dict[Any, list[dict]]] = {}
    for r in results:
        if r["status"] not in FINISHED:
            continue
        key = tuple(r[a] for a in keys)
        out.setdefault(key, {}).setdefault(r[axis], []).append(r)
    return {k: v for k, v in out.items() if len(v) >= 2}
