"""data_prep with a Hugging Face tokenizer directory (issue 32 item 2): WordPiece as BERT has it
and byte-level BPE as RoBERTa has it, built here with ``tokenizers`` and saved with
transformers' ``save_pretrained`` (no Hub). The rows are the tokenizer's own encoding of each
document, the special ids in the manifest and the rows are the tokenizer's, ranks give the
bytes of one process, the trainer masks with the tokenizer's mask id, a warm start from a BERT
of that vocabulary trains and exports with the tokenizer (AutoTokenizer loads it) and
fine-tunes; a source of another vocabulary or other special ids is refused in one line."""

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from data_prep import DataPrepError, PrepConfig, prepare
from data_prep import hf_tokenizer as hft
from data_prep.__main__ import main as data_prep_main
from data_prep.packing import EncodeSettings, FullPacker, assign_split, encode_documents
from data_prep.sources import DEFAULT_MAX_DOC_BYTES, Source
from linformer_ds.data.shards import ShardDataset
from linformer_ds.data.stream import MixtureBatches
from tests.pretrain_utils import read_metrics, run_pretrain, run_ranks_in_threads

transformers = pytest.importorskip("transformers")

WORDS = ("the quick brown fox jumps over a lazy dog while café owners count 12,345.67 coins; "
         "naïve résumé (draft) says: hello-world! tabs\tand   spaces 'quoted' \"double\" x=y+1 "
         "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda").split(" ")  # fmt: skip
SEQ = 64
VALID = 0.15
# BERT's names; [unused0] moves unk/cls/sep/mask off the SentencePiece ids (pad 0, like BERT)
WP_SPECIALS = ["[PAD]", "[unused0]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
RB_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]


def make_docs(n: int, seed: int) -> list[str]:
    """Documents of 1-12 lines (some blank, some spelling a special token as text)."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        lines = []
        for _ in range(rng.randint(1, 12)):
            words = [rng.choice(WORDS) for _ in range(rng.randint(0, 14))]
            if rng.random() < 0.05:
                words.append(rng.choice(["[MASK]", "</s>", "<pad>", "[SEP]"]))
            lines.append(" ".join(words))
        docs.append("\n".join(lines))
    return docs


def build_tokenizers(root: Path, texts: list[str]) -> dict[str, Path]:
    """A WordPiece (BertTokenizerFast) and a byte-level BPE (RobertaTokenizerFast) tokenizer
    trained on ``texts``, saved with save_pretrained."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    wp = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wp.normalizer = normalizers.BertNormalizer(lowercase=True)
    wp.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    wp.decoder = decoders.WordPiece()
    wp.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=400,
                                                            special_tokens=WP_SPECIALS))  # fmt: skip
    bert = transformers.BertTokenizerFast(
        tokenizer_object=wp, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
        sep_token="[SEP]", mask_token="[MASK]",
    )  # fmt: skip
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=400, special_tokens=RB_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    ))  # fmt: skip
    roberta = transformers.RobertaTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", sep_token="</s>",
        cls_token="<s>", unk_token="<unk>", pad_token="<pad>", mask_token="<mask>",
    )  # fmt: skip
    out = {"wordpiece": root / "wordpiece", "bpe": root / "bpe"}
    bert.save_pretrained(str(out["wordpiece"]))
    roberta.save_pretrained(str(out["bpe"]))
    return out


def own_encode(tok, text: str) -> list[int]:
    """The tokenizer's own encode of a document as data_prep defines it (non-blank lines,
    joined by newlines; special-token text stays text)."""
    lines = [ln for ln in text.split("\n") if ln.strip()]
    if not lines:
        return []
    return tok("\n".join(lines), add_special_tokens=False, split_special_tokens=True)["input_ids"]


def special_ids(tok) -> dict[str, int]:
    return {"pad": tok.pad_token_id, "unk": tok.unk_token_id, "cls": tok.cls_token_id,
            "sep": tok.sep_token_id, "mask": tok.mask_token_id}  # fmt: skip


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    """The corpus (text files), both tokenizers, and data_prep's output with each (WordPiece
    with 2 worker processes, BPE inline)."""
    root = tmp_path_factory.mktemp("hftok")
    docs = make_docs(70, seed=3)
    corpus = root / "corpus"
    corpus.mkdir()
    for i, d in enumerate(docs):
        (corpus / f"doc{i:03d}.txt").write_text(d, encoding="utf-8")
    dirs = build_tokenizers(root, docs)
    toks = {k: transformers.AutoTokenizer.from_pretrained(str(v)) for k, v in dirs.items()}
    outs = {}
    for kind, workers in (("wordpiece", "2"), ("bpe", "0")):
        outs[kind] = root / f"data_{kind}"
        argv = ["--source", str(corpus), "--out", str(outs[kind]), "--tokenizer", str(dirs[kind]),
                "--seq-len", str(SEQ), "--valid-fraction", str(VALID), "--workers", workers,
                "--quiet"]  # fmt: skip
        assert data_prep_main(argv) == 0
    read = list(Source([str(corpus)], "text", DEFAULT_MAX_DOC_BYTES, "utf-8"))
    return {"root": root, "corpus": corpus, "dirs": dirs, "toks": toks, "outs": outs,
            "docs": read}  # fmt: skip


def split_rows(out: Path, split: str) -> np.ndarray:
    m = json.loads((out / "manifest.json").read_text())
    return np.concatenate([np.load(out / s["file"]) for s in m["splits"][split]["shards"]])


@pytest.mark.parametrize("kind", ["wordpiece", "bpe"])
def test_rows_are_the_tokenizers_own_encoding(env, kind):
    """Every row starts with the tokenizer's cls; the rows of a split are its documents, each
    the tokenizer's own encode followed by its sep, then its pad; the manifest records them."""
    tok, out = env["toks"][kind], env["outs"][kind]
    ids = special_ids(tok)
    m = json.loads((out / "manifest.json").read_text())
    assert m["special_ids"] == ids
    assert m["special_pieces"] == {k: tok.convert_ids_to_tokens(v) for k, v in ids.items()}
    assert m["vocab_size"] == len(tok) and m["tokenizer"]["kind"] == "huggingface"
    assert m["tokenizer"]["model_type"] == {"wordpiece": "WordPiece", "bpe": "BPE"}[kind]
    saved = transformers.AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    assert special_ids(saved) == ids and saved.get_vocab() == tok.get_vocab()
    if kind == "wordpiece":
        assert ids != {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}  # not SentencePiece's
    docs = env["docs"]
    for split in ("train", "valid"):
        rows = split_rows(out, split)
        assert rows.shape[1] == SEQ and (rows[:, 0] == ids["cls"]).all()
        stream = rows[:, 1:].reshape(-1).tolist()
        while stream and stream[-1] == ids["pad"]:
            stream.pop()
        want: list[int] = []
        texts = [d for d in docs if assign_split(d, VALID, 0) == split and own_encode(tok, d)]
        for d in texts:
            want += own_encode(tok, d) + [ids["sep"]]
        assert stream == want
        assert m["splits"][split]["documents"] == len(texts) > 0
        if kind == "bpe":  # byte-level BPE is lossless: the text comes back exactly
            pieces, cur = [], []
            for t in stream:
                if t == ids["sep"]:
                    pieces.append(tok.decode(cur))
                    cur = []
                else:
                    cur.append(t)
            assert pieces == ["\n".join(ln for ln in d.split("\n") if ln.strip()) for d in texts]
    assert any("[MASK]" in d or "</s>" in d for d in docs)  # special-token text stayed text


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(docs=st.lists(st.text(alphabet=st.sampled_from(list("ab cé\n\t.[]<>/MASKs1")), max_size=40),
                     min_size=1, max_size=6),
       kind=st.sampled_from(["wordpiece", "bpe"]), packing=st.sampled_from(["full", "pad"]))  # fmt: skip
def test_random_documents_round_trip(env, docs, kind, packing):
    """data_prep's worker encoding and packing of any documents: each document's ids are the
    tokenizer's own encode, framed by the tokenizer's special ids only."""
    tok = env["toks"][kind]
    ids = special_ids(tok)
    n = 16
    settings_ = EncodeSettings(n, packing, 0.0, 0, "uint16", ids["cls"], ids["sep"], ids["pad"])
    enc = hft.HFEncoder(hft.payload(tok))
    res = encode_documents(enc, settings_, docs)["splits"]["train"]
    want = [own_encode(tok, d) for d in docs]
    want = [w for w in want if w]
    if packing == "pad":  # [cls] + up to n-2 ids of one document + [sep] + [pad]...
        body: list[int] = []
        for row in res["tokens"].tolist():
            end = row.index(ids["sep"])
            assert row[0] == ids["cls"] and set(row[end + 1 :]) <= {ids["pad"]}
            body += row[1:end]
        assert body == [t for w in want for t in w]
    else:
        packer = FullPacker(n, np.dtype("uint16"), None, ids["cls"], ids["pad"])
        rows = np.concatenate([packer.add(res["tokens"]), packer.finish()])
        assert (rows[:, 0] == ids["cls"]).all()
        stream = rows[:, 1:].reshape(-1).tolist()
        while stream and stream[-1] == ids["pad"]:
            stream.pop()
        assert stream == [t for w in want for t in w + [ids["sep"]]]
        specials = set(ids.values())
        content = [t for w in want for t in w]
        assert not specials & set(content) - {ids["unk"]}


def test_ranks_give_the_bytes_of_one_process(env, tmp_path):
    """Three ranks (srun's file transport, as threads) with the BPE tokenizer: the same files."""
    kw = dict(sources=[str(env["corpus"])], seq_len=SEQ, tokenizer=str(env["dirs"]["bpe"]),
              valid_fraction=VALID, shard_rows=7, workers=0, progress=False)  # fmt: skip
    prepare(PrepConfig(out=str(tmp_path / "one"), **kw))
    many = dict(out=str(tmp_path / "many"), unit_bytes=2000, rank_timeout=60.0, **kw)
    run_ranks_in_threads(many, 3, "hftok")

    one, many = files(tmp_path / "one"), files(tmp_path / "many")
    assert one.keys() == many.keys() and one == many


def test_interrupted_run_resumes_to_the_same_bytes(env, tmp_path, monkeypatch):
    """Ctrl-C between tasks, then --resume: the files of an uninterrupted run (the saved
    tokenizer is checked against its sha256 and reloaded)."""
    from data_prep import packing as pk

    kw = dict(sources=[str(env["corpus"])], seq_len=SEQ, tokenizer=str(env["dirs"]["bpe"]),
              valid_fraction=VALID, shard_rows=7, workers=0, progress=False, task_bytes=400,
              checkpoint_seconds=0.0)  # fmt: skip
    prepare(PrepConfig(out=str(tmp_path / "one"), **kw))
    real, calls = pk.encode_task, {"n": 0}

    def interrupt(texts):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real(texts)

    monkeypatch.setattr(pk, "encode_task", interrupt)
    with pytest.raises(KeyboardInterrupt):
        prepare(PrepConfig(out=str(tmp_path / "r"), **kw))
    monkeypatch.undo()
    assert not (tmp_path / "r").exists()  # --out appears only whole; the work is beside it
    progress = json.loads((tmp_path / ".r.data_prep-partial" / "progress.json").read_text())
    assert progress["counters"]["documents_read"] > 0
    prepare(PrepConfig(out=str(tmp_path / "r"), resume=True, **kw))
    assert files(tmp_path / "r") == files(tmp_path / "one")


def files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_bad_tokenizer_directories_are_refused_in_one_line(env, tmp_path):
    corpus = str(env["corpus"])

    def refused(tokdir: Path, **kw) -> str:
        with pytest.raises(DataPrepError) as e:
            prepare(PrepConfig(sources=[corpus], out=str(tmp_path / "out"), seq_len=SEQ,
                               tokenizer=str(tokdir), workers=0, progress=False, **kw))  # fmt: skip
        assert "\n" not in str(e.value)
        assert not (tmp_path / "out").exists()
        return str(e.value)

    (tmp_path / "empty").mkdir()
    assert "not a Hugging Face tokenizer directory (no tokenizer.json" in refused(
        tmp_path / "empty"
    )
    for attr, name in (("mask_token", "mask_token"), ("pad_token", "pad_token")):
        d = tmp_path / f"no_{attr}"
        broken = transformers.AutoTokenizer.from_pretrained(str(env["dirs"]["wordpiece"]))
        setattr(broken, attr, None)
        broken.save_pretrained(str(d))
        assert f"the tokenizer has no {name}" in refused(d)
    assert "--vocab-size 99 does not match" in refused(env["dirs"]["wordpiece"], vocab_size=99)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "tokenizer.json").write_text("{not json")
    assert "cannot load the tokenizer" in refused(tmp_path / "junk")


def test_trainer_masks_with_the_tokenizers_mask_id(env):
    """The trainer's stream over the WordPiece data hides labels behind the tokenizer's
    [MASK] (5 here, SentencePiece's 4 is [SEP]), never masks special ids, pads with [PAD]."""
    tok = env["toks"]["wordpiece"]
    ds = ShardDataset(env["outs"]["wordpiece"], "train")
    assert (ds.mask_id, ds.pad_id, ds.cls_id, ds.sep_id) == (
        tok.mask_token_id, tok.pad_token_id, tok.cls_token_id, tok.sep_token_id)  # fmt: skip
    stream = MixtureBatches(["wp"], [ds], [1.0], rank=0, world_size=1, micro_batch_size=32, seed=0)
    batch = stream.next_batch()
    labelled = batch["labels"] != -100
    shown = batch["input_ids"][labelled]
    assert labelled.sum() > 50
    assert 0.6 < float((shown == tok.mask_token_id).float().mean()) < 0.95
    assert (batch["input_ids"][~labelled] != tok.mask_token_id).all()
    specials = torch.tensor(sorted(set(special_ids(tok).values())))
    assert not torch.isin(batch["labels"][labelled], specials).any()


def save_bert(path: Path, vocab: int, tok=None, **over):
    """A random BertForMaskedLM (pad 0, 64 positions); ``tok`` saved beside it if given."""
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=vocab, max_position_embeddings=SEQ, hidden_size=32,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, **over)  # fmt: skip
    transformers.BertForMaskedLM(cfg).save_pretrained(str(path))
    if tok is not None:
        tok.save_pretrained(str(path))


def model_cfg(path: Path):
    from linformer_ds.model import ModelConfig
    from linformer_ds.warm_start import model_section, read_source_config

    hf = read_source_config(str(path))
    return ModelConfig(**model_section(hf, max_seq_len=SEQ, k=16))


def test_warm_start_must_agree_with_the_data(env, tmp_path):
    """WarmStart (the trainer's check at start): the source with the data's vocabulary and
    special ids is accepted; another vocabulary size, or another pad id, is refused in one line
    naming it; a tokenizer saved beside the source is compared too."""
    from linformer_ds.warm_start import WarmStart, WarmStartError

    tok = env["toks"]["wordpiece"]
    ds = ShardDataset(env["outs"]["wordpiece"], "train")
    cfg = type("Cfg", (), {})()
    cfg.checkpoint = type("C", (), {})()
    for name, vocab, over, bad in (
        ("same", len(tok), {}, None),
        ("bigger", len(tok) + 10, {}, f"vocabulary has {len(tok) + 10} ids"),
        ("pad", len(tok), {"pad_token_id": 2}, "special ids differ from the data's tokenizer"),
    ):
        src = tmp_path / name
        save_bert(src, vocab, tok if name == "same" else None, **over)
        cfg.model, cfg.checkpoint.init_from = model_cfg(src), f"hf:{src}"
        if bad is None:
            WarmStart.for_run(cfg, None, ds)
            continue
        with pytest.raises(WarmStartError) as e:
            WarmStart.for_run(cfg, None, ds)
        msg = str(e.value)
        assert msg.startswith("checkpoint.init_from: hf:") and "\n" not in msg and bad in msg
        if name == "pad":
            assert "pad 2 (data: 0)" in msg
    # a source whose saved tokenizer is the BPE one (same size, other special ids): refused
    src = tmp_path / "other_tokenizer"
    save_bert(src, len(tok), env["toks"]["bpe"])
    cfg.model, cfg.checkpoint.init_from = model_cfg(src), f"hf:{src}"
    with pytest.raises(WarmStartError, match=r"unk 3 \(data: 2\)"):
        WarmStart.for_run(cfg, None, ds)


@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(k=st.integers(2, 60), seed=st.integers(0, 2**16))
def test_warm_start_refuses_a_tokenizer_with_other_pieces(env, tmp_path_factory, k, seed):
    """The WordPiece tokenizer beside the source with k of its non-special pieces permuted
    (same size, same special ids): the trainer's check refuses in one line with the count
    (issue 45: 985 of 1,000 ids meant other strings and the run started)."""
    from linformer_ds.warm_start import WarmStart, WarmStartError

    tok = env["toks"]["wordpiece"]
    ds = ShardDataset(env["outs"]["wordpiece"], "train")
    src = tmp_path_factory.mktemp("permuted")
    save_bert(src, len(tok), tok)
    spec = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = spec["model"]["vocab"]
    specials = set(special_ids(tok).values()) | {1}
    rng = random.Random(seed)
    moved = rng.sample(sorted(set(vocab.values()) - specials), k)
    by_id = {i: p for p, i in vocab.items()}
    for a, b in zip(moved, moved[1:] + moved[:1]):  # a cycle: every moved id gets another piece
        vocab[by_id[a]] = b
    (src / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    cfg = type("Cfg", (), {})()
    cfg.checkpoint = type("C", (), {})()
    cfg.model, cfg.checkpoint.init_from = model_cfg(src), f"hf:{src}"
    with pytest.raises(WarmStartError) as e:
        WarmStart.for_run(cfg, None, ds)
    msg = str(e.value)
    assert msg.startswith("checkpoint.init_from: hf:") and "\n" not in msg
    assert f"{k} of {len(tok)} ids are other pieces (id {min(moved)}:" in msg, msg


def test_warm_start_trains_exports_with_the_tokenizer_and_finetunes(env, tmp_path, capfd):
    """A BERT whose vocabulary is the WordPiece tokenizer's, warm-started by the trainer on the
    WordPiece data: the loss goes down; the export carries the tokenizer (AutoTokenizer loads
    it; config ids are its ids) and fine-tunes."""
    from linformer_ds.export import export_checkpoint
    from linformer_ds.finetune import main as finetune_main

    tok = env["toks"]["wordpiece"]
    src = tmp_path / "bert"
    save_bert(src, len(tok), tok)
    run = tmp_path / "run"
    over = [f"checkpoint.init_from=hf:{src}", f"model.vocab_size={len(tok)}",
            "model.hidden_size=32", "model.num_heads=4", "model.intermediate_size=64",
            "model.norm=post", "model.layer_norm_eps=1e-12", f"model.max_seq_len={SEQ}",
            "model.k=16", "train.max_steps=12", "scheduler.warmup_steps=2", "optimizer.lr=3e-3",
            "checkpoint.save_interval=12", "deepspeed.precision=fp32"]  # fmt: skip
    r = run_pretrain(env["outs"]["wordpiece"], run, over, nproc=1, launcher="python", check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"[init] weights from hf:{src} (bert" in r.stdout
    losses = [m["loss"] for _, m in sorted(read_metrics(run).items())]
    assert len(losses) == 12 and sum(losses[-3:]) < sum(losses[:3]), losses

    out = Path(export_checkpoint(str(run / "checkpoints"), str(tmp_path / "export")))
    assert (out / "tokenizer.json").is_file() and not (out / "tokenizer.model").exists()
    loaded = transformers.AutoTokenizer.from_pretrained(str(out), trust_remote_code=True)
    text = "the quick brown fox\nnaïve café"
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert loaded.model_max_length == SEQ and "token_type_ids" not in loaded(text)
    config = json.loads((out / "config.json").read_text())
    assert (config["pad_token_id"], config["mask_token_id"], config["cls_token_id"],
            config["sep_token_id"]) == (0, tok.mask_token_id, tok.cls_token_id,
                                        tok.sep_token_id)  # fmt: skip
    model = transformers.AutoModelForMaskedLM.from_pretrained(str(out), trust_remote_code=True)
    batch = loaded(["hello world", "alpha beta gamma delta"], padding=True, return_tensors="pt")
    assert model(**batch).logits.shape[-1] == len(tok)

    rng = random.Random(0)
    rows = [{"text": " ".join(rng.choice(WORDS[:8] if y else WORDS[-8:]) for _ in range(6)),
             "label": str(y)} for y in (0, 1) * 12]  # fmt: skip
    (tmp_path / "task.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ft = tmp_path / "ft"
    capfd.readouterr()
    assert finetune_main(["--model", str(out), "--train", str(tmp_path / "task.jsonl"),
                          "--epochs", "1", "--batch-size", "8", "--out", str(ft)]) == 0  # fmt: skip
    assert "custom code" not in "".join(capfd.readouterr())  # no remote-code prompt
    again = transformers.AutoTokenizer.from_pretrained(str(ft), trust_remote_code=True)
    assert again(text)["input_ids"] == tok(text)["input_ids"]


def _lowercase_off(tok_dir: Path) -> None:
    """Turn lowercasing off in the tokenizer saved in ``tok_dir``, every piece left at its id
    (tokenizer.json's normalizer and tokenizer_config.json's do_lower_case, as a user editing a
    copy of BERT's would)."""
    spec = json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8"))
    spec["normalizer"]["lowercase"] = False
    (tok_dir / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    cfg["do_lower_case"] = False
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")


def test_warm_start_refuses_the_sources_tokenizer_with_lowercasing_off(env, tmp_path, capsys):
    """The tokenizer saved beside the source is the data's (accepted, by content); the same with
    lowercasing turned off (every piece at its id, so a check of the pieces passed it) is
    refused by the trainer's check and by launch/convert.py --data in one line naming both
    files and the normalizer's difference."""
    from linformer_ds.warm_start import WarmStart, WarmStartError
    from linformer_ds.warm_start import main as convert_main

    tok, data = env["toks"]["wordpiece"], env["outs"]["wordpiece"]
    ds = ShardDataset(data, "train")
    src = tmp_path / "bert"
    save_bert(src, len(tok), tok)
    cfg = type("Cfg", (), {})()
    cfg.checkpoint = type("C", (), {})()
    cfg.model, cfg.checkpoint.init_from = model_cfg(src), f"hf:{src}"
    note = WarmStart.for_run(cfg, None, ds).note
    assert note.startswith("tokenizer: ") and "the source's tokenizer.json" in note, note
    # what an export writes (save_pretrained with N_max, the mask stripping left spaces) is
    # the data's tokenizer by content, and the export records its sha256
    from linformer_ds.model_dir import write_tokenizer
    from linformer_ds.tokenizer_identity import check_tokenizers, of_data, of_file, record

    exp = tmp_path / "export"
    exp.mkdir()
    write_tokenizer(str(exp), str(data / "tokenizer"), SEQ)
    assert "normalizer and pre-tokenizer equal" in check_tokenizers(
        of_data(str(data)), of_file(str(exp / "tokenizer.json"), sha256=record(str(exp))["files"]
                                    ["tokenizer.json"]))  # fmt: skip
    _lowercase_off(src)
    with pytest.raises(WarmStartError) as e:
        WarmStart.for_run(cfg, None, ds)
    msg = str(e.value)
    assert "\n" not in msg and "normalizer differs (lowercase: true vs false)" in msg, msg
    assert str(data / "tokenizer" / "tokenizer.json") in msg and str(src / "tokenizer.json") in msg
    capsys.readouterr()
    argv = ["--from", f"hf:{src}", "--data", str(data), f"model.max_seq_len={SEQ}", "model.k=16"]
    assert convert_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "normalizer differs (lowercase: true vs false)" in err


def test_unk_rate_is_the_tokenizers_own_count_and_warns_above_the_threshold(env, tmp_path, capfd):
    """The manifest's ``unk``: the unknown token's count among the content tokens, equal to the
    tokenizer's own encoding of the documents (counted here); the summary says it. The same
    WordPiece with lowercasing turned off, on the corpus with each line capitalised: above 1 %,
    one warning line with the rate and the threshold; the unchanged tokenizer: none."""
    from data_prep.unk_rate import WARN_RATE

    def unk_of(tok, docs):
        ids = [own_encode(tok, d) for d in docs]
        return sum(x.count(tok.unk_token_id) for x in ids), sum(map(len, ids))

    m = json.loads((env["outs"]["wordpiece"] / "manifest.json").read_text())
    unk, content = unk_of(env["toks"]["wordpiece"], env["docs"])
    assert (m["unk"]["tokens"], m["unk"]["content"]) == (unk, content)
    assert m["unk"]["warn_above"] == WARN_RATE == 0.01

    corpus = tmp_path / "capitalised"
    corpus.mkdir()
    docs = ["\n".join(ln[:1].upper() + ln[1:] for ln in d.split("\n")) for d in env["docs"]]
    for i, d in enumerate(docs):
        (corpus / f"doc{i:03d}.txt").write_text(d, encoding="utf-8")
    cased = tmp_path / "cased_copy"
    shutil.copytree(env["dirs"]["wordpiece"], cased)
    _lowercase_off(cased)
    for name, tok_dir in (("uncased", env["dirs"]["wordpiece"]), ("cased", cased)):
        out = tmp_path / name
        capfd.readouterr()
        argv = ["--source", str(corpus), "--out", str(out), "--tokenizer", str(tok_dir),
                "--seq-len", str(SEQ), "--valid-fraction", str(VALID), "--workers", "0"]  # fmt: skip
        assert data_prep_main(argv) == 0
        err = capfd.readouterr().err
        rec = json.loads((out / "manifest.json").read_text())["unk"]
        tok = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
        read = list(Source([str(corpus)], "text", DEFAULT_MAX_DOC_BYTES, "utf-8"))
        assert (rec["tokens"], rec["content"]) == unk_of(tok, read)
        assert f"unknown token '[UNK]': {rec['rate']:.4%} of the content tokens" in err
        warned = [ln for ln in err.splitlines() if "warning" in ln and "unknown token" in ln]
        if name == "uncased":
            assert rec["rate"] <= WARN_RATE and not warned, err
        else:
            assert rec["rate"] > WARN_RATE and len(warned) == 1, err
            assert (
                f"{rec['rate']:.2%} of the content tokens" in warned[0] and "above 1%" in warned[0]
            )
