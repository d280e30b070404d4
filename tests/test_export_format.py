"""An export written before the model became a package (format 1: one ``linformer_model.py``)
still loads: through its own remote code in transformers, and into today's model classes, with
the logits it gave when it was written (tests/data/export_format1/reference.pt)."""

import json
import shutil
from dataclasses import fields
from pathlib import Path

import torch
from safetensors.torch import load_file

from linformer_ds.model import LinformerForMaskedLM, ModelConfig
from linformer_ds.model_dir import check_remote_code

FORMAT1 = Path(__file__).parent / "data" / "export_format1"


def test_format1_export_loads_with_its_own_code_and_with_todays(tmp_path):
    from transformers import AutoModelForMaskedLM

    out = tmp_path / "format1"
    shutil.copytree(FORMAT1, out)
    assert check_remote_code(str(out)) is None  # its recorded code hashes still hold
    ref = torch.load(out / "reference.pt", weights_only=True)
    hf = AutoModelForMaskedLM.from_pretrained(str(out), trust_remote_code=True).eval()
    assert not any((out / name).exists() for name in ("attention.py", "encoder.py"))
    config = json.loads((out / "config.json").read_text())
    ours = LinformerForMaskedLM(
        ModelConfig(**{f.name: config[f.name] for f in fields(ModelConfig) if f.name in config})
    ).eval()
    state = load_file(str(out / "model.safetensors"))
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert unexpected == [] and missing == ["lm_head.decoder.weight"]  # tied to the embeddings
    with torch.no_grad():
        for model in (hf, ours):
            logits = model(input_ids=ref["input_ids"], attention_mask=ref["attention_mask"]).logits
            torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=1e-5)


def test_package_export_of_long_context_kinds_loads_in_transformers(tmp_path):
    """Today's export ships the model package file for file: a model with every new kind
    (window, local, dynamic, routed, selective, rotary positions) loads through transformers'
    remote code with the logits of the training classes."""
    from transformers import AutoModelForMaskedLM

    from linformer_ds.model_dir import MODEL_FILES, write_model_dir

    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=300, max_seq_len=64, hidden_size=16, num_layers=5, num_heads=2,
        intermediate_size=32, k=8,
        layer_projections=["local", "dynamic", "dense", "routed", "selective"],
        routed_blocks=2,
        sharing="headwise", local_window=8, positions="rope", dropout=0.0,
        attention_dropout=0.0,
    )  # fmt: skip
    model = LinformerForMaskedLM(cfg).eval()
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.decoder.weight"}
    out = tmp_path / "export"
    write_model_dir(str(out), cfg, state, str(FORMAT1 / "tokenizer.model"))
    assert {"linformer_model.py", *MODEL_FILES} <= {p.name for p in out.iterdir()}
    assert check_remote_code(str(out)) is None
    hf = AutoModelForMaskedLM.from_pretrained(str(out), trust_remote_code=True).eval()
    ref = torch.load(FORMAT1 / "reference.pt", weights_only=True)
    with torch.no_grad():
        want = model(ref["input_ids"], ref["attention_mask"]).logits
        got = hf(input_ids=ref["input_ids"], attention_mask=ref["attention_mask"]).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
