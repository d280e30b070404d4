"""Every job-config key has a resume policy (linformer_ds/resume_policy.py), and a resumed run
does what the policy says (issue 30 item 1).

The generated test resumes one saved 1-rank run with every key changed alone and with seeded
random pairs: the outcome is a refusal (the one line of exit 2, no file of the run changed) or
a start whose effective values, read back from the engine (optimizer param groups, scheduler,
clipping, batch, sampler, masking, loop), equal the new ones. Never recorded-but-ignored.
"""

import json
import random
import re
import shutil
import subprocess
import sys

import pytest

from linformer_ds.config import load_config, to_dict
from linformer_ds.optim import lr_lambda
from linformer_ds.resume_policy import (
    ADJUSTABLE,
    FREE,
    IDENTITY,
    POLICY,
    Change,
    changes,
    config_keys,
    counts,
    policy_of,
    refusal,
)
from tests.pretrain_utils import (
    REPO,
    TEST_OVERRIDES,
    TINY_CONFIG,
    child_env,
    read_metrics,
    run_pretrain,
)

WORKER = str(REPO / "tests" / "resume_policy_worker.py")
BASE = ["train.max_steps=6", "train.stop_at_step=2", "checkpoint.save_interval=0"]

# A new value for every key of the one-source base run (keys of list items: no items there).
# Each entry: the overrides that change the key (a few need a companion to be a valid config).
VALUES = {
    "name": ["name=renamed"],
    "model.vocab_size": ["model.vocab_size=3000"],
    "model.max_seq_len": ["model.max_seq_len=256"],
    "model.hidden_size": ["model.hidden_size=128"],
    "model.num_layers": ["model.num_layers=3"],
    "model.num_heads": ["model.num_heads=2"],
    "model.intermediate_size": ["model.intermediate_size=256"],
    "model.dropout": ["model.dropout=0.1"],
    "model.attention_dropout": ["model.attention_dropout=0.1"],
    "model.layer_norm_eps": ["model.layer_norm_eps=1e-6"],
    "model.norm": ["model.norm=post"],
    "model.projection": ["model.projection=dense"],
    "model.hybrid_linear_layers": ["model.projection=conv", "model.hybrid_linear_layers=1"],
    "model.layer_projections": ["model.layer_projections=[linear,dense]"],
    "model.k": ["model.k=16"],
    "model.layer_k": ["model.layer_k=[32,16]", "model.sharing=none"],
    "model.sharing": ["model.sharing=none"],
    "model.freeze_projection": ["model.freeze_projection=true"],
    "model.projection_init_std": ["model.projection_init_std=0.05"],
    "model.projection_init": ["model.projection_init=pooling"],
    "model.position_init": ["model.position_init=sinusoidal"],
    "model.output_bias_init": ["model.output_bias_init=unigram"],
    "model.local_mixer": ["model.local_mixer=layers"],
    "model.local_mixer_kernel": ["model.local_mixer_kernel=5"],
    "model.local_window": ["model.local_window=16"],
    "model.routed_blocks": ["model.routed_blocks=2"],
    "model.routed_block": ["model.routed_block=4"],
    "model.positions": ["model.positions=rope"],
    "model.rope_base": ["model.rope_base=500.0"],
    "model.initializer_range": ["model.initializer_range=0.03"],
    "model.pad_token_id": ["model.pad_token_id=1"],
    "model.num_labels": ["model.num_labels=3"],
    "model.classifier_dropout": ["model.classifier_dropout=0.2"],
    "model.tie_word_embeddings": ["model.tie_word_embeddings=false"],
    "model.format_version": [],  # one version exists: nothing to change it to
    "model.extra": ["model.extra.note=x"],
    "data.path": [],  # a copy of the data (same content) is set by the test itself
    "data.train_split": ["data.train_split=valid"],
    "data.valid_split": ["data.valid_split=train"],
    "data.mlm_probability": ["data.mlm_probability=0.3"],
    "data.verify_checksums": ["data.verify_checksums=true"],
    "data.short_seq_prob": ["data.short_seq_prob=0.25"],
    "data.document_isolation": ["data.document_isolation=true"],
    "optimizer.lr": ["optimizer.lr=0.01"],
    "optimizer.betas": ["optimizer.betas=[0.8,0.95]"],
    "optimizer.eps": ["optimizer.eps=1e-8"],
    "optimizer.weight_decay": ["optimizer.weight_decay=0.2"],
    "scheduler.warmup_steps": ["scheduler.warmup_steps=5"],
    "scheduler.decay": ["scheduler.decay=cosine"],
    "scheduler.min_lr_ratio": ["scheduler.min_lr_ratio=0.1"],
    "train.max_steps": ["train.max_steps=20"],
    "train.stop_at_step": ["train.stop_at_step=4"],
    "train.micro_batch_size": ["train.micro_batch_size=2"],
    "train.gradient_accumulation_steps": ["train.gradient_accumulation_steps=2"],
    "train.global_batch_size": ["train.global_batch_size=4"],
    "train.seed": ["train.seed=7"],
    "train.log_interval": ["train.log_interval=3"],
    "train.eval_interval": ["train.eval_interval=5"],
    "train.eval_batches": ["train.eval_batches=2"],
    "train.peak_tflops": ["train.peak_tflops=2.0"],
    "train.save_on_signal": ["train.save_on_signal=false"],
    "train.nonfinite": ["train.nonfinite=skip"],
    "train.compile": ["train.compile=true", "train.compile_backend=eager"],
    "train.compile_backend": ["train.compile_backend=aot_eager"],
    "train.compile_mode": ["train.compile_mode=max-autotune"],
    "train.compile_dynamic": ["train.compile_dynamic=true"],
    "train.threads": ["train.threads=1"],
    "train.omp_wait_policy": ["train.omp_wait_policy=passive"],  # in-process: a warning only
    "deepspeed.precision": ["deepspeed.precision=fp32"],
    "deepspeed.auto_precision": [],  # derived by resolve
    "deepspeed.zero.stage": ["deepspeed.zero.stage=1"],
    "deepspeed.zero.offload_optimizer": ["deepspeed.zero.offload_optimizer=true"],
    "deepspeed.zero.offload_param": ["deepspeed.zero.offload_param=true"],
    "deepspeed.zero.overlap_comm": ["deepspeed.zero.overlap_comm=false"],
    "deepspeed.zero.contiguous_gradients": ["deepspeed.zero.contiguous_gradients=false"],
    "deepspeed.zero.reduce_bucket_size": ["deepspeed.zero.reduce_bucket_size=1000000"],
    "deepspeed.zero.allgather_bucket_size": ["deepspeed.zero.allgather_bucket_size=1000000"],
    "deepspeed.gradient_clipping": ["deepspeed.gradient_clipping=0.5"],
    "deepspeed.fp32_grad_accum": ["deepspeed.fp32_grad_accum=false"],
    "deepspeed.loss_scale": ["deepspeed.loss_scale=128"],
    "deepspeed.initial_scale_power": ["deepspeed.initial_scale_power=8"],
    "deepspeed.loss_scale_window": ["deepspeed.loss_scale_window=50"],
    "deepspeed.hysteresis": ["deepspeed.hysteresis=4"],
    "deepspeed.min_loss_scale": ["deepspeed.min_loss_scale=0.5"],
    "deepspeed.activation_checkpointing.enabled": ["deepspeed.activation_checkpointing.enabled=true"],
    "deepspeed.activation_checkpointing.partition_activations":
        ["deepspeed.activation_checkpointing.partition_activations=true"],
    "deepspeed.activation_checkpointing.cpu_checkpointing":
        ["deepspeed.activation_checkpointing.cpu_checkpointing=true"],
    "deepspeed.activation_checkpointing.number_checkpoints":
        ["deepspeed.activation_checkpointing.number_checkpoints=1"],
    "deepspeed.activation_checkpointing.granularity":
        ["deepspeed.activation_checkpointing.granularity=sublayer"],
    "deepspeed.dist_backend": ["deepspeed.dist_backend=gloo"],
    "deepspeed.extra": ["deepspeed.extra.wall_clock_breakdown=false"],
    "logging.dir": [],  # the case's own directory: changed in every case
    "logging.tensorboard": ["logging.tensorboard=true"],
    "logging.prometheus_port": ["logging.prometheus_port=0"],
    "logging.prometheus_host": ["logging.prometheus_host=127.0.0.1"],
    "logging.sinks": [],  # needs a registered sink: tests/test_extending.py resumes with one
    "checkpoint.dir": [],  # the case's own directory: changed in every case
    "checkpoint.save_interval": ["checkpoint.save_interval=3"],
    "checkpoint.keep_last": ["checkpoint.keep_last=5"],
    "checkpoint.resume": [],  # another value is no resume (never) or another tag
    "checkpoint.save_final": ["checkpoint.save_final=false"],
    "checkpoint.allow_seed_change": ["checkpoint.allow_seed_change=true"],
    "checkpoint.allow_data_change": ["checkpoint.allow_data_change=true"],
    "checkpoint.init_from": ["checkpoint.init_from=hf:/nowhere"],  # a resume never reads it
    "parallel.sequence_parallel_size": ["parallel.sequence_parallel_size=2"],
    "parallel.shard_sequence_parameters": ["parallel.shard_sequence_parameters=true"],
    "parallel.auto_shard": [],  # derived by resolve
    "parallel.init_timeout_s": ["parallel.init_timeout_s=120"],
    "debug.sample_log": ["debug.sample_log=${logging.dir}/samples"],
    "debug.sync_log": ["debug.sync_log=${logging.dir}/syncs"],
    "debug.sync_steps": ["debug.sync_steps=[3]"],
    "debug.nan_at_step": ["debug.nan_at_step=50"],
    "debug.nan_rank": ["debug.nan_rank=0"],
    "eval.context_windows": ["eval.context_windows=[8,16]"],
    "eval.context_rows": ["eval.context_rows=2"],
    "debug.pause_at": [],  # any value holds the start until a signal (test_startup_signals)
}  # fmt: skip
# keys of list items: a mixture of two sources (the same corpus under two names: A and B) in
# two stages, changed by restating the lists (``{A}`` / ``{B}``: the corpus, a copy of it)
LIST_KEYS = {k for k in POLICY if "[]" in k} | {"data.sources", "train.stages"}


def _sources(w=(1.0, 3.0), names=("a", "b"), paths=("{A}", "{A}")):
    items = [f"{{name: {n}, path: {p}, weight: {x}}}" for n, p, x in zip(names, paths, w)]
    return f"data.sources=[{', '.join(items)}]"


def _stages(first="{end_step: 4, sources: [a, b], weights: [1, 1]}", second="{sources: [a, b]}"):
    return f"train.stages=[{first}, {second}]" if second else f"train.stages=[{first}]"


MIX_BASE = [_sources(), _stages()]
MIX_VALUES = {
    "data.sources": [_sources((1.0,), ("a",), ("{A}",)), _stages("{sources: [a]}", "")],
    "data.sources[].name": [
        _sources(names=("a", "c")),
        _stages("{end_step: 4, sources: [a, c], weights: [1, 1]}", "{sources: [a, c]}")],
    "data.sources[].path": [_sources(paths=("{A}", "{B}"))],  # a copy: the same content
    "data.sources[].weight": [_sources((2.0, 3.0))],
    "train.stages": [_stages("{sources: [a, b], weights: [1, 1]}", "")],
    "train.stages[].end_step": [_stages("{end_step: 5, sources: [a, b], weights: [1, 1]}")],
    "train.stages[].sources": [_stages("{end_step: 4, sources: [b, a], weights: [1, 1]}")],
    "train.stages[].weights": [_stages("{end_step: 4, sources: [a, b], weights: [1, 4]}")],
    "train.stages[].path": [_stages(second="{path: {A}}")],
    "train.stages[].micro_batch_size": [
        _stages("{end_step: 4, sources: [a, b], weights: [1, 1], micro_batch_size: 2}")],
}  # fmt: skip
# keys every case changes (the case's copy of the run)
PLACE = {"logging.dir", "checkpoint.dir"}


# ================================================================================== the table
def test_every_config_key_has_a_policy():
    keys = list(config_keys())
    assert sorted(set(keys) - set(POLICY)) == [], "config keys without a resume policy"
    assert sorted(set(POLICY) - set(keys)) == [], "policies of keys the config does not have"
    assert len(keys) == len(set(keys)) == len(POLICY)
    assert all(p.kind in (IDENTITY, ADJUSTABLE, FREE) for p in POLICY.values())
    assert sum(counts().values()) == len(POLICY)
    print("\nresume policy:", counts(), "of", len(POLICY), "keys")


def test_every_key_has_a_generated_change():
    assert sorted(set(POLICY) - set(VALUES) - LIST_KEYS) == []
    assert sorted(LIST_KEYS - set(MIX_VALUES)) == []


def _dict(**sets):
    cfg = load_config(TINY_CONFIG, [*TEST_OVERRIDES, "data.path=/x", *sets.get("o", [])])
    return to_dict(cfg)


def test_changes_and_refusal_name_keys_with_both_values():
    saved = {"config": _dict()}
    cfg = load_config(TINY_CONFIG, [*TEST_OVERRIDES, "data.path=/x", "optimizer.lr=0.01",
                                    "data.train_split=valid", "logging.tensorboard=true"])  # fmt: skip
    found = {c.key: c for c in changes(saved, cfg)}
    assert set(found) == {"optimizer.lr", "data.train_split", "logging.tensorboard"}
    assert [found[k].policy.kind for k in sorted(found)] == [IDENTITY, FREE, ADJUSTABLE]
    line = refusal(list(found.values()), cfg, "ckpt/step_1")
    assert line is not None and "\n" not in line
    assert line.startswith('data.train_split: checkpoint "train", config "valid": ckpt/step_1')
    assert "checkpoint.allow_data_change=true" in line and "optimizer.lr" not in line
    # list items: a weight is adjustable, a name identity, a count identity
    assert policy_of("data.sources[3].weight").kind == ADJUSTABLE
    assert policy_of("data.sources[0].name").kind == IDENTITY
    two = {"data": {"sources": [{"name": "a", "path": "p", "weight": 1.0}] * 2}}
    one = {"data": {"sources": [{"name": "a", "path": "p", "weight": 3.0}] * 2}}
    keys = [c.key for c in changes({"config": two}, _as_cfg(one))]
    assert keys == ["data.sources[0].weight", "data.sources[1].weight"]
    assert Change("optimizer.lr", 0.001, 0.01).text() == "optimizer.lr 0.001 -> 0.01"


def _as_cfg(d):
    """The test config with the keys of ``d`` (a nested dict) set to its values."""
    from omegaconf import OmegaConf

    from linformer_ds.config import from_dict

    return from_dict(OmegaConf.to_container(OmegaConf.merge(OmegaConf.create(_dict()), d)))


# ============================================================================ generated resumes
def _cases(seed: int = 30, pairs: int = 16):
    singles = [(k, v) for k, v in VALUES.items() if v]
    cases = [{"name": f"one_{i:03d}", "keys": [k], "set": v} for i, (k, v) in enumerate(singles)]
    rng = random.Random(seed)
    for i in range(pairs):
        (a, va), (b, vb) = rng.sample(singles, 2)
        cases.append({"name": f"pair_{i:03d}", "keys": [a, b], "set": va + vb})
    return cases


def _expected(key_values, cfg_set, r):
    """(key, expected, read back) for each adjustable key of the case."""
    v, cfg = r["values"], r["config_json"]
    o, t, ds = cfg["optimizer"], cfg["train"], cfg["deepspeed"]
    lam = r["expected_lambda"][v["last_epoch"]]
    out = []
    for key in key_values:
        if key == "optimizer.lr":
            out.append((key, [o["lr"]] * len(v["groups"]), v["base_lrs"]))
            out.append((key, [o["lr"]] * len(v["groups"]), [g["initial_lr"] for g in v["groups"]]))
        elif key == "optimizer.betas":
            out.append((key, [o["betas"]] * len(v["groups"]), [g["betas"] for g in v["groups"]]))
        elif key == "optimizer.eps":
            out.append((key, [o["eps"]] * len(v["groups"]), [g["eps"] for g in v["groups"]]))
        elif key == "optimizer.weight_decay":
            out.append((key, [o["weight_decay"], 0.0], [g["weight_decay"] for g in v["groups"]]))
        elif key.startswith("scheduler.") or key == "train.max_steps":
            out.append((key, r["expected_lambda"], v["lambda"]))
        elif key == "train.stop_at_step":
            out.append((key, min(t["max_steps"], t["stop_at_step"] or 10**9), v["end"]))
        elif key == "train.micro_batch_size":
            out.append((key, t["micro_batch_size"], v["micro_batch"]))
        elif key == "train.gradient_accumulation_steps":
            out.append((key, t["gradient_accumulation_steps"], v["gas"]))
        elif key == "train.global_batch_size":
            out.append((key, t["global_batch_size"], v["train_batch"]))
        elif key in (
            "train.log_interval",
            "train.eval_interval",
            "train.eval_batches",
            "train.nonfinite",
        ):
            out.append((key, t[key.split(".")[1]], v["loop"][key.split(".")[1]]))
        elif key == "checkpoint.save_interval":
            out.append((key, cfg["checkpoint"]["save_interval"], v["loop"]["save_interval"]))
        elif key == "data.mlm_probability":
            out.append((key, cfg["data"]["mlm_probability"], v["mlm_probability"]))
        elif key == "data.short_seq_prob":
            out.append((key, cfg["data"]["short_seq_prob"], v["short_seq_prob"]))
        elif key == "deepspeed.gradient_clipping":
            out.append((key, ds["gradient_clipping"], v["gradient_clipping"]))
            if v["clip_grad"] is not None:  # what the ZeRO / bf16 optimizer clips with
                out.append((key, ds["gradient_clipping"], v["clip_grad"]))
        elif key == "deepspeed.zero.stage":
            out.append((key, ds["zero"]["stage"], v["zero_stage"]))
        elif key == "deepspeed.precision":
            out.append((key, ds["precision"] == "bf16", v["bf16"]))
        elif key == "deepspeed.zero.offload_optimizer":
            out.append((key, ds["zero"]["offload_optimizer"], v["offload_optimizer"]))
        elif key == "parallel.shard_sequence_parameters":  # E/F sharded only where P > 1
            p = cfg["parallel"]["sequence_parallel_size"]
            want = p > 1 and cfg["parallel"]["shard_sequence_parameters"] is True
            out.append((key, want, v["sequence_sharded"]))
        elif key == "deepspeed.fp32_grad_accum":
            fp32 = ds["fp32_grad_accum"] or ds["precision"] == "fp32"
            out.append((key, fp32, v["grad_accum_dtype"] == "torch.float32"))
        elif key in (
            "deepspeed.initial_scale_power",
            "deepspeed.loss_scale_window",
            "deepspeed.hysteresis",
            "deepspeed.min_loss_scale",
        ):
            assert not v["fp16"], "an fp16 run: read the loss scaler back"  # (no fp16 on CPU)
            out.append((key, False, v["fp16"]))  # no loss scaling in this precision
        elif key in ("data.sources[].weight", "train.stages[].weights"):
            out.append((key, _stage_weights(cfg, v["stage_index"]), v["weights"]))
        elif key == "train.stages[].micro_batch_size":
            st = cfg["train"]["stages"][v["stage_index"]]
            want = st["micro_batch_size"] or cfg["train"]["micro_batch_size"]
            out.append((key, want, v["stage_micro_batch"]))
        elif key == "train.seed":
            pass  # (allowed by checkpoint.allow_seed_change: the data order follows the config)
        else:
            raise AssertionError(f"no read-back for adjustable key {key}")
    # always: the LR of the next step is the new schedule at the restored step
    out.append(("lr", [o["lr"] * lam] * len(v["groups"]), [g["lr"] for g in v["groups"]]))
    return out


def _stage_weights(cfg, k):
    """The normalized weights of stage ``k``'s sources (its own, else the sources')."""
    st = cfg["train"]["stages"][k]
    by_name = {x["name"]: x["weight"] for x in cfg["data"]["sources"]}
    w = st["weights"] or [by_name[n] for n in st["sources"]]
    return [x / sum(w) for x in w]


def _close(a, b):
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return abs(a - b) <= 1e-12 * max(1.0, abs(a))
    return a == b


def _run_cases(cases, base, overrides, tmp_path, check_case):
    """All ``cases`` in one worker process; every problem reported (not only the first)."""
    spec = {"base": str(base), "work": str(tmp_path / "work"), "cases": cases,
            "overrides": overrides}  # fmt: skip
    (tmp_path / "work").mkdir()
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    out = tmp_path / "out.json"
    env = child_env()
    proc = subprocess.run([sys.executable, WORKER, str(tmp_path / "spec.json"), str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)  # fmt: skip
    results = json.loads(out.read_text()) if out.exists() else []
    assert len(results) == len(cases), proc.stdout[-3000:] + proc.stderr[-3000:]
    tally = {"refused": 0, "started": 0, "checked values": 0}
    problems = []
    for case, r in zip(cases, results):
        try:
            check_case(case, r, tally)
        except AssertionError as e:
            problems.append(f"{case['name']} {case['set']}: {str(e)[:600]}")
    for case, r in zip(cases, results):  # shown with -s
        print(case["name"], " ".join(case["set"]), "->", r["outcome"], r.get("line", "")[:200])
    print(f"\n{len(cases)} cases: {tally}")
    assert not problems, "\n".join(problems)
    return tally


@pytest.fixture(scope="module")
def base_run(tiny_corpus, tmp_path_factory):
    run = tmp_path_factory.mktemp("policy_base")
    run_pretrain(tiny_corpus, run, BASE, nproc=1, launcher="python")
    return run


def test_generated_resumes_are_refused_or_take_effect(tiny_corpus, base_run, tmp_path):
    """Every key alone, and 16 seeded random pairs, on a one-source run."""
    overrides = [*TEST_OVERRIDES, f"data.path={tiny_corpus}", *BASE]
    _run_cases(_cases(), base_run, overrides, tmp_path, _check_case)


def test_generated_resumes_of_mixture_and_stage_keys(tiny_corpus, tmp_path_factory, tmp_path):
    """The keys of data.sources and train.stages items, on a two-source, two-stage run."""
    copy = tmp_path_factory.mktemp("corpus_copy") / "stdlib_128"
    shutil.copytree(tiny_corpus, copy)

    def fill(items):
        return [x.replace("{A}", str(tiny_corpus)).replace("{B}", str(copy)) for x in items]

    base = tmp_path_factory.mktemp("policy_mix")
    run_pretrain(tiny_corpus, base, [*BASE, *fill(MIX_BASE)], nproc=1, launcher="python")
    cases = [{"name": f"mix_{i:02d}", "keys": [k], "set": fill(v)}
             for i, (k, v) in enumerate(MIX_VALUES.items())]  # fmt: skip
    overrides = [*TEST_OVERRIDES, f"data.path={tiny_corpus}", *BASE, *fill(MIX_BASE)]
    _run_cases(cases, base, overrides, tmp_path, _check_case)


def _check_case(case, r, tally):
    """One case's outcome against the policy of its keys."""
    keys, kinds = case["keys"], {policy_of(k).kind for k in case["keys"]}
    hows = {policy_of(k).how for k in case["keys"]}
    assert r["outcome"] != "crashed", (case, r["line"], r["stdout"])
    tally[r["outcome"]] += 1
    if r["outcome"] == "refused":
        assert "\n" not in r["line"] and r["unchanged"], (case, r["line"])
        # a refusal only for what the policy refuses, or a layout DeepSpeed cannot load,
        # or a config that is invalid in itself (refused before the checkpoint is read)
        invalid = r["line"].startswith("config error") and any(k in r["line"] for k in keys)
        why_ok = IDENTITY in kinds or hows & {"layout", "engine"} or invalid
        assert why_ok, (case, r["line"])
        return
    permitted = [p.how == "data" or f"{p.allow}=true" in case["set"]
                 for p in map(policy_of, keys) if p.kind == IDENTITY]  # fmt: skip
    assert all(permitted), (case, "an identity change was not refused")
    found = {re.sub(r"\[\d+\]", "[]", k) for k in r["changes"] if k not in PLACE}
    assert set(keys) <= found | {"train.compile"}, (case, found)
    assert r["config_json"]["optimizer"] and r["history"][-1]["step"] == 2
    assert set(r["history"][-1]["changed"]) == set(r["changes"])
    adjustable = [k for k in keys if policy_of(k).kind == ADJUSTABLE]
    for key, want, got in _expected(adjustable, case["set"], r):
        assert _close(want, got), (case["name"], key, want, got)
        tally["checked values"] += 1
    line = next((x for x in r["stdout"].splitlines() if x.startswith("[resume] changed: ")), "")
    for key, kind in r["changes"].items():  # every adjustable change is announced
        assert kind != ADJUSTABLE or f" {key} " in line, (case, key, line)


# ============================================================= the case, end to end
def test_lr_change_on_resume_is_used_and_a_refusal_writes_nothing(tiny_corpus, tmp_path):
    """Issue 30: resuming with another optimizer.lr kept the old one (step 7 logged 1.667e-4
    instead of 1.667e-3). Now the resumed steps log the new schedule; config.json changes only
    after a successful start and config_history.jsonl keeps each segment's changes."""
    common = ["train.max_steps=8", "scheduler.warmup_steps=6", "optimizer.lr=1e-4"]
    run_pretrain(tiny_corpus, tmp_path, [*common, "train.stop_at_step=4"], nproc=1,
                 launcher="python")  # fmt: skip
    before = (tmp_path / "config.json").read_text()
    bad = run_pretrain(tiny_corpus, tmp_path, [*common, "data.train_split=valid"], nproc=1,
                       launcher="python", check=False)  # fmt: skip
    assert bad.returncode == 2
    err = [line for line in bad.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and 'data.train_split: checkpoint "train", config "valid"' in err[0]
    assert (tmp_path / "config.json").read_text() == before
    proc = run_pretrain(
        tiny_corpus,
        tmp_path,
        ["train.max_steps=8", "scheduler.warmup_steps=6", "optimizer.lr=1e-3"],
        nproc=1,
        launcher="python",
    )
    assert "[resume] changed: optimizer.lr 0.0001 -> 0.001" in proc.stdout
    m = read_metrics(tmp_path)
    f = lr_lambda(6, 8)
    for step in range(1, 9):  # the LR logged after step s: the schedule's value at s
        lr = 1e-4 if step <= 4 else 1e-3
        assert m[step]["lr"] == pytest.approx(lr * f(step), rel=1e-6), step
    assert json.loads((tmp_path / "config.json").read_text())["optimizer"]["lr"] == 1e-3
    history = [json.loads(x) for x in (tmp_path / "config_history.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [0, 4]
    assert history[1]["changed"]["optimizer.lr"] == [1e-4, 1e-3]


def test_a_checkpoint_older_than_a_model_option_resumes_with_its_default():
    """A checkpoint written before ``model.position_init`` / ``model.output_bias_init`` existed
    (its metadata lacks them) was trained as their defaults train: it resumes under the default
    and is refused, naming the key, under another value."""
    from linformer_ds.checkpoint.io import check_model_config
    from linformer_ds.checkpoint.tags import CheckpointError
    from linformer_ds.config import load_config

    cfg = load_config(TINY_CONFIG, TEST_OVERRIDES)
    old = cfg.model.to_dict()
    del old["position_init"], old["output_bias_init"]
    del old["local_mixer"], old["local_mixer_kernel"]
    del old["local_window"], old["positions"], old["rope_base"]  # before local + global
    del old["routed_blocks"]  # before the routed kind
    del old["routed_block"]  # before the routed kind's own block size
    check_model_config({"model": old}, cfg, "step_00000002")  # no error
    new = load_config(TINY_CONFIG, TEST_OVERRIDES + ["model.position_init=sinusoidal"])
    with pytest.raises(CheckpointError, match=r"model.position_init: checkpoint 'normal' vs "
                       r"config 'sinusoidal'"):  # fmt: skip
        check_model_config({"model": old}, new, "step_00000002")
    mixed = load_config(TINY_CONFIG, TEST_OVERRIDES + ["model.local_mixer=layers"])
    with pytest.raises(CheckpointError, match=r"model.local_mixer: checkpoint 'none' vs "
                       r"config 'layers'"):  # fmt: skip
        check_model_config({"model": old}, mixed, "step_00000002")
