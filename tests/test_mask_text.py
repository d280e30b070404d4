"""The exported tokenizer encodes a text with a literal mask token as the training data placed
the mask (issue 45 item 6): for generated sentences (words, punctuation glued to a word or
after a space, digits, capitals) and generated mask positions, the ids of the text with
``<mask>`` written where the masked pieces were equal the sentence's own ids (as data_prep
wrote them) with those positions replaced by the mask id, framed by ``<s> ... </s>``.

SentencePiece models as data_prep trains them (unigram and bpe, through
``linformer_ds.model_dir.write_tokenizer`` and ``AutoTokenizer``, and once through the
``fill-mask`` pipeline of a real export), and the Hugging Face tokenizers data_prep takes
(WordPiece as BERT, byte-level BPE as RoBERTa, saved as the export saves them).

What no tokenizer can tell from the text, and the generators therefore leave out: a space
before a literal mask is the masked piece's (``be <mask>`` is ``▁be <mask>``, RoBERTa's
convention), so a mask that replaces a piece that follows a bare ``▁`` piece (SentencePiece
split `` L`` as ``▁`` ``L``) is not expressible; nor, for WordPiece, a word-start piece masked
before its own ``##`` continuation (``[MASK]ight`` reads ``ight`` as a new word).
"""

import contextlib
import io
import json
import random

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from data_prep.tokenizer import train_tokenizer
from linformer_ds.model_dir import write_tokenizer
from linformer_ds.special_tokens import SPECIAL_IDS, SPECIAL_PIECES

transformers = pytest.importorskip("transformers")
spm = pytest.importorskip("sentencepiece")

WORDS = ("let there be light and the quick brown fox jumps over a lazy dog while owners count "
         "coins Paris London model data tokens x y z 12 345 2024 hello world encode decode "
         "mask attention linear projection Linformer").split()  # fmt: skip
PUNCT = [",", ":", ";", ".", "!", "?", ")", "'s", "-", "%", '"']
MASK = SPECIAL_PIECES["mask"]
EXAMPLES = 200


def make_corpus(n: int, seed: int) -> list:
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        words = []
        for _ in range(rng.randint(3, 14)):
            w = rng.choice(WORDS)
            if rng.random() < 0.3:
                w += rng.choice(PUNCT)
            words.append(("(" if rng.random() < 0.05 else "") + w)
        lines.append(" ".join(words))
    return lines


@pytest.fixture(scope="module")
def sp_tokenizers(tmp_path_factory):
    """kind -> (SentencePieceProcessor, the exported tokenizer loaded by AutoTokenizer)."""
    root = tmp_path_factory.mktemp("masktext")
    lines = make_corpus(600, seed=1)
    out = {}
    for kind in ("unigram", "bpe"):
        model = root / f"{kind}.model"
        train_tokenizer(lines, str(model), 120, model_type=kind, num_threads=1)
        export = root / f"export_{kind}"
        export.mkdir()
        write_tokenizer(str(export), str(model), 128)
        tok = transformers.AutoTokenizer.from_pretrained(str(export))
        out[kind] = (spm.SentencePieceProcessor(model_file=str(model)), tok)
    return out


SENTENCES = st.lists(
    st.tuples(
        st.sampled_from(WORDS),
        st.sampled_from(["", "", " "] + PUNCT),
        st.sampled_from(["", "", "", "("]),
    ),  # fmt: skip
    min_size=1,
    max_size=10,
).map(lambda ws: " ".join(f"{pre}{w}{p}".strip() for w, p, pre in ws))


def sp_masked(sp, sentence: str, picks):
    """(the text with MASK where the picked pieces were, the id-replaced ids), or None when a
    pick is not expressible (the module docstring)."""
    pieces, ids = sp.encode(sentence, out_type=str), sp.encode(sentence)
    surfaces = [p.replace("\u2581", " ") for p in pieces]
    if surfaces and surfaces[0].startswith(" "):
        surfaces[0] = surfaces[0][1:]  # the dummy prefix
    assert "".join(surfaces) == sentence  # (the sentences need no normalization)
    masked = sorted({i % len(pieces) for i in picks})
    text, want = "", list(ids)
    for i, s in enumerate(surfaces):
        if i in masked:
            prev_bare = i > 0 and pieces[i - 1] == "\u2581" and i - 1 not in masked
            if prev_bare and not pieces[i].startswith("\u2581"):
                return None  # "x <mask>ight": the space would be the mask's
            text += (" " if s.startswith(" ") else "") + MASK
            want[i] = SPECIAL_IDS["mask"]
        else:
            text += s
    return text, [SPECIAL_IDS["cls"], *want, SPECIAL_IDS["sep"]]


@pytest.mark.parametrize("kind", ["unigram", "bpe"])
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(sentence=SENTENCES, picks=st.lists(st.integers(0, 200), min_size=1, max_size=3))
def test_sentencepiece_export_encodes_a_literal_mask_as_training_placed_it(
    sp_tokenizers, kind, sentence, picks
):
    sp, tok = sp_tokenizers[kind]
    case = sp_masked(sp, sentence, picks)
    assume(case is not None)
    text, want = case
    assert tok(text)["input_ids"] == want, (text, tok.tokenize(text))
    assert tok(sentence)["input_ids"] == [SPECIAL_IDS["cls"], *sp.encode(sentence),
                                          SPECIAL_IDS["sep"]]  # fmt: skip


def test_the_probe_sentences_of_the_issue(sp_tokenizers):
    """``Let there be <mask>: and ...`` and its kin (every piece of the masked word a mask):
    no stray ``▁`` after the mask; a text without a mask still as SentencePiece encodes it
    (ends, runs of spaces, tabs and newlines, a literal ``▁`` included)."""
    probes = [("Let there be light: and the dog", "light"), ("a dog, b", "dog"),
              ("hello is here", "hello"), ("x y world", "world"), ("Paris.", "Paris"),
              ("(data) model", "data")]  # fmt: skip
    for sp, tok in sp_tokenizers.values():
        for sentence, word in probes:
            start = sentence.index(word)
            pieces = sp.encode(sentence, out_type=str)
            spans, at = [], 0
            for i, p in enumerate(pieces):  # the pieces inside the word
                surface = p.replace("\u2581", " ") if i else p.lstrip("\u2581")
                lo = at + (1 if surface.startswith(" ") else 0)
                at += len(surface)
                if lo >= start and at <= start + len(word) and at > lo:
                    spans.append(i)
            case = sp_masked(sp, sentence, spans)
            if case is None:  # the word's first piece follows a bare "▁" piece
                assert sentence != probes[0][0]
                continue
            text, want = case
            assert "<mask>" in text and tok(text)["input_ids"] == want, (text, tok.tokenize(text))
        for text in ["  two  spaces  ", "tab\tand\nnewline ", " (x) ", "\u2581lead"]:
            assert tok(text)["input_ids"] == [SPECIAL_IDS["cls"], *sp.encode(text),
                                              SPECIAL_IDS["sep"]], text  # fmt: skip


# ------------------------------------------------------------------ Hugging Face tokenizers
@pytest.fixture(scope="module")
def hf_tokenizers(tmp_path_factory):
    """kind -> the tokenizer as the export saves it (write_tokenizer), loaded by AutoTokenizer: WordPiece (BERT) and byte-level BPE (RoBERTa)."""
    from tests.test_hf_tokenizer import build_tokenizers

    root = tmp_path_factory.mktemp("masktext_hf")
    dirs = build_tokenizers(root, make_corpus(600, seed=2))
    out = {}
    for kind, path in dirs.items():
        export = root / f"export_{kind}"
        export.mkdir()
        write_tokenizer(str(export), str(path), 128)
        out[kind] = transformers.AutoTokenizer.from_pretrained(str(export))
    return out


def hf_masked(tok, sentence: str, picks):
    """As :func:`sp_masked`, from the offsets of the tokenizer's own encoding (data_prep's:
    no special tokens)."""
    enc = tok(sentence, add_special_tokens=False, return_offsets_mapping=True,
              split_special_tokens=True)  # fmt: skip
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    pieces = tok.convert_ids_to_tokens(ids)
    masked = sorted({i % len(ids) for i in picks})
    text, end, want = "", 0, list(ids)
    for i in masked:
        start, stop = offsets[i]
        if start < end:
            return None  # two pieces of one character (bytes of a symbol)
        if i + 1 < len(ids) and pieces[i + 1].startswith("##"):
            return None  # "[MASK]ight": WordPiece reads a new word
        text += sentence[end:start] + tok.mask_token
        end = stop
        want[i] = tok.mask_token_id
    text += sentence[end:]
    head, *tail = tok("")["input_ids"]  # [CLS] [SEP] / <s> </s>
    return text, [head, *want, *tail]


@pytest.mark.parametrize("kind", ["wordpiece", "bpe"])
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(sentence=SENTENCES, picks=st.lists(st.integers(0, 200), min_size=1, max_size=3))
def test_hf_tokenizer_export_encodes_a_literal_mask_as_training_placed_it(
    hf_tokenizers, kind, sentence, picks
):
    tok = hf_tokenizers[kind]
    case = hf_masked(tok, sentence, picks)
    assume(case is not None)
    text, want = case
    assert tok(text)["input_ids"] == want, (text, tok.tokenize(text))


# ----------------------------------------------------------------------- the pipeline itself
def test_fill_mask_pipeline_of_a_real_export_gets_the_training_ids(sp_tokenizers, tmp_path):
    """A real export (launch/export.py's main on a tiny checkpoint with the unigram model):
    the fill-mask pipeline's own preprocessing gives the id-replaced ids, and it fills."""
    from linformer_ds.checkpoint.tags import COMPLETE_FILE, META_FILE, MODEL_STATES
    from linformer_ds.config import load_config
    from linformer_ds.export import main as export_main
    from linformer_ds.model import LinformerForMaskedLM
    from tests.pretrain_utils import TEST_OVERRIDES, TINY_CONFIG

    sp, _ = sp_tokenizers["unigram"]
    cfg = load_config(TINY_CONFIG, TEST_OVERRIDES + [
        "model.hidden_size=16", "model.num_heads=2", "model.num_layers=1",
        "model.intermediate_size=32", "model.k=8"])  # fmt: skip
    tag = tmp_path / "ckpt" / "step_00000002"
    tag.mkdir(parents=True)
    torch.manual_seed(0)
    torch.save({"module": LinformerForMaskedLM(cfg.model).state_dict()}, tag / MODEL_STATES)
    (tag / "tokenizer.model").write_bytes(sp.serialized_model_proto())
    meta = {"format_version": 1, "step": 2, "epoch": 0, "sampler": {"epoch": 0, "consumed": 8},
            "world_size": 1, "zero_stage": 0, "precision": "fp32", "model": cfg.model.to_dict(),
            "tokenizer": "tokenizer.model"}  # fmt: skip
    (tag / META_FILE).write_text(json.dumps(meta))
    (tag / COMPLETE_FILE).write_text(json.dumps({"files": {p.name: p.stat().st_size
                                                           for p in tag.iterdir()}}))  # fmt: skip
    (tag.parent / "latest").write_text(tag.name)
    with contextlib.redirect_stdout(io.StringIO()):
        assert export_main(["--checkpoint", str(tag.parent), "--out", str(tmp_path / "hf")]) == 0
    fill = transformers.pipeline("fill-mask", model=str(tmp_path / "hf"), trust_remote_code=True)
    for sentence, picks in [("let there be light: and the dog", [3]), ("hello, world!", [0, 2]),
                            ("(x) y's z.", [1, 4])]:  # fmt: skip
        case = sp_masked(sp, sentence, picks)
        if case is None:
            continue
        text, want = case
        assert fill.preprocess(text)["input_ids"][0].tolist() == want, text
        assert len(fill(text, top_k=3)) > 0
