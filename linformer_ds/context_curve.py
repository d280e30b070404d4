"""The context curve: does a model use its long context?

    python -m linformer_ds.context_curve MODEL DATA [--windows 128,512,1024,2048,N] [--rows R]
        [--seed S] [--split valid] [--out DIR]

``MODEL``: a Hugging Face export directory (``config.json`` + ``model.safetensors``, loaded into
linformer_ds' own model classes, no remote code runs) or a training checkpoint directory (its
``latest`` tag, or ``--tag``; consolidated as ``linformer_ds.export`` does). ``DATA``: a data_prep
output directory (rows of N tokens).

For the same masked positions and the same masks, the hidden-label loss (the positions whose input
is the mask token, as in :mod:`linformer_ds.context_meter`) when the model sees only a window of W
tokens around each of them, for every W of ``--windows`` (``N``: the rows' length). The rows are
masked once (BERT's 80/10/10, ``MLMMasking`` seeded by ``--seed``, row index as the sample index);
each window is a slice of the masked row, fed as a sequence of its own (positions 0..W-1, as a row
of W tokens). The scored positions are the hidden ones whose document (the span between document
starts: ``position_ids`` restarting after every sep when the data has document isolation, else the
whole row) holds at least W_max (the longest window evaluated) non-pad tokens, so that every W has
a full window inside the document for every position: the same positions for every W.

Windows: a window of W tokens inside the document, as centred on the position as the document
allows. Cutting one window per position would cost a forward pass per position; the windows are
instead tiles of W tokens at a stride of W/2 over the document (the last one ending at the
document's end), and each position is scored in the tile whose start is nearest its centred start,
so that it lies in the middle half of its window (or at the document's edge, where the window
is clipped as a centred one is). Tiles of one W are batched (``--batch-tokens`` tokens a batch).
A model shorter than a window (``max_seq_len``) is evaluated only up to its ``max_seq_len``.

Figures: each W's loss and accuracy, the unigram loss and accuracy on the same positions (the
train split's counts, :class:`linformer_ds.context_meter.UnigramMeter`), and
``long_context_gain = loss(512) - loss(W_max)``: what the context past 512 tokens is worth (> 0:
used). Written to ``--out``: ``context_curve.json`` and ``context_curve.png`` (with matplotlib;
without it the JSON holds the plot's data and says so). The trainer's ``eval.context_windows``
logs the same figures at every evaluation (:func:`curve`, on a few rows).
"""

if __name__ == "__main__":  # the command: Ctrl-C while torch imports is one line, exit 130
    from linformer_ds import entry

    entry.arm("context_curve")

import argparse
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from linformer_ds.data.masking import MLMMasking, document_positions
from linformer_ds.errors import LinformerError
from linformer_ds.log import LogLevelError, get_logger, info_to, setup_logging
from linformer_ds.metrics import top1
from linformer_ds.outdir import error_line

DEFAULT_WINDOWS = "128,512,1024,2048,N"
GAIN_FROM = 512  # long_context_gain = loss(512) - loss(longest)
JSON_FILE, PNG_FILE = "context_curve.json", "context_curve.png"
logger = get_logger(__name__)


class ContextCurveError(LinformerError, ValueError):
    """Bad input (model, data, windows): one line naming it."""


# ========================================================================= positions and windows
def document_segments(tokens: torch.Tensor, pad_id: int, sep_id: int, isolation: bool
                      ) -> list[tuple[int, int]]:  # fmt: skip
    """``[(start, end)]`` of the documents of one row ``tokens [N]`` as the model sees them:
    with ``isolation`` the spans between document starts (``document_positions``: the row start
    and every position after a sep), else the whole row; pad positions left out."""
    n = int(tokens.shape[0])
    real = (tokens != pad_id).numpy()
    if isolation:
        pos = document_positions(tokens[None].long(), sep_id)[0].numpy()
        starts = np.flatnonzero(pos == 0).tolist()
    else:
        starts = [0]
    out = []
    for s, e in zip(starts, starts[1:] + [n]):
        idx = np.flatnonzero(real[s:e])
        if idx.size:
            out.append((s, s + int(idx[-1]) + 1))  # (padding only ever trails a row)
    return out


def tile_starts(start: int, end: int, w: int) -> list[int]:
    """Starts of the windows of ``w`` tokens tiling ``[start, end)`` (``end - start >= w``) at a
    stride of ``w / 2``, the last ending at ``end``."""
    stride = max(1, w // 2)
    out = list(range(start, end - w, stride)) or [start]
    if out[-1] != end - w:
        out.append(end - w)
    return out


def assign_windows(positions: Sequence[int], start: int, end: int, w: int
                   ) -> dict[int, list[int]]:  # fmt: skip
    """``{window start: [positions]}``: each position of ``[start, end)`` in the tile (of
    :func:`tile_starts`) whose start is nearest to its centred, clipped start."""
    tiles = np.asarray(tile_starts(start, end, w))
    out: dict[int, list[int]] = {}
    for p in positions:
        ideal = min(max(p - w // 2, start), end - w)
        t = int(tiles[int(np.argmin(np.abs(tiles - ideal)))])
        out.setdefault(t, []).append(int(p))
    return out


@dataclass
class Row:
    """One evaluated row: its masked input, labels and the scored positions by document."""

    index: int
    input_ids: torch.Tensor  # [N] long, masked
    labels: torch.Tensor  # [N] long, the original tokens at the scored positions
    segments: list[tuple[int, int, list[int]]] = field(default_factory=list)  # (s, e, positions)

    def positions(self) -> list[int]:
        return sorted(p for _, _, ps in self.segments for p in ps)


def select_rows(dataset: Any, rows: int, w_max: int, seed: int, isolation: bool,
                mlm_probability: float = 0.15) -> list[Row]:  # fmt: skip
    """The first ``rows`` rows of ``dataset`` that hold a scored position: a hidden label (input
    = mask) in a document of at least ``w_max`` non-pad tokens."""
    masker = MLMMasking(dataset.vocab_size, dataset.mask_id, dataset.special_ids,
                        mlm_probability=mlm_probability, seed=seed, pad_id=dataset.pad_id)  # fmt: skip
    out: list[Row] = []
    for i in range(len(dataset)):
        tokens = dataset[i]
        segs = [(s, e) for s, e in document_segments(tokens, dataset.pad_id, dataset.sep_id,
                                                      isolation) if e - s >= w_max]  # fmt: skip
        if not segs:
            continue
        batch = masker(tokens[None], torch.tensor([i]), 0)
        ids = batch["input_ids"][0]
        hidden = (ids == dataset.mask_id).numpy()
        scored = [(s, e, (s + np.flatnonzero(hidden[s:e])).tolist()) for s, e in segs]
        scored = [x for x in scored if x[2]]
        if scored:
            out.append(Row(i, ids, batch["labels"][0], scored))
            if len(out) >= rows:
                break
    return out


# =========================================================================================== curve
def _model_forward(model: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """``ids [B, W] -> hidden [B, W, D]`` of the MLM model's encoder."""
    return lambda ids: model.encoder(ids, torch.ones_like(ids))


@torch.no_grad()
def window_stats(model: Any, rows: Sequence[Row], w: int, device: Any = "cpu",
                 batch_tokens: int = 16384, progress: Callable[[int, int], None] | None = None
                 ) -> dict[str, Any]:  # fmt: skip
    """Summed cross-entropy, correct count and count of the rows' scored positions with a
    window of ``w`` tokens; ``per_position``: ``{(row, position): loss}``."""
    jobs = []  # (row, window start, positions)
    for r in rows:
        for s, e, ps in r.segments:
            for t, got in sorted(assign_windows(ps, s, e, w).items()):
                jobs.append((r, t, got))
    per_batch = max(1, batch_tokens // w)
    loss_sum, correct, count = 0.0, 0, 0
    per_position: dict[tuple[int, int], float] = {}
    hidden_of = _model_forward(model)
    for b in range(0, len(jobs), per_batch):
        part = jobs[b : b + per_batch]
        ids = torch.stack([r.input_ids[t : t + w] for r, t, _ in part]).to(device)
        hidden = hidden_of(ids)
        bi = torch.tensor([k for k, (_, _, ps) in enumerate(part) for _ in ps], device=device)
        pi = torch.tensor([p - t for _, t, ps in part for p in ps], device=device)
        target = torch.tensor([int(r.labels[p]) for r, _, ps in part for p in ps], device=device)
        logits = model.lm_head(hidden[bi, pi]).float()
        ce = F.cross_entropy(logits, target, reduction="none")
        loss_sum += float(ce.sum())
        correct += int((top1(logits) == target).sum())
        count += int(target.numel())
        keys = [(r.index, p) for r, _, ps in part for p in ps]
        per_position.update(zip(keys, ce.tolist()))
        if progress is not None:
            progress(min(b + per_batch, len(jobs)), len(jobs))
    return {"loss_sum": loss_sum, "correct": correct, "count": count, "windows": len(jobs),
            "per_position": per_position}  # fmt: skip


def usable_windows(windows: Sequence[int], seq_len: int, max_seq_len: int
                   ) -> tuple[list[int], list[dict[str, Any]]]:  # fmt: skip
    """The windows evaluated (sorted, at most the rows' N and the model's max_seq_len) and the
    ones left out with the reason."""
    use, skipped = [], []
    for w in sorted(set(int(x) for x in windows)):
        if w > max_seq_len:
            skipped.append(
                {"window": w, "why": f"longer than the model's max_seq_len {max_seq_len}"}
            )
        elif w > seq_len:
            skipped.append({"window": w, "why": f"longer than the data's rows (N = {seq_len})"})
        else:
            use.append(w)
    return use, skipped


def curve(model: Any, dataset: Any, windows: Sequence[int], rows: int = 16, seed: int = 0,
          isolation: bool = False, unigram: Any = None, device: Any = "cpu",
          batch_tokens: int = 16384, mlm_probability: float = 0.15,
          log: Callable[[str], None] | None = None) -> dict[str, Any]:  # fmt: skip
    """The context curve of ``model`` (a ``LinformerForMaskedLM``, in eval mode) on ``rows``
    rows of ``dataset`` (a ``ShardDataset``): see the module docstring. ``unigram``: a
    ``UnigramMeter`` for the context-free reference on the same positions (or None)."""
    use, skipped = usable_windows(windows, dataset.seq_len, int(model.config.max_seq_len))
    if not use:
        raise ContextCurveError(
            f"no window to evaluate: {sorted(set(windows))} are all longer than the rows "
            f"(N = {dataset.seq_len}) or the model (max_seq_len {model.config.max_seq_len})"
        )
    w_max = use[-1]
    picked = select_rows(dataset, rows, w_max, seed, isolation, mlm_probability)
    if not picked:
        where = "document" if isolation else "row"
        raise ContextCurveError(
            f"{dataset.path}: no {where} of the {dataset.split} split holds {w_max} non-pad tokens "
            f"and a hidden label; use shorter --windows or a long-document corpus "
            f"(scripts/make_long_corpus.sh)"
        )
    positions = [(r.index, p) for r in picked for p in r.positions()]
    result: dict[str, Any] = {
        "rows": len(picked), "row_indices": [r.index for r in picked],
        "positions": len(positions), "isolation": bool(isolation), "seed": int(seed),
        "seq_len": int(dataset.seq_len), "max_seq_len": int(model.config.max_seq_len),
        "longest_window": w_max, "windows": [], "skipped_windows": skipped,
    }  # fmt: skip
    was_training = model.training
    model.eval()
    try:
        for w in use:
            t0 = time.monotonic()
            last = [t0]

            def progress(
                done: int, total: int, w: int = w, t0: float = t0, last: list = last
            ) -> None:
                if log is not None and (time.monotonic() - last[0] > 10 or done == total):
                    last[0] = time.monotonic()
                    log(f"[context] W={w}: {done}/{total} windows, {time.monotonic() - t0:.0f} s")

            st = window_stats(model, picked, w, device, batch_tokens, progress)
            if st["count"] != len(positions):  # (every position has a window of every W)
                raise RuntimeError(f"window {w} scored {st['count']} of {len(positions)} positions")
            n = max(st["count"], 1)
            result["windows"].append({"window": w, "loss": st["loss_sum"] / n,
                                      "accuracy": st["correct"] / n, "windows_run": st["windows"],
                                      "tokens": st["windows"] * w})  # fmt: skip
    finally:
        model.train(was_training)
    if unigram is not None:
        lab = np.asarray([int(r.labels[p]) for r in picked for p in r.positions()])
        result["unigram_loss"] = float(-unigram.log_prob[lab].mean())
        result["unigram_accuracy"] = float((lab == unigram.top).mean())
    losses = {x["window"]: x["loss"] for x in result["windows"]}
    if GAIN_FROM in losses and w_max > GAIN_FROM:
        result["long_context_gain"] = losses[GAIN_FROM] - losses[w_max]
    else:
        result["long_context_gain"] = None
        result["long_context_gain_note"] = (
            f"needs windows {GAIN_FROM} and a longer one; evaluated {sorted(losses)}"
        )
    return result


def eval_figures(result: dict[str, Any]) -> dict[str, float]:
    """The trainer's eval record fields of a :func:`curve` result: ``context_loss_w{W}``,
    ``context_accuracy_w{W}`` per window and ``long_context_gain`` (when defined)."""
    out: dict[str, float] = {}
    for x in result["windows"]:
        out[f"context_loss_w{x['window']}"] = x["loss"]
        out[f"context_accuracy_w{x['window']}"] = x["accuracy"]
    if result.get("long_context_gain") is not None:
        out["long_context_gain"] = result["long_context_gain"]
    return out


# ====================================================================================== loading
def parse_windows(text: str, seq_len: int) -> list[int]:
    """``"128,512,N"`` -> ``[128, 512, seq_len]`` (``N``: the rows' length)."""
    out = []
    for item in str(text).split(","):
        item = item.strip()
        if not item:
            continue
        if item.upper() == "N":
            out.append(int(seq_len))
            continue
        try:
            w = int(item)
        except ValueError:
            raise ContextCurveError(f"--windows: {item!r} is not a number of tokens or N") from None
        if w < 1:
            raise ContextCurveError(f"--windows: {w} must be at least 1 token")
        out.append(w)
    if not out:
        raise ContextCurveError("--windows: no window given")
    return sorted(set(out))


def _isolation_setting(config: Any) -> Any:
    """A training config's ``data.document_isolation`` (None when not recorded)."""
    if isinstance(config, dict) and isinstance(config.get("data"), dict):
        return config["data"].get("document_isolation")
    return None


def load_model(path: str, tag: str | None = None) -> tuple[Any, dict[str, Any]]:
    """``(LinformerForMaskedLM in eval mode, info)`` of an export or a checkpoint directory;
    ``info``: ``kind``, ``training_config`` (None when not recorded)."""
    from linformer_ds.model import LinformerForMaskedLM, ModelConfig, ModelConfigError

    if not os.path.exists(path):
        raise ContextCurveError(f"MODEL {path}: no such directory")
    if not os.path.isdir(path):
        raise ContextCurveError(f"MODEL {path}: not a directory (an export or a checkpoint)")
    cfg_path, weights = os.path.join(path, "config.json"), os.path.join(path, "model.safetensors")
    if os.path.isfile(cfg_path) and os.path.isfile(weights):
        try:
            with open(cfg_path, encoding="utf-8") as f:
                config = json.load(f)
            if config.get("model_type") != "linformer":
                raise ContextCurveError(
                    f"MODEL {path}: config.json model_type is "
                    f"{config.get('model_type')!r}, not a linformer export"
                )
            known = {f.name for f in fields(ModelConfig)}
            mc = ModelConfig.from_dict({k: v for k, v in config.items() if k in known})
            mc.validate()
        except (OSError, ValueError, TypeError, ModelConfigError) as e:
            if isinstance(e, ContextCurveError):
                raise
            raise ContextCurveError(
                f"MODEL {cfg_path}: not a linformer model config ({e})"
            ) from None
        from safetensors.torch import load_file

        model = LinformerForMaskedLM(mc)
        try:  # a truncated or overwritten file: one line naming it, not safetensors' traceback
            stored = load_file(weights)
        except Exception as e:  # noqa: BLE001  (SafetensorError, OSError, ...)
            raise ContextCurveError(f"MODEL {weights}: not a readable safetensors file "
                                    f"({error_line(e)})") from None  # fmt: skip
        state = {k: v.float() if v.is_floating_point() else v for k, v in stored.items()}
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = ["lm_head.decoder.weight"] if mc.tie_word_embeddings else []
        if unexpected or sorted(missing) != tied:
            raise ContextCurveError(f"MODEL {weights}: the weights do not match config.json "
                                    f"(missing {sorted(missing)[:4]}, unexpected "
                                    f"{sorted(unexpected)[:4]})")  # fmt: skip
        training = None
        prov = os.path.join(path, "linformer_export.json")
        if os.path.isfile(prov):
            try:
                with open(prov, encoding="utf-8") as f:
                    training = json.load(f).get("training_config")
            except (OSError, ValueError, AttributeError):
                training = None
        return model.eval(), {"kind": "export", "training_config": training, "dir": path}
    from linformer_ds.export import (
        ExportError,
        check_state_dict,
        consolidate,
        read_meta,
        resolve_tag,
    )

    try:
        ckpt, name = resolve_tag(path, tag)
    except ExportError as e:
        raise ContextCurveError(
            f"MODEL {path}: not a model: neither an export (config.json + model.safetensors) nor "
            f"a training checkpoint ({e})"
        ) from None
    tag_dir = os.path.join(ckpt, name)
    try:
        meta, mc = read_meta(tag_dir)
        state = check_state_dict(consolidate(ckpt, name), mc, tag_dir)
    except ExportError as e:
        raise ContextCurveError(f"MODEL {tag_dir}: {e}") from None
    model = LinformerForMaskedLM(mc)
    model.load_state_dict(state, strict=False)  # (check_state_dict: only the tied weight left out)
    return model.eval(), {"kind": f"checkpoint {name}", "training_config": meta.get("config"),
                          "dir": tag_dir}  # fmt: skip


def check_data_of_model(data: str, dataset: Any, model: Any, info: dict[str, Any],
                        error: type[ContextCurveError] = ContextCurveError) -> str:  # fmt: skip
    """The data is the model's: its manifest's tokenizer is the export's or checkpoint's
    (:func:`linformer_ds.tokenizer_identity.check_tokenizers`) and its vocabulary fits."""
    from linformer_ds import tokenizer_identity as ti

    try:
        note = ti.check_tokenizers(ti.of_data(str(dataset.path), dataset.manifest),
                                   ti.of_model(info["dir"]))  # fmt: skip
    except ti.TokenizerMismatch as e:
        raise error(f"DATA {data}: not the data of this model: {e}") from None
    if dataset.vocab_size > model.config.vocab_size:
        raise error(f"DATA {data}: vocabulary {dataset.vocab_size} > the model's "
                    f"{model.config.vocab_size}: not the data of this model")  # fmt: skip
    return note


def decide_isolation(setting: str, dataset: Any, training_config: Any) -> tuple[bool, str]:
    """``--isolation``: on / off, or auto: the training config's ``data.document_isolation``
    when recorded, and its ``auto`` (or none recorded): on when the data is packed ``full`` (the
    trainer's rule)."""
    if setting in ("on", "off"):
        return setting == "on", setting
    recorded = _isolation_setting(training_config)
    if recorded is True or recorded is False:
        return bool(recorded), f"{'on' if recorded else 'off'} (the training config's)"
    full = dataset.manifest.get("packing") == "full"
    return full, f"{'on' if full else 'off'} (auto: packing {dataset.manifest.get('packing')})"


def open_data(path: str, split: str) -> tuple[Any, Any]:
    """``(the split to evaluate, the unigram meter of the train split)``."""
    from linformer_ds.context_meter import UnigramMeter, load_counts
    from linformer_ds.data.shards import DataError, ShardDataset

    if not os.path.isdir(path):
        raise ContextCurveError(f"DATA {path}: no such directory")
    try:
        dataset = ShardDataset(path, split)
    except DataError as e:
        raise ContextCurveError(f"DATA {e}") from None
    try:
        counted = ShardDataset(path, "train")
    except DataError:
        counted = dataset
    got = load_counts(counted, None, write_cache=False)
    meter = UnigramMeter(got["counts"], counted.special_ids, f"{counted.split}: {got['from']}")
    return dataset, meter


# ========================================================================================== plot
def plot(result: dict[str, Any], path: str, title: str) -> str | None:
    """Loss against window (log scale) with the unigram level; None when written, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return (
            "matplotlib is not installed (pip install matplotlib): the plot's data is in the JSON"
        )
    ws = [x["window"] for x in result["windows"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ws, [x["loss"] for x in result["windows"]], "o-", label="model (hidden labels)")
    if "unigram_loss" in result:
        ax.axhline(result["unigram_loss"], color="grey", ls="--", label="unigram (no context)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ws)
    ax.set_xticklabels([str(w) for w in ws])
    ax.set_xlabel("window W (tokens of context around each scored position)")
    ax.set_ylabel("hidden-label loss (nats)")
    gain = result.get("long_context_gain")
    ax.set_title(title + (f"\nlong-context gain {gain:+.4f} nats" if gain is not None else ""),
                 fontsize=9)  # fmt: skip
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# =========================================================================================== CLI
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m linformer_ds.context_curve",
        description="Hidden-label loss of the same masked positions seen through windows of W "
        "tokens: does the model use its long context?")  # fmt: skip
    p.add_argument("model", help="an export directory (config.json + model.safetensors) or a "
                   "training checkpoint directory")  # fmt: skip
    p.add_argument("data", help="a data_prep output directory")
    p.add_argument(
        "--windows",
        default=DEFAULT_WINDOWS,
        help=f"window sizes in tokens, N = the rows' length (default {DEFAULT_WINDOWS})",
    )
    p.add_argument("--rows", type=int, default=64, help="rows scored (default 64)")
    p.add_argument("--seed", type=int, default=0, help="masking seed (default 0)")
    p.add_argument("--split", default="valid", help="split scored (default valid)")
    p.add_argument("--tag", default=None, help="checkpoint tag (default: latest)")
    p.add_argument(
        "--isolation",
        default="auto",
        choices=("auto", "on", "off"),
        help="document boundaries from the rows' seps (on) or one document per row "
        "(off); auto: the training config's setting, else on for full packing",
    )
    p.add_argument("--mlm-probability", type=float, default=0.15)
    p.add_argument("--batch-tokens", type=int, default=16384, help="tokens per forward batch")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--out", default="context_curve", help="output directory (default "
                   "./context_curve)")  # fmt: skip
    return p.parse_args(argv)


def resolve_device(name: str | None) -> torch.device:
    """``--device`` as a device this torch can use (default: cuda when available, else cpu),
    checked before any work: a name torch does not know, or a device it was not built for or
    cannot see (``cuda`` on a CPU-only torch was an AssertionError), is one line."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as e:
        raise ContextCurveError(f"--device {name}: {' '.join(str(e).split())}") from None
    if device.type == "meta":
        raise ContextCurveError(f"--device {name}: holds no data; pass --device cpu or cuda")
    try:
        torch.empty(0, device=device)
    except (AssertionError, RuntimeError) as e:
        reason = (" ".join(str(e).split()) or type(e).__name__).split(". ")[0][:200]
        raise ContextCurveError(
            f"--device {name}: not usable with this torch ({torch.__version__}: {reason}); "
            "pass --device cpu, or leave --device out (cuda when available, else cpu)"
        ) from None
    return device


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.rows < 1:
        raise ContextCurveError(f"--rows {args.rows}: must be at least 1")
    if args.batch_tokens < 1:
        raise ContextCurveError(f"--batch-tokens {args.batch_tokens}: must be at least 1")
    if not 0 < args.mlm_probability < 1:
        raise ContextCurveError(f"--mlm-probability {args.mlm_probability}: must be in (0, 1)")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ContextCurveError(f"--out {args.out}: exists and is not a directory")
    device = resolve_device(args.device)
    dataset, meter = open_data(args.data, args.split)
    windows = parse_windows(args.windows, dataset.seq_len)
    if windows[0] > dataset.seq_len:
        raise ContextCurveError(f"DATA {args.data}: rows of {dataset.seq_len} tokens are shorter "
                                f"than the smallest window {windows[0]}")  # fmt: skip
    model, info = load_model(args.model, args.tag)
    note = check_data_of_model(args.data, dataset, model, info)
    isolation, why = decide_isolation(args.isolation, dataset, info["training_config"])
    model.to(device)
    log = logger.info  # progress: stderr (main); stdout holds the result
    log(f"[context] model {args.model} ({info['kind']}), data {args.data} ({args.split}, "
        f"N = {dataset.seq_len}), document isolation {why}, windows {windows}; {note}")  # fmt: skip
    result = curve(model, dataset, windows, args.rows, args.seed, isolation, meter, device,
                   args.batch_tokens, args.mlm_probability, log)  # fmt: skip
    result.update({"model": args.model, "data": args.data, "split": args.split,
                   "isolation_why": why, "unigram_from": meter.source})  # fmt: skip
    title = f"{os.path.basename(os.path.normpath(args.model))} on {args.split} of " \
            f"{os.path.basename(os.path.normpath(args.data))}"  # fmt: skip
    return write_result(result, args.out, JSON_FILE, PNG_FILE, lambda p: plot(result, p, title))


def write_result(
    result: dict[str, Any], out: str, json_file: str, png_file: str,
    draw: Callable[[str], str | None],
) -> dict[str, Any]:  # fmt: skip
    """``out/png_file`` drawn by ``draw(path)`` (None when written, else why not: noted in the
    result) and the result as ``out/json_file``; the command line's outputs of every tool here."""
    os.makedirs(out, exist_ok=True)
    why_not = draw(os.path.join(out, png_file))
    result["plot"] = png_file if why_not is None else None
    if why_not:
        result["plot_note"] = why_not
    with open(os.path.join(out, json_file), "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        setup_logging()
        with info_to("stderr"):
            result = run(args)
    except (ContextCurveError, LogLevelError) as e:
        logger.error(f"context_curve: error: {' '.join(str(e).split())}")
        return 2
    except (RuntimeError, ValueError) as e:  # the model refused an input (one line)
        logger.error(f"context_curve: error: {' '.join(str(e).split())[:400]}")
        return 1
    # the result: a table on stdout
    for x in result["windows"]:
        print(f"W={x['window']:>6}  loss {x['loss']:.4f}  accuracy {x['accuracy']:.4f}  "
              f"({x['windows_run']} windows)")  # fmt: skip
    if "unigram_loss" in result:
        print(f"unigram      loss {result['unigram_loss']:.4f}  accuracy "
              f"{result['unigram_accuracy']:.4f}")  # fmt: skip
    gain = result["long_context_gain"]
    if gain is None:
        print(f"long_context_gain: n/a ({result['long_context_gain_note']}); "
              f"{result['positions']} positions in {result['rows']} rows")  # fmt: skip
    else:
        print(f"long_context_gain = loss({GAIN_FROM}) - loss({result['longest_window']}) = "
              f"{gain:+.4f} nats; {result['positions']} positions in {result['rows']} rows")  # fmt: skip
    for s in result["skipped_windows"]:
        print(f"W={s['window']} not evaluated: {s['why']}")
    if result.get("plot_note"):
        print(f"note: {result['plot_note']}")
    print(f"written: {os.path.join(args.out, JSON_FILE)}"
          + (f", {os.path.join(args.out, PNG_FILE)}" if result["plot"] else ""))  # fmt: skip
    return 0


if __name__ == "__main__":
    entry.run(main)
