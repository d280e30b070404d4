"""Document isolation under sequence parallelism (issue 29): P = 2 with documents crossing the
slice boundary equals one rank (loss, every gradient) for linear layers in every sharing mode,
dense (Ulysses) layers and a mixed schedule under activation checkpointing, with and without
the local mixer (model.local_mixer); through DeepSpeed ZeRO 0-3 (with the mixer) the losses before and after one SGD step equal one rank's. Conv layers and sharded
E/F/positions are refused with isolation under P > 1 (one line). Ranks run this file as a
script, one process per rank, on gloo."""

import copy
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from linformer_ds.dist_env import free_port
from linformer_ds.engine import import_muon_lazily
from linformer_ds.model import ModelConfig
from linformer_ds.parallel.checks import isolation_errors
from linformer_ds.parallel.sharding import shard_batch
from tests.pretrain_utils import child_env, init_gloo_rank

REPO = Path(__file__).resolve().parents[1]
VOCAB, N, N_MAX = 50, 24, 32
BASE = dict(
    vocab_size=VOCAB, max_seq_len=N_MAX, hidden_size=16, num_layers=2, num_heads=2,
    intermediate_size=32, dropout=0.0, attention_dropout=0.0, k=8,
)  # fmt: skip
# row documents (lengths), then padding: each row has a document across position N / 2 = 12
ROWS = [([5, 10, 9], 0), ([3, 14, 3], 4), ([24], 0)]
TOL = 1e-5
SCHEDULES = {
    "linear": dict(projection="linear"),
    "dense": dict(projection="dense"),
    "mixed": dict(num_layers=3, layer_projections=["linear", "dense", "linear"]),
    # the local mixer reads 2 (1) rows across the slice boundary from the other rank
    "linear+mixer": dict(projection="linear", local_mixer="layers", local_mixer_kernel=5),
    "mixed+mixer": dict(
        num_layers=3,
        layer_projections=["linear", "dense", "linear"],
        local_mixer="embed",
        local_mixer_kernel=3,
    ),
    # windows of W/2 = 4 keys each side reach into the other rank's slice (a halo), within
    # each document; rotary positions are the document positions
    "linear+window": dict(projection="linear", local_window=8, positions="rope"),
    "modern": dict(
        num_layers=3,
        layer_projections=["local", "local", "dense"],
        local_window=8,
        positions="rope",
    ),
    "local+linear": dict(layer_projections=["local", "linear"], local_window=10),
}


def make_batch(seed: int = 0) -> dict:
    """The packed rows of ROWS with MLM labels and position_ids (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (len(ROWS), N), generator=g)
    mask = torch.ones(len(ROWS), N, dtype=torch.long)
    pos = torch.zeros(len(ROWS), N, dtype=torch.long)
    for r, (lengths, pad) in enumerate(ROWS):
        pos[r, : N - pad] = torch.cat([torch.arange(n) for n in lengths])
        mask[r, N - pad :] = 0
    ids[mask == 0] = 0
    labelled = (torch.rand(len(ROWS), N, generator=g) < 0.4) & (mask == 1)
    labelled[:, 0] = True
    labels = torch.where(labelled, ids, torch.full_like(ids, -100))
    ids = torch.where(labelled, torch.full_like(ids, 4), ids)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "position_ids": pos}


def loss_of(model, batch: dict, count: torch.Tensor) -> torch.Tensor:
    """Sum of the labelled cross-entropies of ``batch`` (a rank's slice or whole rows) / count."""
    hidden = model.encoder(
        batch["input_ids"], batch["attention_mask"], position_ids=batch["position_ids"]
    )
    sel = batch["labels"] != -100
    logits = model.lm_head(hidden[sel]).float()
    return F.cross_entropy(logits, batch["labels"][sel], reduction="sum") / count


def rel_err(a: torch.Tensor, ref: torch.Tensor, floor: float) -> float:
    return (a - ref).abs().max().item() / max(ref.abs().max().item(), floor)


def _equivalence(rank: int, world: int) -> dict:
    import torch.distributed as dist
    import torch.utils.checkpoint

    from linformer_ds.model import LinformerForMaskedLM
    from linformer_ds.parallel import groups as grp
    from linformer_ds.parallel.parallelize import apply_sequence_parallel

    groups = grp.build_groups(world)
    batch = make_batch()
    count = (batch["labels"] != -100).sum().float()
    local, _ = shard_batch(batch, groups.sp_rank, groups.sp_size)
    results = {}
    sharings = ("none", "headwise", "kv", "layerwise")
    cases = [(s, sh, None, True) for s in ("linear",) for sh in sharings]
    cases += [("linear", sh, None, False) for sh in ("none", "layerwise")]  # chunked path
    cases += [("dense", "none", None, True), ("mixed", "kv", "layer", True)]
    cases += [("mixed", "layerwise", "sublayer", True)]
    cases += [("linear+mixer", "layerwise", None, True), ("linear+mixer", "none", None, False)]
    cases += [("mixed+mixer", "kv", "sublayer", True), ("linear+mixer", "headwise", "layer", True)]
    cases += [
        ("linear+window", "layerwise", None, True),
        ("linear+window", "kv", "sublayer", False),
    ]
    cases += [("modern", "none", "layer", True), ("local+linear", "headwise", None, True)]
    for sched, sharing, checkpointing, per_span in cases:
        torch.manual_seed(0)
        ref = LinformerForMaskedLM(ModelConfig(**{**BASE, **SCHEDULES[sched], "sharing": sharing}))
        model = copy.deepcopy(ref)
        apply_sequence_parallel(model, groups.sp_group)
        model.encoder.document_per_span = per_span  # False: batched over DocumentChunks
        if checkpointing:
            fn = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
            model.encoder.set_activation_checkpointing(fn, granularity=checkpointing)
        loss_ref = loss_of(ref, batch, count)
        loss_ref.backward()
        loss = loss_of(model, local, count)
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total, group=groups.sp_group)
        errs = {"loss": abs(total.item() - loss_ref.item()) / abs(loss_ref.item())}
        floor = 1e-7 * max(p.grad.abs().max().item() for p in ref.parameters())
        for (name, p_ref), (_, p) in zip(ref.named_parameters(), model.named_parameters()):
            g = p.grad.clone()
            dist.all_reduce(g, group=groups.sp_group)
            errs[name] = rel_err(g, p_ref.grad, floor)
        name = f"{sched}/{sharing}" + (f"/ac-{checkpointing}" if checkpointing else "")
        results[name + ("" if per_span else "/chunks")] = errs
    return results


def _zero(rank: int, world: int, deepspeed) -> dict:
    """ZeRO 0-3 with P = 2: the loss before and after one SGD step (lr 0.5), and one rank's."""
    from linformer_ds.loss import LossScaling
    from linformer_ds.model import LinformerForMaskedLM
    from linformer_ds.parallel import groups as grp
    from linformer_ds.parallel import parallelize as par

    groups = grp.build_groups(world)
    batch = make_batch(seed=1)
    count = (batch["labels"] != -100).sum().float()
    local, _ = shard_batch(batch, groups.sp_rank, groups.sp_size)
    # the mixer's weights are ZeRO-partitioned too; the window's halo runs under every stage
    mixer = dict(local_mixer="layers", local_mixer_kernel=3, local_window=8, positions="rope")
    cfg_model = ModelConfig(**{**BASE, **SCHEDULES["mixed"], "sharing": "headwise", **mixer})
    torch.manual_seed(0)
    ref = LinformerForMaskedLM(cfg_model)
    loss = loss_of(ref, batch, count)
    loss.backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.5 * p.grad
    results = {"reference": [loss.item(), loss_of(ref, batch, count).item()]}
    for stage in range(4):
        torch.manual_seed(0)
        model = LinformerForMaskedLM(cfg_model)
        ds = {
            "train_micro_batch_size_per_gpu": len(ROWS), "gradient_accumulation_steps": 1,
            "train_batch_size": len(ROWS), "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
            "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False, "gradient_clipping": 0.0,
            "steps_per_print": 10**9,
        }  # fmt: skip
        par.apply_sequence_parallel(model, groups.sp_group)
        par.partition_for_zero3(model, groups, ds)
        import_muon_lazily()  # as the trainer: no inductor import for DeepSpeed's Muon
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=ds,
            mpu=grp.SequenceParallelMPU(groups),
        )  # fmt: skip
        rule = LossScaling(world, sp_size=world, zero_stage=stage)
        first = loss_of(engine.module, local, count)
        engine.backward(first * rule.backward_scale)
        engine.step()
        with torch.no_grad():
            second = loss_of(engine.module, local, count)
        pair = torch.stack([first.detach(), second]).float()
        torch.distributed.all_reduce(pair, group=groups.sp_group)
        results[f"z{stage}"] = pair.tolist()
        engine.destroy()
    return results


def _main(mode: str, rank: int, world: int, port: int, out: str) -> None:
    deepspeed = init_gloo_rank(rank, world, port)
    torch.set_num_threads(1)
    # "both": the two tests' work in one launch (the ranks' start-up paid once), each result
    # under its mode's name
    modes = ["equivalence", "zero"] if mode == "both" else [mode]
    res = {m: _equivalence(rank, world) if m == "equivalence" else _zero(rank, world, deepspeed)
           for m in modes}  # fmt: skip
    res = res if mode == "both" else res[mode]
    Path(out, f"rank{rank}.json").write_text(json.dumps(res))
    torch.distributed.barrier()
    os._exit(0)  # skip gloo teardown at interpreter exit


def _run_ranks(mode: str, world: int, out: Path, timeout: int = 600) -> list:
    out.mkdir(parents=True, exist_ok=True)
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, mode, str(r), str(world), str(port), str(out)],
            env=env,
            cwd=out,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for r in range(world)
    ]
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{logs[r][-4000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


# =========================================================================================== tests
@pytest.fixture(scope="module")
def p2_ranks(tmp_path_factory) -> list:
    """Both P = 2 modes (equivalence, then zero) in one 2-rank launch: each rank's results."""
    return _run_ranks("both", 2, tmp_path_factory.mktemp("p2_ranks"))


def test_p2_documents_across_the_boundary_equal_one_rank(p2_ranks):
    results = [r["equivalence"] for r in p2_ranks]
    worst = {}
    for res in results:
        for case, errs in res.items():
            for name, err in errs.items():
                assert err <= TOL, f"{case}: {name} differs by {err:.3g} (relative)"
            worst[case] = max(worst.get(case, 0.0), max(errs.values()))
    print("P=2 isolation worst relative deviations:", {k: f"{v:.2e}" for k, v in worst.items()})


def test_zero_stages_give_one_ranks_loss(p2_ranks):
    res = dict(p2_ranks[0]["zero"])
    ref = res.pop("reference")
    for stage, pair in res.items():
        for got, want in zip(pair, ref):
            assert abs(got - want) <= TOL * abs(want), (stage, pair, ref)
    print("ZeRO 0-3 losses (before, after one step):", res, "one rank:", ref)


def test_trainer_p2_isolated_equals_one_rank(tmp_path):
    """The real trainer, isolation on, linear + dense layers: P = 2 under ZeRO-3 (E/F and
    positions whole) logs what one rank does (loss per step, evaluation loss)."""
    from tests.pretrain_utils import read_metrics, run_pretrain
    from tests.test_isolation import short_documents_corpus

    data = short_documents_corpus(tmp_path)
    over = [
        "deepspeed.precision=fp32", "model.attention_dropout=0.0", "model.num_layers=2",
        "model.layer_projections=[linear,dense]", "model.sharing=kv", "train.max_steps=3",
        "train.eval_interval=3", "train.eval_batches=1", "data.document_isolation=true",
    ]  # fmt: skip
    runs = {}
    for name, extra, nproc in [
        ("p1", ["deepspeed.zero.stage=2"], 1),
        ("p2", ["deepspeed.zero.stage=3", "parallel.sequence_parallel_size=2",
                "parallel.shard_sequence_parameters=false"], 2),
    ]:  # fmt: skip
        launcher = "torchrun" if nproc > 1 else "python"  # one rank: one process
        proc = run_pretrain(data, tmp_path / name, over + extra, nproc=nproc, launcher=launcher)
        assert "isolation=on" in proc.stdout, proc.stdout[-2000:]
        runs[name] = (read_metrics(tmp_path / name), read_metrics(tmp_path / name, "eval"))
    (t1, e1), (t2, e2) = runs["p1"], runs["p2"]
    for step in t1:
        assert abs(t2[step]["loss"] - t1[step]["loss"]) <= TOL * abs(t1[step]["loss"]), step
    last = max(e1)
    assert abs(e2[last]["loss"] - e1[last]["loss"]) <= TOL * abs(e1[last]["loss"])


def test_refused_combinations_one_line():
    conv = ModelConfig(**{**BASE, "projection": "hybrid"})
    errors = isolation_errors(2, conv, shard=True)
    assert len(errors) == 2 and all("\n" not in e for e in errors)
    assert errors[0].startswith("data.document_isolation: conv layers")
    assert "shard_sequence_parameters=false" in errors[1]
    assert isolation_errors(1, conv, shard=True) == []
    assert isolation_errors(2, ModelConfig(**BASE), shard=False) == []


if __name__ == "__main__":
    _main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
