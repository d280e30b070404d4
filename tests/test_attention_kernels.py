"""The short-key attention kernels (linformer_ds.model.kernels, issue 46 item 3): SDPA and the
explicit product agree with each other and with a float64 reference, forward and backward, with
masks (bf16 and fp32, dropout off); the rule follows its measured table, a forced kernel wins,
export takes SDPA (no branch on a symbolic length); whole models (plain rows, padding,
documents per span and in chunks) give equal losses and gradients whichever kernel runs; under
sequence parallelism the rule sees the rank's slice and P = 2 still equals P = 1 when the two
pick different kernels."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from linformer_ds.model import ModelConfig, kernels
from linformer_ds.model.kernels import (
    EXPLICIT_UP_TO,
    attention_kernel,
    explicit_attention,
    pick_kernel,
    short_attention,
)
from linformer_ds.perf import DENSE_DROPOUT_ON_CPU, slow_kernels
from tests.pretrain_utils import child_env

REPO = Path(__file__).resolve().parents[1]
# max |kernel - float64| / max |float64| (outputs and gradients), per dtype
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def reference(q, k, v, mask):
    """float64 ``softmax(q k^T / sqrt(d) + mask) v``."""
    q, k, v = (t.double() for t in (q, k, v))
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s.softmax(-1) @ v


def _inputs(b, h, n, m, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    # the model's layout: [B, n, h, d] viewed heads-first (strided)
    q, k, v = (torch.randn(b, s, h, d, generator=g).transpose(1, 2) for s in (n, m, m))
    mask = torch.ones(b, 1, 1, m, dtype=torch.bool)
    mask[-1, ..., m // 2 :] = False  # the last row's second half of summaries is padding
    dy = torch.randn(b, h, n, d, generator=g)
    return [t.to(dtype) for t in (q, k, v)], mask, dy


def _run(fn, qkv, mask, dy):
    leaves = [t.detach().clone().requires_grad_() for t in qkv]
    y = fn(*leaves, mask)
    y.backward(dy.to(y.dtype))
    return [y.detach()] + [t.grad for t in leaves]


def rel(a, ref):
    return ((a.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n,m", [(1, 8), (17, 8), (64, 32), (96, 128)])
@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "mask"])
def test_kernels_agree_with_float64(dtype, n, m, masked):
    qkv, mask, dy = _inputs(2, 3, n, m, 16, dtype, seed=n * 100 + m)
    mask = mask if masked else None
    want = _run(reference, qkv, mask, dy.double())
    sdpa = _run(lambda q, k, v, am: F.scaled_dot_product_attention(q, k, v, attn_mask=am),
                qkv, mask, dy)  # fmt: skip
    expl = _run(explicit_attention, qkv, mask, dy)
    for name, w, s, e in zip(("y", "dq", "dk", "dv"), want, sdpa, expl):
        assert s.dtype == e.dtype == dtype, name
        assert rel(s, w) <= TOL[dtype], (name, "sdpa", rel(s, w))
        assert rel(e, w) <= TOL[dtype], (name, "explicit", rel(e, w))
        assert rel(e, s.double()) <= 2 * TOL[dtype], (name, "explicit vs sdpa")
    if masked:  # padding summaries get no gradient from either kernel
        assert expl[2][-1, :, m // 2 :].abs().max() == 0 == sdpa[2][-1, :, m // 2 :].abs().max()


def test_rule_follows_its_table_and_can_be_forced(monkeypatch):
    cpu = torch.device("cpu")
    for dtype in (torch.bfloat16, torch.float32):
        rows = EXPLICIT_UP_TO[("cpu", dtype)]
        assert [m for m, _ in rows] == sorted(m for m, _ in rows)
        for m_max, n_max in rows:
            if n_max:
                assert pick_kernel(n_max, m_max, dtype, cpu) == "explicit"
            assert pick_kernel(n_max + 1, m_max, dtype, cpu) == "sdpa"
        beyond = rows[-1][0] + 1 if rows else 8  # beyond the table (fp32: empty, SDPA)
        assert pick_kernel(8, beyond, dtype, cpu) == "sdpa"
    assert pick_kernel(512, 256, torch.bfloat16, cpu) == "explicit"  # the N = 512 block
    assert pick_kernel(1024, 256, torch.bfloat16, cpu) == "sdpa"
    assert pick_kernel(8, 8, torch.float16, cpu) == "sdpa"  # not measured: SDPA
    assert pick_kernel(8, 8, torch.float32, torch.device("cuda")) == "sdpa"
    with attention_kernel("sdpa"):
        assert pick_kernel(8, 8, torch.float32, cpu) == "sdpa"
        with attention_kernel("explicit"):
            assert pick_kernel(10**6, 10**6, torch.float32, cpu) == "explicit"
        assert pick_kernel(8, 8, torch.float32, cpu) == "sdpa"
    with pytest.raises(ValueError, match="one of"):
        with attention_kernel("flash"):
            pass
    monkeypatch.setattr(kernels, "tracing", lambda: True)  # export: no branch on the length
    assert pick_kernel(10**6, 10**6, torch.float32, cpu) == kernels.TRACED_KERNEL == "sdpa"


def test_short_attention_dispatches_by_the_rule(monkeypatch):
    calls = []
    monkeypatch.setattr(kernels, "explicit_attention", lambda *a: calls.append("explicit") or 0)
    monkeypatch.setattr(kernels.F, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append("sdpa") or 0)  # fmt: skip
    monkeypatch.setattr(kernels, "EXPLICIT_UP_TO", {("cpu", torch.float32): ((16, 32),)})
    q = torch.zeros(1, 1, 32, 4)
    short_attention(q, torch.zeros(1, 1, 16, 4), torch.zeros(1, 1, 16, 4))
    short_attention(q, torch.zeros(1, 1, 17, 4), torch.zeros(1, 1, 17, 4))
    short_attention(torch.zeros(1, 1, 33, 4), torch.zeros(1, 1, 16, 4), torch.zeros(1, 1, 16, 4))
    assert calls == ["explicit", "sdpa", "sdpa"]


def _model(projection, sharing, dtype):
    from linformer_ds.model import LinformerForMaskedLM, ModelConfig

    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=60, max_seq_len=48, hidden_size=32, num_layers=2, num_heads=2,
        intermediate_size=64, k=8, projection=projection, sharing=sharing, dropout=0.0,
        attention_dropout=0.0,
    )  # fmt: skip
    return LinformerForMaskedLM(cfg).to(dtype)


def _loss_and_grads(model, batch, kernel):
    model.zero_grad()
    with attention_kernel(kernel):
        hidden = model.encoder(batch["ids"], batch["mask"], position_ids=batch.get("pos"))
    loss = hidden.float().square().mean()
    loss.backward()
    return loss.item(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "projection,sharing,layout",
    [("linear", "headwise", "rows"), ("linear", "layerwise", "per_span"),
     ("conv", "kv", "chunks"), ("linear", "none", "chunks")],
)  # fmt: skip
def test_models_equal_whichever_kernel_runs(dtype, projection, sharing, layout):
    """The plain path (padded rows) and document isolation (per span, chunks): the loss and
    every gradient with the explicit product forced equal SDPA forced (fp32 1e-5, bf16 3e-2 of
    the largest gradient)."""
    model = _model(projection, sharing, dtype)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 60, (3, 48), generator=g)
    mask = torch.ones(3, 48, dtype=torch.long)
    mask[1, 30:] = 0
    mask[2, 9:] = 0
    batch = {"ids": ids.masked_fill(mask == 0, 0), "mask": mask}
    if layout != "rows":  # three documents in row 0, two in row 1
        pos = torch.arange(48).repeat(3, 1)
        pos[0, 20:] -= 20
        pos[0, 36:] -= 16
        pos[1, 12:] -= 12
        batch["pos"] = pos
        model.encoder.document_per_span = layout == "per_span"
    loss_s, grads_s = _loss_and_grads(model, batch, "sdpa")
    loss_e, grads_e = _loss_and_grads(model, batch, "explicit")
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert abs(loss_e - loss_s) <= tol * abs(loss_s)
    assert grads_s.keys() == grads_e.keys() and len(grads_s) > 10
    scale = max(g.abs().max().item() for g in grads_s.values())
    worst = max(((grads_e[n] - grads_s[n]).abs().max().item(), n) for n in grads_s)
    assert worst[0] <= tol * scale, worst


def test_bench_rule_and_a_tiny_run(tmp_path):
    """bench/attention_kernel_bench.py: the rule keeps the explicit product up to the first
    length where it is not ``margin`` faster; a tiny grid run writes its table."""
    from bench.attention_kernel_bench import main, rule

    cells = [{"dtype": "bf16", "m": 8, "n": n, "sdpa_over_explicit": r}
             for n, r in ((16, 2.0), (32, 1.2), (64, 1.01), (128, 1.5))]  # fmt: skip
    cells += [{"dtype": "bf16", "m": 16, "n": 16, "sdpa_over_explicit": 0.9}]
    assert rule(cells, 1.05) == {"bf16": [[8, 32], [16, 0]]}
    assert main(["--dtypes", "fp32", "--key-lens", "8", "--seq-lens", "4", "8", "--batch", "1",
                 "--heads", "2", "--head-dim", "4", "--rounds", "1", "--warmup", "0",
                 "--block-lens", "--out", str(tmp_path)]) == 0  # fmt: skip
    res = json.loads((tmp_path / "results.json").read_text())
    assert [(c["m"], c["n"]) for c in res["grid"]] == [(8, 4), (8, 8)] and "fp32" in res["rule"]
    assert "rule (fp32" in (tmp_path / "results.md").read_text()


# ---------------------------------------------------------------- sequence parallel (2 ranks)
def _sp_worker(rank: int, world: int, port: int, out: str) -> None:
    """P = 2 (explicit on the 12-row slice) vs P = 1 (SDPA on the 24-row whole): equal."""
    import copy

    import torch.distributed as dist

    sys.path.insert(0, str(REPO))
    from tests.pretrain_utils import init_gloo_rank
    from tests.test_sequence_parallel import BASE, make_batch, reference_loss, rel_err, sp_loss

    init_gloo_rank(rank, world, port)
    from linformer_ds.model import LinformerForMaskedLM, ModelConfig
    from linformer_ds.parallel import groups as grp
    from linformer_ds.parallel import sharding
    from linformer_ds.parallel.parallelize import apply_sequence_parallel

    # m = k = 8 summaries: explicit up to 12 queries (the slice), SDPA for 24 (the whole row)
    kernels.EXPLICIT_UP_TO = {("cpu", torch.float32): ((8, 12),)}
    seen = []
    pick = kernels.pick_kernel
    kernels.pick_kernel = lambda n, m, *a: seen.append((n, m, pick(n, m, *a))) or seen[-1][2]
    groups = grp.build_groups(world)
    batch = make_batch(3)
    local, _ = sharding.shard_batch(batch, groups.sp_rank, groups.sp_size)
    errs = {}
    for sharing in ("headwise", "layerwise"):
        torch.manual_seed(0)
        ref = LinformerForMaskedLM(ModelConfig(**{**BASE, "sharing": sharing}))
        model = copy.deepcopy(ref)
        apply_sequence_parallel(model, groups.sp_group)
        seen.clear()
        reference_loss(ref, batch).backward()
        ref_kernels = sorted(set(seen))
        seen.clear()
        loss = sp_loss(model, local, groups.sp_group)
        loss.backward()
        sp_kernels = sorted(set(seen))
        total = loss.detach().clone()
        dist.all_reduce(total, group=groups.sp_group)
        loss_ref = reference_loss(ref, batch).item()
        case = {"loss": abs(total.item() - loss_ref) / abs(loss_ref)}
        for (name, p_ref), (_, p) in zip(ref.named_parameters(), model.named_parameters()):
            grad = p.grad.clone()
            dist.all_reduce(grad, group=groups.sp_group)
            case[name] = rel_err(grad, p_ref.grad, 1e-6 * p_ref.grad.abs().max().item())
        errs[sharing] = {"errs": case, "ref": ref_kernels, "sp": sp_kernels}
    Path(out, f"rank{rank}.json").write_text(json.dumps(errs))
    dist.barrier()
    os._exit(0)  # skip gloo teardown at interpreter exit (it can abort: "terminate called")


def test_sequence_parallel_rule_sees_the_rank_slice(tmp_path):
    """Two ranks, gloo, fp32: with a rule that gives the 12-row slice the explicit product and
    the 24-row whole SDPA, the loss and every gradient equal P = 1 to 1e-5."""
    from linformer_ds.dist_env import free_port

    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(r), "2", str(port), str(tmp_path)],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for r in range(2)
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{logs[r][-4000:]}"
    for r in range(2):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        for sharing, case in res.items():
            assert case["ref"] == [[24, 8, "sdpa"]], (sharing, case["ref"])
            assert case["sp"] == [[12, 8, "explicit"]], (sharing, case["sp"])
            bad = {k: v for k, v in case["errs"].items() if not v <= 1e-5}
            assert not bad and len(case["errs"]) > 10, (sharing, bad)


# ------------------------------------------------- the start-up warning for a slow CPU kernel
def _sdpa_ops(dropout_p: float) -> set[str]:
    q = torch.randn(1, 2, 64, 16)
    with torch.profiler.profile() as prof:
        F.scaled_dot_product_attention(q, q, q, dropout_p=dropout_p)
    return {e.name for e in prof.events() if e.name.startswith("aten::_scaled_dot_product")}


@given(
    schedule=st.lists(st.sampled_from(["dense", "linear", "conv", "local"]), min_size=1,
                      max_size=4),
    dropout=st.sampled_from([0.0, 0.1, 0.5]),
    device=st.sampled_from(["cpu", "cuda"]),
)  # fmt: skip
@settings(max_examples=60, deadline=None)
def test_dense_attention_dropout_on_cpu_is_warned_of_and_is_the_math_path(schedule, dropout,
                                                                           device):  # fmt: skip
    """perf.slow_kernels warns exactly when a dense layer trains with attention dropout on the
    CPU, and torch does take the unfused math path there (it warns of a fact: with a fused CPU
    kernel for dropout in a later torch this fails and the warning goes)."""
    model = ModelConfig(layer_projections=schedule, num_layers=len(schedule),
                        attention_dropout=dropout,
                        local_window=16 if set(schedule) - {"dense"} else 0)  # fmt: skip
    slow = "dense" in schedule and dropout > 0 and device == "cpu"
    assert slow_kernels(model, device) == ([DENSE_DROPOUT_ON_CPU] if slow else [])
    if slow:
        assert _sdpa_ops(dropout) == {"aten::_scaled_dot_product_attention_math"}
        assert _sdpa_ops(0.0) == {"aten::_scaled_dot_product_flash_attention_for_cpu"}


if __name__ == "__main__":
    _sp_worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
