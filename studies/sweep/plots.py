"""PNG plots of a sweep: validation perplexity against step per variant, and final
validation perplexity against N, k and the learning rate (diverged runs marked)."""

import math
import statistics
from pathlib import Path
from typing import Any

from studies.sweep.config import FINISHED
from studies.sweep.runs import SERIES_AXES, series

AXES = (  # axis, x label, file, log base
    ("seq_len", "sequence length N", "final_ppl_vs_n.png", 2),
    ("k", "k", "final_ppl_vs_k.png", 2),
    ("lr", "learning rate", "final_ppl_vs_lr.png", 10),
)


def make_plots(results: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """PNG plots: val perplexity vs step per variant; final val perplexity vs N, k and lr."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    done = [r for r in results if r["status"] in FINISHED]
    variants = list(dict.fromkeys(r["variant"] for r in results))
    colors = {v: f"C{i}" for i, v in enumerate(variants)}
    figures = []
    if done:
        figures.append(("val_ppl_vs_step.png", _curves(plt, done, variants)))
    for axis, xlabel, name, base in AXES:
        by_key = series(done, axis)
        if by_key:
            figures.append((name, _against(plt, done, by_key, axis, xlabel, base, colors)))
    written = []
    for name, fig in figures:
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        written.append(out_dir / name)
    return written


def _curves(plt: Any, done: list[dict[str, Any]], variants: list[str]) -> Any:
    """One panel per variant: validation perplexity against step, one line per run."""
    vs = [v for v in variants if any(r["variant"] == v for r in done)]
    cols = min(2, len(vs))
    rows = math.ceil(len(vs) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.2 * rows), squeeze=False)
    for ax, v in zip(axes.flat, vs):
        for r in (r for r in done if r["variant"] == v):
            pts = [(s, p) for s, _, p in r["eval_curve"] if p is not None]
            if not pts:
                continue
            kk = f" k={r['k']}" if r["k"] is not None else ""
            label = f"N={r['seq_len']}{kk} lr={r['lr']:g} s{r['seed']}"
            div = r["status"] == "diverged"
            ys = [min(p, 1e6) for _, p in pts]
            ax.plot(
                [s for s, _ in pts],
                ys,
                ls="--" if div else "-",
                marker=".",
                label=label + (" DIVERGED" if div else ""),
            )
            if div:
                ax.plot(pts[-1][0], ys[-1], "x", color="red", ms=10, mew=2)
        ax.set_title(v)
        ax.set_xlabel("step")
        ax.set_ylabel("validation perplexity")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(vs) :]:
        ax.axis("off")
    return fig


def _against(
    plt: Any,
    done: list[dict[str, Any]],
    by_key: dict[tuple, dict[Any, list[dict]]],
    axis: str,
    xlabel: str,
    base: int,
    colors: dict[str, str],
) -> Any:
    """Final validation perplexity against ``axis``, one line per series; diverged points as
    crosses at the top; against k, dense runs of the same (N, lr, seed) as horizontal lines."""
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    oks = [r for by_x in by_key.values() for runs in by_x.values() for r in runs]
    top = max((r["final_eval_ppl"] for r in oks if r["status"] == "ok"), default=1.0)
    names = [a for a in SERIES_AXES if a != axis]
    for key, by_x in by_key.items():
        xs = sorted(by_x)
        ys = [_mean_ok(by_x[x]) for x in xs]
        div_x = [x for x in xs if any(r["status"] == "diverged" for r in by_x[x])]
        label = " ".join(
            f"{n}={v}" if n != "variant" else str(v) for n, v in zip(names, key) if v is not None
        )
        color = colors[key[0]]
        solid = "layerwise" in key[0] or key[0] == "dense"
        ax.plot(xs, ys, marker="o", color=color, label=label, ls="-" if solid else "--")
        if div_x:
            ax.plot(div_x, [top * 1.15] * len(div_x), "x", color=color, ms=11, mew=2.5)
    if axis == "k":
        shown = {(key[1], key[2], key[3]) for key in by_key}
        for r in done:
            if (
                r["k"] is None
                and r["status"] == "ok"
                and (r["seq_len"], r["lr"], r["seed"]) in shown
            ):
                ax.axhline(
                    r["final_eval_ppl"],
                    color=colors[r["variant"]],
                    ls=":",
                    lw=1,
                    label=f"{r['variant']} N={r['seq_len']} lr={r['lr']:g} seed={r['seed']}",
                )
    ax.set_xlabel(f"{xlabel}  (x at the top: diverged)")
    ax.set_ylabel("final validation perplexity")
    ax.set_xscale("log", base=base)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    return fig


def _mean_ok(runs: list[dict[str, Any]]) -> float:
    oks = [r["final_eval_ppl"] for r in runs if r["status"] == "ok"]
    return statistics.mean(oks) if oks else float("nan")
