"""data_prep: text -> tokenizer -> packed shards, checked against SentencePiece run directly.

Every run here uses a small generated corpus (plus a few stdlib files) and a small vocabulary.
"""

import csv
import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

import data_prep.packing as pk
import data_prep.shards as shards_mod
from data_prep import DataPrepError, PrepConfig, prepare
from data_prep.packing import assign_split
from data_prep.sources import Source, stdlib_files
from data_prep.tokenizer import CLS_ID, MASK_ID, PAD_ID, SEP_ID

REPO = Path(__file__).resolve().parents[1]
N = 32
VOCAB = 120
WORDS = (
    "alpha beta gamma delta epsilon linformer encoder attention projection sequence token "
    "shard manifest rank epoch sampler checkpoint gradient tensor matrix vector layer head "
    "value key query softmax dropout residual norm batch corpus document the a of to and in"
).split()


def make_docs(n: int = 40, seed: int = 0) -> list[str]:
    """Deterministic pseudo-text documents of varied length (some far longer than N tokens)."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        lines = []
        for _ in range(rng.choice([1, 2, 3, 8, 20])):
            words = [rng.choice(WORDS) for _ in range(rng.randint(1, 14))]
            if rng.random() < 0.2:
                words.append(str(rng.randint(0, 99999)))
            lines.append(" ".join(words) + rng.choice([".", ",", ":", "()", ""]))
            if rng.random() < 0.2:
                lines.append("")  # blank lines are dropped by the encoder
        docs.append(f"doc {i}\n" + "\n".join(lines) + "\n")
    return docs


def write_text_corpus(directory: Path, docs: list[str]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(docs):
        (directory / f"doc_{i:04d}.txt").write_text(doc)
    return directory


def run(tmp: Path, name: str, sources: list[str], **kw) -> dict:
    kw.setdefault("seq_len", N)
    if "tokenizer" not in kw:
        kw.setdefault("vocab_size", VOCAB)
    kw.setdefault("workers", 0)
    kw.setdefault("progress", False)
    kw.setdefault("valid_fraction", 0.2)
    return prepare(PrepConfig(sources=sources, out=str(tmp / name), **kw)).manifest


def encode_doc(sp: spm.SentencePieceProcessor, text: str) -> list[int]:
    """The reference: SentencePiece on each non-blank line, ids concatenated."""
    out: list[int] = []
    for line in text.split("\n"):
        if line.strip():
            out.extend(sp.encode(line))
    return out


def load_rows(out: Path, manifest: dict, split: str) -> np.ndarray:
    arrays = [np.load(out / s["file"], mmap_mode="r") for s in manifest["splits"][split]["shards"]]
    return np.concatenate(arrays) if arrays else np.zeros((0, manifest["seq_len"]), np.uint16)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def shard_hashes(out: Path, manifest: dict) -> dict[str, list[str]]:
    return {
        s: [sha256(out / sh["file"]) for sh in manifest["splits"][s]["shards"]]
        for s in ("train", "valid")
    }


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """Generated documents as text files, plus a tokenizer trained by data_prep on them."""
    tmp = tmp_path_factory.mktemp("corpus")
    docs = make_docs()
    docs.append("   \n\n")  # an empty document: produces nothing
    text_dir = write_text_corpus(tmp / "text", docs)
    manifest = run(tmp, "ref", [str(text_dir)], shard_rows=7)
    return {
        "tmp": tmp,
        "docs": docs,
        "dir": text_dir,
        "ref": tmp / "ref",
        "manifest": manifest,
        "model": str(tmp / "ref" / "tokenizer.model"),
    }


# ------------------------------------------------------------------------- round trips
def test_full_packing_round_trip(corpus):
    out, m = corpus["ref"], corpus["manifest"]
    sp = spm.SentencePieceProcessor(model_file=corpus["model"])
    assert [sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()] == [0, 1, 2, 3]
    assert sp.piece_to_id("<mask>") == MASK_ID and sp.is_control(MASK_ID)
    assert MASK_ID not in sp.encode("a literal <mask> in text")
    expected = {"train": [], "valid": []}
    for doc in corpus["docs"]:
        ids = encode_doc(sp, doc)
        if ids:
            expected[assign_split(doc, 0.2, 0)].append(ids)
    assert expected["train"] and expected["valid"]
    for split, docs in expected.items():
        rows = load_rows(out, m, split)
        assert rows.dtype == np.uint16 and rows.shape[1] == N
        assert (rows[:, 0] == CLS_ID).all()
        stream = rows[:, 1:].reshape(-1).tolist()
        n_pad = m["splits"][split]["tokens"]["pad"]
        assert n_pad < N - 1 and all(t == PAD_ID for t in stream[len(stream) - n_pad :])
        assert PAD_ID not in stream[: len(stream) - n_pad]
        want = [t for ids in docs for t in ids + [SEP_ID]]
        assert stream[: len(stream) - n_pad] == want
        info = m["splits"][split]
        content = sum(len(d) for d in docs)
        assert info["documents"] == len(docs)
        assert info["rows"] == len(rows) == -(-len(want) // (N - 1))
        assert info["tokens"] == {
            "content": content,
            "special": len(rows) + len(docs),
            "pad": n_pad,
            "total": len(rows) * N,
        }
        assert info["padding_fraction"] == pytest.approx(n_pad / (len(rows) * N))
    assert m["source"]["documents"] == len(corpus["docs"])
    assert m["source"]["empty_documents"] == 1


def test_pad_packing_round_trip(corpus, tmp_path):
    m = run(tmp_path, "pad", [str(corpus["dir"])], tokenizer=corpus["model"], packing="pad")
    sp = spm.SentencePieceProcessor(model_file=corpus["model"])
    for split in ("train", "valid"):
        want = []
        for doc in corpus["docs"]:
            ids = encode_doc(sp, doc)
            if not ids or assign_split(doc, 0.2, 0) != split:
                continue
            for start in range(0, len(ids), N - 2):
                chunk = ids[start : start + N - 2]
                want.append([CLS_ID] + chunk + [SEP_ID] + [PAD_ID] * (N - 2 - len(chunk)))
        rows = load_rows(tmp_path / "pad", m, split)
        assert rows.tolist() == want
        pad = int((rows == PAD_ID).sum())
        assert m["splits"][split]["tokens"]["pad"] == pad
        assert m["splits"][split]["padding_fraction"] == pytest.approx(pad / rows.size)
    assert m["packing"] == "pad" and m["splits"]["train"]["padding_fraction"] > 0.05


def test_manifest_and_checksums(corpus):
    out, m = corpus["ref"], corpus["manifest"]
    assert m["format_version"] == 1 and m["seq_len"] == N and m["vocab_size"] == VOCAB
    assert m["dtype"] == "uint16"
    assert m["special_ids"] == {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
    assert m["tokenizer"]["sha256"] == sha256(out / "tokenizer.model")
    assert m["tokenizer"]["model_type"] == "unigram" and m["tokenizer"]["vocab_size"] == VOCAB
    assert m["source"]["items"][0]["files"] == len(corpus["docs"])
    assert m["source"]["bytes"] == sum(len(d.encode()) for d in corpus["docs"])
    assert json.loads((out / "manifest.json").read_text()) == m
    assert not (out / "progress.json").exists()
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    listed = [s["file"] for sp in ("train", "valid") for s in m["splits"][sp]["shards"]]
    assert files == sorted(listed + ["manifest.json", "tokenizer.model", m["unigram"]["file"]])
    train = m["splits"]["train"]["shards"]
    # the context meter's counts: the train shards' tokens without the special ids
    want = sum(np.bincount(np.load(out / s["file"]).ravel(), minlength=VOCAB) for s in train)
    want[[0, 1, 2, 3, 4]] = 0
    assert np.load(out / m["unigram"]["file"]).tolist() == want.tolist()
    assert m["unigram"]["sha256"] == sha256(out / m["unigram"]["file"])
    assert m["unigram"]["split"] == "train" and m["unigram"]["tokens"] == int(want.sum())
    assert m["unigram"]["excluded_ids"] == [0, 1, 2, 3, 4]
    assert len(train) > 2 and all(s["rows"] == 7 for s in train[:-1]) and train[-1]["rows"] <= 7
    for split in ("train", "valid"):
        for i, s in enumerate(m["splits"][split]["shards"]):
            assert s["file"] == f"{split}/shard_{i:05d}.npy"
            assert s["sha256"] == sha256(out / s["file"])
            arr = np.load(out / s["file"], mmap_mode="r")
            assert isinstance(arr, np.memmap) and arr.shape == (s["rows"], N)


def test_workers_and_task_size_do_not_change_output(corpus, tmp_path):
    """2 worker processes with tiny tasks give a byte-identical tokenizer and shards."""
    m = run(
        tmp_path,
        "w2",
        [str(corpus["dir"])],
        shard_rows=7,
        workers=2,
        task_bytes=300,
    )
    assert shard_hashes(tmp_path / "w2", m) == shard_hashes(corpus["ref"], corpus["manifest"])
    assert m["splits"] == corpus["manifest"]["splits"]
    assert m["tokenizer"] == corpus["manifest"]["tokenizer"] | {
        "trained": m["tokenizer"]["trained"]
    }
    assert sha256(tmp_path / "w2" / "tokenizer.model") == m["tokenizer"]["sha256"]


def test_structured_formats_match_text_files(corpus, tmp_path):
    """jsonl, csv, tsv and parquet records give the same shards as one text file per document."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = corpus["docs"]
    d = tmp_path / "in"
    d.mkdir()
    with open(d / "a.jsonl", "w") as f:
        for doc in docs[:10]:
            f.write(json.dumps({"id": 1, "body": doc}) + "\n")
    with open(d / "b.csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["body", "n"])
        w.writeheader()
        w.writerows({"body": doc, "n": 1} for doc in docs[10:20])
    with open(d / "c.tsv", "w", newline="") as f:
        w = csv.DictWriter(f, ["body"], delimiter="\t")
        w.writeheader()
        w.writerows({"body": doc} for doc in docs[20:30])
    pq.write_table(pa.table({"body": docs[30:]}), d / "d.parquet")
    m = run(tmp_path, "fmt", [str(d)], tokenizer=corpus["model"], shard_rows=7, text_column="body")
    assert shard_hashes(tmp_path / "fmt", m) == shard_hashes(corpus["ref"], corpus["manifest"])
    # A glob and several sources in order: the same again.
    m2 = run(
        tmp_path,
        "glob",
        [str(d / "a.*"), str(d / "b.csv"), str(d / "[cd].*")],
        tokenizer=corpus["model"],
        shard_rows=7,
        text_column="body",
    )
    assert shard_hashes(tmp_path / "glob", m2) == shard_hashes(corpus["ref"], corpus["manifest"])


def test_bpe_tokenizer(corpus, tmp_path):
    m = run(tmp_path, "bpe", [str(corpus["dir"])], model_type="bpe", valid_fraction=0.0)
    assert m["tokenizer"]["model_type"] == "bpe" and m["vocab_size"] == VOCAB
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "bpe" / "tokenizer.model"))
    assert sp.piece_to_id("<mask>") == MASK_ID and sp.bos_id() == CLS_ID
    want = [
        t for doc in corpus["docs"] if encode_doc(sp, doc) for t in encode_doc(sp, doc) + [SEP_ID]
    ]
    rows = load_rows(tmp_path / "bpe", m, "train")
    assert rows[:, 1:].reshape(-1)[: len(want)].tolist() == want


def test_large_text_file_is_cut_at_lines(tmp_path):
    lines = [f"line {i} " + "x" * (i % 17) for i in range(400)]
    path = tmp_path / "big.txt"
    path.write_text("\n".join(lines) + "\n")
    src = Source([str(path)], max_doc_bytes=1000)
    docs = list(src)
    assert len(docs) > 3 and all(len(doc.encode()) < 1000 + 40 for doc in docs)
    assert "".join(docs) == path.read_text()
    assert src.stats.bytes == path.stat().st_size and src.stats.documents == len(docs)


def test_limits_max_docs_and_max_bytes(corpus, tmp_path):
    few = dict(tokenizer=corpus["model"], valid_fraction=0.0)  # too few documents for a valid split
    m = run(tmp_path, "md", [str(corpus["dir"])], max_docs=5, **few)
    assert m["source"]["documents"] == 5
    sizes = [len(d.encode()) for d in corpus["docs"]]
    m = run(tmp_path, "mb", [str(corpus["dir"])], max_bytes=sizes[0] + 1, **few)
    assert m["source"]["documents"] == 2 and m["source"]["bytes"] == sizes[0] + sizes[1]


def test_stdlib_source():
    files = stdlib_files()
    assert len(files) > 500 and files == sorted(files)
    assert all(f.endswith(".py") for f in files)
    assert not any("site-packages" in f or "dist-packages" in f for f in files)
    import sysconfig

    assert all(f.startswith(sysconfig.get_paths()["stdlib"]) for f in files)


def test_cli_stdlib_with_two_workers(tmp_path):
    out = tmp_path / "std"
    cmd = [
        sys.executable,
        "-m",
        "data_prep",
        "--source",
        "stdlib",
        "--out",
        str(out),
        "--seq-len",
        "64",
        "--vocab-size",
        "400",
        "--max-docs",
        "12",
        "--workers",
        "2",
        "--valid-fraction",
        "0.3",
    ]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "tokens/s" in r.stderr
    m = json.loads((out / "manifest.json").read_text())
    assert m["source"]["items"][0]["kind"] == "stdlib" and m["source"]["documents"] == 12
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    texts = [Path(f).read_bytes().decode("utf-8", "replace") for f in stdlib_files()[:12]]
    content = sum(len(encode_doc(sp, t)) for t in texts)
    assert sum(m["splits"][s]["tokens"]["content"] for s in ("train", "valid")) == content
    r2 = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r2.returncode == 2 and "already holds a finished data_prep output" in r2.stderr
    r3 = subprocess.run(cmd + ["--resume", "--overwrite"], cwd=REPO, capture_output=True, text=True)
    assert r3.returncode == 2 and "exclude each other" in r3.stderr


# ------------------------------------------------------------------------------ resume
def _interrupt_on_call(monkeypatch, module, name, n):
    real = getattr(module, name)
    calls = {"n": 0}

    def wrapper(*a, **k):
        calls["n"] += 1
        if calls["n"] == n:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(module, name, wrapper)


@pytest.mark.parametrize("where", ["between_tasks", "after_shard_rename"])
def test_interrupted_run_resumes_to_identical_output(corpus, tmp_path, monkeypatch, where):
    kw = dict(tokenizer=corpus["model"], shard_rows=7, task_bytes=400)
    if where == "between_tasks":  # a clean interrupt; checkpoints after every task
        _interrupt_on_call(monkeypatch, pk, "encode_task", 9)
        kw["checkpoint_seconds"] = 0.0
    else:  # a crash after a shard was renamed but before any checkpoint recorded it
        _interrupt_on_call(monkeypatch, shards_mod.ShardWriter, "read_back", 3)
        kw["checkpoint_seconds"] = 1e9
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, "r", [str(corpus["dir"])], **kw)
    out = tmp_path / "r"
    work = tmp_path / ".r.data_prep-partial"  # the run's work until it is complete
    assert not out.exists()  # --out appears only whole
    progress = json.loads((work / "progress.json").read_text())
    done = progress["writers"]["train"]["shards"]
    if where == "between_tasks":
        assert progress["counters"]["documents_read"] > 0 and len(done) >= 1
    complete = sorted(p.name for p in (work / "train").glob("*.npy"))
    assert complete[: len(done)] == [Path(s["file"]).name for s in done]
    for s in done:  # finished shards are complete
        assert sha256(work / s["file"]) == s["sha256"]
    monkeypatch.undo()
    with pytest.raises(DataPrepError, match="interrupted data_prep run"):
        run(tmp_path, "r", [str(corpus["dir"])], **kw)
    with pytest.raises(DataPrepError, match="different options"):
        run(tmp_path, "r", [str(corpus["dir"])], resume=True, **{**kw, "seed": 1})
    m = run(tmp_path, "r", [str(corpus["dir"])], resume=True, **kw)
    assert shard_hashes(out, m) == shard_hashes(corpus["ref"], corpus["manifest"])
    assert m["splits"] == corpus["manifest"]["splits"]
    assert m["source"]["documents"] == corpus["manifest"]["source"]["documents"]
    assert m["source"]["bytes"] == corpus["manifest"]["source"]["bytes"]
    assert not (out / "progress.json").exists()
    assert not list(out.rglob("*.partial"))
    assert not work.exists()


def test_interrupted_tokenizer_training_resumes(corpus, tmp_path, monkeypatch):
    import data_prep.steps as steps

    _interrupt_on_call(monkeypatch, steps, "train_tokenizer", 1)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, "t", [str(corpus["dir"])], shard_rows=7)
    assert (tmp_path / ".t.data_prep-partial" / "progress.json").exists()
    assert not (tmp_path / "t").exists()
    monkeypatch.undo()
    m = run(tmp_path, "t", [str(corpus["dir"])], shard_rows=7, resume=True)
    assert m["tokenizer"]["sha256"] == corpus["manifest"]["tokenizer"]["sha256"]
    assert shard_hashes(tmp_path / "t", m) == shard_hashes(corpus["ref"], corpus["manifest"])


# --------------------------------------------------------------------------- bad input
def test_existing_output_directory(corpus, tmp_path):
    src = [str(corpus["dir"])]
    run(tmp_path, "o", src, tokenizer=corpus["model"])
    with pytest.raises(DataPrepError, match="already holds a finished data_prep output"):
        run(tmp_path, "o", src, tokenizer=corpus["model"])
    with pytest.raises(DataPrepError, match="nothing to resume"):
        run(tmp_path, "o", src, tokenizer=corpus["model"], resume=True)
    m = run(tmp_path, "o", src, tokenizer=corpus["model"], overwrite=True, valid_fraction=0.0)
    assert m["splits"]["valid"]["rows"] == 0
    other = tmp_path / "other"
    other.mkdir()
    (other / "precious.txt").write_text("keep me")
    with pytest.raises(DataPrepError, match="exists and is not empty"):
        run(tmp_path, "other", src, tokenizer=corpus["model"])
    with pytest.raises(DataPrepError, match="refusing to --overwrite"):
        run(tmp_path, "other", src, tokenizer=corpus["model"], overwrite=True)
    assert (other / "precious.txt").read_text() == "keep me"
    with pytest.raises(DataPrepError, match="holds no interrupted run"):
        run(tmp_path, "fresh", src, tokenizer=corpus["model"], resume=True)


def test_missing_path_and_empty_glob(tmp_path):
    with pytest.raises(DataPrepError, match="input path does not exist: .*nope"):
        run(tmp_path, "x", [str(tmp_path / "nope")])
    with pytest.raises(DataPrepError, match="matches no files"):
        run(tmp_path, "x", [str(tmp_path / "*.zzz")])
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(DataPrepError, match="contains no files"):
        run(tmp_path, "x", [str(tmp_path / "emptydir")])
    assert not (tmp_path / "x").exists()


def test_empty_corpus(corpus, tmp_path):
    d = tmp_path / "blank"
    d.mkdir()
    (d / "a.txt").write_text("\n   \n\t\n")
    (d / "b.txt").write_text("")
    with pytest.raises(DataPrepError, match="corpus is empty"):
        run(tmp_path, "e1", [str(d)])
    with pytest.raises(DataPrepError, match="corpus is empty"):
        run(tmp_path, "e2", [str(d)], tokenizer=corpus["model"])
    assert not (tmp_path / "e1").exists() and not (tmp_path / "e2").exists()


def test_undecodable_bytes_are_replaced_and_counted(corpus, tmp_path):
    d = tmp_path / "bad"
    d.mkdir()
    raw = b"alpha beta \xff\xfe gamma\nkey \xc3( value\nquery\x80\n"
    (d / "a.txt").write_bytes(raw)
    (d / "b.txt").write_text("alpha beta gamma\n")
    with open(d / "c.csv", "wb") as f:
        f.write(b"text\nalpha \xff beta\n")
    m = run(tmp_path, "u", [str(d)], tokenizer=corpus["model"], valid_fraction=0.0)
    assert m["source"]["undecodable_bytes"] == 5
    sp = spm.SentencePieceProcessor(model_file=corpus["model"])
    text = raw.decode("utf-8", "surrogateescape")
    for c in "\udcff\udcfe\udcc3\udc80":
        text = text.replace(c, "\ufffd")
    assert text == "alpha beta \ufffd\ufffd gamma\nkey \ufffd( value\nquery\ufffd\n"
    want = encode_doc(sp, text) + [SEP_ID]
    want += encode_doc(sp, "alpha beta gamma\n") + [SEP_ID]
    want += encode_doc(sp, "alpha \ufffd beta") + [SEP_ID]
    row = load_rows(tmp_path / "u", m, "train")[0]
    assert row[1 : 1 + len(want)].tolist() == want


def test_vocab_too_large_for_corpus(tmp_path):
    d = write_text_corpus(tmp_path / "tiny", ["alpha beta\n", "gamma delta\n"])
    with pytest.raises(DataPrepError, match="--vocab-size 5000 is too large for this corpus"):
        run(tmp_path, "v", [str(d)], vocab_size=5000)
    assert not (tmp_path / "v").exists()


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(seq_len=4), "--seq-len 4 is too small"),
        (dict(vocab_size=5), "--vocab-size 5 is too small"),
        (dict(vocab_size=None), "--vocab-size is required"),
        (dict(packing="zip"), "--packing must be one of"),
        (dict(valid_fraction=1.0), "--valid-fraction"),
        (dict(shard_rows=0), "--shard-rows must be >= 1"),
        (dict(model_type="wordpiece"), "--model-type"),
    ],
)
def test_bad_options(corpus, tmp_path, kw, msg):
    with pytest.raises(DataPrepError, match=msg):
        run(tmp_path, "b", [str(corpus["dir"])], **kw)
    assert not (tmp_path / "b").exists()


def test_tokenizer_with_wrong_special_ids(corpus, tmp_path):
    prefix = str(tmp_path / "plain")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus["docs"][0].split("\n") * 20),
        model_prefix=prefix,
        vocab_size=60,
        minloglevel=2,
    )  # SentencePiece defaults: unk=0, bos=1, eos=2, no pad, no <mask>
    with pytest.raises(DataPrepError, match="has special ids .* expected"):
        run(tmp_path, "t", [str(corpus["dir"])], tokenizer=prefix + ".model")
    with pytest.raises(DataPrepError, match="does not match --tokenizer"):
        run(tmp_path, "t", [str(corpus["dir"])], tokenizer=corpus["model"], vocab_size=VOCAB + 1)
    with pytest.raises(DataPrepError, match="--tokenizer file does not exist"):
        run(tmp_path, "t", [str(corpus["dir"])], tokenizer=str(tmp_path / "none.model"))


def test_bad_structured_records(tmp_path):
    d = tmp_path / "j"
    d.mkdir()
    (d / "a.jsonl").write_text('{"text": "alpha"}\n{"body": "beta"}\n')
    with pytest.raises(
        DataPrepError, match=r"a.jsonl:2: no text column 'text' \(columns: \['body'\]\)"
    ):
        list(Source([str(d / "a.jsonl")]))
    (d / "b.jsonl").write_text('{"text": "alpha"}\n{"text": "beta"\n')
    with pytest.raises(DataPrepError, match="b.jsonl:2: invalid JSON"):
        list(Source([str(d / "b.jsonl")]))
    (d / "c.jsonl").write_text('{"text": 7}\n')
    with pytest.raises(DataPrepError, match="holds int, not text"):
        list(Source([str(d / "c.jsonl")]))
    (d / "d.csv").write_text("a,b\n1,2\n")
    with pytest.raises(DataPrepError, match="no text column 'text'"):
        list(Source([str(d / "d.csv")]))


def test_hf_dataset_offline_is_a_clear_error(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    cmd = [
        sys.executable,
        "-m",
        "data_prep",
        "--source",
        "hf:no-such-org/no-such-corpus:cfg:train",
        "--out",
        str(tmp_path / "hf"),
        "--seq-len",
        "64",
        "--vocab-size",
        "100",
    ]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "could not load Hugging Face dataset 'no-such-org/no-such-corpus'" in r.stderr
    assert "pass local files" in r.stderr
    assert not (tmp_path / "hf").exists()


def test_hf_sources_from_local_datasets_equal_the_same_documents_as_jsonl(tmp_path, monkeypatch):
    """The ``hf:`` path through ``datasets`` with no Hub: a ``save_to_disk`` DatasetDict (split
    picked by name) and a local parquet directory (``load_dataset``) give shards bit-identical
    to the same documents read from a local .jsonl file."""
    import datasets

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    docs = make_docs(60, seed=3)
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    table = {"text": docs, "id": list(range(len(docs)))}
    saved = tmp_path / "saved"
    other = {"text": ["unused"], "id": [0]}
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict(table), "test": datasets.Dataset.from_dict(other)}
    ).save_to_disk(str(saved))
    pq = tmp_path / "pq"
    pq.mkdir()
    datasets.Dataset.from_dict(table).to_parquet(str(pq / "part-0.parquet"))

    ref = run(tmp_path, "ref", [str(jsonl)])
    got_saved = run(tmp_path, "saved_out", [f"hf:{saved}::train"])
    got_pq = run(tmp_path, "pq_out", [f"hf:{pq}"])
    for got in (got_saved, got_pq):
        assert got["tokenizer"]["sha256"] == ref["tokenizer"]["sha256"]
        for split in ("train", "valid"):
            assert got["splits"][split]["documents"] == ref["splits"][split]["documents"]
            sha = [s["sha256"] for s in got["splits"][split]["shards"]]
            assert sha == [s["sha256"] for s in ref["splits"][split]["shards"]], split
    assert ref["splits"]["train"]["documents"] + ref["splits"]["valid"]["documents"] == 60

    with pytest.raises(DataPrepError, match=r"no split 'validation' \(splits: test, train\)"):
        run(tmp_path, "bad_split", [f"hf:{saved}::validation"])
    assert not (tmp_path / "bad_split" / "manifest.json").exists()


def test_bytes_after_the_last_document_are_counted_whatever_task_bytes(corpus, tmp_path):
    """Input after the last document (blank lines, a record without text) is read and counted
    the same for any task size: the manifest's byte count is the inputs' size."""
    jsonl = tmp_path / "tail.jsonl"
    body = "".join(json.dumps({"text": d}) + "\n" for d in make_docs(5, seed=9))
    jsonl.write_text(body + "\n\n" + json.dumps({"text": None}) + "\n")
    got = [
        run(tmp_path, f"t{tb}", [str(jsonl)], tokenizer=corpus["model"], task_bytes=tb)
        for tb in (1, 1 << 20)
    ]
    assert got[0]["source"]["bytes"] == got[1]["source"]["bytes"] == jsonl.stat().st_size
    assert got[0]["splits"] == got[1]["splits"]


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"unit_bytes": 0}, "--unit-bytes must be >= 1"),
        ({"rank_timeout": 0.0}, "--rank-timeout must be > 0"),
        ({"rank_timeout": float("nan")}, "--rank-timeout must be > 0"),
    ],
)
def test_rank_options_are_checked(corpus, tmp_path, kw, message):
    with pytest.raises(DataPrepError, match=message):
        run(tmp_path, "out", [str(corpus["dir"])], tokenizer=corpus["model"], **kw)
    assert not (tmp_path / "out").exists()


def test_shard_write_past_ulimit_f_names_the_limit(corpus, tmp_path):
    """issue 21's gap: a shard write stopped by `ulimit -f` said only "File too large". It is one
    line naming the file-size limit, exit 2, and --out is not left half-written."""
    import resource

    size = Path(corpus["model"]).stat().st_size  # the tokenizer copy fits, the shards do not
    cap = size + 64 * 1024

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (cap, cap))

    out = tmp_path / "o"
    cmd = [sys.executable, "-m", "data_prep", "--source", "stdlib", "--out", str(out),
           "--seq-len", "64", "--tokenizer", corpus["model"], "--max-docs", "400",
           "--shard-rows", "100000", "--quiet"]  # fmt: skip
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                       preexec_fn=limit)  # fmt: skip
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"file-size limit (ulimit -f: {cap} bytes)" in lines[0], lines[0]
    assert not (out / "manifest.json").exists()
