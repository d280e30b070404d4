"""Downstream score of the English study: which manual section a paragraph comes from.

python studies/english_downstream.py build --corpus data/english/text/english.jsonl --out DIR
python studies/english_downstream.py run --sweep configs/sweeps/english_study.yaml --task DIR \\
    --work DIR2 --report-dir docs/quality_study/english

``build``: paragraphs (lines of 150-1500 characters, at least 20 words) of the six largest
sections of english.jsonl (``source`` = ``package:section/page.html``; hwmon left out: its pages
are one template), split by document (blake2b of the page path: about 30 % of each section's
pages are test pages), then a class-balanced sample with a fixed seed -> train.jsonl, test.jsonl
(``text``, ``label``) and task.json (counts, the majority baseline).
``run``: for every finished point of the sweep (``--only``: a subset; results already in
``--work`` are reused, so two ``--only`` runs side by side, then one plain run for the table), launch/export.py of its final checkpoint and
launch/finetune.py on the task (test split as validation); also untrained exports (one
optimizer step at lr 1e-12) of each architecture; writes downstream.json and downstream.md.
"""

import argparse
import collections
import hashlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from studies import sweep  # noqa: E402

CLASSES = (
    "linux-doc:userspace-api",
    "python3-doc:library",
    "linux-doc:admin-guide",
    "linux-doc:driver-api",
    "linux-doc:networking",
    "linux-doc:filesystems",
)
UNTRAINED = {  # architecture -> the variant whose overrides it takes
    "linear": "linear",
    "conv_hybrid": "conv_hybrid",
    "dense": "dense",
}


def section(source: str) -> str:
    """``package:section`` of a record's source, e.g. ``linux-doc:networking``."""
    pkg, _, path = source.partition(":")
    return f"{pkg}:{path.split('/')[0] if '/' in path else '(root)'}"


def is_test_page(source: str, fraction: float) -> bool:
    """The page's held-out side: blake2b of its path below ``fraction``."""
    h = int.from_bytes(hashlib.blake2b(source.encode(), digest_size=8).digest(), "big")
    return h / 2**64 < fraction


def build(corpus: Path, out: Path, n_train: int, n_test: int, fraction: float, seed: int) -> dict:
    """Write train.jsonl / test.jsonl / task.json under ``out``; returns task.json's dict."""
    pools: dict[str, dict[str, list[str]]] = {"train": {}, "test": {}}
    pages = collections.Counter()
    with open(corpus) as f:
        for line in f:
            rec = json.loads(line)
            label = section(rec["source"])
            if label not in CLASSES:
                continue
            split = "test" if is_test_page(rec["source"], fraction) else "train"
            pages[(split, label)] += 1
            for para in rec["text"].split("\n"):
                para = para.strip()
                if 150 <= len(para) <= 1500 and len(para.split()) >= 20:
                    pools[split].setdefault(label, []).append(para)
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    counts: dict[str, dict[str, int]] = {}
    for split, n in (("train", n_train), ("test", n_test)):
        rows = []
        for label in CLASSES:
            pool = sorted(set(pools[split].get(label, [])))
            take = rng.sample(pool, min(n, len(pool)))
            rows += [{"text": t, "label": label} for t in take]
            counts.setdefault(split, {})[label] = len(take)
        rng.shuffle(rows)
        with open(out / f"{split}.jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    train_major = max(counts["train"], key=lambda c: counts["train"][c])
    n_te = sum(counts["test"].values())
    task = {
        "corpus": str(corpus),
        "classes": list(CLASSES),
        "test_page_fraction": fraction,
        "seed": seed,
        "pages": {f"{s}:{lab}": n for (s, lab), n in sorted(pages.items())},
        "examples": counts,
        "majority_class": train_major,
        "majority_baseline_test_accuracy": counts["test"][train_major] / n_te,
    }
    (out / "task.json").write_text(json.dumps(task, indent=1))
    return task


def _run(cmd: list[str], log: Path) -> int:
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        return subprocess.run(cmd, cwd=sweep.REPO, stdout=f, stderr=subprocess.STDOUT).returncode


def untrained_checkpoint(cfg: sweep.SweepConfig, arch: str, work: Path, log: Path) -> Path:
    """One optimizer step at lr 1e-12 of ``arch`` (the sweep's base config): an untrained model
    with a checkpoint that export.py reads. Returns its checkpoint dir."""
    run = work / f"untrained_{arch}"
    ckpt = run / "checkpoints"
    if (ckpt / "latest").is_file():
        return ckpt
    v = cfg.variants[UNTRAINED[arch]]
    data = v.data_path or cfg.data.path
    cmd = [sys.executable, str(sweep.config.PRETRAIN), "--config", str(cfg.base_config)]
    cmd += list(cfg.base_overrides) + list(v.overrides)
    cmd += [
        "model.max_seq_len=1024",
        "model.k=128",
        f"data.path={data}",
        "train.micro_batch_size=4",
        "train.max_steps=1",
        "train.eval_interval=0",
        "scheduler.warmup_steps=0",
        "optimizer.lr=1e-12",
        f"logging.dir={run}",
        f"name=untrained_{arch}",
    ]
    if _run(cmd, log) != 0:
        raise RuntimeError(f"untrained {arch}: pretrain failed, see {log}")
    return ckpt


def export_and_finetune(
    ckpt: Path, name: str, task: Path, work: Path, args: argparse.Namespace, log: Path
) -> dict[str, Any] | None:
    """Export ``ckpt`` and fine-tune it on the task; the finetune results (None on failure)."""
    exp, ft = work / "exports" / name, work / "finetuned" / name
    res_path = ft / "finetune_results.json"
    if res_path.is_file():
        return json.loads(res_path.read_text())
    if not (exp / "config.json").is_file():
        cmd = [sys.executable, "launch/export.py", "--checkpoint", str(ckpt), "--out", str(exp)]
        if _run(cmd + ["--overwrite"], log) != 0:
            return None
    cmd = [sys.executable, "launch/finetune.py", "--model", str(exp)]
    cmd += ["--train", str(task / "train.jsonl"), "--validation", str(task / "test.jsonl")]
    cmd += ["--max-length", str(args.max_length), "--epochs", str(args.epochs)]
    cmd += ["--batch-size", str(args.batch_size), "--seed", str(args.seed)]
    cmd += ["--out", str(ft), "--overwrite"]
    if args.lr is not None:
        cmd += ["--lr", str(args.lr)]
    t0 = time.perf_counter()
    if _run(cmd, log) != 0:
        return None
    res = json.loads(res_path.read_text())
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    return res


def run(args: argparse.Namespace) -> int:
    """Export + fine-tune every finished sweep point and the untrained models; write tables."""
    cfg = sweep.load_sweep(args.sweep)
    task = Path(args.task)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    log = work / "downstream.log"
    info = json.loads((task / "task.json").read_text())
    rows = []
    jobs = []
    for arch in args.untrained:
        jobs.append((f"untrained_{arch}", arch, None))
    for r in sweep.collect(cfg):
        if r["status"] == "ok":
            jobs.append((r["id"], r["variant"], r))
    if args.only:
        jobs = [j for j in jobs if any(o in j[0] for o in args.only)]
    for name, variant, r in jobs:
        if r is None:
            ckpt = untrained_checkpoint(cfg, variant, work, log)
        else:
            ckpt = sweep.run_dir(cfg, sweep.Point(0, r["id"], [], variant, 0, None, 0, 0))
            ckpt = ckpt / "checkpoints"
        print(f"[downstream] {name}", flush=True)
        res = export_and_finetune(ckpt, name, task, work, args, log)
        rows.append(
            {
                "run": name,
                "variant": variant,
                "seed": None if r is None else r["seed"],
                "pretrained": r is not None,
                "test_accuracy": None if res is None else res["val_accuracy"],
                "history": None if res is None else res.get("history"),
                "wall_s": None if res is None else res.get("wall_s"),
            }
        )
        print(f"[downstream] {name}: {rows[-1]['test_accuracy']}", flush=True)
    out = Path(args.report_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: getattr(args, k) for k in ("max_length", "epochs", "batch_size", "seed", "lr")}
    doc = {"task": info, "finetune": settings, "rows": rows}
    (out / "downstream.json").write_text(json.dumps(doc, indent=1))
    md = [
        f"Task: {len(info['classes'])} classes ({', '.join(info['classes'])}); "
        f"train {sum(info['examples']['train'].values())}, test "
        f"{sum(info['examples']['test'].values())} paragraphs (test pages disjoint from train "
        f"pages). Majority baseline (test): {info['majority_baseline_test_accuracy']:.4f}.",
        f"Fine-tuning: {settings}.",
        "",
        "| run | variant | seed | test accuracy |",
        "|---|---|---|---|",
    ]
    for row in rows:
        acc = "failed" if row["test_accuracy"] is None else f"{row['test_accuracy']:.4f}"
        seed = "-" if row["seed"] is None else row["seed"]
        md.append(f"| {row['run']} | {row['variant']} | {seed} | {acc} |")
    (out / "downstream.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if all(r["test_accuracy"] is not None for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    """Command line: ``build`` or ``run``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write the labelled task")
    b.add_argument("--corpus", required=True, help="english.jsonl (scripts/english_corpus.py)")
    b.add_argument("--out", required=True)
    b.add_argument("--train-per-class", type=int, default=100)
    b.add_argument("--test-per-class", type=int, default=50)
    b.add_argument("--test-fraction", type=float, default=0.3, help="share of pages held out")
    b.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("run", help="export + fine-tune every finished point")
    r.add_argument("--sweep", required=True)
    r.add_argument("--task", required=True)
    r.add_argument("--work", required=True, help="exports, fine-tuned models, untrained runs")
    r.add_argument("--report-dir", required=True)
    r.add_argument("--untrained", nargs="*", default=list(UNTRAINED), choices=list(UNTRAINED))
    r.add_argument("--max-length", type=int, default=128)
    r.add_argument("--epochs", type=int, default=2)
    r.add_argument("--batch-size", type=int, default=16)
    r.add_argument("--lr", type=float, default=None)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--only", nargs="*", help="only the runs whose name contains one of these")
    args = p.parse_args(argv)
    if args.cmd == "build":
        task = build(
            Path(args.corpus),
            Path(args.out),
            args.train_per_class,
            args.test_per_class,
            args.test_fraction,
            args.seed,
        )
        print(json.dumps(task, indent=1))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
