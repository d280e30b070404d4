"""The context meter (linformer_ds.context_meter): unigram counts, smoothed loss and constant-
guess accuracy against references computed here in plain Python, evaluate()'s figures on the
exact scored positions, the mixture's weighting, and a real one-rank run's eval records."""

import hashlib
import io
import json
import math
import re
import shutil
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from linformer_ds.context_meter import (
    COUNTS_FILE,
    FIELDS,
    UnigramMeter,
    counts_record,
    load_counts,
    unigram_bias,
    with_mixture_meter,
)
from linformer_ds.data.masking import MLMMasking
from linformer_ds.data.shards import ShardDataset
from linformer_ds.loss import IGNORE_INDEX
from tests.pretrain_utils import read_metrics, run_pretrain

V, N = 50, 16
SPECIAL = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}


def write_split(root, split, rows_per_shard, seed):
    """Shards of random rows ``[cls] + ids + [sep] + pad`` (with a few unk), skewed towards low
    ids so that the unigram distribution is far from uniform; returns the manifest entry."""
    rng = np.random.default_rng(seed)
    shards = []
    (root / split).mkdir()
    for k, rows in enumerate(rows_per_shard):
        p = np.minimum(rng.geometric(0.15, size=(rows, N)) + 4, V - 1)
        p[:, 0] = SPECIAL["cls"]
        p[:, -3] = SPECIAL["sep"]
        p[:, -2:] = SPECIAL["pad"]
        p[rng.random((rows, N)) < 0.02] = SPECIAL["unk"]
        name = f"{split}/shard_{k:05d}.npy"
        np.save(root / name, p.astype(np.uint16))
        shards.append({"file": name, "rows": rows, "sha256": f"{seed}-{k}"})
    return {"shards": shards, "rows": sum(rows_per_shard)}


@pytest.fixture
def shards(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    splits = {"train": write_split(root, "train", [7, 5, 9], 1),
              "valid": write_split(root, "valid", [6], 2)}  # fmt: skip
    manifest = {"format_version": 1, "seq_len": N, "vocab_size": V, "dtype": "uint16",
                "special_ids": SPECIAL, "splits": splits}  # fmt: skip
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def reference(root):
    """Counts, add-one log-probabilities and the top token, in plain Python."""
    counter = Counter()
    for s in json.loads((root / "manifest.json").read_text())["splits"]["train"]["shards"]:
        for row in np.load(root / s["file"]).tolist():
            counter.update(t for t in row if t not in SPECIAL.values())
    maskable = [t for t in range(V) if t not in SPECIAL.values()]
    total = sum(counter.values()) + len(maskable)
    logp = {t: math.log((counter[t] + 1) / total) for t in maskable}
    top = max(maskable, key=lambda t: (counter[t], -t))
    return counter, logp, top


def test_counts_loss_and_accuracy_match_a_plain_python_reference(shards, tmp_path):
    counter, logp, top = reference(shards)
    train = ShardDataset(shards, "train")
    got = load_counts(train, tmp_path / "run")
    assert got["from"] == "counted"
    assert got["counts"].tolist() == [counter[t] for t in range(V)]
    assert load_counts(train, tmp_path / "run")["from"] == "cache"  # a resumed run: no recount
    meter = UnigramMeter.for_dataset(train, tmp_path / "run")
    assert meter.top == top and meter.tokens == sum(counter.values())
    # the labels of the valid split's masking, scored by hand
    valid = ShardDataset(shards, "valid")
    masker = MLMMasking(V, SPECIAL["mask"], valid.special_ids, seed=7, pad_id=0)
    batch = masker(torch.stack([valid[i] for i in range(len(valid))]), torch.arange(len(valid)), 0)
    labels = [t for t in batch["labels"].reshape(-1).tolist() if t != IGNORE_INDEX]
    assert len(labels) > 5
    loss_sum, correct = meter.stats(batch["labels"])
    assert loss_sum == pytest.approx(-sum(logp[t] for t in labels), rel=1e-12)
    assert correct == sum(t == top for t in labels)
    assert meter.stats(torch.full((2, 3), IGNORE_INDEX)) == [0.0, 0.0]


def test_data_prep_record_is_used_and_checked(shards, tmp_path):
    counter, _, _ = reference(shards)
    m = json.loads((shards / "manifest.json").read_text())
    rec = counts_record(shards, m["splits"]["train"]["shards"], V, list(SPECIAL.values()))
    assert rec["tokens"] == sum(counter.values()) and (shards / COUNTS_FILE).is_file()
    m["unigram"] = rec
    (shards / "manifest.json").write_text(json.dumps(m))
    got = load_counts(ShardDataset(shards, "train"), None)
    assert got["from"] == "manifest" and got["counts"].tolist() == [counter[t] for t in range(V)]
    # counts that do not match their record (tokens): ignored, counted again
    np.save(shards / COUNTS_FILE, np.ones(V, dtype=np.int64))
    assert load_counts(ShardDataset(shards, "train"), None)["from"] == "counted"


def test_evaluate_reports_the_meter_on_the_hidden_positions(shards, tmp_path, monkeypatch):
    """evaluate() with a model that predicts uniformly: loss = log V on every position; the
    meter's figures are those of the reference on the hidden labels (input = <mask>) of the
    same masks (seed train.seed + 1)."""
    import linformer_ds.evaluate as ev
    from linformer_ds.evaluate import evaluate

    monkeypatch.setattr(ev, "all_reduce_sum", lambda t, device: t)  # one rank, no group

    class Uniform(torch.nn.Module):
        def forward(self, input_ids, attention_mask, labels=None, labelled_index=None):
            targets = labels.reshape(-1)[labelled_index]
            logits = torch.zeros(targets.numel(), V)
            loss = torch.nn.functional.cross_entropy(logits, targets)
            return SimpleNamespace(loss=loss, labelled_logits=logits, labelled_targets=targets)

    _, logp, top = reference(shards)
    valid = ShardDataset(shards, "valid")
    cfg = SimpleNamespace(
        data=SimpleNamespace(mlm_probability=0.15),
        eval=SimpleNamespace(context_windows=[]),
        train=SimpleNamespace(seed=3, micro_batch_size=2, gradient_accumulation_steps=1,
                              eval_batches=2),
    )  # fmt: skip
    meter = UnigramMeter.for_dataset(ShardDataset(shards, "train"), tmp_path)
    got = evaluate(Uniform(), valid, cfg, 0, 1, "cpu", unigram=meter)
    assert set(FIELDS) <= set(got)
    masker = MLMMasking(V, SPECIAL["mask"], valid.special_ids, seed=4, pad_id=0)
    rows = torch.stack([valid[i] for i in range(4)])  # eval_batches x micro-batch rows
    masked = masker(rows, torch.arange(4), 0)
    pairs = zip(masked["labels"].reshape(-1).tolist(), masked["input_ids"].reshape(-1).tolist())
    lab = [t for t, x in pairs if t != IGNORE_INDEX and x == SPECIAL["mask"]]
    assert 0 < len(lab) < int((masked["labels"] != IGNORE_INDEX).sum())  # kept/random left out
    want = -sum(logp[t] for t in lab) / len(lab)
    assert got["loss"] == pytest.approx(math.log(V), rel=1e-6)
    assert got["hidden_loss"] == pytest.approx(math.log(V), rel=1e-6)
    assert got["unigram_loss"] == pytest.approx(want, rel=1e-12)
    assert got["unigram_accuracy"] == pytest.approx(sum(t == top for t in lab) / len(lab))
    assert got["context_gain_nats"] == pytest.approx(want - math.log(V), rel=1e-6)
    assert got["context_gain_accuracy"] == pytest.approx(
        got["hidden_accuracy"] - got["unigram_accuracy"]
    )
    assert set(evaluate(Uniform(), valid, cfg, 0, 1, "cpu")) == {
        "loss", "perplexity", "mlm_accuracy"
    }  # fmt: skip


def test_a_model_that_copies_its_input_shows_no_context_gain(shards, tmp_path, monkeypatch):
    """A context-free cheat: predict the input token itself (sure of it). On the 10 % of labels
    kept unchanged it is right, so the loss over all labels sits below the unigram level, but
    on the hidden labels (input = <mask>) it is always wrong: hidden accuracy 0, and the
    context gain is negative however the masks fall."""
    import linformer_ds.evaluate as ev
    from linformer_ds.evaluate import evaluate

    monkeypatch.setattr(ev, "all_reduce_sum", lambda t, device: t)

    class Copy(torch.nn.Module):
        def forward(self, input_ids, attention_mask, labels=None, labelled_index=None):
            targets = labels.reshape(-1)[labelled_index]
            shown = input_ids.reshape(-1)[labelled_index]
            logits = 30.0 * torch.nn.functional.one_hot(shown, V).float()
            loss = torch.nn.functional.cross_entropy(logits, targets)
            return SimpleNamespace(loss=loss, labelled_logits=logits, labelled_targets=targets)

    valid = ShardDataset(shards, "valid")
    meter = UnigramMeter.for_dataset(ShardDataset(shards, "train"), tmp_path)
    for seed in range(4):
        cfg = SimpleNamespace(
            data=SimpleNamespace(mlm_probability=0.5),
            eval=SimpleNamespace(context_windows=[]),
            train=SimpleNamespace(seed=seed, micro_batch_size=2, gradient_accumulation_steps=1,
                                  eval_batches=2),
        )  # fmt: skip
        got = evaluate(Copy(), valid, cfg, 0, 1, "cpu", unigram=meter)
        assert got["mlm_accuracy"] > 0 and got["hidden_accuracy"] == 0.0
        assert got["hidden_loss"] > 25.0 and got["context_gain_nats"] < 0
        assert got["context_gain_accuracy"] <= 0


def test_mixture_record_weights_the_meter_like_the_loss():
    per = {
        "a": {"loss": 3.0, "mlm_accuracy": 0.4, "hidden_loss": 4.0, "hidden_accuracy": 0.3,
              "unigram_loss": 5.0, "unigram_accuracy": 0.1},
        "b": {"loss": 1.0, "mlm_accuracy": 0.6, "hidden_loss": 2.0, "hidden_accuracy": 0.5,
              "unigram_loss": 6.0, "unigram_accuracy": 0.2},
    }  # fmt: skip
    record = {"loss": 3.5, "perplexity": math.exp(3.5), "mlm_accuracy": 0.35, "loss/a": 4.0}
    out = with_mixture_meter(record, ["a", "b"], [0.75, 0.25], per)
    assert list(out)[:9] == ["loss", "perplexity", "mlm_accuracy", *FIELDS]
    assert out["hidden_loss"] == pytest.approx(3.5)
    assert out["hidden_accuracy"] == pytest.approx(0.35)
    assert out["unigram_loss"] == pytest.approx(5.25)
    assert out["unigram_accuracy"] == pytest.approx(0.125)
    assert out["context_gain_nats"] == pytest.approx(1.75)
    assert out["context_gain_accuracy"] == pytest.approx(0.225)
    assert out["loss/a"] == 4.0
    assert with_mixture_meter(per["a"], ["a"], [1.0], {"a": per["a"]}) == per["a"]


def test_trainer_eval_records_and_lines_carry_the_meter(tiny_corpus, tmp_path):
    """One rank, evals at steps 2 and 4: each ``[eval]`` line and metrics.jsonl record has the
    meter; its unigram figures equal a reference on the eval masks. Data without data_prep's
    record (older data): counted, then a resumed process reads the cached counts; data_prep's
    record holds the same counts."""
    recorded = load_counts(ShardDataset(tiny_corpus, "train"), None)
    assert recorded["from"] == "manifest"
    data = tmp_path / "old_data"  # the same data as made before data_prep recorded counts
    shutil.copytree(tiny_corpus, data)
    m = json.loads((data / "manifest.json").read_text())
    (data / m.pop("unigram")["file"]).unlink()
    (data / "manifest.json").write_text(json.dumps(m))
    run = tmp_path / "run"
    common = ["train.eval_interval=2", "train.eval_batches=1", "logging.tensorboard=true"]
    first = run_pretrain(data, run, common + ["train.max_steps=4"], nproc=1, launcher="python")
    assert re.search(r"\[meter\] unigram counts of the train split: .*tokens \(counted\)",
                     first.stdout)  # fmt: skip
    lines = [ln for ln in first.stdout.splitlines() if ln.startswith("[eval]")]
    assert len(lines) == 2 and all("context_gain_nats=" in ln for ln in lines)
    ev = read_metrics(run, "eval")
    assert sorted(ev) == [2, 4]
    r = ev[4]
    assert r["context_gain_nats"] == pytest.approx(r["unigram_loss"] - r["hidden_loss"], abs=1e-12)
    # reference: counts of the train shards, the eval masks of rows 0-3 (seed 42 + 1)
    train, valid = ShardDataset(data, "train"), ShardDataset(data, "valid")
    counts = np.zeros(train.vocab_size, dtype=np.int64)
    for i in range(len(train)):
        counts += np.bincount(train[i].numpy(), minlength=train.vocab_size)
    counts[train.special_ids] = 0
    assert recorded["counts"].tolist() == counts.tolist()
    maskable = np.ones(train.vocab_size, bool)
    maskable[train.special_ids] = False
    p = (counts + 1) / (counts.sum() + maskable.sum())
    masker = MLMMasking(valid.vocab_size, valid.mask_id, valid.special_ids, seed=43,
                        pad_id=valid.pad_id)  # fmt: skip
    rows = min(len(valid), 4)
    masked = masker(torch.stack([valid[i] for i in range(rows)]), torch.arange(rows), 0)
    labels = masked["labels"]
    lab = labels[(labels != IGNORE_INDEX) & (masked["input_ids"] == valid.mask_id)].numpy()
    assert r["unigram_loss"] == pytest.approx(float(-np.log(p[lab]).mean()), rel=1e-9)
    top = int(np.argmax(np.where(maskable, counts, -1)))
    assert r["unigram_accuracy"] == pytest.approx(float((lab == top).mean()), rel=1e-12)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    assert {f"eval/{k}" for k in FIELDS} <= set(acc.Tags()["scalars"])
    again = run_pretrain(data, run, common + ["train.max_steps=6"], nproc=1, launcher="python")
    assert "tokens (cache)" in again.stdout
    assert read_metrics(run, "eval")[6]["unigram_loss"] == pytest.approx(r["unigram_loss"])


def test_unigram_bias_is_the_log_of_the_weighted_mixture(shards, tmp_path):
    """Two meters mixed 3:1: softmax(bias) over the maskable ids is the mixture of their
    add-one distributions (plain Python reference); never-masked ids lie 10 nats below the
    least likely maskable one; the maskable ids' mean is 0."""
    _, logp, _ = reference(shards)
    skewed = np.zeros(V, dtype=np.int64)
    skewed[5] = 1000  # a second source that is nearly all id 5
    meters = [UnigramMeter.for_dataset(ShardDataset(shards, "train"), tmp_path),
              UnigramMeter(skewed, list(SPECIAL.values()))]  # fmt: skip
    bias = unigram_bias(meters, [3.0, 1.0])
    assert bias.dtype == np.float32 and bias.shape == (V,)
    maskable = [t for t in range(V) if t not in SPECIAL.values()]
    z = sum(math.exp(float(bias[t])) for t in maskable)
    second = {t: (skewed[t] + 1) / (1000 + len(maskable)) for t in maskable}
    for t in maskable:
        want = 0.75 * math.exp(logp[t]) + 0.25 * second[t]
        assert math.exp(float(bias[t])) / z == pytest.approx(want, rel=1e-5)
    assert float(np.mean(bias[maskable])) == pytest.approx(0.0, abs=1e-5)
    low = min(float(bias[t]) for t in maskable)
    for t in SPECIAL.values():
        assert float(bias[t]) == pytest.approx(low - 10.0, abs=1e-4)
    wide = unigram_bias(meters, [3.0, 1.0], vocab_size=V + 3)  # a model vocabulary past the data's
    assert wide.shape == (V + 3,) and np.allclose(wide[:V], bias, atol=1e-6)
    assert np.allclose(wide[V:], low - 10.0, atol=1e-4)


def test_output_bias_init_starts_the_model_at_the_unigram_level(tiny_corpus, tmp_path):
    """``model.output_bias_init=unigram`` on a real one-rank run: with near-zero weights
    (initializer_range 1e-4) and a vanishing learning rate the step-1 evaluation's hidden loss
    is the meter's unigram loss (the untrained model predicts the context-free distribution; the
    default zero bias scores log V instead; a model vocabulary 3 ids past the data's gets them
    at the floor); a resumed run keeps its checkpoint's bias."""
    run = tmp_path / "run"
    common = ["train.eval_interval=1", "train.eval_batches=2", "optimizer.lr=1e-9",
              "model.initializer_range=1e-4", "deepspeed.precision=fp32"]  # fmt: skip
    unigram = ["model.output_bias_init=unigram", "model.vocab_size=2003"]  # 3 ids past the data's
    out = run_pretrain(tiny_corpus, run, common + unigram + ["train.max_steps=1"], nproc=1,
                       launcher="python")  # fmt: skip
    assert "[setup] MLM decoder bias: log unigram of" in out.stdout
    r = read_metrics(run, "eval")[1]
    assert r["hidden_loss"] == pytest.approx(r["unigram_loss"], abs=2e-3)
    again = run_pretrain(tiny_corpus, run, common + unigram + ["train.max_steps=2"], nproc=1,
                         launcher="python")  # fmt: skip
    assert "MLM decoder bias" not in again.stdout
    zero = tmp_path / "zero"
    run_pretrain(tiny_corpus, zero, common + ["train.max_steps=1"], nproc=1, launcher="python")
    z = read_metrics(zero, "eval")[1]
    assert z["hidden_loss"] == pytest.approx(math.log(2000), abs=2e-3)
    assert z["unigram_loss"] == pytest.approx(r["unigram_loss"], rel=1e-12)  # the same masks


# ============================== the counts are the ones recorded (issue 45 item 3), generated
COUNT_FAULTS = ("permuted", "other total", "empty", "random bytes", "missing")


def _fault(kind, counts, rng):
    """The bytes a counts file is replaced with (None: removed)."""
    buf = io.BytesIO()
    if kind == "permuted":  # the same total: only the sha256 tells
        np.save(buf, counts[rng.permutation(len(counts))])
    elif kind == "other total":
        np.save(buf, counts + 1)
    elif kind == "random bytes":
        return rng.bytes(int(rng.integers(1, 900)))
    elif kind == "missing":
        return None
    return buf.getvalue()


@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(manifest_fault=st.sampled_from(COUNT_FAULTS), cache_fault=st.sampled_from(COUNT_FAULTS),
       seed=st.integers(0, 2**16))  # fmt: skip
def test_counts_and_cache_are_checked_against_their_sha256(shards, tmp_path, manifest_fault,
                                                           cache_fault, seed):  # fmt: skip
    """The manifest's unigram_counts.npy and the run directory's cache, each replaced by swapped
    counts (same total), other counts, random bytes or nothing: neither is used unless its
    sha256 is the recorded one; the counts are recounted (the reference's) and the meter's
    source names the file that failed."""
    counter, _, _ = reference(shards)
    want = [counter[t] for t in range(V)]
    m = json.loads((shards / "manifest.json").read_text())
    m["unigram"] = counts_record(shards, m["splits"]["train"]["shards"], V, list(SPECIAL.values()))
    (shards / "manifest.json").write_text(json.dumps(m))
    rng = np.random.default_rng(seed)
    true = np.array(want, dtype=np.int64)
    run = tmp_path / f"run{seed}-{manifest_fault}-{cache_fault}"
    train = ShardDataset(shards, "train")
    # a cache made while the manifest's file was unreadable, then both files damaged
    (shards / COUNTS_FILE).rename(shards / "saved.npy")
    first = load_counts(train, run)
    assert first["from"] == "counted" and first["counts"].tolist() == want
    assert first["why"] == f"{COUNTS_FILE} unreadable (No such file or directory): recounted"
    (cache,) = run.glob("unigram_train_*.npy")
    assert load_counts(train, run)["from"] == "cache"  # its bytes are the manifest's sha256
    for path, kind in ((shards / COUNTS_FILE, manifest_fault), (cache, cache_fault)):
        data = _fault(kind, true, rng)
        if data is None:
            path.unlink(missing_ok=True)
        else:
            path.write_bytes(data)
    meter = UnigramMeter.for_dataset(train, run, write_cache=False)
    assert meter.tokens == sum(want) and meter.source.startswith("counted: ")
    result = load_counts(train, run, write_cache=False)
    assert result["counts"].tolist() == want
    assert result["from"] == "counted"
    assert result["why"].startswith(COUNTS_FILE)
    assert (f"cache {cache.name}" in result["why"]) == (cache_fault != "missing"), result["why"]
    assert result["why"].endswith(": recounted") and "\n" not in result["why"]
    (shards / "saved.npy").rename(shards / COUNTS_FILE)
    assert load_counts(train, run)["from"] == "manifest"  # the recorded file back: used again


def test_a_cache_without_a_manifest_record_carries_its_own_sha256(shards, tmp_path):
    """No unigram record in the manifest (older data): the cache is trusted only with the
    sha256 written beside it; swapped counts in it are recounted, and the meter says so."""
    train = ShardDataset(shards, "train")
    first = load_counts(train, tmp_path)
    (cache,) = tmp_path.glob("unigram_train_*.npy")
    assert (cache.with_suffix(".sha256")).read_text() == hashlib.sha256(
        cache.read_bytes()).hexdigest()  # fmt: skip
    swapped = io.BytesIO()
    np.save(swapped, first["counts"][::-1].copy())
    cache.write_bytes(swapped.getvalue())
    meter = UnigramMeter.for_dataset(train, tmp_path)
    assert meter.source.startswith(f"counted: cache {cache.name} sha256 ")
    assert meter.source.endswith(": recounted")
    assert load_counts(train, tmp_path)["from"] == "cache"  # rewritten with the true counts
    assert load_counts(train, tmp_path)["counts"].tolist() == first["counts"].tolist()
