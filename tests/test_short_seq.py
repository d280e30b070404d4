"""MLMMasking(short_seq_prob): BERT-style short rows, deterministic in (seed, epoch, row)."""

import pytest
import torch

from linformer_ds.data.masking import MLMMasking
from linformer_ds.loss import IGNORE_INDEX

V, N, B = 50, 32, 400
SPECIAL = [0, 1, 2, 3, 4]


def rows() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    t = torch.randint(5, V, (B, N), generator=g)
    t[:, 0], t[:, -1] = 2, 3
    return t


def masker(p: float, seed: int = 7) -> MLMMasking:
    return MLMMasking(V, 4, SPECIAL, 0.15, seed=seed, pad_id=0, short_seq_prob=p)


def test_default_and_zero_leave_rows_whole():
    t, idx = rows(), torch.arange(B)
    old = MLMMasking(V, 4, SPECIAL, 0.15, seed=7, pad_id=0)(t, idx, 3)
    new = masker(0.0)(t, idx, 3)
    assert all(torch.equal(old[k], new[k]) for k in old)
    assert bool(new["attention_mask"].all())


def test_short_rows_fraction_padding_and_determinism():
    t, idx = rows(), torch.arange(B)
    out = masker(0.3)(t, idx, 3)
    lengths = out["attention_mask"].sum(1)
    cut = lengths < N
    assert 0.22 < cut.float().mean().item() < 0.38  # ~30 % of 400 rows
    assert int(lengths.min()) >= 2
    for r in torch.nonzero(cut).flatten().tolist():
        n = int(lengths[r])
        assert bool((out["attention_mask"][r, :n] == 1).all())
        assert bool((out["input_ids"][r, n:] == 0).all())  # the tail is padding...
        assert bool((out["labels"][r, n:] == IGNORE_INDEX).all())  # ...and never predicted
    # uncut rows are masked exactly as without short_seq_prob; cut rows on their prefix too
    whole = masker(0.0)(t, idx, 3)
    keep = out["attention_mask"].bool()
    assert torch.equal(out["labels"][keep], whole["labels"][keep])
    assert torch.equal(out["input_ids"][keep], whole["input_ids"][keep])
    # a function of (seed, epoch, row) only: any batching, same result; other epoch, other cuts
    perm = torch.randperm(B)
    again = masker(0.3)(t[perm], idx[perm], 3)
    assert all(torch.equal(again[k], out[k][perm]) for k in out)
    other = masker(0.3)(t, idx, 4)["attention_mask"].sum(1)
    assert not torch.equal(other, lengths)


def test_rejects_bad_probability():
    with pytest.raises(ValueError, match="short_seq_prob must be in"):
        masker(1.5)
