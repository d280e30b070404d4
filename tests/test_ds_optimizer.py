"""The trainer's optimizer implementation: torch's fused AdamW (one pass over DeepSpeed's flat
fp32 partition) is the default, the same update as the single-tensor loop within fp32 rounding;
DeepSpeed's own optimizers (``torch_adam=false``) get no ``fused`` key."""

import sys

import torch

from linformer_ds.config import load_config
from linformer_ds.ds_config import check_deepspeed_extra, deepspeed_config
from tests.pretrain_utils import TINY_CONFIG


def test_fused_adamw_is_the_default():
    params = deepspeed_config(load_config(TINY_CONFIG), world_size=1)["optimizer"]["params"]
    assert params["torch_adam"] is True and params["fused"] is True


def test_deepspeed_optimizers_get_no_fused_key():
    """torch_adam=false (FusedAdam, or DeepSpeedCPUAdam under offload) takes no ``fused``: it is
    dropped, and the check of deepspeed.extra accepts the override."""
    for extra in (
        ["deepspeed.extra.optimizer.params.torch_adam=false"],
        [
            "deepspeed.extra.optimizer.params.torch_adam=false",
            "deepspeed.zero.offload_optimizer=true",
        ],
    ):
        cfg = load_config(TINY_CONFIG, extra)
        assert "fused" not in deepspeed_config(cfg, world_size=1)["optimizer"]["params"]
        check_deepspeed_extra(cfg, world_size=1)
    cfg = load_config(TINY_CONFIG, ["deepspeed.extra.optimizer.params.fused=false"])
    assert deepspeed_config(cfg, world_size=1)["optimizer"]["params"]["fused"] is False
    check_deepspeed_extra(cfg, world_size=1)


def test_fused_and_loop_adamw_agree():
    """Five steps on one flat fp32 tensor (ZeRO's partition): the same parameters and moments
    within fp32 rounding (not bit for bit: the fused kernel orders the arithmetic its own way)."""
    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(10_000, generator=g)
    grads = [torch.randn(10_000, generator=g) * 1e-2 for _ in range(5)]
    out = []
    for fused in (False, True):
        p = torch.nn.Parameter(p0.clone())
        kw = {"fused": True} if fused else {"foreach": False}
        opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, **kw)
        for grad in grads:
            p.grad = grad.clone()
            opt.step()
        out.append((p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]))
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


MUON_PROBE = r"""
import sys, torch
from linformer_ds.engine import MUON_MODULE, import_muon_lazily

real, compiled = torch.compile, []

def recording_compile(fn, **kwargs):  # what deepspeed.runtime.compiler.compile() hands out
    compiled.append(fn.__name__)
    return real(fn, backend="eager", **kwargs)  # dynamo itself, without inductor's code gen

torch.compile = recording_compile
import_muon_lazily()
import_muon_lazily()  # a second call keeps the module it imported
assert MUON_MODULE in sys.modules and "torch._inductor.compile_fx" not in sys.modules
assert compiled == [], compiled
from deepspeed.runtime.zero.muon import original_muon as om
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam  # the isinstance checks

ns = om.zeropower_via_newtonschulz5
g = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
expected = ns.__wrapped__(g, 5)  # the function as written, not compiled
torch.compiler.is_compiling = lambda: True  # met inside a compiled region: runs as written
assert torch.equal(ns(g, 5), expected) and compiled == [], compiled
torch.compiler.is_compiling = lambda: False
first, second = ns(g, 5), ns(g, 5)  # compiled on its first call, once
assert compiled == ["zeropower_via_newtonschulz5"], compiled
assert torch.allclose(first, expected, atol=1e-6) and torch.equal(first, second)
assert "torch._inductor.compile_fx" not in sys.modules
print("ok")
"""


def test_muon_module_imports_without_inductor_and_compiles_on_first_call():
    """``engine.import_muon_lazily`` (run before every ``deepspeed.initialize`` of the trainer):
    DeepSpeed's Muon module is imported without inductor, its decorated functions compile with
    the same ``torch.compile`` on their first call (once), and inside a compiled region they
    run as written. In a fresh interpreter: this one may have imported either already."""
    import subprocess

    from tests.pretrain_utils import REPO, child_env

    proc = subprocess.run(
        [sys.executable, "-c", MUON_PROBE],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_muon_lazily_leaves_a_deepspeed_without_the_module_alone(monkeypatch):
    """A DeepSpeed release without the Muon module (``LINFORMER_DS_UNTESTED_DEPS``): nothing is
    imported and DeepSpeed's ``compile`` stays its own; the trainer starts as before."""
    from deepspeed.runtime import compiler

    from linformer_ds import engine

    before = compiler.compile
    monkeypatch.setattr(engine, "MUON_MODULE", "deepspeed.runtime.zero.muon.not_there")
    engine.import_muon_lazily()
    assert compiler.compile is before
    assert "deepspeed.runtime.zero.muon.not_there" not in sys.modules
