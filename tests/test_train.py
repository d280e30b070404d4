"""Real 2-rank DeepSpeed runs on CPU: ZeRO 0-3, ZeRO-3 vs ZeRO-0 equivalence with the
layerwise-shared projection, activation checkpointing, exact resume, dense, config errors."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from linformer_ds.config import ConfigError, load_config
from linformer_ds.ds_config import deepspeed_config
from linformer_ds.perf import DENSE_DROPOUT_ON_CPU
from tests.pretrain_utils import (
    PRETRAIN,
    REPO,
    TINY_CONFIG,
    child_env,
    read_metrics,
    run_pretrain,
    run_worker_ranks,
    worker_run,
)

FP32 = ["deepspeed.precision=fp32", "model.attention_dropout=0.0"]


def losses(run_dir, steps):
    m = read_metrics(run_dir)
    return [m[s]["loss"] for s in steps]


# (ZeRO stage, activation checkpointing: "" off, "torch" torch's non-reentrant, "ds" DeepSpeed's
# partitioned + CPU checkpointing (its module-global configuration: last))
FP32_RUNS = [(0, ""), (1, ""), (2, ""), (3, ""), (2, "torch"), (3, "torch"), (2, "ds")]


# The first halves (and the uninterrupted runs) of the two exact-resume tests below: bf16
# ZeRO-2 with dropout, and ZeRO-3 (run name -> overrides); resumed together in a second launch
EXACT_COMMON = ["train.max_steps=8", "model.dropout=0.1", "checkpoint.keep_last=0",
                "checkpoint.save_interval=4"]  # fmt: skip
Z3_COMMON = ["deepspeed.zero.stage=3", "train.max_steps=6", "checkpoint.keep_last=0",
             "checkpoint.save_interval=3"]  # fmt: skip
RESUMED = {"part": EXACT_COMMON, "z3_part": Z3_COMMON}
FIRST_HALVES = {"full": EXACT_COMMON, "part": EXACT_COMMON + ["train.stop_at_step=4"],
                "z3_full": Z3_COMMON, "z3_part": Z3_COMMON + ["train.stop_at_step=3"]}  # fmt: skip


def shm_segments() -> set:
    return {p.name for p in Path("/dev/shm").glob("deepspeed_allreduce_buffer_*")}


@pytest.fixture(scope="module")
def launches(tiny_corpus, tmp_path_factory):
    """Two 2-rank process groups (tests/layout_worker.py: runs one after the other, the
    start-up paid once per launch). The first trains FIRST_HALVES, then the 6-step fp32 runs of
    FP32_RUNS (the ZeRO-3 one printing what each rank holds of the shared projection,
    ``[zero3] rank R holds``; DeepSpeed's own checkpointing, module-global, last); the second
    resumes RESUMED. Returns ``(out, stdout of the first launch, of the second, /dev/shm
    segments before the launches)``."""
    out = tmp_path_factory.mktemp("launches")
    shm_before = shm_segments()
    runs = [worker_run(name, tiny_corpus, over) for name, over in FIRST_HALVES.items()]
    for stage, ac in FP32_RUNS:
        overrides = [f"deepspeed.zero.stage={stage}", "train.max_steps=6"]
        overrides.append(f"deepspeed.activation_checkpointing.enabled={str(bool(ac)).lower()}")
        if ac == "ds":
            overrides += [
                "deepspeed.activation_checkpointing.partition_activations=true",
                "deepspeed.activation_checkpointing.cpu_checkpointing=true",
            ]
        run = worker_run(f"z{stage}{ac}", tiny_corpus, FP32 + overrides)
        runs.append({**run, "zero3_holdings": (stage, ac) == (3, "")})
    first = run_worker_ranks(2, runs, out, "first")
    resumed = [worker_run(name, tiny_corpus, over) for name, over in RESUMED.items()]
    return out, first, run_worker_ranks(2, resumed, out, "resume"), shm_before


@pytest.fixture(scope="module")
def fp32_runs(launches):
    """``get(stage, ac="")``: the fp32 run's directory and its stdout (both ranks')."""
    out, stdout, _, _ = launches

    def get(stage: int, ac: str = ""):
        return out / f"z{stage}{ac}", stdout[f"z{stage}{ac}"]

    return get


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_match_zero0(fp32_runs, stage):
    """Same seed, same data: ZeRO 1/2/3 losses equal ZeRO-0's; under ZeRO-3 the shared
    projection is partitioned across the 2 ranks."""
    run, stdout = fp32_runs(stage)
    ref = losses(fp32_runs(0)[0], range(1, 7))
    got = losses(run, range(1, 7))
    assert got == pytest.approx(ref, rel=2e-4, abs=2e-4)
    assert got[-1] < got[0]
    if stage == 3:
        held = sorted(re.findall(r"\[zero3\] rank (\d) holds (\d+)/(\d+) of (\S+)", stdout))
        # k x N = 32 x 128 = 4096 elements, half on each rank
        part = ("2048", "4096", "encoder.shared_linear.weight")
        assert held == [("0", *part), ("1", *part)], stdout[-3000:]
    assert (run / "checkpoints" / "step_00000006" / "COMPLETE").is_file()


@pytest.mark.parametrize("stage,ac", [(2, "torch"), (3, "torch"), (2, "ds")])
def test_activation_checkpointing_same_gradients(fp32_runs, stage, ac):
    """Non-reentrant checkpointing with the shared projection (DeepSpeed issue 988 is the
    trap with reentrant), torch's or DeepSpeed's with partitioned activations kept on the CPU:
    the same gradient norms and losses as without checkpointing."""
    ref, got = read_metrics(fp32_runs(2)[0]), read_metrics(fp32_runs(stage, ac)[0])
    for s in range(1, 7):
        assert got[s]["loss"] == pytest.approx(ref[s]["loss"], rel=2e-4, abs=2e-4)
        assert got[s]["grad_norm"] == pytest.approx(ref[s]["grad_norm"], rel=2e-3)


def test_exact_resume_bf16_zero2(launches):
    """Train 8 steps in one go; then 4 steps, stop, resume to 8: identical losses (bf16, with
    dropout on, ZeRO-2)."""
    # the uninterrupted run and the first half in one 2-rank process group, the second half
    # resumed in a new one (the module's two launches)
    out, _, resumed, _ = launches
    full, part = out / "full", out / "part"
    stdout = resumed["part"]
    assert "[resume]" in stdout and "step 4" in stdout
    assert losses(part, range(1, 9)) == losses(full, range(1, 9))  # exact, not approximate
    meta = json.loads((part / "checkpoints" / "step_00000008" / "linformer_meta.json").read_text())
    assert meta["step"] == 8 and meta["sampler"]["consumed"] == 8 * 4 * 2
    assert (part / "checkpoints" / "latest").read_text().strip() == "step_00000008"


def test_zero3_resume_exact_and_on_one_rank(launches, tiny_corpus, tmp_path):
    """ZeRO-3 checkpoints (one model-states file per rank) resume: bit-exact on the same 2 ranks,
    and on 1 rank through DeepSpeed's universal checkpoint with the LR schedule continuing."""
    out, _, resumed, shm_before = launches
    full, part, one = out / "z3_full", out / "z3_part", tmp_path / "one"
    # DeepSpeed's CPU shm all-reduce op is kept off: no /dev/shm segment outlives the runs
    assert shm_segments() == shm_before
    tag3 = full / "checkpoints" / "step_00000003"
    assert sorted(p.name for p in tag3.glob("zero_pp_rank_*_model_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_model_states.pt",
        "zero_pp_rank_1_mp_rank_00_model_states.pt",
    ]
    stdout = resumed["z3_part"]
    assert "[resume] " in stdout and "step 3, epoch 0, sampler consumed 24" in stdout
    assert sorted(read_metrics(part)) == [1, 2, 3, 4, 5, 6]  # 4-6 from the resumed process
    assert losses(part, range(1, 7)) == losses(full, range(1, 7))  # exact, not approximate

    (one / "checkpoints").mkdir(parents=True)
    shutil.copytree(tag3, one / "checkpoints" / tag3.name)
    (one / "checkpoints" / "latest").write_text(tag3.name)
    proc = run_pretrain(
        tiny_corpus, one, Z3_COMMON + ["train.micro_batch_size=8"], nproc=1, launcher="python"
    )
    assert "saved by 2 rank(s), this run has 1: converting" in proc.stdout
    ref, got = read_metrics(full), read_metrics(one)
    assert sorted(got) == [4, 5, 6]
    for s in (4, 5, 6):
        assert got[s]["lr"] == ref[s]["lr"]
        assert got[s]["loss"] == pytest.approx(ref[s]["loss"], abs=0.02)
    meta = json.loads((one / "checkpoints" / "step_00000006" / "linformer_meta.json").read_text())
    assert meta["world_size"] == 1 and meta["zero_stage"] == 3 and meta["step"] == 6


def test_dense_config_trains_with_eval_and_tensorboard(tiny_corpus, tmp_path):
    """Dense attention with attention dropout on the CPU trains, and the run says once at the
    start that this is torch's slow math path (perf.slow_kernels)."""
    proc = run_pretrain(
        tiny_corpus,
        tmp_path,
        [
            "model.projection=dense",
            "model.attention_dropout=0.1",
            "train.max_steps=6",
            "train.eval_interval=3",
            "train.eval_batches=2",
            "logging.tensorboard=true",
            "deepspeed.zero.stage=1",
        ],
        launcher="torchrun",
    )
    train = read_metrics(tmp_path)
    ev = read_metrics(tmp_path, "eval")
    assert sorted(ev) == [3, 6]
    assert ev[6]["loss"] < ev[3]["loss"] + 0.5
    assert ev[6]["perplexity"] == pytest.approx(2.718281828 ** ev[6]["loss"], rel=1e-6)
    for key in ("mlm_accuracy", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_gb"):
        assert train[6][key] == train[6][key] and train[6][key] >= 0, key  # not NaN
    assert train[6]["loss"] < train[1]["loss"]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert proc.stderr.count(f"[warn] {DENSE_DROPOUT_ON_CPU}") == 1, proc.stderr[-3000:]


# ============================================================================= config errors
CONFIG_ERRORS = [
    (["model.nope=1"], "model.nope: Key 'nope' not in 'ModelConfig'"),
    (["train.max_steps=ten"], "train.max_steps: Value 'ten' of type 'str' could not be"),
    (["model.k=512"], "model.k: k=512 must be in [1, max_seq_len=256]"),
    (["model.projection=conv", "model.k=48"], "model.k: conv layer 0: k=48 does not divide"),
    (["deepspeed.zero.offload_param=true"], "deepspeed.zero.offload_param: needs zero.stage=3"),
    (["train.global_batch_size=10"], "train.global_batch_size: 10 is not micro_batch_size"),
    (["train.max_steps"], "override 'train.max_steps' is not of the form key=value"),
    (
        [
            "deepspeed.zero.stage=3",
            "deepspeed.activation_checkpointing.enabled=true",
            "deepspeed.activation_checkpointing.cpu_checkpointing=true",
        ],
        "deepspeed.activation_checkpointing.cpu_checkpointing: DeepSpeed's own checkpointing",
    ),
]


@pytest.fixture(scope="module")
def config_error_runs(tmp_path_factory):
    """launch/pretrain.py with each of CONFIG_ERRORS' overrides, all started at once (one
    interpreter start-up each, side by side): (exit code, stderr) per case."""
    out = tmp_path_factory.mktemp("config_errors")
    procs = []
    for i, (overrides, _) in enumerate(CONFIG_ERRORS):
        cmd = [sys.executable, PRETRAIN, "--config", TINY_CONFIG, *overrides]
        with open(out / f"{i}.err", "w") as err:
            procs.append(subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err))
    codes = [p.wait(timeout=300) for p in procs]
    return [(code, (out / f"{i}.err").read_text()) for i, code in enumerate(codes)]


@pytest.mark.parametrize("overrides,message", CONFIG_ERRORS)
def test_config_errors_fail_before_training(overrides, message, config_error_runs):
    code, stderr = config_error_runs[CONFIG_ERRORS.index((overrides, message))]
    assert code == 2, stderr[-2000:]
    assert message in stderr
    assert "Traceback" not in stderr


def test_print_config_and_derived_deepspeed_json():
    env = child_env()
    proc = subprocess.run(
        [sys.executable, PRETRAIN, "--config", TINY_CONFIG, "--print-config", "model.k=32"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "k: 32" in proc.stdout, (
        proc.stdout[-2000:],
        proc.stderr[-2000:],
        sorted(os.environ),
    ) and '"train_batch_size": 8' in proc.stdout
    cfg = load_config(
        TINY_CONFIG,
        [
            "deepspeed.zero.stage=3",
            "deepspeed.zero.offload_optimizer=true",
            "deepspeed.precision=fp16",
            "deepspeed.extra.zero_optimization.stage3_max_live_parameters=1000",
            "train.gradient_accumulation_steps=4",
        ],
    )
    ds = deepspeed_config(cfg, world_size=4)
    assert ds["train_batch_size"] == 8 * 4 * 4
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["zero_optimization"]["stage3_max_live_parameters"] == 1000
    assert ds["fp16"]["enabled"] and ds["data_types"]["grad_accum_dtype"] == "fp32"
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(str(REPO / "configs" / "nope.yaml"))


def test_every_shipped_config_loads():
    names = sorted(p.name for p in (REPO / "configs").glob("*.yaml"))
    assert {
        "base_4096.yaml",
        "dense_4096.yaml",
        "conv_linformer_4096.yaml",
        "tiny_cpu.yaml",
    } <= set(names)
    for name in names:
        cfg = load_config(str(REPO / "configs" / name))
        deepspeed_config(cfg, world_size=8)
    base = load_config(str(REPO / "configs" / "base_4096.yaml"))
    assert (base.model.num_layers, base.model.hidden_size, base.model.num_heads) == (12, 768, 12)
    assert (base.model.k, base.model.max_seq_len, base.model.sharing) == (128, 4096, "layerwise")
    # the long-context study's equal wall-clock winner: the local mixer, no exact window
    assert (base.model.local_window, base.model.local_mixer) == (0, "layers")
    assert base.deepspeed.precision == "bf16" and base.deepspeed.activation_checkpointing.enabled
    conv = load_config(str(REPO / "configs" / "conv_linformer_4096.yaml"))
    assert conv.model.projection_schedule() == ["linear"] * 6 + ["conv"] * 6


def test_resume_refuses_other_model(tiny_corpus, tmp_path):
    run_pretrain(tiny_corpus, tmp_path, ["train.max_steps=2"], nproc=1, launcher="python")
    proc = run_pretrain(
        tiny_corpus,
        tmp_path,
        ["train.max_steps=4", "model.k=16"],
        nproc=1,
        launcher="python",
        check=False,
    )
    assert proc.returncode != 0
    assert (
        "different model config (model.k: checkpoint 32 vs config 16)" in proc.stdout + proc.stderr
    )
    shutil.rmtree(tmp_path / "checkpoints")


def test_precision_the_accelerator_lacks_is_a_config_error(tiny_corpus, tmp_path):
    """fp16 on a CPU without fp16 kernels: exit 2 naming the key, before DeepSpeed's engine
    raises from deep inside; where the CPU has them, fp16 trains with loss scaling."""
    import torch

    over = ["deepspeed.precision=fp16", "train.max_steps=2", "deepspeed.zero.stage=2"]
    proc = run_pretrain(tiny_corpus, tmp_path, over, nproc=1, launcher="python", check=False)
    if torch.ops.mkldnn._is_mkldnn_fp16_supported():  # DeepSpeed's CPU fp16 check
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert sorted(read_metrics(tmp_path)) == [1, 2]
    else:
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert "error: deepspeed.precision: fp16 is not supported by this machine's cpu" in (
            proc.stderr
        )
        assert "Traceback" not in proc.stderr
