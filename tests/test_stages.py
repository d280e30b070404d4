"""Sequence-length stages (linformer_ds.data.stream.TrainData): stage switches at their end steps,
sources carry their position into later stages, and the state resumes exactly at any step,
across a stage boundary included."""

import pytest
import torch

from linformer_ds.data.masking import MLMMasking
from linformer_ds.data.shards import ShardDataset
from linformer_ds.data.stages import Stage
from linformer_ds.data.stream import TrainData
from tests.legacy_batches import TrainBatches
from tests.pretrain_utils import read_metrics, run_worker_ranks, worker_run
from tests.test_mixture import docs_corpus, prepare


@pytest.fixture(scope="module")
def short_source(tiny_corpus, tmp_path_factory):
    """The stdlib corpus again at N = 64, with tiny_corpus's tokenizer (a staged run's short
    stage)."""
    out = tmp_path_factory.mktemp("short") / "stdlib_64"
    return prepare(out, "stdlib", 64, "--tokenizer", tiny_corpus / "tokenizer.model",
                   "--max-docs", "40", "--valid-fraction", "0.05")  # fmt: skip


def make(stages, datasets, rank=0, world=1):
    return TrainData(stages, datasets, rank, world, seed=7, short_seq_prob=0.1)


def run(data: TrainData, first: int, last: int):
    out = []
    for step in range(first, last + 1):
        data.begin_step(step)
        b = data.next_batch()
        out.append((data.stage_index, b["input_ids"].clone(), b["labels"].clone()))
    return out


def sources(tiny_corpus, short_source):
    return {
        "short": ShardDataset(short_source),  # N = 64
        "a": ShardDataset(tiny_corpus, "valid"),  # N = 128, small: wraps
        "b": ShardDataset(tiny_corpus, "train"),  # N = 128
    }


def test_stages_switch_and_resume_exactly_at_every_step(tiny_corpus, short_source):
    datasets = sources(tiny_corpus, short_source)
    stages = [
        Stage(3, ["short"], ["s"], [1.0], 5),
        Stage(5, ["a", "b"], ["a", "b"], [0.5, 0.5], 2),
        Stage(9, ["a"], ["a"], [1.0], 3),
    ]
    ref = run(make(stages, datasets), 1, 9)
    assert [k for k, _, _ in ref] == [0, 0, 0, 1, 1, 2, 2, 2, 2]
    shapes = [tuple(x.shape) for _, x, _ in ref]
    assert shapes == [(5, 64)] * 3 + [(2, 128)] * 2 + [(3, 128)] * 4
    for cut in range(0, 9):  # stop after step `cut`, resume in a fresh object
        a = make(stages, datasets)
        run(a, 1, cut)
        b = make(stages, datasets)
        b.load_state_dict(a.state_dict())
        got = run(b, cut + 1, 9)
        for (k1, x1, y1), (k2, x2, y2) in zip(got, ref[cut:]):
            assert k1 == k2 and torch.equal(x1, x2) and torch.equal(y1, y2)


def test_a_source_continues_where_its_last_stage_left_it(tiny_corpus, short_source):
    datasets = sources(tiny_corpus, short_source)
    a = datasets["a"]
    stages = [
        Stage(2, ["a"], ["a"], [1.0], 2),
        Stage(4, ["short"], ["s"], [1.0], 3),
        Stage(6, ["a", "b"], ["a", "b"], [2.0, 1.0], 3),
    ]
    data = make(stages, datasets)
    rows = []
    data.on_batch = lambda epochs, picks: rows.append(picks)
    run(data, 1, 6)
    # stage 0 drew 4 rows of `a`, stage 2 drew 4 more (6 draws at 2:1): 8 rows of one epoch,
    # the continuation of one permutation, no row twice
    assert len(a) > 8
    assert data.mixture.sampler.sources[0].count == 4
    st = data.state_dict()["sampler"]["mixture"]["sources"]["a"]
    assert (st["epoch"], st["consumed"]) == (0, 8)
    perm = data.mixture.sampler.permutation(0, 0)
    a_rows = [row for _, row in rows[0] + rows[1]] + [r for i, r in rows[4] + rows[5] if i == 0]
    assert a_rows == [int(r) for r in perm[:8]]
    assert len(set(a_rows)) == 8


def test_loads_a_train_batches_state(tiny_corpus):
    """A checkpoint written before mixtures (TrainBatches' state) resumes the same stream."""
    ds = ShardDataset(tiny_corpus, "valid")
    masker = MLMMasking(ds.vocab_size, ds.mask_id, ds.special_ids, 0.15, seed=7, pad_id=ds.pad_id,
                        short_seq_prob=0.1)  # fmt: skip
    old = TrainBatches(ds, masker, 1, 2, 3, seed=7)
    for _ in range(len(ds) // 5):
        old.next_batch()
    new = make([Stage(100, ["valid"], ["v"], [1.0], 3)], {"valid": ds}, rank=1, world=2)
    assert new.legacy
    new.load_state_dict(old.state_dict())
    for _ in range(len(ds) // 2):
        a, b = old.next_batch(), new.next_batch()
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert new.state_dict()["sampler"]["consumed"] == old.state_dict()["sampler"]["consumed"]
    assert new.epoch == old.epoch >= 1


# ============================================================================ the trainer
STAGE_STEPS = 12


def staged_overrides(tiny_corpus, short_source, docs_source):
    """Steps 1-6 at N = 64 (micro-batch 6), steps 7-12 at N = 128 on a 2:1 mixture
    (micro-batch 3); a hybrid model (layer 0 linear, layer 1 conv with stride 128/32 = 4)."""
    return [
        f"data.sources=[{{name: short, path: '{short_source}', weight: 1}}, "
        f"{{name: code, path: '{tiny_corpus}', weight: 2}}, "
        f"{{name: docs, path: '{docs_source}', weight: 1}}]",
        "train.stages=[{end_step: 6, sources: [short], micro_batch_size: 6}, "
        "{end_step: 12, sources: [code, docs], micro_batch_size: 3}]",
        f"train.max_steps={STAGE_STEPS}", "model.projection=hybrid",
        "model.hybrid_linear_layers=1", "checkpoint.save_interval=0",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def docs_source(tiny_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("docs") / "docs_128"
    return prepare(out, docs_corpus(tmp_path_factory), 128, "--tokenizer", tiny_corpus / "tokenizer.model",
                   "--valid-fraction", "0.2", "--max-docs", "12")  # fmt: skip


def test_staged_run_resumes_exactly_across_its_boundary(
    tiny_corpus, short_source, docs_source, tmp_path
):
    ov = staged_overrides(tiny_corpus, short_source, docs_source)
    # the same run in three pieces: stop at the boundary (step 6), then inside stage 1 (step 9);
    # 2 ranks, the uninterrupted run and the first piece in one process group
    # (tests/layout_worker.py), each later piece resumed in a new one
    pieces = [worker_run("parts", tiny_corpus, ov + [f"train.stop_at_step={stop}"])
              for stop in (6, 9, STAGE_STEPS)]  # fmt: skip
    first = run_worker_ranks(2, [worker_run("ref", tiny_corpus, ov), pieces[0]], tmp_path, "a")
    parts = [first["parts"]]
    parts += [run_worker_ranks(2, [piece], tmp_path, f"b{i}")["parts"]
              for i, piece in enumerate(pieces[1:])]  # fmt: skip
    assert "step_00000006: step 6," in parts[1]  # resumed at the boundary...
    assert "step_00000009: step 9," in parts[2]  # ...and inside the second stage
    a, b = read_metrics(tmp_path / "ref"), read_metrics(tmp_path / "parts")
    steps = range(1, STAGE_STEPS + 1)
    assert [a[s]["loss"] for s in steps] == [b[s]["loss"] for s in steps]
    # the logs: per-stage N, tokens per step and a summary of each stage
    assert [a[s]["seq_len"] for s in steps] == [64] * 6 + [128] * 6
    assert [a[s]["stage"] for s in steps] == [0] * 6 + [1] * 6
    out = first["ref"]
    assert "[stage] 0 start: steps 1-6, N=64, micro_batch_size=6" in out
    assert "[stage] 1 start: steps 7-12, N=128, micro_batch_size=3" in out
    for k in (0, 1):
        line = next(x for x in out.splitlines() if x.startswith(f"[stage] {k} done"))
        figures = dict(f.split("=") for f in line.split()[3:] if "=" in f)
        assert float(figures["tokens_per_s"]) > 0 and 0 < float(figures["mfu"])
        assert float(figures["peak_mem_gb"]) > 0
