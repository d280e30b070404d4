"""data_prep's tokenizer: no ``<unk>`` for text of the training corpus (byte fallback, full
character coverage decided by alphabet size) and the round trip decode(encode(x)) ==
normalized(x) that data_prep reports in its manifest."""

import json
import random
import sysconfig
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from data_prep.tokenizer import (
    BYTE_FALLBACK_MIN_VOCAB,
    UNK_ID,
    document_lines,
    normalized,
    round_trip,
    train_tokenizer,
    training_options,
)

STDLIB = Path(sysconfig.get_paths()["stdlib"])
RARE = "K!U()V-"  # the characters coverage 0.9995 turned into <unk> on the King James Bible


def verses(n: int = 6000, seed: int = 0) -> list:
    """Bible-like lines: capitalised made-up words, chapter:verse numbers, and the RARE
    characters in about one line in thirty (well under 0.05 % of the characters)."""
    rng = random.Random(seed)
    syl = [c + v for c in "bcdfghlmnprstwz" for v in "aeiou"]
    words = ["".join(rng.choice(syl) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    out = []
    for i in range(n):
        w = [rng.choice(words) for _ in range(rng.randint(8, 20))]
        w[0] = w[0].capitalize()
        if i % 97 == 0:
            w.insert(3, "(Kings)")
        if i % 89 == 0:
            w.append("Uzziah!")
        if i % 83 == 0:
            w.insert(5, "Vashti-like")
        out.append(f"{i % 50 + 1}:{i % 31 + 1} " + " ".join(w) + rng.choice(".;,"))
    return out


@pytest.fixture(scope="module")
def bible(tmp_path_factory) -> dict:
    """Tokenizers trained on the verses: the old default (coverage 0.9995, no byte fallback),
    today's default below BYTE_FALLBACK_MIN_VOCAB (full coverage) and above it (+ bytes)."""
    import sentencepiece as spm

    root = tmp_path_factory.mktemp("tok")
    lines = verses()
    models = {}
    for name, vocab, options in [
        ("old", 600, dict(character_coverage=0.9995, byte_fallback=False)),
        ("full", 600, {}),
        ("bytes", BYTE_FALLBACK_MIN_VOCAB + 176, {}),
    ]:
        path = train_tokenizer(lines, str(root / f"{name}.model"), vocab, **options)
        models[name] = spm.SentencePieceProcessor(model_file=path)
    return {"lines": lines, "root": root, **models}


def test_rare_punctuation_and_capitals_survive(bible):
    lines = bible["lines"]
    rare_lines = [ln for ln in lines if any(c in ln for c in RARE)]
    assert 150 < len(rare_lines) < 300
    old = round_trip(bible["old"], lines)
    assert old["unk_pieces"] > 100 and old["rate"] < 0.99  # the defect the defaults fix
    assert training_options(lines, 600) == {"character_coverage": 1.0, "byte_fallback": False}
    assert training_options(lines, BYTE_FALLBACK_MIN_VOCAB) == {
        "character_coverage": 1.0,
        "byte_fallback": True,
    }
    for name in ("full", "bytes"):
        trip = round_trip(bible[name], lines)
        assert trip == {"lines": len(lines), "exact": len(lines), "rate": 1.0, "unk_pieces": 0}
    text = "KJV: (Uzziah) - Vashti! said the LORD."
    assert bible["bytes"].decode(bible["bytes"].encode(text)) == text
    assert UNK_ID in bible["full"].encode("J")  # no byte pieces: unseen letters stay unknown


@settings(max_examples=200, deadline=None)
@given(st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\u2581")))
def test_byte_fallback_round_trips_any_text(bible, text):
    """With byte pieces, any text (any script, symbols, controls) decodes to its normalized form."""
    sp = bible["bytes"]
    ids = sp.encode(text)
    assert UNK_ID not in ids
    assert sp.decode(ids) == normalized(sp, text)


def test_stdlib_corpus_round_trip(tiny_corpus):
    """data_prep's manifest reports the round trip on its sample (all lines exact, no <unk>);
    recomputed on stdlib modules with the written tokenizer it holds too."""
    import sentencepiece as spm

    tok = json.loads((tiny_corpus / "manifest.json").read_text())["tokenizer"]
    assert tok["byte_fallback"] is True and tok["character_coverage"] == 1.0
    trip = tok["trained"]["round_trip"]
    assert trip["lines"] == tok["trained"]["sampled_lines"] > 1000
    assert trip["exact"] == trip["lines"] and trip["rate"] == 1.0 and trip["unk_pieces"] == 0
    sp = spm.SentencePieceProcessor(model_file=str(tiny_corpus / "tokenizer.model"))
    files = [STDLIB / "_pydecimal.py", *sorted((STDLIB / "email").glob("*.py"))]
    lines = [ln for f in files for ln in document_lines(f.read_text(encoding="utf-8"))]
    again = round_trip(sp, lines)
    assert again["exact"] == again["lines"] == len(lines) and again["unk_pieces"] == 0
