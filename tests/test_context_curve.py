"""The context curve (linformer_ds.context_curve): the full window's loss is the plain model's
hidden-label loss on the same positions computed here, every window scores the same positions,
a window covering a whole document equals the full (isolated) row, and bad input is one line."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from linformer_ds.context_curve import (
    JSON_FILE,
    assign_windows,
    curve,
    document_segments,
    main,
    select_rows,
    tile_starts,
)
from linformer_ds.context_meter import UnigramMeter, load_counts
from linformer_ds.data.masking import document_positions
from linformer_ds.data.shards import ShardDataset
from linformer_ds.model import LinformerForMaskedLM, ModelConfig

V, N = 60, 64
SPECIAL = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}


def write_data(root, packing, rows_by_split):
    """A data_prep-like output: ``{split: int rows [R, N]}``."""
    root.mkdir()
    splits = {}
    for split, rows in rows_by_split.items():
        (root / split).mkdir()
        np.save(root / split / "shard_00000.npy", rows.astype(np.uint16))
        splits[split] = {"shards": [{"file": f"{split}/shard_00000.npy", "rows": len(rows)}],
                         "rows": len(rows)}  # fmt: skip
    manifest = {"format_version": 1, "seq_len": N, "vocab_size": V, "dtype": "uint16",
                "special_ids": SPECIAL, "splits": splits, "packing": packing}  # fmt: skip
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def one_doc_rows(rng, count):
    rows = rng.integers(5, V, size=(count, N))
    rows[:, 0] = SPECIAL["cls"]
    return rows


def packed_rows(rng, count, lengths=(31, 20, 8)):
    """Rows ``[cls] + doc + sep + doc + sep ...`` (the first document, with cls and its sep, is
    ``lengths[0] + 2`` tokens)."""
    rows = []
    for _ in range(count):
        row = [SPECIAL["cls"]]
        for n in lengths:
            row += rng.integers(5, V, size=n).tolist() + [SPECIAL["sep"]]
        row += rng.integers(5, V, size=max(0, N - len(row))).tolist()
        rows.append(row[:N])
    return np.array(rows)


def tiny_model(**kw):
    torch.manual_seed(0)
    cfg = dict(vocab_size=V, max_seq_len=N, hidden_size=16, num_layers=2, num_heads=2,
               intermediate_size=32, k=8, dropout=0.0, attention_dropout=0.0,
               projection="linear", sharing="headwise")  # fmt: skip
    cfg.update(kw)
    return LinformerForMaskedLM(ModelConfig(**cfg)).eval()


def meter(ds):
    return UnigramMeter(load_counts(ds, None, False)["counts"], ds.special_ids)


def test_windows_tile_the_document_and_hold_each_position_in_their_middle():
    assert tile_starts(0, 64, 64) == [0]
    assert tile_starts(10, 74, 16) == [10, 18, 26, 34, 42, 50, 58]
    positions = list(range(5, 300, 3))
    got = assign_windows(positions, 5, 300, 32)
    assert sorted(p for ps in got.values() for p in ps) == positions
    for t, ps in got.items():
        for p in ps:
            assert 5 <= t and t + 32 <= 300 and t <= p < t + 32
            ideal = min(max(p - 16, 5), 300 - 32)
            assert abs(t - ideal) <= 8  # in the middle half, or clipped at the document's edge


def test_full_window_equals_the_plain_models_hidden_label_loss(tmp_path):
    rng = np.random.default_rng(0)
    data = write_data(tmp_path / "data", "pad", {"train": one_doc_rows(rng, 6),
                                                  "valid": one_doc_rows(rng, 5)})  # fmt: skip
    ds = ShardDataset(data, "valid")
    model = tiny_model(projection="hybrid")
    res = curve(model, ds, [8, 16, 32, N], rows=4, seed=3, unigram=meter(ds))
    assert [w["window"] for w in res["windows"]] == [8, 16, 32, N]
    assert res["rows"] == 4 and res["longest_window"] == N
    # independently: the whole masked rows through the model, CE at the hidden positions
    from linformer_ds.data.masking import MLMMasking

    masker = MLMMasking(V, SPECIAL["mask"], ds.special_ids, seed=3, pad_id=0)
    idx = res["row_indices"]
    batch = masker(torch.stack([ds[i] for i in idx]), torch.tensor(idx), 0)
    hidden = batch["input_ids"] == SPECIAL["mask"]
    with torch.no_grad():
        logits = model(batch["input_ids"], batch["attention_mask"]).logits
    ce = F.cross_entropy(logits[hidden], batch["labels"][hidden], reduction="none")
    assert res["positions"] == int(hidden.sum()) > 10
    full = res["windows"][-1]
    assert full["loss"] == pytest.approx(float(ce.mean()), abs=1e-5)
    acc = float((logits[hidden].argmax(-1) == batch["labels"][hidden]).float().mean())
    assert full["accuracy"] == pytest.approx(acc)
    labels = batch["labels"][hidden].numpy()
    um = meter(ds)
    assert res["unigram_loss"] == pytest.approx(float(-um.log_prob[labels].mean()))
    assert res["long_context_gain"] is None  # no 512 window here
    # shorter windows differ from the full row (the model reads its context)
    assert res["windows"][0]["loss"] != pytest.approx(full["loss"], abs=1e-4)


def test_every_window_scores_the_same_positions():
    rng = np.random.default_rng(1)

    class Rows:  # a ShardDataset stand-in
        vocab_size, mask_id, pad_id, sep_id, seq_len = V, 4, 0, 3, N
        special_ids = [0, 1, 2, 3, 4]

        def __init__(self, rows):
            self.rows = torch.from_numpy(rows)

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, i):
            return self.rows[i].long()

    ds = Rows(packed_rows(rng, 6))
    rows = select_rows(ds, 6, 16, seed=5, isolation=True)
    from linformer_ds.context_curve import window_stats

    model = tiny_model()
    seen = []
    for w in (4, 8, 16):
        st = window_stats(model, rows, w)
        seen.append(sorted(st["per_position"]))
    assert seen[0] == seen[1] == seen[2] and len(seen[0]) > 5
    # only documents of >= 16 tokens are scored: here the first two of each row (33, 21 tokens)
    for r in rows:
        assert all(e - s >= 16 for s, e, _ in r.segments) and len(r.segments) >= 1
        assert all(s in (0, 33) for s, _, _ in r.segments)


def test_window_over_a_whole_document_equals_the_isolated_full_row(tmp_path):
    rng = np.random.default_rng(2)
    data = write_data(tmp_path / "data", "full", {"train": packed_rows(rng, 4),
                                                   "valid": packed_rows(rng, 4)})  # fmt: skip
    ds = ShardDataset(data, "valid")
    assert document_segments(ds[0], 0, 3, True)[:2] == [(0, 33), (33, 54)]
    assert document_segments(ds[0], 0, 3, False) == [(0, N)]
    model = tiny_model(layer_projections=["dense", "linear"])
    # windows up to 33: the first document (33 tokens) is scored; W = 33 covers it whole
    res = curve(model, ds, [8, 33], rows=4, seed=1, isolation=True)
    from linformer_ds.data.masking import MLMMasking

    masker = MLMMasking(V, SPECIAL["mask"], ds.special_ids, seed=1, pad_id=0)
    idx = res["row_indices"]
    tokens = torch.stack([ds[i] for i in idx])
    batch = masker(tokens, torch.tensor(idx), 0)
    hidden = batch["input_ids"] == SPECIAL["mask"]
    hidden[:, 33:] = False  # the second document (21 tokens) is shorter than 33
    with torch.no_grad():
        logits = model(batch["input_ids"], batch["attention_mask"],
                       position_ids=document_positions(tokens, 3)).logits  # fmt: skip
    ce = F.cross_entropy(logits[hidden], batch["labels"][hidden], reduction="none")
    assert res["positions"] == int(hidden.sum()) > 3
    assert res["windows"][-1]["loss"] == pytest.approx(float(ce.mean()), abs=1e-5)


def export_dir(path, model):
    from safetensors.torch import save_file

    path.mkdir()
    cfg = {"model_type": "linformer", **model.config.to_dict()}
    (path / "config.json").write_text(json.dumps(cfg))
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if k != "lm_head.decoder.weight"}  # fmt: skip
    save_file(state, str(path / "model.safetensors"))
    return path


def test_cli_writes_json_and_plot(tmp_path, capsys):
    rng = np.random.default_rng(3)
    data = write_data(tmp_path / "data", "pad", {"train": one_doc_rows(rng, 4),
                                                  "valid": one_doc_rows(rng, 4)})  # fmt: skip
    model = tiny_model()
    exp = export_dir(tmp_path / "export", model)
    out = tmp_path / "curve"
    assert main([str(exp), str(data), "--windows", "16,N,128", "--rows", "3",
                 "--out", str(out)]) == 0  # fmt: skip
    res = json.loads((out / JSON_FILE).read_text())
    assert [w["window"] for w in res["windows"]] == [16, N]
    assert res["skipped_windows"][0]["window"] == 128
    assert res["rows"] == 3 and "unigram_loss" in res
    assert res["plot"] is None or (out / res["plot"]).is_file()
    direct = curve(model, ShardDataset(data, "valid"), [16, N], rows=3)
    assert res["windows"][1]["loss"] == pytest.approx(direct["windows"][1]["loss"], abs=1e-6)


@pytest.mark.parametrize(
    "case",
    "no_model not_a_model no_data short_rows windows device no_device corrupt_weights".split(),
)
def test_bad_input_is_one_line_and_a_nonzero_exit(tmp_path, capsys, case):
    rng = np.random.default_rng(4)
    data = write_data(tmp_path / "data", "pad", {"train": one_doc_rows(rng, 2),
                                                  "valid": one_doc_rows(rng, 2)})  # fmt: skip
    exp = export_dir(tmp_path / "export", tiny_model())
    (tmp_path / "empty").mkdir()
    if case == "corrupt_weights":  # truncated: safetensors' own error was a traceback
        weights = exp / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-9])
    args = {
        "no_model": [str(tmp_path / "missing"), str(data)],
        "not_a_model": [str(tmp_path / "empty"), str(data)],
        "no_data": [str(exp), str(tmp_path / "missing")],
        "short_rows": [str(exp), str(data), "--windows", "128,256"],
        "windows": [str(exp), str(data), "--windows", "16,abc"],
        "device": [str(exp), str(data), "--device", "bogus"],
        # a CPU-only torch (an AssertionError before) or a GPU machine without a 100th GPU
        "no_device": [str(exp), str(data), "--device", "cuda:99"],
        "corrupt_weights": [str(exp), str(data)],
    }[case]
    assert main([*args, "--out", str(tmp_path / "out")]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("context_curve: error:"), err
    assert "device" not in case or "--device" in err, err
    assert not (tmp_path / "out").exists()


def test_trainer_eval_logs_the_same_figures(tmp_path):
    """``eval.context_windows``: evaluate's context figures are the curve's, on the valid split
    masked with the evaluation's seed; bad settings are one line naming the key."""
    from linformer_ds.config import ConfigError, load_config
    from linformer_ds.context_curve import eval_figures
    from linformer_ds.evaluate import context_figures
    from tests.pretrain_utils import TEST_OVERRIDES, TINY_CONFIG

    rng = np.random.default_rng(5)
    data = write_data(tmp_path / "data", "pad", {"train": one_doc_rows(rng, 4),
                                                  "valid": one_doc_rows(rng, 4)})  # fmt: skip
    cfg = load_config(TINY_CONFIG, [*TEST_OVERRIDES, f"data.path={data}",
                                    "eval.context_windows=[16,64]", "eval.context_rows=3"])  # fmt: skip
    ds = ShardDataset(data, "valid")
    model = tiny_model()
    um = meter(ds)
    got = context_figures(model, ds, cfg, "cpu", um, False)
    want = eval_figures(curve(model, ds, [16, 64], 3, cfg.train.seed + 1, unigram=um))
    assert got == want and set(got) == {"context_loss_w16", "context_accuracy_w16",
                                        "context_loss_w64", "context_accuracy_w64"}  # fmt: skip
    for bad, key in (("eval.context_windows=[0]", "eval.context_windows"),
                     ("eval.context_windows=[100000]", "eval.context_windows"),
                     ("eval.context_rows=0", "eval.context_rows")):  # fmt: skip
        with pytest.raises(ConfigError) as e:
            load_config(TINY_CONFIG, [*TEST_OVERRIDES, f"data.path={data}", bad])
        assert str(e.value).startswith(f"{key}:") and "\n" not in str(e.value)
