"""data_prep on R ranks (``mpirun``/``srun``): the same bytes as one process, for any R.

The corpus is cut into *units*, runs of consecutive documents in the single-process reading
order, as each spec's source kind cuts it (a group of consecutive files of one source of about
``unit_bytes``, a part of a larger file cut between its documents (byte ranges, Parquet row
groups: :meth:`data_prep.sources.Source.file_parts`), or one contiguous shard of a Hugging Face
dataset, ``Dataset.shard(n, i, contiguous=True)``: :class:`data_prep.sources.SourceKind`).
Units depend on the inputs and ``unit_bytes`` only, never on R. Because the packed streams of
the single-process run are the concatenation of the units' streams, the run goes:

1. **scan** (only to train a tokenizer or with ``--max-docs``/``--max-bytes``): each rank reads
   its units and counts the tokenizer's training lines (and documents and bytes, to place the
   ``--max-*`` cut exactly where one process stops: units are then read in rounds, in order,
   and no unit after the cut is read);
2. **tokenizer sample**: the single-process sample is a reservoir (Algorithm R) over the global
   line sequence, whose random draws depend only on the line count. Every rank replays the draws
   (:func:`reservoir_indices`, vectorised) to learn which global lines are kept, collects those
   of its own units, and rank 0 trains on the gathered sample: the same sample, hence the same
   ``tokenizer.model``, with no rank reading the whole corpus. The model is broadcast;
3. **tokenize**: each rank tokenizes its units (``--workers`` processes each) into
   ``OUT/.units/u*.{train,valid}.bin`` (the unit's packing stream) and ``u*.json`` (its
   counters, written last: a unit is done);
4. **assemble**: with every unit's length known, shard ``k`` of a split is a fixed slice of the
   concatenated stream; ranks write disjoint shards in parallel (``.partial``, then renamed);
5. rank 0 writes ``manifest.json`` last (atomically), once every rank has reported its shards,
   then removes ``.units`` and ``progress.json``.

A failed or dead rank fails every rank at its next wait (see :mod:`data_prep.distributed`) and no
manifest is written; ``--resume`` (on any R) keeps the tokenizer, the finished units and shards.
"""

import hashlib
import json
import os
import random
import shutil
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from data_prep import hf_tokenizer as hft
from data_prep import packing as pk
from data_prep.distributed import PeerFailed, Transport, World, connect, remove_sync_root
from data_prep.doc_stats import summary_line
from data_prep.errors import DataPrepError
from data_prep.shards import fsync_dir, npy_header, shard_name
from data_prep.sources import Source, SourceStats
from data_prep.steps import (
    MANIFEST,
    PROGRESS,
    SHARD_TARGET_BYTES,
    TOKENIZER,
    PrepResult,
    _Encoder,
    _manifest,
    _prepare_out_dir,
    _tasks,
    copy_given_tokenizer,
    dtype_for_vocab,
    train_on_sample,
)
from data_prep.tokenizer import (
    document_lines,
    file_sha256,
    split_long_line,
    tokenizer_info,
)
from linformer_ds.fsio import atomic_write_json

UNITS_DIR = ".units"
MIN_UNIT_BYTES = 1 << 20
MAX_UNIT_BYTES = 256 << 20
DIE_ENV = "LINFORMER_DS_DATA_PREP_DIE"  # "RANK:UNITS": that rank SIGKILLs itself (tests)


class Quiet(DataPrepError):
    """A failure another rank prints; this rank exits 2 without a message."""

    quiet = True


# ---------------------------------------------------------------------------------- units
@dataclass
class Unit:
    """A run of consecutive documents of one spec: ``part`` as its kind's ``units`` gave it
    (a tuple of files of a local spec, ``(num_shards, index)`` of an hf spec)."""

    index: int
    spec: str
    part: Any = None
    size: int = 0  # bytes, for balancing only


def default_unit_bytes(total: int | None) -> int:
    """About 256 units for mid-size corpora, 1-256 MiB each."""
    if total is None:
        return 64 << 20
    return int(min(MAX_UNIT_BYTES, max(MIN_UNIT_BYTES, total // 256)))


def make_units(source: Source, unit_bytes: int) -> list[Unit]:
    """The work units of ``source``, in reading order (independent of the number of ranks)."""
    units: list[Unit] = []
    for spec in source.specs:
        for part, size in source.units(spec, unit_bytes):
            units.append(Unit(len(units), spec, part, size))
    return units


def unit_docs(source: Source, unit: Unit, limit: int | None) -> Iterator[str]:
    """The documents of ``unit`` (the first ``limit`` of them), counted in ``source.stats``."""
    docs = source.read(unit.spec, unit.part)
    if limit is None:
        yield from docs
        return
    for i, doc in enumerate(docs):
        yield doc
        if i + 1 >= limit:
            return  # stop without reading further, as the single-process run does


def assign(sizes: Sequence[tuple[int, int]], ranks: int) -> list[list[int]]:
    """Longest-processing-time assignment of ``(unit index, size)`` to ranks (deterministic)."""
    loads = [(0, r) for r in range(ranks)]
    out: list[list[int]] = [[] for _ in range(ranks)]
    for idx, size in sorted(sizes, key=lambda x: (-x[1], x[0])):
        load, r = min(loads)
        loads[r] = (load + max(size, 1), r)
        out[r].append(idx)
    return [sorted(x) for x in out]


# ------------------------------------------------------------------------ reservoir replay
def reservoir_indices(total: int, k: int, seed: int) -> np.ndarray:
    """Which of ``total`` items :func:`data_prep.tokenizer.sample_sentences` keeps, by slot.

    Algorithm R with ``random.Random(seed)``: item ``t`` (1-based) past ``k`` draws
    ``j = randrange(t)`` and replaces slot ``j`` if ``j < k``. The draws depend only on ``t``, so
    the kept items follow from ``total`` alone. CPython's ``randrange(t)`` takes
    ``getrandbits(b)`` (``b = t.bit_length()``: the top ``b`` bits of one 32-bit Mersenne Twister
    word for ``b <= 32``, two words for ``b <= 64``) until the value is below ``t``; the words come
    in bulk from numpy's MT19937 set to the same state, and rejection is resolved exactly. Returns
    the 0-based item index held by each slot (``min(total, k)`` slots).
    """
    slots = np.arange(min(total, k), dtype=np.int64)
    if total <= k:
        return slots
    state = random.Random(seed).getstate()[1]
    bg = np.random.MT19937()
    bg.state = {
        "bit_generator": "MT19937",
        "state": {"key": np.array(state[:624], dtype=np.uint32), "pos": state[624]},
    }
    buf = np.zeros(0, dtype=np.uint64)
    pos = 0
    t = k + 1  # the argument of the next randrange
    while t <= total:
        b = t.bit_length()
        if b > 64:
            raise DataPrepError(f"too many tokenizer lines ({total}) for the reservoir sample")
        words = 1 if b <= 32 else 2
        t_end = min(total, (1 << b) - 1)  # same bit length up to here
        m = int(min(t_end - t + 1, max(16, (1 << b) >> 8), 1 << 16))  # at most m draws accepted
        need = 3 * m * words + 64
        if len(buf) - pos < need:
            buf = np.concatenate([buf[pos:], bg.random_raw(max(need, 1 << 16))])
            pos = 0
        w = buf[pos : pos + min(need, len(buf) - pos) // words * words]
        if words == 1:
            c = w >> np.uint64(32 - b)
        else:
            c = w[0::2] | ((w[1::2] >> np.uint64(64 - b)) << np.uint64(32))
        c = c.astype(np.int64)
        sure = c < t  # accepted whatever t has grown to
        amb = np.flatnonzero((c >= t) & (c < t + m))
        acc = sure.copy()
        if len(amb):
            before = np.cumsum(sure)  # sure accepts up to and including i
            extra = 0
            for i in amb:  # accepted iff c < t + (accepts before i); few of them
                if c[i] < t + int(before[i]) + extra:
                    acc[i] = True
                    extra += 1
        taken = np.flatnonzero(acc)[:m]  # the first m accepted draws
        n_draws = int(taken[-1]) + 1 if len(taken) else len(c)
        pos += n_draws * words
        vals = c[taken]
        ts = t + np.arange(len(taken), dtype=np.int64)  # the randrange argument of each
        hit = vals < k
        np.maximum.at(slots, vals[hit], ts[hit] - 1)  # the last (largest t) wins
        t += len(taken)
    return slots


# ------------------------------------------------------------------------------- scanning
@dataclass
class Scan:
    """Counters of one unit (truncated at the cut for the unit holding it)."""

    docs: int = 0
    bytes: int = 0
    undecodable: int = 0
    binary: int = 0
    pieces: int = 0  # tokenizer training lines (after splitting long lines)
    lines: int = 0
    line_bytes: int = 0
    long: int = 0


def _scan_unit(
    source: Source, unit: Unit, sampling: bool, per_doc: bool
) -> tuple[Scan, list[Scan] | None]:
    source.stats = SourceStats()
    st = source.stats
    total = Scan()
    docs: list[Scan] | None = [] if per_doc else None
    for doc in unit_docs(source, unit, None):
        total.docs += 1
        if sampling:
            for line in document_lines(doc):
                total.lines += 1
                total.line_bytes += len(line.encode("utf-8"))
                n = len(split_long_line(line))
                total.long += n > 1
                total.pieces += n
        if docs is not None:  # the counters as they stand right after this document
            docs.append(
                Scan(
                    total.docs, st.bytes, st.undecodable_bytes, st.binary_files, total.pieces,
                    total.lines, total.line_bytes, total.long,
                )
            )  # fmt: skip
    total.bytes, total.undecodable, total.binary = st.bytes, st.undecodable_bytes, st.binary_files
    return total, docs


def _cut_in(docs: list[Scan], base: Scan, cfg: Any) -> int | None:
    """The local index of the document that reaches --max-docs/--max-bytes, if in this unit."""
    for i, d in enumerate(docs):
        if cfg.max_docs is not None and base.docs + d.docs >= cfg.max_docs:
            return i
        if cfg.max_bytes is not None and base.bytes + d.bytes >= cfg.max_bytes:
            return i
    return None


def _add(a: Scan, b: Scan) -> Scan:
    return Scan(*(x + y for x, y in zip(a.__dict__.values(), b.__dict__.values())))


# ------------------------------------------------------------------------------------ run
def _log(cfg: Any, msg: str) -> None:
    if cfg.progress:
        print(f"data_prep: {msg}", file=sys.stderr, flush=True)


class _Ctx:
    """What every phase needs."""

    def __init__(self, cfg: Any, comm: Transport, source: Source) -> None:
        self.cfg = cfg
        self.comm = comm
        self.rank = comm.rank
        self.size = comm.size
        self.source = source
        self.units_dir = os.path.join(cfg.out, UNITS_DIR)
        self.created: bool | None = None  # rank 0: whether it made --out (until resumable)
        self.made_out = False  # rank 0: whether this run made --out
        self.die = None
        self.ids: dict[str, int] = {}  # the rows' cls/sep/pad ids (packing.special_settings)
        spec = os.environ.get(DIE_ENV)
        if spec:
            r, n = spec.split(":")
            if int(r) == self.rank:
                self.die = int(n)


def prepare_distributed(cfg: Any, world: World) -> Any:
    """Run data_prep as one rank of ``world``; every rank returns (rank 0 with the manifest).

    Messages: an error every rank meets alike (options, missing inputs) is printed by rank 0
    only; a rank's own later error by that rank (it may be killed by mpirun before rank 0 could
    print it); a rank that died, by rank 0 (rank 1 if rank 0 died). The other ranks exit 2
    without a message (:class:`Quiet`).
    """

    t_start = time.time()
    try:
        cfg.validate()  # the same on every rank, before anyone waits for anyone
    except DataPrepError as e:
        if world.rank > 0:
            raise Quiet(str(e)) from None
        raise
    comm = connect(world, cfg.out, cfg.rank_timeout)
    ctx: _Ctx | None = None
    ok = False
    try:
        try:
            try:
                source = Source(cfg.sources, cfg.text_column, cfg.max_doc_bytes, cfg.encoding)
            except DataPrepError as e:  # alike on every rank: rank 0 prints it
                comm.report_failure(str(e), printed=comm.rank == 0)
                if comm.rank == 0:
                    raise
                raise Quiet(str(e)) from None
            ctx = _Ctx(cfg, comm, source)
            result = _run(ctx, t_start)
            ok = True
            return result if result is not None else PrepResult({}, 0.0, 0.0, 0.0)
        except PeerFailed as e:
            loud = (comm.rank == 0 and e.rank != 0) or (comm.rank == 1 and e.rank == 0 and e.died)
            if loud and not e.printed:
                raise DataPrepError(
                    f"{e}; no manifest was written: fix the cause and rerun the same command "
                    "with --resume to continue"
                ) from None
            raise Quiet(str(e)) from None
        except OSError as e:
            msg = (
                f"could not read or write: {e.strerror or e}"
                f"{' (' + e.filename + ')' if getattr(e, 'filename', None) else ''}"
            )
            comm.report_failure(msg, printed=True)
            raise DataPrepError(_who(comm) + msg + "; rerun with --resume once fixed") from None
        except Quiet:
            raise
        except DataPrepError as e:
            comm.report_failure(str(e), printed=True)
            if comm.rank == 0:
                raise
            raise DataPrepError(_who(comm) + str(e)) from None
        except KeyboardInterrupt:
            comm.report_failure(f"rank {comm.rank} was interrupted", printed=True)
            raise
        except BaseException as e:  # a bug or a broken worker pool: the others stop at once
            comm.report_failure(f"{type(e).__name__}: {e}", printed=True)
            raise
    finally:
        comm.close(ok)
        if ok and comm.rank == 0:
            remove_sync_root(cfg.out)
        elif not ok and ctx is not None and ctx.rank == 0 and ctx.created is not None:
            _clean_unstarted(cfg.out, ctx.created)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _alike(ctx: "_Ctx", message: str) -> DataPrepError:
    """An error every rank meets at the same point: rank 0 prints it, the others exit quietly."""
    return DataPrepError(message) if ctx.rank == 0 else Quiet(message)


def _who(comm: Transport) -> str:
    return f"rank {comm.rank} of {comm.size}: " if comm.rank else ""


def _clean_unstarted(out: str, created: bool) -> None:
    """A run that failed before its tokenizer was saved leaves nothing (as one process does)."""
    if created:
        shutil.rmtree(out, ignore_errors=True)
        return
    for name in os.listdir(out):
        path = os.path.join(out, name)
        shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)


def _run(ctx: _Ctx, t_start: float) -> Any:

    cfg, comm, source = ctx.cfg, ctx.comm, ctx.source
    # ---- output directory (rank 0), units, resume state
    head: dict[str, Any] = {}
    if ctx.rank == 0:
        try:
            state, created = _prepare_out_dir(cfg)
        except OSError as e:
            raise DataPrepError(
                f"--out {cfg.out}: cannot write there: {e.strerror or e}; choose a writable --out"
            ) from None
        if state is not None and "tokenizer" in state and state.get("mode") != "units":
            raise DataPrepError(
                f"cannot --resume {cfg.out!r} under mpirun/srun: that run was started as one "
                "process; resume it the same way (or --overwrite)"
            )
        if state is not None and "tokenizer" not in state:
            state = None  # stopped before the tokenizer was trained: start from the beginning
        ctx.made_out = created
        if state is None:
            ctx.created = created
        unit_bytes = (state or {}).get("unit_bytes") or cfg.unit_bytes
        unit_bytes = unit_bytes or default_unit_bytes(source.total_bytes())
        # rank 0 cuts the inputs (a large CSV is parsed once to find its row ends), the others
        # receive the units
        head = {"state": state, "unit_bytes": unit_bytes, "units": make_units(source, unit_bytes)}
        if state is not None:
            head["done"] = _finished_units(ctx.units_dir)
            saved = state["tokenizer"]
            with open(os.path.join(cfg.out, saved.get("file", TOKENIZER)), "rb") as f:
                head["proto"] = f.read()
            if saved.get("kind") == hft.KIND and _sha(head["proto"]) == saved["sha256"]:
                head["payload"] = hft.saved(cfg.out, saved)[0]  # what the workers encode with
    head = comm.bcast(head, "output directory")
    state = head["state"]
    units: list[Unit] = head["units"]
    fingerprint = cfg.fingerprint()
    limited = cfg.max_docs is not None or cfg.max_bytes is not None

    # ---- scan, tokenizer sample and training
    if state is None:
        train = cfg.tokenizer is None
        plan, scans = _scan(ctx, units, sampling=train, limited=limited)
        if train:
            proto, tok_info = _train(ctx, units, plan, scans)
        else:
            proto, tok_info = _copy_tokenizer(ctx)
        if ctx.rank == 0:
            os.makedirs(ctx.units_dir, exist_ok=True)
            atomic_write_json(
                os.path.join(cfg.out, PROGRESS),
                {
                    "fingerprint": fingerprint,
                    "mode": "units",
                    "unit_bytes": head["unit_bytes"],
                    "units": len(units),
                    "plan": plan,
                    "tokenizer": tok_info,
                },
            )
        done: dict[int, dict[str, Any]] = {}
        comm.allgather(None, "tokenizer")  # progress.json is written: resumable from here
        ctx.created = None
    else:
        if state.get("units") != len(units):
            raise _alike(
                ctx,
                f"cannot --resume: the sources now make {len(units)} work units, the "
                f"interrupted run had {state.get('units')}; rerun with --overwrite",
            )
        plan, tok_info, proto, done = state["plan"], state["tokenizer"], head["proto"], head["done"]
        if _sha(proto) != tok_info["sha256"]:
            name = tok_info.get("file", TOKENIZER)
            raise _alike(ctx, f"cannot --resume: {name} changed since the interrupted run")
        proto = head.get("payload", proto)
        _log(cfg, f"resuming: {len(done)} of {plan['units']} work units are done")

    vocab_size = int(tok_info["vocab_size"])
    ctx.ids = pk.special_settings(tok_info)
    dtype = dtype_for_vocab(vocab_size)
    shard_rows = cfg.shard_rows or max(1, SHARD_TARGET_BYTES // (cfg.seq_len * dtype.itemsize))

    # ---- tokenize
    t_encode = time.time()
    mine, tokens = _tokenize(ctx, units, plan, done, proto, dtype)
    encode_s = time.time() - t_encode
    _log(
        cfg,
        f"rank {ctx.rank}/{ctx.size}: {len(mine)} units, {tokens} tokens in {encode_s:.2f} s "
        f"({tokens / max(encode_s, 1e-9):,.0f} tokens/s)",
    )
    metas = dict(done)
    for part in comm.allgather(mine, "tokenize"):
        metas.update(part)
    metas_list = [metas[i] for i in range(plan["units"])]

    # ---- assemble
    entries, counters = _assemble(ctx, metas_list, dtype, shard_rows)
    if ctx.rank != 0:  # nothing more from this rank: after this, rank 0 removes the sync files
        comm.stop_heartbeat()
    gathered = comm.gather(entries, "shards")
    if ctx.rank != 0:
        return None

    shards: dict[str, list[dict[str, Any]]] = {s: [] for s in pk.SPLITS}
    for part in gathered or []:
        for split, k, entry in part:
            shards[split].append((k, entry))
    writers = {s: _Done([e for _, e in sorted(shards[s], key=lambda x: x[0])]) for s in pk.SPLITS}
    source.stats = SourceStats(binary_files=counters.pop("binary_files"))
    manifest = _manifest(cfg, source, tok_info, vocab_size, dtype, shard_rows, counters, writers)

    atomic_write_json(os.path.join(cfg.out, MANIFEST), manifest)
    os.remove(os.path.join(cfg.out, PROGRESS))
    shutil.rmtree(ctx.units_dir, ignore_errors=True)
    fsync_dir(cfg.out)
    elapsed = time.time() - t_start
    content = sum(counters["splits"][s]["content"] for s in pk.SPLITS)
    tr, va = manifest["splits"]["train"], manifest["splits"]["valid"]
    _log(
        cfg,
        f"{counters['documents_read']} documents, {content} tokens -> train {tr['rows']} rows, "
        f"valid {va['rows']} rows of {cfg.seq_len} on {ctx.size} ranks; "
        f"padding {tr['padding_fraction']:.4f}; {elapsed:.1f} s total",
    )
    for s in pk.SPLITS:
        _log(cfg, summary_line(s, manifest["splits"][s]["documents_in_rows"]))
    if counters["undecodable_bytes"]:
        print(
            f"data_prep: warning: replaced {counters['undecodable_bytes']} bytes that are not "
            f"{cfg.encoding} with U+FFFD; if the input uses another encoding, pass --encoding "
            "(e.g. latin-1, cp1252)",
            file=sys.stderr,
            flush=True,
        )
    if source.stats.binary_files:
        print(
            f"data_prep: warning: skipped {source.stats.binary_files} input file(s) that are not "
            "text (NUL or control bytes)",
            file=sys.stderr,
            flush=True,
        )
    return PrepResult(manifest, elapsed, encode_s, tokens / max(encode_s, 1e-9))


class _Done:
    """Stands in for a ShardWriter in :func:`data_prep.steps._manifest`."""

    def __init__(self, shards: list[dict[str, Any]]) -> None:
        self.shards = shards

    def close(self) -> list[dict[str, Any]]:
        return list(self.shards)


def _finished_units(units_dir: str) -> dict[int, dict[str, Any]]:

    done = {}
    if os.path.isdir(units_dir):
        for name in os.listdir(units_dir):
            if name.startswith("u") and name.endswith(".json"):
                with open(os.path.join(units_dir, name)) as f:
                    meta = json.load(f)
                done[int(meta["index"])] = meta
    return done


# ---------------------------------------------------------------------------- phase: scan
def _scan(
    ctx: _Ctx, units: list[Unit], sampling: bool, limited: bool
) -> tuple[dict[str, Any], list[Scan]]:
    """Count what the sample and the --max-* cut need; returns (plan, scans of kept units)."""
    cfg, comm = ctx.cfg, ctx.comm
    if not sampling and not limited:
        return {"units": len(units), "cut": None}, []
    if not limited:  # every unit, balanced; one exchange at the end
        mine = assign([(u.index, u.size) for u in units], ctx.size)[ctx.rank]
        out = {}
        for i in mine:
            comm.check_peers()
            out[i] = _scan_unit(ctx.source, units[i], sampling, False)[0]
        scans: dict[int, Scan] = {}
        for part in comm.allgather(out, "scan"):
            scans.update(part)
        return {"units": len(units), "cut": None}, [scans[i] for i in range(len(units))]
    # --max-docs/--max-bytes: rounds of R consecutive units until the cut is found
    kept: list[Scan] = []
    base = Scan()
    for start in range(0, len(units), ctx.size):
        idx = start + ctx.rank
        local = _scan_unit(ctx.source, units[idx], sampling, True) if idx < len(units) else None
        totals = comm.allgather(local[0] if local else None, "scan round")
        bases, b = [], base
        for t in totals:
            bases.append(b)
            b = _add(b, t) if t is not None else b
        cut = _cut_in(local[1], bases[ctx.rank], cfg) if local else None
        cand = comm.allgather(None if cut is None else (cut, local[1][cut]), "scan cut")
        for r, t in enumerate(totals):
            if t is None:
                break
            if cand[r] is not None:
                d, at = cand[r]
                kept.append(at)
                return {"units": start + r + 1, "cut": {"unit": start + r, "docs": d + 1}}, kept
            kept.append(t)
        base = b
    return {"units": len(units), "cut": None}, kept


def _unit_limit(plan: dict[str, Any], index: int) -> int | None:
    cut = plan.get("cut")
    return cut["docs"] if cut and cut["unit"] == index else None


# ------------------------------------------------------------------------ phase: tokenizer
def _train(
    ctx: _Ctx, units: list[Unit], plan: dict[str, Any], scans: list[Scan]
) -> tuple[bytes, dict[str, Any]]:
    cfg, comm = ctx.cfg, ctx.comm
    t0 = time.time()
    total = Scan()
    for s in scans:
        total = _add(total, s)
    k = cfg.max_sentences_for_tokenizer
    slots = reservoir_indices(total.pieces, k, cfg.seed)
    wanted = np.sort(slots)
    bases = np.concatenate([[0], np.cumsum([s.pieces for s in scans])]).astype(np.int64)
    counts = np.searchsorted(wanted, bases[1:]) - np.searchsorted(wanted, bases[:-1])
    sizes = [(i, units[i].size) for i in range(plan["units"]) if counts[i] > 0]
    mine = assign(sizes, ctx.size)[ctx.rank]
    got: dict[int, str] = {}
    for i in mine:
        comm.check_peers()
        lo, hi = bases[i], bases[i + 1]
        want = wanted[np.searchsorted(wanted, lo) : np.searchsorted(wanted, hi)] - lo
        got.update(_collect(ctx, units[i], _unit_limit(plan, i), want, int(lo)))
    parts = comm.gather(got, "tokenizer sample")
    tok_info: dict[str, Any] = {}
    proto = b""
    if ctx.rank == 0:
        pieces: dict[int, str] = {}
        for p in parts or []:
            pieces.update(p)
        sample = [pieces[int(t)] for t in slots]
        if not sample:
            raise DataPrepError(
                f"the corpus is empty: {total.docs} documents from {cfg.sources} hold no "
                "non-blank text"
            )
        sampled = {
            "corpus_lines": total.lines,
            "corpus_bytes": total.line_bytes,
            "long_lines": total.long,
            "sampled_lines": len(sample),
            "sampled_bytes": sum(len(s.encode("utf-8")) for s in sample),
        }

        _log(cfg, f"tokenizer sample drawn across {ctx.size} ranks")
        _sp, tok_info = train_on_sample(cfg, sample, sampled, t0)
        dest = os.path.join(cfg.out, TOKENIZER)
        with open(dest, "rb") as f:
            proto = f.read()
    return comm.bcast((proto, tok_info), "tokenizer")


def _collect(
    ctx: _Ctx, unit: Unit, limit: int | None, want: np.ndarray, base: int
) -> dict[int, str]:
    """The training lines of ``unit`` with local indices ``want`` (sorted), keyed globally."""
    ctx.source.stats = SourceStats()
    out: dict[int, str] = {}
    n = 0
    j = 0
    for doc in unit_docs(ctx.source, unit, limit):
        for line in document_lines(doc):
            for piece in split_long_line(line):
                if j < len(want) and want[j] == n:
                    out[base + n] = piece
                    j += 1
                n += 1
        if j == len(want):
            break
    return out


def _copy_tokenizer(ctx: _Ctx) -> tuple[Any, dict[str, Any]]:
    """Rank 0 copies ``--tokenizer``; every rank gets the workers' model (a SentencePiece
    proto or a Hugging Face payload) and the manifest entry."""
    cfg = ctx.cfg
    proto, info = b"", {}
    if ctx.rank == 0 and hft.is_hf_tokenizer(cfg.tokenizer):
        proto, info = hft.copy_tokenizer(cfg.tokenizer, cfg.out, cfg.vocab_size)
    elif ctx.rank == 0:
        dest = os.path.join(cfg.out, TOKENIZER)
        sp = copy_given_tokenizer(cfg, dest)
        info = tokenizer_info(dest, sp, None)
        with open(dest, "rb") as f:
            proto = f.read()
    return ctx.comm.bcast((proto, info), "tokenizer")


# ------------------------------------------------------------------------ phase: tokenize
def _tokenize(
    ctx: _Ctx,
    units: list[Unit],
    plan: dict[str, Any],
    done: dict[int, Any],
    proto: Any,
    dtype: np.dtype,
) -> tuple[dict[int, dict[str, Any]], int]:

    cfg = ctx.cfg
    todo = [(i, units[i].size) for i in range(plan["units"]) if i not in done]
    mine = assign(todo, ctx.size)[ctx.rank]
    out: dict[int, dict[str, Any]] = {}
    if not mine:
        return out, 0
    os.makedirs(ctx.units_dir, exist_ok=True)
    settings = pk.EncodeSettings(
        cfg.seq_len, cfg.packing, cfg.valid_fraction, cfg.seed, dtype.name, **ctx.ids
    )
    encoder = _Encoder(cfg.workers, proto, settings)
    tokens = 0
    ok = False
    try:
        for n_done, i in enumerate(mine, 1):
            ctx.source.stats = SourceStats()
            docs = unit_docs(ctx.source, units[i], _unit_limit(plan, i))
            stem = os.path.join(ctx.units_dir, f"u{i:06d}")
            files = {s: open(f"{stem}.{s}.bin.tmp", "wb") for s in pk.SPLITS}
            meta: dict[str, Any] = {
                "index": i,
                "documents": 0,
                "empty_documents": 0,
                "splits": {s: {"documents": 0, "content": 0, "pad": 0, "length": 0} for s in pk.SPLITS},
            }  # fmt: skip
            try:
                for result, tmeta in encoder.map(_tasks(docs, ctx.source, cfg.task_bytes)):
                    ctx.comm.check_peers()
                    for s in pk.SPLITS:
                        part = result["splits"][s]
                        files[s].write(np.ascontiguousarray(part["tokens"], dtype=dtype).tobytes())
                        m = meta["splits"][s]
                        for key in ("documents", "content", "pad"):
                            m[key] += part[key]
                        m["length"] += len(part["tokens"])
                        tokens += part["content"]
                    meta["documents"] += tmeta["documents"]
                    meta["empty_documents"] += result["empty"]
                for f in files.values():
                    f.flush()
                    os.fsync(f.fileno())
            finally:
                for f in files.values():
                    f.close()
            st = ctx.source.stats
            meta.update(
                bytes=st.bytes, undecodable_bytes=st.undecodable_bytes, binary_files=st.binary_files
            )
            for s in pk.SPLITS:
                os.replace(f"{stem}.{s}.bin.tmp", f"{stem}.{s}.bin")
            atomic_write_json(f"{stem}.json", meta)
            out[i] = meta
            if ctx.die is not None and n_done >= ctx.die:  # tests: a rank that dies mid-run
                os.kill(os.getpid(), signal.SIGKILL)
        ok = True
    finally:
        encoder.close(ok)
    return out, tokens


# ------------------------------------------------------------------------ phase: assemble
def _assemble(
    ctx: _Ctx, metas: list[dict[str, Any]], dtype: np.dtype, shard_rows: int
) -> tuple[list[tuple[str, int, dict[str, Any]]], dict[str, Any]]:
    """Write this rank's shards; returns ``(split, k, entry)`` for each and the run counters."""
    cfg = ctx.cfg
    n = cfg.seq_len
    body = n - 1
    counters: dict[str, Any] = {
        "documents_read": sum(m["documents"] for m in metas),
        "bytes": sum(m["bytes"] for m in metas),
        "undecodable_bytes": sum(m["undecodable_bytes"] for m in metas),
        "empty_documents": sum(m["empty_documents"] for m in metas),
        "splits": {},
        "binary_files": sum(m["binary_files"] for m in metas),
    }
    jobs: list[tuple[str, int, int, int, np.ndarray]] = []
    for s in pk.SPLITS:
        lengths = np.array([m["splits"][s]["length"] for m in metas], dtype=np.int64)
        c = {
            key: sum(m["splits"][s][key] for m in metas) for key in ("documents", "content", "pad")
        }
        total = int(lengths.sum())
        if cfg.packing == "full":
            rows = -(-total // body)
            c["pad"] += (body - total % body) % body  # the last row's padding
        else:
            rows = total
        counters["splits"][s] = c
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        for k in range(-(-rows // shard_rows)):
            jobs.append((s, k, k * shard_rows, min(rows, (k + 1) * shard_rows), offsets))
    if counters["splits"]["train"]["content"] + counters["splits"]["valid"]["content"] == 0:
        raise _alike(
            ctx,
            f"the corpus is empty: {counters['documents_read']} documents from {cfg.sources} "
            "produced no tokens",
        )
    empty = pk.empty_split(counters, cfg.valid_fraction, cfg.max_doc_bytes)
    if empty:  # alike on every rank; rank 0 removes the run (the fix changes the options)
        ctx.created = ctx.made_out
        raise _alike(ctx, empty)
    for s in pk.SPLITS:  # (after the checks: rank 0 may be removing --out after a refusal)
        os.makedirs(os.path.join(cfg.out, s), exist_ok=True)
    entries = []
    for j, (s, k, r0, r1, offsets) in enumerate(jobs):
        if j % ctx.size != ctx.rank:
            continue
        ctx.comm.check_peers()
        entries.append((s, k, _write_shard(ctx, s, k, r0, r1, offsets, dtype)))
    return entries, counters


def _read_stream(ctx: _Ctx, split: str, lo: int, hi: int, offsets: np.ndarray, dtype, width: int):
    """Items ``[lo, hi)`` of a split's concatenated unit streams (item = ``width`` tokens)."""
    parts = []
    first = int(np.searchsorted(offsets, lo, side="right")) - 1
    for u in range(max(first, 0), len(offsets) - 1):
        a, b = int(offsets[u]), int(offsets[u + 1])
        if a >= hi:
            break
        s, e = max(lo, a), min(hi, b)
        if e <= s:
            continue
        path = os.path.join(ctx.units_dir, f"u{u:06d}.{split}.bin")
        count = (e - s) * width
        arr = np.fromfile(path, dtype=dtype, count=count, offset=(s - a) * width * dtype.itemsize)
        if len(arr) != count:
            raise DataPrepError(
                f"work file {path!r} is shorter than recorded; rerun with --overwrite"
            )
        parts.append(arr)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def _write_shard(ctx: _Ctx, split: str, k: int, r0: int, r1: int, offsets, dtype) -> dict[str, Any]:
    cfg = ctx.cfg
    n = cfg.seq_len
    rel = f"{split}/{shard_name(k)}"
    final = os.path.join(cfg.out, rel)
    nrows = r1 - r0
    header = npy_header(nrows, n, dtype)
    if os.path.isfile(final) and os.path.getsize(final) == len(header) + nrows * n * dtype.itemsize:
        return {"file": rel, "rows": nrows, "sha256": file_sha256(final)}  # done before a resume
    if cfg.packing == "full":
        body = n - 1
        total = int(offsets[-1])
        tok = _read_stream(ctx, split, r0 * body, min(r1 * body, total), offsets, dtype, 1)
        flat = np.full(nrows * body, ctx.ids["pad_id"], dtype=dtype)
        flat[: len(tok)] = tok
        rows = np.empty((nrows, n), dtype=dtype)
        rows[:, 0] = ctx.ids["cls_id"]
        rows[:, 1:] = flat.reshape(nrows, body)
    else:
        rows = _read_stream(ctx, split, r0, r1, offsets, dtype, n).reshape(nrows, n)
    data = rows.tobytes()
    h = hashlib.sha256(header)
    h.update(data)
    partial = final + ".partial"
    with open(partial, "wb") as f:
        f.write(header)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, final)
    fsync_dir(os.path.dirname(final))
    return {"file": rel, "rows": nrows, "sha256": h.hexdigest()}
