"""studies/long_downstream.py build: the "same document?" task's invariants on a tiny generated
corpus (no data/ needed; the tokenizer is the one in tests/data).

Label balance; no document in both splits; every row within its token bounds; a label-1 row's
passage is text of its first part's document more than 512 tokens after it, a label-0 row's
passage text of another document of the same package; every first part and every passage once
with each label (quads); the tail512 rows are exactly the last <= 512 tokens of the full rows;
the sep512 rows fit 512 tokens; the same seed builds the same files.
"""

import json
import random
from pathlib import Path

import pytest
import sentencepiece as spm

from studies import long_downstream as ld

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "tests" / "data" / "export_format1" / "tokenizer.model"


def _corpus(path: Path) -> list:
    """Two packages of six documents of 3,000 words (about 3 spans each); every document has its
    own vocabulary, so a passage's document can be told from the text alone."""
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    docs = []
    for pkg in ("pkga", "pkgb"):
        for d in range(6):
            vocab = [
                "".join(rng.choice(letters) for _ in range(rng.randint(2, 6))) + f"{d}{pkg[-1]}"
                for _ in range(80)
            ]
            words = [rng.choice(vocab) for _ in range(3000)]
            for i in range(0, len(words), 17):  # lines and tabs: normalised to single spaces
                words[i] += rng.choice(["\n", "\t", "  "])
            words[5] = "x</s>y"  # a special piece in the text: the word is dropped
            docs.append({"text": " ".join(words), "source": f"{pkg}:dir{d}"})
    with open(path, "w") as f:
        for rec in docs:
            f.write(json.dumps(rec) + "\n")
    return docs


def _read(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("long_downstream")
    docs = _corpus(tmp / "long.jsonl")
    task = ld.build(
        tmp / "long.jsonl",
        TOKENIZER,
        tmp / "task",
        n_train=40,
        n_test=24,
        test_fraction=0.34,
        seed=3,
    )
    return tmp, docs, task


def test_build_invariants(built):
    tmp, docs, task = built
    sp = spm.SentencePieceProcessor(model_file=str(TOKENIZER))
    by_source = {
        d["source"]: " ".join(w for w in d["text"].split() if "</s>" not in w) for d in docs
    }
    out = tmp / "task"
    seen = {}
    for split, n in (("train", 40), ("test", 24)):
        rows = _read(out / f"{split}.jsonl")
        assert len(rows) == n == task["examples"][split]["examples"]
        assert sum(r["label"] for r in rows) == n // 2  # balanced
        seen[split] = {r["first_doc"] for r in rows} | {r["passage_doc"] for r in rows}
        for r in rows:
            assert r["text"].count(f" {ld.SEP} ") == 1 and r["text"].count(ld.SEP) == 1
            p_text, q_text = r["text"].split(f" {ld.SEP} ")
            ids = ld.encode_row(sp, r["text"])
            assert len(ids) == r["tokens"] and 1900 + 2100 + 3 - 2 * 64 <= len(ids) <= 4003 <= 4096
            a, b = by_source[r["first_doc"]], by_source[r["passage_doc"]]
            assert r["group"] == r["first_doc"].split(":")[0] == r["passage_doc"].split(":")[0]
            p_at = a.find(p_text)
            assert p_at >= 0 and a.find(p_text, p_at + 1) < 0
            q_at = b.find(q_text)
            assert q_at >= 0
            if r["label"] == 1:
                assert r["first_doc"] == r["passage_doc"]
                between = a[p_at + len(p_text) : q_at]
                assert q_at > p_at + len(p_text) and len(sp.encode(between)) > 512
                # the passage is the end of the row: 512 tokens before its last token lie in Q
                assert len(sp.encode(q_text)) > 512
            else:
                assert r["first_doc"] != r["passage_doc"] and a.find(q_text) < 0
        # quads: each first part and each passage once with each label
        for part in (0, 1):
            labels = {}
            for r in rows:
                labels.setdefault(r["text"].split(f" {ld.SEP} ")[part], []).append(r["label"])
            assert all(sorted(v) == [0, 1] for v in labels.values())
        # the controls: same labels, same order
        tails = _read(out / f"{split}_tail512.jsonl")
        seps = _read(out / f"{split}_sep512.jsonl")
        assert (
            [t["label"] for t in tails] == [r["label"] for r in rows] == [s["label"] for s in seps]
        )
        for r, t, s in zip(rows, tails, seps):
            full, tail = ld.encode_row(sp, r["text"]), ld.encode_row(sp, t["text"])
            k = len(tail) - 2
            assert len(tail) <= 512 and tail[-1] == full[-1] and tail[1:-1] == full[-k - 1 : -1]
            q_words = r["text"].split(f" {ld.SEP} ")[1].split()
            t_words = t["text"].split()
            assert q_words[-len(t_words) :] == t_words  # word-aligned suffix of the passage
            assert k + len(sp.encode(q_words[-len(t_words) - 1])) > 510  # and the longest one
            assert len(ld.encode_row(sp, s["text"])) <= 512 and s["text"].count(ld.SEP) == 1
            p_tail, q_head = s["text"].split(f" {ld.SEP} ")
            p_text, q_text = r["text"].split(f" {ld.SEP} ")
            assert p_text.endswith(p_tail) and q_text.startswith(q_head)
    assert not seen["train"] & seen["test"]  # split by document
    assert task["majority_baseline_test_accuracy"] == 0.5


def test_build_is_seeded(built):
    tmp, _, _ = built
    ld.build(
        tmp / "long.jsonl",
        TOKENIZER,
        tmp / "again",
        n_train=40,
        n_test=24,
        test_fraction=0.34,
        seed=3,
    )
    for name in ("train", "test", "test_tail512", "test_sep512"):
        assert (tmp / "again" / f"{name}.jsonl").read_bytes() == (
            tmp / "task" / f"{name}.jsonl"
        ).read_bytes()


def test_split_documents_keeps_two_a_side():
    side = ld.split_documents({"a": list(range(10)), "b": [10, 11, 12]}, 0.1, 0)
    assert sum(side[i] == "test" for i in range(10)) == 2
    assert all(side[i] == "train" for i in (10, 11, 12))  # too few to split


def test_lexical_baseline_sees_the_junction(built):
    """Adjacent P and Q: word overlap alone solves the rows and the sep512 window alike (the
    shortcut --filler-tokens closes); the tail alone has no separator (n/a)."""
    tmp, _, _ = built
    out = tmp / "task"
    full = ld.lexical_baseline(out / "train.jsonl", out / "test.jsonl")
    sep = ld.lexical_baseline(out / "train_sep512.jsonl", out / "test_sep512.jsonl")
    assert full["test_accuracy"] >= 0.9 and sep["test_accuracy"] >= 0.9
    assert ld.lexical_baseline(out / "train_tail512.jsonl", out / "test_tail512.jsonl") is None


def test_build_filler_keeps_p_and_q_apart(built):
    """--filler-tokens: rows P </s> F </s> Q, F of a third document, one per quad; no 512-token
    window holds both P and Q; the sep512 window (P's end, F's start) is the same for both rows
    of a P, so it cannot beat 0.5; word overlap of P and Q still solves the rows."""
    tmp, _, _ = built
    sp = spm.SentencePieceProcessor(model_file=str(TOKENIZER))
    out = tmp / "filler"
    ld.build(tmp / "long.jsonl", TOKENIZER, out, n_train=40, n_test=24, test_fraction=0.34,
             seed=3, first_tokens=1300, filler_tokens=600)  # fmt: skip
    for split in ("train", "test"):
        rows = _read(out / f"{split}.jsonl")
        seps = _read(out / f"{split}_sep512.jsonl")
        fillers, windows = {}, {}
        for r, s in zip(rows, seps):
            p_text, f_text, q_text = r["text"].split(f" {ld.SEP} ")
            assert r["filler_doc"] not in (r["first_doc"], r["passage_doc"])
            assert r["filler_doc"].split(":")[0] == r["group"]
            assert len(ld.encode_row(sp, r["text"])) == r["tokens"] <= 4096
            assert len(sp.encode(f_text)) + 3 > 512  # last P token .. first Q token
            fillers.setdefault(r["quad"], set()).add(f_text)
            s_p, s_f = s["text"].split(f" {ld.SEP} ")
            assert p_text.endswith(s_p) and f_text.startswith(s_f)
            windows.setdefault(p_text, set()).add(s["text"])
        assert all(len(v) == 1 for v in fillers.values())
        assert all(len(v) == 1 for v in windows.values())  # one window for both labels
    assert ld.lexical_baseline(out / "train.jsonl", out / "test.jsonl")["test_accuracy"] >= 0.9
    sep = ld.lexical_baseline(out / "train_sep512.jsonl", out / "test_sep512.jsonl")
    assert sep["test_accuracy"] == 0.5
