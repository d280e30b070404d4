"""The data_prep pipeline: source -> tokenizer -> parallel tokenization -> packed shards, in
one process (:class:`Solo`, the one-process side of the driver :mod:`data_prep.driver`).

Output directory (built in ``.<OUT>.data_prep-partial`` beside it, renamed to OUT once
complete: :mod:`data_prep.driver`)::

    OUT/manifest.json            written last (atomically): the run is complete
    OUT/tokenizer.model          trained here or copied from --tokenizer (a SentencePiece model)
    OUT/tokenizer/               or: a Hugging Face --tokenizer directory, saved again here
    OUT/train/shard_00000.npy    [rows, N] uint16 (vocab <= 65535) else uint32
    OUT/valid/shard_00000.npy
    .<OUT>.data_prep-partial/progress.json   only while a run is unfinished (resume state)

Memory is bounded independently of corpus size: documents are read one at a time, at most
``2 * workers + 2`` batches of about ``task_bytes`` text are in flight, tokenizer training uses a
reservoir sample of at most ``max_sentences_for_tokenizer`` lines, and rows go to disk as soon
as they are complete. The output is identical for any ``workers`` and ``task_bytes``.

Resume: a checkpoint (``progress.json``) records, every ``checkpoint_seconds`` and at the end,
the number of documents fully packed, the finished shards, the rows of each partial shard and
the packer carry, in the partial directory. A rerun with ``resume=True`` checks the sources and
the shards by content (:mod:`data_prep.verify`, :class:`data_prep.shards.ShardWriter`), truncates
the partial shards to the recorded rows, skips the recorded documents and continues; the result
is byte-identical to an uninterrupted run.
"""

import os
import shutil
import time
from typing import Any

from tqdm import tqdm

from data_prep import packing as pk
from data_prep.distributed import detect_world
from data_prep.driver import Context, PublishError, Run, drive
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
    _limited,
    _log,
    _skip,
    _tasks,
    dtype_for_vocab,
    partial_dir,
)
from data_prep.tokenizer import sample_sentences
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
    run = Run(cfg, Solo(), source, t_start)
    work = partial_dir(cfg.out)
    try:
        try:
            result = drive(run)
            assert result is not None
            return result
        except OSError as e:  # writing the output failed (disk full, file system gone read-only)
            kept = _documents_done(work)
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
        if isinstance(e, PublishError):  # finished but not renamed to --out: kept for --resume
            raise
        made = run.cfg.out != cfg.out  # past the checks of --out: the partial directory is used
        fresh = made and run.state is None  # (a resume refused keeps the interrupted run's)
        if made and isinstance(e, EmptySplitError) or fresh and _documents_done(work) == 0:
            shutil.rmtree(work, ignore_errors=True)  # nothing of value (or usable) was written
        raise


class Solo(Context):
    """One process: the documents are read in order, encoded by ``--workers`` processes,
    packed and written to the shards as they come; ``progress.json`` records the documents
    packed, the finished shards, the rows of each partial shard and the packer carry."""

    def __init__(self) -> None:
        self.packers: dict[str, pk.FullPacker] = {}
        self.writers: dict[str, ShardWriter] = {}
        self.progress: dict[str, Any] = {}

    def wrong_mode(self, out: str) -> str:
        return (
            f"cannot --resume {out!r} as one process: that run was started under mpirun/srun; "
            "resume it the same way, on any number of ranks (or --overwrite)"
        )

    def sample(self, run: Run, train: bool):
        if not train:
            return None
        cfg = run.cfg
        t0 = time.time()
        source = Source(cfg.sources, cfg.text_column, cfg.max_doc_bytes, cfg.encoding)
        sampled: dict[str, int] = {}
        sentences = sample_sentences(
            _limited(cfg, source), cfg.max_sentences_for_tokenizer, cfg.seed, sampled
        )
        return sentences, sampled, t0, source.stats

    def checkpoint(self, run: Run) -> None:
        for w in self.writers.values():
            w.flush()
        atomic_write_json(
            os.path.join(run.cfg.out, PROGRESS),
            {
                **self.progress,
                "counters": run.counters,
                "writers": {s: w.state() for s, w in self.writers.items()},
                "carry": {s: p.carry.tolist() for s, p in self.packers.items()},
            },
        )

    def start(self, run: Run) -> None:
        cfg, state = run.cfg, run.state
        self.progress = {
            "fingerprint": cfg.fingerprint(),
            "sources": run.sources,
            "tokenizer": run.tok_info,
        }
        run.counters = state["counters"] if state else _empty_counters()
        self.writers = {
            s: ShardWriter(cfg.out, s, cfg.seq_len, run.dtype, run.shard_rows,
                           state["writers"][s] if state else None)
            for s in pk.SPLITS
        }  # fmt: skip
        self.packers = {
            s: pk.FullPacker(cfg.seq_len, run.dtype, state["carry"][s] if state else None,
                             run.ids["cls_id"], run.ids["pad_id"])
            for s in pk.SPLITS
        }  # fmt: skip
        self.checkpoint(run)  # the tokenizer is done: a rerun can --resume from here
        if run.counters["documents_read"]:
            _log(cfg, f"resuming after {run.counters['documents_read']} documents")

    def encode(self, run: Run) -> None:
        cfg, source, counters = run.cfg, run.source, run.counters
        settings = pk.EncodeSettings(
            cfg.seq_len, cfg.packing, cfg.valid_fraction, cfg.seed, run.dtype.name, **run.ids
        )
        encoder = _Encoder(cfg.workers, run.model, settings)
        docs = _skip(_limited(cfg, source), counters["documents_read"])
        bar = tqdm(unit="tok", unit_scale=True, desc="data_prep", disable=not cfg.progress,
                   smoothing=0.1, mininterval=0.5)  # fmt: skip
        t_encode = time.time()
        consistent = True
        ok = False
        try:
            last_ckpt = time.time()
            shards_at_ckpt = sum(len(w.shards) for w in self.writers.values())
            for result, meta in encoder.map(_tasks(docs, source, cfg.task_bytes)):
                consistent = False
                for s in pk.SPLITS:
                    part = result["splits"][s]
                    tokens = part["tokens"]
                    rows = self.packers[s].add(tokens) if cfg.packing == "full" else tokens
                    self.writers[s].write(rows)
                    for key in ("documents", "content", "pad"):
                        counters["splits"][s][key] += part[key]
                    run.tokens += part["content"]
                    bar.update(part["content"])
                counters["documents_read"] += meta["documents"]
                counters["bytes"] += meta["bytes"]
                counters["undecodable_bytes"] += meta["undecodable_bytes"]
                counters["empty_documents"] += result["empty"]
                consistent = True
                shards = sum(len(w.shards) for w in self.writers.values())
                if shards != shards_at_ckpt or time.time() - last_ckpt >= cfg.checkpoint_seconds:
                    self.checkpoint(run)
                    last_ckpt = time.time()
                    shards_at_ckpt = shards
            ok = True
        finally:
            bar.close()
            encoder.close(ok)
            if not ok:
                if consistent:
                    self.checkpoint(run)
                self.abort(run)
        run.encode_s = time.time() - t_encode
        run.stats = source.stats

    def abort(self, run: Run) -> None:
        for w in self.writers.values():
            w.abort()

    def write_rows(self, run: Run) -> None:
        for s in pk.SPLITS:
            run.counters["splits"][s]["pad"] += self.packers[s].pending_pad()
            self.writers[s].write(self.packers[s].finish())
        self.checkpoint(run)
        run.writers = self.writers
