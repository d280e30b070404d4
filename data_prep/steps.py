"""The steps of data_prep that the one-process pipeline (:mod:`data_prep.pipeline`) and the
multi-rank path (:mod:`data_prep.parallel`) share: the options, the output directory and its
resume state, the tokenizer (trained on a sample or copied), the encoding tasks and the manifest.
"""

import collections
import json
import multiprocessing as mp
import os
import shutil
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from data_prep import console
from data_prep import hf_tokenizer as hft
from data_prep import packing as pk
from data_prep.doc_stats import split_documents
from data_prep.errors import DataPrepError
from data_prep.files import check_encoding
from data_prep.shards import ShardWriter
from data_prep.sources import DEFAULT_MAX_DOC_BYTES, Source, SourceStats, source_kind
from data_prep.tokenizer import (
    MAX_SENTENCE_BYTES,
    MODEL_TYPES,
    SPECIAL_IDS,
    SPECIAL_PIECES,
    load_tokenizer,
    round_trip,
    tokenizer_info,
    train_tokenizer,
)
from data_prep.unk_rate import unk_record
from linformer_ds import outdir
from linformer_ds.context_meter import counts_record
from linformer_ds.fsio import atomic_write_json, file_sha256

FORMAT_VERSION = 1
MIN_SEQ_LEN = 8
MAX_SEQ_LEN = 1 << 24  # 16,777,216 tokens: a 32 MiB row at uint16
MANIFEST = "manifest.json"
PROGRESS = "progress.json"
TOKENIZER = "tokenizer.model"
SHARD_TARGET_BYTES = 64 << 20


@dataclass
class PrepConfig:
    """Every data_prep option (the CLI maps one flag to each field)."""

    sources: list[str]
    out: str
    seq_len: int
    vocab_size: int | None = None
    model_type: str = "unigram"
    tokenizer: str | None = None
    character_coverage: float | None = None  # None: by alphabet size (training_options)
    max_sentences_for_tokenizer: int = 300_000
    tokenizer_threads: int = 2  # fixed, not the CPU count: the model depends on it
    text_column: str = "text"
    encoding: str = "utf-8"  # of plain-text and JSON-lines/CSV inputs
    packing: str = "full"
    valid_fraction: float = 0.01
    seed: int = 0
    shard_rows: int | None = None  # default: about 64 MiB per shard
    max_docs: int | None = None
    max_bytes: int | None = None
    max_doc_bytes: int = DEFAULT_MAX_DOC_BYTES
    workers: int = field(default_factory=lambda: max(1, os.cpu_count() or 1))
    task_bytes: int = 1 << 20
    overwrite: bool = False
    resume: bool = False
    checkpoint_seconds: float = 10.0
    progress: bool = True
    unit_bytes: int | None = None  # ranks' work unit (mpirun/srun); the output ignores it
    rank_timeout: float = 120.0  # mpirun/srun: a rank silent this long fails the run

    def validate(self) -> None:
        """Raise :class:`DataPrepError` naming the first bad option."""
        if self.seq_len < MIN_SEQ_LEN:
            raise DataPrepError(
                f"--seq-len {self.seq_len} is too small: the minimum is {MIN_SEQ_LEN}"
            )
        if self.seq_len > MAX_SEQ_LEN:
            raise DataPrepError(
                f"--seq-len {self.seq_len} is too large: the maximum is {MAX_SEQ_LEN} tokens "
                "per row (longer sequences: train with sequence parallelism on rows of this size)"
            )
        if self.packing not in pk.PACKINGS:
            raise DataPrepError(f"--packing must be one of {pk.PACKINGS}, got {self.packing!r}")
        if self.model_type not in MODEL_TYPES:
            raise DataPrepError(
                f"--model-type must be one of {MODEL_TYPES}, got {self.model_type!r}"
            )
        if not 0.0 <= self.valid_fraction < 1.0:
            raise DataPrepError(f"--valid-fraction must be in [0, 1), got {self.valid_fraction}")
        if self.tokenizer is None and self.vocab_size is None:
            raise DataPrepError("--vocab-size is required unless --tokenizer is given")
        if self.vocab_size is not None and self.vocab_size <= len(SPECIAL_IDS):
            raise DataPrepError(
                f"--vocab-size {self.vocab_size} is too small: it must exceed the "
                f"{len(SPECIAL_IDS)} special tokens"
            )
        if self.vocab_size is not None and self.vocab_size > 2**32 - 1:
            raise DataPrepError(f"--vocab-size {self.vocab_size} does not fit in uint32")
        for name in ("workers",):
            if getattr(self, name) < 0:
                raise DataPrepError(f"--{name} must be >= 0")
        for name in ("shard_rows", "max_docs", "max_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise DataPrepError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.tokenizer_threads < 1:
            raise DataPrepError("--tokenizer-threads must be >= 1")
        if self.max_sentences_for_tokenizer < 1:
            raise DataPrepError("--max-sentences-for-tokenizer must be >= 1")
        if self.max_doc_bytes < 1 or self.task_bytes < 1:
            raise DataPrepError("--max-doc-bytes and task_bytes must be >= 1")
        cov = self.character_coverage
        if cov is not None and not 0.0 < cov <= 1.0:  # SentencePiece's own range
            raise DataPrepError(
                f"--character-coverage must be in (0, 1], got {self.character_coverage}"
            )
        if not 0 <= self.seed < 2**32:
            raise DataPrepError(f"--seed must be in [0, 2**32), got {self.seed}")
        if self.unit_bytes is not None and self.unit_bytes < 1:
            raise DataPrepError(f"--unit-bytes must be >= 1, got {self.unit_bytes}")
        if not self.rank_timeout > 0 or self.rank_timeout == float("inf"):
            raise DataPrepError(f"--rank-timeout must be > 0 seconds, got {self.rank_timeout}")
        if not self.checkpoint_seconds >= 0:  # 0: after every task; nan is refused too
            raise DataPrepError(f"checkpoint_seconds must be >= 0, got {self.checkpoint_seconds}")
        if not self.out or not str(self.out).strip():
            raise DataPrepError("--out must not be empty")
        check_encoding(self.encoding)

    def fingerprint(self) -> dict[str, Any]:
        """The options that determine the output (a resumed run must match them)."""
        keys = (
            "sources",
            "seq_len",
            "vocab_size",
            "model_type",
            "character_coverage",
            "max_sentences_for_tokenizer",
            "tokenizer_threads",
            "text_column",
            "packing",
            "valid_fraction",
            "seed",
            "shard_rows",
            "max_docs",
            "max_bytes",
            "max_doc_bytes",
        )
        fp = {k: getattr(self, k) for k in keys}
        if check_encoding(self.encoding) != "utf-8":  # (runs before --encoding keep their print)
            fp["encoding"] = self.encoding
        tok = self.tokenizer
        if tok and os.path.isdir(tok) and os.path.isfile(os.path.join(tok, hft.HF_FILE)):
            tok = os.path.join(tok, hft.HF_FILE)  # a Hugging Face tokenizer directory
        fp["tokenizer_sha256"] = file_sha256(tok) if tok and os.path.isfile(tok) else None
        return fp


@dataclass
class PrepResult:
    """What :func:`prepare` returns: the manifest plus run statistics (not in the manifest)."""

    manifest: dict[str, Any]
    elapsed_s: float
    encode_elapsed_s: float
    tokens_per_s: float


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 65535 else np.dtype(np.uint32)


def _log(cfg: PrepConfig, msg: str) -> None:
    """A progress or summary line (INFO: data_prep.console), unless ``--quiet``."""
    if cfg.progress:
        console.info(msg)


# ----------------------------------------------------------------------------- output dir
def source_roots(sources: list[str]) -> list[str]:
    """The local paths the sources read below, as each spec's kind names them: a file or
    directory, a glob's fixed leading directory, the stdlib directory, an ``hf:`` source's
    local directory."""
    return [root for spec in sources for root in source_kind(spec).roots(spec)]


def options_diff(saved: Any, new: dict[str, Any]) -> str:
    """The options of :meth:`PrepConfig.fingerprint` that differ, as flags with the saved and
    the new value: ``--seq-len 128 -> 256, --seed 0 -> 1``."""
    if not isinstance(saved, dict):
        return f"no options recorded in {PROGRESS}"
    defaults = {"encoding": "utf-8"}  # recorded only when not the default

    def show(key: str, value: Any) -> str:
        if key == "tokenizer_sha256" and isinstance(value, str):
            return f"sha256 {value[:12]}"
        if isinstance(value, list):
            return " ".join(map(str, value))
        return "none" if value is None else str(value)

    flags = {"sources": "--source", "tokenizer_sha256": "--tokenizer"}
    parts = []
    for key in [*new, *(k for k in saved if k not in new)]:
        old_v, new_v = saved.get(key, defaults.get(key)), new.get(key, defaults.get(key))
        if old_v != new_v:
            flag = flags.get(key, "--" + key.replace("_", "-"))
            parts.append(f"{flag} {show(key, old_v)} -> {show(key, new_v)}")
    return ", ".join(parts) or "the same options in another form"


def partial_dir(out: str) -> str:
    """Where a run builds ``--out`` until it is complete: ``.<out>.data_prep-partial`` beside
    it (the same name for every run with that ``--out``: ``--resume`` continues the work
    there); renamed to ``--out`` at the end (:func:`data_prep.driver.publish`)."""
    out = os.path.abspath(out)
    return os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.data_prep-partial")


def _prepare_out_dir(cfg: PrepConfig) -> tuple[dict[str, Any] | None, str]:
    """Check ``--out`` and prepare the partial directory; returns (the progress state of the
    interrupted run to resume or None, the partial directory)."""
    out = cfg.out
    inputs = [("--source", p) for p in source_roots(cfg.sources)] + [("--tokenizer", cfg.tokenizer)]
    try:  # --out never replaces what data_prep did not create, nor lies in an input
        outdir.check_out(out, "data_prep", inputs, cfg.overwrite, cfg.resume)
    except outdir.OutDirError as e:
        raise DataPrepError(str(e)) from None
    work = partial_dir(out)
    entries = os.listdir(out) if os.path.isdir(out) else []
    has_manifest = MANIFEST in entries
    in_place = PROGRESS in entries and not has_manifest  # interrupted before partial_dir was used
    has_partial = os.path.isfile(os.path.join(work, PROGRESS))
    if cfg.overwrite:  # the old output stays until the new one replaces it
        shutil.rmtree(work, ignore_errors=True)
    elif cfg.resume:
        where = work if has_partial else out if in_place else None
        if where is None:
            if has_manifest:
                raise DataPrepError(
                    f"--out {out!r} already holds a finished run ({MANIFEST}); "
                    "nothing to resume (use --overwrite to rebuild)"
                )
            if entries:
                raise DataPrepError(
                    f"cannot --resume: {out!r} holds no {PROGRESS} from an interrupted run"
                )
            raise DataPrepError(f"cannot --resume: {out!r} holds no interrupted run")
        try:
            with open(os.path.join(where, PROGRESS)) as f:
                state = json.load(f)
        except (OSError, ValueError) as e:
            raise DataPrepError(
                f"cannot --resume: {os.path.join(where, PROGRESS)} is unreadable ({e}); rerun "
                "with --overwrite"
            ) from None
        saved = state.get("fingerprint") if isinstance(state, dict) else None
        if saved != cfg.fingerprint():
            raise DataPrepError(
                f"cannot --resume: the interrupted run in {where!r} used different options "
                f"({options_diff(saved, cfg.fingerprint())}); rerun with the same options or "
                "--overwrite"
            )
        if where == out:  # a run of an earlier version, built in --out: continue it in work
            shutil.rmtree(work, ignore_errors=True)
            os.replace(out, work)
        return state, work
    elif has_partial or in_place:
        raise DataPrepError(
            f"--out {out!r} holds an interrupted data_prep run (in {work if has_partial else out};"
            " pass --resume to continue it); pass --overwrite to start over"
        )
    elif entries:
        why = (
            "already holds a finished data_prep output"
            if has_manifest
            else "exists and is not empty"
        )
        raise DataPrepError(f"--out {out!r} {why}; pass --overwrite to start over")
    shutil.rmtree(work, ignore_errors=True)  # (a directory without progress.json: no run)
    os.makedirs(work)
    # Mark the directory as ours at once, so that a run interrupted while training the
    # tokenizer can still be resumed (from the start) or overwritten.
    # (progress.json, then manifest.json, are data_prep's marker: outdir.identify)
    atomic_write_json(os.path.join(work, PROGRESS), {"fingerprint": cfg.fingerprint()})
    return None, work


def _limited(cfg: PrepConfig, source: Source) -> Iterator[str]:
    """The source's documents, stopped by --max-docs / --max-bytes (at document granularity).

    Stops right after the document that reaches a limit, without reading the next one.
    """
    for i, doc in enumerate(source):
        yield doc
        if cfg.max_docs is not None and i + 1 >= cfg.max_docs:
            return
        if cfg.max_bytes is not None and source.stats.bytes >= cfg.max_bytes:
            return


# ---------------------------------------------------------------------------- tokenizer
def resumed_tokenizer(out: str, info: dict[str, Any]) -> Any:
    """The workers' model (:func:`data_prep.packing.init_worker`) of the tokenizer an
    interrupted run saved in ``out`` (``info``: its manifest entry), checked unchanged."""
    from linformer_ds.tokenizer_identity import TokenizerMismatch, of_data, read_checked

    ref = of_data(out, {"tokenizer": info}, "the interrupted run's")
    path = ref.path if ref else os.path.join(out, TOKENIZER)
    try:  # the file the interrupted run recorded (the one identity check's reader)
        data = read_checked(ref)[0] if ref and ref.sha256 else None
    except TokenizerMismatch:
        data = None
    if data is None:
        raise DataPrepError(f"cannot resume: {path!r} changed since the interrupted run")
    if info.get("kind") == hft.KIND:
        return hft.saved(out, info)[0]
    return data


def given_tokenizer(cfg: PrepConfig) -> tuple[Any, dict[str, Any]]:
    """Copy ``--tokenizer`` into ``cfg.out``: ``(the workers' model, manifest entry)``."""
    if hft.is_hf_tokenizer(cfg.tokenizer):
        return hft.copy_tokenizer(cfg.tokenizer, cfg.out, cfg.vocab_size)
    dest = os.path.join(cfg.out, TOKENIZER)
    sp = copy_given_tokenizer(cfg, dest)
    with open(dest, "rb") as f:
        return f.read(), tokenizer_info(dest, sp, None)


def copy_given_tokenizer(cfg: PrepConfig, dest: str):
    """Check ``--tokenizer`` (exists, agrees with ``--vocab-size``), copy it to ``dest``
    atomically and return it loaded."""
    if not os.path.isfile(cfg.tokenizer):
        raise DataPrepError(
            f"--tokenizer file does not exist: {cfg.tokenizer!r} (a SentencePiece .model or a "
            "Hugging Face tokenizer directory)"
        )
    sp = load_tokenizer(cfg.tokenizer)
    if cfg.vocab_size is not None and cfg.vocab_size != sp.get_piece_size():
        raise DataPrepError(
            f"--vocab-size {cfg.vocab_size} does not match --tokenizer {cfg.tokenizer!r} "
            f"(vocab {sp.get_piece_size()}); omit --vocab-size"
        )
    shutil.copyfile(cfg.tokenizer, dest + ".tmp")
    os.replace(dest + ".tmp", dest)
    return sp


def train_on_sample(
    cfg: PrepConfig, sentences: list[str], sampled: dict[str, int], t0: float
) -> tuple[Any, dict[str, Any]]:
    """Train ``OUT/tokenizer.model`` on the sample; returns the workers' model (its bytes)
    and its manifest entry.

    ``sampled`` holds the sample's counters (see :func:`sample_sentences`); ``t0`` is when the
    sampling began (the manifest's ``seconds``)."""
    dest = os.path.join(cfg.out, TOKENIZER)
    _log(
        cfg,
        f"training a {cfg.model_type} tokenizer (vocab {cfg.vocab_size}) on "
        f"{sampled['sampled_lines']} sampled lines ({sampled['sampled_bytes']:,} bytes) of "
        f"{sampled['corpus_lines']} non-blank lines ({sampled['corpus_bytes']:,} bytes); "
        f"{sampled['long_lines']} lines over {MAX_SENTENCE_BYTES} bytes were split",
    )
    train_tokenizer(
        sentences,
        dest,
        cfg.vocab_size,
        cfg.model_type,
        cfg.character_coverage,
        num_threads=cfg.tokenizer_threads,
        seed=cfg.seed,
    )
    sp = load_tokenizer(dest)
    trip = round_trip(sp, sentences)  # decode(encode(x)) == normalized(x) on the sample
    _log(
        cfg,
        f"tokenizer round trip: {trip['exact']}/{trip['lines']} sampled lines decode to "
        f"their normalized text ({trip['unk_pieces']} <unk> pieces)",
    )
    trained = {
        **sampled,  # sampled_lines/bytes, corpus_lines/bytes, long_lines (split)
        "max_sentences": cfg.max_sentences_for_tokenizer,
        "character_coverage": cfg.character_coverage,  # requested (None: automatic)
        "round_trip": trip,
        "threads": cfg.tokenizer_threads,
        "seconds": round(time.time() - t0, 2),
    }
    with open(dest, "rb") as f:
        return f.read(), tokenizer_info(dest, sp, trained)


# ------------------------------------------------------------------------------- encoding
class _Encoder:
    """Runs ``encode_task`` in worker processes (or inline when workers == 0), in order.

    A ``ProcessPoolExecutor`` (not ``multiprocessing.Pool``): a worker that dies (killed, out
    of memory) fails the run with ``BrokenProcessPool`` instead of hanging it.
    """

    def __init__(self, workers: int, model_proto: Any, settings: pk.EncodeSettings) -> None:
        self.workers = workers
        self.pool: Any | None = None
        if workers > 0:
            self.pool = ProcessPoolExecutor(
                workers,
                mp_context=mp.get_context("spawn"),
                initializer=pk.init_worker,
                initargs=(model_proto, settings),
            )
        else:
            pk.init_worker(model_proto, settings, worker=False)  # Ctrl-C: KeyboardInterrupt

    def map(self, tasks: Iterable[tuple[list[str], Any]]) -> Iterator[tuple[dict[str, Any], Any]]:
        """Yield ``(result, meta)`` for each ``(texts, meta)`` task, in submission order."""
        if self.pool is None:
            for texts, meta in tasks:
                yield pk.encode_task(texts), meta
            return
        window: collections.deque[tuple[Any, Any]] = collections.deque()
        limit = 2 * self.workers + 2  # bounded: at most this many batches in flight
        for texts, meta in tasks:
            window.append((self.pool.submit(pk.encode_task, texts), meta))
            if len(window) >= limit:
                fut, m = window.popleft()
                yield fut.result(), m
        while window:
            fut, m = window.popleft()
            yield fut.result(), m

    def close(self, ok: bool) -> None:
        """Stop the workers (dropping queued batches after an error)."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=not ok)
            self.pool = None


def _tasks(
    docs: Iterator[str], source: Source, task_bytes: int
) -> Iterator[tuple[list[str], dict[str, int]]]:
    """Batch documents into tasks of about ``task_bytes``; meta holds the source counters."""
    texts: list[str] = []
    size = 0
    stats = source.stats
    before = (stats.bytes, stats.undecodable_bytes)
    for doc in docs:
        texts.append(doc)
        size += len(doc)
        if size >= task_bytes:
            meta = {
                "documents": len(texts),
                "bytes": stats.bytes - before[0],
                "undecodable_bytes": stats.undecodable_bytes - before[1],
            }
            yield texts, meta
            texts, size = [], 0
            before = (stats.bytes, stats.undecodable_bytes)
    if texts or (stats.bytes, stats.undecodable_bytes) != before:  # bytes after the last doc
        meta = {
            "documents": len(texts),
            "bytes": stats.bytes - before[0],
            "undecodable_bytes": stats.undecodable_bytes - before[1],
        }
        yield texts, meta


def _skip(docs: Iterator[str], n: int) -> Iterator[str]:
    """Consume the first ``n`` documents now (so their bytes are not counted again)."""
    it = iter(docs)
    for _ in range(n):
        if next(it, None) is None:
            raise DataPrepError(
                f"cannot resume: the source now has fewer than the {n} documents already packed"
            )
    return it


def _empty_counters() -> dict[str, Any]:
    return {
        "documents_read": 0,
        "bytes": 0,
        "undecodable_bytes": 0,
        "empty_documents": 0,
        "splits": {s: {"documents": 0, "content": 0, "pad": 0} for s in pk.SPLITS},
    }


def _documents_done(out: str) -> int:
    try:
        with open(os.path.join(out, PROGRESS)) as f:
            return int(json.load(f)["counters"]["documents_read"])
    except (OSError, ValueError, KeyError):
        return 0


def _manifest(
    cfg: PrepConfig,
    source: Source,
    stats: SourceStats,
    tok_info: dict[str, Any],
    vocab_size: int,
    dtype: np.dtype,
    shard_rows: int,
    counters: dict[str, Any],
    writers: dict[str, ShardWriter],
) -> dict[str, Any]:
    splits = {}
    for s, w in writers.items():
        shards = w.close()
        c = counters["splits"][s]
        rows = sum(sh["rows"] for sh in shards)
        total = rows * cfg.seq_len
        special = total - c["content"] - c["pad"]
        splits[s] = {
            "shards": shards,
            "rows": rows,
            "documents": c["documents"],
            "tokens": {
                "content": c["content"],
                "special": special,
                "pad": c["pad"],
                "total": total,
            },
            "padding_fraction": c["pad"] / total if total else 0.0,
            # single-document rows and document lengths, counted from the shards (doc_stats)
            "documents_in_rows": split_documents(
                cfg.out, shards, cfg.packing, pk.special_settings_ids(tok_info), cfg.seq_len
            ),
        }
    # the train split's token counts for the trainer's context meter (unigram_counts.npy)
    special_ids = dict(tok_info.get("special_ids") or SPECIAL_IDS)  # (SentencePiece: fixed)
    special_pieces = dict(tok_info.get("special_pieces") or SPECIAL_PIECES)
    unigram = counts_record(cfg.out, splits["train"]["shards"], vocab_size,
                            sorted(special_ids.values()))  # fmt: skip
    layout = {
        "full": "each row is [cls] + N-1 tokens of the split's stream, where every document is "
        "followed by sep; documents continue across rows; only the split's last row is padded",
        "pad": "each row is [cls] + up to N-2 tokens of one document + [sep] + pad; a longer "
        "document continues in the next row; documents never share a row",
    }[cfg.packing]
    return {
        "format_version": FORMAT_VERSION,
        "created_by": "data_prep",
        "seq_len": cfg.seq_len,
        "vocab_size": vocab_size,
        "dtype": dtype.name,
        "packing": cfg.packing,
        "row_layout": layout,
        "special_ids": special_ids,
        "special_pieces": special_pieces,
        "tokenizer": tok_info,
        "source": {
            **source.describe(),
            "documents": counters["documents_read"],
            "empty_documents": counters["empty_documents"],
            "bytes": counters["bytes"],
            "undecodable_bytes": counters["undecodable_bytes"],
            "encoding": cfg.encoding,
            "binary_files_skipped": stats.binary_files,
            "max_docs": cfg.max_docs,
            "max_bytes": cfg.max_bytes,
            "max_doc_bytes": cfg.max_doc_bytes,
        },
        "split": {
            "by": "document",
            "method": "blake2b-64 of the document text keyed by seed < valid_fraction -> valid",
            "valid_fraction": cfg.valid_fraction,
            "seed": cfg.seed,
        },
        "shard_rows": shard_rows,
        "splits": splits,
        "unigram": unigram,
        # the unknown token's share of the content tokens, any tokenizer kind (data_prep.unk_rate)
        "unk": unk_record(cfg.out, splits, special_ids["unk"], special_pieces["unk"]),
    }
