"""Two Trainers in one process are independent: a sequence-parallel run followed by a
data-parallel one in the same 2 processes logs, step for step, what each logs in fresh processes.

Issue 28: DeepSpeed keeps the ``mpu`` of the last engine given one in a module global
(``deepspeed.utils.groups.mpu``) and ``deepspeed.initialize`` without an mpu left it there, so
a DP = 2 run after an SP = 2 one reduced its gradients over the SP run's groups: twice the
gradient norm under ZeRO 0-2 with E/F whole, a crash on the sharded mpu's model-parallel rank.
:func:`linformer_ds.parallel.parallelize.parallelize` now installs every engine's own mpu (None included).
"""

from pathlib import Path

import pytest

from linformer_ds.config import load_config
from linformer_ds.engine import build_model
from linformer_ds.parallel.parallelize import parallelize
from tests.pretrain_utils import (
    TEST_OVERRIDES,
    TINY_CONFIG,
    read_metrics,
    start_worker_ranks,
    wait_worker_ranks,
)

STEPS = 5
TOL = 1e-6
COMMON = [
    "deepspeed.precision=fp32",
    "model.dropout=0.0",
    "model.attention_dropout=0.0",
    "data.short_seq_prob=0.5",
    f"train.max_steps={STEPS}",
    "train.eval_interval=0",
    "train.micro_batch_size=4",
    "checkpoint.resume=never",
    "checkpoint.save_final=false",
    "checkpoint.save_interval=0",
]
# in this order in one launch; each also alone in a fresh launch (the first is the "same"
# launch's own first run: fresh processes already)
RUNS = {
    "sp2_whole_z2": ["parallel.sequence_parallel_size=2", "parallel.shard_sequence_parameters=false",
                     "deepspeed.zero.stage=2"],
    "dp2_z2": ["deepspeed.zero.stage=2"],
    "sp2_sharded_z0": ["parallel.sequence_parallel_size=2",
                       "parallel.shard_sequence_parameters=true", "deepspeed.zero.stage=0"],
    "dp2_z0": ["deepspeed.zero.stage=0"],
}  # fmt: skip


def _runs(out: Path, data: Path, names: list[str], tag: str) -> list[dict]:
    return [
        {"name": f"{tag}/{n}",
         "overrides": COMMON + RUNS[n] + [f"data.path={data}",
                                          f"checkpoint.dir={out / tag / n / 'checkpoints'}"]}
        for n in names
    ]  # fmt: skip


@pytest.mark.slow  # 4 launches of 2 ranks at once (~1 min on 2 cores)
def test_sp_then_dp_in_one_process_equals_fresh_processes(tiny_corpus, tmp_path):
    first, *later = RUNS
    launches = {"same": list(RUNS)} | {f"fresh_{n}": [n] for n in later}
    procs: dict[str, list] = {}
    for tag, names in launches.items():
        (tmp_path / tag).mkdir()
        procs[tag] = start_worker_ranks(2, _runs(tmp_path, tiny_corpus, names, tag), tmp_path, tag)
    for tag, ps in procs.items():
        wait_worker_ranks(ps, tmp_path, tag, timeout=900)
    worst = {}
    for name in RUNS:
        same = read_metrics(tmp_path / "same" / name)
        fresh = read_metrics(tmp_path / ("same" if name == first else f"fresh_{name}") / name)
        assert sorted(same) == sorted(fresh) == list(range(1, STEPS + 1)), name
        for s in fresh:
            for key in ("loss", "grad_norm"):
                d = abs(same[s][key] - fresh[s][key]) / abs(fresh[s][key])
                worst[f"{name} {key}"] = max(worst.get(f"{name} {key}", 0.0), d)
    print("\nsame process vs fresh, worst relative difference over", STEPS, "steps:")
    for k, d in worst.items():
        print(f"  {k:24s} {d:.2e}")
    assert all(d <= TOL for d in worst.values()), worst


def test_parallelize_installs_this_engines_mpu():
    """Without sequence parallelism the engine's mpu is None, and so is DeepSpeed's global one
    afterwards, whatever an earlier engine of the process left there."""
    from deepspeed.utils import groups as ds_groups

    cfg = load_config(TINY_CONFIG, TEST_OVERRIDES)
    ds_groups.mpu = object()  # an earlier (sequence-parallel) engine's
    try:
        assert parallelize(build_model(cfg), cfg, {}, None) is None
        assert ds_groups.mpu is None
    finally:
        ds_groups.mpu = None
