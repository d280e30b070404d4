"""Merge the probe JSONs of one study (one run directory per kind and N, run two at a time) into
one ``probe.json`` + ``probe.png`` and print the docs table (accuracy +- standard error by
distance bucket).

    python studies/capability/merge.py OUT_DIR RUN_DIR [RUN_DIR ...]
"""

import json
import os
import sys

from linformer_ds.capability.probe import JSON_FILE, PNG_FILE, plot


def merge(dirs: list[str]) -> dict:
    results = [json.load(open(os.path.join(d, JSON_FILE))) for d in dirs]
    runs = []
    for d, res in zip(dirs, results):
        for r in res["runs"]:
            runs.append({**r, "source": os.path.basename(os.path.normpath(d)),
                         "batch": res["batch"], "items": res["items"],
                         "eval_rows": res["eval_rows"], "curriculum": res.get("curriculum", 0.0),
                         "queries": res.get("queries", 1)})  # fmt: skip
    first = results[0]
    same = ("seed", "lr", "min_distance", "vocab", "base_model")
    for res in results[1:]:
        for key in same:
            if res.get(key) != first.get(key):
                raise SystemExit(
                    f"{key} differs between the runs: {res.get(key)} vs {first.get(key)}"
                )
    steps = sorted({r["steps"] for r in runs})
    return {**{k: first[k] for k in same}, "steps": steps[0] if len(steps) == 1 else steps,
            "chance": {k: v for res in results for k, v in res["chance"].items()},
            "runs": runs}  # fmt: skip


def table(result: dict) -> str:
    width = max(len(r["buckets"]) for r in result["runs"])
    edges = max((r["buckets"] for r in result["runs"]), key=len)
    head = "| kind | N | steps | rows x queries a step | " + " | ".join(
        f"{b['from']}-{b['to']}" for b in edges) + " | all | bag | train s |"  # fmt: skip
    lines = [head, "|---|---:|---:|---:|" + "---:|" * (width + 3)]
    for r in sorted(result["runs"], key=lambda r: (r["task"], r["seq_len"])):
        cells = [f"{b['accuracy']:.2f} ± {b['stderr']:.2f}" for b in r["buckets"]]
        cells += [""] * (width - len(cells))
        lines.append(f"| {r['kind']} | {r['seq_len']:,} | {r['steps']:,} | "
                     f"{r['batch']} x {r['items'] * r['queries']} | " + " | ".join(cells)
                     + f" | **{r['accuracy']:.3f}** | {r['bag_accuracy']:.3f} | "
                     f"{r['train_seconds']:.0f} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    out, dirs = sys.argv[1], sys.argv[2:]
    result = merge(dirs)
    os.makedirs(out, exist_ok=True)
    why = plot(result, os.path.join(out, PNG_FILE))
    result["plot"] = why is None
    with open(os.path.join(out, JSON_FILE), "w") as f:
        json.dump(result, f, indent=2)
    print(table(result))
