"""data_prep on R ranks (``mpirun``/``srun``): the same bytes as one process, for any R.

The corpus is cut into *units*, runs of consecutive documents in the single-process reading
order, as each spec's source kind cuts it (a group of consecutive files of one source of about
``unit_bytes``, a part of a larger file cut between its documents (byte ranges, Parquet row
groups: :func:`data_prep.files.file_parts`), or one contiguous shard of a Hugging Face
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
manifest is written; ``--resume`` (on any R) keeps the tokenizer and the finished units (checked).
"""

import hashlib
import os
import random
import shutil
import signal
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from data_prep import packing as pk
from data_prep.distributed import PeerFailed, Transport, World, connect, remove_sync_root
from data_prep.driver import Context, Run, drive
from data_prep.errors import DataPrepError
from data_prep.shards import fsync_dir, npy_header, shard_name
from data_prep.sources import Source, SourceStats
from data_prep.steps import PROGRESS, PrepResult, _Encoder, _log, _tasks
from data_prep.tokenizer import document_lines, split_long_line
from data_prep.verify import json_record, same_bytes
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
def scan_unit(
    source: Source, unit: Unit, sampling: bool, per_doc: bool
) -> tuple[SourceStats, list[SourceStats] | None]:
    """The counters of ``unit`` (with its tokenizer lines when ``sampling``), and when
    ``per_doc`` the counters as they stand right after each of its documents."""
    source.stats = st = SourceStats()
    docs: list[SourceStats] | None = [] if per_doc else None
    for doc in unit_docs(source, unit, None):
        if sampling:
            for line in document_lines(doc):
                st.lines += 1
                st.line_bytes += len(line.encode("utf-8"))
                n = len(split_long_line(line))
                st.long_lines += n > 1
                st.pieces += n
        if docs is not None:
            docs.append(st.copy())
    return st, docs


def _cut_in(docs: list[SourceStats], base: SourceStats, cfg: Any) -> int | None:
    """The local index of the document that reaches --max-docs/--max-bytes, if in this unit."""
    for i, d in enumerate(docs):
        if cfg.max_docs is not None and base.documents + d.documents >= cfg.max_docs:
            return i
        if cfg.max_bytes is not None and base.bytes + d.bytes >= cfg.max_bytes:
            return i
    return None


# ------------------------------------------------------------------------------ the ranks
class Ranks(Context):
    """One rank of R: the corpus cut into work units (the module docstring), collectives over
    ``comm`` (:mod:`data_prep.distributed`)."""

    mode = "units"

    def __init__(self, cfg: Any, comm: Transport) -> None:
        self.comm = comm
        self.rank = comm.rank
        self.size = comm.size
        self.where = f" on {comm.size} ranks"
        self.units: list[Unit] = []
        self.plan_: dict[str, Any] = {}  # the units to read, the --max-* cut
        self.scans: list[SourceStats] = []
        self.done: dict[int, dict[str, Any]] = {}  # finished units (a resumed run's)
        self.jobs: list[tuple[str, int, int, int, np.ndarray]] = []  # the shards to write
        self.die = None
        spec = os.environ.get(DIE_ENV)
        if spec:
            r, n = spec.split(":")
            if int(r) == self.rank:
                self.die = int(n)

    # ---------------------------------------------------------------------- collectives
    def bcast(self, obj: Any, what: str = "") -> Any:
        return self.comm.bcast(obj, what)

    def gather(self, obj: Any, what: str = "") -> list[Any] | None:
        return self.comm.gather(obj, what)

    def allgather(self, obj: Any, what: str = "") -> list[Any]:
        return self.comm.allgather(obj, what)

    def check_peers(self) -> None:
        self.comm.check_peers()

    def alike(self, message: str, kind: type = DataPrepError) -> DataPrepError:
        return DataPrepError(message) if self.rank == 0 else Quiet(message)

    # ---------------------------------------------------------------------------- work
    def wrong_mode(self, out: str) -> str:
        return (
            f"cannot --resume {out!r} under mpirun/srun: that run was started as one "
            "process; resume it the same way (or --overwrite)"
        )

    def plan(self, run: Run) -> dict[str, Any]:
        # rank 0 cuts the inputs (a large CSV is parsed once to find its row ends), the
        # others receive the units
        cfg, state, source = run.cfg, run.state, run.source
        unit_bytes = (state or {}).get("unit_bytes") or cfg.unit_bytes
        unit_bytes = unit_bytes or default_unit_bytes(source.total_bytes())
        head = {"unit_bytes": unit_bytes, "units": make_units(source, unit_bytes)}
        if state is not None:
            if state.get("units") != len(head["units"]):
                raise DataPrepError(
                    f"cannot --resume: the sources now make {len(head['units'])} work units, "
                    f"the interrupted run had {state.get('units')}; rerun with --overwrite"
                )
            head["done"], redo = verified_units(os.path.join(cfg.out, UNITS_DIR))
            for name in redo:
                _log(cfg, f"work unit file {name} changed since it was written: encoding it again")
        return head

    def sample(self, run: Run, train: bool):
        self.units = run.head["units"]
        limited = run.cfg.max_docs is not None or run.cfg.max_bytes is not None
        self.plan_, self.scans = _scan(self, run, train, limited)
        return _sample(self, run) if train else None

    def start(self, run: Run) -> None:
        cfg = run.cfg
        self.units = run.head["units"]
        if run.state is None:
            if self.rank == 0:
                os.makedirs(os.path.join(cfg.out, UNITS_DIR), exist_ok=True)
                atomic_write_json(
                    os.path.join(cfg.out, PROGRESS),
                    {
                        "fingerprint": cfg.fingerprint(),
                        "sources": run.sources,
                        "mode": "units",
                        "unit_bytes": run.head["unit_bytes"],
                        "units": len(self.units),
                        "plan": self.plan_,
                        "tokenizer": run.tok_info,
                    },
                )
            self.allgather(None, "tokenizer")  # progress.json is written: resumable from here
        else:
            self.plan_, self.done = run.state["plan"], run.head["done"]
            _log(cfg, f"resuming: {len(self.done)} of {self.plan_['units']} work units are done")

    def encode(self, run: Run) -> None:
        cfg = run.cfg
        t_encode = time.time()
        mine = _tokenize(self, run)
        run.encode_s = time.time() - t_encode
        _log(
            cfg,
            f"rank {self.rank}/{self.size}: {len(mine)} units, {run.tokens} tokens in "
            f"{run.encode_s:.2f} s ({run.tokens / max(run.encode_s, 1e-9):,.0f} tokens/s)",
        )
        metas = dict(self.done)
        for part in self.allgather(mine, "tokenize"):
            metas.update(part)
        run.counters, self.jobs, run.stats = _count(
            cfg, [metas[i] for i in range(self.plan_["units"])], run.shard_rows
        )

    def write_rows(self, run: Run) -> None:
        cfg = run.cfg
        for s in pk.SPLITS:  # (after the checks: rank 0 may be removing the run after a refusal)
            os.makedirs(os.path.join(cfg.out, s), exist_ok=True)
        entries = []
        for j, (s, k, r0, r1, offsets) in enumerate(self.jobs):
            if j % self.size != self.rank:
                continue
            self.check_peers()
            entries.append((s, k, _write_shard(run, s, k, r0, r1, offsets)))
        if self.rank != 0:  # nothing more from this rank: after this, rank 0 removes the sync files
            self.comm.stop_heartbeat()
        gathered = self.gather(entries, "shards")
        if self.rank == 0:
            shards: dict[str, list[tuple[int, dict[str, Any]]]] = {s: [] for s in pk.SPLITS}
            for part in gathered or []:
                for split, k, entry in part:
                    shards[split].append((k, entry))
            run.writers = {s: _Done([e for _, e in sorted(shards[s], key=lambda x: x[0])])
                           for s in pk.SPLITS}  # fmt: skip

    def finish(self, run: Run) -> None:
        shutil.rmtree(os.path.join(run.cfg.out, UNITS_DIR), ignore_errors=True)


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
    run: Run | None = None
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
            run = Run(cfg, Ranks(cfg, comm), source, t_start)
            result = drive(run)
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
        elif not ok and run is not None and comm.rank == 0 and run.disposable:
            if run.cfg.out != cfg.out:  # the partial directory, before its tokenizer was saved
                shutil.rmtree(run.cfg.out, ignore_errors=True)  # (or refused): nothing to resume


def _who(comm: Transport) -> str:
    return f"rank {comm.rank} of {comm.size}: " if comm.rank else ""


class _Done:
    """Stands in for a ShardWriter in :func:`data_prep.steps._manifest`."""

    def __init__(self, shards: list[dict[str, Any]]) -> None:
        self.shards = shards

    def close(self) -> list[dict[str, Any]]:
        return list(self.shards)


def verified_units(units_dir: str) -> tuple[dict[int, dict[str, Any]], list[str]]:
    """The finished units of an interrupted run whose stream files hold the bytes recorded
    (sha256) as they were written, and a file of each that does not (or that an earlier
    data_prep recorded no sha256 of): their records are removed, and the units encoded again
    from their sources (checked unchanged; a unit is a fixed run of documents)."""
    done, redo = {}, []
    names = sorted(os.listdir(units_dir)) if os.path.isdir(units_dir) else []
    for name in (n for n in names if n.startswith("u") and n.endswith(".json")):
        stem = os.path.join(units_dir, name[: -len(".json")])
        meta = json_record(stem + ".json")  # None: unreadable (encoded again too)
        sums = (meta or {}).get("sha256") or {}
        bad = [f"{stem}.{s}.bin" for s in pk.SPLITS]
        bad = [p for p, s in zip(bad, pk.SPLITS) if not same_bytes(p, sums.get(s))]
        if bad:
            os.remove(stem + ".json")
            redo.append(bad[0])
        else:
            done[int(meta["index"])] = meta
    return done, redo


# ---------------------------------------------------------------------------- phase: scan
def _scan(
    ctx: Ranks, run: Run, sampling: bool, limited: bool
) -> tuple[dict[str, Any], list[SourceStats]]:
    """Count what the sample and the --max-* cut need; returns (plan, scans of kept units)."""
    cfg, units = run.cfg, ctx.units
    if not sampling and not limited:
        return {"units": len(units), "cut": None}, []
    if not limited:  # every unit, balanced; one exchange at the end
        mine = assign([(u.index, u.size) for u in units], ctx.size)[ctx.rank]
        out = {}
        for i in mine:
            ctx.check_peers()
            out[i] = scan_unit(run.source, units[i], sampling, False)[0]
        scans: dict[int, SourceStats] = {}
        for part in ctx.allgather(out, "scan"):
            scans.update(part)
        return {"units": len(units), "cut": None}, [scans[i] for i in range(len(units))]
    # --max-docs/--max-bytes: rounds of R consecutive units until the cut is found
    kept: list[SourceStats] = []
    base = SourceStats()
    for start in range(0, len(units), ctx.size):
        idx = start + ctx.rank
        local = scan_unit(run.source, units[idx], sampling, True) if idx < len(units) else None
        totals = ctx.allgather(local[0] if local else None, "scan round")
        bases, b = [], base
        for t in totals:
            bases.append(b)
            b = b + t if t is not None else b
        cut = _cut_in(local[1], bases[ctx.rank], cfg) if local else None
        cand = ctx.allgather(None if cut is None else (cut, local[1][cut]), "scan cut")
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
def _sample(ctx: Ranks, run: Run):
    """The single-process reservoir sample, drawn across the ranks (the module docstring);
    on rank 0 ``(sample, its counters, start time, counters of the corpus)``."""
    cfg, units, plan, scans = run.cfg, ctx.units, ctx.plan_, ctx.scans
    t0 = time.time()
    total = SourceStats()
    for s in scans:
        total = total + s
    slots = reservoir_indices(total.pieces, cfg.max_sentences_for_tokenizer, cfg.seed)
    wanted = np.sort(slots)
    bases = np.concatenate([[0], np.cumsum([s.pieces for s in scans])]).astype(np.int64)
    counts = np.searchsorted(wanted, bases[1:]) - np.searchsorted(wanted, bases[:-1])
    sizes = [(i, units[i].size) for i in range(plan["units"]) if counts[i] > 0]
    mine = assign(sizes, ctx.size)[ctx.rank]
    got: dict[int, str] = {}
    for i in mine:
        ctx.check_peers()
        lo, hi = bases[i], bases[i + 1]
        want = wanted[np.searchsorted(wanted, lo) : np.searchsorted(wanted, hi)] - lo
        got.update(_collect(run.source, units[i], _unit_limit(plan, i), want, int(lo)))
    parts = ctx.gather(got, "tokenizer sample")
    if ctx.rank != 0:
        return None
    pieces: dict[int, str] = {}
    for p in parts or []:
        pieces.update(p)
    sample = [pieces[int(t)] for t in slots]
    sampled = {
        "corpus_lines": total.lines,
        "corpus_bytes": total.line_bytes,
        "long_lines": total.long_lines,
        "sampled_lines": len(sample),
        "sampled_bytes": sum(len(s.encode("utf-8")) for s in sample),
    }
    return sample, sampled, t0, total


def _collect(
    source: Source, unit: Unit, limit: int | None, want: np.ndarray, base: int
) -> dict[int, str]:
    """The training lines of ``unit`` with local indices ``want`` (sorted), keyed globally."""
    source.stats = SourceStats()
    out: dict[int, str] = {}
    n = 0
    j = 0
    for doc in unit_docs(source, unit, limit):
        for line in document_lines(doc):
            for piece in split_long_line(line):
                if j < len(want) and want[j] == n:
                    out[base + n] = piece
                    j += 1
                n += 1
        if j == len(want):
            break
    return out


# ------------------------------------------------------------------------ phase: tokenize
def _tokenize(ctx: Ranks, run: Run) -> dict[int, dict[str, Any]]:
    """Encode this rank's share of the unfinished units into ``.units/``; returns their
    records (also each unit's ``u*.json``, written last)."""
    cfg, dtype, plan = run.cfg, run.dtype, ctx.plan_
    todo = [(i, ctx.units[i].size) for i in range(plan["units"]) if i not in ctx.done]
    mine = assign(todo, ctx.size)[ctx.rank]
    out: dict[int, dict[str, Any]] = {}
    if not mine:
        return out
    units_dir = os.path.join(cfg.out, UNITS_DIR)
    os.makedirs(units_dir, exist_ok=True)
    settings = pk.EncodeSettings(
        cfg.seq_len, cfg.packing, cfg.valid_fraction, cfg.seed, dtype.name, **run.ids
    )
    encoder = _Encoder(cfg.workers, run.model, settings)
    ok = False
    try:
        for n_done, i in enumerate(mine, 1):
            run.source.stats = SourceStats()
            docs = unit_docs(run.source, ctx.units[i], _unit_limit(plan, i))
            stem = os.path.join(units_dir, f"u{i:06d}")
            files = {s: open(f"{stem}.{s}.bin.tmp", "wb") for s in pk.SPLITS}
            hashes = {s: hashlib.sha256() for s in pk.SPLITS}  # of the bytes as written
            meta: dict[str, Any] = {
                "index": i,
                "documents": 0,
                "empty_documents": 0,
                "splits": {s: {"documents": 0, "content": 0, "pad": 0, "length": 0} for s in pk.SPLITS},
            }  # fmt: skip
            try:
                for result, tmeta in encoder.map(_tasks(docs, run.source, cfg.task_bytes)):
                    ctx.check_peers()
                    for s in pk.SPLITS:
                        part = result["splits"][s]
                        data = np.ascontiguousarray(part["tokens"], dtype=dtype).tobytes()
                        files[s].write(data)
                        hashes[s].update(data)
                        m = meta["splits"][s]
                        for key in ("documents", "content", "pad"):
                            m[key] += part[key]
                        m["length"] += len(part["tokens"])
                        run.tokens += part["content"]
                    meta["documents"] += tmeta["documents"]
                    meta["empty_documents"] += result["empty"]
                for f in files.values():
                    f.flush()
                    os.fsync(f.fileno())
            finally:
                for f in files.values():
                    f.close()
            st = run.source.stats
            meta.update(bytes=st.bytes, undecodable_bytes=st.undecodable_bytes,
                        binary_files=st.binary_files, binary_examples=st.binary_examples,
                        undecodable_files=st.undecodable_files,
                        sha256={s: h.hexdigest() for s, h in hashes.items()})  # fmt: skip
            for s in pk.SPLITS:
                os.replace(f"{stem}.{s}.bin.tmp", f"{stem}.{s}.bin")
            atomic_write_json(f"{stem}.json", meta)
            out[i] = meta
            if ctx.die is not None and n_done >= ctx.die:  # tests: a rank that dies mid-run
                os.kill(os.getpid(), signal.SIGKILL)
        ok = True
    finally:
        encoder.close(ok)
    return out


# ------------------------------------------------------------------------ phase: assemble
def _count(
    cfg: Any, metas: list[dict[str, Any]], shard_rows: int
) -> tuple[dict[str, Any], list[tuple[str, int, int, int, np.ndarray]], SourceStats]:
    """The run's counters, the shards to write ``(split, k, first row, end row, the units'
    stream offsets)`` and the counters of the documents read, from the units' records."""
    body = cfg.seq_len - 1
    counters: dict[str, Any] = {
        "documents_read": sum(m["documents"] for m in metas),
        "bytes": sum(m["bytes"] for m in metas),
        "undecodable_bytes": sum(m["undecodable_bytes"] for m in metas),
        "empty_documents": sum(m["empty_documents"] for m in metas),
        "splits": {},
    }
    stats = SourceStats()
    for m in metas:
        stats = stats + SourceStats.from_record(m)
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
    return counters, jobs, stats


def _read_stream(
    units_dir: str, split: str, lo: int, hi: int, offsets: np.ndarray, dtype, width: int
):
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
        path = os.path.join(units_dir, f"u{u:06d}.{split}.bin")
        count = (e - s) * width
        arr = np.fromfile(path, dtype=dtype, count=count, offset=(s - a) * width * dtype.itemsize)
        if len(arr) != count:
            raise DataPrepError(
                f"work file {path!r} is shorter than recorded; rerun with --overwrite"
            )
        parts.append(arr)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def _write_shard(run: Run, split: str, k: int, r0: int, r1: int, offsets) -> dict[str, Any]:
    cfg, dtype, ids = run.cfg, run.dtype, run.ids
    units_dir = os.path.join(cfg.out, UNITS_DIR)
    n = cfg.seq_len
    rel = f"{split}/{shard_name(k)}"
    final = os.path.join(cfg.out, rel)
    nrows = r1 - r0
    header = npy_header(nrows, n, dtype)
    # (a shard an interrupted run wrote is written again: its units are verified, it is not)
    if cfg.packing == "full":
        body = n - 1
        total = int(offsets[-1])
        tok = _read_stream(units_dir, split, r0 * body, min(r1 * body, total), offsets, dtype, 1)
        flat = np.full(nrows * body, ids["pad_id"], dtype=dtype)
        flat[: len(tok)] = tok
        rows = np.empty((nrows, n), dtype=dtype)
        rows[:, 0] = ids["cls_id"]
        rows[:, 1:] = flat.reshape(nrows, body)
    else:
        rows = _read_stream(units_dir, split, r0, r1, offsets, dtype, n).reshape(nrows, n)
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
