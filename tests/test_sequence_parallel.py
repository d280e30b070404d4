"""Sequence parallelism: P = 2 equals P = 1 (losses, every gradient), through DeepSpeed ZeRO 0-3
(DP 2 x SP 2 on 4 ranks equals DP 2 on 2 ranks after an optimizer step), and the bytes each layer
hands to collectives. Multi-rank parts run this file as a script, one process per rank, on gloo.
"""

import functools
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.sp_collectives import collective_bytes_per_layer, count_collectives
from linformer_ds.dist_env import free_port
from linformer_ds.engine import import_muon_lazily
from linformer_ds.loss import LossScaling
from linformer_ds.model import ModelConfig
from linformer_ds.parallel.checks import SequenceParallelConfigError, check_config, config_errors
from linformer_ds.parallel.groups import group_layout
from linformer_ds.parallel.sharding import shard_batch
from tests.pretrain_utils import child_env, init_gloo_rank

REPO = Path(__file__).resolve().parents[1]
VOCAB, N, N_MAX, B = 50, 24, 32, 3
BASE = dict(
    vocab_size=VOCAB,
    max_seq_len=N_MAX,
    hidden_size=16,
    num_layers=2,
    num_heads=2,
    intermediate_size=32,
    dropout=0.0,
    attention_dropout=0.0,
    k=8,  # linear: k = 8; conv: stride = 32 / 8 = 4, slices of 12 = 3 blocks
)
SCHEDULES = {
    "linear": dict(projection="linear"),
    "conv": dict(projection="conv"),
    "dense": dict(projection="dense"),
    "hybrid": dict(projection="hybrid"),
    "mixed": dict(num_layers=3, layer_projections=["linear", "dense", "conv"]),
}
SHARING = ("none", "headwise", "kv", "layerwise")
TOL = 1e-5
MIXER = dict(local_mixer="layers", local_mixer_kernel=5)  # reaches 2 rows into the next slice
MIXER_CASES = [
    ("linear+mixer", "layerwise", False, False), ("conv+mixer", "headwise", False, True),
    ("mixed+mixer", "kv", "sublayer", False), ("dense+mixer", "none", False, False),
]  # fmt: skip
# local + global attention: the window reads W/2 = 4 rows of the neighbouring slice (a halo);
# rotary positions at the slice's global offset; "modern": ModernBERT-like local/local/dense
WINDOW = dict(local_window=8, positions="rope")
CASE_SCHEDULES = {
    **SCHEDULES, "modern": dict(num_layers=3, layer_projections=["local", "local", "dense"]),
}  # fmt: skip
MIXER_CASES += [
    ("linear+window", "layerwise", False, False), ("conv+window", "headwise", False, False),
    ("modern+window", "kv", "sublayer", False), ("mixed+window", "none", "layer", True),
]  # fmt: skip


# ============================================================================ data, shared by all
def make_batch(rows: int, seed: int = 0) -> dict:
    """``rows`` right-padded rows of N tokens with MLM labels (same on every rank).

    Row 1 is padded from position 17 (inside the second slice), row 2 from 7 (the second slice
    is all padding); every row has labelled positions.
    """
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (rows, N), generator=g)
    lengths = [N, 17, 7] * (rows // 3 + 1)
    mask = torch.zeros(rows, N, dtype=torch.long)
    for i in range(rows):
        mask[i, : lengths[i]] = 1
    ids[mask == 0] = 0
    labelled = (torch.rand(rows, N, generator=g) < 0.4) & (mask == 1)
    labelled[:, 0] = True
    labels = torch.where(labelled, ids, torch.full_like(ids, -100))
    ids = torch.where(labelled, torch.full_like(ids, 4), ids)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def reference_loss(model, batch: dict) -> torch.Tensor:
    """P = 1: the mean cross-entropy over the batch's labelled positions."""
    hidden = model.encoder(batch["input_ids"], batch["attention_mask"])
    sel = batch["labels"] != -100
    return F.cross_entropy(model.lm_head(hidden[sel]).float(), batch["labels"][sel])


def sp_loss(model, batch: dict, group) -> torch.Tensor:
    """P > 1: this rank's share (sum over its labelled positions / the replica's count)."""
    from linformer_ds.parallel.collectives import global_label_count

    hidden = model.encoder(batch["input_ids"], batch["attention_mask"])
    sel = batch["labels"] != -100
    targets = batch["labels"][sel]
    logits = model.lm_head(hidden[sel]).float()
    return F.cross_entropy(logits, targets, reduction="sum") / global_label_count(targets, group)


def rel_err(a: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    """max |a - ref| / max(max |ref|, floor) (the plain difference when both are zero).

    ``floor`` keeps a gradient that is zero in exact arithmetic but fp32 rounding noise in
    practice (the conv key bias: softmax ignores a shift shared by all keys, ~1e-13 here)
    from turning noise into a large relative error.
    """
    scale = max(ref.abs().max().item(), floor)
    diff = (a - ref).abs().max().item()
    return diff / scale if scale > 0 else diff


# ==================================================================================== rank workers
def _equivalence_worker(rank: int, world: int, out: Path) -> dict:
    """P = 2 vs P = 1 for every schedule and sharing mode, and collective bytes per layer."""
    import copy

    import torch.distributed as dist
    import torch.utils.checkpoint

    from linformer_ds.model import LinformerForMaskedLM
    from linformer_ds.parallel import groups as grp
    from linformer_ds.parallel import sharding
    from linformer_ds.parallel.parallelize import apply_sequence_parallel

    groups = grp.build_groups(world)
    results: dict = {"cases": {}, "bytes": {}}
    batch = make_batch(B)
    local, offset = shard_batch(batch, groups.sp_rank, groups.sp_size)
    # every schedule x sharing mode, plus the mixed schedule under activation checkpointing
    # (torch's non-reentrant: the recomputed forward issues its collectives again in backward)
    # Sharded (N = max_seq_len): each rank holds its columns of E/F and rows of the position
    # table; their gradient on the rank must be the reference's part, with no SP reduction.
    cases = [
        (sched, sharing, False, shard)
        for shard in (False, True)
        for sched in SCHEDULES
        for sharing in SHARING
    ]
    # per layer unsharded, per sub-layer (attention, feed-forward apart) sharded
    cases += [("mixed", "headwise", "layer", False), ("mixed", "headwise", "sublayer", True)]
    cases += MIXER_CASES
    for sched, sharing, checkpointing, shard in cases:
        torch.manual_seed(0)
        extra = {"max_seq_len": N} if shard else {}
        if sched.endswith("+mixer"):  # the local mixer's halo rows cross the slice boundary
            sched, extra = sched[: -len("+mixer")], {**extra, **MIXER}
        if sched.endswith("+window"):  # so do the window's keys
            sched, extra = sched[: -len("+window")], {**extra, **WINDOW}
        cfg = ModelConfig(**{**BASE, **CASE_SCHEDULES[sched], "sharing": sharing, **extra})
        ref = LinformerForMaskedLM(cfg)
        model = copy.deepcopy(ref)
        sharded = {}
        if shard:
            names = sharding.shard_sequence_parameters(model, groups.sp_rank, groups.sp_size)
            sharded = {n: p.sequence_shard[0] for n, p in model.named_parameters() if n in names}
            full = sharding.full_state_dict(model, groups.sp_group)
            want = ref.state_dict()
            assert full.keys() == want.keys() and all(torch.equal(full[k], want[k]) for k in want)
            for n in sharded:  # each rank holds 1/P of them
                held = dict(model.named_parameters())[n].numel()
                assert held * groups.sp_size == dict(ref.named_parameters())[n].numel(), n
        apply_sequence_parallel(model, groups.sp_group)
        if checkpointing:
            fn = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
            model.encoder.set_activation_checkpointing(fn, granularity=checkpointing)
        loss_ref = reference_loss(ref, batch)
        loss_ref.backward()
        loss = sp_loss(model, local, groups.sp_group)
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total, group=groups.sp_group)
        errs = {"loss": abs(total.item() - loss_ref.item()) / abs(loss_ref.item())}
        # 1e-6 of the largest gradient: a gradient that is zero in exact arithmetic (the conv key
        # bias) is fp32 noise of ~1e-12 of it, which depends on the CPU's kernels (1.8e-5 of a
        # 1e-7 floor on an AVX-512 BF16 EPYC, under 1e-5 on an AMX Xeon)
        floor = 1e-6 * max(p.grad.abs().max().item() for p in ref.parameters())
        for (name, p_ref), (_, p) in zip(ref.named_parameters(), model.named_parameters()):
            if name in sharded:  # complete on the rank: compared without any reduction
                want = sharding.shard_tensor(
                    p_ref.grad, sharded[name], groups.sp_rank, groups.sp_size
                )
                errs[f"{name} (sharded)"] = rel_err(p.grad, want, floor)
                continue
            g = p.grad.clone()
            dist.all_reduce(g, group=groups.sp_group)
            errs[name] = rel_err(g, p_ref.grad, floor)
        tag = (f"/checkpointed-{checkpointing}" if checkpointing else "") + (
            "/sharded" if shard else ""
        )
        suffix = ("+mixer" if "local_mixer" in extra else "") + (
            "+window" if "local_window" in extra else ""
        )
        results["cases"][f"{sched}{suffix}/{sharing}{tag}"] = errs

    # Bytes handed to collectives by one layer of each kind, forward and backward.
    for kind in ("linear", "conv", "dense"):
        torch.manual_seed(0)
        cfg = ModelConfig(**{**BASE, "projection": kind, "sharing": "headwise"})
        model = LinformerForMaskedLM(cfg)
        apply_sequence_parallel(model, groups.sp_group)
        with count_collectives() as fwd:
            hidden = model.encoder(local["input_ids"], local["attention_mask"])
        with count_collectives() as bwd:
            hidden.square().sum().backward()
        results["bytes"][kind] = {
            "forward": fwd.total,
            "backward": bwd.total,
            "calls_forward": fwd.calls,
            "calls_backward": bwd.calls,
            "layers": cfg.num_layers,
        }
    results["offset"] = offset
    return results


def _ds_config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "train_batch_size": 4,  # counts replicas: 2 rows x 2 data-parallel replicas
        "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
    }


DS_MODEL = dict(num_layers=3, layer_projections=["linear", "conv", "dense"], sharing="headwise")
SHARDED_STAGES = (0, 1, 2, 3)  # sharded E/F and positions: DP-only reduction through the mpu
# (name, ZeRO stage, apply partition_for_zero3, apply LossScaling.backward_scale)
DS_CASES = [
    ("z0", 0, True, True),
    ("z1", 1, True, True),
    ("z2", 2, True, True),
    ("z3", 3, True, True),
    ("z3_dp_partition", 3, False, True),  # DeepSpeed's own ZeRO-3 partitioning (DP only)
    ("z3_no_scale", 3, True, False),  # partitioned over DP x P, loss not scaled by P
]


def _deepspeed_worker(rank: int, world: int, out: Path, deepspeed, sp_size: int) -> dict:
    """One SGD step per case: the reduced gradients and the parameters after the step."""
    from deepspeed.utils import safe_get_full_grad

    from linformer_ds.model import LinformerForMaskedLM
    from linformer_ds.parallel import groups as grp
    from linformer_ds.parallel import parallelize as par
    from linformer_ds.parallel import sharding

    groups = grp.build_groups(sp_size) if sp_size > 1 else None
    replica = groups.dp_rank if groups else rank
    batch = make_batch(4, seed=1)  # the global batch: 2 rows per replica
    rows = {k: v[2 * replica : 2 * replica + 2] for k, v in batch.items()}
    results = {}
    cases = DS_CASES if sp_size > 1 else [c for c in DS_CASES if "_" not in c[0]]
    cases = cases + [(f"z{z}_sharded", z, False, False) for z in SHARDED_STAGES]
    for name, stage, partition, scale in cases:
        torch.manual_seed(0)
        shard = name.endswith("_sharded")
        extra = {"max_seq_len": N} if shard else {}  # sharding needs N = max_seq_len
        model = LinformerForMaskedLM(ModelConfig(**{**BASE, **DS_MODEL, **extra}))
        cfg = _ds_config(stage)
        kwargs = {}
        if groups is not None and shard:
            par.shard_for_deepspeed(model, groups)
            par.apply_sequence_parallel(model, groups.sp_group)
            kwargs["mpu"] = grp.ShardedSequenceParallelMPU(groups)
        elif groups is not None:
            par.apply_sequence_parallel(model, groups.sp_group)
            if partition:
                par.partition_for_zero3(model, groups, cfg)
            kwargs["mpu"] = grp.SequenceParallelMPU(groups)
        import_muon_lazily()  # as the trainer: no inductor import for DeepSpeed's Muon
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=cfg, **kwargs
        )
        if groups is not None:
            local, _ = shard_batch(rows, groups.sp_rank, groups.sp_size)
            loss = sp_loss(engine.module, local, groups.sp_group)
            rule = LossScaling(world, sp_size=sp_size, zero_stage=stage)
            factor = rule.backward_scale if scale else 1.0
        else:
            loss, factor = reference_loss(engine.module, rows), 1.0
        engine.backward(loss * factor)
        grads = {  # the reduced gradients the optimizer will apply
            k: safe_get_full_grad(v).detach().clone() for k, v in engine.module.named_parameters()
        }
        engine.step()
        params = list(engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=stage == 3):
            after = {k: v.detach().clone() for k, v in engine.module.named_parameters()}
        if groups is not None and shard:  # whole again: all-gather the shards over the group
            for k, v in engine.module.named_parameters():
                if hasattr(v, sharding.SHARD_ATTR):
                    dim = getattr(v, sharding.SHARD_ATTR)[0]
                    for d in (grads, after):
                        parts = [torch.empty_like(d[k]) for _ in range(groups.sp_size)]
                        torch.distributed.all_gather(parts, d[k].contiguous(), groups.sp_group)
                        d[k] = torch.cat(parts, dim=dim)
        results[name] = {
            "grad": {k: v.tolist() for k, v in grads.items()},
            "param": {k: v.tolist() for k, v in after.items()},
        }
        engine.destroy()
    return results


# (precision, fp32 gradient accumulation, ZeRO stage): DeepSpeed's reduce paths differ by each
EXACT_CASES = [("fp32", False, z) for z in range(4)] + [("bf16", False, z) for z in range(4)]
EXACT_CASES += [("bf16", True, z) for z in (1, 2, 3)]  # ZeRO-0 bf16 refuses fp32 accumulation


def _exact_scale_worker(rank: int, world: int, deepspeed) -> dict:
    """SP = 2, DP = 1: a bias-free Linear(4, 1) with weight 1, each rank feeds its slice's token
    ``x_r`` and its share of the loss; one SGD step with lr 1 must leave ``1 - (x_0 + x_1)``,
    exactly (small integers are exact in bf16), whatever the precision and stage."""
    from linformer_ds.parallel import groups as grp
    from linformer_ds.parallel import parallelize as par

    groups = grp.build_groups(world)
    x = torch.arange(8, dtype=torch.float32).view(2, 4)[rank : rank + 1]
    results = {}
    for (precision, fp32_accum, stage), shard in itertools.product(EXACT_CASES, (False, True)):
        if shard and precision == "bf16" and (stage == 0 or (stage == 1 and fp32_accum)):
            # DeepSpeed's BF16_Optimizer (bf16 ZeRO-0, and ZeRO-1 with fp32 accumulation) cannot
            # take a model-parallel rank without a model-parallel parameter (torch.stack of an
            # empty norm list); our model has one on every rank (its position rows), this
            # one-weight probe does not
            continue
        model = torch.nn.Linear(4, 1, bias=False)
        torch.nn.init.ones_(model.weight)
        cfg = {**_ds_config(stage), "train_micro_batch_size_per_gpu": 1, "train_batch_size": 1}
        if precision == "bf16":
            cfg["bf16"] = {"enabled": True}
        if fp32_accum:
            cfg["data_types"] = {"grad_accum_dtype": "fp32"}
        if shard:  # the sharded path: the replicated weight's gradient summed over SP by a hook
            par.shard_for_deepspeed(model, groups)
            mpu, scale = grp.ShardedSequenceParallelMPU(groups), 1.0
        else:
            par.partition_for_zero3(model, groups, cfg)
            rule = LossScaling(world, sp_size=world, zero_stage=stage)
            mpu, scale = grp.SequenceParallelMPU(groups), rule.backward_scale
        import_muon_lazily()  # as the trainer: no inductor import for DeepSpeed's Muon
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=cfg, mpu=mpu
        )
        loss = engine(x.to(next(model.parameters()).dtype)).float().sum()
        engine.backward(loss * scale)
        engine.step()
        with deepspeed.zero.GatheredParameters(model.weight, enabled=stage == 3):
            key = f"{precision}/{fp32_accum}/z{stage}" + ("/sharded" if shard else "")
            results[key] = model.weight.float().tolist()
        engine.destroy()
    return results


def _main(mode: str, rank: int, world: int, port: int, out: str) -> None:
    deepspeed = init_gloo_rank(rank, world, port)
    torch.set_num_threads(1)
    res = {}
    for m in mode.split("+"):  # "a+b": several tests' work in one launch, by mode name
        if m == "equivalence":
            res[m] = _equivalence_worker(rank, world, Path(out))
        elif m == "exact":
            res[m] = _exact_scale_worker(rank, world, deepspeed)
        elif m == "plan":  # the planner's two-rank measurements (tests/plan_worker.py)
            from tests.plan_worker import plan_worker

            res[m] = plan_worker(rank, world, deepspeed)
        else:
            res[m] = _deepspeed_worker(rank, world, Path(out), deepspeed, sp_size=int(m[-1]))
    res = res if "+" in mode else res[mode]
    Path(out, f"rank{rank}.json").write_text(json.dumps(res))
    import torch.distributed as dist

    dist.barrier()
    os._exit(0)  # skip gloo teardown at interpreter exit


# ========================================================================================= helpers
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
        )
        for r in range(world)
    ]
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{logs[r][-4000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


# =========================================================================================== tests
def _cfg(**kw) -> ModelConfig:
    return ModelConfig(**{**BASE, **kw})


def test_config_errors_one_line_each():
    ok = dict(world_size=4, seq_len=N, model=_cfg())
    assert config_errors(1, **ok) == [] and config_errors(2, **ok) == []
    cases = {
        "does not divide the world size 4": (3, dict(ok, seq_len=24)),
        "does not divide the sequence length N=24": (5, dict(ok, world_size=5)),
        "max_seq_len >= N": (2, dict(ok, seq_len=48)),
        "not a multiple of the conv stride 4": (4, dict(ok, model=_cfg(projection="conv"))),
        "num_heads divisible by P": (4, dict(ok, model=_cfg(projection="dense", num_heads=2))),
        "reduce_scatter=true": (2, dict(ok, zero_stage=3, zero_reduce_scatter=False)),
        "must be >= 1": (0, ok),
    }
    for expected, (p, kw) in cases.items():
        errors = config_errors(p, **kw)
        assert len(errors) == 1 and expected in errors[0], (expected, errors)
        assert errors[0].startswith("parallel.sequence_parallel_size: ")
        assert "\n" not in errors[0]
        with pytest.raises(SequenceParallelConfigError, match="sequence_parallel_size"):
            check_config(p, **kw)
    # sharded E/F and positions: N must be max_seq_len (each rank holds its slice's columns);
    # ZeRO-3 needs no reduce-scatter setting then (every reduction is over DP only)
    shard = config_errors(2, **ok, shard=True)
    assert len(shard) == 1 and "max_seq_len == N" in shard[0]
    assert shard[0].startswith("parallel.shard_sequence_parameters: ") and "\n" not in shard[0]
    exact = dict(ok, seq_len=N_MAX)
    assert config_errors(2, **exact, shard=True, zero_stage=3, zero_reduce_scatter=False) == []
    z0_bf16 = config_errors(2, **exact, shard=True, zero_stage=0, precision="bf16")
    assert len(z0_bf16) == 1 and "BF16_Optimizer" in z0_bf16[0]
    assert config_errors(2, **exact, shard=False, zero_stage=0, precision="bf16") == []
    # conv aligned at P = 2 (slices of 12, stride 4); ZeRO-3 with reduce-scatter on is fine
    assert config_errors(2, **dict(ok, model=_cfg(projection="conv")), zero_stage=3) == []


def test_group_layout_and_shard_batch():
    sp_groups, dp_groups = group_layout(8, 4)
    assert sp_groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dp_groups == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(SequenceParallelConfigError, match="does not divide the world size 6"):
        group_layout(6, 4)
    batch = make_batch(3)
    parts = [shard_batch(batch, r, 3) for r in range(3)]
    assert [off for _, off in parts] == [0, 8, 16]
    for key in batch:
        assert torch.equal(torch.cat([p[key] for p, _ in parts], dim=1), batch[key])
        assert parts[1][0][key].shape == (3, 8)
    with pytest.raises(SequenceParallelConfigError, match="sequence length 24"):
        shard_batch(batch, 0, 5)


def test_bytes_formula_scaling():
    """Linear-SP exchanges k x D per layer whatever N; Ulysses grows with N / P."""
    kw = dict(sp_size=4, batch_size=1, hidden_size=512, k=256)
    lin = [collective_bytes_per_layer("linear", seq_len=n, **kw) for n in (2**14, 2**20)]
    dense = [collective_bytes_per_layer("dense", seq_len=n, **kw) for n in (2**14, 2**20)]
    assert lin[0] == lin[1] == {"forward": 256 * 1024 * 4, "backward": 256 * 1024 * 4}
    assert dense[1]["backward"] == 4 * (2**20 // 4) * 512 * 4
    assert dense[1]["backward"] // lin[1]["backward"] == 2048  # 4 N/P / (2 k), N = 1 M
    assert collective_bytes_per_layer("dense", seq_len=64, **{**kw, "sp_size": 1}) == {
        "forward": 0,
        "backward": 0,
    }


def test_loss_scaling_rule():
    """DeepSpeed divides by DP x GAS (ZeRO 0-2, and sharded ZeRO-3), by DP x P x GAS under
    ZeRO-3 unsharded with P > 1: the factor on the loss undoes exactly that."""
    assert LossScaling(8, sp_size=4, zero_stage=3).backward_scale == 4.0
    assert LossScaling(8, sp_size=4, zero_stage=2).backward_scale == 1.0
    assert LossScaling(8, sp_size=4, zero_stage=3, sharded=True).backward_scale == 1.0
    assert LossScaling(1, zero_stage=3).backward_scale == 1.0
    assert LossScaling(8, sp_size=4, zero_stage=3, accumulation_steps=3).grad_factor == 24.0
    assert LossScaling(8, sp_size=2, zero_stage=1, accumulation_steps=3).grad_factor == 12.0
    assert LossScaling(2).grad_factor == 2.0 and LossScaling(1).grad_factor == 1.0
    loss = torch.tensor(2.5)
    assert LossScaling(1).scale(loss) is loss and LossScaling(2).scale(loss).item() == 5.0
    labels = torch.tensor([[1, -100, 3], [-100, -100, -100]])
    assert LossScaling(1).denominator([labels], torch.device("cpu")) is None  # the model counts
    count = LossScaling(1, accumulation_steps=2).denominator([labels, labels[:1]], "cpu")
    assert count.dtype == torch.float32 and count.item() == 4.0
    assert LossScaling(1, accumulation_steps=2).denominator([labels[1:]] * 2, "cpu").item() == 1


# The 2-rank work of the three tests below in one launch: the DP-only DeepSpeed reference
# first (a fresh process, as alone), the exact-scale cases last (their sharded mpu stays set)
TWO_RANK_MODES = "ds_sp1+equivalence+plan+exact"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list:
    """Each rank's results of TWO_RANK_MODES (one 2-rank launch), by mode."""
    return _run_ranks(TWO_RANK_MODES, 2, tmp_path_factory.mktemp("two_ranks"))


@pytest.mark.slow
def test_plan_holds_on_two_ranks(two_ranks):
    """The planner (linformer_ds.plan) against the two-rank launch (tests/plan_worker.py): with
    P = 2 each rank's measured peak of live tensor bytes within 10 % of the plan and the bytes
    counted on the sequence-parallel collectives equal to it; with DP = 2 the parameters and
    optimizer states (Adam's moments, fp32 master partitions) a DeepSpeed engine holds per rank
    equal to the plan's ZeRO accounting (ZeRO 0-3 in bf16, 0 and 3 in fp32)."""
    from linformer_ds.config import load_config
    from linformer_ds.plan import (
        Step,
        activation_peak,
        model_states,
        sp_bytes_per_layer,
        sp_mask_bytes,
    )
    from tests import plan_worker as pw
    from tests.pretrain_utils import TINY_CONFIG

    for rank in two_ranks:
        for (kind, dtype, ckpt), got in zip(pw.SP_CASES, rank["plan"]["sp"]):
            config, elem = pw.sp_config(**kind), 4 if dtype == "float32" else 2
            step = Step(pw.B, pw.N // 2, pw.N, elem, "cpu", labelled=got["labelled"], sp=2)
            peak = 2 * got["param_bytes"] + activation_peak(config, step, ckpt)["peak"]
            assert abs(peak / got["peak"] - 1) < 0.10, (kind, dtype, ckpt, peak, got["peak"])
            layers = [sp_bytes_per_layer(config, i, pw.N, 2, pw.B, elem) for i in range(2)]
            want = sum(b["forward"] * (2 if ckpt else 1) + b["backward"] for b in layers)
            assert want + sp_mask_bytes(config, 2, pw.B, pw.N // 2) == got["bytes"], kind
        model = load_config(TINY_CONFIG).model
        for (precision, stage), got in zip(pw.STATE_CASES, rank["plan"]["states"]):
            plan = model_states(model, precision, stage, dp=2, sp=1, shard=False,
                                fp32_grad_accum=False)  # fmt: skip
            assert (plan["parameters"], plan["optimizer"]) == (
                got["parameters"], got["optimizer"]), (precision, stage)  # fmt: skip


@pytest.mark.slow
def test_p2_equals_p1_every_schedule_and_sharing(two_ranks):
    """Two ranks, gloo, fp32: losses and the gradient of every parameter (summed over the SP
    group) equal the single-rank full-sequence reference to 1e-5, with right-padded rows.
    Sharded: every E/F (each sharing mode, per-layer and layerwise) and the position table
    hold half their columns/rows per rank, reassemble to the reference exactly, and their
    gradient on each rank equals the reference's half with no reduction over the group."""
    results = [r["equivalence"] for r in two_ranks]
    assert [r["offset"] for r in results] == [0, N // 2]
    for res in results:
        assert len(res["cases"]) == 2 * (len(SCHEDULES) * len(SHARING) + 1) + len(MIXER_CASES)
        for case, errs in res["cases"].items():  # sharded cases: positions, and E/F if linear
            n_sharded = sum(k.endswith("(sharded)") for k in errs)
            assert n_sharded == 0 if "sharded" not in case else n_sharded >= 1, (case, errs)
        lin = res["cases"]["linear/none/sharded"]
        assert sum(k.endswith("(sharded)") for k in lin) == 1 + 2 * BASE["num_layers"]
        for case, errs in res["cases"].items():
            bad = {k: v for k, v in errs.items() if not v <= TOL}
            assert not bad, (case, bad)
            assert len(errs) > 10  # the loss and every parameter were compared
        worst = max((v, case, k) for case, errs in res["cases"].items() for k, v in errs.items())
        print(f"P=2 vs P=1 worst relative difference: {worst[0]:.1e} ({worst[1]}, {worst[2]})")

    # Bytes per layer: the formula against the tensors handed to the collectives (rank 0).
    counted = results[0]["bytes"]
    batch_rows, dim = B, BASE["hidden_size"]
    for kind, stride in (("linear", None), ("conv", 4), ("dense", None)):
        expected = collective_bytes_per_layer(
            kind, seq_len=N, sp_size=2, batch_size=batch_rows, hidden_size=dim, k=8, stride=stride
        )
        layers = counted[kind]["layers"]
        assert counted[kind]["forward"] == layers * expected["forward"], (kind, counted[kind])
        assert counted[kind]["backward"] == layers * expected["backward"], (kind, counted[kind])
    # headwise: keys and values go as two all-reduces (linear) or all-gathers (conv) per layer
    assert counted["linear"]["calls_forward"]["all_reduce"] == 2 * 2
    assert counted["dense"]["calls_forward"]["all_to_all"] == 4 * 2
    assert counted["dense"]["calls_backward"]["all_to_all"] == 4 * 2
    assert counted["conv"]["calls_backward"]["reduce_scatter"] == 2 * 2


@pytest.mark.slow
def test_deepspeed_zero_stages_dp2_sp2_equal_dp2(two_ranks, tmp_path):
    """deepspeed.initialize with the SP mpu on 4 ranks (DP 2 x SP 2) vs 2 ranks DP only, same
    global batch: the parameter updates of one SGD step agree to 1e-5 under ZeRO 0, 1, 2, 3.
    Without partition_for_zero3 or LossScaling.backward_scale ZeRO-3 is wrong, as documented."""
    sp_runs = _run_ranks("ds_sp2", 4, tmp_path / "sp")
    dp_runs = [r["ds_sp1"] for r in two_ranks]
    ref = dp_runs[0]

    def worst(run: dict, case: str, ref_case: str, what: str) -> float:
        """The largest relative difference of any parameter's ``what`` (floor as in rel_err)."""
        ref_t = {n: torch.tensor(v) for n, v in ref[ref_case][what].items()}
        floor = 1e-7 * max(t.abs().max().item() for t in ref_t.values())
        errs = {n: rel_err(torch.tensor(run[case][what][n]), t, floor) for n, t in ref_t.items()}
        name = max(errs, key=errs.get)
        print(f"{case} {what}: worst {name} {errs[name]:.2e}")
        return errs[name]

    for stage in range(4):
        case = f"z{stage}"
        for run in sp_runs + dp_runs:  # every rank of both jobs
            assert worst(run, case, case, "grad") <= TOL, (stage, "grad")
            assert worst(run, case, case, "param") <= TOL, (stage, "param")
        # the comparison is of real updates: every parameter has a non-zero gradient
        assert min(torch.tensor(g).abs().max().item() for g in ref[case]["grad"].values()) > 0
    for stage in SHARDED_STAGES:  # sharded on DP 2 x SP 2 vs the same model on DP 2, unsharded
        case = f"z{stage}_sharded"
        for run in sp_runs:
            assert worst(run, case, case, "grad") <= TOL, (case, "grad")
            assert worst(run, case, case, "param") <= TOL, (case, "param")
    # The two ways ZeRO-3 goes wrong without the fix (see docs/sequence_parallel.md):
    assert worst(sp_runs[0], "z3_dp_partition", "z3", "grad") > 0.1  # partitioned over DP only
    assert worst(sp_runs[0], "z3_no_scale", "z3", "grad") > 0.1  # reduce-scatter divides by DP x P


@pytest.mark.slow
def test_deepspeed_reduction_scale_exact_fp32_bf16(two_ranks):
    """The gradient DeepSpeed applies is the sum over the SP ranks (our loss convention) under
    fp32 and bf16 (with and without fp32 accumulation), ZeRO 0-3, exactly."""
    target = [[1.0 - (0 + 4), 1.0 - (1 + 5), 1.0 - (2 + 6), 1.0 - (3 + 7)]]
    for res in [r["exact"] for r in two_ranks]:
        assert len(res) == 2 * len(EXACT_CASES) - 2  # unsharded and sharded mpu
        assert all(w == target for w in res.values()), res


@pytest.mark.parametrize("sharing", SHARING)
def test_shards_of_every_rank_rebuild_the_model(sharing):
    """Single process: the P shards of E/F (every sharing mode; linear, conv and dense layers)
    and of the position table, taken for each rank, concatenate to the whole parameters; conv
    kernels and everything else stay whole; the parameter count is the whole model's."""
    import copy

    from linformer_ds.model import LinformerForMaskedLM
    from linformer_ds.parallel.sharding import sequence_dim, shard_sequence_parameters

    torch.manual_seed(0)
    cfg = _cfg(**SCHEDULES["mixed"], sharing=sharing)
    ref = LinformerForMaskedLM(cfg)
    full = dict(ref.named_parameters())
    world = 4
    shards = []
    for r in range(world):
        model = copy.deepcopy(ref)
        names = shard_sequence_parameters(model, r, world)
        assert model.num_parameters() == ref.num_parameters()
        shards.append(dict(model.named_parameters()))
    # the linear layer's E (and F) and the positions, nothing else (conv kernels stay whole)
    want = {n for n, p in full.items() if sequence_dim(n, p.dim()) is not None}
    assert set(names) == want and "encoder.position_embeddings.weight" in want
    assert len(want) == 1 + {"none": 2, "headwise": 2, "kv": 1, "layerwise": 1}[sharing]
    for name, p in full.items():
        if name in want:
            dim = shards[0][name].sequence_shard[0]
            assert shards[0][name].shape[dim] * world == p.shape[dim]
            assert torch.equal(torch.cat([s[name] for s in shards], dim=dim), p)
        else:
            assert all(torch.equal(s[name], p) for s in shards)


if __name__ == "__main__":
    _main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])


@settings(max_examples=60, deadline=None)
@given(
    p=st.sampled_from([1, 2, 4]),
    n=st.sampled_from([32, 48, 64]),
    n_max=st.sampled_from([48, 64, 96]),
    zero=st.integers(0, 3),
    precision=st.sampled_from(["fp32", "bf16"]),
)
def test_shard_auto_true_false(p, n, n_max, zero, precision):
    """``parallel.shard_sequence_parameters``: auto shards exactly when ``true`` validates
    (P > 1 and the run allows it), else holds the matrices whole; it fails only where ``false``
    fails; ``true`` keeps its errors; the choice and the reason are recorded (``auto_shard``)."""
    from linformer_ds.config import ConfigError, from_dict
    from linformer_ds.resolve import resolve

    def job(shard):
        model = {"max_seq_len": n_max, "hidden_size": 16, "num_heads": 4, "num_layers": 1,
                 "intermediate_size": 32, "k": 8, "vocab_size": 50}  # fmt: skip
        return from_dict({
            "model": model, "deepspeed": {"precision": precision, "zero": {"stage": zero}},
            "parallel": {"sequence_parallel_size": p, "shard_sequence_parameters": shard},
        })  # fmt: skip

    def outcome(cfg):
        try:
            return resolve(cfg, 4, seq_len=n), None
        except ConfigError as e:
            return None, str(e)

    (auto, err_auto), (true, err_true), (false, err_false) = map(
        outcome, (job("auto"), job(True), job(False))
    )
    assert err_auto == err_false  # auto never refuses a run for a sharding rule
    if err_false is not None:
        return
    chosen = auto.parallel.shard_sequence_parameters
    assert chosen is (p > 1 and err_true is None), (chosen, err_true)
    assert auto.parallel.auto_shard.startswith("sharded: " if chosen else "whole: ")
    assert "\n" not in auto.parallel.auto_shard and "=false" not in auto.parallel.auto_shard
    if p > 1 and n != n_max:  # true: sharding needs N = max_seq_len, one line naming the key
        assert err_true.startswith("parallel.shard_sequence_parameters: ") and "\n" not in err_true
    if true is not None:  # resolved: true stays true, no auto reason
        assert true.parallel.shard_sequence_parameters is True and true.parallel.auto_shard is None
    assert false.parallel.shard_sequence_parameters is False


def test_shard_bad_value_names_the_key():
    from linformer_ds.config import ConfigError, from_dict, validate

    cfg = from_dict({"parallel": {"sequence_parallel_size": 2, "shard_sequence_parameters": "yes"}})
    with pytest.raises(ConfigError, match="shard_sequence_parameters: must be auto, true or false"):
        validate(cfg)
