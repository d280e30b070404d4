"""Run a quality sweep (variant x N x k x lr x seed) through launch/pretrain.py and report it.

python studies/run_sweep.py configs/sweeps/quality_study.yaml                 # all points, then report
python studies/run_sweep.py SWEEP.yaml --dry-run                              # list the points
python studies/run_sweep.py SWEEP.yaml --point 3                              # one point (array task)
python studies/run_sweep.py SWEEP.yaml --slurm [--submit]                     # sbatch array script
python studies/run_sweep.py SWEEP.yaml --report-only --report-dir docs/quality_study
python studies/run_sweep.py --inference-time --seq-lens 512 1024 2048 4096 --out docs/quality_study
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from studies import sweep  # noqa: E402

INFER_VARIANTS = {
    "dense": {"projection": "dense"},
    "linear_layerwise": {"projection": "linear", "sharing": "layerwise"},
    "conv_hybrid": {"projection": "hybrid", "sharing": "headwise"},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("sweep", nargs="?", help="sweep YAML (see configs/sweeps/)")
    p.add_argument("--out", help="output folder (default: the sweep file's `out`)")
    p.add_argument("--report-dir", help="where report.md, results.* and PNGs go (<out>/report)")
    p.add_argument("--dry-run", action="store_true", help="print the points and exit")
    p.add_argument("--point", type=int, help="run only the point with this index")
    p.add_argument("--report-only", action="store_true", help="rebuild the report, train nothing")
    p.add_argument("--no-report", action="store_true", help="do not write the report after runs")
    p.add_argument("--max-minutes", type=float, help="start no new point after this many minutes")
    p.add_argument("--slurm", action="store_true", help="write <out>/sweep_array.sbatch")
    p.add_argument("--submit", action="store_true", help="with --slurm: sbatch it + a report job")
    g = p.add_argument_group("inference timing (no sweep file)")
    g.add_argument("--inference-time", action="store_true", help="time encoder forwards")
    g.add_argument("--seq-lens", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    g.add_argument("--batch", type=int, default=4)
    g.add_argument("--iters", type=int, default=3)
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--hidden", type=int, default=128)
    g.add_argument("--heads", type=int, default=4)
    g.add_argument("--k", type=int, default=128)
    g.add_argument("--vocab", type=int, default=8000)
    g.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    g.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    g.add_argument("--stat", default="min", choices=["min", "median"], help="over --iters")
    return p.parse_args(argv)


def inference_main(args: argparse.Namespace) -> int:
    """Time the encoder forward of dense / linear / conv hybrid; write inference.{md,json}."""
    import platform

    import torch

    model = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        intermediate_size=4 * args.hidden,
        k=args.k,
    )
    rows = sweep.time_inference(
        args.seq_lens,
        INFER_VARIANTS,
        model,
        batch=args.batch,
        iters=args.iters,
        dtype=args.dtype,
        threads=args.threads,
        stat=args.stat,
    )
    table = sweep.inference_table(rows)
    head = (
        f"Encoder forward only, batch {args.batch}, {args.layers} layers, hidden "
        f"{args.hidden}, {args.heads} heads, k={args.k}, {args.dtype}, {args.stat} of "
        f"{args.iters}; torch {torch.__version__}, {platform.processor() or platform.machine()}"
        f", {torch.get_num_threads()} threads. In parentheses: dense time / variant time.\n\n"
    )
    print(head + table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "inference.md").write_text(head + table)
        (out / "inference.json").write_text(
            json.dumps({"args": vars(args), "rows": rows}, indent=1)
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; exit 0 when every point run is ok or diverged, 1 if one failed, 2 bad input."""
    args = parse_args(argv)
    if args.inference_time:
        return inference_main(args)
    if not args.sweep:
        print("error: give a sweep YAML (or --inference-time)", file=sys.stderr)
        return 2
    try:
        cfg = sweep.load_sweep(args.sweep, out=args.out)
    except sweep.SweepError as e:
        print(f"sweep error: {e}", file=sys.stderr)
        return 2
    points = cfg.points()
    if args.dry_run:
        for p in points:
            print(f"{p.index:3d} {p.id:50s} grids={','.join(p.grids)}")
        print(f"{len(points)} points; out: {cfg.out}")
        return 0
    if args.slurm:
        path = sweep.write_slurm(cfg, args.sweep)
        print(f"[slurm] wrote {path} ({len(points)} array tasks)")
        if not args.submit:
            print(f"[slurm] submit: sbatch {path}")
            return 0
        job = (
            subprocess.run(
                ["sbatch", "--parsable", str(path)], check=True, text=True, capture_output=True
            )
            .stdout.strip()
            .split(";")[0]
        )
        rep = [
            sys.executable,
            str(sweep.SWEEP_CLI),
            str(Path(args.sweep).resolve()),
            "--out",
            str(cfg.out),
            "--report-only",
        ]
        if args.report_dir:
            rep += ["--report-dir", str(Path(args.report_dir).resolve())]
        dep = subprocess.run(
            [
                "sbatch",
                "--parsable",
                f"--dependency=afterany:{job}",
                f"--chdir={sweep.REPO}",
                f"--output={cfg.out}/slurm/report_%j.out",
                "--wrap",
                " ".join(rep),
            ],
            check=True,
            text=True,
            capture_output=True,
        ).stdout.strip()
        print(f"[slurm] array job {job}; report job {dep} runs after it")
        return 0
    report_dir = Path(args.report_dir) if args.report_dir else None
    if args.report_only:
        print(f"[report] {sweep.write_report(cfg, report_dir)}")
        return 0
    if args.point is not None:
        if not 0 <= args.point < len(points):
            print(f"error: --point {args.point} outside [0, {len(points)})", file=sys.stderr)
            return 2
        try:
            res = sweep.run_point(cfg, points[args.point])
        except sweep.SweepError as e:
            print(f"sweep error: {e}", file=sys.stderr)
            return 2
        return 0 if res["status"] in sweep.FINISHED else 1
    try:
        results = sweep.run_sweep(cfg, max_minutes=args.max_minutes)
    except sweep.SweepError as e:
        print(f"sweep error: {e}", file=sys.stderr)
        return 2
    if not args.no_report:
        print(f"[report] {sweep.write_report(cfg, report_dir)}")
    return 0 if all(r["status"] in sweep.FINISHED for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
