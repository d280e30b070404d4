"""Issue 30 item 5: data the trainer or data_prep must refuse in one line (exit 2) naming the
problem and the fix, with no file changed: a tokenizer.model that is not the data's tokenizer
although its sha256 matches the manifest, a stage ``path:`` named like another source, mixture
weights that cannot be normalised, and a data_prep output with an empty split. And (e) large
input files (JSON lines, plain text, CSV/TSV, Parquet) cut into work units between their
documents, so that data_prep on R ranks writes the bytes of one process."""

import csv
import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import pytest
from sentencepiece import sentencepiece_model_pb2 as pb

from linformer_ds import train
from linformer_ds.config import ConfigError, load_config
from linformer_ds.data.sampler import normalized_weights
from linformer_ds.data.shards import ShardDataset
from linformer_ds.data.splits import empty_split_fix
from linformer_ds.data.stages import resolve_stages
from tests.pretrain_utils import TEST_OVERRIDES, TINY_CONFIG, run_ranks_in_threads

pytestmark = pytest.mark.usefixtures("_clean_env")  # main() fills in the rank variables


def tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` and beside it with its name (``.NAME.lock``, sync
    directories), with its sha256."""
    out = {}
    for top in [root, *root.parent.glob(f".{root.name}*")]:
        for p in [top, *top.rglob("*")] if top.exists() else []:
            if p.is_file():
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def one_line_exit_2(argv: list[str], capsys, watched: list[Path]) -> str:
    """Run the trainer; assert exit 2, one line, no traceback, no file changed under
    ``watched``; return the line."""
    before = {str(w): tree(w) for w in watched}
    rc = train.main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert {str(w): tree(w) for w in watched} == before
    return err


def _argv(data: Path, run: Path, *more: str) -> list[str]:
    return ["--config", TINY_CONFIG, *TEST_OVERRIDES, f"data.path={data}", f"logging.dir={run}",
            *more]  # fmt: skip


# ============================================================== a. the tokenizer, parsed at start
def _swap_tokenizer(data: Path, content: bytes, **record) -> None:
    """Replace data's tokenizer.model and make the manifest agree (sha256 and ``record``)."""
    (data / "tokenizer.model").write_bytes(content)
    m = json.loads((data / "manifest.json").read_text())
    m["tokenizer"]["sha256"] = hashlib.sha256(content).hexdigest()
    m["tokenizer"].update(record)
    (data / "manifest.json").write_text(json.dumps(m))


def _edited_model(data: Path, edit) -> bytes:
    proto = pb.ModelProto()
    proto.ParseFromString((data / "tokenizer.model").read_bytes())
    edit(proto)
    return proto.SerializeToString()


def _rename_mask(p: pb.ModelProto) -> None:
    p.pieces[4].piece = "<msk>"


def _drop_pieces(p: pb.ModelProto) -> None:
    del p.pieces[1500:]


TOKENIZER_CASES = [
    ("random-bytes", lambda d: random.Random(0).randbytes(2 * 1024), {},
     "tokenizer.model: not a SentencePiece model"),
    ("fewer-pieces", lambda d: _edited_model(d, _drop_pieces), {"vocab_size": 1500},
     "tokenizer.model: 1500 pieces, the manifest's vocab_size is 2000"),
    ("no-mask-token", lambda d: _edited_model(d, _rename_mask), {},
     "tokenizer.model: special tokens <mask> = -1 (not 4); every data_prep tokenizer has"),
]  # fmt: skip


@pytest.mark.parametrize("make,record,message", [c[1:] for c in TOKENIZER_CASES],
                         ids=[c[0] for c in TOKENIZER_CASES])  # fmt: skip
def test_a_tokenizer_with_matching_sha256_is_still_checked(
    make, record, message, tiny_corpus, tmp_path, capsys
):
    data = tmp_path / "data"
    shutil.copytree(tiny_corpus, data)
    _swap_tokenizer(data, make(data), **record)
    run = tmp_path / "run"
    err = one_line_exit_2(_argv(data, run), capsys, [data, run])
    assert message in err and "re-run data_prep" in err, err
    assert not run.exists()  # nothing written: no checkpoint holds the bad tokenizer


def test_a_the_real_tokenizer_passes(tiny_corpus):
    from linformer_ds.data.shards import check_tokenizer

    check_tokenizer(ShardDataset(tiny_corpus), 2000)


# ====================================================== b. stage paths never alias other sources
def _stages(*overrides: str):
    return resolve_stages(load_config(TINY_CONFIG, [*TEST_OVERRIDES, "data.path=/x", *overrides]))


def test_b_stage_path_named_like_a_source_is_refused(tmp_path, capsys):
    """sources: wiki = n64/wiki; a stage path n128/wiki used to replace wiki in every stage."""
    ov = ["train.max_steps=4", f"data.sources=[{{name: wiki, path: {tmp_path}/n64/wiki}}]",
          f"train.stages=[{{end_step: 2, sources: [wiki]}}, "
          f"{{path: {tmp_path}/n128/wiki}}]"]  # fmt: skip
    with pytest.raises(ConfigError, match=r"train.stages\[1\].path: .*n128/wiki would be named "
                       r"'wiki' after its folder, the name of source 'wiki'"):  # fmt: skip
        _stages(*ov)
    run = tmp_path / "run"
    err = one_line_exit_2(_argv(tmp_path / "d", run, *ov), capsys, [run])
    assert "add it to data.sources under a name of its own ({name: wiki_1, path: " in err, err
    assert "give this stage sources: [wiki_1]" in err


def test_b_two_stage_paths_with_one_folder_name_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"train.stages\[1\].path: .* the name of another "
                       r"stage's path"):  # fmt: skip
        _stages("train.max_steps=4", "train.stages=[{end_step: 2, path: a/n64/wiki}, "
                "{path: a/n128/wiki}]")  # fmt: skip


def test_b_stage_paths_that_are_the_source_keep_its_name(tmp_path):
    """The same directory (spelled otherwise, or through a link) is the same source: it keeps
    the source's name (its stream position continues); other folder names are their own."""
    (tmp_path / "n64" / "wiki").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "n64" / "wiki")
    src = f"data.sources=[{{name: wiki, path: {tmp_path}/n64/wiki}}]"
    for spelled in (f"{tmp_path}/n64/wiki/", f"{tmp_path}/n64/./wiki"):
        st = _stages(
            "train.max_steps=4",
            src,
            f"train.stages=[{{end_step: 2, sources: [wiki]}}, {{path: '{spelled}'}}]",
        )
        assert [s.names for s in st] == [["wiki"], ["wiki"]]
    st = _stages(
        "train.max_steps=6",
        src,
        f"train.stages=[{{end_step: 2, path: {tmp_path}/n128/other}}, "
        f"{{end_step: 4, sources: [wiki]}}, {{path: {tmp_path}/n128/other}}]",
    )
    assert [s.names for s in st] == [["other"], ["wiki"], ["other"]]
    # a stage path whose folder is named like a source no stage lists: that source is unused
    st = _stages("train.max_steps=4", src, "train.stages=[{end_step: 2, path: b/x}, "
                 f"{{path: {tmp_path}/n128/wiki}}]")  # fmt: skip
    assert [s.names for s in st] == [["x"], ["wiki"]] and st[1].paths == [f"{tmp_path}/n128/wiki"]


# ============================================================ c. weights finite and normalisable
def test_c_weights_that_overflow_or_underflow_are_refused():
    with pytest.raises(ValueError, match="sum to inf .*cannot be normalised; .*scale them down"):
        normalized_weights([1e308, 1e308])
    with pytest.raises(ValueError, match="its share rounds to 0"):
        normalized_weights([1e-320, 1e300])
    assert normalized_weights([1e308, 0.0]) == [1.0, 0.0]
    assert normalized_weights([0.8, 0.2]) == [0.8 / 1.0, 0.2 / 1.0]  # unchanged arithmetic


@pytest.mark.parametrize("overrides,message", [
    (["data.sources=[{name: a, path: /x/a, weight: 1e308}, {name: b, path: /x/b, weight: 1e308}]"],
     "data.sources: weights 1e+308, 1e+308 sum to inf (beyond the largest float), so they cannot "
     "be normalised; weights are relative: scale them down"),
    (["data.sources=[{name: a, path: /x/a}, {name: b, path: /x/b}]",
      "train.stages=[{sources: [a, b], weights: [1e308, 1e308]}]"],
     "train.stages[0].weights: weights 1e+308, 1e+308 sum to inf"),
    (["data.sources=[{name: a, path: /x/a, weight: 1e308}, {name: b, path: /x/b, weight: 1e308}]",
      "train.stages=[{sources: [a, b]}]"],
     "data.sources (weights of train.stages[0].sources): weights 1e+308, 1e+308 sum to inf"),
], ids=["sources", "stage-weights", "stage-of-sources"])  # fmt: skip
def test_c_trainer_refuses_weights_that_overflow(overrides, message, tmp_path, capsys):
    run = tmp_path / "run"
    err = one_line_exit_2(_argv(tmp_path / "d", run, *overrides), capsys, [run])
    assert message in err, err


# ============================================================================ d. empty splits
def test_d_advice_names_the_flag_that_works():
    # the corpus: one 40 MB file is 5 documents of 8 MiB; valid got none
    fix = empty_split_fix("valid", 5, 40 << 20, 8 << 20, 0.01)
    assert "5 documents (8.0 MiB each on average) at --valid-fraction 0.01 put none in valid" in fix
    assert "rerun data_prep with --max-doc-bytes 32768" in fix, fix
    assert "--valid-fraction" not in fix.split(";")[1]
    # many small documents: more of them for valid
    fix = empty_split_fix("valid", 200, 200 * 900, 8 << 20, 0.001)
    assert "rerun data_prep with --valid-fraction 0.05 (about 10 of the 200" in fix, fix
    assert "--max-doc-bytes" not in fix
    # too few, small documents: nothing to cut
    assert "a corpus with more documents" in empty_split_fix("valid", 3, 3000, 8 << 20, 0.01)
    assert "lower --valid-fraction" in empty_split_fix("train", 2, 2000, 8 << 20, 0.5)
    assert "--valid-fraction 0 (no valid split)" in empty_split_fix("valid", 9, 9, 9, 0.0)


def _big_file(path: Path, nbytes: int) -> Path:
    """Plain text of about ``nbytes``: varied short lines of words."""
    rng = random.Random(1)
    letters = "etaoinshrdlucmfwyp"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 8))) for _ in range(3000)]
    lines, n = [], 0
    while n < nbytes:
        line = " ".join(rng.choice(words) for _ in range(rng.randint(4, 14))) + "\n"
        lines.append(line)
        n += len(line)
    path.write_text("".join(lines))
    return path


def _data_prep(argv: list[str], capsys) -> tuple:
    from data_prep.__main__ import main as data_prep_main

    rc = data_prep_main(["--seq-len", "32", "--vocab-size", "200", "--workers", "0", "--quiet",
                         *argv])  # fmt: skip
    return rc, capsys.readouterr().err.strip()


@pytest.fixture(scope="module")
def few_huge(tmp_path_factory) -> Path:
    """800 KB in one file: 4 documents of 200 KB at --max-doc-bytes 204800."""
    return _big_file(tmp_path_factory.mktemp("few_huge") / "corpus.txt", 800_000)


FEW_HUGE = ["--max-doc-bytes", "204800", "--valid-fraction", "0.1", "--seed", "3"]


def test_d_data_prep_refuses_an_empty_valid_split_and_its_fix_works(few_huge, tmp_path, capsys):
    out = tmp_path / "out"
    rc, err = _data_prep(["--source", str(few_huge), "--out", str(out), *FEW_HUGE], capsys)
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("data_prep: error: the valid split would be empty: 4 documents "), err
    assert (
        "at --valid-fraction 0.1 put none in valid; rerun data_prep with --max-doc-bytes 4096"
        in err
    ), err
    assert not out.exists() and tree(out) == {}, tree(out)  # nothing left behind
    # an existing empty --out is left empty
    out.mkdir()
    rc, err2 = _data_prep(["--source", str(few_huge), "--out", str(out), *FEW_HUGE], capsys)
    assert rc == 2 and err2 == err and list(out.iterdir()) == []
    # the fix it names works
    fixed = [*FEW_HUGE[2:], "--max-doc-bytes", "4096"]
    rc, err = _data_prep(["--source", str(few_huge), "--out", str(out), *fixed], capsys)
    assert rc == 0, err
    assert len(ShardDataset(out, "valid")) > 0 and len(ShardDataset(out, "train")) > 0


def test_d_data_prep_refuses_an_empty_train_split(tiny_corpus, tmp_path, capsys):
    """One small document: whichever split it lands in (by seed), the other is empty."""
    from data_prep.__main__ import main as data_prep_main

    _big_file(tmp_path / "doc.txt", 1000)
    out = tmp_path / "out"
    refusals = set()
    for seed in range(8):
        rc = data_prep_main(["--source", str(tmp_path / "doc.txt"), "--out", str(out), "--quiet",
                             "--seq-len", "32", "--workers", "0", "--valid-fraction", "0.9",
                             "--seed", str(seed), "--tokenizer",
                             str(tiny_corpus / "tokenizer.model")])  # fmt: skip
        err = capsys.readouterr().err.strip()
        assert rc == 2 and len(err.splitlines()) == 1 and tree(out) == {}, err
        refusals.add(err)
    assert refusals == {  # (seeds 0-7: the document lands in each split at least once)
        "data_prep: error: the train split would be empty: 1 document (1.0 KiB each on average) "
        "at --valid-fraction 0.9 put none in train; rerun data_prep with a lower "
        "--valid-fraction (e.g. 0.01) or on a corpus with more documents",
        "data_prep: error: the valid split would be empty: 1 document (1.0 KiB each on average) "
        "at --valid-fraction 0.9 put none in valid; rerun data_prep on a corpus with more "
        "documents (or with --valid-fraction 0 and train.eval_interval=0: no evaluation)",
    }


def test_d_trainer_names_the_same_fix(few_huge, tiny_corpus, tmp_path, capsys):
    """An output with an empty valid split (made before data_prep refused them): the trainer's
    message names the fix data_prep names, from the manifest's counts."""
    data = tmp_path / "data"
    shutil.copytree(tiny_corpus, data)
    m = json.loads((data / "manifest.json").read_text())
    m["source"].update(documents=4, empty_documents=0, bytes=800_000, max_doc_bytes=204800)
    m["split"]["valid_fraction"] = 0.1
    m["splits"]["valid"].update(rows=0, shards=[])
    (data / "manifest.json").write_text(json.dumps(m))
    run = tmp_path / "run"
    err = one_line_exit_2(_argv(data, run, "train.eval_interval=2"), capsys, [data, run])
    fix = empty_split_fix("valid", 4, 800_000, 204800, 0.1)
    assert f"split 'valid' is empty (0 rows): {fix}" in err, err
    assert "--max-doc-bytes 4096" in fix and "--valid-fraction" not in fix.split(";")[1]


def test_d_ranks_refuse_an_empty_split_alike(few_huge, tmp_path):
    """data_prep under srun (2 ranks as threads, srun's file transport): rank 0 says the same
    line as one process, the other rank exits quietly, and no output is left."""
    import threading

    from data_prep import DataPrepError, PrepConfig
    from data_prep.distributed import World
    from data_prep.parallel import Quiet, prepare_distributed

    out = tmp_path / "out"
    kw = dict(sources=[str(few_huge)], out=str(out), seq_len=32, vocab_size=200, workers=0,
              progress=False, max_doc_bytes=204800, valid_fraction=0.1, seed=3,
              rank_timeout=60.0)  # fmt: skip
    errors: dict[int, BaseException] = {}

    def rank(r: int) -> None:
        try:
            prepare_distributed(PrepConfig(**kw), World("slurm", r, 2, "empty"))
        except BaseException as e:  # noqa: BLE001 - checked below
            errors[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert type(errors[0]) is DataPrepError and isinstance(errors[1], Quiet), errors
    assert str(errors[0]).startswith("the valid split would be empty: 4 documents "), errors[0]
    assert "rerun data_prep with --max-doc-bytes 4096" in str(errors[0])
    assert not out.exists() and tree(out) == {k: v for k, v in tree(out).items() if "sync" in k}


# ============================================== e. a large JSON-lines file is many work units
def _jsonl_corpus(root: Path) -> list[str]:
    """Two JSON-lines files of about 40 KB (records of 1-60 words, blank lines, the last line
    without a newline) and a small text file; returns the --source specs."""
    rng = random.Random(5)
    letters = "etaoinshrdlucmfwyp"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 8))) for _ in range(800)]
    root.mkdir(parents=True, exist_ok=True)
    for name in ("a.jsonl", "b.jsonl"):
        lines = []
        while sum(map(len, lines)) < 40_000:
            text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 60)))
            lines.append(json.dumps({"text": text, "id": len(lines)}) + "\n")
            if rng.random() < 0.05:
                lines.append("\n")
        (root / name).write_text("".join(lines).rstrip("\n"))
    (root / "c.txt").write_text("a small plain text file\nof two lines\n")
    return [str(root / "a.jsonl"), str(root / "b.jsonl"), str(root / "c.txt")]


def test_e_units_of_large_jsonl_files_are_line_ranges(tmp_path):
    """Read unit by unit, the documents and byte counts are those of one sequential read for
    any unit size; the ranges of a file cover it exactly, each starting at a line start."""
    from data_prep.files import FileRange
    from data_prep.parallel import assign, make_units
    from data_prep.sources import Source

    specs = _jsonl_corpus(tmp_path / "c")
    whole = Source(specs)
    docs = list(whole)
    for unit_bytes in (1, 97, 1000, 4096, 39_000, 10**6):
        src = Source(specs)
        units = make_units(src, unit_bytes)
        assert [d for u in units for d in src.read(u.spec, u.part)] == docs, unit_bytes
        assert src.stats.bytes == whole.stats.bytes and src.stats.documents == len(docs)
        for spec in specs[:2]:
            data = Path(spec).read_bytes()
            ranges = [r for u in units for r in u.part if isinstance(r, FileRange)
                      and r.path == spec]  # fmt: skip
            if unit_bytes >= len(data):
                assert ranges == []
                continue
            assert ranges[0].start == 0 and ranges[-1].end == len(data)
            assert all(a.end == b.start for a, b in zip(ranges, ranges[1:]))
            assert all(data[r.start - 1 : r.start] == b"\n" for r in ranges[1:])
    units = make_units(Source(specs), 4096)
    assert len(units) >= 20
    assert all(assign([(u.index, u.size) for u in units], 3))  # every rank has work


def _ranks_equal_one_process(tmp_path: Path, specs: list[str], ranks: int, more: dict,
                             min_units: int) -> None:  # fmt: skip
    """data_prep of ``specs`` on ``ranks`` ranks (srun's transport, threads), 8 KiB units
    (at least ``min_units``, work for every rank), writes the files of one process."""
    from data_prep import PrepConfig, prepare
    from data_prep.parallel import assign, make_units
    from data_prep.sources import Source

    kw = dict(sources=specs, seq_len=32, vocab_size=200, workers=0, progress=False,
              valid_fraction=0.2, shard_rows=20, **more)  # fmt: skip
    prepare(PrepConfig(out=str(tmp_path / "one"), **kw))
    units = make_units(Source(specs, max_doc_bytes=kw.get("max_doc_bytes", 8 << 20)), 8192)
    assert len(units) >= min_units and all(assign([(u.index, u.size) for u in units], ranks))
    many = dict(out=str(tmp_path / "many"), unit_bytes=8192, rank_timeout=60.0, **kw)
    run_ranks_in_threads(many, ranks, "ranges", timeout=300)

    def files(out: Path) -> dict[str, str]:
        got = {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
               for p in sorted(out.rglob("*")) if p.is_file()}  # fmt: skip
        m = json.loads((out / "manifest.json").read_text())
        m["tokenizer"]["trained"].pop("seconds")
        got["manifest.json"] = json.dumps(m, sort_keys=True)
        return got

    assert files(tmp_path / "many") == files(tmp_path / "one")


def test_e_ranks_write_the_bytes_of_one_process_on_a_few_large_files(tmp_path):
    """A corpus of two large JSON-lines files on 3 ranks (srun's transport, threads), 8 KiB
    units: ~10 units, every rank tokenizes, and the output equals one process's."""
    _ranks_equal_one_process(tmp_path, _jsonl_corpus(tmp_path / "c"), 3, {}, min_units=9)


# ================================ e. large plain-text, CSV and Parquet files are many work units
def _mixed_corpus(root: Path) -> list[str]:
    """A plain-text file of about 60 KB (lines of words, CRLF and LF ends, a few undecodable
    bytes, no final newline), a CSV of about 40 KB (a BOM, quoted fields holding newlines,
    commas and doubled quotes, a literal quote in an unquoted field, blank lines, short rows,
    CRLF rows), a TSV, and a Parquet file of 12 row groups; returns the --source specs."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(7)
    letters = "etaoinshrdlucmfwyp"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 8))) for _ in range(600)]

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choice(words) for _ in range(rng.randint(lo, hi)))

    root.mkdir(parents=True, exist_ok=True)
    raw = b""
    while len(raw) < 60_000:
        raw += text(1, 30).encode() + rng.choice([b"\n", b"\r\n", b"\n\n", b" \xff\n"])
    (root / "big.txt").write_bytes(raw.rstrip(b"\n"))

    def table(delim: str, bom: bool) -> bytes:
        rows = [f"id{delim}text{delim}more"]
        while sum(map(len, rows)) < 40_000:
            t = text(1, 40)
            kind = rng.random()
            if kind < 0.2:
                t = f'"{t}\n{text(1, 5)}\r\n{delim} ""{text(1, 3)}"""'  # quoted: newlines
            elif kind < 0.25:
                t = f'{t} 5" tall'  # a literal quote in an unquoted field
            elif kind < 0.3:
                rows.append("")  # a blank line (DictReader skips it)
            elif kind < 0.33:
                rows.append(f"{len(rows)}")  # a short row: no text (None)
                continue
            rows.append(f"{len(rows)}{delim}{t}{delim}x")
        body = "".join(r + rng.choice(["\n", "\r\n"]) for r in rows)
        return (b"\xef\xbb\xbf" if bom else b"") + body.encode()

    (root / "big.csv").write_bytes(table(",", True))
    (root / "big.tsv").write_bytes(table("\t", False))
    texts = [text(1, 50) for _ in range(600)]
    pq.write_table(pa.table({"n": list(range(600)), "text": texts}), root / "big.parquet",
                   row_group_size=50)  # fmt: skip
    return [str(root / f"big.{s}") for s in ("txt", "csv", "tsv", "parquet")]


MIXED_MAX_DOC = 4096  # the plain-text file: ~15 documents of about 4 KiB


def test_e_units_of_large_text_csv_and_parquet_files(tmp_path):
    """Read unit by unit, the documents, byte, file and undecodable-byte counts are those of
    one sequential read for any unit size; text files are cut at the ends of their documents,
    CSV/TSV at row ends (never inside a quoted field), Parquet at row groups."""
    from data_prep.files import FileRange, RowGroups, csv_row_ends
    from data_prep.parallel import assign, make_units
    from data_prep.sources import Source

    specs = _mixed_corpus(tmp_path / "c")
    whole = Source(specs, max_doc_bytes=MIXED_MAX_DOC)
    docs = list(whole)
    assert whole.stats.undecodable_bytes > 0 and any("\n" in d for d in docs[-700:-600])
    for unit_bytes in (1, 97, 1000, 4096, 9000, 10**6):
        src = Source(specs, max_doc_bytes=MIXED_MAX_DOC)
        units = make_units(src, unit_bytes)
        assert [d for u in units for d in src.read(u.spec, u.part)] == docs, unit_bytes
        for key in ("bytes", "documents", "files", "undecodable_bytes"):
            assert getattr(src.stats, key) == getattr(whole.stats, key), (unit_bytes, key)
        for spec in specs:
            parts = [r for u in units for r in u.part if not isinstance(r, str)
                     and r.path == spec]  # fmt: skip
            if unit_bytes >= os.path.getsize(spec):
                assert parts == [], (unit_bytes, spec)
                continue
            assert len(parts) > 1 and parts[0].start == 0, (unit_bytes, spec)
            assert all(a.end == b.start for a, b in zip(parts, parts[1:]))
            if spec.endswith(".parquet"):
                assert all(isinstance(r, RowGroups) for r in parts) and parts[-1].end == 12
                assert sum(r.nbytes for r in parts) == os.path.getsize(spec)
                continue
            assert all(isinstance(r, FileRange) for r in parts)
            assert parts[-1].end == os.path.getsize(spec)
            if spec.endswith((".csv", ".tsv")):
                ends = set(csv_row_ends(spec, "," if spec.endswith(".csv") else "\t"))
                assert all(r.start in ends for r in parts[1:]), (unit_bytes, spec)
    units = make_units(Source(specs, max_doc_bytes=MIXED_MAX_DOC), 4096)
    assert len(units) >= 30
    assert all(assign([(u.index, u.size) for u in units], 3))  # every rank has work


def test_e_csv_cut_is_never_inside_a_quoted_field(tmp_path, monkeypatch):
    """A CSV whose every row holds a quoted field with newlines that look like rows: the cuts
    are row ends only (a cut at a line start inside the field would read other rows); a quote
    left open takes the rest of the file into its row, cut or not; a file the csv module
    refuses (here: a field over its size limit), and a CSV in another encoding, stay one unit."""
    from data_prep.files import file_parts, read_files
    from data_prep.sources import Source

    def same_docs(path: Path, unit_bytes: int) -> int:
        src = Source([str(path)])
        parts = file_parts(src, str(path), path.stat().st_size, unit_bytes)
        assert parts is not None
        assert list(read_files(src, parts)) == list(Source([str(path)]))
        return len(parts)

    rows = ["text,n"] + [f'"row {i}\n{i},fake row\n",{i}' for i in range(400)]
    path = tmp_path / "q.csv"
    path.write_text("\n".join(rows) + "\n")
    assert same_docs(path, 500) > 10
    open_quote = tmp_path / "open.csv"
    open_quote.write_text("text\n" + "a\n" * 300 + '"unterminated\n' + "b\n" * 100)
    assert same_docs(open_quote, 100) > 3
    latin = Source([str(path)], encoding="latin-1")
    assert file_parts(latin, str(path), path.stat().st_size, 500) is None
    real = csv.field_size_limit
    monkeypatch.setattr(csv, "field_size_limit", lambda n=None: real(8))
    try:
        assert file_parts(Source([str(path)]), str(path), path.stat().st_size, 500) is None
    finally:
        real(2**31 - 1)


def test_e_a_registered_format_with_parts_is_cut_like_the_built_ins(tmp_path, monkeypatch):
    """A format added with register_file_format: one unit per file; given parts/read_part (here
    one document per line, cut at line starts), a large file is cut and read unit by unit into
    the documents and byte counts of one sequential read, for any unit size. parts without
    read_part is refused."""
    from data_prep import files
    from data_prep.parallel import make_units
    from data_prep.sources import Source

    monkeypatch.setattr(files, "_FORMATS", list(files._FORMATS))  # registrations end with it

    def read_range(src, path, start=0, end=None):
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read() if end is None else f.read(end - start)
        src.stats.bytes += len(data)
        yield from (line.decode() for line in data.splitlines() if line.strip())

    path = tmp_path / "big.lines"
    rng = random.Random(3)
    path.write_text("".join(f"line {i} " + "x" * rng.randint(0, 90) + "\n" for i in range(900)))
    files.register_file_format((".LINES",), read_range)
    whole = Source([str(path)])
    docs = list(whole)
    assert len(docs) == 900 and docs[7].startswith("line 7 ")
    assert len(make_units(Source([str(path)]), 1000)) == 1  # no parts: one unit
    with pytest.raises(ValueError, match="both parts and read_part"):
        files.register_file_format((".lines",), read_range, parts=lambda *a: None)
    files.register_file_format(
        (".lines",), read_range,
        parts=lambda src, p, size, unit: files.line_ranges(p, size, unit),
        read_part=lambda src, part: read_range(src, part.path, part.start, part.end),
    )  # fmt: skip
    for unit_bytes in (1, 500, 4096, 10**6):
        src = Source([str(path)])
        units = make_units(src, unit_bytes)
        size = path.stat().st_size
        cut = len(files.line_ranges(str(path), size, unit_bytes))
        assert len(units) == (1 if unit_bytes >= size else cut) and (unit_bytes > 4096 or cut > 10)
        assert [d for u in units for d in src.read(u.spec, u.part)] == docs, unit_bytes
        assert (src.stats.bytes, src.stats.files) == (whole.stats.bytes, 1), unit_bytes


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_e_ranks_write_the_bytes_of_one_process_on_large_text_csv_parquet(tmp_path, ranks):
    """The mixed corpus (one large file of each format) on 1, 2 and 3 ranks (srun's transport,
    threads), 8 KiB units: every rank tokenizes, and the output equals one process's."""
    _ranks_equal_one_process(tmp_path, _mixed_corpus(tmp_path / "c"), ranks,
                             {"max_doc_bytes": MIXED_MAX_DOC}, min_units=15)  # fmt: skip
