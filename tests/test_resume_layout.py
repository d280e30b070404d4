"""Resuming in another layout under ZeRO-0 and ZeRO-3 (ZeRO-1/2: tests/test_sp_train.py).

One chain per ZeRO stage hops, two optimizer steps at a time, through every change of the
sequence-parallel size P (1 <-> 2), of the E/F / position sharding (sharded <-> whole) and of
the data-parallel size, each hop resuming the previous hop's checkpoint (ZeRO-3 through
DeepSpeed's universal checkpoint, ZeRO-0 through re-sharded native files, or natively where
nothing changes on disk). Invariant: every step's loss and gradient norm equal an
uninterrupted one-rank run's within the layout-invariance tolerance (fp32), and so do the final
parameters; a loaded weight or Adam moment that was wrong would show within the hop's two
steps. Each world size's hops of both chains run in one process-group launch
(tests/layout_worker.py): 6 launches in all, which also train tests/test_frozen_resume.py's
frozen chains (tests/conftest.py's ``layout_chains``: 7 launches for both modules, not 10).
"""

import os
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.pretrain_utils import read_metrics, start_worker_ranks, wait_worker_ranks

RTOL = 1e-6  # per-step loss and gradient norm (measured worst: see test docstring)
GLOBAL_ROWS = 8  # rows per optimizer step in every layout
HOP = 2  # optimizer steps per hop
# (ranks, P, E/F and positions sharded) of each hop, in order; each hop resumes the previous one
# A sharded P > 1 run leaves DeepSpeed's global mpu set for the next run in the same process,
# so within one launch the sharded hops come last.
CHAIN: list[tuple[int, int, bool]] = [
    (1, 1, False),  # steps 1-2 on one rank
    (2, 1, False),  # one rank -> DP 2 (ZeRO-3: 1 -> 2 partitions)
    (2, 2, False),  # DP 2 -> P = 2 whole (the same files either way: native)
    (2, 2, True),  # whole -> sharded, same ranks
    (1, 1, False),  # sharded P = 2 -> one rank
    (2, 2, True),  # one rank -> sharded P = 2
    (1, 1, False),  # sharded P = 2 -> one rank
    (4, 2, True),  # one rank -> DP 2 x sharded P = 2
]
STEPS = HOP * len(CHAIN)
STAGES = (0, 3)
COMMON = [
    "deepspeed.precision=fp32",
    "model.attention_dropout=0.0",
    "model.dropout=0.0",
    "data.short_seq_prob=0.5",  # padded rows: labelled counts differ between ranks
    "optimizer.weight_decay=20",  # a parameter in the wrong decay group after a load shows
    f"train.max_steps={STEPS}",
    "train.eval_interval=0",
    "checkpoint.save_interval=0",
    "checkpoint.save_final=true",
]


def _overrides(data: Path, ckpt: Path, stage: int, ranks: int, p: int, shard: bool) -> list[str]:
    return COMMON + [
        f"data.path={data}",
        f"checkpoint.dir={ckpt}",
        f"deepspeed.zero.stage={stage}",
        f"parallel.sequence_parallel_size={p}",
        f"parallel.shard_sequence_parameters={str(shard).lower()}",
        f"train.micro_batch_size={GLOBAL_ROWS // (ranks // p)}",
    ]


def _launch(ranks: int, runs: list[dict], out: Path, name: str) -> str:
    """Train ``runs`` in turn in one process group of ``ranks``; returns rank 0's log (stdout
    and stderr as written)."""
    procs = start_worker_ranks(ranks, runs, out, name, merge_stderr=True)
    wait_worker_ranks(procs, out, name, timeout=900)
    return (out / f"{name}.rank0").read_text()


def chain_launches(data: Path, out: Path, prefix: str) -> list[tuple[int, list[dict]]]:
    """The reference (one rank, ZeRO-0, uninterrupted) and one chain per ZeRO stage as
    process-group launches ``(ranks, runs)`` in order; run ``NAME`` logs to ``out/NAME`` and
    is named ``prefix/NAME`` (``out`` is ``prefix`` under the launches' folder)."""
    ref = {"name": f"{prefix}/ref", "overrides": _overrides(data, out / "ref_ckpt", 0, 1, 1, False)}
    ref["overrides"] += ["checkpoint.save_final=false"]
    launches: list[tuple[int, list[dict]]] = [(1, [ref])]
    for i, (ranks, p, shard) in enumerate(CHAIN):
        if launches[-1][0] != ranks:
            launches.append((ranks, []))
        for stage in STAGES:
            over = _overrides(data, out / f"z{stage}_ckpt", stage, ranks, p, shard)
            over.append(f"train.stop_at_step={HOP * (i + 1)}")
            launches[-1][1].append({"name": f"{prefix}/z{stage}_hop{i}", "overrides": over})
    return launches


@pytest.fixture(scope="module")
def chains(layout_chains) -> tuple[Path, dict[int, list[str]]]:
    """The reference and the chains (:func:`chain_launches`, trained in launches shared with
    tests/test_frozen_resume.py's chains: tests/conftest.py's ``layout_chains``). Returns the
    output directory and, per stage, rank 0's lines that name the stage's chain checkpoint
    directory (each hop's resume line among them)."""
    out, logs = layout_chains["resume"], layout_chains["logs"]
    resumes = {
        s: [ln for log in logs for ln in log.splitlines() if str(out / f"z{s}_ckpt") in ln]
        for s in STAGES
    }
    return out, resumes


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def read_chain(out: Path, stage: int, hops: int) -> dict[int, dict]:
    """The metrics of hops ``z{stage}_hop0..`` of a chain under ``out``, joined by step; each
    hop holds exactly its own ``HOP`` steps."""
    got: dict[int, dict] = {}
    for i in range(hops):
        hop = read_metrics(out / f"z{stage}_hop{i}")
        assert sorted(hop) == list(range(HOP * i + 1, HOP * (i + 1) + 1)), (i, sorted(hop))
        got.update(hop)
    return got


@pytest.mark.slow  # the chains: 6 launches of 1, 2 and 4 ranks (~2.5 min on 2 busy cores)
@pytest.mark.parametrize("stage", STAGES)
def test_resume_across_layouts_equals_uninterrupted_run(chains, stage):
    """ZeRO-0 and ZeRO-3: a run hopping 1 rank -> DP 2 -> P=2 whole -> P=2 sharded -> 1 rank
    -> P=2 sharded -> 1 rank -> DP 2 x P=2 sharded trains the same model as one uninterrupted rank: every
    step's loss and gradient norm within 1e-6 relative, every final parameter tensor within
    1e-5 (measured worst: printed)."""
    out, resumes = chains
    ref = read_metrics(out / "ref")
    got = read_chain(out, stage, len(CHAIN))
    worst = {"loss": 0.0, "grad_norm": 0.0, "param": 0.0}
    for s in range(1, STEPS + 1):
        for key in ("loss", "grad_norm"):
            worst[key] = max(worst[key], _rel(got[s][key], ref[s][key]))
    params = torch.load(out / f"z{stage}_hop{len(CHAIN) - 1}" / "params.pt")
    want = torch.load(out / "ref" / "params.pt")
    assert params.keys() == want.keys()
    for k, w in want.items():
        assert params[k].shape == w.shape, k
        d = (params[k] - w).double().norm().item() / max(w.double().norm().item(), 1e-12)
        worst["param"] = max(worst["param"], d)
    print(f"\nZeRO-{stage} chain, {STEPS} steps, worst relative difference: {worst}")
    assert worst["loss"] <= RTOL and worst["grad_norm"] <= RTOL, worst
    assert worst["param"] <= 10 * RTOL, worst
    assert ref[STEPS]["loss"] < ref[1]["loss"]
    # each hop resumed the previous hop's last step, by the route its stage takes
    resumed = [ln for ln in resumes[stage] if ": step " in ln and "sampler consumed" in ln]
    assert [int(ln.split(": step ")[1].split(",")[0]) for ln in resumed] == [
        HOP * i for i in range(1, len(CHAIN))
    ]
    said = "\n".join(resumes[stage])
    if stage == 3:  # every hop that changes the ranks or the sharding: universal
        assert said.count("universal checkpoint") == 6, said
    else:  # the five sharding changes re-shard; the rest (world, P whole) load natively
        assert said.count("re-shard") == 5 and "universal" not in said, said
    assert not (out / f"z{stage}_ckpt" / "universal").exists()  # derived data removed


@pytest.mark.slow  # uses the chains
def test_zero0_reshard_round_trip_is_exact(chains, tmp_path):
    """reshard_zero0 on the ZeRO-0 chain's last (P = 2 sharded) checkpoint: joined whole (P = 1) its
    weights equal the exporter's consolidation; cut again for P = 2, every weight, Adam moment
    and step equals the saved files bit for bit."""
    from linformer_ds import engine as eng
    from linformer_ds.checkpoint.io import safe_torch_load
    from linformer_ds.checkpoint.reshard import reshard_zero0
    from linformer_ds.checkpoint.tags import read_meta, sharded_sp_size, tag_for
    from linformer_ds.config import load_config
    from linformer_ds.export import consolidate
    from linformer_ds.optim import param_groups
    from tests.pretrain_utils import TEST_OVERRIDES, TINY_CONFIG

    out, _ = chains
    ckpt = out / "z0_ckpt"
    tag = tag_for(STEPS)  # the last hop's: DP 2 x P = 2 sharded
    assert sharded_sp_size(read_meta(str(ckpt), tag)) == 2
    model = eng.build_model(load_config(TINY_CONFIG, TEST_OVERRIDES + COMMON))
    name_of = {id(p): n for n, p in model.named_parameters()}
    index_names = [name_of[id(p)] for g in param_groups(model, 20.0) for p in g["params"]]
    reshard_zero0(str(ckpt), tag, 2, 1, index_names, str(tmp_path / "p1"))
    reshard_zero0(str(tmp_path / "p1"), tag, 1, 2, index_names, str(tmp_path / "p2"))

    whole = safe_torch_load(str(tmp_path / "p1" / tag / "mp_rank_00_model_states.pt"))
    assert not (tmp_path / "p1" / tag / "mp_rank_01_model_states.pt").exists()
    want = consolidate(str(ckpt), tag)
    assert whole["module"].keys() == want.keys()
    for k, w in want.items():
        assert torch.equal(whole["module"][k].float(), w), k
    pos = [k for k in want if k.endswith("position_embeddings.weight")]
    assert pos and all(whole["module"][k].shape[0] == 128 for k in pos)  # every position (N)
    for r in (0, 1):
        name = f"mp_rank_{r:02d}_model_states.pt"
        a = safe_torch_load(str(ckpt / tag / name))
        b = safe_torch_load(str(tmp_path / "p2" / tag / name))
        assert a["module"].keys() == b["module"].keys()
        for k in a["module"]:
            assert torch.equal(a["module"][k], b["module"][k]), (r, k)
        sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
        assert (
            sa.keys() == sb.keys()
            and a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
        )
        for i in sa:
            assert sa[i].keys() == sb[i].keys() == {"step", "exp_avg", "exp_avg_sq"}
            for key in sa[i]:
                assert torch.equal(sa[i][key], sb[i][key]), (r, i, key)


@settings(max_examples=40, deadline=None)
@given(
    stage=st.sampled_from([0, 1, 2, 3]),
    saved=st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]), st.booleans()),
    now=st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]), st.booleans()),
)
def test_layout_route_of_every_change(stage, saved, now):
    """layout_route for (world size, P, sharded) saved -> now at one ZeRO stage (fp32): ZeRO 1-3
    load through the universal checkpoint exactly when the world size or the E/F sharding
    changes; ZeRO-0 re-shards exactly when the sharding changes; otherwise natively."""
    import tempfile

    from linformer_ds.checkpoint.reshard import RESHARD_DIRECT, VIA_UNIVERSAL, layout_route
    from linformer_ds.config import from_dict

    (w0, p0, s0), (w1, p1, s1) = saved, now
    meta = {"world_size": w0, "zero_stage": stage, "precision": "fp32"}
    meta.update(sequence_parallel_size=p0, shard_sequence_parameters=p0 > 1 and s0)
    cfg = from_dict(
        {
            "deepspeed": {"zero": {"stage": stage}, "precision": "fp32"},
            "parallel": {"sequence_parallel_size": p1, "shard_sequence_parameters": s1},
        }
    )
    with tempfile.TemporaryDirectory() as d:
        os.makedirs(os.path.join(d, "step_00000002"))
        for r in range(w0 if stage else 0):  # ZeRO 1-3: one optimizer shard per saved rank
            name = f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
            open(os.path.join(d, "step_00000002", name), "w").close()
        route = layout_route(d, "step_00000002", meta, cfg, w1)
    resharded = (p0 if p0 > 1 and s0 else 1) != (p1 if p1 > 1 and s1 else 1)
    if stage == 0:
        assert route == (RESHARD_DIRECT if resharded else None)
    else:
        assert route == (VIA_UNIVERSAL if resharded or w0 != w1 else None)
