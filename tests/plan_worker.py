"""The planner's two-rank checks (linformer_ds.plan, issue 55), run inside the two-rank launch
of tests/test_sequence_parallel.py (mode ``plan``): with P = 2 the measured peak of live tensor
bytes of one forward + backward on each rank (gradients held) and the bytes counted on the sequence-parallel
collectives; with DP = 2 the sizes of the parameters and optimizer states a DeepSpeed engine
holds per rank, by ZeRO stage and precision. The tests compare them with the plan."""

import functools

import torch

from bench.sp_collectives import count_collectives
from linformer_ds.engine import import_muon_lazily
from linformer_ds.model import LinformerForMaskedLMPretraining, ModelConfig, labelled_positions

N, B = 1024, 2
SP_CASES = [  # (model options, dtype, checkpointing)
    ({"projection": "linear"}, "float32", None),
    ({"projection": "linear"}, "bfloat16", "sublayer"),
    ({"projection": "conv"}, "float32", "layer"),
    ({"projection": "dense", "attention_dropout": 0.0}, "float32", None),
    ({"projection": "local", "local_window": 32}, "bfloat16", None),
]
# every stage in bf16; fp32 where its accounting differs (ZeRO-0: the parameters are the master
# copy; ZeRO-3: a flat fp32 partition beside the parameters' own)
STATE_CASES = [("fp32", 0), ("fp32", 3)] + [("bf16", z) for z in range(4)]


def sp_config(**kind) -> ModelConfig:
    return ModelConfig(**{"vocab_size": 512, "max_seq_len": N, "hidden_size": 64,
                          "num_layers": 2, "num_heads": 4, "intermediate_size": 256, "k": 32,
                          "sharing": "layerwise", **kind})  # fmt: skip


def _sp_case(groups, kind: dict, dtype: str, checkpoint) -> dict:  # noqa: ANN001
    import torch.utils.checkpoint as cp

    from linformer_ds.parallel.collectives import global_label_count
    from linformer_ds.parallel.parallelize import apply_sequence_parallel
    from linformer_ds.plan.measure import LiveBytes

    torch.manual_seed(0)
    model = LinformerForMaskedLMPretraining(sp_config(**kind)).to(getattr(torch, dtype))
    apply_sequence_parallel(model, groups.sp_group)
    if checkpoint:
        fn = functools.partial(cp.checkpoint, use_reentrant=False)
        model.encoder.set_activation_checkpointing(fn, granularity=checkpoint)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 512, (B, N), generator=g)
    labels = torch.where(torch.rand(B, N, generator=g) < 0.15, ids, -100)
    mask = torch.ones_like(ids)
    n = N // groups.sp_size
    s = slice(groups.sp_rank * n, (groups.sp_rank + 1) * n)
    ids, labels, mask = ids[:, s], labels[:, s], mask[:, s]
    index = labelled_positions(labels)
    denominator = global_label_count(labels, groups.sp_group)
    params = list(model.parameters())
    for p in params:  # held through the step, as DeepSpeed's gradient buffers are
        p.grad = torch.zeros_like(p)
    with count_collectives() as counted, LiveBytes(params + [p.grad for p in params]) as live:
        out = model(ids, mask, labels=labels, labelled_index=index, loss_denominator=denominator)
        out.loss.backward()
    return {
        "peak": live.peak,
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
        "labelled": index.numel() / labels.numel(),
        "bytes": counted.total,
    }


def _states_case(precision: str, stage: int, deepspeed) -> dict:  # noqa: ANN001
    """Bytes one rank's engine holds after a step: parameters (ZeRO-3: its partition), Adam's
    state tensors and the fp32 master partitions (the optimizer's parameters that are not the
    model's)."""
    from linformer_ds.config import load_config
    from linformer_ds.ds_config import deepspeed_config
    from tests.pretrain_utils import TINY_CONFIG

    job = load_config(TINY_CONFIG, [f"deepspeed.zero.stage={stage}",
                                    f"deepspeed.precision={precision}",
                                    "deepspeed.fp32_grad_accum=false"])  # fmt: skip
    cfg = deepspeed_config(job, world_size=2)
    torch.manual_seed(0)
    model = LinformerForMaskedLMPretraining(job.model)
    import_muon_lazily()  # as the trainer: no inductor import for DeepSpeed's Muon
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    ids = torch.randint(1, 512, (cfg["train_micro_batch_size_per_gpu"], 64))
    labels = torch.where(torch.rand(ids.shape) < 0.3, ids, -100)
    engine.backward(engine(ids, labels=labels).loss)
    engine.step()
    held = [getattr(p, "ds_tensor", p) for p in engine.module.parameters()]
    params = sum(t.numel() * t.element_size() for t in held)
    basic = engine.optimizer
    while not isinstance(basic, torch.optim.Optimizer) or hasattr(basic, "optimizer"):
        basic = basic.optimizer
    state = sum(t.numel() * t.element_size() for st in basic.state.values()
                for t in st.values() if torch.is_tensor(t) and t.numel() > 1)  # fmt: skip
    # the master partitions: what the state is kept for (ZeRO-3 swaps them into the param
    # groups only during the step) and the param groups, unless a model parameter's storage
    masters = {t.data_ptr(): t for t in basic.state}
    masters.update((t.data_ptr(), t) for grp in basic.param_groups for t in grp["params"])
    for t in held:
        masters.pop(t.data_ptr(), None)
    master = sum(t.numel() * t.element_size() for t in masters.values())
    engine.destroy()
    return {"parameters": params, "optimizer": state + master}


def plan_worker(rank: int, world: int, deepspeed) -> dict:  # noqa: ANN001, ARG001
    from linformer_ds.parallel import groups as grp

    groups = grp.build_groups(world)
    results: dict = {"sp": [], "states": []}
    for kind, dtype, checkpoint in SP_CASES:
        results["sp"].append(_sp_case(groups, kind, dtype, checkpoint))
    for precision, stage in STATE_CASES:
        results["states"].append(_states_case(precision, stage, deepspeed))
    return results
