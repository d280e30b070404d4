"""The cases of tests/test_resume_policy.py in one process (one rank): resume a saved run with
changed config keys and report, per case, the outcome and the values read back from the engine.

    python tests/resume_policy_worker.py SPEC.json OUT.json

SPEC: ``{"base": RUN_DIR, "work": DIR, "overrides": [...], "cases": [{"name", "set": [...]}]}``.
RUN_DIR holds a finished run (its checkpoints and config.json). Each case copies it to
``DIR/name``, builds the real :class:`linformer_ds.trainer.Trainer` as the command line does
(:func:`linformer_ds.train.start_trainer`) with ``overrides + set``
(``logging.dir`` / ``checkpoint.dir`` pointed at the copy) and records either the refusal (the
one line ``train.main`` prints, exit 2) with a digest of every file before and after, or the
effective values (:func:`read_back`) and the run's config.json / config_history.jsonl.
"""

import hashlib
import io
import json
import os
import shutil
import sys
import traceback
from contextlib import redirect_stderr, redirect_stdout

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")

from linformer_ds.checkpoint.reshard import sequence_shards  # noqa: E402
from linformer_ds.config import ConfigError, load_config  # noqa: E402
from linformer_ds.data.stages import resolve_stages  # noqa: E402
from linformer_ds.dist_env import free_port  # noqa: E402
from linformer_ds.errors import LinformerError  # noqa: E402
from linformer_ds.optim import lr_lambda  # noqa: E402
from linformer_ds.resume_policy import torch_optimizer  # noqa: E402
from linformer_ds.train import start_trainer  # noqa: E402
from linformer_ds.trainer import Trainer  # noqa: E402
from tests.pretrain_utils import TINY_CONFIG  # noqa: E402

os.environ["MASTER_PORT"] = str(free_port())


def digest(root: str) -> dict:
    """relative path -> sha256 of every file below ``root``."""
    out = {}
    for d, _, files in os.walk(root):
        for name in files:
            p = os.path.join(d, name)
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def read_back(t: Trainer) -> dict:
    """What the resumed run uses, from the engine and the components (not from the config)."""
    e = t.engine
    opt = torch_optimizer(e)
    groups = e.lr_scheduler.optimizer.param_groups
    sched = e.lr_scheduler
    mix = t.batches.mixture
    scaler = getattr(e.optimizer, "loss_scaler", None)
    return {
        "step": t.step,
        "groups": [{"lr": g["lr"], "initial_lr": g.get("initial_lr"), "betas": list(g["betas"]),
                    "eps": g["eps"], "weight_decay": g["weight_decay"]} for g in groups],
        "same_groups": groups is opt.param_groups,
        "base_lrs": list(sched.base_lrs),
        "last_epoch": sched.last_epoch,
        "lambda": [sched.lr_lambdas[0](k) for k in range(0, 40)],
        "get_lr": list(e.get_lr()),
        "clip_grad": getattr(e.optimizer, "clip_grad", None),
        "gradient_clipping": e.gradient_clipping(),
        "micro_batch": e.train_micro_batch_size_per_gpu(),
        "gas": e.gradient_accumulation_steps(),
        "train_batch": e.train_batch_size(),
        "zero_stage": e.zero_optimization_stage(),
        "bf16": e.bfloat16_enabled(),
        "fp16": e.fp16_enabled(),
        "offload_optimizer": bool(e.zero_cpu_offload()),
        "grad_accum_dtype": str(e.get_data_types()[1]),
        "sequence_sharded": bool(sequence_shards(e.module)),
        "mlm_probability": mix.maskers[0].mlm_probability,
        "short_seq_prob": mix.maskers[0].short_seq_prob,
        "weights": list(mix.sampler.weights),
        "stage_index": t.batches.stage_index,
        "stage_micro_batch": mix.micro_batch_size,
        "end": t.end,
        "loop": {"log_interval": t.metrics.cfg.train.log_interval,
                 "eval_interval": t.cfg.train.eval_interval,
                 "eval_batches": t.cfg.train.eval_batches,
                 "nonfinite": t.cfg.train.nonfinite,
                 "save_interval": t.checkpoints.cfg.checkpoint.save_interval},
        "loss_scaler": None if scaler is None else {
            k: getattr(scaler, k, None) for k in ("cur_scale", "scale_window", "min_scale",
                                                  "delayed_shift")},
    }  # fmt: skip


def expected_lambda(cfg) -> list:
    s = cfg.scheduler
    f = lr_lambda(s.warmup_steps, cfg.train.max_steps, s.decay, s.min_lr_ratio)
    return [f(k) for k in range(0, 40)]


def run_case(spec: dict, case: dict) -> dict:
    run = os.path.join(spec["work"], case["name"])
    shutil.copytree(spec["base"], run)
    where = [f"logging.dir={run}", f"checkpoint.dir={run}/checkpoints"]
    before = digest(run)
    out, err = io.StringIO(), io.StringIO()
    result: dict = {"name": case["name"], "set": case["set"]}
    trainer = None
    try:
        with redirect_stdout(out), redirect_stderr(err):
            cfg = load_config(TINY_CONFIG, spec["overrides"] + where + case["set"])
            resolve_stages(cfg)
            trainer = start_trainer(cfg)
            trainer.watchdog.training_started()
        result["outcome"] = "started"
        result["values"] = read_back(trainer)
        result["expected_lambda"] = expected_lambda(trainer.cfg)
        with open(os.path.join(run, "config.json")) as f:
            result["config_json"] = json.load(f)
        with open(os.path.join(run, "config_history.jsonl")) as f:
            result["history"] = [json.loads(line) for line in f]
        result["changes"] = {c.key: c.policy.kind for c in trainer.checkpoints.changes}
    except LinformerError as e:  # train.main: exit 2
        prefix = "config error" if isinstance(e, ConfigError) else "error"
        result["outcome"] = "refused"
        result["line"] = f"{prefix}: {e}"
        result["unchanged"] = digest(run) == before
    except Exception:
        result["outcome"] = "crashed"
        result["line"] = traceback.format_exc()[-3000:]
    finally:
        if trainer is not None:
            trainer.close()
    result["stdout"] = out.getvalue()[-3000:]
    shutil.rmtree(run, ignore_errors=True)
    return result


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    results = []
    for case in spec["cases"]:
        results.append(run_case(spec, case))
        with open(out_path, "w") as f:
            json.dump(results, f)
    sys.stdout.flush()
    os._exit(0)  # no gloo teardown (see linformer_ds.train.run_and_exit)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
