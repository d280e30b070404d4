"""``metrics.top1`` (the trainer's and the evaluation's prediction) equals ``argmax(-1)``, ties
included: the first of equal maxima, in every dtype the trainer computes logits in."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from linformer_ds.metrics import top1


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(1, 40),
    vocab=st.sampled_from([1, 2, 7, 64, 300, 8000]),
    levels=st.integers(1, 4),  # few distinct values: many ties
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    seed=st.integers(0, 2**31 - 1),
)
def test_top1_is_argmax_with_ties(rows, vocab, levels, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, levels, (rows, vocab), generator=g).to(dtype)
    assert torch.equal(top1(x), x.argmax(-1))
    y = torch.randn(rows, vocab, generator=g).to(dtype)
    assert torch.equal(top1(y), y.argmax(-1))
