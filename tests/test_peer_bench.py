"""bench/peer_bench.py: ours and lucidrains' linformer really do equal work in every sharing mode
(parameters, counted matrix-multiply FLOPs, output shapes; ``none`` differs only by its per-head
E/F parameters), and tiny runs (in this process and one process per model) write their table."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from bench.common import write_results
from bench.peer_bench import (
    PEER_CONFIGS,
    SHARINGS,
    PeerConfig,
    build,
    loss_of,
    main,
    markdown_table,
    our_config,
    run_benchmark,
    unique_parameters,
)
from linformer_ds.model import flops_per_token


def counted_flops(name: str, model: torch.nn.Module, ids: torch.Tensor) -> int:
    """Matrix-multiply FLOPs of one forward + backward, counted by torch's FlopCounterMode (the
    math SDPA backend, whose matmuls it sees), and the logits."""
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        out = model(ids)
        logits = out.logits if hasattr(out, "logits") else out
        logits.float().square().mean().backward()
    return counter.get_total_flops(), logits


@settings(max_examples=10, deadline=None)
@given(
    sharing=st.sampled_from(SHARINGS),
    layers=st.integers(1, 3),
    heads=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([4, 8]),
    k=st.integers(2, 16),
    n_max=st.integers(16, 48),
    short=st.integers(0, 8),
    batch=st.integers(1, 2),
)
def test_equal_work(sharing, layers, heads, head_dim, k, n_max, short, batch):
    """Same parameters but our q/k/v biases (and, under ``none``, our per-head E/F), the same
    counted FLOPs (= our flops_per_token) and the same logits shape, also for inputs shorter
    than max_seq_len."""
    d = heads * head_dim
    pc = PeerConfig(layers=layers, hidden=d, heads=heads, k=k, intermediate=4 * d, vocab=37)
    cfg = our_config(pc, n_max, sharing)
    n = n_max - short
    ids = torch.randint(5, 37, (batch, n), generator=torch.Generator().manual_seed(n))
    ours, theirs = build("ours", cfg), build("lucidrains", cfg)
    extra = 0 if PEER_CONFIGS[sharing][1] else 2 * (heads - 1) * k * n_max * layers
    assert unique_parameters(ours) - unique_parameters(theirs) == 3 * d * layers + extra
    f_ours, logits_ours = counted_flops("ours", ours, ids)
    f_theirs, logits_theirs = counted_flops("lucidrains", theirs, ids)
    assert f_ours == f_theirs == flops_per_token(cfg, n) * batch * n
    assert logits_ours.shape == logits_theirs.shape == (batch, n, 37)


@settings(max_examples=6, deadline=None)
@given(
    layers=st.integers(1, 2),
    heads=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([4, 8]),
    n_max=st.integers(8, 40),
    short=st.integers(0, 6),
    batch=st.integers(1, 2),
)
def test_dense_equal_work_with_hf_bert(layers, heads, head_dim, n_max, short, batch):
    """ours-dense and HF BertForMaskedLM (sdpa): the same counted matrix-multiply FLOPs (= our
    dense flops_per_token), the same logits shape; parameters differ by exactly our final
    LayerNorm minus BERT's one token-type row (hidden)."""
    from dataclasses import replace

    d = heads * head_dim
    pc = PeerConfig(layers=layers, hidden=d, heads=heads, k=4, intermediate=4 * d, vocab=37)
    cfg = our_config(pc, n_max)
    n = n_max - short
    ids = torch.randint(5, 37, (batch, n), generator=torch.Generator().manual_seed(n))
    ours, bert = build("ours-dense", cfg), build("hf-bert", cfg)
    assert unique_parameters(ours) - unique_parameters(bert) == d
    f_ours, logits_ours = counted_flops("ours-dense", ours, ids)
    f_bert, logits_bert = counted_flops("hf-bert", bert, ids)
    dense = replace(cfg, projection="dense")
    assert f_ours == f_bert == flops_per_token(dense, n) * batch * n
    assert logits_ours.shape == logits_bert.shape == (batch, n, 37)


def test_dense_pair_run_records_speedup_vs_hf_bert(tmp_path):
    """--models ours-dense hf-bert (one process each): rows with the dense FLOPs, the ratio
    per round and its median, and a table row; lucidrains' FFN rule does not apply."""
    pc = PeerConfig(layers=1, hidden=16, heads=2, k=4, intermediate=40, vocab=40)
    pc.seq_lens, pc.iters, pc.warmup, pc.gemm_n, pc.gemm_budget_s = [32], 2, 0, 128, 0.2
    pc.models, pc.sharings = ["ours-dense", "hf-bert"], ["headwise"]
    results = run_benchmark(pc, log=lambda _: None)
    rows = {r["model"]: r for r in results["rows"]}
    assert set(rows) == {"ours-dense", "hf-bert"}
    assert rows["ours-dense"]["flops_per_token"] == rows["hf-bert"]["flops_per_token"]
    assert len(rows["ours-dense"]["speedup_vs_hf_bert_per_round"]) == 2
    assert "speedup_vs_lucidrains" not in rows["ours-dense"]
    assert results["environment"]["transformers"]
    _, md_path = write_results(results, tmp_path, markdown_table)
    line = next(ln for ln in md_path.read_text().splitlines() if "| ours-dense |" in ln)
    assert "- (dense)" in line and line.rstrip().endswith("x |")


def test_same_loss_on_same_logits():
    """ours and ours-trainer give the same loss from the same weights (the trainer's head on the
    labelled positions only); the lucidrains loss is the same function of its logits."""
    pc = PeerConfig(layers=1, hidden=16, heads=2, k=4, intermediate=64, vocab=29)
    cfg = our_config(pc, 24)
    ids = torch.randint(5, 29, (2, 24), generator=torch.Generator().manual_seed(0))
    labels = torch.full_like(ids, -100)
    labels[:, ::5] = ids[:, ::5]
    torch.manual_seed(0)
    full = build("ours", cfg)
    torch.manual_seed(0)
    trainer = build("ours-trainer", cfg)
    trainer.load_state_dict(full.state_dict())
    a, b = loss_of("ours", full, ids, labels), loss_of("ours-trainer", trainer, ids, labels)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert torch.isfinite(loss_of("lucidrains", build("lucidrains", cfg), ids, labels))


def test_tiny_run_writes_table(tmp_path):
    pc = PeerConfig(layers=1, hidden=32, heads=2, k=8, intermediate=128, vocab=60)
    pc.seq_lens, pc.iters, pc.warmup, pc.gemm_n, pc.gemm_budget_s = [64], 2, 0, 256, 0.5
    pc.isolation, pc.sharings, pc.beside = "shared", ["headwise"], "nothing"
    results = run_benchmark(pc, log=lambda _: None)
    rows = {r["model"]: r for r in results["rows"]}
    assert set(rows) == {"ours", "lucidrains", "ours-trainer"}
    assert rows["ours"]["flops_per_token"] == rows["lucidrains"]["flops_per_token"]
    assert rows["ours-trainer"]["flops_per_token"] < rows["ours"]["flops_per_token"]
    for r in rows.values():
        assert len(r["step_s_all"]) == 2 and r["mfu"] > 0
    assert len(rows["ours"]["speedup_per_round"]) == 2
    assert results["gemm_dtype"] == "bfloat16"
    json_path, md_path = write_results(results, tmp_path, markdown_table)
    assert json.loads(json_path.read_text())["rows"][0]["n"] == 64
    md = md_path.read_text()
    assert "| 64 | headwise | lucidrains | share_kv=False |" in md and "beside: nothing" in md
    assert len(results["environment"]["load_avg_end"]) == 3


def test_one_process_per_model():
    """isolation=process: each model steps in a process of its own (its peak RSS recorded),
    the turns still interleaved; the kv group pairs ours with lucidrains' tied proj_v."""
    pc = PeerConfig(layers=1, hidden=16, heads=2, k=4, intermediate=64, vocab=40)
    pc.seq_lens, pc.iters, pc.warmup, pc.gemm_n, pc.gemm_budget_s = [32], 2, 0, 128, 0.2
    pc.models, pc.sharings = ["ours", "lucidrains"], ["kv"]
    rows = {r["model"]: r for r in run_benchmark(pc, log=lambda _: None)["rows"]}
    assert set(rows) == {"ours", "lucidrains"}
    for r in rows.values():
        assert r["sharing"] == "kv" and r["equal_work"] and r["peak_rss_gib"] > 0
        assert len(r["step_s_all"]) == 2
    assert rows["ours"]["params"] - rows["lucidrains"]["params"] == 3 * 16


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--intermediate", "100"], "4 x hidden"),
        (["--precision", "fp16"], "--precision"),
        (["--models", "bert"], "--models"),
        (["--sharings", "conv"], "--sharings"),
        (["--isolation", "thread"], "--isolation"),
        (["--seq-lens", "8"], "--seq-lens"),
    ],
)
def test_bad_options_exit_2(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err and "Traceback" not in err
