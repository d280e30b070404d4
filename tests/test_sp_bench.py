"""The sequence-parallel benchmark at tiny sizes: real gloo ranks and DeepSpeed, every phase once;
its numbers checked against independent references (bytes formula, parameter counts, the P = 1
loss, ZeRO-3 partition sizes)."""

import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from bench import sp_bench
from bench.sp_collectives import collective_bytes_per_layer
from linformer_ds.model import LinformerForMaskedLMPretraining

N, H, K, L, VOCAB = 128, 32, 16, 2, 97
TINY = [
    "--layers", str(L), "--hidden", str(H), "--heads", "2", "--k", str(K), "--intermediate", "64",
    "--vocab", str(VOCAB), "--warmup", "1", "--iters", "1", "--case-timeout-s", "300",
]  # fmt: skip


def _tool(out: Path, argv: list[str]) -> tuple[Path, dict]:
    """``python -m bench.sp_bench ... --out OUT`` (in this process): OUT and its results.json."""
    assert sp_bench.main(argv + ["--out", str(out)]) == 0
    return out, json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def tool_runs(tmp_path_factory, tiny_corpus):
    """The tool's two runs of this module at once (the frontier phase in a second thread: their
    one-rank cases and start-ups leave a core free): the comm, memory and trainer phases, and
    the frontier phase. Each case still runs in its own fresh rank processes."""
    phases = TINY + [
        "--phases", "comm", "memory", "trainer", "--seq-lens", str(N), "--sp", "2",
        "--memory-seq-len", str(N), "--memory-sp", "1", "--zero-sweep", "3",
        "--trainer-data", str(tiny_corpus), "--trainer-sp", "2",
        "--no-shard",  # E/F and positions whole on every rank (the sharded rows: frontier)
    ]  # fmt: skip
    frontier = TINY + [
        "--phases", "frontier", "--frontier-seq-lens", str(N), "--frontier-sp", "1", "2",
        "--frontier-ac", "0", "1",
    ]  # fmt: skip
    with ThreadPoolExecutor(1) as pool:
        second = pool.submit(_tool, tmp_path_factory.mktemp("sp_bench_frontier"), frontier)
        first = _tool(tmp_path_factory.mktemp("sp_bench"), phases)
        return first, second.result()


@pytest.fixture(scope="module")
def tiny_run(tool_runs):
    out, res = tool_runs[0]
    return out, res, {(r["phase"], r.get("variant"), r["p"], r["zero"]): r for r in res["rows"]}


def _param_bytes() -> int:
    bc = sp_bench.SPBenchConfig(layers=L, hidden=H, heads=2, k=K, intermediate=64, vocab=VOCAB)
    cfg = sp_bench.model_config(bc, "linear", N)
    return 4 * LinformerForMaskedLMPretraining(cfg).num_parameters()  # fp32, tied weights once


def test_writes_json_and_markdown(tiny_run):
    out, res, rows = tiny_run
    assert set(rows) == {
        ("comm", "linear", 2, 2), ("comm", "dense", 2, 2), ("memory", "linear", 1, 2),
        ("memory", "linear", 2, 3), ("trainer", None, 2, 2),
    }  # fmt: skip
    md = (out / "results.md").read_text()
    assert "| linear | 128 | 2 |" in md and "| dense | 128 | 2 |" in md
    assert "DIFFERS" not in md and "failed" not in md
    assert res["environment"]["deepspeed"] and res["config"]["seq_lens"] == [N]


def test_bytes_per_layer_equal_the_formula(tiny_run):
    _, _, rows = tiny_run
    for variant in ("linear", "dense"):
        r = rows[("comm", variant, 2, 2)]
        want = collective_bytes_per_layer(
            variant, seq_len=N, sp_size=2, batch_size=1, hidden_size=H, k=K
        )
        assert r["sp_fwd_bytes_per_layer"] == want["forward"] > 0
        assert r["sp_bwd_bytes_per_layer"] == want["backward"] > 0
        assert r["bytes_match"] is True
    # by hand: linear one [1, k, 2H] fp32 all-reduce; dense four [1, N/2, H] all-to-alls + mask
    assert rows[("comm", "linear", 2, 2)]["sp_fwd_bytes_per_layer"] == K * 2 * H * 4
    assert rows[("comm", "dense", 2, 2)]["sp_fwd_bytes_per_layer"] == 4 * 64 * H * 4 + 64
    # ZeRO-2 reduces every gradient once (plus scalars such as the overflow check)
    grad = rows[("comm", "linear", 2, 2)]["grad_reduce_bytes"]
    assert _param_bytes() <= grad <= _param_bytes() + 64


def test_times_memory_and_losses_are_sane(tiny_run):
    _, _, rows = tiny_run
    ref = rows[("memory", "linear", 1, 2)]  # one rank holding the whole sequence
    for key, r in rows.items():
        if key[0] == "trainer":
            continue
        assert r["step_s"] > 0 and r["tokens_per_s"] == pytest.approx(N / r["step_s"])
        assert 0 <= r["sp_comm_s"] < r["step_s"]
        assert len(r["peak_rss_per_rank"]) == r["p"]
        for peak, base in zip(r["peak_rss_per_rank"], r["rss_after_imports"]):
            assert peak >= base > 50 * 2**20
        assert math.isclose(r["loss_first"], math.log(VOCAB), rel_tol=0.2)
    # the same model and row split over 2 ranks: the summed loss equals the one-rank loss
    for key in (("comm", "linear", 2, 2), ("memory", "linear", 2, 3)):
        assert rows[key]["loss_first"] == pytest.approx(ref["loss_first"], rel=1e-5)
    assert ref["sp_fwd_bytes_per_layer"] == ref["sp_bwd_bytes_per_layer"] == 0


def test_what_each_rank_holds(tiny_run):
    _, _, rows = tiny_run
    full, z3 = rows[("memory", "linear", 1, 2)], rows[("memory", "linear", 2, 3)]
    assert full["model_param_bytes"] == _param_bytes()
    assert full["positions_local"] == full["positions_full"] == N * H
    assert full["E_local"] == full["E_full"] == K * N
    # ZeRO-3 over the 2 SP ranks: half of E and of the position table at rest
    assert z3["positions_local"] * 2 == z3["positions_full"] == N * H
    assert z3["E_local"] * 2 == z3["E_full"] == K * N
    assert z3["model_param_bytes"] < 0.6 * full["model_param_bytes"]
    # AdamW's two moments (and the fp32 master partition) of the rank's share at least
    assert full["optimizer_bytes"] >= 2 * full["model_param_bytes"]
    assert z3["optimizer_bytes"] >= 2 * z3["model_param_bytes"]


def test_trainer_phase_runs_one_step(tiny_run):
    _, _, rows = tiny_run
    r = rows[("trainer", None, 2, 2)]
    assert r["returncode"] == 0 and "failed" not in r
    assert r["metrics"]["step"] == 1 and math.isfinite(r["metrics"]["loss"])
    assert len(r["peak_rss_per_rank_sampled"]) == 2
    assert all(x > 50 * 2**20 for x in r["peak_rss_per_rank_sampled"])


def test_bad_options_are_one_line_errors(capsys):
    assert sp_bench.main(["--heads", "3", "--hidden", "64"]) == 2
    assert "--hidden 64 is not divisible by --heads 3" in capsys.readouterr().err
    assert sp_bench.main(["--phases", "trainer"]) == 2
    assert "--trainer-data" in capsys.readouterr().err
    assert sp_bench.main(["--seq-lens", "100", "--sp", "3", "--variants", "linear"]) == 2
    assert "divisible by P=3" in capsys.readouterr().err


def test_frontier_second_step_sharded(tool_runs):
    """The frontier phase: the second step at P = 1 and 2 (sharded), activation checkpointing
    off and on: its time and per-rank peak RSS; P = 2 holds half of E and the positions, its
    loss equals one rank's, and the layers' exchange still equals the formula."""
    out, res = tool_runs[1]
    rows = {(r["p"], r["ac"]): r for r in res["rows"]}
    assert set(rows) == {(1, False), (1, True), (2, False), (2, True)}
    md = (out / "results.md").read_text()
    assert "| 128 | 2 | sublayer | sharded |" in md and "| 128 | 1 | off | whole |" in md
    one = rows[(1, False)]
    for (p, _ac), r in rows.items():
        assert len(r["step_s_all"]) == 1 and r["step_s"] > 0  # the second step, timed
        assert len(r["step_peak_rss_per_rank"]) == p
        # the breakdown: its parts sum to each rank's peak; params, grads, optimizer counted
        for peak, b in zip(r["step_peak_rss_per_rank"], r["breakdown_per_rank"]):
            assert sum(b[k] for k in sp_bench.BREAKDOWN) == b["peak"] == peak
            assert b["params"] == r["model_param_bytes"] and b["optimizer"] == r["optimizer_bytes"]
            # fp32 ZeRO-2, one data-parallel rank: every trainable parameter's gradient is held
            assert b["params"] <= b["grads"] <= b["params"] + 4096, (b["grads"], b["params"])
            assert b["activations"] >= 0 and b["libraries"] in r["rss_after_imports"]
        assert all(x > 50 * 2**20 for x in r["step_peak_rss_per_rank"])
        assert r["loss_first"] == pytest.approx(one["loss_first"], rel=1e-5)
        assert r["positions_full"] == N * H and r["E_full"] == K * N
        assert r["positions_local"] * p == N * H and r["E_local"] * p == K * N
        assert r["bytes_match"] is True
        # sharded: the replicated gradients are summed over the SP group, E and positions not
        assert (r["sp_grad_bytes"] > 0) == (p > 1)
        if p > 1:
            assert r["sp_grad_bytes"] == _param_bytes() - 4 * (N * H + K * N)
