"""LoRA vs full fine-tuning of an export on a labelled task (issue 32 item 4).

python studies/lora_recipe.py run --model /work/english/export5 --task /work/study/task_r5 \\
    --work W --seeds 0 1 2 --only full lora_all_r16a32_lr5e-3 --train-per-class 100 \\
    --test-per-class 50 --threads 1
python studies/lora_recipe.py run --model EXPORT --task keyword --work W2 --max-length 64 --threads 1
python studies/lora_recipe.py report --work W --out docs/quality_study/lora/english

The task is the one studies/english_downstream.py builds (``build``: train.jsonl, test.jsonl,
task.json); the protocol is launch/finetune.py's (linformer_ds/finetune.py: its data loading,
label mapping, tokenisation, padding and evaluation are called here, and the loop below is its
loop: AdamW without decay on biases/norms, 6 % linear warmup then linear decay, gradient clip 1.0,
batch 16, seeded shuffling). Each point of :data:`GRID` is trained the same way, either on every
weight (``full``), on the task head only (``head``) or through PEFT LoRA adapters (``lora``: the
head is in ``modules_to_save``, as PEFT's SEQ_CLS default). ``run`` writes one JSON per point and
seed under ``--work`` and skips those already there (resumable); ``report`` gathers them into
lora_recipe.json and lora_recipe.md.
"""

import argparse
import dataclasses
import json
import math
import os
import platform
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from linformer_ds import finetune as ft  # noqa: E402
from linformer_ds.optim import lr_scheduler, param_groups  # noqa: E402

ALL_LINEAR = ("qkv", "out", "fc1", "fc2")  # every nn.Linear of an encoder block


@dataclasses.dataclass(frozen=True)
class Setting:
    """One way to fine-tune: ``method`` full | head | lora; LoRA's targets, rank and alpha."""

    method: str
    lr: float
    epochs: float = 1.0
    targets: tuple[str, ...] = ()
    r: int = 8
    alpha: int = 8
    dropout: float = 0.0


# The documented recipe (docs/export.md "PEFT / LoRA"): every linear layer of the encoder,
# rank 16, alpha 32 (scale 2), lr 5e-3 (about 30x the full fine-tuning lr of this study, which is
# launch/finetune.py's default for hidden 256).
RECIPE = Setting("lora", lr=5e-3, epochs=1.0, targets=ALL_LINEAR, r=16, alpha=32)

GRID: dict[str, Setting] = {
    "full": Setting("full", lr=1.5e-4),  # english_downstream's reference (0.544 at seed 0)
    "full_lr5e-4": Setting("full", lr=5e-4),  # launch/finetune.py's largest default lr
    "head": Setting("head", lr=1e-3),  # frozen encoder, trained head: how much the features hold
    # the recipe the outside check used: qkv/out, PEFT defaults (r 8, alpha 8), lr 1e-3
    "lora_qkvout_r8_lr1e-3": Setting("lora", lr=1e-3, targets=("qkv", "out")),
    "lora_qkvout_r8_lr5e-3": Setting("lora", lr=5e-3, targets=("qkv", "out")),
    "lora_all_r8_lr1e-3": Setting("lora", lr=1e-3, targets=ALL_LINEAR),
    "lora_all_r8_lr5e-3": Setting("lora", lr=5e-3, targets=ALL_LINEAR),
    "lora_all_r16a32_lr1e-3": Setting("lora", lr=1e-3, targets=ALL_LINEAR, r=16, alpha=32),
    "lora_all_r16a32_lr2e-3": Setting("lora", lr=2e-3, targets=ALL_LINEAR, r=16, alpha=32),
    "lora_all_r16a32_lr5e-3": RECIPE,
    "lora_all_r16a32_lr5e-3_ep2": dataclasses.replace(RECIPE, epochs=2.0),
    "full_ep2": Setting("full", lr=1.5e-4, epochs=2.0),
}

# ``--task keyword``: the generated task of tests/test_lora_recipe.py (320 training rows, 3
# epochs: 60 steps), for a small export (hidden 32) whose full fine-tuning default lr is 5e-4.
KEYWORD = {"epochs": 3.0}
KEYWORD_GRID: dict[str, Setting] = {
    "full": Setting("full", lr=1.5e-3, **KEYWORD),
    "full_lr5e-4": Setting("full", lr=5e-4, **KEYWORD),
    "head": Setting("head", lr=5e-3, **KEYWORD),
    "lora_qkvout_r8_lr1e-3": Setting("lora", lr=1e-3, targets=("qkv", "out"), **KEYWORD),
    "lora_qkvout_r8_lr5e-3": Setting("lora", lr=5e-3, targets=("qkv", "out"), **KEYWORD),
    "lora_qkvout_r16a32_lr5e-3": Setting(
        "lora", lr=5e-3, targets=("qkv", "out"), r=16, alpha=32, **KEYWORD
    ),  # fmt: skip
    "lora_all_r8_lr1e-3": Setting("lora", lr=1e-3, targets=ALL_LINEAR, **KEYWORD),
    "lora_all_r8_lr5e-3": Setting("lora", lr=5e-3, targets=ALL_LINEAR, **KEYWORD),
    "lora_all_r16a16_lr5e-3": Setting(
        "lora", lr=5e-3, targets=ALL_LINEAR, r=16, alpha=16, **KEYWORD
    ),  # fmt: skip
    "lora_all_r16a32_lr1e-3": Setting(
        "lora", lr=1e-3, targets=ALL_LINEAR, r=16, alpha=32, **KEYWORD
    ),  # fmt: skip
    "lora_all_r16a32_lr2e-3": Setting(
        "lora", lr=2e-3, targets=ALL_LINEAR, r=16, alpha=32, **KEYWORD
    ),  # fmt: skip
    "lora_all_r16a32_lr5e-3": dataclasses.replace(RECIPE, **KEYWORD),
    "lora_all_r16a32_lr1e-2": Setting(
        "lora", lr=1e-2, targets=ALL_LINEAR, r=16, alpha=32, **KEYWORD
    ),  # fmt: skip
}
COLOURS = ("red", "green", "blue", "pink")
GREEK = ("alpha", "beta", "gamma", "delta")
FILLER = ("the", "a", "of", "and", "to", "in", "is", "was", "for", "on", "with", "as", "by")


def keyword_task(n: int, seed: int) -> tuple[list[str], list[int]]:
    """``(texts, labels)``: 6-12 filler words with one keyword inserted after the first; label 1
    when it is a colour, 0 when a Greek letter name; balanced, shuffled. The first token's
    state in a frozen encoder does not tell the label: attention has to bring it there."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        words = [rng.choice(FILLER) for _ in range(rng.randint(6, 12))]
        words.insert(rng.randrange(1, len(words) + 1), rng.choice(COLOURS if i % 2 else GREEK))
        rows.append((" ".join(words), i % 2))
    rng.shuffle(rows)
    return [t for t, _ in rows], [y for _, y in rows]


def subset(texts: list[str], labels: list[Any], per_class: int | None) -> tuple[list, list]:
    """The first ``per_class`` rows of every label (file order), or all rows."""
    if not per_class:
        return texts, labels
    seen: dict[str, int] = {}
    keep = []
    for t, y in zip(texts, labels):
        if seen.get(str(y), 0) < per_class:
            seen[str(y)] = seen.get(str(y), 0) + 1
            keep.append((t, y))
    return [t for t, _ in keep], [y for _, y in keep]


def load_model(model_dir: str, labels: list[Any]) -> Any:
    """The export as a sequence classifier (new head), as launch/finetune.py loads it."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the new head's "MISSING" report is expected
    return AutoModelForSequenceClassification.from_pretrained(
        model_dir,
        trust_remote_code=True,
        num_labels=len(labels),
        id2label={i: str(v) for i, v in enumerate(labels)},
        label2id={str(v): i for i, v in enumerate(labels)},
        ignore_mismatched_sizes=True,
        dtype=torch.float32,
    )


def prepare(model: Any, s: Setting) -> Any:
    """``model`` made trainable as ``s`` says: everything, the head only, or LoRA + head."""
    if s.method == "full":
        return model
    if s.method == "head":
        for name, p in model.named_parameters():
            p.requires_grad_(name.startswith(ft.HEAD_PREFIX))
        return model
    if s.method != "lora":
        raise ValueError(f"method must be full, head or lora, got {s.method!r}")
    from peft import LoraConfig, TaskType, get_peft_model

    config = LoraConfig(task_type=TaskType.SEQ_CLS, target_modules=list(s.targets), r=s.r,
                        lora_alpha=s.alpha, lora_dropout=s.dropout)  # fmt: skip
    return get_peft_model(model, config)


def train_eval(
    model_dir: str,
    train: tuple[list[str], list[Any]],
    test: tuple[list[str], list[Any]],
    s: Setting,
    seed: int,
    max_length: int = 128,
    batch_size: int = 16,
    log_every: int = 0,
) -> dict[str, Any]:
    """Fine-tune ``model_dir`` on ``train`` as ``s`` says (launch/finetune.py's loop and
    defaults) and return test accuracy, train loss, trainable parameter count, head change."""
    from transformers import AutoTokenizer

    random.seed(seed)
    torch.manual_seed(seed)
    labels = ft.label_mapping(train[1], test[1])
    ids = {str(v): i for i, v in enumerate(labels)}
    tr_l, te_l = [ids[str(v)] for v in train[1]], [ids[str(v)] for v in test[1]]
    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=True)
    tr_s, te_s = ft.encode(tok, train[0], max_length), ft.encode(tok, test[0], max_length)
    pad_id = int(tok.pad_token_id)
    model = prepare(load_model(model_dir, labels), s)
    head0 = {n: p.detach().clone() for n, p in model.named_parameters()
             if p.requires_grad and "classifier" in n}  # fmt: skip
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(param_groups(model, 0.01), lr=s.lr)
    total = max(1, math.ceil(s.epochs * math.ceil(len(tr_s) / batch_size)))
    sched = lr_scheduler(opt, int(0.06 * total), total, decay="linear")
    rng, order, step, t0, losses = random.Random(seed), list(range(len(tr_s))), 0, time.time(), []
    while step < total:
        rng.shuffle(order)
        model.train()
        for i in range(0, len(order), batch_size):
            if step >= total:
                break
            idx = order[i : i + batch_size]
            x, mask = ft.pad_batch([tr_s[j] for j in idx], pad_id)
            out = model(
                input_ids=x, attention_mask=mask, labels=torch.tensor([tr_l[j] for j in idx])
            )
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(out.loss.detach()))
            step += 1
            if log_every and step % log_every == 0:
                print(f"[lora_recipe] step {step}/{total} loss {losses[-1]:.4f} "
                      f"{time.time() - t0:.0f} s", flush=True)  # fmt: skip
    train_s = time.time() - t0
    acc = ft.evaluate(model, te_s, te_l, pad_id, 64)
    moved = {
        n: float((p.detach() - head0[n]).norm()) for n, p in model.named_parameters() if n in head0
    }
    tail = losses[-max(1, len(losses) // 10) :]
    return {
        "test_accuracy": acc,
        "train_loss_last10pct": sum(tail) / len(tail),
        "train_loss_first": losses[0],
        "steps": step,
        "trainable_params": trainable,
        "total_params": total_params,
        "head_update_norm": round(sum(moved.values()), 4),
        "train_s": round(train_s, 1),
        "eval_s": round(time.time() - t0 - train_s, 1),
    }


def read_task(task: Path, train_per_class: int | None, test_per_class: int | None) -> tuple:
    """``(train, test, info)`` of a studies/english_downstream.py task directory."""
    tr_x, tr_y, te_x, te_y = ft.load_splits(str(task / "train.jsonl"), str(task / "test.jsonl"))
    info = json.loads((task / "task.json").read_text())
    return subset(tr_x, tr_y, train_per_class), subset(te_x, te_y, test_per_class), info


def run(args: argparse.Namespace) -> int:
    """Train every selected point of :data:`GRID` at every seed; one JSON each under --work."""
    torch.set_num_threads(args.threads)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.task == "keyword":
        grid, train, test = KEYWORD_GRID, keyword_task(320, 1), keyword_task(200, 2)
    else:
        grid = GRID
        train, test, _ = read_task(Path(args.task), args.train_per_class, args.test_per_class)
    names = args.only or list(grid)
    for name in names:
        for seed in args.seeds:
            path = work / f"{name}_s{seed}.json"
            if path.is_file():
                continue
            s = grid[name]
            print(f"[lora_recipe] {name} seed {seed}: {s}", flush=True)
            res = train_eval(args.model, train, test, s, seed, args.max_length, args.batch_size, 10)
            doc = {"name": name, "seed": seed, "setting": dataclasses.asdict(s), **res,
                   "model": os.path.basename(os.path.normpath(args.model)),
                   "task": os.path.basename(os.path.normpath(args.task)),
                   "n_train": len(train[0]), "n_test": len(test[0]),
                   "max_length": args.max_length, "batch_size": args.batch_size,
                   "threads": args.threads, "beside": args.beside,
                   "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                   "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
            path.write_text(json.dumps(doc, indent=1))
            print(f"[lora_recipe] {name} seed {seed}: accuracy {res['test_accuracy']:.4f} "
                  f"({res['train_s']} s)", flush=True)  # fmt: skip
    return 0


def summarise(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean test accuracy per point over its seeds, and its fraction of ``full``'s mean
    (over the seeds both have)."""
    by: dict[str, dict[int, dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["name"], {})[r["seed"]] = r
    full = by.get("full", {})
    out = []
    order = list(dict.fromkeys([*GRID, *KEYWORD_GRID]))
    for name in [n for n in order if n in by] + sorted(set(by) - set(order)):
        runs = by[name]
        accs = [runs[s]["test_accuracy"] for s in sorted(runs)]
        common = sorted(set(runs) & set(full))
        frac = None
        if common:
            ref = sum(full[s]["test_accuracy"] for s in common) / len(common)
            frac = sum(runs[s]["test_accuracy"] for s in common) / len(common) / ref
        any_run = next(iter(runs.values()))
        out.append({"name": name, "setting": any_run["setting"], "seeds": sorted(runs),
                    "test_accuracy": accs, "mean": sum(accs) / len(accs),
                    "fraction_of_full": frac, "trainable_params": any_run["trainable_params"],
                    "train_s": [runs[s]["train_s"] for s in sorted(runs)],
                    "head_update_norm": [runs[s]["head_update_norm"] for s in sorted(runs)]})  # fmt: skip
    return out


def report(args: argparse.Namespace) -> int:
    """Gather --work's JSONs into lora_recipe.json and lora_recipe.md under --out."""
    rows = [json.loads(p.read_text()) for p in sorted(Path(args.work).glob("*_s*.json"))]
    if not rows:
        print(f"no results under {args.work}", file=sys.stderr)
        return 1
    table = summarise(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    r0 = rows[0]
    doc = {"recipe": dataclasses.asdict(RECIPE), "summary": table, "runs": rows}
    (out / "lora_recipe.json").write_text(json.dumps(doc, indent=1))
    md = [
        *([args.title, ""] if args.title else []),
        f"Model {r0['model']}, task {r0['task']} (train {r0['n_train']}, test {r0['n_test']} "
        f"rows), length {r0['max_length']}, batch {r0['batch_size']}, launch/finetune.py's "
        f"loop; {r0['machine']}, threads: {r0['threads']}, nice 10; beside: {r0['beside']}.",
        "",
        "| point | method | targets | r | alpha | lr | epochs | trainable | seeds | test accuracy "
        "| mean | fraction of full |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in table:
        s = t["setting"]
        lora = s["method"] == "lora"
        frac = "-" if t["fraction_of_full"] is None else f"{t['fraction_of_full']:.3f}"
        md.append(
            f"| {t['name']} | {s['method']} | {','.join(s['targets']) if lora else '-'} "
            f"| {s['r'] if lora else '-'} | {s['alpha'] if lora else '-'} | {s['lr']:g} "
            f"| {s['epochs']:g} | {t['trainable_params']} | {','.join(map(str, t['seeds']))} "
            f"| {', '.join(f'{a:.4f}' for a in t['test_accuracy'])} | {t['mean']:.4f} | {frac} |"
        )
    (out / "lora_recipe.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command line: ``run`` or ``report``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="train the grid's points (skips finished ones)")
    r.add_argument("--model", required=True, help="an export (launch/export.py)")
    r.add_argument("--task", required=True,
                   help="studies/english_downstream.py build's directory, or 'keyword' (the "
                   "generated task of tests/test_lora_recipe.py, KEYWORD_GRID)")  # fmt: skip
    r.add_argument("--work", required=True, help="one JSON per point and seed")
    r.add_argument("--only", nargs="*", choices=sorted(set(GRID) | set(KEYWORD_GRID)))
    r.add_argument("--seeds", nargs="*", type=int, default=[0])
    r.add_argument("--train-per-class", type=int, default=None, help="first N of each class")
    r.add_argument("--test-per-class", type=int, default=None)
    r.add_argument("--max-length", type=int, default=128)
    r.add_argument("--batch-size", type=int, default=16)
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--beside", default="", help="what else ran on the machine (recorded)")
    q = sub.add_parser("report", help="gather the JSONs into a table")
    q.add_argument("--work", required=True)
    q.add_argument("--out", required=True)
    q.add_argument("--title", default="", help="a first paragraph for the md table")
    args = p.parse_args(argv)
    return run(args) if args.cmd == "run" else report(args)


if __name__ == "__main__":
    sys.exit(main())
