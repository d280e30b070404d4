"""The planner (linformer_ds.plan, issue 55) against what runs here: the predicted peak of a
training step's live tensor bytes within 10 % of the measured one (plain model, forward +
backward, every attention kind, bf16 and fp32, activation checkpointing off / per layer / per
sub-layer), the parameter count exact, the sequence-parallel bytes equal to the formula the
collective counter checks (tests/test_sp_bench.py), and the CLI."""

import functools
import itertools

import pytest
import torch
import torch.utils.checkpoint as cp

from bench.sp_collectives import collective_bytes_per_layer
from linformer_ds.model import LinformerForMaskedLMPretraining, ModelConfig, labelled_positions
from linformer_ds.plan import Step, activation_peak, parameter_counts, sp_bytes_per_layer
from linformer_ds.plan.__main__ import main as plan_main
from linformer_ds.plan.measure import LiveBytes
from tests.pretrain_utils import TINY_CONFIG

KINDS = [
    {"projection": "linear"},
    {"projection": "conv"},
    {"projection": "dense"},
    {"projection": "dense", "attention_dropout": 0.0},
    {"projection": "dynamic"},
    {"projection": "linear", "local_window": 32},
    {"projection": "local", "local_window": 32},
    {"projection": "linear", "local_mixer": "layers"},
    {"projection": "hybrid", "sharing": "headwise"},
]


def _config(n: int, **kind) -> ModelConfig:
    opts = {"sharing": "layerwise", **kind}
    return ModelConfig(vocab_size=512, max_seq_len=n, hidden_size=128, num_layers=2, num_heads=4,
                       intermediate_size=512, k=32, **opts)  # fmt: skip


def _measured(config: ModelConfig, dtype: torch.dtype, checkpoint, batch: int, masked: bool):  # noqa: ANN001, E501
    """(measured peak of live tensor bytes of one forward + backward with the gradients held
    from the start, parameter bytes, labelled fraction). ``masked``: an attention mask with the last row's tail padded, as the
    trainer passes one."""
    torch.manual_seed(0)
    model = LinformerForMaskedLMPretraining(config).to(dtype)
    if checkpoint:
        fn = functools.partial(cp.checkpoint, use_reentrant=False)
        model.encoder.set_activation_checkpointing(fn, granularity=checkpoint)
    n = config.max_seq_len
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, config.vocab_size, (batch, n), generator=g)
    labels = torch.where(torch.rand(batch, n, generator=g) < 0.15, ids, -100)
    mask = None
    if masked:
        mask = torch.ones_like(ids)
        mask[-1, n - n // 8 :] = 0
        labels[mask == 0] = -100
    index = labelled_positions(labels)
    params = list(model.parameters())
    for p in params:  # held through the step, as DeepSpeed's gradient buffers are
        p.grad = torch.zeros_like(p)
    with LiveBytes(params + [p.grad for p in params]) as live:
        model(ids, mask, labels=labels, labelled_index=index).loss.backward()
    return (
        live.peak,
        sum(p.numel() * p.element_size() for p in params),
        index.numel() / labels.numel(),
    )


# every kind x dtype x checkpointing with an attention mask (the trainer's case); without one
# (keys and values are then views of the qkv product, not a masked copy) without checkpointing
RATIOS: dict = {}  # predicted / measured of every case run (printed with -s by the last)
LAYOUTS = list(itertools.product(range(len(KINDS)), (torch.float32, torch.bfloat16),
                                 (None, "layer", "sublayer"), (True,)))  # fmt: skip
LAYOUTS += list(itertools.product(range(len(KINDS)), (torch.float32, torch.bfloat16),
                                  (None,), (False,)))  # fmt: skip


@pytest.mark.parametrize("kind, dtype, checkpoint, masked", LAYOUTS)
def test_predicted_peak_within_10_percent(kind, dtype, checkpoint, masked):  # noqa: ANN001
    config = _config(256, **KINDS[kind])
    peak, param_bytes, labelled = _measured(config, dtype, checkpoint, 2, masked)
    elem = torch.empty(0, dtype=dtype).element_size()
    step = Step(2, 256, 256, elem, device="cpu", labelled=labelled, masked=masked)
    predicted = 2 * param_bytes + activation_peak(config, step, checkpoint)["peak"]
    RATIOS[(kind, str(dtype), checkpoint, masked)] = predicted / peak
    assert abs(predicted / peak - 1) < 0.10, (KINDS[kind], dtype, checkpoint, predicted, peak)


@pytest.mark.parametrize(
    "kind, checkpoint", [(0, None), (0, "sublayer"), (1, "sublayer"), (6, "sublayer")]
)  # linear, conv, local window
def test_predicted_peak_long_rows(kind, checkpoint):  # noqa: ANN001
    """Rows of 16,384 tokens (one row, fp32): the same 10 % where activations are nearly all."""
    n = 16384
    config = _config(n, **KINDS[kind])
    peak, param_bytes, labelled = _measured(config, torch.float32, checkpoint, 1, True)
    step = Step(1, n, n, 4, device="cpu", labelled=labelled)
    predicted = 2 * param_bytes + activation_peak(config, step, checkpoint)["peak"]
    RATIOS[(kind, "float32 N=16384", checkpoint, True)] = predicted / peak
    assert abs(predicted / peak - 1) < 0.10, (KINDS[kind], checkpoint, predicted, peak)


def test_parameter_count_exact():
    for kind in KINDS:
        config = _config(256, **kind)
        model = LinformerForMaskedLMPretraining(config)
        assert parameter_counts(config)[0] == model.num_parameters()


@pytest.mark.parametrize("sp", [2, 4])
def test_sequence_parallel_bytes_equal_the_counted_formula(sp):  # noqa: ANN001
    """The bench formula equals the bytes counted on real collectives (tests/test_sp_bench.py,
    tests/test_sequence_parallel.py); the planner's per-layer figure equals it exactly."""
    n, b = 4096, 2
    for kind, extra in (("linear", {"k": 32}), ("conv", {"stride": 4096 // 32}), ("dense", {})):
        config = _config(n, projection=kind)
        for elem in (2, 4):
            want = collective_bytes_per_layer(kind, seq_len=n, sp_size=sp, batch_size=b,
                                              hidden_size=128, bytes_per_element=elem, **extra)  # fmt: skip
            assert sp_bytes_per_layer(config, 0, n, sp, b, elem) == want, (kind, elem)


def test_cli_plans_the_config_and_ranks_layouts(capsys):  # noqa: ANN001
    assert plan_main(["--config", TINY_CONFIG, "--gpus", "2", "--gpu-memory", "1",
                      "deepspeed.precision=bf16"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "per-rank peak" in out and "largest N that fits" in out
    assert "layouts of 2 GPUs that fit" in out and "tokens/s/GPU" in out


def test_print_ratios():
    """The figures behind the 10 % bound (``pytest -s``): predicted / measured per case."""
    for key, ratio in sorted(RATIOS.items(), key=lambda kv: abs(kv[1] - 1)):
        print(f"{KINDS[key[0]]} {key[1:]}: {ratio:.3f}")
