"""The benchmark tool on a tiny grid: outputs, row set, numbers checked against references."""

import json

import pytest
import torch

from bench import model_bench as bench
from linformer_ds.model import LinformerForMaskedLM, flops_per_token

TINY = [
    "--layers", "2", "--hidden", "32", "--heads", "2", "--k", "16", "--intermediate", "64",
    "--vocab", "97", "--warmup", "1", "--iters", "2", "--gemm-n", "256", "--gemm-reps", "2",
]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    argv = TINY + ["--seq-lens", "64", "128", "--max-n", "dense=64", "--out", str(out)]
    assert bench.main(argv) == 0
    return out, json.loads((out / "results.json").read_text())


def test_writes_json_markdown_and_pngs(tiny_run):
    out, res = tiny_run
    for name in ("time_per_token.png", "peak_memory.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = {(r["variant"], r["n"]): r for r in res["rows"]}
    assert set(rows) == {(v, n) for v in bench.DEFAULT_VARIANTS for n in (64, 128)}
    assert rows[("dense", 128)]["skipped"] == "N > --max-n dense=64"
    assert rows[("dense", 128)]["step_s"] is None
    md = (out / "results.md").read_text()
    table = [ln for ln in md.splitlines() if ln.startswith("| ") and not ln.startswith("| variant")]
    assert len(table) == 8
    assert "| dense | 128 | 1 | skipped: N > --max-n dense=64 |" in md
    assert res["environment"]["torch"] == torch.__version__
    assert res["config"]["seq_lens"] == [64, 128]


def test_numbers_are_consistent(tiny_run):
    _, res = tiny_run
    peak = res["gemm_peak_flops"]
    assert peak == max(res["gemm_flops_all"]) > 1e8
    assert len(res["gemm_flops_all"]) == 4  # before, after each of the 2 lengths, after
    bc = bench.BenchConfig(**res["config"])
    for r in res["rows"]:
        if r["skipped"]:
            continue
        cfg = bench.model_config(bc, r["variant"], r["n"])
        n_mask = round(bc.mlm_fraction * r["n"])
        assert r["flops_per_token"] == flops_per_token(cfg, r["n"], n_mask / r["n"])
        assert len(r["step_s_all"]) == 2 and r["step_s"] == min(r["step_s_all"]) > 0
        assert r["us_per_token"] == pytest.approx(r["step_s"] / r["n"] * 1e6)
        assert r["model_tflops"] == pytest.approx(
            r["flops_per_token"] * r["n"] / r["step_s"] / 1e12
        )
        # MFU is not bounded by 1 on CPUs without native bf16 (AVX2 only: the bf16 GEMM peak is
        # emulated and slower than the model's fp32 parts); consistency is what is checked
        assert r["mfu"] > 0 and r["mfu"] == pytest.approx(r["model_tflops"] * 1e12 / peak)
        assert r["gemm_flops_nearby"] in res["gemm_flops_all"][1:3]
        assert r["mfu_vs_nearby_gemm"] == pytest.approx(
            r["model_tflops"] * 1e12 / r["gemm_flops_nearby"]
        )
        # peak = persistent (fp32 params + 2 AdamW moments, at least) + a positive transient
        n_params = LinformerForMaskedLM(cfg).num_parameters()
        assert r["transient_mem_bytes"] > 0
        assert r["peak_mem_bytes"] >= 12 * n_params + r["transient_mem_bytes"]
        assert r["peak_mem_bytes"] < 12 * n_params + 64 * 2**20
    s = res["summary"]
    by = {(r["variant"], r["n"]): r for r in res["rows"]}
    dense, lin = by[("dense", 64)], by[("linear", 64)]
    assert s["speedup_vs_dense"]["linear"]["64"] == pytest.approx(dense["step_s"] / lin["step_s"])
    assert "128" not in s["speedup_vs_dense"]["linear"]  # no dense row to compare with


def test_cpu_transient_peak_matches_known_allocations():
    mib = 2**20

    def work():
        a = torch.empty(8 * mib, dtype=torch.uint8)
        b = torch.empty(4 * mib, dtype=torch.uint8)  # peak: a and b alive together
        del a, b
        c = torch.empty(2 * mib, dtype=torch.uint8)
        del c

    peak = bench.transient_peak(work, torch.device("cpu"))
    assert 12 * mib <= peak < 12 * mib + 64 * 1024


def test_persistent_bytes_counts_params_and_adamw_state():
    bc = bench.BenchConfig(layers=1, hidden=32, heads=2, k=16, intermediate=64, vocab=97)
    t = bench.Trainee(bc, "linear", 64, torch.device("cpu"))
    t.step()  # creates the optimizer state
    n_params = t.model.num_parameters()
    n_tensors = len(list(t.model.parameters()))
    fp32_params, bf16_params = 4 * n_params, 2 * n_params
    adam = 8 * n_params + 4 * n_tensors  # exp_avg, exp_avg_sq (fp32) and a float32 step each
    inputs = 2 * 8 * 64  # input ids and labels, int64
    assert bc.precision == "bf16"  # bf16 params + fp32 master copy + AdamW state
    assert t.persistent_bytes() == bf16_params + fp32_params + adam + inputs
    auto = bench.Trainee(bench.BenchConfig(**{**vars(bc), "precision": "autocast"}), "linear", 64,
                         torch.device("cpu"))  # fmt: skip
    auto.step()
    assert auto.persistent_bytes() == fp32_params + adam + inputs


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["--variants", "sparse"], "--variants: unknown variant 'sparse'"),
        (
            ["--seq-lens", "100", "--k", "16"],
            "--seq-lens: N=100 must be >= 1 and a multiple of k=16",
        ),
        (["--max-n", "dense:8"], "--max-n: expected VARIANT=N"),
        (["--precision", "fp8"], "--precision: must be one of"),
        (["--hidden", "30", "--heads", "4"], "--hidden 30 is not divisible by --heads 4"),
    ],
)
def test_bad_options_are_named(argv, msg, capsys):
    assert bench.main(argv) == 2
    assert msg in capsys.readouterr().err


def test_replot_rewrites_markdown_and_plots_from_json(tiny_run, tmp_path):
    out, res = tiny_run
    (tmp_path / "results.json").write_text(json.dumps(res))
    assert bench.main(["--replot", str(tmp_path)]) == 0
    assert (tmp_path / "results.md").read_text() == (out / "results.md").read_text()
    assert (tmp_path / "peak_memory.png").read_bytes()[:4] == b"\x89PNG"
    assert bench.main(["--replot", str(tmp_path / "missing")]) == 2


def test_tokens_option_sets_the_batch_per_length():
    bc = bench.BenchConfig(tokens=256, k=16)
    assert [bc.batch_for(n) for n in (64, 128, 512)] == [4, 2, 1]
    t = bench.Trainee(
        bench.BenchConfig(
            tokens=256, layers=1, hidden=32, heads=2, k=16, intermediate=64, vocab=97
        ),
        "conv",
        64,
        torch.device("cpu"),
    )
    assert tuple(t.ids.shape) == (4, 64) and t.tokens == 256
    assert (t.labels != -100).sum().item() == 4 * round(0.15 * 64)


def test_step_budget_stops_a_variant_at_longer_lengths(tmp_path):
    argv = TINY + ["--seq-lens", "64", "128", "--variants", "linear", "--step-budget-s", "0"]
    assert bench.main(argv + ["--no-plots", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(r["n"], r["skipped"]) for r in rows] == [
        (64, None),
        (128, "a shorter N took over --step-budget-s"),
    ]
