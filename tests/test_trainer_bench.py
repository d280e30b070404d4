"""bench/trainer_bench.py: a tiny run of every arm (linformer_ds dense and Linformer, HF BERT
and ModernBERT) in this process writes a row per arm on the same rows (the first batch's
checksum), and the summary's means and ratios are the recorded values' (never timings)."""

import json

import pytest

from bench.common import BenchError
from bench.trainer_bench import (
    TrainerBenchConfig,
    main,
    summarize,
    variant_overrides,
)

TINY = ["--layers", "1", "--hidden", "32", "--heads", "2", "--intermediate", "64", "--k", "16",
        "--batch", "2", "--budget-s", "0.4", "--rounds", "2", "--eval-rows", "4",
        "--precision", "fp32", "--isolation", "shared", "--warmup-steps", "1",
        "--schedule-steps", "1000", "--seeds", "0"]  # fmt: skip
ARMS = ["ours:dense", "ours:linear", "hf-bert", "hf-modernbert"]


@pytest.mark.usefixtures("_clean_env")
def test_every_arm_has_a_row_on_the_same_rows(tiny_corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "out"
    assert main(["--data", str(tiny_corpus), *TINY, "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    rows = results["rows"]
    assert [r["arm"] for r in rows] == ARMS
    assert len({r["first_batch"] for r in rows}) == 1, "the arms saw different rows"
    for r in rows:
        assert r["n"] == 128 and r["steps"] >= 2 and r["train_s"] > 0
        assert r["tokens_per_s"] > 0 and r["first_step_s"] > 0 and r["hidden_loss"] > 0
        assert len(r["step_s"]) == r["steps"]
    assert results["environment"]["precision"] == "fp32"
    # the summary is computed from the rows: one seed, so the means are the rows' values
    summary = {m["arm"]: m for m in results["summary"]}
    by_arm = {r["arm"]: r for r in rows}
    for arm in ("ours:dense", "ours:linear"):
        for hf in ("hf-bert", "hf-modernbert"):
            speed = by_arm[arm]["tokens_per_s"] / by_arm[hf]["tokens_per_s"]
            loss = by_arm[arm]["hidden_loss"] - by_arm[hf]["hidden_loss"]
            assert summary[arm][f"speed_vs_{hf}"] == pytest.approx(speed, rel=1e-12)
            assert summary[arm][f"loss_minus_{hf}"] == pytest.approx(loss, rel=1e-12)
    table = (out / "results.md").read_text()
    assert all(f"| 128 | {arm} |" in table for arm in ARMS), table


def test_summary_means_over_seeds_and_ratios_of_the_means():
    def row(arm, seed, tps, loss, rss):
        return dict(n=512, arm=arm, seed=seed, tokens_per_s=tps, first_step_s=2.0 + seed,
                    hidden_loss=loss, steps=10 + seed, peak_rss_gib=rss)  # fmt: skip

    rows = [row("ours:linear", 0, 300.0, 5.0, 1.0), row("ours:linear", 1, 500.0, 6.0, 1.5),
            row("hf-bert", 0, 100.0, 6.5, 2.0), row("hf-bert", 1, 300.0, 7.5, 2.5),
            row("hf-modernbert", 0, 80.0, 7.0, None), row("hf-modernbert", 1, 120.0, 8.0, None)]  # fmt: skip
    s = {m["arm"]: m for m in summarize(rows)}
    ours = s["ours:linear"]
    assert ours["tokens_per_s"] == 400.0 and ours["hidden_loss"] == 5.5
    assert ours["hidden_loss_all"] == [5.0, 6.0] and ours["peak_rss_gib"] == 1.5
    assert ours["speed_vs_hf-bert"] == 400.0 / 200.0
    assert ours["loss_minus_hf-bert"] == 5.5 - 7.0
    assert ours["speed_vs_hf-modernbert"] == 400.0 / 100.0
    assert ours["loss_minus_hf-modernbert"] == 5.5 - 7.5
    assert s["hf-modernbert"]["peak_rss_gib"] is None
    assert "speed_vs_hf-bert" not in s["hf-bert"]


def test_variants_take_any_projection_setting():
    assert variant_overrides("linear") == ["model.projection=linear"]
    assert variant_overrides("projection=local;local_window=128") == [
        "model.projection=local", "model.local_window=128"]  # fmt: skip
    assert variant_overrides("model.layer_projections=[local,dense]") == [
        "model.layer_projections=[local,dense]"]  # fmt: skip
    with pytest.raises(BenchError, match="--variants"):
        variant_overrides("projection=local;oops")
    with pytest.raises(BenchError, match="--data"):
        TrainerBenchConfig().validate()


def test_every_arm_gets_the_same_dropout(tiny_corpus):
    """``--dropout`` is every arm's hidden and attention dropout (ours ran attention dropout 0.1
    against the HF arms' 0.0 once: SDPA's math path with a bernoulli mask over N x N)."""
    from dataclasses import asdict

    from bench.trainer_bench import ArmSpec, hf_model, job_overrides
    from linformer_ds.config import load_config

    c = TrainerBenchConfig(data=[str(tiny_corpus)], layers=1, hidden=32, heads=2,
                           intermediate=64, k=16, dropout=0.25)  # fmt: skip

    def spec(name: str) -> ArmSpec:
        return ArmSpec(name, str(tiny_corpus), 0, "fp32", asdict(c), "unused")

    model = load_config(None, job_overrides(spec("ours:dense"), "dense")).model
    assert model.dropout == model.attention_dropout == 0.25
    bert = hf_model(spec("hf-bert")).config
    assert bert.hidden_dropout_prob == bert.attention_probs_dropout_prob == 0.25
    modern = hf_model(spec("hf-modernbert")).config
    assert modern.mlp_dropout == modern.embedding_dropout == modern.attention_dropout == 0.25
