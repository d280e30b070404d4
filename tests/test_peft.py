"""PEFT LoRA on an export with PEFT's default settings (only ``target_modules`` named, as for
any model PEFT has no table entry for): the whole classification head is trained and saved with
the adapter (``modules_to_save`` covers ``classifier``), so a process without linformer_ds that
loads the base model and the adapter predicts exactly as the trained model did.
sentence-transformers on the same export: mean pooling equals the encoder's masked mean."""

import json
import random
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_export import run_fresh  # noqa: E402
from test_hf_heads import NUMBERS, WORDS, tiny_export  # noqa: E402


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    return tiny_export(tmp_path_factory.mktemp("peft"))


TRAIN = textwrap.dedent(
    """
    import json, sys, warnings
    sys.meta_path[:] = [f for f in sys.meta_path if "linformer_ds" not in getattr(f, "__module__", "")]
    warnings.filterwarnings("ignore")
    import torch
    torch.set_num_threads(1)
    from peft import LoraConfig, TaskType, get_peft_model
    from transformers import (AutoModelForSequenceClassification, AutoTokenizer,
                              DataCollatorWithPadding, Trainer, TrainingArguments)
    out, data_path, adapter = sys.argv[1], sys.argv[2], sys.argv[3]
    data = json.loads(open(data_path).read())
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForSequenceClassification.from_pretrained(out, trust_remote_code=True, num_labels=2)
    config = LoraConfig(task_type=TaskType.SEQ_CLS, target_modules=["qkv", "out"])
    model = get_peft_model(model, config)
    trainable = sorted(n.replace("base_model.model.", "").replace(".modules_to_save.default", "")
                       for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n)
    enc = lambda rows: [dict(tok(t, truncation=True, max_length=48), labels=y) for t, y in rows]
    args = TrainingArguments(output_dir=adapter + "_work", per_device_train_batch_size=16,
                             num_train_epochs=6, learning_rate=5e-3, warmup_steps=5, report_to=[],
                             save_strategy="no", logging_strategy="no", use_cpu=True, seed=0,
                             dataloader_num_workers=0, disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=enc(data["train"]),
            data_collator=DataCollatorWithPadding(tok)).train()
    model.save_pretrained(adapter)
    model.eval()
    texts = [t for t, _ in data["test"]]
    with torch.no_grad():
        logits = model(**tok(texts, padding=True, return_tensors="pt")).logits
    print("RESULT " + json.dumps({"pred": logits.argmax(-1).tolist(), "logits": logits.tolist(),
                                  "trainable": trainable,
                                  "modules_to_save": sorted(model.peft_config["default"].modules_to_save or [])}))
    """
)

RELOAD = textwrap.dedent(
    """
    import json, sys, warnings
    sys.meta_path[:] = [f for f in sys.meta_path if "linformer_ds" not in getattr(f, "__module__", "")]
    warnings.filterwarnings("ignore")
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer
    out, data_path, adapter = sys.argv[1], sys.argv[2], sys.argv[3]
    texts = [t for t, _ in json.loads(open(data_path).read())["test"]]
    tok = AutoTokenizer.from_pretrained(out)
    base = AutoModelForSequenceClassification.from_pretrained(out, trust_remote_code=True, num_labels=2)
    model = PeftModel.from_pretrained(base, adapter).eval()
    batch = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
    saved = sorted(load_file(adapter + "/adapter_model.safetensors"))
    res = {"pred": logits.argmax(-1).tolist(), "logits": logits.tolist(),
           "head_saved": [k for k in saved if "classifier" in k]}

    from sentence_transformers import SentenceTransformer, models
    word = models.Transformer(out, model_args={"trust_remote_code": True},
                              config_args={"trust_remote_code": True})
    st = SentenceTransformer(modules=[word, models.Pooling(word.get_word_embedding_dimension(), "mean")],
                             device="cpu")
    emb = st.encode(texts[:8], convert_to_tensor=True)
    enc = AutoModel.from_pretrained(out, trust_remote_code=True).eval()
    b = tok(texts[:8], padding=True, return_tensors="pt")
    with torch.no_grad():
        h = enc(**b).last_hidden_state
    m = b["attention_mask"].unsqueeze(-1).float()
    res["st_vs_mean"] = (emb - (h * m).sum(1) / m.sum(1)).abs().max().item()
    print("RESULT " + json.dumps(res))
    """
)


COLOURS = ["red", "green", "blue", "black", "white", "brown", "pink", "grey"]


def sentences(label: int, rng: random.Random) -> str:
    """A separable task: class 0 sentences are Greek letter names, class 1 ones colours, both
    with numbers mixed in."""
    words = [rng.choice(COLOURS if label else WORDS) for _ in range(rng.randint(5, 10))]
    words.insert(rng.randrange(len(words) + 1), rng.choice(NUMBERS))
    return " ".join(words)


def test_lora_default_settings_survive_reload(export, tmp_path):
    rng = random.Random(0)
    rows = [(sentences(y, rng), y) for y in [0, 1] * 160]
    train, test = rows[:200], rows[200:]
    data = tmp_path / "data.json"
    data.write_text(json.dumps({"train": train, "test": test}))
    adapter = tmp_path / "adapter"
    a = run_fresh(TRAIN, [str(export), str(data), str(adapter)], cwd=tmp_path, timeout=600)
    b = run_fresh(RELOAD, [str(export), str(data), str(adapter)], cwd=tmp_path, timeout=600)
    gold = [y for _, y in test]
    acc = [sum(p == y for p, y in zip(r["pred"], gold)) / len(gold) for r in (a, b)]
    diff = max(abs(x - y) for ra, rb in zip(a["logits"], b["logits"]) for x, y in zip(ra, rb))
    print(f"LoRA accuracy before saving {acc[0]:.4f}, after reload {acc[1]:.4f}, "
          f"max logit difference {diff:.2e}; trainable besides LoRA: {a['trainable']}")  # fmt: skip
    assert a["modules_to_save"] == ["classifier", "score"]  # PEFT's defaults for SEQ_CLS
    assert a["trainable"] == ["classifier.dense.bias", "classifier.dense.weight",
                              "classifier.out_proj.bias", "classifier.out_proj.weight"]  # fmt: skip
    assert len(b["head_saved"]) == 4  # the pooler (classifier.dense) travels with the adapter
    assert a["pred"] == b["pred"] and acc[0] == acc[1] and diff <= 1e-5
    assert acc[0] >= 0.9, acc  # it learned (chance: 0.5)
    assert b["st_vs_mean"] <= 1e-5
