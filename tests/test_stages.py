"""Sequence-length stages (linformer_ds.mixture.TrainData): stage switches at their end steps,
sources carry their position into later stages, and the state resumes exactly at any step,
across a stage boundary included."""

import subprocess
import sys

import pytest
import torch

from linformer_ds.data import MLMMasking, ShardDataset, TrainBatches
from linformer_ds.mixture import Stage, TrainData
from tests.pretrain_utils import REPO


@pytest.fixture(scope="module")
def short_source(tiny_corpus, tmp_path_factory):
    """The stdlib corpus again at N = 64, with tiny_corpus's tokenizer (a staged run's short
    stage)."""
    out = tmp_path_factory.mktemp("short") / "stdlib_64"
    cmd = [sys.executable, "-m", "data_prep", "--source", "stdlib", "--out", str(out),
           "--seq-len", "64", "--tokenizer", str(tiny_corpus / "tokenizer.model"),
           "--max-docs", "40", "--valid-fraction", "0.05", "--quiet"]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=REPO, timeout=600)
    return out


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
