"""Trainable synthetic probes: can an attention kind retrieve a token from far away?

    python -m linformer_ds.capability probe --kinds "dense,linear:k=8" [--tasks recall,copy]
        [--seq-len 512] [--steps S] [--batch B] [--seed S] [--out DIR]
        [--curriculum F] [--curriculum-batch rows|tokens]

Every kind trains the same small MLM model from scratch (the same base options, data, seed,
steps, AdamW and schedule; plain PyTorch, no DeepSpeed) on rows of :mod:`.tasks`, then is scored
on held-out rows: top-1 accuracy of the probe's labels by distance bucket (``[lo, 2 lo)``
tokens between the query or the copy and what it needs).

Kinds (``--kinds``, comma-separated; commas inside ``[...]`` belong to the value)::

    LABEL[:OPTION=VALUE[:OPTION=VALUE...]]

``LABEL`` names the run; when it is an attention kind (``projection_names()``: the registered
kinds and ``dense``, or ``hybrid``) and no ``projection`` / ``layer_projections`` is given, it is
the model's ``projection``. ``OPTION=VALUE`` overrides a :class:`ModelConfig` field for that kind
only (the value read as YAML: ``k=8``, ``local_window=128``, ``layer_projections=[dense,linear,
linear]``). ``--model OPTION=VALUE`` (repeatable) changes the base of every kind. E.g.::

    --kinds "dense,linear,window:projection=linear:local_window=128,
             modernbert:layer_projections=[local,dense]:local_window=128"
"""

import argparse
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, fields, replace
from typing import Any

import numpy as np
import torch
import yaml

from linformer_ds.context_curve import write_result
from linformer_ds.errors import LinformerError

from .tasks import TASKS, TaskSpec, Vocab, bag_accuracy, make_rows

JSON_FILE, PNG_FILE = "probe.json", "probe.png"
BASE_MODEL = {  # the probe model every kind starts from (--model changes it; docs/capability.md)
    "hidden_size": 64, "num_layers": 2, "num_heads": 1, "intermediate_size": 256,
    "dropout": 0.0, "attention_dropout": 0.0, "k": 128, "sharing": "layerwise",
    "positions": "rope", "rope_base": 1e8, "initializer_range": 0.1, "local_mixer": "layers",
}  # fmt: skip


class ProbeError(LinformerError, ValueError):
    """Bad probe options: one line naming them."""


# ========================================================================================= kinds
def split_top(text: str, sep: str) -> list[str]:
    """``text`` split at ``sep`` outside brackets."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "[{("
        depth -= ch in "]})"
        if ch == sep and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    out.append(cur)
    return [x.strip() for x in out if x.strip()]


def parse_option(item: str, where: str) -> tuple[str, Any]:
    """``"k=8"`` -> ``("k", 8)`` (the value read as YAML)."""
    from linformer_ds.model import ModelConfig

    name, eq, value = item.partition("=")
    name = name.strip()
    if not eq or not name:
        raise ProbeError(f"{where}: {item!r} is not OPTION=VALUE")
    if name not in {f.name for f in fields(ModelConfig)}:
        raise ProbeError(f"{where}: {name!r} is not a model option (linformer_ds.model.config)")
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        raise ProbeError(f"{where}: {item!r}: the value is not YAML") from None
    if isinstance(parsed, str) and parsed[:1].isdigit():  # YAML 1.1 reads 1e8 as a string
        try:
            parsed = float(parsed)
        except ValueError:
            pass
    return name, parsed


def parse_kinds(text: str) -> list[tuple[str, dict[str, Any]]]:
    """``"dense,linear:k=8"`` -> ``[("dense", {}), ("linear", {"k": 8})]``."""
    from linformer_ds.model import projection_names

    out: list[tuple[str, dict[str, Any]]] = []
    for spec in split_top(text, ","):
        label, *items = split_top(spec, ":")
        overrides = dict(parse_option(x, f"--kinds {spec}") for x in items)
        if "projection" not in overrides and "layer_projections" not in overrides:
            if label not in projection_names() + ("hybrid",):
                raise ProbeError(
                    f"--kinds {spec}: {label!r} is not an attention kind "
                    f"({', '.join(projection_names() + ('hybrid',))}): name one with "
                    f"projection=KIND or layer_projections=[...]"
                )
            overrides["projection"] = label
        if label in [x[0] for x in out]:
            raise ProbeError(f"--kinds: {label!r} is given twice")
        out.append((label, overrides))
    if not out:
        raise ProbeError("--kinds: no kind given")
    return out


def kind_config(base: dict[str, Any], overrides: dict[str, Any], seq_len: int, vocab: Vocab
                ) -> Any:  # fmt: skip
    """The ``ModelConfig`` of one kind at ``seq_len`` (k clipped to N for kinds with summaries)."""
    from linformer_ds.model import ModelConfig, ModelConfigError

    cfg = {"vocab_size": vocab.size, "max_seq_len": seq_len, **base, **overrides}
    if cfg.get("layer_projections") is not None:
        cfg.setdefault("num_layers", len(cfg["layer_projections"]))
    if isinstance(cfg.get("k"), int) and cfg["k"] > seq_len:
        cfg["k"] = seq_len
    try:
        return ModelConfig.from_dict(cfg)
    except (ModelConfigError, TypeError) as e:
        raise ProbeError(f"model {overrides}: {e}") from None


# ===================================================================================== training
def buckets(min_distance: int, seq_len: int) -> list[int]:
    """Lower edges of the distance buckets ``[lo, 2 lo)`` from ``min_distance`` up to N."""
    out, lo = [], min_distance
    while lo < seq_len:
        out.append(lo)
        lo *= 2
    return out


def _lr(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def curriculum_spec(spec: TaskSpec, vocab: Vocab, step: int, steps: int, curriculum: float,
                    start: int) -> TaskSpec:  # fmt: skip
    """The rows of training step ``step``: during the first ``curriculum`` fraction of the
    steps, rows grow geometrically from ``start`` tokens to N, with items in proportion to
    their length (the same task, shorter distances); then ``spec``."""
    ramp = int(curriculum * steps)
    if step >= ramp or start >= spec.seq_len:
        return spec
    n = int(round(start * (spec.seq_len / start) ** (step / ramp)))
    items = max(1, round(spec.items * n / spec.seq_len))
    short = replace(spec, seq_len=n, items=items)
    while items > 1 and short.check(vocab):
        items -= 1
        short = replace(spec, seq_len=n, items=items)
    return spec if short.check(vocab) else short


def curriculum_rows(batch: int, seq_len: int, row_len: int, mode: str) -> int:
    """Rows of a training step whose rows hold ``row_len`` of the task's ``seq_len`` tokens:
    ``batch`` ("rows"), or as many as hold ``batch`` full rows' tokens ("tokens"), at least
    ``batch``."""
    if mode == "tokens":
        return max(batch, batch * seq_len // row_len)
    return batch


def train(config: Any, spec: TaskSpec, vocab: Vocab, steps: int, batch: int, lr: float,
          seed: int, log: Callable[[str], None] | None = None, label: str = "",
          curriculum: float = 0.0, curriculum_start: int = 64, curriculum_batch: str = "rows"
          ) -> tuple[Any, dict[str, Any]]:  # fmt: skip
    """The model of ``config`` trained ``steps`` AdamW steps on fresh rows of ``spec`` (shorter
    rows first: :func:`curriculum_spec`; ``curriculum_batch``: "rows", ``batch`` rows of every
    length, or "tokens", ``batch`` rows' worth of tokens, so a short row's step holds as many
    labels as a full one's)."""
    from linformer_ds.model import LinformerForMaskedLMPretraining

    torch.manual_seed(seed)
    model = LinformerForMaskedLMPretraining(config)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, steps // 10)
    t0 = last = time.monotonic()
    losses: list[float] = []
    model.train()
    for step in range(steps):
        now_spec = curriculum_spec(spec, vocab, step, steps, curriculum, curriculum_start)
        rows = curriculum_rows(batch, spec.seq_len, now_spec.seq_len, curriculum_batch)
        ids, labels, _ = make_rows(now_spec, vocab, rows, seed=(seed + 1) * 1_000_003 + step)
        for g in opt.param_groups:
            g["lr"] = _lr(step, steps, lr, warmup)
        x, y = torch.from_numpy(ids), torch.from_numpy(labels)
        loss = model(x, torch.ones_like(x), y).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        now = time.monotonic()
        if log is not None and (now - last > 15 or step + 1 == steps):
            last = now
            recent = float(np.mean(losses[-50:]))
            rows = f" (rows of {now_spec.seq_len})" if now_spec is not spec else ""
            log(f"[probe] {label} {spec.task} N={spec.seq_len}: step {step + 1}/{steps}{rows}, "
                f"loss {recent:.3f}, {now - t0:.0f} s")  # fmt: skip
    return model.eval(), {"train_seconds": time.monotonic() - t0,
                          "final_train_loss": float(np.mean(losses[-50:]))}  # fmt: skip


@torch.no_grad()
def evaluate(model: Any, spec: TaskSpec, vocab: Vocab, rows: int, seed: int, batch: int = 16
             ) -> dict[str, Any]:  # fmt: skip
    """Accuracy and loss of the probe's labels on ``rows`` held-out rows, overall and by
    distance bucket."""
    ids, labels, dist = make_rows(spec, vocab, rows, seed=10_000_019 + seed)
    correct, losses, dists = [], [], []
    for b in range(0, rows, batch):
        x, y = torch.from_numpy(ids[b : b + batch]), torch.from_numpy(labels[b : b + batch])
        out = model(x, torch.ones_like(x), y)
        ce = torch.nn.functional.cross_entropy(
            out.labelled_logits.float(), out.labelled_targets, reduction="none"
        )
        correct.append((out.labelled_logits.argmax(-1) == out.labelled_targets).numpy())
        losses.append(ce.numpy())
        dists.append(dist[b : b + batch][labels[b : b + batch] != -100])
    c, lo, d = np.concatenate(correct), np.concatenate(losses), np.concatenate(dists)
    table = []
    for low in buckets(spec.min_distance, spec.seq_len):
        sel = (d >= low) & (d < 2 * low)
        if sel.any():
            acc = float(c[sel].mean())
            table.append({"from": low, "to": min(2 * low, spec.seq_len) - 1,
                          "count": int(sel.sum()), "accuracy": acc,
                          "stderr": math.sqrt(acc * (1 - acc) / int(sel.sum())),
                          "loss": float(lo[sel].mean())})  # fmt: skip
    return {"accuracy": float(c.mean()), "loss": float(lo.mean()), "count": int(c.size),
            "bag_accuracy": bag_accuracy(ids, labels, spec, vocab), "buckets": table}  # fmt: skip


def run_probe(kinds: Sequence[tuple[str, dict[str, Any]]], tasks: Sequence[str],
              seq_lens: Sequence[int], steps: int, batch: int = 8, lr: float = 3e-3,
              seed: int = 0, eval_rows: int = 64, base: dict[str, Any] | None = None,
              vocab: Vocab | None = None, items: int = 32, min_distance: int = 16,
              log: Callable[[str], None] | None = None, queries: int = 1,
              curriculum: float = 0.3, curriculum_start: int = 64,
              curriculum_batch: str = "rows") -> dict[str, Any]:  # fmt: skip
    """Train and score every kind on every task and N: the probe's JSON (see the module doc)."""
    vocab = vocab or Vocab()
    base = {**BASE_MODEL, **(base or {})}
    runs = []
    for n in seq_lens:
        for task in tasks:
            spec = TaskSpec(task=task, seq_len=n, items=items, min_distance=min_distance,
                            queries=queries)  # fmt: skip
            problem = spec.check(vocab)
            if problem:
                raise ProbeError(problem)
            for label, overrides in kinds:
                config = kind_config(base, overrides, n, vocab)
                model, stats = train(config, spec, vocab, steps, batch, lr, seed, log, label,
                                     curriculum, curriculum_start, curriculum_batch)  # fmt: skip
                t0 = time.monotonic()
                got = evaluate(model, spec, vocab, eval_rows, seed)
                runs.append({"kind": label, "overrides": overrides, "task": task, "seq_len": n,
                             "steps": steps, **stats, "eval_seconds": time.monotonic() - t0,
                             **got, "model": config.to_dict()})  # fmt: skip
                if log is not None:
                    log(f"[probe] {label} {task} N={n}: accuracy {got['accuracy']:.3f} "
                        "by distance " + " ".join(f"{x['from']}+:{x['accuracy']:.2f}"
                                                  for x in got["buckets"]))  # fmt: skip
    return {"seed": seed, "steps": steps, "batch": batch, "lr": lr, "eval_rows": eval_rows,
            "items": items, "queries": queries, "min_distance": min_distance,
            "curriculum": curriculum, "curriculum_start": curriculum_start,
            "curriculum_batch": curriculum_batch,
            "vocab": asdict(vocab),
            "base_model": base, "torch_threads": torch.get_num_threads(),
            "chance": {t: TaskSpec(task=t).chance(vocab) for t in tasks},
            "kinds": [{"kind": k, "overrides": o} for k, o in kinds], "runs": runs}  # fmt: skip


# ========================================================================================== plot
def plot(result: dict[str, Any], path: str) -> str | None:
    """Accuracy against distance, one panel per (task, N); None when written, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return (
            "matplotlib is not installed (pip install matplotlib): the plot's data is in the JSON"
        )
    panels = sorted({(r["task"], r["seq_len"]) for r in result["runs"]})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False)
    for ax, (task, n) in zip(axes[0], panels):
        for r in result["runs"]:
            if (r["task"], r["seq_len"]) == (task, n):
                xs = [b["from"] for b in r["buckets"]]
                ax.errorbar(xs, [b["accuracy"] for b in r["buckets"]],
                            yerr=[b.get("stderr", 0.0) for b in r["buckets"]], fmt="o-",
                            capsize=2, label=r["kind"])  # fmt: skip
        ax.axhline(result["chance"][task], color="grey", ls="--", label="chance")
        bag = [r["bag_accuracy"] for r in result["runs"] if (r["task"], r["seq_len"]) == (task, n)]
        if bag and "bag_accuracy" in result["runs"][0]:
            ax.axhline(bag[0], color="grey", ls=":", label="bag of tokens")
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("distance (tokens, bucket start)")
        ax.set_ylabel("top-1 accuracy")
        ax.set_title(f"{task}, N = {n}, {result['steps']} steps", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# =========================================================================================== CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kinds", default="dense,linear",
                   help="comma-separated LABEL[:OPTION=VALUE...] (see the module doc)")  # fmt: skip
    p.add_argument("--tasks", default="induction", help=f"of {', '.join(TASKS)}")
    p.add_argument("--seq-len", default="512", help="N, comma-separated (e.g. 512,1024)")
    p.add_argument("--steps", type=int, default=800, help="AdamW steps per kind (default 800)")
    p.add_argument("--batch", type=int, default=8, help="rows per step (default 8)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--items", type=int, default=32, help="pairs or spans per row (default 32)")
    p.add_argument("--queries", type=int, default=1,
                   help="queries (copy: repeats) of every item, each at its own distance")  # fmt: skip
    p.add_argument("--min-distance", type=int, default=16)
    p.add_argument("--curriculum", type=float, default=0.3,
                   help="the fraction of the steps whose rows grow from --curriculum-start "
                   "tokens to N (items in proportion)")  # fmt: skip
    p.add_argument("--curriculum-start", type=int, default=64)
    p.add_argument("--curriculum-batch", choices=("rows", "tokens"), default="rows",
                   help="during the ramp: --batch rows of every length (rows), or --batch full "
                   "rows' worth of tokens (tokens: as many labels a step as a full row's)")  # fmt: skip
    p.add_argument("--keys", type=int, default=Vocab.keys, help="key tokens (recall, induction)")
    p.add_argument("--values", type=int, default=Vocab.values, help="value tokens")
    p.add_argument("--filler", type=int, default=Vocab.filler,
                   help="filler tokens (the background of every row, and copy's spans)")  # fmt: skip
    p.add_argument("--eval-rows", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", action="append", default=[], metavar="OPTION=VALUE",
                   help="a base model option for every kind (repeatable)")  # fmt: skip
    p.add_argument("--out", default="capability_probe", help="output directory")


def run(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    kinds = parse_kinds(args.kinds)
    tasks = [t for t in split_top(args.tasks, ",")]
    bad = [t for t in tasks if t not in TASKS]
    if bad or not tasks:
        raise ProbeError(f"--tasks: {bad or args.tasks!r}: each must be one of {TASKS}")
    try:
        lens = [int(x) for x in split_top(args.seq_len, ",")]
    except ValueError:
        raise ProbeError(f"--seq-len {args.seq_len!r}: not numbers") from None
    for name in ("steps", "batch", "items", "queries", "eval_rows", "min_distance", "keys",
                 "values", "filler"):  # fmt: skip
        if getattr(args, name) < 1:
            raise ProbeError(f"--{name.replace('_', '-')}: must be at least 1")
    if not 0 <= args.curriculum <= 1:
        raise ProbeError(f"--curriculum {args.curriculum}: must be in [0, 1]")
    if args.curriculum_start < 16:
        raise ProbeError(f"--curriculum-start {args.curriculum_start}: must be at least 16")
    base = dict(parse_option(x, "--model") for x in args.model)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ProbeError(f"--out {args.out}: exists and is not a directory")
    vocab = Vocab(args.keys, args.values, args.filler)
    result = run_probe(kinds, tasks, lens, args.steps, args.batch, args.lr, args.seed,
                       args.eval_rows, base, vocab, args.items, args.min_distance, log,
                       args.queries, args.curriculum, args.curriculum_start,
                       args.curriculum_batch)  # fmt: skip
    return write_result(result, args.out, JSON_FILE, PNG_FILE, lambda p: plot(result, p))


def report(result: dict[str, Any], out: str) -> None:
    """The result table on stdout."""
    for r in result["runs"]:
        cells = " ".join(f"{b['from']}+:{b['accuracy']:.2f}" for b in r["buckets"])
        print(f"{r['kind']:>12} {r['task']:>7} N={r['seq_len']:<5} accuracy "
              f"{r['accuracy']:.3f}  ({cells}; {r['train_seconds']:.0f} s)")  # fmt: skip
    print("chance: " + ", ".join(f"{t} {c:.3f}" for t, c in result["chance"].items()))
    print(f"written: {os.path.join(out, JSON_FILE)}"
          + (f", {os.path.join(out, PNG_FILE)}" if result["plot"] else ""))  # fmt: skip
