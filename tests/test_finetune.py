"""Fine-tuning an exported model on a small learnable task made from local (stdlib) text."""

import json
import random
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_export import train_tokenizer  # noqa: E402

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SEQ = 64


def _snippets(files, n_lines: int = 3) -> list:
    """Consecutive groups of ``n_lines`` non-trivial source lines, joined by spaces."""
    out = []
    for f in files:
        lines = [ln.strip() for ln in f.read_text(encoding="utf-8").splitlines()]
        lines = [ln for ln in lines if len(ln) > 8]
        out += [" ".join(lines[i : i + n_lines]) for i in range(0, len(lines) - n_lines, n_lines)]
    return out


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> dict:
    """Which module does a snippet come from: decimal arithmetic (label 'decimal') or email?"""
    root = tmp_path_factory.mktemp("ft")
    rng = random.Random(0)
    decimal = _snippets([STDLIB / "_pydecimal.py"])
    email = _snippets(sorted((STDLIB / "email").glob("*.py")))
    rng.shuffle(decimal)
    rng.shuffle(email)
    rows = {
        "train": [(t, "decimal") for t in decimal[:300]] + [(t, "email") for t in email[:300]],
        "valid": [(t, "decimal") for t in decimal[300:400]]
        + [(t, "email") for t in email[300:400]],
    }
    for split in rows.values():
        rng.shuffle(split)
    # train as CSV with custom column names, validation as JSONL
    import csv

    with open(root / "train.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["snippet", "module"])
        w.writerows(rows["train"])
    with open(root / "valid.jsonl", "w") as f:
        for text, label in rows["valid"]:
            f.write(json.dumps({"snippet": text, "module": label}) + "\n")

    # an exported (untrained) model: the same writer as launch/export.py
    from linformer_ds.export import TIED_KEY, write_model_dir
    from linformer_ds.model import LinformerForMaskedLM, ModelConfig

    sources = [STDLIB / "_pydecimal.py", *sorted((STDLIB / "email").glob("*.py"))]
    tok = train_tokenizer(root / "tokenizer.model", vocab_size=1000, files=sources)
    mc = ModelConfig(
        vocab_size=1000, max_seq_len=SEQ, hidden_size=64, num_layers=2, num_heads=4,
        intermediate_size=128, k=16, dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    mlm = LinformerForMaskedLM(mc)
    state = {k: v for k, v in mlm.state_dict().items() if k != TIED_KEY}
    write_model_dir(str(root / "base"), mc, state, str(tok))
    return {"root": root, "rows": rows}


def test_finetune_learns_task_and_saves_reloadable_model(task):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from linformer_ds.finetune import main

    root = task["root"]
    out = root / "finetuned"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the machine is shared: 2 spinning threads stall under load
    argv = [
        "--model", str(root / "base"), "--train", str(root / "train.csv"),
        "--validation", str(root / "valid.jsonl"), "--text-column", "snippet",
        "--label-column", "module", "--max-length", "48", "--epochs", "3",
        "--batch-size", "16", "--lr", "2e-3", "--warmup-ratio", "0.1", "--out", str(out),
    ]  # fmt: skip
    try:
        assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    results = json.loads((out / "finetune_results.json").read_text())
    assert results["labels"] == ["decimal", "email"]
    assert (results["num_train"], results["num_validation"]) == (600, 200)
    assert results["val_accuracy"] >= 0.80, results["history"]  # chance: 0.5

    # the saved model reloads through the Auto classes and reproduces the reported accuracy
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LinformerForSequenceClassification"]
    assert config["id2label"] == {"0": "decimal", "1": "email"}
    model = AutoModelForSequenceClassification.from_pretrained(out, trust_remote_code=True)
    tok = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    texts = [t for t, _ in task["rows"]["valid"]]
    gold = [model.config.label2id[lab] for _, lab in task["rows"]["valid"]]
    batch = tok(texts, truncation=True, max_length=48, padding=True, return_tensors="pt")
    assert batch["input_ids"].shape[1] <= 48 and (batch["attention_mask"] == 0).any()
    with torch.no_grad():
        pred = model(**batch).logits.argmax(-1)
    assert int((pred == torch.tensor(gold)).sum()) / len(gold) == results["val_accuracy"]


def test_load_splits_from_dataset_directory_and_fraction(task, tmp_path):
    """A dataset directory goes through datasets.load_dataset (the Hub-name path), offline."""
    from linformer_ds.finetune import load_splits

    d = tmp_path / "ds"
    d.mkdir()
    for split, name in (("train", "train.jsonl"), ("valid", "validation.jsonl")):
        with open(d / name, "w") as f:
            for text, label in task["rows"][split][:50]:
                f.write(json.dumps({"text": text, "label": int(label == "email")}) + "\n")
    tr_x, tr_y, va_x, va_y = load_splits(str(d))
    assert (len(tr_x), len(va_x)) == (50, 50)
    assert set(tr_y) == {0, 1} and va_x[0] == task["rows"]["valid"][0][0]
    tr_x, tr_y, va_x, va_y = load_splits(
        str(task["root"] / "train.csv"), text_column="snippet", label_column="module",
        validation_fraction=0.25,
    )  # fmt: skip
    assert (len(tr_x), len(va_x)) == (450, 150)
    assert not set(va_x) & set(tr_x) - {""}


def test_finetune_rejects_bad_input(task, tmp_path):
    from linformer_ds.finetune import FinetuneError, label_mapping, load_splits, main

    root = task["root"]
    with pytest.raises(FinetuneError, match=r"no column 'text' .*--text-column"):
        load_splits(str(root / "train.csv"))
    with pytest.raises(FinetuneError, match="data file .* not found"):
        load_splits(str(tmp_path / "missing.csv"))
    with pytest.raises(FinetuneError, match=r"validation labels \['c'\] never occur"):
        label_mapping(["a", "b"], ["a", "c"])
    assert label_mapping([0, 2, 1, 2], [1]) == [0, 1, 2]
    common = ["--train", str(root / "train.csv"), "--text-column", "snippet",
              "--label-column", "module", "--out", str(tmp_path / "o")]  # fmt: skip
    assert main(["--model", str(tmp_path), *common]) == 2  # not an exported model
    assert main(["--model", str(root / "base"), "--max-length", "999", *common]) == 2


def test_txt_files_and_unsupported_formats(task, tmp_path):
    """A .txt file holds 'label<TAB>text' lines; other file types are refused by name."""
    from linformer_ds.finetune import FinetuneError, load_splits

    rows = task["rows"]["train"][:40]
    (tmp_path / "train.txt").write_text("".join(f"{y}\t{t}\n" for t, y in rows) + "\n")
    tr_x, tr_y, va_x, va_y = load_splits(str(tmp_path / "train.txt"), validation_fraction=0.25)
    assert sorted(zip(tr_x + va_x, tr_y + va_y)) == sorted(rows)
    assert len(va_x) == 10
    (tmp_path / "bad.txt").write_text("email\tok\nno tab on this line\n")
    with pytest.raises(FinetuneError, match=r"bad.txt line 2: expected 'label<TAB>text'"):
        load_splits(str(tmp_path / "bad.txt"))
    (tmp_path / "data.xml").write_text("<x/>")
    with pytest.raises(FinetuneError, match=r"unsupported file type .xml; use .csv/.tsv"):
        load_splits(str(tmp_path / "data.xml"))


def test_out_must_not_overlap_the_base_model(task, tmp_path):
    import shutil

    from linformer_ds.finetune import main

    base = tmp_path / "base"
    shutil.copytree(task["root"] / "base", base)
    before = sorted(p.name for p in base.iterdir())
    common = ["--train", str(task["root"] / "train.csv"), "--text-column", "snippet",
              "--label-column", "module", "--overwrite"]  # fmt: skip
    for out in (base, base / "sub", tmp_path):  # equal, inside, around
        assert main(["--model", str(base), "--out", str(out), *common]) == 2
    assert sorted(p.name for p in base.iterdir()) == before


def test_default_learning_rate_scales_with_width():
    from linformer_ds.finetune import default_lr, parse_args

    assert parse_args(["--model", "m", "--train", "t.csv", "--out", "o"]).lr is None
    assert default_lr(768) == pytest.approx(5e-5)  # BERT-base practice
    assert default_lr(128) == pytest.approx(3e-4)  # configs/tiny_cpu.yaml
    assert default_lr(1024) == pytest.approx(3.75e-5)
    assert default_lr(32) == 5e-4 and default_lr(8192) == 2e-5  # clipped
