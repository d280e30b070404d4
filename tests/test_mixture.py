"""linformer_ds.mixture: the blended stream tracks its weights at every prefix, re-shards to any
rank count, resumes exactly, and one source is today's TrainBatches stream bit for bit."""

import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from linformer_ds.data import DataError, MLMMasking, ShardDataset, TrainBatches
from linformer_ds.mixture import (
    MixtureBatches,
    MixtureSampler,
    check_same_tokenizer,
    normalized_weights,
    open_sources,
)
from tests.pretrain_utils import REPO

weights_st = st.lists(
    st.one_of(st.integers(0, 20).map(float), st.floats(1e-3, 1.0)), min_size=1, max_size=6
).filter(lambda w: sum(w) > 0)


def sampler(sizes, weights, rank=0, world=1, seed=3, **kw) -> MixtureSampler:
    return MixtureSampler(
        [f"s{i}" for i in range(len(sizes))], sizes, weights, rank, world, seed, **kw
    )


def global_stream(sizes, weights, world, rounds, seed=3, state=None):
    """The global stream (source, epoch, row) read through ``world`` ranks in lockstep."""
    ranks = [sampler(sizes, weights, r, world, seed) for r in range(world)]
    if state is not None:
        for s in ranks:
            s.load_state_dict(state)
    out = []
    for _ in range(rounds):
        out += [s.next() for s in ranks]
    states = [s.state_dict() for s in ranks]
    assert all(x == states[0] for x in states)  # the state is the same on every rank
    return out, states[0]


# ======================================================================= blending invariants
@settings(max_examples=60, deadline=None)
@given(weights=weights_st, n=st.integers(1, 400))
def test_realized_shares_track_weights_at_every_prefix(weights, n):
    w = normalized_weights(weights)
    s = sampler([5] * len(w), weights)
    counts = np.zeros(len(w))
    for p in range(1, n + 1):
        i, _, _ = s.next()
        counts[i] += 1
        dev = counts - np.array(w) * p
        # proven for the max-gap rule: never more than one ahead, never S - 1 behind
        assert dev.max() < 1.0 + 1e-9
        assert dev.min() > -(len(w) - 1) - 1e-9
        if len(w) == 2:
            assert np.abs(dev).max() < 1.0 + 1e-9
        assert all(c == 0 for c, x in zip(counts, w) if x == 0)  # weight 0: never drawn
    assert s.shares() == {f"s{i}": c / n for i, c in enumerate(counts)}


def test_shares_within_one_percent_after_200_samples():
    s = sampler([37, 11], [0.75, 0.25])
    for _ in range(200):
        s.next()
    shares = s.shares()
    assert shares == {"s0": 0.75, "s1": 0.25}  # 150 / 50 exactly
    # the small source wrapped: 50 draws from 11 rows = 4 whole epochs + 6 rows
    assert s.epochs()["s1"] == pytest.approx(50 / 11)
    assert s.state_dict()["sources"]["s1"]["epoch"] == 4


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 9), min_size=2, max_size=4),
    data=st.data(),
)
def test_each_source_walks_its_own_permutations(sizes, data):
    weights = data.draw(st.lists(st.floats(0.05, 1.0), min_size=len(sizes), max_size=len(sizes)))
    s = sampler(sizes, weights)
    seen = {i: [] for i in range(len(sizes))}
    for _ in range(60):
        i, e, row = s.next()
        seen[i].append((e, row))
    for i, rows in seen.items():
        for k, (e, row) in enumerate(rows):  # draw k of source i: epoch k // n, its permutation
            assert e == k // sizes[i]
            assert row == s.permutation(i, e)[k % sizes[i]]


# ================================================================== sharding and exact resume
@settings(max_examples=30, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 12), min_size=2, max_size=4),
    world=st.integers(1, 4),
    total=st.integers(0, 60),
)
def test_global_stream_does_not_depend_on_rank_count(sizes, world, total):
    weights = [1.0 + i for i in range(len(sizes))]
    rounds = total // world
    ref, ref_state = global_stream(sizes, weights, 1, rounds * world)
    got, state = global_stream(sizes, weights, world, rounds)
    assert got == ref
    assert state == ref_state


@settings(max_examples=30, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 12), min_size=1, max_size=4),
    w1=st.integers(1, 4),
    w2=st.integers(1, 4),
    k=st.integers(0, 30),
)
def test_resume_at_any_point_on_any_rank_count(sizes, w1, w2, k):
    """Saved after k rounds of w1 ranks, resumed on w2 ranks: the same continuation as a run
    that never stopped and switched to w2 ranks at that point (for one source: today's rule)."""
    weights = [2.0, 1.0, 0.5, 3.0][: len(sizes)]
    if len(sizes) == 1 and max(w1, w2) > sizes[0]:
        sizes = [max(w1, w2) + sizes[0]]
    _, state = global_stream(sizes, weights, w1, k)
    ranks = [sampler(sizes, weights, r, w1) for r in range(w1)]
    for _ in range(k):
        for s in ranks:
            s.next()
    # the uninterrupted objects, re-sharded in place to w2 ranks
    cont = [sampler(sizes, weights, r, w2) for r in range(w2)]
    for s in cont:
        s.load_state_dict(ranks[0].state_dict())
    resumed, _ = global_stream(sizes, weights, w2, 10, state=state)
    ref = []
    for _ in range(10):
        ref += [s.next() for s in cont]
    assert resumed == ref
    if len(sizes) > 1:  # several sources: the stream is independent of the rank counts
        full, _ = global_stream(sizes, weights, 1, k * w1 + 10 * w2)
        assert resumed == full[k * w1 :]


def test_load_state_refuses_other_sources_and_changed_data():
    s = sampler([5, 7], [1, 1])
    s.next()
    with pytest.raises(ValueError, match="the checkpoint's mixture has sources"):
        sampler([5, 7, 9], [1, 1, 1]).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="dataset changed"):
        sampler([5, 4], [1, 1]).load_state_dict(s.state_dict())


def test_bad_weights():
    for bad, msg in (([1, -1], "negative"), ([0, 0], "all weights are zero"),
                     ([1, math.nan], "not a finite"), ([math.inf], "not a finite")):  # fmt: skip
        with pytest.raises(ValueError, match=msg):
            normalized_weights(bad)


# ======================================================= one source = today's TrainBatches
@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 40),
    world=st.integers(1, 4),
    mb=st.integers(1, 5),
    steps=st.integers(1, 25),
    world2=st.integers(1, 4),
)
def test_one_source_is_todays_sampler(n, world, mb, steps, world2):
    """Indices, epochs and the saved state of one source equal ResumableDistributedSampler's as
    TrainBatches drives it, across epoch ends and a resume on another rank count."""
    n = max(n, world, world2)

    class Rows:  # TrainBatches only asks the length here (indices are compared, not rows)
        path, split = "rows", "train"

        def __len__(self):
            return n

    def todays(rank, w, state=None):
        tb = TrainBatches(Rows(), None, rank, w, mb, seed=11)
        if state is not None:
            tb.sampler.load_state_dict(state["sampler"])
            tb.epoch = int(state["epoch"])
        return tb

    old = [todays(r, world) for r in range(world)]
    new = [sampler([n], [1.0], r, world, seed=11) for r in range(world)]
    for _ in range(steps):
        for o, m in zip(old, new):
            want = [o._next_index() for _ in range(mb)]
            got = [m.next() for _ in range(mb)]
            assert want == [row for _, _, row in got]
            assert got[-1][1] == o.epoch  # the batch's epoch (TrainBatches masks with it)
    st_old = old[0].state_dict()
    src = new[0].state_dict()["sources"]["s0"]
    assert (src["epoch"], src["consumed"]) == (st_old["epoch"], st_old["sampler"]["consumed"])
    # resume both on world2 ranks
    old2 = [todays(r, world2, st_old) for r in range(world2)]
    new2 = [sampler([n], [1.0], r, world2, seed=11) for r in range(world2)]
    for m in new2:
        m.load_state_dict(new[0].state_dict())
    for _ in range(steps):
        for o, m in zip(old2, new2):
            assert [o._next_index() for _ in range(mb)] == [m.next()[2] for _ in range(mb)]


def test_one_source_batches_equal_train_batches(tiny_corpus):
    """Rows and masks: MixtureBatches over one source == TrainBatches, 2 ranks, many epochs."""
    ds = ShardDataset(tiny_corpus, "valid")  # small: the run crosses several epochs
    n, mb, world = len(ds), 3, 2
    masker = MLMMasking(ds.vocab_size, ds.mask_id, ds.special_ids, 0.15, seed=5, pad_id=ds.pad_id,
                        short_seq_prob=0.1)  # fmt: skip
    for rank in range(world):
        old = TrainBatches(ds, masker, rank, world, mb, seed=5)
        new = MixtureBatches(["only"], [ds], [1.0], rank, world, mb, seed=5,
                             mlm_probability=0.15, short_seq_prob=0.1)  # fmt: skip
        for _ in range(3 * n // (mb * world) + 2):
            a, b = old.next_batch(), new.next_batch()
            assert all(torch.equal(a[k], b[k]) for k in a)
        assert new.epoch == old.epoch >= 2


# ================================================================== real sources, real checks
@pytest.fixture(scope="module")
def second_source(tiny_corpus, tmp_path_factory):
    """A second corpus (this repo's docs) prepared with tiny_corpus's tokenizer, N = 128."""
    out = tmp_path_factory.mktemp("docs") / "docs_128"
    cmd = [sys.executable, "-m", "data_prep", "--source", str(REPO / "docs" / "*.md"), "--out", str(out),
           "--seq-len", "128", "--tokenizer", str(tiny_corpus / "tokenizer.model"),
           "--valid-fraction", "0.2", "--max-docs", "12", "--quiet"]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=REPO, timeout=600)
    return out


def test_two_sources_mask_each_row_by_its_source(tiny_corpus, second_source):
    names = ["code", "docs"]
    dss = open_sources(names, [tiny_corpus, second_source], "train")
    mb = 4
    mix = MixtureBatches(names, dss, [0.75, 0.25], 0, 1, mb, seed=9)
    maskers = mix.maskers
    assert maskers[0].seed != maskers[1].seed  # sources have their own mask randomness
    ref = MixtureSampler(names, [len(d) for d in dss], [0.75, 0.25], 0, 1, seed=9)
    for _ in range(60):
        batch = mix.next_batch()
        for r in range(mb):
            i, e, row = ref.next()
            want = maskers[i](dss[i][row][None], torch.tensor([row]), e)
            assert all(torch.equal(batch[k][r], want[k][0]) for k in want)
    shares = mix.shares()
    assert abs(shares["code"] - 0.75) <= 1 / 240 and abs(shares["docs"] - 0.25) <= 1 / 240
    assert mix.epochs()["docs"] == pytest.approx(60 / len(dss[1]))


def test_sources_must_share_tokenizer_and_n(tiny_corpus, second_source, tmp_path):
    other = tmp_path / "other_tok"
    cmd = [sys.executable, "-m", "data_prep", "--source", str(REPO / "docs" / "*.md"), "--out", str(other),
           "--seq-len", "64", "--vocab-size", "300", "--max-docs", "6", "--quiet"]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=REPO, timeout=600)
    a, b = ShardDataset(tiny_corpus), ShardDataset(other)
    with pytest.raises(DataError, match="different tokenizers"):
        check_same_tokenizer(["a", "b"], [a, b])
    short = tmp_path / "short"
    cmd = [sys.executable, "-m", "data_prep", "--source", str(REPO / "docs" / "*.md"), "--out", str(short),
           "--seq-len", "64", "--tokenizer", str(tiny_corpus / "tokenizer.model"),
           "--max-docs", "6", "--quiet"]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=REPO, timeout=600)
    with pytest.raises(DataError, match="different sequence lengths"):
        check_same_tokenizer(["a", "s"], [a, ShardDataset(short)])
    check_same_tokenizer(["a", "s"], [a, ShardDataset(short)], same_seq_len=False)
    check_same_tokenizer(["a", "d"], [a, ShardDataset(second_source)])
