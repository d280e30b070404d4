"""``data_prep --resume`` continues only what it verified (generated interrupts and changes).

A run of one process (stopped at a drawn encoding task, or right after a drawn shard was
finished and before a checkpoint recorded it) or of ranks (one rank, stopped at a drawn task or
a drawn shard of the assembly), then one drawn change: a drawn byte of any file the run keeps
(a finished shard, the partial shard, a unit's work file, a shard the ranks had begun, the
tokenizer), or a drawn source file edited in place (same size), appended to, touched, added or
removed, or nothing. The rule (docs/reliability.md), as the expectation here: a change to a
source or to bytes the resume would keep is refused in one line naming the file, and the run
stays resumable (undone, the resume completes); bytes the resume drops, rewrites or redoes
(rows after the checkpoint, the partial shard's header, a unit's work file, a shard the ranks
write again) and a touch are no change. Every completed resume publishes the bytes of the
uninterrupted run, and its manifest's sha256 are those of the files on disk.
"""

import contextlib
import hashlib
import itertools
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, assume, event, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_data_prep  # noqa: E402
from test_data_prep import write_text_corpus  # noqa: E402

import data_prep.packing as pk  # noqa: E402
import data_prep.parallel as par  # noqa: E402
from data_prep import DataPrepError, PrepConfig, prepare  # noqa: E402
from data_prep.distributed import World  # noqa: E402
from data_prep.shards import ShardWriter, npy_header  # noqa: E402

DOCS = 16  # of the corpus fixture's documents: about 6 KB, ~20 tasks, ~15 shards
KW = dict(seq_len=32, shard_rows=5, task_bytes=300, valid_fraction=0.2, workers=0, progress=False)
UNIT_BYTES = 1500  # the ranks' work units: 4-5 of them
RUN_IDS = itertools.count()
PHASES = (Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink)  # (explain: minutes)
corpus = test_data_prep.corpus  # its fixture: generated documents and a tokenizer trained on them


@contextlib.contextmanager
def interrupt_at(target, name: str, n: int):
    """``target.name`` raises KeyboardInterrupt on its ``n``-th call (0: never); yields the
    call count."""
    real = getattr(target, name)
    calls = [0]

    def wrapper(*a, **k):
        calls[0] += 1
        if calls[0] == n:
            raise KeyboardInterrupt
        return real(*a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(target, name, wrapper)
        yield calls


SITES = {  # where a run stops: (object, attribute) whose n-th call raises
    ("one", "task"): (pk, "encode_task"),
    ("one", "shard"): (ShardWriter, "read_back"),  # a shard renamed, no checkpoint yet
    ("ranks", "task"): (pk, "encode_task"),
    ("ranks", "shard"): (par, "_write_shard"),
}


def prep(mode: str, src: Path, out: Path, model: str, resume: bool = False, **extra):
    cfg = PrepConfig(sources=[str(src)], out=str(out), tokenizer=model, resume=resume,
                     **{**KW, **extra})  # fmt: skip
    if mode == "one":
        return prepare(cfg).manifest
    cfg.unit_bytes, cfg.rank_timeout = UNIT_BYTES, 30.0
    return par.prepare_distributed(cfg, World("slurm", 0, 1, f"t{next(RUN_IDS)}")).manifest


def published(out: Path, m: dict) -> dict:
    """The manifest's splits, each shard's sha256 checked against the file on disk."""
    for s in ("train", "valid"):
        for sh in m["splits"][s]["shards"]:
            assert hashlib.sha256((out / sh["file"]).read_bytes()).hexdigest() == sh["sha256"]
    return m["splits"]


@pytest.fixture(scope="module")
def ref(corpus, tmp_path_factory):
    """The uninterrupted run's splits, and how often each stopping site is called in it."""
    tmp = tmp_path_factory.mktemp("resume_ref")
    src = write_text_corpus(tmp / "src", corpus["docs"][:DOCS])
    calls, splits = {}, {}
    for mode in ("one", "ranks"):
        with interrupt_at(*SITES[mode, "task"], 0) as tasks:
            with interrupt_at(*SITES[mode, "shard"], 0) as shards:
                splits[mode] = published(tmp / mode, prep(mode, src, tmp / mode, corpus["model"]))
        calls[mode, "task"], calls[mode, "shard"] = tasks[0], shards[0]
    assert splits["ranks"] == splits["one"]  # (the ranks' equality is test_data_prep_mpi's)
    assert min(calls.values()) >= 3
    return {"splits": splits["one"], "calls": calls}


def flip(path: Path, offset: int, by: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 + by % 255  # never 0: the byte changes
    path.write_bytes(bytes(data))


def kept_bytes(mode: str, work: Path, path: Path, offset: int) -> bool:
    """Whether the resume keeps the byte ``offset`` of ``path`` (so that changing it must be
    refused): the tokenizer; one process: a finished shard recorded in progress.json, the
    partial shard's recorded rows (not its header: rewritten, nor later rows: dropped)."""
    rel = path.relative_to(work).as_posix()
    if rel == "tokenizer.model":
        return True
    if mode != "one":  # the ranks redo a unit whose file changed and rewrite every shard
        return False
    state = json.loads((work / "progress.json").read_text())
    for split, w in state["writers"].items():
        if rel in {s["file"] for s in w["shards"]}:
            return True
        current = f"{split}/shard_{w['index']:05d}.npy"
        if rel in (current, current + ".partial") and w["rows"]:
            header = len(npy_header(0, KW["seq_len"], "uint16"))
            return header <= offset < header + w["rows"] * KW["seq_len"] * 2
    return False


def shard_files(work: Path) -> list[Path]:
    return sorted(p for s in ("train", "valid") for p in (work / s).glob("*"))


# What a change hits: (the runs it applies to, the files of the run it may change)
TARGETS = {
    "finished shard": (["one"], lambda w: [w / f for f in recorded_shards(w)]),
    "other shard file": (  # the partial shard (header, rows, rows after the checkpoint), later ones
        ["one"],
        lambda w: [
            p for p in shard_files(w) if p.relative_to(w).as_posix() not in recorded_shards(w)
        ],
    ),  # fmt: skip
    "unit work file": (["ranks"], lambda w: sorted((w / ".units").glob("*.bin*"))),
    "shard the ranks began": (["ranks"], shard_files),
    "tokenizer": (["one", "ranks"], lambda w: [w / "tokenizer.model"]),
}
SETTINGS = dict(deadline=None, derandomize=True, phases=PHASES,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.filter_too_much])  # fmt: skip


def recorded_shards(work: Path) -> set[str]:
    state = json.loads((work / "progress.json").read_text())
    return {s["file"] for w in state["writers"].values() for s in w["shards"]}


def interrupted(tmp_path_factory, corpus, ref, mode: str, data, site: str = "") -> tuple:
    """A run of ``mode`` stopped at a drawn site and call, with drawn checkpoints: ``(src,
    out, work, resume)``; ``resume()`` runs ``--resume`` (the same options)."""
    tmp = tmp_path_factory.mktemp("resume")
    src = write_text_corpus(tmp / "src", corpus["docs"][:DOCS])
    out, work = tmp / "out", tmp / ".out.data_prep-partial"
    site = site or data.draw(st.sampled_from(["task", "shard"]), label="stop at")
    first = 2 if site == "shard" and mode == "ranks" else 1  # (after the first shard)
    stop = data.draw(st.integers(first, ref["calls"][mode, site]), label="call")
    every = data.draw(st.sampled_from([0.0, 1e9]), label="checkpoint_seconds")
    with interrupt_at(*SITES[mode, site], stop), pytest.raises(KeyboardInterrupt):
        prep(mode, src, out, corpus["model"], checkpoint_seconds=every)
    assert not out.exists() and (work / "progress.json").is_file()
    return (
        src,
        out,
        work,
        lambda: prep(mode, src, out, corpus["model"], True, checkpoint_seconds=every),
    )


def resumes(out: Path, work: Path, resume, ref, refused: Path | None, undo) -> None:
    """``--resume`` is refused in one line naming ``refused`` (then the run is still resumable:
    once the change is undone it completes), or completes (``refused`` None); completed, it
    published the uninterrupted run's shards, the manifest's sha256 those on disk."""
    if refused is not None:
        with pytest.raises(DataPrepError) as e:
            resume()
        msg = str(e.value)
        assert "\n" not in msg and str(refused) in msg and msg.startswith("cannot resume"), msg
        assert not out.exists() and (work / "progress.json").is_file()
        undo()
    assert published(out, resume()) == ref["splits"]
    assert not work.exists()
    shutil.rmtree(out.parent)


@pytest.mark.parametrize("target", list(TARGETS))
@settings(max_examples=3, **SETTINGS)
@given(data=st.data())
def test_a_changed_byte_of_what_the_resume_keeps_is_refused_the_rest_redone(
    corpus, ref, tmp_path_factory, target, data
):
    """A drawn byte of a drawn file of the interrupted run: refused when the resume keeps that
    byte (:func:`kept_bytes`), else the resume completes (it drops, rewrites or redoes it)."""
    modes, candidates = TARGETS[target]
    mode = data.draw(st.sampled_from(modes), label="mode")
    site = "shard" if target == "shard the ranks began" else ""  # (none before the assembly)
    src, out, work, resume = interrupted(tmp_path_factory, corpus, ref, mode, data, site)
    files = [p for p in candidates(work) if p.stat().st_size]
    assume(files)
    path = data.draw(st.sampled_from(files), label="file")
    offset = data.draw(st.integers(0, path.stat().st_size - 1), label="offset")
    before = path.read_bytes()
    flip(path, offset, data.draw(st.integers(0, 254), label="xor"))
    refused = path if kept_bytes(mode, work, path, offset) else None
    event(f"{mode}: {'refused' if refused else 'completed'}")
    resumes(out, work, resume, ref, refused, lambda: path.write_bytes(before))


@pytest.mark.parametrize("change", ["edit", "append", "touch", "add", "remove"])
@settings(max_examples=2, **SETTINGS)
@given(data=st.data())
def test_a_changed_source_is_refused_naming_it(corpus, ref, tmp_path_factory, change, data):
    """A drawn source file edited in place at a drawn byte (same size), appended to, touched,
    removed, or a file added beside it: refused naming it, except the touch (same bytes)."""
    mode = data.draw(st.sampled_from(["one", "ranks"]), label="mode")
    src, out, work, resume = interrupted(tmp_path_factory, corpus, ref, mode, data)
    path = data.draw(st.sampled_from(sorted(src.iterdir())), label="source file")
    before, stat = path.read_bytes(), path.stat()
    undo = lambda: path.write_bytes(before)  # noqa: E731
    refused = path
    if change == "edit":
        flip(path, data.draw(st.integers(0, len(before) - 1), label="offset"), 7)
    elif change == "append":
        path.write_bytes(before + b"one more line\n")
    elif change == "touch":
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
        refused = None
    elif change == "remove":
        path.unlink()
    else:
        refused = path.with_name(path.stem + "b.txt")  # read right after it
        refused.write_text("a new document\n")
        undo = refused.unlink
    resumes(out, work, resume, ref, refused, undo)
