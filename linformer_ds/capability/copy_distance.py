"""Copy at distance on real rows: does the model read a passage it saw d tokens earlier?

    python -m linformer_ds.capability copy MODEL DATA [--distances 64,256,1024,2048,3072]
        [--passage 32] [--mask-fraction 0.5] [--rows R] [--seed S] [--split valid] [--out DIR]

``MODEL`` and ``DATA`` as in :mod:`linformer_ds.context_curve` (an export or a checkpoint; a
data_prep output), loaded by its functions; ``--isolation`` likewise.

For each of ``--rows`` rows holding a document of at least L tokens (L: the rows' N, or the
model's ``max_seq_len`` when shorter), the view is the last L tokens of that document. A passage
of ``--passage`` P tokens ends ``TAIL`` tokens before the view's end (the copy, at t); for every
distance d the P tokens at t - d (the original) are written over the copy, and a fraction
(``--mask-fraction``, drawn once per row, the same positions for every d) of the copy's tokens
is replaced by the mask token and scored (loss and top-1 of the original token). Three views,
scored by :func:`linformer_ds.context_curve.window_stats` on the same positions:

* ``with``: the row with the copy (the original in view, d tokens before);
* ``without``: the same row with the original's P tokens replaced by P tokens of another row
  (the next selected row's tokens at the same positions; specials replaced by random
  non-special tokens): the same length, positions and copy, no original anywhere;
* ``plain`` (once per row): the row with no copy (the masked positions hold the row's own text):
  the level of ordinary text.

``gain = loss(without) - loss(with)`` per distance: what seeing the original is worth (a model
that copies gains nats; one that uses distance as topic about as much as ordinary context).
Distances longer than the view allows (d > L - P - TAIL) are skipped and said why. Written to
``--out``: ``copy.json`` and ``copy.png`` (the context curve's conventions).
"""

import argparse
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from linformer_ds.context_curve import (
    ContextCurveError,
    Row,
    check_data_of_model,
    decide_isolation,
    document_segments,
    load_model,
    open_data,
    window_stats,
    write_result,
)

DEFAULT_DISTANCES = "64,256,1024,2048,3072"
TAIL = 16  # tokens between the copy and the view's end
JSON_FILE, PNG_FILE = "copy.json", "copy.png"


class CopyError(ContextCurveError):
    """Bad input (model, data, distances): one line naming it."""


def parse_distances(text: str) -> list[int]:
    try:
        out = sorted({int(x) for x in str(text).split(",") if x.strip()})
    except ValueError:
        raise CopyError(f"--distances {text!r}: not a list of token counts") from None
    if not out or out[0] < 1:
        raise CopyError(f"--distances {text!r}: each must be at least 1 token")
    return out


def pick_views(dataset: Any, rows: int, view: int, isolation: bool) -> list[tuple[int, int]]:
    """``[(row index, view start)]``: the first ``rows`` rows with a document of at least
    ``view`` non-pad tokens; the view is that document's last ``view`` tokens."""
    out = []
    for i in range(len(dataset)):
        tokens = dataset[i]
        for s, e in document_segments(tokens, dataset.pad_id, dataset.sep_id, isolation):
            if e - s >= view:
                out.append((i, e - view))
                break
        if len(out) >= rows:
            break
    return out


def _mask_positions(rng: np.random.Generator, passage: int, fraction: float) -> np.ndarray:
    m = max(1, int(round(fraction * passage)))
    return np.sort(rng.choice(passage, size=m, replace=False))


def build_rows(dataset: Any, picked: Sequence[tuple[int, int]], view: int, passage: int,
               distance: int | None, fraction: float, seed: int, original: bool
               ) -> list[Row]:  # fmt: skip
    """The views of one distance as :class:`Row` s of ``view`` tokens (segment ``(0, view)``):
    ``distance`` None: no copy (plain); ``original`` False: the original replaced."""
    specials = np.asarray(sorted(set(dataset.special_ids)))
    ordinary = np.setdiff1d(np.arange(dataset.vocab_size), specials)
    t = view - TAIL - passage
    out = []
    for j, (i, start) in enumerate(picked):
        rng = np.random.default_rng([seed, i])
        where = t + _mask_positions(rng, passage, fraction)
        tokens = dataset[i][start : start + view].numpy().astype(np.int64)
        if distance is not None:
            s = t - distance
            tokens[t : t + passage] = tokens[s : s + passage]
            if not original:
                donor_i, donor_start = picked[(j + 1) % len(picked)]
                donor = dataset[donor_i][donor_start + s : donor_start + s + passage].numpy()
                donor = donor.astype(np.int64)
                bad = np.isin(donor, specials) | (donor == tokens[s : s + passage])
                donor[bad] = rng.choice(ordinary, size=int(bad.sum()))
                tokens[s : s + passage] = donor
        labels = torch.full((view,), -100, dtype=torch.long)
        labels[where] = torch.from_numpy(tokens[where])
        tokens[where] = dataset.mask_id
        out.append(Row(i, torch.from_numpy(tokens), labels, [(0, view, where.tolist())]))
    return out


def _score(model: Any, rows: list[Row], view: int, device: Any, batch_tokens: int
           ) -> dict[str, float]:  # fmt: skip
    st = window_stats(model, rows, view, device, batch_tokens)
    n = max(st["count"], 1)
    return {"loss": st["loss_sum"] / n, "accuracy": st["correct"] / n, "count": st["count"]}


def copy_curve(model: Any, dataset: Any, distances: Sequence[int], rows: int = 16,
               passage: int = 32, fraction: float = 0.5, seed: int = 0, isolation: bool = False,
               device: Any = "cpu", batch_tokens: int = 16384,
               log: Callable[[str], None] | None = None) -> dict[str, Any]:  # fmt: skip
    """The copy-at-distance figures of ``model`` on ``rows`` rows of ``dataset``."""
    view = min(int(dataset.seq_len), int(model.config.max_seq_len))
    longest = view - TAIL - passage
    if longest < 1:
        raise CopyError(f"a passage of {passage} tokens does not fit a view of {view} tokens")
    use = [d for d in distances if passage <= d <= longest]
    skipped = [{"distance": d, "why": f"longer than the view allows ({longest} = {view} - "
                f"passage {passage} - {TAIL})" if d > longest else
                f"shorter than the passage ({passage}): the copy would overlap the original"}
               for d in distances if d not in use]  # fmt: skip
    if not use:
        raise CopyError(f"no distance to evaluate: {list(distances)} with a view of {view} tokens")
    picked = pick_views(dataset, rows, view, isolation)
    if not picked:
        raise CopyError(
            f"{dataset.path}: no {'document' if isolation else 'row'} of the {dataset.split} "
            f"split holds {view} non-pad tokens; use a long-document corpus "
            f"(scripts/make_long_corpus.sh)"
        )
    result: dict[str, Any] = {
        "rows": len(picked), "row_indices": [i for i, _ in picked], "isolation": bool(isolation),
        "seed": int(seed), "seq_len": int(dataset.seq_len),
        "max_seq_len": int(model.config.max_seq_len), "view": view, "passage": passage,
        "mask_fraction": fraction, "copy_at": view - TAIL - passage, "distances": [],
        "skipped_distances": skipped,
    }  # fmt: skip
    was_training = model.training
    model.eval()
    t0 = time.monotonic()
    try:
        plain = _score(model, build_rows(dataset, picked, view, passage, None, fraction, seed,
                                         True), view, device, batch_tokens)  # fmt: skip
        result.update(plain_loss=plain["loss"], plain_accuracy=plain["accuracy"],
                      positions=plain["count"])  # fmt: skip
        for d in use:
            got = {}
            for name, original in (("with", True), ("without", False)):
                part = build_rows(dataset, picked, view, passage, d, fraction, seed, original)
                got[name] = _score(model, part, view, device, batch_tokens)
            result["distances"].append({
                "distance": d, "loss_with": got["with"]["loss"],
                "accuracy_with": got["with"]["accuracy"], "loss_without": got["without"]["loss"],
                "accuracy_without": got["without"]["accuracy"],
                "gain": got["without"]["loss"] - got["with"]["loss"]})  # fmt: skip
            if log is not None:
                x = result["distances"][-1]
                log(f"[copy] d={d}: loss {x['loss_with']:.4f} with the original, "
                    f"{x['loss_without']:.4f} without (gain {x['gain']:+.4f}), "
                    f"{time.monotonic() - t0:.0f} s")  # fmt: skip
    finally:
        model.train(was_training)
    return result


def plot(result: dict[str, Any], path: str, title: str) -> str | None:
    """Loss with and without the original against distance; None when written, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return (
            "matplotlib is not installed (pip install matplotlib): the plot's data is in the JSON"
        )
    ds = [x["distance"] for x in result["distances"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ds, [x["loss_with"] for x in result["distances"]], "o-", label="original in view")
    ax.plot(ds, [x["loss_without"] for x in result["distances"]], "s--", label="original replaced")
    ax.axhline(result["plain_loss"], color="grey", ls=":", label="no copy (ordinary text)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ds)
    ax.set_xticklabels([str(d) for d in ds])
    ax.set_xlabel("distance d (tokens from the original to its copy)")
    ax.set_ylabel("loss of the copy's masked tokens (nats)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="an export directory or a training checkpoint directory")
    p.add_argument("data", help="a data_prep output directory")
    p.add_argument("--distances", default=DEFAULT_DISTANCES,
                   help=f"tokens from the original to the copy (default {DEFAULT_DISTANCES})")  # fmt: skip
    p.add_argument("--passage", type=int, default=32, help="tokens copied (default 32)")
    p.add_argument("--mask-fraction", type=float, default=0.5,
                   help="fraction of the copy's tokens masked and scored (default 0.5)")  # fmt: skip
    p.add_argument("--rows", type=int, default=16, help="rows scored (default 16)")
    p.add_argument("--seed", type=int, default=0, help="masking seed (default 0)")
    p.add_argument("--split", default="valid", help="split scored (default valid)")
    p.add_argument("--tag", default=None, help="checkpoint tag (default: latest)")
    p.add_argument("--isolation", default="auto", choices=("auto", "on", "off"),
                   help="as context_curve's")  # fmt: skip
    p.add_argument("--batch-tokens", type=int, default=16384, help="tokens per forward batch")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--out", default="capability_copy", help="output directory")


def run(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    if args.rows < 1 or args.passage < 1 or args.batch_tokens < 1:
        raise CopyError("--rows, --passage and --batch-tokens must be at least 1")
    if not 0 < args.mask_fraction <= 1:
        raise CopyError(f"--mask-fraction {args.mask_fraction}: must be in (0, 1]")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise CopyError(f"--out {args.out}: exists and is not a directory")
    distances = parse_distances(args.distances)
    dataset, _ = open_data(args.data, args.split)
    model, info = load_model(args.model, args.tag)
    note = check_data_of_model(args.data, dataset, model, info, CopyError)
    isolation, why = decide_isolation(args.isolation, dataset, info["training_config"])
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    log(f"[copy] model {args.model} ({info['kind']}), data {args.data} ({args.split}, "
        f"N = {dataset.seq_len}), document isolation {why}, distances {distances}; {note}")  # fmt: skip
    result = copy_curve(model, dataset, distances, args.rows, args.passage, args.mask_fraction,
                        args.seed, isolation, device, args.batch_tokens, log)  # fmt: skip
    result.update({"model": args.model, "data": args.data, "split": args.split,
                   "isolation_why": why})  # fmt: skip
    title = f"copy at distance: {os.path.basename(os.path.normpath(args.model))} on " \
            f"{args.split} of {os.path.basename(os.path.normpath(args.data))}"  # fmt: skip
    return write_result(result, args.out, JSON_FILE, PNG_FILE, lambda p: plot(result, p, title))


def report(result: dict[str, Any], out: str) -> None:
    for x in result["distances"]:
        print(f"d={x['distance']:>6}  with {x['loss_with']:.4f} ({x['accuracy_with']:.3f})  "
              f"without {x['loss_without']:.4f} ({x['accuracy_without']:.3f})  "
              f"gain {x['gain']:+.4f}")  # fmt: skip
    print(f"no copy    loss {result['plain_loss']:.4f} ({result['plain_accuracy']:.3f}); "
          f"{result['positions']} positions in {result['rows']} rows")  # fmt: skip
    for s in result["skipped_distances"]:
        print(f"d={s['distance']} not evaluated: {s['why']}")
    if result.get("plot_note"):
        print(f"note: {result['plot_note']}")
    print(f"written: {os.path.join(out, JSON_FILE)}"
          + (f", {os.path.join(out, PNG_FILE)}" if result["plot"] else ""))  # fmt: skip
