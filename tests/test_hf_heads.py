"""The export's task heads, attention implementations, activation checkpointing and old head
weights, used as downstream users use them, in one process that cannot import linformer_ds
(``python -I``, as in test_export.py): token classification, extractive QA and multiple choice
through the Auto classes, each fine-tuned with ``transformers.Trainer`` on tiny data written
here, saved and reloaded to identical outputs."""

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

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SEQ, VOCAB, LAYERS = 64, 1200, 3  # VOCAB >= 1024: the tokenizer has byte fallback
WORDS = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]
NUMBERS = ["12", "345", "6789", "90", "271", "8"]


def tiny_export(root: Path, **model_options) -> Path:
    """A randomly initialised MLM export (data_prep tokenizer on stdlib modules, hybrid layers;
    ``model_options`` override the ModelConfig)."""
    from data_prep.tokenizer import document_lines, train_tokenizer
    from linformer_ds.export import TIED_KEY, write_model_dir
    from linformer_ds.model import LinformerForMaskedLM, ModelConfig

    files = [STDLIB / "_pydecimal.py", *sorted((STDLIB / "email").glob("*.py"))]
    lines = [ln for f in files for ln in document_lines(f.read_text(encoding="utf-8"))]
    sp_path = train_tokenizer(lines, str(root / "sp.model"), VOCAB)
    mc = ModelConfig(
        vocab_size=VOCAB, max_seq_len=SEQ, hidden_size=32, num_layers=LAYERS, num_heads=2,
        intermediate_size=64, k=16, projection="hybrid", hybrid_linear_layers=2, dropout=0.1,
        attention_dropout=0.0, **model_options,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LinformerForMaskedLM(mc)
    out = root / "export"
    write_model_dir(str(out), mc, {k: v for k, v in model.state_dict().items() if k != TIED_KEY},
                    sp_path)  # fmt: skip
    return out


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    return tiny_export(tmp_path_factory.mktemp("heads"))


def tagging_data(n: int, seed: int) -> list:
    """Texts of words and numbers; the task: which characters belong to numbers."""
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(NUMBERS if rng.random() < 0.3 else WORDS) for _ in range(rng.randint(4, 9)))
        for _ in range(n)
    ]  # fmt: skip


HEADS = textwrap.dedent(
    """
    import json, sys, warnings
    sys.meta_path[:] = [f for f in sys.meta_path if "linformer_ds" not in getattr(f, "__module__", "")]
    warnings.filterwarnings("ignore")
    import torch
    torch.set_num_threads(1)
    from safetensors.torch import load_file, save_file
    from transformers import (AutoModel, AutoModelForMultipleChoice, AutoModelForQuestionAnswering,
                              AutoModelForSequenceClassification, AutoModelForTokenClassification,
                              AutoTokenizer, Trainer, TrainingArguments, default_data_collator)
    out, data_path, tmp = sys.argv[1], sys.argv[2], sys.argv[3]
    data = json.loads(open(data_path).read())
    res = {}
    try:
        import linformer_ds  # noqa: F401
        res["importable"] = True
    except ImportError:
        res["importable"] = False
    tok = AutoTokenizer.from_pretrained(out)
    d = lambda a, b: (a - b).abs().max().item()

    # tokenizer: ids and text back (byte fallback carried into tokenizer.json)
    res["tok"] = {t: {"ids": tok(t)["input_ids"], "text": tok.decode(tok(t)["input_ids"],
                      skip_special_tokens=True)} for t in data["tok_texts"]}

    def train(model, rows, name, steps=40, **extra):
        args = TrainingArguments(output_dir=f"{tmp}/{name}_work", per_device_train_batch_size=16,
                                 max_steps=steps, learning_rate=3e-3, warmup_steps=3, report_to=[],
                                 save_strategy="no", logging_steps=1, use_cpu=True, seed=0,
                                 dataloader_num_workers=0, disable_tqdm=True, **extra)
        trainer = Trainer(model=model, args=args, train_dataset=rows,
                          data_collator=default_data_collator)
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return trainer, losses

    def pad(enc):
        return tok.pad(enc, padding="max_length", max_length=48, return_tensors="pt")

    def reload(cls, model, name, batch):
        model.save_pretrained(f"{tmp}/{name}")
        again = cls.from_pretrained(f"{tmp}/{name}", trust_remote_code=True).eval()
        model.eval()
        with torch.no_grad():
            a, b = model(**batch), again(**batch)
        return max(d(a[k], b[k]) for k in a.keys() if k != "loss"), type(again).__name__

    # ---- token classification: which tokens hold digits
    texts = data["tagging"]
    enc = tok(texts, return_offsets_mapping=True, truncation=True, max_length=48)
    rows = []
    for t, ids, offs in zip(texts, enc["input_ids"], enc["offset_mapping"]):
        labels = [-100 if s == e else int(any(c.isdigit() for c in t[s:e])) for s, e in offs]
        rows.append({"input_ids": ids, "labels": labels})
    batch = pad([{"input_ids": r["input_ids"]} for r in rows])
    labels = torch.full(batch["input_ids"].shape, -100)
    for i, r in enumerate(rows):
        labels[i, :len(r["labels"])] = torch.tensor(r["labels"])
    rows = [{"input_ids": batch["input_ids"][i], "attention_mask": batch["attention_mask"][i],
             "labels": labels[i]} for i in range(len(rows))]
    model = AutoModelForTokenClassification.from_pretrained(out, trust_remote_code=True, num_labels=2)
    _, losses = train(model, rows, "tag")
    model.eval()
    with torch.no_grad():
        pred = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.argmax(-1)
    keep = labels != -100
    res["tag"] = {"losses": losses, "acc": (pred[keep] == labels[keep]).float().mean().item(),
                  "majority": max(labels[keep].float().mean().item(), 1 - labels[keep].float().mean().item())}
    res["tag"]["reload"], res["tag"]["class"] = reload(
        AutoModelForTokenClassification, model, "tag_saved",
        {"input_ids": batch["input_ids"][:8], "attention_mask": batch["attention_mask"][:8]})

    # ---- extractive QA: where is the number
    rows, qa_in = [], []
    for q, ctx, ans in data["qa"]:
        e = tok(q, ctx, return_offsets_mapping=True, truncation=True, max_length=48)
        seq = e.sequence_ids()
        start = ctx.index(ans)
        end = start + len(ans)
        toks = [i for i, (s, t) in enumerate(e["offset_mapping"]) if seq[i] == 1 and s < end and t > start]
        p = pad({"input_ids": e["input_ids"]})
        rows.append({"input_ids": p["input_ids"], "attention_mask": p["attention_mask"],
                     "start_positions": toks[0], "end_positions": toks[-1]})
    model = AutoModelForQuestionAnswering.from_pretrained(out, trust_remote_code=True)
    _, losses = train(model, rows, "qa")
    batch = {k: torch.stack([r[k] for r in rows[:32]]) for k in ("input_ids", "attention_mask")}
    model.eval()
    with torch.no_grad():
        o = model(**batch)
    gold = torch.tensor([[r["start_positions"], r["end_positions"]] for r in rows[:32]])
    res["qa"] = {"losses": losses, "start_acc": (o.start_logits.argmax(-1) == gold[:, 0]).float().mean().item()}
    res["qa"]["reload"], res["qa"]["class"] = reload(AutoModelForQuestionAnswering, model, "qa_saved", batch)

    # ---- multiple choice: the choice that names a number
    rows = []
    for prompt, choices, label in data["mc"]:
        e = [pad({"input_ids": tok(prompt, c, truncation=True, max_length=48)["input_ids"]}) for c in choices]
        rows.append({"input_ids": torch.stack([x["input_ids"] for x in e]),
                     "attention_mask": torch.stack([x["attention_mask"] for x in e]), "labels": label})
    model = AutoModelForMultipleChoice.from_pretrained(out, trust_remote_code=True)
    _, losses = train(model, rows, "mc")
    batch = {k: torch.stack([r[k] for r in rows[:32]]) for k in ("input_ids", "attention_mask")}
    model.eval()
    with torch.no_grad():
        lg = model(**batch).logits
    gold = torch.tensor([r["labels"] for r in rows[:32]])
    res["mc"] = {"losses": losses, "shape": list(lg.shape), "acc": (lg.argmax(-1) == gold).float().mean().item()}
    res["mc"]["reload"], res["mc"]["class"] = reload(AutoModelForMultipleChoice, model, "mc_saved", batch)

    # ---- attention implementations
    b = tok(texts[:4], padding=True, return_tensors="pt")
    hs = {}
    for impl in ("sdpa", "eager", None):
        m = AutoModel.from_pretrained(out, trust_remote_code=True, attn_implementation=impl).eval()
        with torch.no_grad():
            hs[str(impl)] = (m.config._attn_implementation, m(**b).last_hidden_state)
    res["attn"] = {"names": {k: v[0] for k, v in hs.items()},
                   "eager_vs_sdpa": d(hs["eager"][1], hs["sdpa"][1])}
    try:
        AutoModel.from_pretrained(out, trust_remote_code=True, attn_implementation="flash_attention_2")
        res["attn"]["flash"] = None
    except (ValueError, ImportError) as e:
        res["attn"]["flash"] = str(e)[:200]

    # ---- Trainer(gradient_checkpointing=True): same training as without
    rows = [dict(tok(t, truncation=True, max_length=48, padding="max_length"), labels=int(any(c.isdigit() for c in t)))
            for t in texts[:64]]
    final = {}
    for gc in (False, True):
        torch.manual_seed(0)
        model = AutoModelForSequenceClassification.from_pretrained(out, trust_remote_code=True, num_labels=2)
        trainer, losses = train(model, rows, f"gc{gc}", steps=3, gradient_checkpointing=gc)
        final[gc] = ({k: v.detach().clone() for k, v in model.state_dict().items()}, losses,
                     model.is_gradient_checkpointing, model.encoder._checkpoint_fn is not None)
    init = load_file(f"{out}/model.safetensors")
    res["gc"] = {"params": max(d(final[False][0][k], final[True][0][k]) for k in final[False][0]),
                 "moved": max(d(final[True][0][k], init[k]) for k in init if k.startswith("encoder.layers")),
                 "losses": [final[False][1], final[True][1]], "on": [final[False][2], final[True][2]],
                 "fn": [final[False][3], final[True][3]]}
    m = AutoModelForSequenceClassification.from_pretrained(out, trust_remote_code=True, num_labels=2).train()
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True},
                                    every_n_layers=2, offload=True)
    res["gc"]["every_2"] = sorted(m.encoder._checkpoint_layers)
    m.gradient_checkpointing_disable()
    res["gc"]["off"] = m.is_gradient_checkpointing

    # ---- exports written before the RoBERTa layout (pooler.* + classifier.*) still load
    clf = AutoModelForSequenceClassification.from_pretrained(out, trust_remote_code=True, num_labels=3).eval()
    clf.save_pretrained(f"{tmp}/legacy")
    old = {"classifier.dense.": "pooler.", "classifier.out_proj.": "classifier."}
    sd = load_file(f"{tmp}/legacy/model.safetensors")
    renamed = {}
    for k, v in sd.items():
        for new, was in old.items():
            k = k.replace(new, was) if k.startswith(new) else k
        renamed[k] = v
    save_file(renamed, f"{tmp}/legacy/model.safetensors", metadata={"format": "pt"})
    again = AutoModelForSequenceClassification.from_pretrained(f"{tmp}/legacy", trust_remote_code=True).eval()
    again.save_pretrained(f"{tmp}/resaved")
    with torch.no_grad():
        res["legacy"] = {"keys": sorted(k for k in renamed if not k.startswith("encoder.")),
                         "diff": d(clf(**b).logits, again(**b).logits),
                         "resaved": sorted(k for k in load_file(f"{tmp}/resaved/model.safetensors")
                                           if not k.startswith("encoder."))}
    print("RESULT " + json.dumps(res))
    """
)


def _mean(xs: list) -> float:
    return sum(xs) / len(xs)


def test_heads_attention_checkpointing_in_transformers_only_process(export, tmp_path):
    """Token classification, QA and multiple choice train with Trainer (loss falls, better than
    chance) and reload to identical outputs; sdpa/eager/default attention agree; Trainer with
    gradient_checkpointing=True ends with the same weights as without; old head names load;
    the exported tokenizer decodes byte-fallback text back."""
    import sentencepiece as spm

    from data_prep.tokenizer import normalized

    rng = random.Random(1)
    tagging = tagging_data(192, seed=2)
    qa = []
    for _ in range(192):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 8))]
        ans = rng.choice(NUMBERS)
        words.insert(rng.randrange(len(words) + 1), ans)
        qa.append(("which number?", " ".join(words), ans))
    mc = []
    for _ in range(192):
        right = f"{rng.choice(WORDS)} {rng.choice(NUMBERS)}"
        wrong = f"{rng.choice(WORDS)} {rng.choice(WORDS)}"
        label = rng.randrange(2)
        mc.append(("pick the number", [wrong, right] if label else [right, wrong], label))
    tok_texts = [
        "KJV: (Uzziah) - Vashti! said the LORD.",
        "snow \u2603 and \u65e5\u672c, caf\u00e9",
    ]
    data = tmp_path / "data.json"
    data.write_text(json.dumps({"tagging": tagging, "qa": qa, "mc": mc, "tok_texts": tok_texts}))
    res = run_fresh(HEADS, [str(export), str(data), str(tmp_path)], cwd=tmp_path, timeout=900)
    summary = {k: {a: b for a, b in v.items() if a != "losses"} if isinstance(v, dict) else v
               for k, v in res.items()}  # fmt: skip
    print(json.dumps(summary, indent=1))
    assert res["importable"] is False

    sp = spm.SentencePieceProcessor(model_file=str(export / "tokenizer.model"))
    for text, got in res["tok"].items():
        assert got["ids"] == [2, *sp.encode(text), 3]
        assert got["text"] == normalized(sp, text) == text  # nothing lost (no <unk>)

    for head in ("tag", "qa", "mc"):
        r = res[head]
        assert _mean(r["losses"][-5:]) < 0.7 * _mean(r["losses"][:5]), (head, r["losses"])
        assert r["reload"] == 0.0, head
    assert res["tag"]["class"] == "LinformerForTokenClassification"
    assert res["tag"]["acc"] >= 0.95 > res["tag"]["majority"] + 0.1
    assert res["qa"]["class"] == "LinformerForQuestionAnswering" and res["qa"]["start_acc"] >= 0.8
    assert res["mc"]["class"] == "LinformerForMultipleChoice" and res["mc"]["shape"] == [32, 2]
    assert res["mc"]["acc"] >= 0.8

    assert res["attn"]["names"] == {"sdpa": "sdpa", "eager": "eager", "None": "sdpa"}
    assert res["attn"]["eager_vs_sdpa"] <= 1e-5
    assert "Flash Attention 2" in res["attn"]["flash"]

    gc = res["gc"]
    assert gc["on"] == [False, True] and gc["fn"] == [False, True]
    assert gc["losses"][0] == gc["losses"][1] and gc["params"] == 0.0 and gc["moved"] > 0
    assert gc["every_2"] == [0, 2] and gc["off"] is False

    lg = res["legacy"]
    assert lg["keys"] == ["classifier.bias", "classifier.weight", "pooler.bias", "pooler.weight"]
    assert lg["diff"] == 0.0
    assert lg["resaved"] == [f"classifier.{m}.{p}" for m in ("dense", "out_proj")
                             for p in ("bias", "weight")]  # fmt: skip
