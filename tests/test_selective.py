"""The selective kind (each query reads its own best blocks, linformer_ds/model/selective.py):
against an independent per-query reference (values and gradients), its traced form, equal to
dense when every block is read, document isolation and padding, bf16, and its refusals."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from linformer_ds.config import ConfigError, from_dict
from linformer_ds.model import LinformerForMaskedLM, ModelConfig, rotary_tables, rotate
from linformer_ds.model.selective import _selective, _selective_traced
from linformer_ds.parallel.checks import config_errors, isolation_errors
from linformer_ds.resolve import resolve


def reference(q, k, v, real, cs, m, rotary=None):
    """Query by query, head by head: the row in blocks of ``cs`` tokens from its start; a block
    with a real token has a key (value), the mean of its real keys (values), unrotated; the
    query scores those blocks (q . mean K_j / sqrt(d)), reads the real tokens of its ``m`` best
    exactly (rotated keys) and, in one softmax, the means of the blocks it did not read.
    ``q, k, v [n, h, d]``, ``real [n]`` bool."""
    n, h, d = q.shape
    blocks = [
        [s for s in range(j * cs, min(n, (j + 1) * cs)) if real[s]] for j in range(-(-n // cs))
    ]
    blocks = [idx for idx in blocks if idx]  # a block of padding: nothing to score or read
    qr, kr = (q, k) if rotary is None else (rotate(q[None], rotary)[0], rotate(k[None], rotary)[0])
    out = torch.zeros(n, h, d, dtype=torch.float64)
    for head in range(h):
        mk = [k[idx, head].double().mean(0) for idx in blocks]
        mv = [v[idx, head].double().mean(0) for idx in blocks]
        for t in range(n):
            qt = q[t, head].double()
            s_blk = [qt @ key / math.sqrt(d) for key in mk]
            order = sorted(range(len(blocks)), key=lambda j: -float(s_blk[j].detach()))
            read = set(order[:m])
            scores, values = [], []
            for j, idx in enumerate(blocks):
                if j in read:
                    for s in idx:
                        scores.append(qr[t, head].double() @ kr[s, head].double() / math.sqrt(d))
                        values.append(v[s, head].double())
                else:
                    scores.append(s_blk[j])
                    values.append(mv[j])
            p = torch.stack(scores).softmax(0)
            out[t, head] = (p[:, None] * torch.stack(values)).sum(0)
    return out


def _inputs(n, padded, seed, rope, h=2, d=4):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, n, h, d, generator=g, dtype=torch.float64) for _ in range(3))
    real = torch.ones(1, n, dtype=torch.bool)
    real[0, n - min(padded, n - 1) :] = False
    rotary = rotary_tables(torch.arange(n), d, 10000.0) if rope else None
    return q, k, v, real, None if rotary is None else tuple(t.double() for t in rotary)


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(3, 40),
    cs=st.sampled_from([1, 2, 3, 4, 8]),
    m=st.integers(1, 5),
    padded=st.integers(0, 9),
    rope=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_selective_matches_the_per_query_reference(n, cs, m, padded, rope, seed):
    """n not a multiple of the block (a short last block), padding at the row end (whole blocks
    of it too), more blocks read than there are; the traced form (export) equals the eager one
    on every query, padding included (a padding query picks the first blocks in both)."""
    q, k, v, real, rot = _inputs(n, padded, seed, rope)
    got = _selective(q, k, v, real, rot, cs, m, 0.0)[0]
    want = reference(q[0], k[0], v[0], real[0], cs, m, rot)
    torch.testing.assert_close(got[real[0]], want[real[0]], rtol=1e-9, atol=1e-9)
    traced = _selective_traced(q, k, v, real, rot, cs, m)[0]  # padding queries: the same picks
    torch.testing.assert_close(traced, got, rtol=1e-9, atol=1e-9)
    unpadded = _selective(q, k, v, None, rot, cs, m, 0.0)[0]  # no mask: every token real
    want = reference(q[0], k[0], v[0], torch.ones(n, dtype=torch.bool), cs, m, rot)
    torch.testing.assert_close(unpadded, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("cs, m", [(4, 2), (3, 1)])
def test_gradients_match_the_reference(cs, m):
    """The backward of the batched form (the block means, the gathers of the blocks read) is
    the per-query reference's, for q, k and v; and the traced form's."""
    n, h, d = 23, 2, 4
    q, k, v, real, rot = _inputs(n, 3, 11, True, h, d)
    g = torch.Generator().manual_seed(12)
    weight = torch.randn(n, h, d, generator=g, dtype=torch.float64) * real[0, :, None, None]
    grads = []
    for fn in (
        lambda a, b, c: _selective(a, b, c, real, rot, cs, m, 0.0)[0],
        lambda a, b, c: reference(a[0], b[0], c[0], real[0], cs, m, rot),
        lambda a, b, c: _selective_traced(a, b, c, real, rot, cs, m)[0],
    ):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        (fn(*leaves) * weight).sum().backward()
        grads.append([t.grad for t in leaves])
    for got, want, traced in zip(*grads):
        assert want.abs().sum() > 0
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(traced, want, rtol=1e-9, atol=1e-9)


BASE = dict(
    vocab_size=60, max_seq_len=48, hidden_size=16, num_layers=2, num_heads=2,
    intermediate_size=32, k=6, dropout=0.0, attention_dropout=0.0,
)  # fmt: skip


@pytest.mark.parametrize("extra", [{"routed_blocks": 6}, {"routed_blocks": 6, "positions": "rope"}])
def test_reading_every_block_is_dense_with_the_same_weights(extra):
    """routed_blocks >= blocks (of 8 tokens): every key once, exactly: the dense model's logits,
    with padding and with documents (position_ids restarting)."""
    torch.manual_seed(0)
    dense = LinformerForMaskedLM(ModelConfig(**BASE, projection="dense", **{
        k: v for k, v in extra.items() if k == "positions"})).eval()  # fmt: skip
    sel = LinformerForMaskedLM(ModelConfig(**BASE, projection="selective", **extra)).eval()
    sel.load_state_dict(dense.state_dict())
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 60, (2, 48), generator=g)
    mask = torch.ones(2, 48, dtype=torch.long)
    mask[1, 30:] = 0
    positions = torch.cat([torch.arange(17), torch.arange(31)]).expand(2, 48)
    with torch.no_grad():
        for kw in ({}, {"position_ids": positions}):
            a, b = dense(ids, mask, **kw).logits, sel(ids, mask, **kw).logits
            torch.testing.assert_close(b[mask.bool()], a[mask.bool()], rtol=1e-5, atol=1e-5)
        # one block read of six: not dense (the test above is not vacuous)
        one = LinformerForMaskedLM(ModelConfig(**{**BASE, **extra, "routed_blocks": 1},
                                               projection="selective")).eval()  # fmt: skip
        one.load_state_dict(dense.state_dict())
        assert (one(ids, mask).logits - dense(ids, mask).logits).abs().max() > 1e-4


def test_documents_are_isolated_and_gradients_reach_every_weight():
    """A token's output does not change when another document of its row changes (documents of
    20 and 28 tokens: blocks of 8 from each document's start); the loss reaches every
    parameter."""
    cfg = ModelConfig(**BASE, projection="selective", routed_blocks=2, positions="rope")
    torch.manual_seed(0)
    model = LinformerForMaskedLM(cfg).eval()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 60, (1, 48), generator=g)
    positions = torch.cat([torch.arange(20), torch.arange(28)])[None]
    other = ids.clone()
    other[0, 20:] = torch.randint(1, 60, (28,), generator=g)
    with torch.no_grad():
        a = model(ids, position_ids=positions).logits[0]
        b = model(other, position_ids=positions).logits[0]
        whole = model(ids).logits[0]
    torch.testing.assert_close(a[:20], b[:20], rtol=0, atol=1e-6)
    assert (a[20:] - b[20:]).abs().max() > 1e-4  # the changed document did change
    assert (a[:20] - whole[:20]).abs().max() > 1e-4  # and the row as one document differs
    model.train()
    model(ids, position_ids=positions).logits.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_bf16_runs_close_to_fp32():
    """The eager path in bfloat16 on the CPU: forward and backward finite, the output and the
    gradients within bf16's rounding of float32's (measured: output mean 0.0013, max 0.008)."""
    q, k, v, real, rot = _inputs(40, 5, 7, True, h=2, d=16)
    rot32 = tuple(t.float() for t in rot)
    runs = []
    for dtype in (torch.float32, torch.bfloat16):
        leaves = [t.to(dtype).requires_grad_(True) for t in (q, k, v)]
        y = _selective(*leaves, real, rot32, 4, 3, 0.0)
        assert y.dtype == dtype and torch.isfinite(y).all()
        (y.float()[real] ** 2).sum().backward()
        assert all(torch.isfinite(t.grad).all() for t in leaves)
        runs.append([y.float()[real]] + [t.grad.float() for t in leaves])
    for want, got in zip(*runs):
        diff = (got - want).abs()
        assert diff.mean() < 0.02 * want.abs().mean() + 1e-3 and diff.max() < 0.1, diff.max()


def test_refusals_name_the_option():
    """k must divide max_seq_len; sequence parallelism is refused (the kind does not support
    it), at start-up in one line naming the key and the reason."""
    with pytest.raises(ValueError, match="model.k: selective layer 0: k=5 does not divide"):
        ModelConfig(**{**BASE, "k": 5}, projection="selective")
    with pytest.raises(ValueError, match="model.routed_blocks: must be >= 1"):
        ModelConfig(**BASE, projection="selective", routed_blocks=0)
    cfg = ModelConfig(**BASE, layer_projections=["linear", "selective"])
    errors = config_errors(2, world_size=2, seq_len=48, model=cfg)
    assert errors == [
        "parallel.sequence_parallel_size: layer 1: the selective projection does not support "
        "sequence parallelism (its kind is registered without sequence_parallel=True); use P=1"
    ]
    assert "selective layers under sequence parallelism" in isolation_errors(2, cfg, False)[0]
    model = {"max_seq_len": 48, "hidden_size": 16, "num_heads": 2, "num_layers": 2, "k": 6,
             "intermediate_size": 32, "vocab_size": 60,
             "layer_projections": ["linear", "selective"]}  # fmt: skip
    job = from_dict({"model": model, "deepspeed": {"precision": "fp32"},
                     "parallel": {"sequence_parallel_size": 2}})  # fmt: skip
    with pytest.raises(ConfigError) as err:
        resolve(job, 2)
    assert str(err.value) == errors[0] and "\n" not in str(err.value)
