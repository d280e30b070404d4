"""data_prep tokenizer training on lines longer than SentencePiece's max_sentence_length:
every byte reaches the sample, and the manifest reports what was sampled."""

import json
import random
from pathlib import Path

import sentencepiece as spm

from data_prep.pipeline import PrepConfig, prepare
from data_prep.tokenizer import MAX_SENTENCE_BYTES, sample_sentences, split_long_line

WORDS = "linformer projection sequence caf\u00e9 \u2603 token shard attention encoder".split()


def long_docs(n: int, seed: int = 0) -> list:
    """One-line documents of 5,000-20,000 characters (some multi-byte), plus short lines."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(600, 2400)))
        if i % 3 == 0:
            line = line.replace(" ", "", 200)  # a stretch without whitespace: hard cuts
        docs.append(line + ("\nshort line" if i % 2 else ""))
    return docs


def test_split_long_line_keeps_every_byte():
    rng = random.Random(1)
    for line in [
        "a" * 10_000,
        "word " * 3000,
        "".join(rng.choice("ab \u00e9\u2603\t\U0001d11e") for _ in range(9000)),
        "x" * MAX_SENTENCE_BYTES,
        "x" * (MAX_SENTENCE_BYTES + 1),
    ]:
        pieces = split_long_line(line)
        assert "".join(pieces) == line
        assert all(0 < len(p.encode("utf-8")) <= MAX_SENTENCE_BYTES for p in pieces)
    pieces = split_long_line("word " * 3000)
    assert all(p.endswith(" ") for p in pieces[:-1])  # cut after whitespace, not inside a word
    assert split_long_line("short") == ["short"]


def test_every_byte_of_long_documents_reaches_the_sample():
    docs = long_docs(12)
    assert min(len(d.split("\n")[0]) for d in docs) > MAX_SENTENCE_BYTES
    stats: dict = {}
    sample = sample_sentences(docs, max_sentences=10_000, seed=0, stats=stats)
    lines = [ln for d in docs for ln in d.split("\n")]
    assert "".join(sample) == "".join(lines)  # below capacity the reservoir keeps the order
    assert all(len(s.encode("utf-8")) <= MAX_SENTENCE_BYTES for s in sample)
    total = sum(len(ln.encode("utf-8")) for ln in lines)
    assert stats == {
        "corpus_lines": len(lines),
        "corpus_bytes": total,
        "long_lines": 12,
        "sampled_lines": len(sample),
        "sampled_bytes": total,
    }
    # with a cap, the report says how much of the corpus was sampled
    capped: dict = {}
    sample = sample_sentences(docs, max_sentences=5, seed=0, stats=capped)
    assert capped["sampled_lines"] == 5 < len(lines)
    assert capped["sampled_bytes"] == sum(len(s.encode("utf-8")) for s in sample) < total


def test_corpus_of_only_long_lines_trains_a_tokenizer(tmp_path: Path):
    src = tmp_path / "docs.jsonl"
    docs = [d.split("\n")[0] for d in long_docs(8, seed=2)]
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    cfg = PrepConfig(sources=[str(src)], out=str(tmp_path / "out"), seq_len=64, vocab_size=60,
                     workers=0, progress=False, valid_fraction=0.0)  # fmt: skip
    manifest = prepare(cfg).manifest
    trained = manifest["tokenizer"]["trained"]
    total = sum(len(d.encode("utf-8")) for d in docs)
    assert trained["corpus_lines"] == trained["long_lines"] == 8
    assert trained["sampled_bytes"] == trained["corpus_bytes"] == total
    assert trained["sampled_lines"] > 8
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "out" / "tokenizer.model"))
    assert sp.get_piece_size() == 60
    assert "\u2603" in "".join(sp.id_to_piece(i) for i in range(60))  # a rare char, learned
