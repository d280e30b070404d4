"""The trainer compiled vs eager: the same job twice through ``launch/pretrain.py`` (one rank),
``train.compile=false`` then ``true``; step time and throughput from each run's metrics.jsonl.

    python -m bench.compile_bench --data data/stdlib [--config configs/tiny_cpu.yaml]
        [--steps 60] [--warmup 10] [--backend inductor] [--out DIR] [key=value ...]

The first ``--warmup`` steps of each run are left out (the compiled run compiles at step 1 and
recompiles once when the labelled count changes); the step time is the median of the rest.
``key=value`` overrides reach both runs (e.g. ``deepspeed.precision=fp32``). Writes
``DIR/results.json`` and ``DIR/results.md`` (one row per mode and the speed-up); run it alone
on the machine (BENCHMARKS.md says what ran alongside).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.common import BenchError, environment
from linformer_ds.dist_env import without_launcher_vars
from linformer_ds.fsio import read_jsonl

REPO = Path(__file__).resolve().parents[1]
FIXED = [
    "train.log_interval=1", "train.eval_interval=0", "logging.tensorboard=false",
    "checkpoint.save_interval=0", "checkpoint.save_final=false", "checkpoint.resume=never",
]  # fmt: skip


def run_mode(args: argparse.Namespace, compiled: bool) -> dict[str, Any]:
    """One trainer run; its median step time, tokens/s and MFU after the warm-up steps."""
    name = "compiled" if compiled else "eager"
    run_dir = Path(args.out) / name
    over = [f"data.path={args.data}", f"logging.dir={run_dir}",
            f"checkpoint.dir={run_dir / 'checkpoints'}", f"train.max_steps={args.steps}",
            f"train.compile={str(compiled).lower()}", f"train.compile_backend={args.backend}",
            *FIXED, *args.overrides]  # fmt: skip
    cmd = [sys.executable, str(REPO / "launch" / "pretrain.py"), "--config", args.config, *over]
    env = without_launcher_vars(os.environ)  # a job of its own
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("DS_ACCELERATOR", "cpu")
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "log.txt", "w") as log:
        code = subprocess.run(
            cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
        ).returncode
    if code != 0:
        tail = (run_dir / "log.txt").read_text().splitlines()[-5:]
        raise BenchError(f"{name} run failed (exit {code}): " + " | ".join(tail))
    recs = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("split") == "train"]
    timed = [r for r in recs if r["step"] > args.warmup]
    cfg = json.loads((run_dir / "config.json").read_text())
    seq_len = json.loads((Path(args.data) / "manifest.json").read_text())["seq_len"]
    t = cfg["train"]
    tokens = t["micro_batch_size"] * t["gradient_accumulation_steps"] * seq_len
    tps = statistics.median(r["tokens_per_s"] for r in timed)
    last = recs[-1]
    return {
        "mode": name,
        "backend": args.backend if compiled else "-",
        "steps_timed": len(timed),
        "tokens_per_step": tokens,
        "step_s": tokens / tps,
        "tokens_per_s": tps,
        "mfu": statistics.median(r["mfu"] for r in timed),
        "precision": cfg["deepspeed"]["precision"],
        "final_loss": last["loss"],
        "compile_seconds": last.get("compile_seconds"),
        "compile_graphs": last.get("compile_graphs"),
        "compile_graph_breaks": last.get("compile_graph_breaks"),
        "command": " ".join(cmd),
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    eager = rows[0]["step_s"]
    head = ("| mode | backend | precision | step (s, median) | tokens/s | MFU | speed-up | "
            "compile (s) | graphs | graph breaks | final loss |\n"
            "|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|")  # fmt: skip

    def cell(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    lines = [
        f"| {r['mode']} | {r['backend']} | {r['precision']} | {r['step_s']:.4f} | "
        f"{r['tokens_per_s']:.0f} | {r['mfu']:.3f} | {eager / r['step_s']:.2f}x | "
        f"{cell(r['compile_seconds'], '.1f')} | {cell(r['compile_graphs'], '')} | "
        f"{cell(r['compile_graph_breaks'], '')} | {r['final_loss']:.4f} |"
        for r in rows
    ]
    return "\n".join([head, *lines]) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="data_prep output (data.path)")
    p.add_argument("--config", default=str(REPO / "configs" / "tiny_cpu.yaml"))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10, help="first steps left out of the timing")
    p.add_argument("--backend", default="inductor", help="train.compile_backend")
    p.add_argument("--out", default="bench/results/compile_cpu")
    p.add_argument("overrides", nargs="*", help="key=value config overrides for both runs")
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        raise BenchError(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    if not (Path(args.data) / "manifest.json").is_file():
        raise BenchError(f"--data {args.data}: no manifest.json (run python -m data_prep first)")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        rows = [run_mode(args, compiled=False), run_mode(args, compiled=True)]
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    results = {"environment": environment("bench.compile_bench"), "rows": rows}
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    table = markdown(rows)
    (out / "results.md").write_text(table)
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
