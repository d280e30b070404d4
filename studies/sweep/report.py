"""The sweep's report, rebuilt from the points' result.json files at any time: report.md
(one row per point, pivots against N, k and lr), results.json, results.csv and the plots."""

import csv
import json
import math
import statistics
from pathlib import Path
from typing import Any

from studies.sweep.config import FINISHED, REPO, SweepConfig
from studies.sweep.data import data_dir, unigram_perplexity
from studies.sweep.plots import make_plots
from studies.sweep.runs import SERIES_AXES, collect, series


def _fmt(x: float | None, spec: str = ".4g") -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return format(x, spec)


def report_table(results: list[dict[str, Any]]) -> str:
    """Markdown table: one row per point, diverged/failed marked in the status column."""
    head = (
        "| run | grid | variant | N | k | lr | seed | steps | final val loss | final val ppl "
        "| best val ppl | unigram loss | context gain (nats) | train tok/s | wall s | status |"
    )
    rows = [head, "|" + "---|" * 16]
    for r in results:
        status = r["status"] + (f" ({r['reason']})" if r.get("reason") else "")
        if r["status"] in ("diverged", "failed"):
            status = f"**{status.replace('|', '/')}**"
        rows.append(
            f"| {r['id']} | {','.join(r['grids'])} | {r['variant']} | {r['seq_len']} | "
            f"{r['k'] if r['k'] is not None else '-'} | {r['lr']:g} | {r['seed']} | "
            f"{r.get('steps', '-')} | {_fmt(r.get('final_eval_loss'), '.4f')} | "
            f"{_fmt(r.get('final_eval_ppl'), '.2f')} | {_fmt(r.get('best_eval_ppl'), '.2f')} | "
            f"{_fmt(r.get('final_unigram_loss'), '.4f')} | "
            f"{_fmt(r.get('final_context_gain_nats'), '.4f')} | "
            f"{_fmt(r.get('tokens_per_s'), '.0f')} | {_fmt(r.get('wall_s'), '.0f')} | {status} |"
        )
    return "\n".join(rows) + "\n"


def pivot_tables(results: list[dict[str, Any]]) -> str:
    """Markdown: final validation perplexity against N, k and lr; one row per series (variant,
    the other axes and the seed) that has at least two values of that axis."""
    out = []
    done = [r for r in results if r["status"] in FINISHED]
    for axis, title in (("seq_len", "N"), ("k", "k"), ("lr", "learning rate")):
        by_key = series(done, axis)
        if not by_key:
            continue
        xs = sorted({x for s in by_key.values() for x in s if x is not None})
        names = [a for a in SERIES_AXES if a != axis]
        out += [f"Final validation perplexity vs {title}:", ""]
        out.append("| series | " + " | ".join(f"{title}={x:g}" for x in xs) + " |")
        out.append("|" + "---|" * (len(xs) + 1))
        for key, by_x in by_key.items():
            label = ", ".join(
                str(v) if n == "variant" else f"{n}={v:g}"
                for n, v in zip(names, key)
                if v is not None
            )
            cells = [_pivot_cell(by_x.get(x, [])) for x in xs]
            out.append(f"| {label} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out) + "\n"


def _pivot_cell(runs: list[dict[str, Any]]) -> str:
    """Mean final perplexity of the ok runs; diverged runs counted; '-' when none."""
    oks = [r["final_eval_ppl"] for r in runs if r["status"] == "ok"]
    div = sum(r["status"] == "diverged" for r in runs)
    cell = f"{statistics.mean(oks):.1f}" if oks else ""
    if div:
        cell += f" (**{div}/{len(runs)} diverged**)" if oks else "**DIVERGED**"
    elif len(oks) > 1:
        cell += f" (n={len(oks)})"
    return cell or "-"


def display_path(path: Path) -> str:
    """``path`` relative to the repository when it lies inside it."""
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def write_report(cfg: SweepConfig, report_dir: Path | None = None, plots: bool = True) -> Path:
    """results.json, results.csv, report.md and PNG plots under ``report_dir``."""
    rdir = Path(report_dir) if report_dir else cfg.out / "report"
    rdir.mkdir(parents=True, exist_ok=True)
    results = collect(cfg)
    (rdir / "results.json").write_text(json.dumps(results, indent=1))
    with open(rdir / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for r in results:
            w.writerow([",".join(r[c]) if c == "grids" else r.get(c, "") for c in CSV_COLUMNS])
    pngs = make_plots(results, rdir) if plots else []
    path = rdir / "report.md"
    path.write_text(report_markdown(cfg, results, pngs))
    return path


CSV_COLUMNS = (
    "id",
    "grids",
    "variant",
    "seq_len",
    "k",
    "lr",
    "seed",
    "status",
    "reason",
    "steps",
    "final_eval_loss",
    "final_eval_ppl",
    "best_eval_ppl",
    "final_eval_accuracy",
    "final_unigram_loss",
    "final_unigram_accuracy",
    "final_context_gain_nats",
    "final_context_gain_accuracy",
    "tokens_per_s",
    "wall_s",
)


def report_markdown(cfg: SweepConfig, results: list[dict[str, Any]], pngs: list[Path]) -> str:
    """report.md: status counts, the per-point table, the unigram reference, the pivots."""
    counts = {
        s: sum(r["status"] == s for r in results) for s in ("ok", "diverged", "failed", "pending")
    }
    md = [
        f"# Sweep report: {cfg.name}",
        "",
        f"Sweep file: `{display_path(cfg.path)}`; runs: `{display_path(cfg.out / 'runs')}`.",
        "",
        "Points: " + ", ".join(f"{v} {k}" for k, v in counts.items()) + ".",
        "",
        report_table(results),
    ]
    built = [
        n
        for n in sorted({r["seq_len"] for r in results})
        if (data_dir(cfg.data, n) / "manifest.json").is_file()
    ]
    if built:
        ppl = unigram_perplexity(data_dir(cfg.data, built[0]), cfg.eval_tokens)
        md += [
            f"Context-free reference: the unigram perplexity of the training split on the "
            f"validation tokens (N={built[0]} data) is {ppl:.1f}.",
            "",
        ]
    md += [pivot_tables(results)]
    md += [f"![{p.stem}]({p.name})" for p in pngs]
    return "\n".join(md) + "\n"
