"""``deepspeed.precision: auto`` and the time-bounded GEMM-peak probe: auto picks bf16 exactly
where the CPU has a native bf16 unit (read here from /proc/cpuinfo independently), the trainer
reports the choice on its [setup] line and records the resolved precision in its config and
checkpoint, and the probe's size follows its time budget."""

import json
import math
import re
from pathlib import Path

import torch
from hypothesis import given
from hypothesis import strategies as st

from linformer_ds.config import load_config
from linformer_ds.perf import cpu_flags, matmul_probe_size, measure_matmul_peak_tflops, native_bf16
from linformer_ds.resolve import resolve
from tests.pretrain_utils import TINY_CONFIG, run_pretrain

BF16_UNITS = ("amx_bf16", "avx512_bf16", "bf16")  # x86 AMX, x86 AVX-512 BF16, Arm
OTHER_FLAGS = ("avx2", "avx512f", "amx_tile", "fma", "sse4_2", "asimd", "fp", "bf16_foo")


def _this_cpu() -> tuple:
    """(expected precision, reason) from /proc/cpuinfo, read with a regex of our own."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    for unit in BF16_UNITS:
        if re.search(rf"^(flags|Features)\s*:.*(?<![\w]){unit}(?![\w])", text, re.M):
            return "bf16", unit
    return "fp32", "no native bf16"


@given(st.sets(st.sampled_from(BF16_UNITS + OTHER_FLAGS)))
def test_native_bf16_iff_the_cpu_has_a_bf16_unit(flags):
    why = native_bf16("cpu", flags)
    units = [u for u in BF16_UNITS if u in flags]
    assert (why is None) == (not units)
    if units:
        assert why == units[0]  # AMX before AVX-512 before Arm's flag: one answer per machine


def test_cpu_flags_of_x86_and_arm_cpuinfo(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nmodel name\t: Xeon\nflags\t\t: fpu avx2 amx_bf16 amx_tile\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\nCPU part\t: 0xd4f\n")
    assert cpu_flags(str(x86)) == {"fpu", "avx2", "amx_bf16", "amx_tile"}
    assert cpu_flags(str(arm)) == {"fp", "asimd", "bf16", "i8mm"}
    assert cpu_flags(str(tmp_path / "missing")) == set()
    assert native_bf16("cpu", cpu_flags(str(x86))) == "amx_bf16"
    assert native_bf16("cpu", cpu_flags(str(arm))) == "bf16"
    assert native_bf16("mps", {"amx_bf16"}) is None  # an accelerator it does not know


def test_auto_resolves_from_this_machine():
    precision, why = _this_cpu()
    loaded = load_config(TINY_CONFIG)  # the shipped CPU config says auto
    assert loaded.deepspeed.precision == "auto"  # decided by resolve, once
    cfg = resolve(loaded, 1)
    assert (cfg.deepspeed.precision, cfg.deepspeed.auto_precision) == (precision, why)
    assert cfg.deepspeed.precision_text() == f"{precision} (auto: {why})"
    fixed = resolve(load_config(TINY_CONFIG, ["deepspeed.precision=fp32"]), 1)
    assert (fixed.deepspeed.precision, fixed.deepspeed.auto_precision) == ("fp32", None)
    assert fixed.deepspeed.precision_text() == "fp32"


def test_probe_size_follows_the_budget():
    assert matmul_probe_size(torch.float32, "cpu", 2048, 0.0) == 256
    assert matmul_probe_size(torch.float32, "cpu", 2048, math.inf) == 2048
    assert matmul_probe_size(torch.float32, "cpu", 128, math.inf) == 128  # never above the max
    size = matmul_probe_size(torch.bfloat16, "cpu", 4096, 0.05)
    assert 256 <= size <= 4096 and size & (size - 1) == 0
    assert measure_matmul_peak_tflops(torch.bfloat16, "cpu", 2048, repeats=2, budget_s=0.0) > 0


def test_trainer_reports_and_records_the_choice(tiny_corpus, tmp_path):
    """One rank, two steps with precision=auto: the [setup] line says what auto chose and why;
    the run's config.json and its checkpoint record the resolved precision."""
    precision, why = _this_cpu()
    proc = run_pretrain(
        tiny_corpus,
        tmp_path,
        ["deepspeed.precision=auto", "train.max_steps=2"],
        nproc=1,
        launcher="python",
    )
    setup = [ln for ln in proc.stdout.splitlines() if ln.startswith("[setup]")]
    assert len(setup) == 1 and f" precision={precision} (auto: {why}) " in setup[0], setup
    saved = json.loads((tmp_path / "config.json").read_text())["deepspeed"]
    assert (saved["precision"], saved["auto_precision"]) == (precision, why)
    meta = json.loads(
        (tmp_path / "checkpoints" / "step_00000002" / "linformer_meta.json").read_text()
    )
    assert meta["precision"] == precision
