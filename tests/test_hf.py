"""The export as a Hugging Face encoder, used the way downstream users use one, in processes that
cannot import linformer_ds (``python -I``, as in test_export.py): tokenizer round trips through
``Trainer.save_model``, ``resize_token_embeddings``, ``output_hidden_states`` / ``inputs_embeds``,
refused arguments, left padding, special ids in ``config.json``."""

import json
import random
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_export import run_fresh  # noqa: E402
from test_finetune import _snippets  # noqa: E402

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SEQ, VOCAB, LAYERS = 64, 600, 3
TEXTS = [
    "def f(x): return x",
    "import json as j, sys  # a longer line than the first one, with more tokens",
    "class Decimal(object):",
]


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> dict:
    """An exported MLM (data_prep tokenizer, hybrid linear/conv layers) and the project model's
    own hidden states and logits on a right-padded batch (the reference)."""
    from transformers import AutoTokenizer

    from data_prep.tokenizer import document_lines, train_tokenizer
    from linformer_ds.export import TIED_KEY, write_model_dir
    from linformer_ds.model import LinformerForMaskedLM, ModelConfig

    root = tmp_path_factory.mktemp("hf")
    files = [STDLIB / "_pydecimal.py", *sorted((STDLIB / "email").glob("*.py"))]
    lines = [ln for f in files for ln in document_lines(f.read_text(encoding="utf-8"))]
    sp_path = train_tokenizer(lines, str(root / "sp.model"), VOCAB)
    mc = ModelConfig(
        vocab_size=VOCAB, max_seq_len=SEQ, hidden_size=32, num_layers=LAYERS, num_heads=2,
        intermediate_size=64, k=16, projection="hybrid", hybrid_linear_layers=2, dropout=0.1,
        attention_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LinformerForMaskedLM(mc).eval()
    out = root / "export"
    state = {k: v for k, v in model.state_dict().items() if k != TIED_KEY}
    write_model_dir(str(out), mc, state, sp_path)

    # reference: the project's encoder, its intermediate outputs read by forward hooks
    tok = AutoTokenizer.from_pretrained(out)
    batch = tok(TEXTS, padding=True, return_tensors="pt")
    enc = model.encoder
    seen: list = []
    hooks = [enc.drop.register_forward_hook(lambda m, i, o: seen.append(o))]
    hooks += [layer.register_forward_hook(lambda m, i, o: seen.append(o)) for layer in enc.layers]
    with torch.no_grad():
        logits = model(batch["input_ids"], batch["attention_mask"]).logits
    for h in hooks:
        h.remove()
    hidden = seen[:LAYERS] + [enc.final_ln(seen[LAYERS])]  # embeddings, layer inputs, output
    ref = root / "ref.pt"
    torch.save({**batch, "hidden": hidden, "logits": logits}, ref)
    return {"root": root, "out": out, "ref": ref}


FORWARD = textwrap.dedent(
    """
    import json, sys
    sys.meta_path[:] = [f for f in sys.meta_path if "linformer_ds" not in getattr(f, "__module__", "")]
    import torch
    from transformers import AutoModel, AutoModelForMaskedLM, AutoModelForSequenceClassification
    from transformers import AutoTokenizer
    out, ref_path, texts, tmp = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
    ref = torch.load(ref_path, weights_only=True)
    res = {}
    try:
        import linformer_ds  # noqa: F401
        res["importable"] = True
    except ImportError:
        res["importable"] = False
    tok = AutoTokenizer.from_pretrained(out)
    mlm = AutoModelForMaskedLM.from_pretrained(out, trust_remote_code=True).eval()
    base = AutoModel.from_pretrained(out, trust_remote_code=True).eval()
    clf = AutoModelForSequenceClassification.from_pretrained(
        out, trust_remote_code=True, num_labels=3).eval()
    right = tok(texts, padding=True, return_tensors="pt")
    tok.padding_side = "left"
    left = tok(texts, padding=True, return_tensors="pt")
    res["same_ids_as_ref"] = torch.equal(right["input_ids"], ref["input_ids"])
    mr, ml = right["attention_mask"].bool(), left["attention_mask"].bool()
    res["left_first_is_pad"] = bool((left["input_ids"][:, 0] == 0).any())
    d = lambda a, b: (a - b).abs().max().item()
    with torch.no_grad():
        hb = base(**right, output_hidden_states=True)
        res["n_hidden"] = len(hb.hidden_states)
        res["hidden_vs_project"] = max(d(a, b) for a, b in zip(hb.hidden_states, ref["hidden"]))
        res["last_is_output"] = torch.equal(hb.hidden_states[-1], hb.last_hidden_state)
        res["default_no_hidden"] = base(**right).hidden_states is None
        lm_r = mlm(**right, output_hidden_states=True)
        lm_l = mlm(**left, output_hidden_states=True)
        res["logits_vs_project"] = d(lm_r.logits, ref["logits"])
        res["left_vs_right_logits"] = d(lm_r.logits[mr], lm_l.logits[ml])
        res["left_vs_right_hidden"] = max(
            d(a[mr], b[ml]) for a, b in zip(lm_r.hidden_states, lm_l.hidden_states))
        c_r, c_l = clf(**right).logits, clf(**left).logits
        alone = torch.cat([clf(**tok(t, return_tensors="pt")).logits for t in texts])
        res["cls_left_vs_right"] = d(c_r, c_l)
        res["cls_left_vs_alone"] = d(c_l, alone)
        emb = mlm.get_input_embeddings()(right["input_ids"])
        res["embeds_vs_ids"] = d(mlm(inputs_embeds=emb, attention_mask=right["attention_mask"]).logits,
                                 lm_r.logits)
        res["accepted"] = d(mlm(**right, output_attentions=False,
                                token_type_ids=torch.zeros_like(right["input_ids"])).logits, lm_r.logits)
    errors = {}
    for name, value in [("output_attentions", True),
                        ("head_mask", torch.ones(2)), ("token_type_ids", right["attention_mask"]),
                        ("bogus", 1)]:
        try:
            mlm(**right, **{name: value})
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    res["errors"] = errors
    res["config_ids"] = {k: getattr(mlm.config, k + "_token_id") for k in ("bos", "eos", "pad")}
    res["tok_ids"] = {k: getattr(tok, k + "_token_id") for k in ("bos", "eos", "pad")}

    # add tokens, resize, forward, save and reload
    tok.padding_side = "right"
    v0 = mlm.config.vocab_size
    tok.add_tokens(["<new_a>", "<new_b>"])
    mlm.resize_token_embeddings(len(tok))
    ids = tok(["x = <new_b> + <new_a>"], return_tensors="pt")
    with torch.no_grad():
        lg = mlm(**ids).logits
    mlm.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    again = AutoModelForMaskedLM.from_pretrained(tmp, trust_remote_code=True).eval()
    tok2 = AutoTokenizer.from_pretrained(tmp)
    with torch.no_grad():
        lg2 = again(**tok2(["x = <new_b> + <new_a>"], return_tensors="pt")).logits
    res["resize"] = {"v0": v0, "ids": ids["input_ids"][0].tolist(), "shape": list(lg.shape),
                     "config": mlm.config.vocab_size, "reloaded_diff": d(lg, lg2),
                     "tied": again.lm_head.decoder.weight is again.encoder.token_embeddings.weight}
    print("RESULT " + json.dumps(res))
    """
)


def test_forward_semantics_in_transformers_only_process(export, tmp_path):
    """Hidden states equal the project's; left padding equals right padding at real positions;
    inputs_embeds; refusals; special ids in config.json; resize then forward (and reload)."""
    res = run_fresh(
        FORWARD,
        [str(export["out"]), str(export["ref"]), json.dumps(TEXTS), str(tmp_path / "resized")],
        cwd=tmp_path,
    )
    print(json.dumps(res, indent=1))
    assert res["importable"] is False and res["same_ids_as_ref"]
    assert res["n_hidden"] == LAYERS + 1 and res["last_is_output"] and res["default_no_hidden"]
    assert res["hidden_vs_project"] <= 1e-5 and res["logits_vs_project"] <= 1e-5
    assert res["left_first_is_pad"]
    assert res["left_vs_right_logits"] <= 1e-5 and res["left_vs_right_hidden"] <= 1e-5
    assert res["cls_left_vs_right"] <= 1e-5 and res["cls_left_vs_alone"] <= 1e-5
    assert res["embeds_vs_ids"] <= 1e-6 and res["accepted"] == 0.0
    err = res["errors"]
    assert "output_attentions is not supported" in err["output_attentions"]
    assert "head_mask is not supported" in err["head_mask"]
    assert "token_type_ids" in err["token_type_ids"] and "bogus" in err["bogus"]
    assert res["config_ids"] == res["tok_ids"] == {"bos": 2, "eos": 3, "pad": 0}
    r = res["resize"]
    assert (
        r["v0"] == VOCAB
        and r["config"] == VOCAB + 2
        and r["shape"] == [1, len(r["ids"]), VOCAB + 2]
    )
    assert VOCAB in r["ids"] and VOCAB + 1 in r["ids"]
    assert r["ids"][0] == 2 and r["ids"][-1] == 3
    assert r["reloaded_diff"] <= 1e-6 and r["tied"]


TRAIN = textwrap.dedent(
    """
    import json, logging, sys
    sys.meta_path[:] = [f for f in sys.meta_path if "linformer_ds" not in getattr(f, "__module__", "")]
    import torch
    torch.set_num_threads(1)
    from transformers import (AutoModelForSequenceClassification, AutoTokenizer,
                              DataCollatorWithPadding, Trainer, TrainingArguments)
    from transformers.utils import logging as hf_logging
    out, data_path, saved = sys.argv[1], sys.argv[2], sys.argv[3]
    data = json.loads(open(data_path).read())
    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    hf_logging.get_logger("transformers").addHandler(handler)
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForSequenceClassification.from_pretrained(
        out, trust_remote_code=True, num_labels=2)
    enc = lambda rows: [dict(tok(t, truncation=True, max_length=48), labels=y) for t, y in rows]
    args = TrainingArguments(output_dir=saved + "_work", per_device_train_batch_size=16,
                             num_train_epochs=4, learning_rate=2e-3, warmup_steps=5,
                             report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True,
                             seed=0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=enc(data["train"]),
                      data_collator=DataCollatorWithPadding(tok), processing_class=tok)
    trainer.train()
    trainer.save_model(saved)
    model.eval()
    texts = [t for t, _ in data["test"]]
    ids = tok(texts, truncation=True, max_length=48)["input_ids"]
    with torch.no_grad():
        pred = model(**tok(texts, truncation=True, max_length=48, padding=True,
                           return_tensors="pt")).logits.argmax(-1).tolist()
    print("RESULT " + json.dumps({"ids": ids, "pred": pred, "log": records}))
    """
)

RELOAD = textwrap.dedent(
    """
    import json, sys
    sys.meta_path[:] = [f for f in sys.meta_path if "linformer_ds" not in getattr(f, "__module__", "")]
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    saved, data_path = sys.argv[1], sys.argv[2]
    texts = [t for t, _ in json.loads(open(data_path).read())["test"]]
    tok = AutoTokenizer.from_pretrained(saved)
    model = AutoModelForSequenceClassification.from_pretrained(saved, trust_remote_code=True).eval()
    ids = tok(texts, truncation=True, max_length=48)["input_ids"]
    with torch.no_grad():
        pred = model(**tok(texts, truncation=True, max_length=48, padding=True,
                           return_tensors="pt")).logits.argmax(-1).tolist()
    print("RESULT " + json.dumps({"ids": ids, "pred": pred, "class": type(tok).__name__}))
    """
)


def test_trainer_save_model_keeps_tokenizer_and_accuracy(export, tmp_path):
    """transformers.Trainer fine-tunes the export, Trainer.save_model, a fresh process reloads:
    identical ids (with <s> ... </s>), identical predictions, the same accuracy."""
    rng = random.Random(0)
    dec = _snippets([STDLIB / "_pydecimal.py"])
    em = _snippets(sorted((STDLIB / "email").glob("*.py")))
    rng.shuffle(dec)
    rng.shuffle(em)
    train = [(t, 0) for t in dec[:150]] + [(t, 1) for t in em[:150]]
    test = [(t, 0) for t in dec[150:230]] + [(t, 1) for t in em[150:230]]
    rng.shuffle(train)
    data = tmp_path / "data.json"
    data.write_text(json.dumps({"train": train, "test": test}))
    saved = tmp_path / "saved"
    a = run_fresh(TRAIN, [str(export["out"]), str(data), str(saved)], cwd=tmp_path, timeout=600)
    b = run_fresh(RELOAD, [str(saved), str(data)], cwd=tmp_path)
    gold = [y for _, y in test]
    acc = [sum(p == y for p, y in zip(r["pred"], gold)) / len(gold) for r in (a, b)]
    print(f"accuracy after Trainer: {acc[0]:.3f}, after save_model + reload: {acc[1]:.3f}")
    assert b["class"] == "TokenizersBackend"
    assert a["ids"] == b["ids"] and all(i[0] == 2 and i[-1] == 3 for i in b["ids"])
    assert a["pred"] == b["pred"] and acc[0] == acc[1]
    assert acc[0] >= 0.75, acc  # it learned (chance: 0.5)
    assert not [m for m in a["log"] if "differ from the model config" in m], a["log"]


def test_portable_paths():
    from linformer_ds.export import portable_paths

    base = "/work/project"
    obj = {"a": "/work/project/runs/x", "b": ["/elsewhere/data/shards", "rel/path", 3],
           "c": {"d": "/work/project"}, "e": "/work/projectile/y"}  # fmt: skip
    assert portable_paths(obj, base) == {
        "a": "runs/x",
        "b": [".../shards", "rel/path", 3],
        "c": {"d": "."},
        "e": ".../y",
    }
