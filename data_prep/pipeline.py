"""The data_prep pipeline: source -> tokenizer -> parallel tokenization -> packed shards.

Output directory::

    OUT/manifest.json            written last (atomically): the run is complete
    OUT/tokenizer.model          trained here or copied from --tokenizer (a SentencePiece model)
    OUT/tokenizer/               or: a Hugging Face --tokenizer directory, saved again here
    OUT/train/shard_00000.npy    [rows, N] uint16 (vocab <= 65535) else uint32
    OUT/valid/shard_00000.npy
    OUT/progress.json            only while a run is unfinished (resume state)

Memory is bounded independently of corpus size: documents are read one at a time, at most
``2 * workers + 2`` batches of about ``task_bytes`` text are in flight, tokenizer training uses a
reservoir sample of at most ``max_sentences_for_tokenizer`` lines, and rows go to disk as soon
as they are complete. The output is identical for any ``workers`` and ``task_bytes``.

Resume: a checkpoint (``progress.json``) records, every ``checkpoint_seconds`` and at the end,
the number of documents fully packed, the finished shards, the rows of each partial shard and
the packer carry. A rerun with ``resume=True`` truncates the partial shards to the recorded rows,
skips the recorded documents and continues; the result is byte-identical to an uninterrupted run.
"""

import os
import shutil
import sys
import time
from typing import Any

from tqdm import tqdm

from data_prep import packing as pk
from data_prep.distributed import detect_world
from data_prep.doc_stats import summary_line
from data_prep.errors import DataPrepError, EmptySplitError
from data_prep.parallel import prepare_distributed
from data_prep.shards import ShardWriter
from data_prep.sources import Source
from data_prep.steps import (  # noqa: F401  (PrepConfig ... re-exported: the public API)
    FORMAT_VERSION,
    MANIFEST,
    PROGRESS,
    SHARD_TARGET_BYTES,
    TOKENIZER,
    PrepConfig,
    PrepResult,
    _documents_done,
    _empty_counters,
    _Encoder,
    _get_tokenizer,
    _limited,
    _log,
    _manifest,
    _prepare_out_dir,
    _skip,
    _tasks,
    dtype_for_vocab,
    worker_model,
)
from linformer_ds import outdir
from linformer_ds.fsio import atomic_write_json


def prepare(cfg: PrepConfig) -> PrepResult:
    """Run data_prep end to end; returns the manifest (also written to ``OUT/manifest.json``)."""
    t_start = time.time()
    world = detect_world()
    if world is not None:  # launched by mpirun or srun: one rank of many (data_prep.parallel)
        return prepare_distributed(cfg, world)
    cfg.validate()
    # missing paths fail here
    source = Source(cfg.sources, cfg.text_column, cfg.max_doc_bytes, cfg.encoding)
    try:
        state, created = _prepare_out_dir(cfg)
    except OSError as e:  # read-only or full file system, no permission: before any work
        raise DataPrepError(
            f"--out {cfg.out}: cannot write there: {e.strerror or e}"
            f"{' (' + e.filename + ')' if e.filename else ''}; choose a writable --out"
        ) from None
    if state is not None and state.get("mode") == "units":  # (before the clean-up below)
        raise DataPrepError(
            f"cannot --resume {cfg.out!r} as one process: that run was started under mpirun/srun; "
            "resume it the same way, on any number of ranks (or --overwrite)"
        )
    try:
        try:
            return _run(cfg, source, state, t_start)
        except OSError as e:  # writing the output failed (disk full, file system gone read-only)
            kept = _documents_done(cfg.out)
            raise DataPrepError(
                outdir.write_error(e, f"to --out {cfg.out}")
                + "; "
                + (
                    f"the {kept} documents packed so far are kept: fix it and rerun with --resume"
                    if kept
                    else "nothing was kept"
                )
            ) from None
    except DataPrepError as e:
        if isinstance(e, EmptySplitError) or _documents_done(cfg.out) == 0:  # nothing of value
            # was written (or nothing usable: an empty split): leave no trace
            if created:
                shutil.rmtree(cfg.out, ignore_errors=True)
            else:  # the directory existed, empty: empty it again
                for name in os.listdir(cfg.out):
                    path = os.path.join(cfg.out, name)
                    shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        raise


def _run(
    cfg: PrepConfig, source: Source, state: dict[str, Any] | None, t_start: float
) -> PrepResult:
    if state is not None and "tokenizer" not in state:
        state = None  # interrupted before the tokenizer was done: start from the beginning
    sp, tok_info = _get_tokenizer(cfg, state)
    vocab_size = int(tok_info["vocab_size"])
    ids = pk.special_settings(tok_info)
    dtype = dtype_for_vocab(vocab_size)
    shard_rows = cfg.shard_rows or max(1, SHARD_TARGET_BYTES // (cfg.seq_len * dtype.itemsize))
    fingerprint = cfg.fingerprint()
    counters = state["counters"] if state else _empty_counters()
    docs_done = counters["documents_read"]
    writers = {
        s: ShardWriter(
            cfg.out, s, cfg.seq_len, dtype, shard_rows, state["writers"][s] if state else None
        )
        for s in pk.SPLITS
    }
    packers = {
        s: pk.FullPacker(
            cfg.seq_len, dtype, state["carry"][s] if state else None, ids["cls_id"], ids["pad_id"]
        )
        for s in pk.SPLITS
    }

    def checkpoint() -> None:
        for w in writers.values():
            w.flush()
        atomic_write_json(
            os.path.join(cfg.out, PROGRESS),
            {
                "fingerprint": fingerprint,
                "tokenizer": tok_info,
                "counters": counters,
                "writers": {s: w.state() for s, w in writers.items()},
                "carry": {s: p.carry.tolist() for s, p in packers.items()},
            },
        )

    checkpoint()  # the tokenizer is done: a rerun can --resume from here
    if docs_done:
        _log(cfg, f"resuming after {docs_done} documents")
    settings = pk.EncodeSettings(
        cfg.seq_len, cfg.packing, cfg.valid_fraction, cfg.seed, dtype.name, **ids
    )
    encoder = _Encoder(cfg.workers, worker_model(sp), settings)
    docs = _skip(_limited(cfg, source), docs_done)

    bar = tqdm(
        unit="tok",
        unit_scale=True,
        desc="data_prep",
        disable=not cfg.progress,
        smoothing=0.1,
        mininterval=0.5,
    )
    t_encode = time.time()
    new_tokens = 0
    consistent = True
    ok = False
    try:
        last_ckpt = time.time()
        shards_at_ckpt = sum(len(w.shards) for w in writers.values())
        for result, meta in encoder.map(_tasks(docs, source, cfg.task_bytes)):
            consistent = False
            for s in pk.SPLITS:
                part = result["splits"][s]
                rows = packers[s].add(part["tokens"]) if cfg.packing == "full" else part["tokens"]
                writers[s].write(rows)
                for key in ("documents", "content", "pad"):
                    counters["splits"][s][key] += part[key]
                new_tokens += part["content"]
                bar.update(part["content"])
            counters["documents_read"] += meta["documents"]
            counters["bytes"] += meta["bytes"]
            counters["undecodable_bytes"] += meta["undecodable_bytes"]
            counters["empty_documents"] += result["empty"]
            consistent = True
            shards_done = sum(len(w.shards) for w in writers.values())
            if shards_done != shards_at_ckpt or time.time() - last_ckpt >= cfg.checkpoint_seconds:
                checkpoint()
                last_ckpt = time.time()
                shards_at_ckpt = shards_done
        ok = True
    finally:
        bar.close()
        encoder.close(ok)
        if not ok:
            if consistent:
                checkpoint()
            for w in writers.values():
                w.abort()
    encode_elapsed = time.time() - t_encode

    content = sum(counters["splits"][s]["content"] for s in pk.SPLITS)
    if content == 0:
        for w in writers.values():
            w.abort()
        raise DataPrepError(
            f"the corpus is empty: {counters['documents_read']} documents from {cfg.sources} "
            "produced no tokens"
        )
    empty = pk.empty_split(counters, cfg.valid_fraction, cfg.max_doc_bytes)
    if empty:  # the fix changes the options: nothing of this run can be resumed or kept
        for w in writers.values():
            w.abort()
        raise EmptySplitError(empty)
    for s in pk.SPLITS:
        counters["splits"][s]["pad"] += packers[s].pending_pad()
        writers[s].write(packers[s].finish())
    checkpoint()
    manifest = _manifest(cfg, source, tok_info, vocab_size, dtype, shard_rows, counters, writers)
    atomic_write_json(os.path.join(cfg.out, MANIFEST), manifest)
    os.remove(os.path.join(cfg.out, PROGRESS))
    elapsed = time.time() - t_start
    tps = new_tokens / max(encode_elapsed, 1e-9)
    train, valid = manifest["splits"]["train"], manifest["splits"]["valid"]
    _log(
        cfg,
        f"{counters['documents_read']} documents, {content} tokens -> "
        f"train {train['rows']} rows, valid {valid['rows']} rows of {cfg.seq_len}; "
        f"padding {train['padding_fraction']:.4f}; {tps:,.0f} tokens/s; "
        f"{elapsed:.1f} s total",
    )
    for s in pk.SPLITS:
        _log(cfg, summary_line(s, manifest["splits"][s]["documents_in_rows"]))
    st = source.stats
    if st.binary_files:  # always shown: input was left out
        print(
            f"data_prep: warning: skipped {st.binary_files} input file(s) that are not text "
            f"(NUL or control bytes), e.g. {', '.join(st.binary_examples)}",
            file=sys.stderr,
            flush=True,
        )
    if counters["undecodable_bytes"]:
        print(
            f"data_prep: warning: replaced {counters['undecodable_bytes']} bytes that are not "
            f"{cfg.encoding} with U+FFFD (e.g. in {', '.join(st.undecodable_files) or 'records'}); "
            "if the input uses another encoding, pass --encoding (e.g. latin-1, cp1252)",
            file=sys.stderr,
            flush=True,
        )
    return PrepResult(manifest, elapsed, encode_elapsed, tps)
