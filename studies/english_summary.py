"""Summary tables of the English study from the sweep report's results.json (and the
downstream.json of studies/english_downstream.py): per variant the final eval loss (mean and
seed range), the unigram loss, the context gain, the relative gap to dense per seed, the
packing arms, the downstream accuracies.

python studies/english_summary.py docs/quality_study/english   # -> summary.md there
"""

import json
import statistics
import sys
from pathlib import Path
from typing import Any

ARMS = ("linear", "conv_hybrid", "dense")
LONG = ("linear_500", "dense_500")  # the optional 500-step points
PACKING = (("linear", "full, mixed"), ("linear_isolated", "full, isolated"), ("linear_pad", "pad"))


def _mean_range(xs: list[float], spec: str = ".4f") -> str:
    """``mean (min-max, n)``, or the value alone for one run."""
    if not xs:
        return "-"
    if len(xs) == 1:
        return format(xs[0], spec)
    return (
        f"{format(statistics.mean(xs), spec)} ({format(min(xs), spec)} to "
        f"{format(max(xs), spec)}, n={len(xs)})"
    )


def summary(results: list[dict[str, Any]], down: dict[str, Any] | None) -> str:
    """The markdown tables."""
    ok = [r for r in results if r["status"] == "ok"]
    by: dict[str, dict[int, dict[str, Any]]] = {}
    for r in ok:
        by.setdefault(r["variant"], {})[r["seed"]] = r
    md = [
        "| variant | seeds | eval loss, mid-run | final eval loss | unigram loss "
        "| context gain (nats) | eval accuracy | unigram accuracy | train tokens/s (median) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for v in ARMS + tuple(p for p, _ in PACKING[1:]) + LONG:
        runs = list(by.get(v, {}).values())
        if not runs and v in LONG:
            continue
        if not runs:
            md.append(f"| {v} | - | not run | | | | | | |")
            continue

        def col(key: str, runs: list[dict[str, Any]] = runs) -> list[float]:
            return [r[key] for r in runs if r.get(key) is not None]

        md.append(
            f"| {v} | {','.join(str(s) for s in sorted(by[v]))} "
            f"| {_mean_range([r['eval_curve'][0][1] for r in runs if len(r['eval_curve']) > 1])} "
            f"| {_mean_range(col('final_eval_loss'))} | {_mean_range(col('final_unigram_loss'))} "
            f"| {_mean_range(col('final_context_gain_nats'))} "
            f"| {_mean_range(col('final_eval_accuracy'))} "
            f"| {_mean_range(col('final_unigram_accuracy'))} "
            f"| {_mean_range(col('tokens_per_s'), '.0f')} |"
        )
    md += ["", "Relative eval-loss gap to dense, per seed ((loss - dense loss) / dense loss):", ""]
    md += ["| variant | per seed | mean |", "|---|---|---|"]
    dense = by.get("dense", {})
    for v, ref in (("linear", "dense"), ("conv_hybrid", "dense"), ("linear_500", "dense_500")):
        dense = by.get(ref, {})
        gaps = {
            s: (r["final_eval_loss"] - dense[s]["final_eval_loss"]) / dense[s]["final_eval_loss"]
            for s, r in sorted(by.get(v, {}).items())
            if s in dense
        }
        if not gaps:
            continue
        cells = ", ".join(f"seed {s}: {100 * g:+.2f} %" for s, g in gaps.items()) or "-"
        mean = f"{100 * statistics.mean(gaps.values()):+.2f} %" if gaps else "-"
        md.append(f"| {v} vs {ref} | {cells} | {mean} |")
    dense = by.get("dense", {})
    if 0 in dense and 1 in dense:
        d0, d1 = dense[0]["final_eval_loss"], dense[1]["final_eval_loss"]
        md.append(f"| dense seed 1 vs seed 0 | {100 * (d1 - d0) / d0:+.2f} % | |")
    md += ["", "Packing (linear, seed 0, equal steps and tokens a step):", ""]
    md += [
        "| arm | final eval loss | unigram loss | context gain (nats) | eval accuracy |",
        "|---|---|---|---|---|",
    ]
    for v, label in PACKING:
        r = by.get(v, {}).get(0)
        if r is None:
            md.append(f"| {label} | not run | | | |")
            continue
        md.append(
            f"| {label} | {r['final_eval_loss']:.4f} | {r['final_unigram_loss']:.4f} "
            f"| {r['final_context_gain_nats']:+.4f} | {r['final_eval_accuracy']:.4f} |"
        )
    if down:
        task = down["task"]
        md += [
            "",
            f"Downstream (test accuracy; majority baseline "
            f"{task['majority_baseline_test_accuracy']:.4f}, chance 1/{len(task['classes'])}):",
            "",
            "| model | per seed | mean |",
            "|---|---|---|",
        ]
        groups: dict[str, list[dict[str, Any]]] = {}
        for row in down["rows"]:
            key = row["variant"] if row["pretrained"] else f"untrained {row['variant']}"
            groups.setdefault(key, []).append(row)
        for key, rows in groups.items():
            accs = [r["test_accuracy"] for r in rows if r["test_accuracy"] is not None]
            cells = ", ".join(
                f"{'-' if r['seed'] is None else 'seed ' + str(r['seed'])}: "
                f"{'failed' if r['test_accuracy'] is None else format(r['test_accuracy'], '.4f')}"
                for r in rows
            )
            mean = f"{statistics.mean(accs):.4f}" if accs else "-"
            md.append(f"| {key} | {cells} | {mean} |")
    return "\n".join(md) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write summary.md beside results.json; print it."""
    d = Path((argv or sys.argv[1:])[0])
    results = json.loads((d / "results.json").read_text())
    dpath = d / "downstream.json"
    down = json.loads(dpath.read_text()) if dpath.is_file() else None
    text = summary(results, down)
    (d / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
