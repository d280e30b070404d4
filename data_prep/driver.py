"""The one data_prep driver: :data:`STEPS`, run in order by one process
(:class:`data_prep.pipeline.Solo`) or by every rank of an ``mpirun``/``srun`` run
(:class:`data_prep.parallel.Ranks`).

What differs between the two is behind :class:`Context`: the collectives (trivial for one
process) and how the corpus is read and encoded (one process streams the documents through the
packers and checkpoints at document granularity; R ranks cut it into work units, encode them
apart and assemble the shards; see each module). The output directory, its resume state, the
tokenizer, the checks, the manifest and the report are the steps below, the same for both.

The output is built in a hidden sibling of ``--out`` (:func:`data_prep.steps.partial_dir`,
``.<out>.data_prep-partial``) and renamed to ``--out`` once complete (:func:`publish`): an
interrupted run leaves ``--out`` as it was and its work there, which ``--resume`` continues.
"""

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from data_prep import console, unk_rate
from data_prep import packing as pk
from data_prep.doc_stats import summary_line
from data_prep.errors import DataPrepError, EmptySplitError
from data_prep.shards import fsync_dir
from data_prep.sources import Source, SourceStats
from data_prep.steps import (
    MANIFEST,
    PROGRESS,
    SHARD_TARGET_BYTES,
    PrepConfig,
    PrepResult,
    _log,
    _manifest,
    _prepare_out_dir,
    dtype_for_vocab,
    given_tokenizer,
    resumed_tokenizer,
    train_on_sample,
)
from data_prep.verify import check_sources, identity_summary, source_identity
from linformer_ds import outdir
from linformer_ds.fsio import atomic_write_json


@dataclass
class Run:
    """What the steps share. ``cfg.out`` is the directory being built (the partial one, after
    :func:`open_output`); ``out`` the user's ``--out``."""

    cfg: PrepConfig
    ctx: "Context"
    source: Source
    t_start: float
    out: str = ""
    state: dict[str, Any] | None = None  # progress.json of the run being resumed
    head: dict[str, Any] = field(default_factory=dict)  # rank 0's plan, sent to every rank
    disposable: bool = False  # a failure now removes the partial directory (nothing of value)
    sources: list[dict[str, Any]] = field(default_factory=list)  # their identity (verify.py)
    sources_line: str = ""  # what hashing them took, said once the corpus is known not empty
    model: Any = None  # what the workers encode with (packing.init_worker)
    tok_info: dict[str, Any] = field(default_factory=dict)
    vocab_size: int = 0
    dtype: np.dtype = field(default_factory=lambda: np.dtype(np.uint16))
    shard_rows: int = 0
    ids: dict[str, int] = field(default_factory=dict)  # the rows' cls/sep/pad ids
    counters: dict[str, Any] = field(default_factory=dict)  # documents, bytes, per split
    stats: SourceStats = field(default_factory=SourceStats)  # of every document read
    writers: dict[str, Any] = field(default_factory=dict)  # split -> .close() gives its shards
    tokens: int = 0  # content tokens encoded by this process (its rate)
    encode_s: float = 0.0
    result: PrepResult | None = None

    def __post_init__(self) -> None:
        self.out = self.out or self.cfg.out


class Context:
    """The differences between one process and R ranks. The collectives here are those of one
    process; the work methods are each mode's."""

    rank = 0
    size = 1
    mode: str | None = None  # progress.json's "mode" of the runs it makes (None: one process)
    where = ""  # the summary's " on R ranks"

    # ---------------------------------------------------------------------- collectives
    def bcast(self, obj: Any, what: str = "") -> Any:
        """Rank 0's ``obj`` on every rank."""
        return obj

    def gather(self, obj: Any, what: str = "") -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (None elsewhere)."""
        return [obj]

    def allgather(self, obj: Any, what: str = "") -> list[Any]:
        """Every rank's ``obj`` on every rank (a barrier too)."""
        return [obj]

    def check_peers(self) -> None:
        """Raise if another rank failed."""

    def alike(self, message: str, kind: type = DataPrepError) -> DataPrepError:
        """An error every rank meets at the same point (rank 0 prints it)."""
        return kind(message)

    # ---------------------------------------------------------------------------- work
    def wrong_mode(self, out: str) -> str:
        """The refusal to resume a run the other mode started."""
        raise NotImplementedError

    def plan(self, run: Run) -> dict[str, Any]:
        """Rank 0, once the output directory is ready: what every rank needs to start."""
        return {}

    def sample(self, run: Run, train: bool) -> tuple[list[str], dict, float, SourceStats] | None:
        """A fresh run's reading before the tokenizer (every rank): on rank 0, when ``train``,
        the tokenizer sample, its counters (:func:`data_prep.tokenizer.sample_sentences`), when
        the reading began and the counters of the documents read."""
        raise NotImplementedError

    def start(self, run: Run) -> None:
        """The tokenizer is known: record the resume state (the run is resumable from here)."""
        raise NotImplementedError

    def encode(self, run: Run) -> None:
        """Encode the corpus: set ``run.counters``, ``run.stats``, ``run.tokens``,
        ``run.encode_s``."""
        raise NotImplementedError

    def abort(self, run: Run) -> None:
        """The checks refused the output: drop what is half written."""

    def write_rows(self, run: Run) -> None:
        """Write the shards; on rank 0 set ``run.writers``."""
        raise NotImplementedError

    def finish(self, run: Run) -> None:
        """Rank 0, the manifest written: remove the mode's work files."""


# ------------------------------------------------------------------------------- the steps
def open_output(run: Run) -> None:
    """Rank 0 checks ``--out`` and prepares the partial directory (or reads the state of the
    interrupted run there) and the mode's plan; every rank receives them."""
    ctx, cfg = run.ctx, run.cfg
    head: dict[str, Any] = {}
    if ctx.rank == 0:
        try:
            state, work = _prepare_out_dir(cfg)
        except OSError as e:  # read-only or full file system, no permission: before any work
            raise DataPrepError(
                f"--out {cfg.out}: cannot write there: {e.strerror or e}"
                f"{' (' + e.filename + ')' if e.filename else ''}; choose a writable --out"
            ) from None
        if state is not None and state.get("finished"):  # a finished run whose rename failed
            return _publish_kept(run, work)
        if state is not None and "tokenizer" in state and state.get("mode") != ctx.mode:
            raise DataPrepError(ctx.wrong_mode(cfg.out))
        if state is None or "tokenizer" not in state:
            state = None  # stopped before the tokenizer was saved: start from the beginning
            run.disposable = True
        t0 = time.time()
        if state is not None:  # (refused: the interrupted run stays as it was, resumable)
            run.sources = check_sources(state.get("sources"), run.source, f"{work}/{PROGRESS}")
        run.state, run.cfg = state, dataclasses.replace(cfg, out=work)
        if state is None:  # before any document is read
            run.sources = source_identity(run.source)
        run.sources_line = identity_summary(run.sources, time.time() - t0, state is not None)
        head = {"state": state, "work": work, **ctx.plan(run)}
    head = ctx.bcast(head, "output directory")
    run.head, run.state = head, head["state"]
    run.cfg = dataclasses.replace(cfg, out=head["work"])


class PublishError(DataPrepError):
    """The finished output could not be renamed to ``--out``; it is kept whole in the partial
    directory, marked finished, for ``--resume`` (:func:`_publish_kept`)."""


def _keep_finished(run: Run, e: BaseException) -> PublishError:
    """Rank 0, the rename of the finished ``run.cfg.out`` to ``--out`` failed: mark it finished
    (``progress.json``: the options' fingerprint, ``finished``) so that ``--resume`` publishes it
    without redoing any work; the one line says so."""
    work = run.cfg.out
    atomic_write_json(os.path.join(work, PROGRESS),
                      {"fingerprint": run.cfg.fingerprint(), "finished": True})  # fmt: skip
    reason = str(e) if isinstance(e, DataPrepError) else outdir.write_error(e, f"--out {run.out}")
    return PublishError(f"{reason}; the finished output is kept whole in {work}: fix --out and "
                        "rerun the same command with --resume to publish it")  # fmt: skip


def _publish_kept(run: Run, work: str) -> None:
    """Rank 0, ``--resume`` found a finished run that was not renamed to ``--out``: rename it
    now (nothing is redone) and tell every rank that the run is done."""
    with open(os.path.join(work, MANIFEST)) as f:
        m = json.load(f)
    try:
        publish(work, run.out)
    except (OSError, DataPrepError, outdir.OutDirError) as e:
        run.cfg = dataclasses.replace(run.cfg, out=work)
        raise _keep_finished(run, e) from None
    os.remove(os.path.join(run.out, PROGRESS))  # after the rename: no window without a marker
    _log(run.cfg, f"published the finished run kept in {work} to {run.out} (nothing redone)")
    run.result = PrepResult(m, time.time() - run.t_start, 0.0, 0.0)
    run.head = run.ctx.bcast({"state": None, "work": work, "finished": True}, "output directory")


def tokenizer(run: Run) -> None:
    """The resumed run's tokenizer, a copy of ``--tokenizer``, or one trained on the sample;
    rank 0 makes it and every rank receives the workers' model."""
    ctx, cfg = run.ctx, run.cfg
    model, info = None, {}
    if run.state is not None:
        info = run.state["tokenizer"]
        if ctx.rank == 0:
            _log(cfg, run.sources_line)
            model = resumed_tokenizer(cfg.out, info)
    else:
        sample = ctx.sample(run, train=cfg.tokenizer is None)
        if ctx.rank == 0 and cfg.tokenizer is not None:
            _log(cfg, run.sources_line)
            model, info = given_tokenizer(cfg)
        elif ctx.rank == 0:
            sentences, sampled, t0, st = sample
            if not sentences:
                raise DataPrepError(
                    f"the corpus is empty: {st.documents} documents from {cfg.sources} hold no "
                    "non-blank text"
                    + (
                        f" ({st.binary_files} file(s) skipped as not text, e.g. "
                        f"{st.binary_examples[0]})"
                        if st.binary_files
                        else ""
                    )
                )
            _log(cfg, run.sources_line)  # (after the empty corpus's one line)
            if ctx.size > 1:
                _log(cfg, f"tokenizer sample drawn across {ctx.size} ranks")
            model, info = train_on_sample(cfg, sentences, sampled, t0)
    run.model, run.tok_info = ctx.bcast((model, info), "tokenizer")
    run.vocab_size = int(run.tok_info["vocab_size"])
    run.ids = pk.special_settings(run.tok_info)
    run.dtype = dtype_for_vocab(run.vocab_size)
    run.shard_rows = cfg.shard_rows or max(
        1, SHARD_TARGET_BYTES // (cfg.seq_len * run.dtype.itemsize)
    )
    ctx.start(run)
    run.disposable = False


def encode(run: Run) -> None:
    run.ctx.encode(run)


def check(run: Run) -> None:
    """Refuse an output without tokens, or with an empty split (every rank alike)."""
    ctx, cfg, counters = run.ctx, run.cfg, run.counters
    content = sum(counters["splits"][s]["content"] for s in pk.SPLITS)
    if content == 0:
        ctx.abort(run)
        raise ctx.alike(
            f"the corpus is empty: {counters['documents_read']} documents from {cfg.sources} "
            "produced no tokens"
        )
    empty = pk.empty_split(counters, cfg.valid_fraction, cfg.max_doc_bytes)
    if empty:  # the fix changes the options: nothing of this run can be resumed or kept
        run.disposable = True
        ctx.abort(run)
        raise ctx.alike(empty, EmptySplitError)


def write_rows(run: Run) -> None:
    run.ctx.write_rows(run)


def manifest(run: Run) -> None:
    """Rank 0: the manifest (written last: the output is complete), then ``--out``."""
    ctx, cfg = run.ctx, run.cfg
    if ctx.rank != 0:
        return
    m = _manifest(cfg, run.source, run.stats, run.tok_info, run.vocab_size, run.dtype,
                  run.shard_rows, run.counters, run.writers)  # fmt: skip
    atomic_write_json(os.path.join(cfg.out, MANIFEST), m)
    os.remove(os.path.join(cfg.out, PROGRESS))
    ctx.finish(run)
    fsync_dir(cfg.out)
    try:
        publish(cfg.out, run.out)
    except (OSError, DataPrepError, outdir.OutDirError) as e:  # done: kept for --resume
        raise _keep_finished(run, e) from None
    elapsed = time.time() - run.t_start
    run.result = PrepResult(m, elapsed, run.encode_s, run.tokens / max(run.encode_s, 1e-9))


def report(run: Run) -> None:
    """Rank 0: the summary and the warnings (input left out or replaced)."""
    if run.ctx.rank != 0 or run.result is None:
        return
    cfg, counters, st, m = run.cfg, run.counters, run.stats, run.result.manifest
    content = sum(counters["splits"][s]["content"] for s in pk.SPLITS)
    train, valid = m["splits"]["train"], m["splits"]["valid"]
    _log(
        cfg,
        f"{counters['documents_read']} documents, {content} tokens -> "
        f"train {train['rows']} rows, valid {valid['rows']} rows of {cfg.seq_len}{run.ctx.where}; "
        f"padding {train['padding_fraction']:.4f}; {run.result.tokens_per_s:,.0f} tokens/s; "
        f"{run.result.elapsed_s:.1f} s total",
    )
    for s in pk.SPLITS:
        _log(cfg, summary_line(s, m["splits"][s]["documents_in_rows"]))
    if "unk" in m:  # (a finished run kept by an older data_prep has no record)
        _log(cfg, unk_rate.summary(m["unk"]))
        unk_warning = unk_rate.warning(m["unk"], cfg.tokenizer)
        if unk_warning:  # shown with --quiet too (WARNING): the tokenizer does not fit the text
            console.say(logging.WARNING, unk_warning)
    if st.binary_files:  # shown with --quiet too (WARNING): input was left out
        console.warning(
            f"skipped {st.binary_files} input file(s) that are not text (NUL or control bytes), "
            f"e.g. {', '.join(st.binary_examples)}"
        )
    if counters["undecodable_bytes"]:
        console.warning(
            f"replaced {counters['undecodable_bytes']} bytes that are not {cfg.encoding} with "
            f"U+FFFD (e.g. in {', '.join(st.undecodable_files) or 'records'}); if the input uses "
            "another encoding, pass --encoding (e.g. latin-1, cp1252)"
        )


STEPS = (open_output, tokenizer, encode, check, write_rows, manifest, report)


def drive(run: Run) -> PrepResult | None:
    """Run :data:`STEPS`; rank 0 returns the result, the other ranks None."""
    for step in STEPS:
        step(run)
        if run.head.get("finished"):  # --resume published a finished run: nothing to redo
            break
    return run.result


def publish(work: str, out: str) -> None:
    """Rename the finished ``work`` to ``out`` (a previous data_prep output there, checked
    before the run, is replaced whole: :func:`linformer_ds.outdir.swap_in`)."""
    if os.path.islink(os.path.abspath(out)):  # appeared during the run (refused before it)
        target = os.readlink(os.path.abspath(out))
        raise DataPrepError(f"--out {out} became a symbolic link (to {target}) during the run; "
                            "nothing was renamed onto it")  # fmt: skip
    if os.path.lexists(out):
        found = outdir.identify(out) if os.path.isdir(out) else ("not a directory", None)
        if not os.path.isdir(out) or os.listdir(out) and (found is None or found[1] != "data_prep"):
            raise DataPrepError(  # something else appeared at --out during the run: keep both
                f"--out {out} changed during the run and is not a data_prep output; nothing "
                "was renamed onto it"
            )
    outdir.swap_in(work, out)
