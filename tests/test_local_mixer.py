"""The local token mixer (``model.local_mixer``: embed / layers, issue 29): a depthwise
convolution over the sequence that never reads another document or padding.

Checked against independent references: torch's depthwise ``conv1d`` (one document, no
padding); a packed row with ``position_ids`` equal to its documents run alone (outputs, loss and
every gradient, fp32, 1e-6) for every schedule and both mixer placements (hypothesis draws the
document lengths and padding); the Hugging Face export equal to the training model; bad options
refused with the field named. Sequence parallelism (the halo rows from the neighbouring ranks)
is checked in tests/test_sequence_parallel.py and tests/test_isolation_sp.py."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from linformer_ds.model import (
    LinformerForMaskedLMPretraining,
    LocalMixer,
    LocalMixing,
    ModelConfig,
    ModelConfigError,
    local_mixer_valid,
)
from tests.test_isolation import (
    check_export_on_packed_row,
    check_packed_equals_alone,
    rows_strategy,
)


def mixer_config(
    projection: str, mixer: str, kernel: int, sharing: str = "layerwise"
) -> ModelConfig:
    return ModelConfig(
        vocab_size=40, max_seq_len=32, hidden_size=16, num_layers=3, num_heads=2,
        intermediate_size=24, k=4, dropout=0.0, attention_dropout=0.0, sharing=sharing,
        projection=projection, local_mixer=mixer, local_mixer_kernel=kernel,
    )  # fmt: skip


def make_model(projection: str, mixer: str, kernel: int, sharing: str = "layerwise"):
    torch.manual_seed(0)
    model = LinformerForMaskedLMPretraining(mixer_config(projection, mixer, kernel, sharing))
    with torch.no_grad():  # non-zero biases (padding matters) and mixer weights of order 1
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(std=0.1)
            if "mixer" in name:
                p.normal_(std=0.5)
    return model


@pytest.mark.parametrize("kernel", [1, 3, 5, 7])
def test_mixer_equals_depthwise_conv1d(kernel):
    """One document per row, no padding: torch's depthwise conv1d with zero padding; padding
    tokens read as zeros (their rows zeroed in the reference)."""
    torch.manual_seed(kernel)
    b, n, d = 3, 11, 8
    mixer = LocalMixer(d, kernel)
    torch.nn.init.normal_(mixer.weight)
    x = torch.randn(b, n, d)
    r = kernel // 2
    ref = F.conv1d(x.transpose(1, 2), mixer.weight.t()[:, None, :], padding=r, groups=d)
    got = mixer(x, LocalMixing(local_mixer_valid(r, n, b, None, None, x.device)))
    assert (got - ref.transpose(1, 2)).abs().max() <= 1e-6
    mask = torch.ones(b, n, dtype=torch.long)
    mask[0, 7:] = 0
    mask[2, 3:] = 0
    zeroed = x * mask[..., None]
    ref = F.conv1d(zeroed.transpose(1, 2), mixer.weight.t()[:, None, :], padding=r, groups=d)
    got = mixer(x, LocalMixing(local_mixer_valid(r, n, b, mask, None, x.device)))
    real = mask.bool()
    assert (got - ref.transpose(1, 2))[real].abs().max() <= 1e-6


def test_valid_never_crosses_documents():
    """Documents of 3, 1 and 4 tokens, then 2 padding: token i reads i + o only inside its
    document and never padding."""
    pos = torch.tensor([[0, 1, 2, 0, 0, 1, 2, 3, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1, 0, 0]])
    valid = local_mixer_valid(2, 10, 1, mask, pos, pos.device)
    doc = [0, 0, 0, 1, 2, 2, 2, 2, 2, 2]  # padding joins the document before it
    for j, o in enumerate(range(-2, 3)):
        for i in range(10):
            want = 0 <= i + o < 10 and doc[i + o] == doc[i] and bool(mask[0, i + o])
            assert bool(valid[j, 0, i]) == want, (o, i)


CASES = [(p, m, k) for p in ("linear", "conv", "hybrid", "dense") for m in ("embed", "layers")
         for k in (3,)] + [("linear", "layers", 5), ("linear", "embed", 7)]  # fmt: skip


@pytest.mark.parametrize("projection,mixer,kernel", CASES)
@settings(max_examples=4, deadline=None, derandomize=True, phases=[Phase.generate])
@given(rows=rows_strategy(), seed=st.integers(0, 2**16))
def test_packed_row_equals_documents_alone(projection, mixer, kernel, rows, seed):
    check_packed_equals_alone(make_model(projection, mixer, kernel), rows, seed)


@pytest.mark.parametrize("sharing", ["none", "headwise", "kv"])
def test_packed_row_equals_alone_other_sharing(sharing):
    model = make_model("linear", "layers", 3, sharing)
    check_packed_equals_alone(model, [([5, 11, 3], 5, True), ([1, 23], 0, False)], seed=1)


@pytest.mark.parametrize("mixer", ["embed", "layers"])
def test_mixer_changes_the_model_and_is_trained(mixer):
    """The mixer is on the forward path (outputs move with its weights) and gets gradients."""
    model = make_model("linear", mixer, 3)
    ids = torch.randint(4, 40, (2, 24))
    labels = ids.clone()
    out = model(ids, labels=labels)
    out.loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "mixer" in n]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)
    before = model.encoder(ids).detach()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "mixer" in n:
                p.zero_()
    assert (model.encoder(ids) - before).abs().max() > 1e-3


def test_no_mixer_means_no_new_parameters():
    names = [n for n, _ in make_model("linear", "none", 3).named_parameters()]
    assert not [n for n in names if "mix" in n]
    embed = [n for n, _ in make_model("linear", "embed", 3).named_parameters() if "mix" in n]
    layers = [n for n, _ in make_model("linear", "layers", 5).named_parameters() if "mix" in n]
    assert embed == ["encoder.mixer.weight"]
    assert len(layers) == 3 * 3  # per layer: the mixer weight, its LayerNorm's weight and bias
    assert dict(make_model("linear", "layers", 5).named_parameters())[
        "encoder.layers.0.mixer.weight"
    ].shape == (5, 16)


@pytest.mark.parametrize(
    "options,field",
    [({"local_mixer_kernel": 4}, "local_mixer_kernel"), ({"local_mixer_kernel": 0},
     "local_mixer_kernel"), ({"local_mixer": "conv"}, "local_mixer")],
)  # fmt: skip
def test_bad_options_name_the_field(options, field):
    with pytest.raises(ModelConfigError, match=f"model.{field}"):
        ModelConfig(**options)


def test_sequence_parallel_refuses_slices_shorter_than_the_reach():
    from linformer_ds.parallel.checks import config_errors

    cfg = ModelConfig(max_seq_len=64, hidden_size=16, num_heads=2, num_layers=1, k=8,
                      local_mixer="layers", local_mixer_kernel=9)  # fmt: skip
    errors = config_errors(8, world_size=8, seq_len=16, model=cfg)
    assert any("local mixer" in e and "N/P=2" in e for e in errors), errors
    assert not any(
        "local mixer" in e for e in config_errors(4, world_size=4, seq_len=16, model=cfg)
    )


@pytest.mark.parametrize("mixer", ["embed", "layers"])
def test_export_equals_training_model(tmp_path, mixer):
    """The exported MLM (remote code through transformers) with a mixer equals the training
    model on a packed row with position_ids, with right and left padding."""
    from transformers import AutoModelForMaskedLM

    from tests.test_hf_heads import tiny_export

    out = tiny_export(tmp_path, local_mixer=mixer, local_mixer_kernel=5)
    exported = AutoModelForMaskedLM.from_pretrained(str(out), trust_remote_code=True).eval()
    assert exported.config.local_mixer == mixer and exported.config.local_mixer_kernel == 5
    with torch.no_grad():
        for n, p in exported.named_parameters():
            if "mixer" in n:
                p.normal_(std=0.5)
    training, ids = check_export_on_packed_row(exported)
    with torch.no_grad():  # the first document alone: what the packed row gave it
        alone = training(ids[:, :9]).logits
        packed = training(ids, (ids != 0).long(), position_ids=torch.cat(
            [torch.arange(n) for n in (9, 20, 4, 15)] + [torch.zeros(16, dtype=torch.long)])[None]
        ).logits  # fmt: skip
    assert (packed[:, :9] - alone).abs().max() <= 1e-5
