"""bench/profile_step.py: ops land in the right category and phase, and a tiny equal-work
profile accounts for the whole step (categories + unattributed = the phases' wall time)."""

import json

import pytest

from bench.profile_step import (
    CATEGORIES,
    PHASES,
    ProfileConfig,
    category,
    main,
    markdown,
    run_profile,
)


@pytest.mark.parametrize(
    "name, phase, expected",
    [
        ("aten::mm", "backward", 0),
        ("aten::addmm", "forward", 0),
        ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "backward", 1),
        ("aten::_softmax", "forward", 2),
        ("aten::_log_softmax_backward_data", "backward", 3),
        ("aten::nll_loss_forward", "forward", 3),
        ("aten::native_layer_norm_backward", "backward", 4),
        ("aten::gelu", "forward", 5),
        ("aten::_to_copy", "forward", 6),
        ("aten::copy_", "optimizer", 6),
        ("aten::_fused_adamw_", "optimizer", 7),
        ("aten::mul_", "optimizer", 7),
        ("aten::embedding_dense_backward", "backward", 8),
        ("aten::cat", "backward", 9),
    ],
)
def test_category(name, phase, expected):
    assert category(name, phase) == CATEGORIES[expected]


def test_tiny_equal_work_profile(tmp_path):
    pc = ProfileConfig(layers=1, hidden=32, heads=2, k=8, intermediate=128, vocab=60)
    pc.seq_lens, pc.paths, pc.iters, pc.gemm_n, pc.gemm_budget_s = [64], ["equal-work"], 1, 128, 0.2
    pc.beside = "nothing"
    results = run_profile(pc, log=lambda _: None)
    (row,) = results["rows"]
    table = row["self_s_per_step"]
    assert set(table) == set(CATEGORIES)
    gemm = sum(table[CATEGORIES[0]].values())
    assert gemm > 0 and row["gemm_flops_per_step"] > 0
    assert sum(table[CATEGORIES[7]].values()) > 0  # the AdamW step
    for p in PHASES:  # every phase's wall time is fully accounted for (up to rounding)
        accounted = sum(table[c].get(p, 0.0) for c in CATEGORIES)
        assert accounted == pytest.approx(row["phase_wall_s_per_step"][p], rel=1e-6, abs=1e-6)
    assert len(row["step_wall_s_timed"]) == pc.timed and row["step_wall_s"] > 0
    md = markdown(results)
    assert "**equal-work, N = 64**" in md and "beside: nothing" in md
    mfu = row["model_flops_per_step"] / row["step_wall_s"] / 1e12 / results["gemm_peak_tflops"]
    assert f"MFU {mfu * 100:.1f} %" in md
    assert json.dumps(results)  # serialisable


def test_bad_options_exit_2(capsys):
    assert main(["--paths", "dense"]) == 2
    assert main(["--ds-extra", "fused"]) == 2
    assert main(["--timed", "0"]) == 2
    err = capsys.readouterr().err
    assert "--paths" in err and "--ds-extra" in err and "--timed" in err
    assert "Traceback" not in err
