"""The routed kind (content-routed block attention, linformer_ds/model/routed.py): against an
independent per-query reference, equal to dense when every block is read, document isolation
and padding, and its refusals."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from linformer_ds.model import LinformerForMaskedLM, ModelConfig, rotary_tables, rotate
from linformer_ds.model.routed import _routed, _routed_traced
from linformer_ds.parallel.checks import isolation_errors


def reference(q, k, v, real, bs, m, r, rotary=None, cs=None):
    """Query by query: the block's routing scores (best over its real queries of q . mean K_j
    / sqrt(d), over routed blocks of bs tokens), its m best blocks read exactly, the window's
    other real tokens within r, and for each summary block of cs tokens (default bs) the mean
    key and value of its real tokens not read exactly; one softmax. ``q, k, v [n, h, d]``,
    ``real [n]`` bool."""
    n, h, d = q.shape
    cs = cs or bs
    nb, nc = -(-n // bs), -(-n // cs)
    m = min(m, nb)
    qr, kr = (q, k) if rotary is None else (rotate(q[None], rotary)[0], rotate(k[None], rotary)[0])
    out = torch.zeros(n, h, d, dtype=torch.float64)
    for head in range(h):
        means_k, ok = [], []
        for j in range(nb):
            idx = [t for t in range(j * bs, min(n, (j + 1) * bs)) if real[t]]
            ok.append(bool(idx))
            means_k.append(k[idx, head].double().mean(0) if idx else torch.zeros(d).double())
        for j in range(nb):
            queries = [t for t in range(j * bs, min(n, (j + 1) * bs))]
            routing = [
                max(
                    (float((q[t, head].double() @ means_k[c]).detach()) / math.sqrt(d))
                    for t in queries
                    if real[t]
                )
                if any(real[t] for t in queries) and ok[c]
                else -math.inf
                for c in range(nb)
            ]
            order = sorted(range(nb), key=lambda c: -routing[c])  # ties: any order
            picked = set(order[:m])
            for t in queries:
                keys, vals = [], []
                for c in picked:
                    for s in range(c * bs, min(n, (c + 1) * bs)):
                        if real[s]:
                            keys.append(qr[t, head].double() @ kr[s, head].double())
                            vals.append(v[s, head].double())
                for c in range(nc):
                    rest = [
                        s
                        for s in range(c * cs, min(n, (c + 1) * cs))
                        if real[s] and s // bs not in picked
                    ]
                    if rest:
                        keys.append(q[t, head].double() @ k[rest, head].double().mean(0))
                        vals.append(v[rest, head].double().mean(0))
                for s in range(max(0, t - r), min(n, t + r + 1)) if r else ():
                    if real[s] and s // bs not in picked:
                        keys.append(qr[t, head].double() @ kr[s, head].double())
                        vals.append(v[s, head].double())
                if keys:
                    p = (torch.stack(keys) / math.sqrt(d)).softmax(0)
                    out[t, head] = (p[:, None] * torch.stack(vals)).sum(0)
    return out


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(5, 40),
    bs=st.sampled_from([2, 4, 8]),
    per=st.sampled_from([1, 1, 2, 3]),
    m=st.integers(1, 4),
    r=st.sampled_from([0, 1, 2]),
    padded=st.integers(0, 6),
    rope=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_routed_matches_the_per_query_reference(n, bs, per, m, r, padded, rope, seed):
    """Routed blocks of bs tokens inside summary blocks of per * bs (per = 1: the summaries are
    the routed blocks)."""
    r, cs = min(r, bs), per * bs
    g = torch.Generator().manual_seed(seed)
    h, d = 2, 4
    q, k, v = (torch.randn(1, n, h, d, generator=g, dtype=torch.float64) for _ in range(3))
    real = torch.ones(1, n, dtype=torch.bool)
    real[0, n - min(padded, n - 1) :] = False
    rotary = rotary_tables(torch.arange(n), d, 10000.0) if rope else None
    rot64 = None if rotary is None else tuple(t.double() for t in rotary)
    got = _routed(q, k, v, real, rot64, bs, cs, m, r, 0.0)[0]
    want = reference(q[0], k[0], v[0], real[0], bs, m, r, rot64, cs)
    torch.testing.assert_close(got[real[0]], want[real[0]], rtol=1e-9, atol=1e-9)
    traced = _routed_traced(q, k, v, real, rot64, bs, cs, m, r)[0]  # the export's graph: every row
    torch.testing.assert_close(traced, got, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("per", [1, 3])
def test_gradients_match_the_reference(per):
    """The backward of the batched form (gathers, the unread summaries' scatter) is the per-query
    reference's, for q, k and v."""
    g = torch.Generator().manual_seed(11)
    n, h, d, bs = 23, 2, 4, 2
    q, k, v = (torch.randn(1, n, h, d, generator=g, dtype=torch.float64) for _ in range(3))
    real = torch.ones(1, n, dtype=torch.bool)
    real[0, 20:] = False
    rot = tuple(t.double() for t in rotary_tables(torch.arange(n), d, 10000.0))
    weight = torch.randn(n, h, d, generator=g, dtype=torch.float64) * real[0, :, None, None]
    grads = []
    for fn in (
        lambda a, b, c: _routed(a, b, c, real, rot, bs, per * bs, 3, 1, 0.0)[0],
        lambda a, b, c: reference(a[0], b[0], c[0], real[0], bs, 3, 1, rot, per * bs),
    ):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        (fn(*leaves) * weight).sum().backward()
        grads.append([t.grad for t in leaves])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


BASE = dict(
    vocab_size=60, max_seq_len=48, hidden_size=16, num_layers=2, num_heads=2,
    intermediate_size=32, k=6, dropout=0.0, attention_dropout=0.0,
)  # fmt: skip


@pytest.mark.parametrize(
    "extra",
    [
        {"routed_blocks": 6},
        {"routed_blocks": 6, "local_window": 8, "positions": "rope"},
        {"routed_blocks": 12, "routed_block": 4, "local_window": 8, "positions": "rope"},
    ],
)
def test_reading_every_block_is_dense_with_the_same_weights(extra):
    """routed_blocks >= blocks: every key once, exactly: the dense model's logits (padding,
    documents); routed blocks of 4 inside the summary blocks of 8 too."""
    dense = LinformerForMaskedLM(ModelConfig(**BASE, projection="dense", **{
        k: v for k, v in extra.items() if k == "positions"})).eval()  # fmt: skip
    routed = LinformerForMaskedLM(ModelConfig(**BASE, projection="routed", **extra)).eval()
    routed.load_state_dict(dense.state_dict())
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 60, (2, 48), generator=g)
    mask = torch.ones(2, 48, dtype=torch.long)
    mask[1, 30:] = 0
    positions = torch.cat([torch.arange(17), torch.arange(31)]).expand(2, 48)
    with torch.no_grad():
        for kw in ({}, {"position_ids": positions}):
            a, b = dense(ids, mask, **kw).logits, routed(ids, mask, **kw).logits
            torch.testing.assert_close(b[mask.bool()], a[mask.bool()], rtol=1e-5, atol=1e-5)


def test_documents_are_isolated_and_gradients_reach_every_weight():
    """A token's output does not change when another document of its row changes; the loss
    reaches every parameter."""
    cfg = ModelConfig(**BASE, projection="routed", routed_blocks=2, local_window=4, routed_block=4)
    model = LinformerForMaskedLM(cfg).eval()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 60, (1, 48), generator=g)
    positions = torch.cat([torch.arange(20), torch.arange(28)])[None]
    other = ids.clone()
    other[0, 20:] = torch.randint(1, 60, (28,), generator=g)
    with torch.no_grad():
        a = model(ids, position_ids=positions).logits[0, :20]
        b = model(other, position_ids=positions).logits[0, :20]
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    model.train()
    model(ids, position_ids=positions).logits.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_refusals_name_the_option():
    with pytest.raises(ValueError, match="model.k: routed layer 0: k=5 does not divide"):
        ModelConfig(**{**BASE, "k": 5}, projection="routed")
    with pytest.raises(ValueError, match="local_window=20 reaches past one block of 8"):
        ModelConfig(**BASE, projection="routed", local_window=20)
    with pytest.raises(ValueError, match="model.routed_block=3 does not divide the summary block"):
        ModelConfig(**BASE, projection="routed", routed_block=3)
    with pytest.raises(ValueError, match="local_window=8 reaches past one block of 2"):
        ModelConfig(**BASE, projection="routed", routed_block=2, local_window=8)
    with pytest.raises(ValueError, match="model.routed_blocks: must be >= 1"):
        ModelConfig(**BASE, projection="routed", routed_blocks=0)
    cfg = ModelConfig(**BASE, projection="routed")
    assert "routed layers under sequence parallelism" in isolation_errors(2, cfg, False)[0]
