"""Model math against independent float64 references, sharing-mode parameter formulas,
padding invariance, length limits, gradients, memory at N = 16384, and a property test."""

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from linformer_ds.model import (
    ConvProjection,
    LinearProjection,
    LinformerEncoder,
    LinformerForMaskedLM,
    LinformerForSequenceClassification,
    LinformerSelfAttention,
    ModelConfig,
    ModelConfigError,
)


def tiny(**kw) -> ModelConfig:
    base = dict(
        vocab_size=50,
        max_seq_len=32,
        hidden_size=16,
        num_layers=2,
        num_heads=2,
        intermediate_size=32,
        k=8,
        dropout=0.0,
        attention_dropout=0.0,
        sharing="none",
    )
    base.update(kw)
    return ModelConfig(**base)


# ============================================================================ naive reference
def projection_matrices(attn: LinformerSelfAttention, shared, head: int):
    """(E_h, F_h) or (conv weight, conv bias) for keys and values of one head."""
    if attn.kind == "linear":
        pk = attn.proj_k if attn.proj_k is not None else shared
        pv = attn.proj_v if attn.proj_v is not None else pk
        hk = head if pk.weight.shape[0] > 1 else 0
        return pk.weight[hk], pv.weight[hk]
    pk = attn.proj_k if attn.proj_k is not None else shared
    pv = attn.proj_v if attn.proj_v is not None else pk
    hk = head if pk.weight.shape[0] > 1 else 0
    return (pk.weight[hk], pk.bias[hk]), (pv.weight[hk], pv.bias[hk])


def naive_attention(attn: LinformerSelfAttention, x, mask=None, shared=None):
    """Per-sample, per-head loops in float64: softmax(Q (E K)^T / sqrt(d)) (F V) and friends."""
    x = x.double()
    b, n, dm = x.shape
    h, d = attn.num_heads, attn.head_dim
    w, bias = attn.qkv.weight.double(), attn.qkv.bias.double()
    qkv = x @ w.T + bias
    q_all, k_all, v_all = qkv[..., :dm], qkv[..., dm : 2 * dm], qkv[..., 2 * dm :]
    out = torch.zeros(b, n, dm, dtype=torch.float64)
    for s in range(b):
        m = mask[s].bool() if mask is not None else torch.ones(n, dtype=torch.bool)
        for hd in range(h):
            sl = slice(hd * d, (hd + 1) * d)
            q, k, v = q_all[s, :, sl], k_all[s, :, sl].clone(), v_all[s, :, sl].clone()
            k[~m] = 0.0
            v[~m] = 0.0
            if attn.kind == "dense":
                scores = q @ k.T / math.sqrt(d)
                scores[:, ~m] = float("-inf")
                vp = v
            elif attn.kind == "linear":
                e, f = projection_matrices(attn, shared, hd)
                kp, vp = e.double()[:, :n] @ k, f.double()[:, :n] @ v
                scores = q @ kp.T / math.sqrt(d)
            else:
                (wk, bk), (wv, bv) = projection_matrices(attn, shared, hd)
                r = wk.shape[-1]
                pad = (-n) % r
                kp = F.conv1d(F.pad(k.T, (0, pad))[None], wk.double(), bk.double(), stride=r)[0].T
                vp = F.conv1d(F.pad(v.T, (0, pad))[None], wv.double(), bv.double(), stride=r)[0].T
                blocks = F.pad(m, (0, pad)).view(-1, r).any(-1)
                scores = q @ kp.T / math.sqrt(d)
                scores[:, ~blocks] = float("-inf")
            out[s, :, sl] = torch.softmax(scores, -1) @ vp
    return out @ attn.out.weight.double().T + attn.out.bias.double()


def shared_of(enc: LinformerEncoder, layer: int):
    return enc._shared_for(enc.layers[layer])


# ====================================================================================== math
@pytest.mark.parametrize("kind", ["dense", "linear", "conv"])
@pytest.mark.parametrize("sharing", ["none", "headwise", "kv", "layerwise"])
def test_attention_equals_naive_float64(kind, sharing):
    torch.manual_seed(0)
    cfg = tiny(projection=kind, sharing=sharing)
    enc = LinformerEncoder(cfg).double()
    attn = enc.layers[1].attention
    x = torch.randn(3, 24, cfg.hidden_size, dtype=torch.float64)
    mask = torch.ones(3, 24, dtype=torch.long)
    mask[1, 17:] = 0
    mask[2, 5:] = 0
    shared = shared_of(enc, 1)
    for m in (None, mask):
        got = attn(x, m, shared)
        ref = naive_attention(attn, x, m, shared)
        assert torch.allclose(got, ref, atol=1e-10), (got - ref).abs().max()


def test_linear_with_identity_projection_equals_dense():
    torch.manual_seed(1)
    n = 16
    lin = LinformerSelfAttention(tiny(max_seq_len=n, k=n, projection="linear", sharing="headwise"))
    dense = LinformerSelfAttention(tiny(max_seq_len=n, k=n, projection="dense"))
    dense.load_state_dict({k: v for k, v in lin.state_dict().items() if "proj" not in k})
    with torch.no_grad():
        lin.proj_k.weight.copy_(torch.eye(n)[None])
        lin.proj_v.weight.copy_(torch.eye(n)[None])
    lin, dense = lin.double(), dense.double()
    x = torch.randn(2, n, 16, dtype=torch.float64)
    assert torch.allclose(lin(x), dense(x), atol=1e-12)
    ref = naive_attention(dense, x)
    assert torch.allclose(dense(x), ref, atol=1e-12)


def test_conv_projection_equals_conv1d():
    torch.manual_seed(2)
    for heads in (1, 3):
        proj = ConvProjection(stride=4, head_dim=5, heads=heads, frozen=False).double()
        with torch.no_grad():
            proj.bias.normal_()
        x = torch.randn(2, 13, 3, 5, dtype=torch.float64)  # n=13 is padded to 16
        y = proj(x)
        assert y.shape == (2, 4, 3, 5)
        for hd in range(3):
            w, b = proj.weight[hd % heads], proj.bias[hd % heads]
            inp = F.pad(x[:, :, hd].transpose(1, 2), (0, 3))
            ref = F.conv1d(inp, w, b, stride=4).transpose(1, 2)
            assert torch.allclose(y[:, :, hd], ref, atol=1e-12)


def test_linear_projection_slices_first_n_columns():
    proj = LinearProjection(k=4, max_seq_len=10, heads=1, init_std=1.0, frozen=False).double()
    x = torch.randn(1, 6, 2, 3, dtype=torch.float64)
    ref = torch.einsum("kn,bnhd->bkhd", proj.weight[0, :, :6], x)
    assert torch.allclose(proj(x), ref, atol=1e-12)


# ================================================================================ parameters
def _formula(cfg: ModelConfig) -> int:
    """Parameter count written out from the architecture, independently of the model code."""
    D, L, V, N, ff = (
        cfg.hidden_size,
        cfg.num_layers,
        cfg.vocab_size,
        cfg.max_seq_len,
        cfg.intermediate_size,
    )
    h, d = cfg.num_heads, cfg.hidden_size // cfg.num_heads
    per_layer = (3 * D * D + 3 * D) + (D * D + D) + (D * ff + ff) + (ff * D + D) + 4 * D
    emb = V * D + N * D + 2 * D
    final_ln = 2 * D if cfg.norm == "pre" else 0
    head = D * D + D + 2 * D + V  # dense, LN, decoder bias (decoder weight tied)
    proj = 0
    lin = [i for i, p in enumerate(cfg.projection_schedule()) if p == "linear"]
    conv = [i for i, p in enumerate(cfg.projection_schedule()) if p == "conv"]
    kk = cfg.k
    one_lin, one_conv = kk * N, d * d * (N // kk) + d
    mult = {"none": 2 * h, "headwise": 2, "kv": 1}
    if cfg.sharing == "layerwise":
        proj = (one_lin if lin else 0) + (one_conv if conv else 0)
    else:
        proj = mult[cfg.sharing] * (len(lin) * one_lin + len(conv) * one_conv)
    return emb + L * per_layer + final_ln + head + proj


@pytest.mark.parametrize("projection", ["linear", "conv", "hybrid", "dense"])
@pytest.mark.parametrize("sharing", ["none", "headwise", "kv", "layerwise"])
def test_parameter_counts_match_formulas(projection, sharing):
    cfg = tiny(projection=projection, sharing=sharing, num_layers=4, hybrid_linear_layers=2)
    model = LinformerForMaskedLM(cfg)
    assert model.num_parameters() == _formula(cfg)
    assert cfg.num_projection_parameters() == _formula(cfg) - _formula(
        tiny(projection="dense", num_layers=4)
    )
    expected_lin = {
        "none": 4 * 2 * 2 * 8 * 32,
        "headwise": 4 * 2 * 8 * 32,
        "kv": 4 * 8 * 32,
        "layerwise": 8 * 32,
    }
    if projection == "linear":
        assert cfg.num_projection_parameters() == expected_lin[sharing]


def test_layerwise_projection_has_one_owner():
    model = LinformerForMaskedLM(tiny(projection="hybrid", sharing="layerwise", num_layers=4))
    names = [n for n, _ in model.named_parameters() if "shared" in n or "proj" in n]
    assert sorted(names) == [
        "encoder.shared_conv.bias",
        "encoder.shared_conv.weight",
        "encoder.shared_linear.weight",
    ]


# ========================================================================== padding, lengths
@pytest.mark.parametrize("projection", ["linear", "conv", "dense", "hybrid"])
@pytest.mark.parametrize("sharing", ["none", "kv", "layerwise"])
def test_padding_invariance(projection, sharing):
    torch.manual_seed(3)
    cfg = tiny(projection=projection, sharing=sharing, num_layers=3, hybrid_linear_layers=1)
    model = LinformerForMaskedLM(cfg).double().eval()
    ids = torch.randint(5, 50, (1, 13))
    ref = model(ids).logits
    for total in (14, 16, 21, 32):
        padded = torch.cat([ids, torch.zeros(1, total - 13, dtype=torch.long)], 1)
        mask = (torch.arange(total) < 13).long()[None]
        got = model(padded, mask).logits[:, :13]
        assert torch.allclose(got, ref, atol=1e-10), (projection, total, (got - ref).abs().max())


def test_batch_with_different_lengths_matches_single_sequences():
    torch.manual_seed(4)
    model = (
        LinformerForMaskedLM(tiny(projection="hybrid", num_layers=2, hybrid_linear_layers=1))
        .double()
        .eval()
    )
    a, b = torch.randint(5, 50, (1, 20)), torch.randint(5, 50, (1, 9))
    batch = torch.zeros(2, 20, dtype=torch.long)
    batch[0], batch[1, :9] = a[0], b[0]
    mask = torch.zeros(2, 20, dtype=torch.long)
    mask[0], mask[1, :9] = 1, 1
    out = model(batch, mask).logits
    assert torch.allclose(out[0], model(a).logits[0], atol=1e-10)
    assert torch.allclose(out[1, :9], model(b).logits[0], atol=1e-10)


def test_lengths_and_input_errors():
    model = LinformerForMaskedLM(tiny(projection="conv", k=8))
    assert model(torch.randint(0, 50, (2, 7))).logits.shape == (2, 7, 50)  # n < N_max, padded conv
    with pytest.raises(ValueError, match="sequence length 33 exceeds the model's max_seq_len 32"):
        model(torch.randint(0, 50, (1, 33)))
    with pytest.raises(TypeError, match="integer tensor"):
        model(torch.rand(1, 4))
    with pytest.raises(ValueError, match=r"attention_mask shape \(1, 3\) does not match"):
        model(torch.randint(0, 50, (1, 4)), torch.ones(1, 3))
    with pytest.raises(ValueError, match=r"token id 50 outside the vocabulary \[0, 50\)"):
        model(torch.tensor([[1, 50]]))
    with pytest.raises(ValueError, match=r"token id -1 outside the vocabulary"):
        model(torch.tensor([[-1, 3]]))
    with pytest.raises(ValueError, match=r"\[batch, seq_len\]"):
        model(torch.randint(0, 50, (4,)))


def test_config_errors_name_the_field():
    cases = [
        (dict(k=64), "model.k: k=64 must be in"),
        (dict(projection="conv", k=5), "model.k: conv layer 0: k=5 does not divide max_seq_len=32"),
        (dict(hidden_size=15), "model.hidden_size: 15 is not divisible by num_heads=2"),
        (dict(sharing="weird"), "model.sharing: must be one of"),
        (dict(layer_projections=["linear"]), "model.layer_projections: has 1 entries"),
        (
            dict(sharing="layerwise", layer_k=[8, 4]),
            "model.layer_k: sharing='layerwise' needs one k",
        ),
    ]
    for kw, msg in cases:
        with pytest.raises(ModelConfigError, match=msg.replace("[", r"\[").replace("(", r"\(")):
            tiny(**kw)


# ====================================================================== schedule, gradients
def test_hybrid_schedule_and_per_layer_k():
    cfg = tiny(
        projection="hybrid",
        num_layers=5,
        hybrid_linear_layers=2,
        sharing="headwise",
        layer_k=[8, 4, 16, 8, 4],
    )
    enc = LinformerEncoder(cfg)
    kinds = [layer.attention.kind for layer in enc.layers]
    assert kinds == ["linear", "linear", "conv", "conv", "conv"]
    assert isinstance(enc.layers[0].attention.proj_k, LinearProjection)
    assert enc.layers[1].attention.proj_k.weight.shape == (1, 4, 32)
    strides = [enc.layers[i].attention.proj_k.stride for i in (2, 3, 4)]
    assert strides == [2, 4, 8]
    custom = LinformerEncoder(tiny(layer_projections=["dense", "conv"]))
    assert [la.attention.kind for la in custom.layers] == ["dense", "conv"]
    assert custom.layers[0].attention.proj_k is None


@pytest.mark.parametrize("frozen", [False, True])
def test_gradients_reach_projections_unless_frozen(frozen):
    torch.manual_seed(5)
    cfg = tiny(
        projection="hybrid", sharing="layerwise", hybrid_linear_layers=1, freeze_projection=frozen
    )
    model = LinformerForMaskedLM(cfg)
    ids = torch.randint(5, 50, (2, 32))
    labels = ids.clone()
    model(ids, labels=labels).loss.backward()
    for p in (model.encoder.shared_linear.weight, model.encoder.shared_conv.weight):
        if frozen:
            assert not p.requires_grad and p.grad is None
        else:
            assert p.grad is not None and p.grad.abs().sum() > 0
    assert model.encoder.token_embeddings.weight.grad.abs().sum() > 0


def test_mlm_loss_and_classification_heads():
    torch.manual_seed(6)
    cfg = tiny(projection="linear", sharing="kv", num_labels=3)
    mlm = LinformerForMaskedLM(cfg).eval()
    ids = torch.randint(5, 50, (2, 10))
    labels = torch.full_like(ids, -100)
    labels[0, 3], labels[1, 7] = 11, 22
    out = mlm(ids, labels=labels)
    full = mlm(ids).logits
    ref = F.cross_entropy(torch.stack([full[0, 3], full[1, 7]]), torch.tensor([11, 22]))
    assert torch.allclose(out.loss, ref, atol=1e-6)
    assert mlm.lm_head.decoder.weight is mlm.encoder.token_embeddings.weight
    clf = LinformerForSequenceClassification(cfg).eval()
    res = clf(ids, labels=torch.tensor([0, 2]))
    assert res.logits.shape == (2, 3)
    assert torch.allclose(res.loss, F.cross_entropy(res.logits, torch.tensor([0, 2])), atol=1e-6)


def test_activation_checkpointing_hook_gives_same_gradients():
    import functools

    torch.manual_seed(7)
    cfg = tiny(projection="hybrid", sharing="layerwise", num_layers=3, hybrid_linear_layers=2)
    model = LinformerForMaskedLM(cfg)
    ids = torch.randint(5, 50, (2, 32))
    model(ids, labels=ids).loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ck = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    model.encoder.set_activation_checkpointing(ck)
    model(ids, labels=ids).loss.backward()
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, ref[n], atol=1e-6), n


def test_flops_per_token_formula():
    cfg = tiny(projection="linear", num_layers=1)
    D, ff, k, V = 16, 32, 8, 50
    fwd = 2 * (4 * D * D + 2 * D * ff) + 8 * k * D + 0.15 * 2 * (D * D + D * V)
    assert LinformerForMaskedLM(cfg).flops_per_token(32, mlm_fraction=0.15) == pytest.approx(
        3 * fwd
    )
    dense = tiny(projection="dense", num_layers=1)
    assert LinformerForMaskedLM(dense).flops_per_token(32, 0.0) == pytest.approx(
        3 * (2 * (4 * D * D + 2 * D * ff) + 4 * 32 * D)
    )


# ===================================================================================== memory
def test_linear_mode_at_16k_stays_far_below_an_n_by_n_tensor():
    """Forward+backward at N = 16384 in a fresh process: peak RSS growth < 400 MiB, while one
    fp32 N x N score tensor per head would need 1 GiB."""
    code = textwrap.dedent(
        """
        import resource, torch
        from linformer_ds.model import LinformerForMaskedLM, ModelConfig
        torch.manual_seed(0)
        cfg = ModelConfig(vocab_size=100, max_seq_len=16384, hidden_size=64, num_layers=2,
                          num_heads=2, intermediate_size=128, k=64, sharing="headwise")
        model = LinformerForMaskedLM(cfg)
        ids = torch.randint(5, 100, (1, 16384))
        labels = torch.where(torch.rand(1, 16384) < 0.15, ids, torch.full_like(ids, -100))
        model(ids[:, :64], labels=labels[:, :64]).loss.backward()  # warm up allocator/threads
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        model(ids, labels=labels).loss.backward()
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print((after - before) * 1024)
        """
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr
    growth = int(out.stdout.strip().splitlines()[-1])
    assert growth < 400 * 2**20, f"peak RSS grew by {growth / 2**20:.0f} MiB"


# ============================================================================ property test
@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(["linear", "conv", "dense"]),
    sharing=st.sampled_from(["none", "headwise", "kv", "layerwise"]),
    heads=st.sampled_from([1, 2, 4]),
    head_dim=st.integers(1, 6),
    log_k=st.integers(0, 4),
    n_max_mult=st.integers(1, 3),
    batch=st.integers(1, 3),
    data=st.data(),
)
def test_property_attention_matches_reference(
    kind, sharing, heads, head_dim, log_k, n_max_mult, batch, data
):
    k = 2**log_k
    n_max = k * n_max_mult * 2
    cfg = tiny(
        hidden_size=heads * head_dim,
        num_heads=heads,
        max_seq_len=n_max,
        k=k,
        projection=kind,
        sharing=sharing,
        num_layers=1,
    )
    torch.manual_seed(data.draw(st.integers(0, 10_000)))
    enc = LinformerEncoder(cfg).double()
    attn = enc.layers[0].attention
    n = data.draw(st.integers(1, n_max))
    x = torch.randn(batch, n, cfg.hidden_size, dtype=torch.float64)
    lengths = [data.draw(st.integers(1, n)) for _ in range(batch)]
    mask = (torch.arange(n)[None] < torch.tensor(lengths)[:, None]).long()
    shared = shared_of(enc, 0)
    got = attn(x, mask, shared)
    ref = naive_attention(attn, x, mask, shared)
    for s, length in enumerate(lengths):
        assert torch.allclose(got[s, :length], ref[s, :length], atol=1e-9)


# ----------------------------------------------------------------------------- projection_init
@settings(max_examples=25, deadline=None)
@given(
    n_max=st.integers(1, 64), k=st.integers(1, 16), heads=st.integers(1, 3),
    n=st.integers(1, 64), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_pooling_init_projects_window_means(n_max, k, heads, n, seed):
    """``projection_init=pooling``: summary j of an input of n <= N_max positions is the mean of
    the positions p < n with floor(p k / N_max) = j, divided by the window's full width (the
    first-columns slicing of a shorter input keeps E's weights); empty windows give zeros."""
    n = min(n, n_max)
    proj = LinearProjection(k, n_max, heads, 0.1, frozen=False, init="pooling")
    x = torch.randn(2, n, heads, 3, generator=torch.Generator().manual_seed(seed),
                    dtype=torch.float64)  # fmt: skip
    got = proj.double()(x)
    want = torch.zeros(2, k, heads, 3, dtype=torch.float64)
    width = [sum(1 for p in range(n_max) if p * k // n_max == j) for j in range(k)]
    for p in range(n):
        want[:, p * k // n_max] += x[:, p] / width[p * k // n_max]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)  # E was built in fp32


def test_pooling_init_conv_is_block_mean():
    """Conv pooling init: each block's output is the mean of its r positions (avg_pool1d)."""
    proj = ConvProjection(stride=4, head_dim=5, heads=2, frozen=False, init="pooling")
    x = torch.randn(3, 16, 2, 5)
    want = F.avg_pool1d(x.permute(0, 2, 3, 1).reshape(6, 5, 16), 4).reshape(3, 2, 5, 4)
    torch.testing.assert_close(proj(x), want.permute(0, 3, 1, 2), rtol=1e-6, atol=1e-6)


def test_projection_init_option():
    """Every model built with ``pooling`` holds pooling E/F; an unknown value names the key."""
    model = LinformerForMaskedLM(tiny(projection_init="pooling", projection="hybrid"))
    linear = [m for m in model.modules() if isinstance(m, LinearProjection)]
    conv = [m for m in model.modules() if isinstance(m, ConvProjection)]
    assert linear and conv
    for m in linear:
        assert torch.equal(m.weight.sum(-1), torch.ones_like(m.weight.sum(-1)))
        assert int((m.weight > 0).sum()) == m.heads * m.max_seq_len
    with pytest.raises(ModelConfigError, match="model.projection_init"):
        tiny(projection_init="identity")


@pytest.mark.parametrize("n,d", [(7, 16), (33, 9), (1, 2)])
def test_sinusoidal_positions_match_the_formula(n, d):
    """The table against Vaswani et al.'s formula evaluated here with math, odd widths too."""
    from linformer_ds.model import sinusoidal_positions

    got = sinusoidal_positions(n, d)
    assert got.shape == (n, d) and got.dtype == torch.float32
    for p in range(n):
        for c in range(d):
            angle = p / 10000 ** ((c - c % 2) / d)
            want = math.sin(angle) if c % 2 == 0 else math.cos(angle)
            assert float(got[p, c]) == pytest.approx(want, abs=1e-6)


def test_position_init_option():
    """``sinusoidal``: the learned table starts as the sin/cos table at RMS initializer_range,
    in the project's and the Hugging Face classes alike, and stays a trained parameter;
    ``normal`` keeps N(0, std); an unknown value names the key."""
    from linformer_ds.hf.configuration_linformer import LinformerConfig
    from linformer_ds.hf.modeling_linformer import LinformerForMaskedLM as HFMaskedLM
    from linformer_ds.model import sinusoidal_positions

    cfg = tiny(position_init="sinusoidal", initializer_range=0.05)
    want = sinusoidal_positions(32, 16) * (0.05 * math.sqrt(2.0))
    model = LinformerForMaskedLM(cfg)
    table = model.encoder.position_embeddings.weight
    assert torch.allclose(table, want, atol=1e-7) and table.requires_grad
    assert float(table.detach().pow(2).mean().sqrt()) == pytest.approx(0.05, rel=0.02)
    hf = HFMaskedLM(LinformerConfig(**cfg.to_dict()))
    assert torch.allclose(hf.encoder.position_embeddings.weight, want, atol=1e-7)
    plain = LinformerForMaskedLM(tiny()).encoder.position_embeddings.weight
    assert not torch.allclose(plain, sinusoidal_positions(32, 16) * (0.02 * math.sqrt(2.0)))
    with pytest.raises(ModelConfigError, match="model.position_init"):
        tiny(position_init="rotary")
    with pytest.raises(ModelConfigError, match="model.output_bias_init"):
        tiny(output_bias_init="ones")
