"""Local + global attention (``model.local_window``, the ``local`` and ``dynamic`` kinds) and
rotary positions: exact against independent references, document isolation, bad input."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from linformer_ds.model import (
    LinformerForMaskedLM,
    ModelConfig,
    ModelConfigError,
    flops_per_token,
)
from linformer_ds.model.rotary import rotary_tables, rotate
from linformer_ds.parallel.checks import config_errors

BASE = dict(
    vocab_size=60, max_seq_len=64, hidden_size=32, num_layers=2, num_heads=4,
    intermediate_size=48, dropout=0.0, attention_dropout=0.0, k=8,
)  # fmt: skip
# every kind of layer that has a window or is new, with the sharing modes where each applies
VARIANTS = {
    "linear+window": dict(projection="linear", local_window=8),
    "linear+window/rope/none": dict(projection="linear", local_window=8, positions="rope",
                                    sharing="none"),
    "conv+window/headwise": dict(projection="conv", local_window=6, sharing="headwise"),
    "local": dict(projection="local", local_window=12),
    "modern/rope": dict(num_layers=3, layer_projections=["local", "local", "dense"],
                        local_window=8, positions="rope"),
    "dynamic/kv": dict(projection="dynamic", sharing="kv"),
    "dynamic+window/headwise": dict(projection="dynamic", local_window=8, sharing="headwise"),
    "dense/rope": dict(projection="dense", positions="rope"),
}  # fmt: skip


def model_of(**kw) -> LinformerForMaskedLM:
    torch.manual_seed(0)
    return LinformerForMaskedLM(ModelConfig(**{**BASE, **kw})).eval()


def ids_of(b: int, n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(
        5, BASE["vocab_size"], (b, n), generator=torch.Generator().manual_seed(seed)
    )


# ------------------------------------------------------------------------------------ exactness
@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_local_window_covering_the_row_equals_dense(positions):
    """``local`` with W >= 2N on one document is dense attention with the same weights."""
    dense = model_of(projection="dense", positions=positions)
    local = model_of(projection="local", local_window=64, positions=positions)
    local.load_state_dict(dense.state_dict(), strict=True)  # no parameter of its own
    ids = ids_of(2, 32)
    mask = torch.ones(2, 32, dtype=torch.long)
    mask[1, 21:] = 0
    with torch.no_grad():
        a, b = dense(ids, mask).logits, local(ids, mask).logits
    torch.testing.assert_close(b[0], a[0], rtol=0, atol=2e-6)
    torch.testing.assert_close(b[1, :21], a[1, :21], rtol=0, atol=2e-6)


def _reference_layer(attn, x, mask, rotary, shared=None):
    """One windowed linear layer computed naively: token i's scores against every key j with
    |i - j| <= W/2 that is not padding, and against E K; one softmax over both."""
    b, n, _ = x.shape
    h, d = attn.num_heads, attn.head_dim
    q, k, v = attn.qkv(x).view(b, n, 3, h, d).unbind(2)
    keep = mask[:, :, None, None].float()
    k, v = k * keep, v * keep
    proj = attn.proj_k if attn.proj_k is not None else shared
    e = proj.weight[0, :, :n]  # [k, n] (sharing: one matrix)
    kp, vp = torch.einsum("mn,bnhd->bmhd", e, k), torch.einsum("mn,bnhd->bmhd", e, v)
    qr, kr = (rotate(q, rotary), rotate(k, rotary)) if rotary is not None else (q, k)
    r = attn.config.local_window // 2
    out = torch.zeros(b, n, h, d)
    for bi in range(b):
        for i in range(n):
            js = [j for j in range(max(0, i - r), min(n, i + r + 1)) if mask[bi, j]]
            sw = torch.einsum("hd,jhd->hj", qr[bi, i], kr[bi, js])
            ss = torch.einsum("hd,mhd->hm", q[bi, i], kp[bi])
            p = torch.cat([sw, ss], -1).div(math.sqrt(d)).softmax(-1)
            out[bi, i] = torch.einsum("hj,jhd->hd", p[:, : len(js)], v[bi, js]) + torch.einsum(
                "hm,mhd->hd", p[:, len(js) :], vp[bi]
            )
    return attn.out(out.reshape(b, n, h * d))


@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_window_plus_summaries_against_a_naive_loop(positions):
    model = model_of(projection="linear", local_window=10, positions=positions, sharing="kv")
    attn = model.encoder.layers[0].attention
    n = 29  # not a multiple of the block (W/2 = 5), padded tail
    x = torch.randn(2, n, BASE["hidden_size"])
    mask = torch.ones(2, n, dtype=torch.long)
    mask[1, 17:] = 0
    rotary = rotary_tables(torch.arange(n), attn.head_dim, 10000.0) if positions == "rope" else None
    window = model.encoder._window(2, n, 0, mask, None, x.device)
    from linformer_ds.model.window import LocalContext

    with torch.no_grad():
        got = attn(x, mask, None, None, LocalContext(window, rotary))
        want = _reference_layer(attn, x, mask.bool(), rotary)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=2e-6)
    torch.testing.assert_close(got[1, :17], want[1, :17], rtol=0, atol=2e-6)


def test_rotary_is_a_rotation_with_relative_scores():
    """RoPE keeps norms, and q(i) . k(j) depends on i - j only."""
    d = 8
    q, k = torch.randn(1, 1, 1, d).double(), torch.randn(1, 1, 1, d).double()
    tables = rotary_tables(torch.arange(40), d, 10000.0)
    cos, sin = (t.double() for t in tables)

    def at(x, p):
        return rotate(x, (cos[:, p : p + 1], sin[:, p : p + 1]))

    torch.testing.assert_close(at(q, 7).norm(), q.norm())
    s1 = (at(q, 12) * at(k, 5)).sum()
    s2 = (at(q, 30) * at(k, 23)).sum()
    torch.testing.assert_close(s1, s2)


def test_dynamic_projection_against_its_formula():
    """Summaries = softmax over the row's real positions of (x w), times x."""
    model = model_of(projection="dynamic", sharing="headwise")
    proj = model.encoder.layers[0].attention.proj_k
    x = torch.randn(2, 20, BASE["num_heads"], BASE["hidden_size"] // BASE["num_heads"])
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1, 13:] = False
    with torch.no_grad():
        got = proj(x, mask=mask)
        for bi, n in ((0, 20), (1, 13)):
            scores = torch.einsum("nhd,dk->nhk", x[bi, :n], proj.weight[0])
            want = torch.einsum("nhk,nhd->khd", scores.softmax(0), x[bi, :n])
            torch.testing.assert_close(got[bi], want, rtol=0, atol=2e-6)


# ---------------------------------------------------------------------------- document isolation
@settings(max_examples=12, deadline=None)
@given(
    variant=st.sampled_from(sorted(VARIANTS)),
    lengths=st.lists(st.integers(3, 21), min_size=2, max_size=3),
    pad=st.integers(0, 5),
    per_span=st.booleans(),
)
def test_a_document_alone_equals_it_packed_with_others(variant, lengths, pad, per_span):
    """A document's outputs do not change when other documents (and padding) share its row."""
    model = model_of(**VARIANTS[variant])
    model.encoder.document_per_span = per_span
    n = sum(lengths) + pad
    ids = ids_of(1, n, seed=len(lengths) + pad)
    mask = torch.ones(1, n, dtype=torch.long)
    if pad:
        mask[0, -pad:] = 0
    pos = torch.zeros(1, n, dtype=torch.long)
    pos[0, : sum(lengths)] = torch.cat([torch.arange(m) for m in lengths])
    with torch.no_grad():
        packed = model(ids, mask, position_ids=pos).logits
        start = 0
        for m in lengths:
            alone = model(ids[:, start : start + m]).logits
            torch.testing.assert_close(packed[:, start : start + m], alone, rtol=0, atol=3e-5)
            start += m


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_variant_trains_one_step_with_checkpointing(variant):
    """Forward and backward under activation checkpointing equal the plain run."""
    import functools

    import torch.utils.checkpoint

    ids = ids_of(2, 40)
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[0, 33:] = 0
    labels = torch.where(
        torch.rand(2, 40, generator=torch.Generator().manual_seed(3)) < 0.3, ids, -100
    )
    grads = []
    for ckpt in (False, True):
        model = model_of(**VARIANTS[variant]).train()
        if ckpt:
            fn = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
            model.encoder.set_activation_checkpointing(fn, granularity="sublayer")
        model(ids, mask, labels=labels).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------- sizes
def test_flops_count_the_window_and_parameters_the_kind():
    lin = ModelConfig(**BASE, projection="linear")
    win = ModelConfig(**BASE, projection="linear", local_window=16)
    n, dm = 64, BASE["hidden_size"]
    extra = flops_per_token(win, n) - flops_per_token(lin, n)
    assert extra == pytest.approx(3 * BASE["num_layers"] * 2 * 2 * 17 * dm)
    local = ModelConfig(**BASE, projection="local", local_window=16)
    assert local.num_projection_parameters() == 0
    assert len(model_of(projection="local", local_window=16).state_dict()) == len(
        model_of(projection="dense").state_dict()
    )
    dyn = ModelConfig(**BASE, projection="dynamic", sharing="headwise")
    d_h = BASE["hidden_size"] // BASE["num_heads"]
    assert dyn.num_projection_parameters() == BASE["num_layers"] * 2 * d_h * BASE["k"]
    rope = model_of(projection="dense", positions="rope")
    assert rope.encoder.position_embeddings is None
    assert not any("position" in k for k in rope.state_dict())


# ------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "options, key",
    [
        (dict(projection="linear", local_window=7), "model.local_window: must be even"),
        (dict(projection="linear", local_window=66), "model.local_window: 66 is wider"),
        (
            dict(projection="dense", local_window=8),
            "model.local_window: applies to the layers of windowed kinds",
        ),
        (
            dict(projection="local"),
            "model.projection: the 'local' kind attends through the sliding window",
        ),
        (
            dict(projection="dynamic", freeze_projection=True),
            "model.freeze_projection: the 'dynamic'",
        ),
        (dict(positions="alibi"), "model.positions: must be one of"),
        (dict(positions="rope", hidden_size=36, num_heads=4), "model.positions: rope rotates"),
        (dict(projection="linear", local_window=-2), "model.local_window: must be >= 0"),
    ],
)
def test_bad_window_options_one_line_naming_the_key(options, key):
    with pytest.raises(ModelConfigError) as e:
        ModelConfig(**{**BASE, **options})
    assert str(e.value).startswith(key) and "\n" not in str(e.value)


def test_window_wider_than_a_sequence_parallel_slice_is_refused():
    model = ModelConfig(**{**BASE, "projection": "linear", "local_window": 40})
    errors = config_errors(4, model=model, seq_len=64, world_size=4)
    assert any("local_window 40" in e and "<= 32" in e for e in errors), errors
    dyn = ModelConfig(**{**BASE, "projection": "dynamic"})
    assert any(
        "dynamic projection does not support" in e
        for e in config_errors(2, model=dyn, seq_len=64, world_size=2)
    )


def test_windowed_model_exports_to_onnx_with_equal_outputs(tmp_path):
    """torch.export (dynamic batch and length) -> ONNX -> onnxruntime equals PyTorch for a
    ModernBERT-like schedule with a window, summaries and rotary positions (padding included)."""
    import numpy as np
    import onnxruntime as ort

    from linformer_ds.onnx_export import _size_oblivious

    model = model_of(
        num_layers=3, layer_projections=["local", "linear", "dense"], local_window=8,
        positions="rope",
    )  # fmt: skip

    class Logits(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, ids, mask):
            return (self.m(ids, mask).logits,)

    ids, mask = ids_of(2, 33), torch.ones(2, 33, dtype=torch.long)
    batch, seq = torch.export.Dim("batch", min=1), torch.export.Dim("seq", min=2, max=64)
    with torch.no_grad(), _size_oblivious():
        program = torch.export.export(
            Logits(model), (ids, mask), dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}),
            strict=False,
        )  # fmt: skip
        onnx = torch.onnx.export(program, (ids, mask), dynamo=True, verbose=False)
    onnx.save(str(tmp_path / "m.onnx"))
    session = ort.InferenceSession(str(tmp_path / "m.onnx"))
    for b, n in ((1, 7), (3, 64), (2, 40)):
        ids, mask = ids_of(b, n, seed=n), torch.ones(b, n, dtype=torch.long)
        mask[-1, n // 2 :] = 0
        with torch.no_grad():
            want = model(ids, mask).logits.numpy()
        names = [i.name for i in session.get_inputs()]
        got = session.run(None, dict(zip(names, (ids.numpy(), mask.numpy()))))[0]
        assert float(np.abs(got - want).max()) < 1e-5, (b, n)
