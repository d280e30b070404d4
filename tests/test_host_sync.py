"""No device->host synchronisation per micro-batch (linformer_ds/testing/hostsync.py counts them).

A ``TorchDispatchMode`` sees every aten operation, also on the CPU, and counts those that make
the host wait for an accelerator (scalar reads, ``nonzero``, boolean-mask indexing, copies to
the host...), with whose code asked. Checked here:

- the pretraining model's labelled path (flat indices computed on the host, gathers of a known
  size) equals the boolean-mask reference bit for bit (loss, logits, every gradient) on
  generated batches, and its forward + backward asks for nothing;
- the data pipeline gives every sequence-parallel slice the labelled positions of its slice;
- real DeepSpeed runs (1 rank with accumulation, 2 data-parallel ranks, sequence parallel 2)
  under ZeRO 0-3, through the trainer's own hook (``debug.sync_log``): per optimizer
  step the model asks for nothing and the trainer for exactly one read (the agreed
  statistics); DeepSpeed's own counts are recorded (``syncs_deepspeed.json``) and printed.
"""

import functools
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from linformer_ds.model import LinformerForMaskedLMPretraining, ModelConfig, labelled_positions
from linformer_ds.testing.hostsync import SyncCounter
from tests.pretrain_utils import start_worker_ranks, wait_worker_ranks

VOCAB, MAX_N = 50, 16


@functools.cache
def tiny_model(projection: str) -> LinformerForMaskedLMPretraining:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=VOCAB, max_seq_len=MAX_N, hidden_size=16, num_heads=2, intermediate_size=32,
        num_layers=2, k=4, dropout=0.0, attention_dropout=0.0, projection=projection,
    )  # fmt: skip
    return LinformerForMaskedLMPretraining(cfg)


def boolean_mask_reference(model, ids, mask, labels):
    """The forward as it was: boolean-mask selection of the labelled positions."""
    hidden = model.encoder(ids, mask)
    sel = labels != -100
    targets = labels[sel]
    logits = model.lm_head(hidden[sel])
    total = F.cross_entropy(logits.float(), targets, reduction="sum")
    return total / max(targets.numel(), 1), logits


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@st.composite
def batches(draw):
    b = draw(st.integers(1, 3))
    n = draw(st.integers(2, MAX_N))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (b, n), generator=g)
    lengths = torch.randint(1, n + 1, (b,), generator=g)
    mask = (torch.arange(n)[None] < lengths[:, None]).long()
    p = draw(st.sampled_from([0.0, 0.15, 0.5, 1.0]))
    labelled = (torch.rand(b, n, generator=g) < p) & (mask == 1)
    labels = torch.where(labelled, ids, torch.full_like(ids, -100))
    return ids, mask, labels


@settings(max_examples=30, deadline=None)
@given(batch=batches(), projection=st.sampled_from(["linear", "hybrid", "dense"]))
def test_labelled_path_equals_boolean_mask_without_syncs(batch, projection):
    """Loss, logits and every gradient bit-identical to the boolean-mask reference; the
    forward + backward with host-computed indices count no sync (the ids unchecked, as the
    trainer runs it); the default path costs its one ``nonzero`` and the id check two reads."""
    ids, mask, labels = batch
    model = tiny_model(projection)
    ref_loss, ref_logits = boolean_mask_reference(model, ids, mask, labels)
    ref_loss.backward()
    ref_grads = _grads(model)

    index = labelled_positions(labels)  # on the host, as the data pipeline does
    assert torch.equal(index, torch.from_numpy((labels.reshape(-1) != -100).numpy().nonzero()[0]))
    model.encoder.check_token_ids = False
    try:
        with SyncCounter() as counter:
            out = model(ids, mask, labels=labels, labelled_index=index)
            out.loss.backward()
    finally:
        model.encoder.check_token_ids = True
    assert dict(counter.counts) == {}
    assert torch.equal(out.loss, ref_loss)
    assert torch.equal(out.labelled_logits, ref_logits)
    assert torch.equal(out.labelled_targets, labels[labels != -100])
    grads = _grads(model)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert torch.equal(g, ref_grads[name]), name

    with SyncCounter() as counter:  # the public default: the model finds the positions
        default = model(ids, mask, labels=labels)
    assert torch.equal(default.loss, ref_loss)
    assert dict(counter.ops) == {("model", "item"): 2, ("model", "nonzero"): 1}


def test_sequence_parallel_slices_keep_their_labelled_positions(tiny_corpus):
    """Every rank's batch (sp_size 2 and 4) carries the labelled positions of its own slice:
    mapped back to the whole row they are the unsplit batch's, each exactly once."""
    from linformer_ds.data.shards import ShardDataset
    from linformer_ds.data.stream import MixtureBatches

    ds = ShardDataset(tiny_corpus, "valid")
    n = ds.seq_len

    def stream(sp_rank: int, sp_size: int):
        return MixtureBatches(["v"], [ds], [1.0], 0, 1, 3, seed=3, short_seq_prob=0.3,
                              sp_rank=sp_rank, sp_size=sp_size)  # fmt: skip

    for sp_size in (2, 4):
        whole = stream(0, 1)
        ranks = [stream(r, sp_size) for r in range(sp_size)]
        for _ in range(4):
            full = whole.next_batch()
            assert torch.equal(full["labelled_index"], labelled_positions(full["labels"]))
            found: list[int] = []
            for r, s in enumerate(ranks):
                part = s.next_batch()
                local = n // sp_size
                idx = part["labelled_index"]
                assert torch.equal(idx, labelled_positions(part["labels"]))
                row, col = idx // local, idx % local
                found += (row * n + r * local + col).tolist()
            assert sorted(found) == full["labelled_index"].tolist()


# ========================================================== real runs: the trainer's own hook
STEPS = 4
COUNTED = (2, 3)
# name -> (ranks, sequence-parallel size, gradient accumulation steps)
RUNS = {"1rank_gas2": (1, 1, 2), "dp2_gas2": (2, 1, 2), "sp2_gas2": (2, 2, 2)}
STAGES = (0, 1, 2, 3)


@pytest.fixture(scope="module")
def counted(tiny_corpus, tmp_path_factory) -> list[dict]:
    """Every run x ZeRO stage trained for STEPS steps; the hook's records of COUNTED steps."""
    out = tmp_path_factory.mktemp("host_sync")
    by_world: dict[int, list] = {}
    for name, (ranks, sp, gas) in RUNS.items():
        for stage in STAGES:
            run = f"{name}_z{stage}"
            by_world.setdefault(ranks, []).append({"name": run, "overrides": [
                f"data.path={tiny_corpus}", f"checkpoint.dir={out / run}/checkpoints",
                f"deepspeed.zero.stage={stage}", f"parallel.sequence_parallel_size={sp}",
                f"train.gradient_accumulation_steps={gas}", "train.micro_batch_size=2",
                f"train.max_steps={STEPS}", "checkpoint.resume=never",
                "checkpoint.save_final=false", "checkpoint.save_interval=0",
                "data.short_seq_prob=0.5",  # the hook: debug.sync_log, debug.sync_steps
                f"debug.sync_log={out / f'syncs_world{ranks}'}",
                f"debug.sync_steps=[{','.join(map(str, COUNTED))}]",
                # bf16; ZeRO-0 bf16 accumulates in bf16:
            ] + (["deepspeed.fp32_grad_accum=false"] if stage == 0 else [])})  # fmt: skip
    launches = [(f"world{r}", start_worker_ranks(r, runs, out, f"world{r}"))
                for r, runs in by_world.items()]  # fmt: skip
    for name, procs in launches:
        wait_worker_ranks(procs, out, name, timeout=600)
    records = []
    for path in sorted(out.glob("syncs_world*/syncs.rank*.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines()]
    for r in records:
        r["name"] = Path(r["run"]).name
    return records


def test_one_read_per_step_and_none_in_the_model(counted):
    """Per optimizer step, on every rank of every run and ZeRO stage: nothing from the model
    (forward, backward), exactly one read from the trainer (the all-reduced statistics);
    DeepSpeed's own count per stage is recorded beside the run."""
    runs = {f"{name}_z{s}" for name in RUNS for s in STAGES}
    steps = [r for r in counted if r["counted"]]
    want = {(name, RUNS[name.rsplit("_z", 1)[0]][0]) for name in runs}
    assert {(r["name"], len({x["rank"] for x in steps if x["name"] == r["name"]}))
            for r in steps} == want  # fmt: skip
    table: dict[str, dict[str, dict]] = {}
    for r in steps:
        d = r["dispatch"]
        assert r["step"] in COUNTED
        assert d["by_owner"].get("model", 0) == 0, (r["name"], d["sites"])
        assert {k: v for k, v in d["by_reason"].items() if k.startswith("trainer/")} == {
            "trainer/copy_to_host": 1
        }, (r["name"], d["sites"])
        ds = {k: v for k, v in d["by_owner"].items() if k.startswith("deepspeed")}
        table.setdefault(r["name"], {})[f"step {r['step']} rank {r['rank']}"] = ds
    for name, rows in sorted(table.items()):
        print(f"[syncs] {name}: DeepSpeed's per optimizer step {rows}")
    out = Path(counted[0]["run"]).parent / "syncs_deepspeed.json"
    out.write_text(json.dumps(table, indent=1, sort_keys=True))
    # the step after the counted ones ran uncounted (the counters' cost shows beside it)
    assert {r["step"] for r in counted if not r["counted"]} == {max(COUNTED) + 1}
