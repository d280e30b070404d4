"""The one tokenizer identity check (linformer_ds.tokenizer_identity.check_tokenizers): over
generated variants of a WordPiece (Hugging Face) and a SentencePiece tokenizer, it accepts
exactly those that tokenize as the original does (the same bytes, the same content written
otherwise, what an export rewrites) and refuses in one line, naming both files and what differs,
a flipped lowercasing, a renamed piece, another size, another pre-tokenizer or normalizer, a
changed score; whatever it accepts encodes generated texts to the same ids. Through a real
command: context_curve on data whose manifest records the tokenizer, against an export holding
a variant. The tokenizers are built here in milliseconds (no training of a model, no launch)."""

import copy
import hashlib
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from linformer_ds.tokenizer_identity import (
    TokenizerMismatch,
    check_tokenizers,
    of_data,
    of_file,
    of_model,
)

tokenizers = pytest.importorskip("tokenizers")

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "café", "naive"]
LETTERS = list("abcdefghijklmnopqrstuvwxyzé")
VOCAB = SPECIALS + WORDS + LETTERS + ["##" + c for c in LETTERS[:18]]  # 60 ids
FAST = settings(max_examples=30, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
TEXT = st.text(alphabet="thequickbrownfoxjumpsoverlazydogcafénaive THE Café,.!\t\n", max_size=40)


def wordpiece_json() -> str:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    tok = Tokenizer(models.WordPiece({p: i for i, p in enumerate(VOCAB)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.add_special_tokens(SPECIALS)
    return tok.to_str()


# ----------------------------------------------------------------------- Hugging Face variants
def _hf_same(spec, rng):
    return spec


def _hf_reformatted(spec, rng):  # the same content, other bytes (indentation, key order)
    return json.loads(json.dumps(spec, indent=2, sort_keys=True))


def _hf_export_rewrite(spec, rng):  # what an export changes: the mask's lstrip, a post-processor
    spec = copy.deepcopy(spec)
    for t in spec["added_tokens"]:
        t["lstrip"] = t["content"] == "[MASK]"
    spec["post_processor"] = {"type": "BertProcessing", "sep": ["[SEP]", 3], "cls": ["[CLS]", 2]}
    return spec


def _hf_lowercase(spec, rng):
    spec = copy.deepcopy(spec)
    spec["normalizer"]["lowercase"] = not spec["normalizer"]["lowercase"]
    return spec


def _hf_strip_accents(spec, rng):
    spec = copy.deepcopy(spec)
    spec["normalizer"]["strip_accents"] = True
    return spec


def _hf_renamed(spec, rng):
    spec = copy.deepcopy(spec)
    vocab = spec["model"]["vocab"]
    piece = rng.choice([p for p in vocab if p not in SPECIALS])
    vocab["x" + piece] = vocab.pop(piece)
    return spec


def _hf_bigger(spec, rng):
    spec = copy.deepcopy(spec)
    spec["model"]["vocab"]["zz"] = len(spec["model"]["vocab"])
    return spec


def _hf_pre_tokenizer(spec, rng):
    spec = copy.deepcopy(spec)
    spec["pre_tokenizer"] = rng.choice([{"type": "Whitespace"}, {"type": "WhitespaceSplit"}])
    return spec


def _hf_subword_prefix(spec, rng):
    spec = copy.deepcopy(spec)
    spec["model"]["continuing_subword_prefix"] = "++"
    return spec


HF_VARIANTS = {  # name: (make, the same tokenizer?)
    "same": (_hf_same, True), "reformatted": (_hf_reformatted, True),
    "export_rewrite": (_hf_export_rewrite, True), "lowercase": (_hf_lowercase, False),
    "strip_accents": (_hf_strip_accents, False), "renamed": (_hf_renamed, False),
    "bigger": (_hf_bigger, False), "pre_tokenizer": (_hf_pre_tokenizer, False),
    "subword_prefix": (_hf_subword_prefix, False),
}  # fmt: skip


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hf_identity")
    text = wordpiece_json()
    (root / "tokenizer.json").write_text(text, encoding="utf-8")
    return {"root": root, "text": text, "spec": json.loads(text)}


def _write_variant(path: Path, base: str, spec: dict, name: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if name == "same":
        path.write_text(base, encoding="utf-8")  # the same bytes
    else:
        path.write_text(json.dumps(spec), encoding="utf-8")
    return path


def _encode(path: Path, texts: list[str]) -> list[list[int]]:
    tok = tokenizers.Tokenizer.from_file(str(path))
    return [tok.encode(t, add_special_tokens=False).ids for t in texts]


@FAST
@given(name=st.sampled_from(sorted(HF_VARIANTS)), seed=st.integers(0, 2**16),
       texts=st.lists(TEXT, min_size=1, max_size=6))  # fmt: skip
def test_hf_variants_accepted_exactly_when_the_same(hf, tmp_path_factory, name, seed, texts):
    make, same = HF_VARIANTS[name]
    spec = make(copy.deepcopy(hf["spec"]), random.Random(seed))
    variant = _write_variant(tmp_path_factory.mktemp("v") / "tokenizer.json", hf["text"], spec,
                             name)  # fmt: skip
    a = of_file(str(hf["root"] / "tokenizer.json"), "the data's")
    b = of_file(str(variant), "the model's")
    if same:
        note = check_tokenizers(a, b)
        assert note.startswith("tokenizer: ") and "\n" not in note
        # an independent reference: what it accepts encodes every text to the same ids
        assert _encode(hf["root"] / "tokenizer.json", texts) == _encode(variant, texts)
        return
    with pytest.raises(TokenizerMismatch) as e:
        check_tokenizers(a, b)
    msg = str(e.value)
    assert "\n" not in msg and str(a.path) in msg and str(variant) in msg
    said = {"lowercase": "normalizer differs (lowercase: true vs false)",
            "strip_accents": "normalizer differs (strip_accents: null vs true)",
            "renamed": "1 of 60 ids are other pieces", "bigger": "60 ids vs 61",
            "pre_tokenizer": "pre-tokenizer differs (type: ",
            "subword_prefix": "model differs (continuing_subword_prefix: "}[name]  # fmt: skip
    assert said in msg, msg


# ------------------------------------------------------------------------ SentencePiece variants
@pytest.fixture(scope="module")
def sp(tmp_path_factory) -> dict:
    from data_prep.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("sp_identity")
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(8)) for _ in range(300)]
    train_tokenizer(lines, str(root / "tokenizer.model"), 40, "unigram", None, num_threads=1)
    return {"root": root, "bytes": (root / "tokenizer.model").read_bytes(), "lines": lines}


def _sp_variant(data: bytes, name: str, rng: random.Random) -> bytes:
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString(data)
    normal = [i for i, p in enumerate(proto.pieces) if p.type == 1]
    if name == "same":
        return data
    if name == "trainer_only":  # how it was trained, not how it encodes
        proto.trainer_spec.num_threads += 3
        proto.trainer_spec.input.append("elsewhere.txt")
    elif name == "renamed":
        proto.pieces[rng.choice(normal)].piece += "x"
    elif name == "score":
        proto.pieces[rng.choice(normal)].score -= 1.5
    elif name == "dummy_prefix":
        proto.normalizer_spec.add_dummy_prefix = not proto.normalizer_spec.add_dummy_prefix
    elif name == "smaller":
        del proto.pieces[-1]
    return proto.SerializeToString()


SP_VARIANTS = {"same": True, "trainer_only": True, "renamed": False, "score": False,
               "dummy_prefix": False, "smaller": False}  # fmt: skip


@FAST
@given(name=st.sampled_from(sorted(SP_VARIANTS)), seed=st.integers(0, 2**16))
def test_sentencepiece_variants_accepted_exactly_when_the_same(sp, tmp_path_factory, name, seed):
    import sentencepiece as spm

    data = _sp_variant(sp["bytes"], name, random.Random(seed))
    path = tmp_path_factory.mktemp("spv") / "tokenizer.model"
    path.write_bytes(data)
    recorded = hashlib.sha256(sp["bytes"]).hexdigest()
    a = of_file(str(sp["root"] / "tokenizer.model"), "the data's", sha256=recorded)
    b = of_file(str(path), "the model's")
    if SP_VARIANTS[name]:
        check_tokenizers(a, b)
        ours = spm.SentencePieceProcessor(model_proto=sp["bytes"])
        theirs = spm.SentencePieceProcessor(model_proto=data)
        assert ours.encode(sp["lines"][:50]) == theirs.encode(sp["lines"][:50])
        return
    with pytest.raises(TokenizerMismatch) as e:
        check_tokenizers(a, b)
    msg = str(e.value)
    assert "\n" not in msg and str(a.path) in msg and str(path) in msg
    n = spm.SentencePieceProcessor(model_proto=sp["bytes"]).get_piece_size()
    said = {"renamed": f"1 of {n} ids are other pieces", "score": "model differs (scores[",
            "dummy_prefix": "normalizer differs (add_dummy_prefix: ",
            "smaller": f"{n} ids vs {n - 1}"}[name]  # fmt: skip
    assert said in msg, msg


def test_a_file_that_is_not_its_record_and_a_missing_side(sp, tmp_path):
    """The data's file must be the bytes its manifest records; a side with nothing recorded
    is not compared (and the note says so); two kinds never match."""
    path = tmp_path / "tokenizer.model"
    path.write_bytes(_sp_variant(sp["bytes"], "renamed", random.Random(1)))
    recorded = hashlib.sha256(sp["bytes"]).hexdigest()
    with pytest.raises(TokenizerMismatch, match="not the tokenizer this data was made with"):
        check_tokenizers(of_data(str(tmp_path), {"tokenizer": {"sha256": recorded}}), None)
    assert "not compared" in check_tokenizers(None, of_file(str(path)))
    hf_file = tmp_path / "tokenizer.json"
    hf_file.write_text(wordpiece_json(), encoding="utf-8")
    with pytest.raises(TokenizerMismatch, match="kind sentencepiece vs huggingface"):
        check_tokenizers(of_file(str(sp["root"] / "tokenizer.model")), of_file(str(hf_file)))


# ------------------------------------------------------------------- through a real command
@settings(max_examples=len(HF_VARIANTS), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(name=st.sampled_from(sorted(HF_VARIANTS)))
def test_context_curve_scores_only_data_of_the_models_tokenizer(hf, tmp_path_factory, capsys,
                                                                name):  # fmt: skip
    """context_curve MODEL DATA: the data's manifest records its tokenizer (file, sha256); an
    export holding a variant of it gets a curve (exit 0) exactly when the variant is the same
    tokenizer, else exit 2 and one line naming both files and what differs (before: any data
    whose vocabulary was not larger than the model's was scored)."""
    from linformer_ds.context_curve import main
    from tests.test_context_curve import export_dir, one_doc_rows, tiny_model, write_data

    root = tmp_path_factory.mktemp("cc")
    rng = np.random.default_rng(0)
    data = write_data(root / "data", "pad", {"train": one_doc_rows(rng, 2),
                                             "valid": one_doc_rows(rng, 2)})  # fmt: skip
    tok = _write_variant(data / "tokenizer" / "tokenizer.json", hf["text"], hf["spec"], "same")
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["tokenizer"] = {"kind": "huggingface", "file": "tokenizer/tokenizer.json",
                             "sha256": hashlib.sha256(tok.read_bytes()).hexdigest()}  # fmt: skip
    (data / "manifest.json").write_text(json.dumps(manifest))
    exp = export_dir(root / "export", tiny_model())
    make, same = HF_VARIANTS[name]
    _write_variant(exp / "tokenizer.json", hf["text"], make(copy.deepcopy(hf["spec"]),
                                                            random.Random(0)), name)  # fmt: skip
    capsys.readouterr()
    rc = main([str(exp), str(data), "--windows", "N", "--rows", "1", "--out", str(root / "o")])
    err = capsys.readouterr().err
    if same:
        assert rc == 0 and "tokenizer: " in err, err
        return
    line = err.strip()
    assert rc == 2 and len(line.splitlines()) == 1, err
    assert line.startswith(f"context_curve: error: DATA {data}: not the data of this model")
    assert str(tok) in line and str(exp / "tokenizer.json") in line
    assert not (root / "o").exists()


def test_an_edited_export_tokenizer_is_refused_by_finetune_and_context_curve(sp, tmp_path):
    """An export records the sha256 of its tokenizer files: one replaced afterwards is refused
    (finetune's check, and context_curve's against the data)."""
    from linformer_ds.finetune import FinetuneError, check_export_tokenizer
    from linformer_ds.tokenizer_identity import record

    exp = tmp_path / "export"
    exp.mkdir()
    shutil.copyfile(sp["root"] / "tokenizer.model", exp / "tokenizer.model")
    (exp / "linformer_export.json").write_text(json.dumps({"tokenizer": record(str(exp))}))
    assert "is the file its record names" in check_export_tokenizer(str(exp))
    data = tmp_path / "data"
    data.mkdir()
    shutil.copyfile(sp["root"] / "tokenizer.model", data / "tokenizer.model")
    manifest = {"tokenizer": {"file": "tokenizer.model",
                              "sha256": hashlib.sha256(sp["bytes"]).hexdigest()}}  # fmt: skip
    assert "the same file" in check_tokenizers(of_data(str(data), manifest), of_model(str(exp)))
    (exp / "tokenizer.model").write_bytes(_sp_variant(sp["bytes"], "score", random.Random(2)))
    with pytest.raises(FinetuneError, match="not the tokenizer the export was written with"):
        check_export_tokenizer(str(exp))
    with pytest.raises(TokenizerMismatch, match="not the tokenizer the export was written with"):
        check_tokenizers(of_data(str(data), manifest), of_model(str(exp)))
