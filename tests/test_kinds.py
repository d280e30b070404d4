"""Attention kinds answer for themselves: a copy of every built-in kind registered under a new
name behaves exactly like the original (config checks, sequence-parallel and isolation checks,
the ONNX decision, FLOPs, parameter counts, outputs), so no rule anywhere is keyed on a name."""

import dataclasses
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from linformer_ds.model import (
    PROJECTIONS,
    LinformerForMaskedLM,
    ModelConfig,
    flops_per_token,
    get_projection,
    onnx_problem,
    register_projection,
    unregister_projection,
)
from linformer_ds.parallel.checks import config_errors, isolation_errors

COPY = "copy_of_"


@pytest.fixture(scope="module", autouse=True)
def copies():
    """Every built-in kind again, as ``copy_of_<name>``, with all its fields."""
    for name in PROJECTIONS:
        fields = dataclasses.asdict(get_projection(name))
        fields.pop("name")
        register_projection(COPY + name, **fields)
    yield
    for name in PROJECTIONS:
        unregister_projection(COPY + name)


def _renamed(options: dict, name: str) -> dict:
    """``options`` with every layer of kind ``name`` its copy."""
    out = dict(options)
    out["layer_projections"] = [COPY + p if p == name else p for p in options["layer_projections"]]
    return out


def _outcome(options: dict) -> tuple:
    """What the registry-driven code says of a model of ``options``: its validation error, the
    SP and isolation errors at P = 2, the ONNX decision, FLOPs and projection parameters."""
    try:
        cfg = ModelConfig(**options)
    except ValueError as e:
        return ("invalid", str(e))
    return (
        "valid",
        config_errors(2, world_size=2, seq_len=cfg.max_seq_len, model=cfg),
        isolation_errors(2, cfg, False),
        onnx_problem(cfg),
        flops_per_token(cfg, cfg.max_seq_len),
        cfg.num_projection_parameters(),
    )


def _unname(value, name: str):
    """``value`` with the copy's name written as the original's (messages name the kind)."""
    if isinstance(value, str):
        return re.sub(rf"\b{COPY}{name}\b", name, value)
    if isinstance(value, (list, tuple)):
        return type(value)(_unname(v, name) for v in value)
    return value


options_st = st.fixed_dictionaries(
    {
        "layer_projections": st.lists(st.sampled_from(PROJECTIONS), min_size=1, max_size=3),
        "k": st.sampled_from([2, 3, 4, 8]),
        "local_window": st.sampled_from([0, 4, 5]),
        "sharing": st.sampled_from(["none", "headwise", "kv", "layerwise"]),
        "freeze_projection": st.booleans(),
        "num_heads": st.sampled_from([1, 3, 4]),
        "max_seq_len": st.sampled_from([16, 18]),
    }
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(options=options_st)
def test_a_renamed_copy_of_each_kind_gets_the_same_answers(options):
    options = dict(options, num_layers=len(options["layer_projections"]), vocab_size=32)
    options.update(hidden_size=12, intermediate_size=16)
    original = _outcome(options)
    for name in set(options["layer_projections"]):
        assert _unname(_outcome(_renamed(options, name)), name) == original, name


@pytest.mark.parametrize("name", PROJECTIONS)
def test_a_renamed_copy_computes_the_same_outputs(name):
    """Same seed, same schedule but one layer of the copy: the same parameters (bar the shared
    projection's attribute name) and bitwise the same logits, with padding and documents."""
    others = [p for p in ("linear", "dense") if p != name][0]
    options = dict(
        vocab_size=40, max_seq_len=32, hidden_size=16, num_layers=2, num_heads=2,
        intermediate_size=32, k=4, layer_projections=[name, others], dropout=0.0,
        attention_dropout=0.0, local_window=8 if get_projection(name).windowed else 0,
        sharing="headwise",
    )  # fmt: skip
    ids = torch.randint(1, 40, (2, 32), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 32, dtype=torch.long)
    mask[1, 27:] = 0
    positions = torch.cat([torch.arange(20), torch.arange(12)]).expand(2, 32)
    outputs = []
    for opts in (options, _renamed(options, name)):
        torch.manual_seed(0)
        model = LinformerForMaskedLM(ModelConfig(**opts)).eval()
        with torch.no_grad():
            outputs.append(
                (
                    model(ids, mask).logits,
                    model(ids, mask, position_ids=positions).logits,
                    sorted(v.sum().item() for v in model.state_dict().values()),
                )
            )
    assert torch.equal(outputs[0][0], outputs[1][0])
    assert torch.equal(outputs[0][1], outputs[1][1])
    assert outputs[0][2] == outputs[1][2]


def test_a_kind_is_refused_without_a_way_to_attend():
    with pytest.raises(ValueError, match="needs a factory"):
        register_projection("nothing_at_all")
    with pytest.raises(ValueError, match="needs_window=True needs windowed=True"):
        register_projection("bad_window", attend=lambda *a: None, needs_window=True, windowed=False)
    with pytest.raises(ValueError, match="identifier"):
        register_projection("hybrid", attend=lambda *a: None)
