"""Fine-tune an exported Linformer model for sequence classification.

    python launch/finetune.py --model exported/tiny --train train.csv --validation valid.csv \\
        --out finetuned/tiny [--text-column text --label-column label --max-length 512]
    python launch/finetune.py --model exported/tiny --dataset imdb --out finetuned/imdb

Loads the model and tokenizer through the Auto classes, trains with
AdamW and a linear warmup/decay schedule on padded batches (padding masked out), reports accuracy
on the validation split after every epoch and writes the fine-tuned model in the same
self-contained format as ``launch/export.py`` (plus ``finetune_results.json``).

Safety: ``--model`` must be a Linformer export (another architecture is refused); its code
files run only when they have the sha256 its export recorded (``--trust-remote-code`` runs them
anyway); only the task head (``classifier.*``) may be newly initialised: any other weight the
export lacks or holds in another shape than its ``config.json`` says is refused, naming the
tensors. ``--out`` is locked while finetune runs, ``--model`` pinned (a shared lock: an export
cannot replace it meanwhile); Ctrl-C leaves ``--out`` untouched.
"""

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch

from linformer_ds import dirlock, outdir
from linformer_ds.errors import LinformerError
from linformer_ds.export import portable_paths
from linformer_ds.log import LogLevelError, get_logger, setup_logging
from linformer_ds.model import ModelConfig
from linformer_ds.model_dir import ExportError, apply_umask, check_remote_code, write_model_dir
from linformer_ds.optim import lr_scheduler, param_groups

log = get_logger(__name__)

LOCAL_FORMATS = {
    ".csv": "csv",
    ".tsv": "csv",
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".txt": "label<TAB>text lines",
}
FORMATS_HELP = ".csv/.tsv (header row), .json/.jsonl, .parquet, .txt (one 'label<TAB>text' a line)"
# Default learning rate: 5e-5 at BERT-base width (768), scaled by 768 / hidden_size (smaller
# encoders take larger steps, as for BERT's small models), clipped to [LR_MIN, LR_MAX].
LR_AT_768, LR_MIN, LR_MAX = 5e-5, 2e-5, 5e-4
# The task head of LinformerForSequenceClassification: the only weights that may be new (or
# replaced when the label count differs). Weights of other heads in the export are dropped.
HEAD_PREFIX = "classifier."
OTHER_HEADS = ("lm_head.", "classifier.", "pooler.", "qa_outputs.")


class FinetuneError(LinformerError, ValueError):
    """Bad fine-tuning input; the message names the option or file."""


# ========================================================================================== data
def _load(
    source: str, config_name: str | None = None, columns: tuple[str, str] = ("text", "label")
) -> Any:
    """A ``datasets`` DatasetDict from a local file (:data:`FORMATS_HELP`), a local directory
    or a Hub name. A ``.txt`` file gives the columns ``columns`` (text, label)."""
    import datasets

    datasets.disable_progress_bars()  # stderr holds errors (one line each), not progress bars
    ext = os.path.splitext(source)[1].lower()
    if ext in LOCAL_FORMATS:
        if not os.path.isfile(source):
            raise FinetuneError(f"data file {source} not found")
        if ext == ".txt":
            return datasets.DatasetDict({"train": _load_txt(source, columns)})
        kwargs = {"delimiter": "\t"} if ext == ".tsv" else {}
        try:
            return datasets.load_dataset(LOCAL_FORMATS[ext], data_files={"train": source}, **kwargs)
        except Exception as e:  # noqa: BLE001  (an empty, truncated or malformed file)
            raise FinetuneError(
                f"{source}: cannot be read as {ext} data ({outdir.error_line(e)}); "
                f"expected {FORMATS_HELP}"
            ) from None
    if os.path.isfile(source):
        raise FinetuneError(
            f"{source}: unsupported file type {ext or '(none)'}; use {FORMATS_HELP}"
        )
    try:
        return datasets.load_dataset(source, config_name)
    except Exception as e:  # noqa: BLE001  (datasets raises many types for a bad name)
        raise FinetuneError(f"cannot load dataset {source!r}: {type(e).__name__}: {e}") from e


def _load_txt(path: str, columns: tuple[str, str]) -> Any:
    """``label<TAB>text`` lines (blank lines skipped) as a Dataset with ``columns``."""
    import datasets

    texts, labels = [], []
    try:
        with open(path, encoding="utf-8") as f:
            lines = list(f)
    except UnicodeDecodeError as e:
        raise FinetuneError(f"{path}: not UTF-8 text ({e}); convert it to UTF-8") from None
    for i, line in enumerate(lines, 1):
        line = line.rstrip("\r\n")
        if not line.strip():
            continue
        label, tab, text = line.partition("\t")
        if not tab or not label.strip():
            raise FinetuneError(
                f"{path} line {i}: expected 'label<TAB>text' (a .txt file holds one labelled "
                "example per line)"
            )
        labels.append(label.strip())
        texts.append(text)
    return datasets.Dataset.from_dict({columns[0]: texts, columns[1]: labels})


def default_lr(hidden_size: int) -> float:
    """The fine-tuning learning rate used when ``--lr`` is not given (see :data:`LR_AT_768`)."""
    return min(LR_MAX, max(LR_MIN, LR_AT_768 * 768 / int(hidden_size)))


def load_splits(
    train: str,
    validation: str | None = None,
    text_column: str = "text",
    label_column: str = "label",
    dataset_config: str | None = None,
    train_split: str = "train",
    validation_split: str = "validation",
    validation_fraction: float = 0.1,
    seed: int = 0,
) -> tuple[list[str], list[Any], list[str], list[Any]]:
    """``(train_texts, train_labels, valid_texts, valid_labels)``.

    The validation rows come from ``validation`` (a file), else the source's ``validation_split``,
    else a seeded ``validation_fraction`` of the training rows.
    """
    data = _load(train, dataset_config, (text_column, label_column))
    if train_split not in data:
        raise FinetuneError(f"{train}: no split {train_split!r} (has {sorted(data)})")
    train_ds = data[train_split]
    if validation is not None:
        valid_ds = _load(validation, columns=(text_column, label_column))["train"]
    elif validation_split in data:
        valid_ds = data[validation_split]
    else:
        if not 0.0 < validation_fraction < 1.0:
            raise FinetuneError(
                f"--validation-fraction must be in (0, 1), got {validation_fraction}"
            )
        parts = train_ds.train_test_split(test_size=validation_fraction, seed=seed)
        train_ds, valid_ds = parts["train"], parts["test"]
    out: list[list[Any]] = []
    for name, ds in (("train", train_ds), ("validation", valid_ds)):
        for col in (text_column, label_column):
            if col not in ds.column_names:
                raise FinetuneError(
                    f"{name} data has no column {col!r} (columns: {ds.column_names}); "
                    "use --text-column / --label-column"
                )
        texts, labels = ds[text_column], ds[label_column]
        if not texts:
            raise FinetuneError(f"{name} data is empty")
        bad = [i for i, t in enumerate(texts) if not isinstance(t, str)]
        if bad:
            raise FinetuneError(f"{name} data: {text_column!r} is not text in row {bad[0]}")
        if any(lab is None for lab in labels):
            raise FinetuneError(f"{name} data: missing {label_column!r} value")
        bad = [i for i, lab in enumerate(labels) if not isinstance(lab, (str, int, float))]
        if bad:
            raise FinetuneError(
                f"{name} data: {label_column!r} in row {bad[0]} is a "
                f"{type(labels[bad[0]]).__name__}, not one class label (text or a number)"
            )
        out += [list(texts), list(labels)]
    return out[0], out[1], out[2], out[3]


def label_mapping(train_labels: Sequence[Any], valid_labels: Sequence[Any]) -> list[Any]:
    """Sorted distinct training labels; integer labels 0..C-1 keep their values."""
    labels = sorted(set(train_labels), key=lambda x: (str(type(x)), x))
    unseen = sorted({str(v) for v in valid_labels} - {str(v) for v in labels})
    if unseen:
        raise FinetuneError(f"validation labels {unseen} never occur in the training data")
    if len(labels) < 2:
        raise FinetuneError(f"need at least 2 distinct labels, got {labels}")
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in labels)
    if ints and labels[0] >= 0:
        return list(range(max(labels) + 1))
    return labels


def encode(tokenizer: Any, texts: list[str], max_length: int) -> list[list[int]]:
    """Token ids with ``<s> ... </s>``, truncated to ``max_length``."""
    return tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]


def pad_batch(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids, attention_mask`` ``[B, longest]`` (right padding, mask 0 on padding)."""
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), n), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


@torch.no_grad()
def evaluate(model: Any, seqs: list[list[int]], labels: list[int], pad_id: int, bs: int) -> float:
    """Accuracy of ``model`` on the encoded ``seqs``."""
    model.eval()
    correct = 0
    for i in range(0, len(seqs), bs):
        ids, mask = pad_batch(seqs[i : i + bs], pad_id)
        pred = model(input_ids=ids, attention_mask=mask).logits.argmax(-1)
        correct += int((pred == torch.tensor(labels[i : i + bs])).sum())
    return correct / len(seqs)


# ======================================================================================== train
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line of ``launch/finetune.py``."""
    p = argparse.ArgumentParser(description="Fine-tune an exported Linformer for classification.")
    p.add_argument("--model", required=True, help="exported model directory (launch/export.py)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--train", help=f"training data file: {FORMATS_HELP}")
    src.add_argument("--dataset", help="a Hugging Face dataset name or local dataset directory")
    p.add_argument("--dataset-config", default=None, help="dataset configuration name")
    p.add_argument("--validation", default=None, help="validation file (same format as --train)")
    p.add_argument("--train-split", default="train")
    p.add_argument("--validation-split", default="validation")
    p.add_argument("--validation-fraction", type=float, default=0.1,
                   help="held-out share of the training rows when there is no validation split")  # fmt: skip
    p.add_argument("--text-column", default="text")
    p.add_argument("--label-column", default="label")
    p.add_argument("--max-length", type=int, default=None,
                   help="tokens per sequence incl. <s> </s> (default and maximum: N_max)")  # fmt: skip
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--eval-batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (default: 5e-5 * 768 / hidden_size, in [2e-5, 5e-4])")  # fmt: skip
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup-ratio", type=float, default=0.06)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="where to write the fine-tuned model")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run the export's code files even when they differ from the sha256s "
                   "recorded at export time (default: refuse)")  # fmt: skip
    return p.parse_args(argv)


def check_export(model_dir: str, trust_remote_code: bool = False) -> dict[str, Any]:
    """``--model``'s config.json, checked: a Linformer export whose code files match the
    sha256s recorded at export time (unless ``trust_remote_code``); :class:`FinetuneError`."""
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise FinetuneError(f"--model {model_dir}: config.json cannot be read ({e})") from None
    kind = config.get("model_type") if isinstance(config, dict) else None
    if kind != "linformer":
        archs = config.get("architectures") if isinstance(config, dict) else None
        raise FinetuneError(
            f"--model {model_dir}: config.json describes a {kind!r} model"
            f"{f' ({archs})' if archs else ''}, not a Linformer export; finetune takes a "
            "directory written by launch/export.py"
        )
    why = None if trust_remote_code else check_remote_code(model_dir)
    if why:
        raise FinetuneError(
            f"--model {model_dir}: refusing to run its code: {why}; export it again, or pass "
            "--trust-remote-code if you trust the code in it"
        )
    check_export_tokenizer(model_dir)
    return config


def check_export_tokenizer(model_dir: str) -> str:
    """The export's tokenizer (the one the texts are encoded with) is the one the model was
    trained with: the file the export recorded (``linformer_export.json``: its sha256), by the
    one identity check (:func:`~linformer_ds.tokenizer_identity.check_tokenizers`); an export
    that records none (written before the record) is not compared. Returns the note."""
    from linformer_ds.tokenizer_identity import (
        HF_FILE,
        SP_FILE,
        TokenizerMismatch,
        check_tokenizers,
        of_model,
    )

    # both files: the texts are encoded with tokenizer.json, tokenizer.model is written along
    refs = [of_model(model_dir, "the export's", name) for name in (SP_FILE, HF_FILE)]
    try:
        return "; ".join(check_tokenizers(r, None) for r in refs if r is not None)
    except TokenizerMismatch as e:
        raise FinetuneError(f"--model {model_dir}: {e}; export it again from the checkpoint, "
                            "or restore the tokenizer the model was trained with") from None  # fmt: skip


def check_loaded(model_dir: str, info: dict[str, Any]) -> None:
    """Only the task head may be new: a weight the export lacks, holds in another shape than
    its config.json says, or holds beyond the model (other than other heads) is refused."""
    missing = sorted(k for k in info.get("missing_keys", ()) if not k.startswith(HEAD_PREFIX))
    shapes = sorted(
        f"{k} {tuple(saved)} vs config {tuple(want)}"
        for k, saved, want in info.get("mismatched_keys", ())
        if not k.startswith(HEAD_PREFIX)
    )
    unexpected = sorted(k for k in info.get("unexpected_keys", ()) if not k.startswith(OTHER_HEADS))
    found = (("missing", missing), ("shape mismatch (weights vs config)", shapes),
             ("unexpected", unexpected))  # fmt: skip
    parts = [f"{what} {_short(keys)}" for what, keys in found if keys]
    if info.get("error_msgs"):
        parts.append(f"errors {_short([str(m) for m in info['error_msgs']])}")
    if parts:
        raise FinetuneError(
            f"--model {model_dir}: its weights do not match its config.json (only the task head "
            f"{HEAD_PREFIX}* may be newly initialised): " + "; ".join(parts)
        )


def _short(items: list[str], n: int = 4) -> str:
    return ", ".join(items[:n]) + (f", ... ({len(items)} in all)" if len(items) > n else "")


def finetune(args: argparse.Namespace) -> dict[str, Any]:
    """Run fine-tuning as configured by ``args``; returns the results written to the output.
    ``--out`` is locked and ``--model`` pinned (shared) for the whole run."""
    try:  # the output contract before the lock file is made beside it (again once locked)
        outdir.check_out(args.out, "finetune", _inputs(args), args.overwrite)
    except outdir.OutDirError as e:
        raise FinetuneError(str(e)) from None
    with contextlib.ExitStack() as held:
        try:
            lock = held.enter_context(dirlock.output_lock(args.out, "finetune"))
            if lock.stale_note():
                log.warning(lock.stale_note())
        except dirlock.LockError as e:
            raise FinetuneError(str(e)) from None
        except OSError:  # no lock file can be made there: the --out checks below say why
            pass
        same = os.path.realpath(args.model) == os.path.realpath(args.out)  # check_out says why
        if os.path.isdir(args.model) and not same:
            try:  # an export writing --model right now is refused; a read-only place is fine
                held.enter_context(
                    dirlock.output_lock(args.model, "finetune (reading)", "--model", shared=True)
                )
            except dirlock.LockError as e:
                raise FinetuneError(str(e)) from None
            except OSError:
                pass
        return _finetune(args)


def _inputs(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    return [("--model", args.model), ("--train", args.train), ("--dataset", args.dataset),
            ("--validation", args.validation)]  # fmt: skip


def _finetune(args: argparse.Namespace) -> dict[str, Any]:
    """:func:`finetune` with ``--out`` locked."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    try:  # before anything else: --out never replaces what finetune did not create
        state = outdir.check_out(args.out, "finetune", _inputs(args), args.overwrite)
    except outdir.OutDirError as e:
        raise FinetuneError(str(e)) from None
    if state == "exists":
        raise FinetuneError(
            f"--out {args.out} holds an earlier fine-tuned model; pass --overwrite to replace it"
        )
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise FinetuneError(f"--model {args.model}: no config.json (not an exported model)")
    for name in ("epochs", "batch_size", "eval_batch_size", "lr", "max_grad_norm"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise FinetuneError(f"--{name.replace('_', '-')} must be > 0 (and finite), got {value}")
    ranges = {"weight_decay": (0.0, math.inf, "[0, inf)"), "warmup_ratio": (0.0, 1.0, "[0, 1)"),
              "validation_fraction": (0.0, 1.0, "(0, 1)")}  # fmt: skip
    for name, (lo, hi, text) in ranges.items():
        value = getattr(args, name)
        ok = lo <= value < hi and (name != "validation_fraction" or value > 0)
        if not ok:
            raise FinetuneError(f"--{name.replace('_', '-')} must be in {text}, got {value}")
    if not 0 <= args.seed < 2**32:
        raise FinetuneError(f"--seed must be in [0, 2**32), got {args.seed}")
    try:  # --out writable? (before training, not after)
        parent = os.path.dirname(os.path.abspath(args.out))
        if os.path.exists(parent) and not os.path.isdir(parent):
            raise FinetuneError(f"--out {args.out}: {parent} is not a directory")
        os.makedirs(parent, exist_ok=True)
        tempfile.TemporaryDirectory(prefix=".finetune-probe-", dir=parent).cleanup()
    except OSError as e:
        raise FinetuneError(f"--out {args.out}: cannot write there: {e.strerror or e}") from None
    check_export(args.model, getattr(args, "trust_remote_code", False))  # before any data
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    source = args.train or args.dataset
    tr_x, tr_y, va_x, va_y = load_splits(
        source, args.validation, args.text_column, args.label_column, args.dataset_config,
        args.train_split, args.validation_split, args.validation_fraction, args.seed,
    )  # fmt: skip
    labels = label_mapping(tr_y, va_y)
    label_ids = {str(v): i for i, v in enumerate(labels)}
    tr_l = [label_ids[str(v)] for v in tr_y]
    va_l = [label_ids[str(v)] for v in va_y]

    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # the new head's "MISSING" load report is expected
    hf_logging.disable_progress_bar()  # stderr holds errors, one line each
    try:  # the code was checked (check_export): it may run
        tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=True)
        model, info = AutoModelForSequenceClassification.from_pretrained(
            args.model,
            trust_remote_code=True,
            num_labels=len(labels),
            id2label={i: str(v) for i, v in enumerate(labels)},
            label2id={str(v): i for i, v in enumerate(labels)},
            ignore_mismatched_sizes=True,  # the head's label count may differ: checked below
            output_loading_info=True,
            dtype=torch.float32,
        )
    except (FinetuneError, KeyboardInterrupt):
        raise
    except Exception as e:  # noqa: BLE001  (a bad option in config.json, a missing file, ...)
        raise FinetuneError(
            f"--model {args.model} cannot be loaded: {outdir.error_line(e)}"
        ) from None
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    check_loaded(args.model, info)
    n_max = int(model.config.max_seq_len)
    max_length = args.max_length or n_max
    if not 3 <= max_length <= n_max:
        raise FinetuneError(f"--max-length must be in [3, N_max={n_max}], got {max_length}")
    tr_s, va_s = encode(tokenizer, tr_x, max_length), encode(tokenizer, va_x, max_length)
    pad_id = int(tokenizer.pad_token_id)
    if args.lr is None:
        args.lr = default_lr(model.config.hidden_size)

    opt = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr)
    steps_per_epoch = math.ceil(len(tr_s) / args.batch_size)
    total = max(1, math.ceil(args.epochs * steps_per_epoch))
    sched = lr_scheduler(opt, int(args.warmup_ratio * total), total, decay="linear")

    history: list[dict[str, Any]] = []
    step, t0 = 0, time.time()
    order = list(range(len(tr_s)))
    rng = random.Random(args.seed)
    log.info(
        f"[finetune] train={len(tr_s)} valid={len(va_s)} labels={[str(v) for v in labels]} "
        f"max_length={max_length} steps={total} lr={args.lr:.3g}"
    )
    while step < total:
        rng.shuffle(order)
        model.train()
        losses = []
        for i in range(0, len(order), args.batch_size):
            if step >= total:
                break
            idx = order[i : i + args.batch_size]
            ids, mask = pad_batch([tr_s[j] for j in idx], pad_id)
            out = model(
                input_ids=ids, attention_mask=mask, labels=torch.tensor([tr_l[j] for j in idx])
            )
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(out.loss.detach()))
            step += 1
        acc = evaluate(model, va_s, va_l, pad_id, args.eval_batch_size)
        epoch = {"epoch": len(history) + 1, "step": step, "train_loss": sum(losses) / len(losses),
                 "val_accuracy": acc, "seconds": round(time.time() - t0, 2)}  # fmt: skip
        history.append(epoch)
        log.info(f"[finetune] {json.dumps(epoch)}")

    results = {
        "val_accuracy": history[-1]["val_accuracy"],
        "num_train": len(tr_s),
        "num_validation": len(va_s),
        "labels": [str(v) for v in labels],
        "max_length": max_length,
        "history": history,
        "base_model": portable_paths(os.path.abspath(args.model)),
        "lr": args.lr,
    }
    _save(model, args, results)
    return results


def tokenizer_of(model_dir: str) -> str:
    """The tokenizer an export carries: its ``tokenizer.model`` (SentencePiece), else the
    directory itself (a Hugging Face tokenizer saved with the export)."""
    sp = os.path.join(model_dir, "tokenizer.model")
    return sp if os.path.isfile(sp) else model_dir


def _save(model: Any, args: argparse.Namespace, results: dict[str, Any]) -> None:
    """Write the fine-tuned classifier in the export format: into a directory next to
    ``--out``, swapped in when complete (a failed write leaves the previous output whole)."""

    model_config = ModelConfig.from_dict(model.config.to_model_config().to_dict())
    state = {k: v.detach() for k, v in model.state_dict().items()}
    tmp = outdir.staging_dir(args.out, "finetune")
    try:
        write_model_dir(
            tmp,
            model_config,
            state,
            tokenizer_of(args.model),
            architecture="LinformerForSequenceClassification",
            config_extra={
                "id2label": dict(model.config.id2label),
                "label2id": dict(model.config.label2id),
                "problem_type": "single_label_classification",
            },
            provenance={
                "finetuned_from": portable_paths(os.path.abspath(args.model)),
                "dtype": "float32",
            },
        )
        with open(os.path.join(tmp, "finetune_results.json"), "w") as f:
            json.dump({**results, "args": portable_paths(vars(args))}, f, indent=2)
        apply_umask(tmp)
        outdir.swap_in(tmp, args.out)
    except (FinetuneError, ExportError):
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except Exception as e:  # a full disk, a file-size limit: one line, --out untouched
        shutil.rmtree(tmp, ignore_errors=True)
        raise FinetuneError(outdir.write_error(e, f"--out {args.out}")) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status."""
    args = parse_args(argv)
    outdir.ignore_file_size_signal()
    try:
        setup_logging()
        results = finetune(args)
    except (FinetuneError, ExportError, LogLevelError) as e:
        return outdir.fail("finetune failed", str(e))
    except OSError as e:  # a file that cannot be read or written (disk full, permissions)
        where = f": {e.filename}" if e.filename else ""
        return outdir.fail("finetune failed", f"{e.strerror or e}{where}")
    except KeyboardInterrupt:  # the staging copy is already gone; --out untouched
        return outdir.fail("finetune interrupted", f"nothing written to --out {args.out}", 130)
    log.info(f"[finetune] validation accuracy {results['val_accuracy']:.4f}; saved to {args.out}")
    return 0
