"""The table of bad input at every entry point: each case gets one clear line naming the problem,
from the first check that can see it, and no traceback from inside a library.

Entry points: the trainer's command line (``linformer_ds.train.main``, in-process: every case
here fails before ``deepspeed.init_distributed``), the dataset, the model's ``forward``, the
checkpoint directory, and ``launch/export.py`` (``linformer_ds.export.main``). Cases that need a
real training run (a full disk, pickled code in a checkpoint) are in test_reliability.py.
"""

import json
import os
import re
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from linformer_ds import export as export_mod
from linformer_ds import train
from linformer_ds.checkpoint.io import remove_stale
from linformer_ds.checkpoint.tags import (
    COMPLETE_FILE,
    META_FILE,
    META_KEYS,
    MODEL_STATES,
    latest_tag,
    tag_problem,
)
from linformer_ds.config import load_config
from linformer_ds.data.shards import DataError, ShardDataset
from linformer_ds.model import LinformerForMaskedLM, ModelConfig
from tests.pretrain_utils import TEST_OVERRIDES, TINY_CONFIG, child_env

pytestmark = pytest.mark.usefixtures("_clean_env")  # main() fills in the rank variables


@pytest.fixture(scope="module")
def corpus_copy(tiny_corpus, tmp_path_factory):
    """A factory of private copies of the test corpus, to damage."""
    base = tmp_path_factory.mktemp("bad_data")

    def make(name: str) -> Path:
        dst = base / name
        shutil.copytree(tiny_corpus, dst)
        return dst

    return make


def _manifest(d: Path) -> dict:
    return json.loads((d / "manifest.json").read_text())


def _shard(d: Path, split: str = "train") -> Path:
    return d / _manifest(d)["splits"][split]["shards"][0]["file"]


def _set_manifest(d: Path, edit: Callable[[dict], None]) -> None:
    m = _manifest(d)
    edit(m)
    (d / "manifest.json").write_text(json.dumps(m))


# ----------------------------------------------------------------------- damaged datasets
def data_corrupt_shard(d: Path) -> None:
    _shard(d).write_bytes(b"this is not a numpy file" * 10)


def data_truncated_shard(d: Path) -> None:
    p = _shard(d)
    p.write_bytes(p.read_bytes()[:-1000])


def data_manifest_rows(d: Path) -> None:
    _set_manifest(d, lambda m: m["splits"]["train"].update(rows=m["splits"]["train"]["rows"] + 1))


def data_empty_split(d: Path) -> None:
    _set_manifest(d, lambda m: m["splits"]["train"].update(rows=0, shards=[]))


def data_corrupt_manifest(d: Path) -> None:
    (d / "manifest.json").write_text('{"format_version": 1, "seq_len": ')


def data_no_manifest(d: Path) -> None:
    (d / "manifest.json").unlink()


def data_no_mask_id(d: Path) -> None:
    _set_manifest(d, lambda m: m["special_ids"].pop("mask"))


def data_special_id_outside_vocab(d: Path) -> None:
    _set_manifest(d, lambda m: m["special_ids"].update(mask=5000))


def data_manifest_not_an_object(d: Path) -> None:
    (d / "manifest.json").write_text("[1, 2]")


# ----------------------------------------------------------------------- bad checkpoints
def _tag(
    run: Path,
    tag: str,
    model: dict,
    complete: bool = True,
    meta: bool = True,
    meta_extra: dict | None = None,
) -> Path:
    d = run / "checkpoints" / tag
    d.mkdir(parents=True)
    if meta:
        m = {k: 0 for k in META_KEYS} | {"format_version": 1, "world_size": 1}
        m.update(model=model, sampler={"epoch": 0, "consumed": 0}, **(meta_extra or {}))
        (d / META_FILE).write_text(json.dumps(m))
    (d / MODEL_STATES).write_bytes(b"")
    if complete:
        (d / COMPLETE_FILE).write_text(json.dumps({"files": {}}))
    return d


def _model_dict(*overrides: str) -> dict:
    return load_config(TINY_CONFIG, TEST_OVERRIDES + list(overrides)).model.to_dict()


def ckpt_not_a_checkpoint(run: Path) -> None:
    (run / "checkpoints" / "step_00000002").mkdir(parents=True)
    (run / "checkpoints" / "step_00000002" / "notes.txt").write_text("hello")


def ckpt_other_model(run: Path) -> None:
    _tag(run, "step_00000002", _model_dict("model.k=16"))


def ckpt_incomplete(run: Path) -> None:
    _tag(run, "step_00000002", _model_dict(), complete=False)


def ckpt_corrupt_meta(run: Path) -> None:
    d = _tag(run, "step_00000002", _model_dict())
    (d / META_FILE).write_text("{not json")


def ckpt_newer_format(run: Path) -> None:
    d = _tag(run, "step_00000002", _model_dict())
    m = json.loads((d / META_FILE).read_text())
    (d / META_FILE).write_text(json.dumps(m | {"format_version": 99}))


def ckpt_zero2_bf16(run: Path) -> None:
    _tag(run, "step_00000002", _model_dict(), meta_extra={"zero_stage": 2, "precision": "bf16"})


def ckpt_seed_42(run: Path) -> None:
    meta = {"zero_stage": 2, "precision": "bf16", "config": {"train": {"seed": 42}}}
    _tag(run, "step_00000002", _model_dict(), meta_extra=meta)


def ckpt_dir_is_a_file(run: Path) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "checkpoints").write_text("a file, not a directory")


# (id, extra overrides, setup(run_dir, data_dir) or None, damage of the data copy or None, message)
MAIN_CASES = [
    ("config-unknown-key", ["model.nope=1"], None, None, "model.nope: Key 'nope' not in"),
    ("config-wrong-type", ["train.max_steps=ten"], None, None, "train.max_steps: Value 'ten'"),
    ("config-k-too-large", ["model.k=512"], None, None, "model.k: k=512 must be in [1,"),
    (
        "config-heads-do-not-divide",
        ["model.num_heads=3"],
        None,
        None,
        "model.hidden_size: 64 is not divisible by num_heads=3",
    ),
    ("config-negative-lr", ["optimizer.lr=-1"], None, None, "optimizer.lr: must be > 0, got -1"),
    (
        "config-global-batch",
        ["train.global_batch_size=10"],
        None,
        None,
        "train.global_batch_size: 10 is not micro_batch_size",
    ),
    ("config-not-key-value", ["train.max_steps"], None, None, "is not of the form key=value"),
    ("config-bad-precision", ["deepspeed.precision=fp8"], None, None, "must be fp32, bf16 or"),
    (
        "config-skip-unsupported",
        ["train.nonfinite=skip", "deepspeed.precision=fp32", "deepspeed.zero.stage=0"],
        None,
        None,
        "train.nonfinite: 'skip' needs an optimizer that DeepSpeed can make skip a step",
    ),
    (
        "config-eval-resolver",
        ["name=${eval:__import__}"],
        None,
        None,
        "Unsupported interpolation type eval",
    ),
    # -- every numeric key: finite and in range (issue 14)
    (
        "config-lr-nan",
        ["optimizer.lr=nan"],
        None,
        None,
        "optimizer.lr: must be a finite number, got nan",
    ),
    (
        "config-lr-inf",
        ["optimizer.lr=inf"],
        None,
        None,
        "optimizer.lr: must be a finite number, got inf",
    ),
    (
        "config-eps-negative",
        ["optimizer.eps=-1"],
        None,
        None,
        "optimizer.eps: must be > 0, got -1.0",
    ),
    (
        "config-weight-decay-negative",
        ["optimizer.weight_decay=-5"],
        None,
        None,
        "optimizer.weight_decay: must be >= 0, got -5.0",
    ),
    (
        "config-clip-nan",
        ["deepspeed.gradient_clipping=nan"],
        None,
        None,
        "deepspeed.gradient_clipping: must be a finite number, got nan",
    ),
    (
        "config-stop-at-negative",
        ["train.stop_at_step=-5"],
        None,
        None,
        "train.stop_at_step: must be >= 1 (or null: run to max_steps), got -5",
    ),
    (
        "config-bucket-zero",
        ["deepspeed.zero.reduce_bucket_size=0"],
        None,
        None,
        "deepspeed.zero.reduce_bucket_size: must be >= 1 (elements), got 0",
    ),
    ("config-seed-negative", ["train.seed=-1"], None, None, "train.seed: must be in [0, 2**32)"),
    (
        "config-eval-batches-negative",
        ["train.eval_batches=-1"],
        None,
        None,
        "train.eval_batches: must be >= 0 (0 turns evaluation off), got -1",
    ),
    (
        "config-keep-last-negative",
        ["checkpoint.keep_last=-1"],
        None,
        None,
        "checkpoint.keep_last: must be >= 0 (0: all), got -1",
    ),
    ("config-model-dropout-nan", ["model.dropout=nan"], None, None, "model.dropout: must be in"),
    (
        "config-layer-norm-eps-zero",
        ["model.layer_norm_eps=0"],
        None,
        None,
        "model.layer_norm_eps: must be > 0, got 0.0",
    ),
    (
        "config-loss-scale-window-zero",
        ["deepspeed.loss_scale_window=0"],
        None,
        None,
        "deepspeed.loss_scale_window: must be >= 1, got 0",
    ),
    (
        "config-zero0-bf16-fp32-accum",
        ["deepspeed.zero.stage=0"],
        None,
        None,
        "deepspeed.fp32_grad_accum: zero.stage=0 with bf16 cannot accumulate gradients in fp32",
    ),
    (
        "config-unknown-backend",
        ["deepspeed.dist_backend=nccx"],
        None,
        None,
        "deepspeed.dist_backend: must be one of gloo, nccl, mpi, ccl, hccl",
    ),
    (
        "config-nccl-on-cpu",
        ["deepspeed.dist_backend=nccl"],
        None,
        None,
        "deepspeed.dist_backend: nccl is not available with this machine's cpu accelerator",
    ),
    # -- deepspeed.extra, checked by DeepSpeed's own config classes before any process group
    (
        "config-extra-nested-typo",
        ["deepspeed.extra.zero_optimization.reduce_bucket_sise=5"],
        None,
        None,
        "deepspeed.extra.zero_optimization.reduce_bucket_sise: Extra inputs are not "
        "permitted (got 5)",
    ),
    (
        "config-extra-top-level-typo",
        ["deepspeed.extra.gradient_clippin=1.0"],
        None,
        None,
        "deepspeed.extra.gradient_clippin: DeepSpeed does not read this key; did you mean "
        "'gradient_clipping'?",
    ),
    (
        "config-extra-bad-value",
        ["deepspeed.extra.zero_optimization.offload_optimizer.pin_memory=maybe"],
        None,
        None,
        "deepspeed.extra.zero_optimization.offload_optimizer.pin_memory: Input should be a "
        "valid boolean, unable to interpret input (got 'maybe')",
    ),
    (
        "config-extra-owned-offload",
        ["deepspeed.extra.zero_optimization.offload_optimizer.device=cpu"],
        None,
        None,
        "deepspeed.extra.zero_optimization.offload_optimizer.device: the job config sets it; "
        "use deepspeed.zero.offload_optimizer instead",
    ),
    (
        "config-extra-owned-key",
        ["deepspeed.extra.train_batch_size=7"],
        None,
        None,
        "deepspeed.extra.train_batch_size: the job config sets it; use train.global_batch_size",
    ),
    (
        "config-extra-bf16-typo",
        ["deepspeed.extra.bf16.enabld=true"],
        None,
        None,
        "deepspeed.extra.bf16.enabld: the job config sets it; use deepspeed.precision instead",
    ),
    ("data-missing", ["data.path=/nonexistent/data"], None, None, "no manifest.json"),
    ("data-no-manifest", [], None, data_no_manifest, "no manifest.json (not a data_prep output)"),
    ("data-corrupt-manifest", [], None, data_corrupt_manifest, "corrupt manifest"),
    ("data-corrupt-shard", [], None, data_corrupt_shard, "is corrupt: not a readable .npy"),
    ("data-truncated-shard", [], None, data_truncated_shard, "is truncated:"),
    ("data-manifest-rows", [], None, data_manifest_rows, "manifest mismatch: split 'train' lists"),
    ("data-empty-split", [], None, data_empty_split, "split 'train' is empty (0 rows)"),
    ("data-no-such-split", ["data.train_split=nope"], None, None, "no split 'nope'"),
    ("data-no-mask-id", [], None, data_no_mask_id, "special_ids lacks ['mask']"),
    (
        "data-special-id-outside-vocab",
        [],
        None,
        data_special_id_outside_vocab,
        "special_ids.mask = 5000 is not a token id in [0, 2000)",
    ),
    (
        "data-manifest-not-an-object",
        [],
        None,
        data_manifest_not_an_object,
        "corrupt manifest (not a JSON object)",
    ),
    (
        "data-vocab-larger-than-model",
        ["model.vocab_size=1000"],
        None,
        None,
        "dataset vocab_size 2000 > model vocab_size 1000",
    ),
    (
        "data-seq-longer-than-model",
        ["model.max_seq_len=64"],
        None,
        None,
        "dataset seq_len 128 > model max_seq_len 64",
    ),
    (
        "ckpt-missing-tag",
        ["checkpoint.resume=step_00000100"],
        None,
        None,
        "checkpoint.resume: tag 'step_00000100' not found",
    ),
    (
        "ckpt-not-a-checkpoint",
        ["checkpoint.resume=step_00000002"],
        ckpt_not_a_checkpoint,
        None,
        "is not a linformer_ds checkpoint (no linformer_meta.json)",
    ),
    (
        "ckpt-other-model",
        [],
        ckpt_other_model,
        None,
        "different model config (model.k: checkpoint 16 vs config 32)",
    ),
    (
        "ckpt-incomplete-named",
        ["checkpoint.resume=step_00000002"],
        ckpt_incomplete,
        None,
        "is incomplete (no COMPLETE marker: the save was interrupted)",
    ),
    (
        "ckpt-corrupt-meta",
        ["checkpoint.resume=step_00000002"],
        ckpt_corrupt_meta,
        None,
        "linformer_meta.json is unreadable",
    ),
    (
        "ckpt-newer-format",
        [],
        ckpt_newer_format,
        None,
        "has format_version 99; this linformer_ds reads <= 1",
    ),
    (
        "ckpt-zero-stage-2-to-3",
        ["deepspeed.zero.stage=3"],
        ckpt_zero2_bf16,
        None,
        "was saved with zero.stage=2 precision=bf16; this config has deepspeed.zero.stage "
        "2 -> 3, which DeepSpeed cannot load. Resume with deepspeed.zero.stage=2",
    ),
    (
        "ckpt-precision-to-fp16",
        ["deepspeed.precision=fp16", "deepspeed.zero.stage=2"],
        ckpt_zero2_bf16,
        None,
        "this config has deepspeed.precision bf16 -> fp16, which DeepSpeed cannot load",
    ),
    (
        "ckpt-seed-change",
        ["train.seed=7"],
        ckpt_seed_42,
        None,
        "train.seed: {run}/checkpoints/step_00000002 was trained with seed 42, this config has 7",
    ),
    (
        "ckpt-dir-is-a-file",
        [],
        ckpt_dir_is_a_file,
        None,
        "checkpoint.dir {run}/checkpoints is not writable",
    ),
]


@pytest.mark.parametrize(
    "overrides,setup,damage,message", [c[1:] for c in MAIN_CASES], ids=[c[0] for c in MAIN_CASES]
)
def test_trainer_entry_point(
    overrides, setup, damage, message, tiny_corpus, corpus_copy, tmp_path, capsys
):
    run = tmp_path / "run"
    data = corpus_copy(tmp_path.name) if damage else tiny_corpus
    if damage:
        damage(data)
    if setup:
        setup(run)
    argv = ["--config", TINY_CONFIG, *TEST_OVERRIDES, f"data.path={data}", f"logging.dir={run}"]
    rc = train.main(argv + list(overrides))
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert message.format(run=run) in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert not Path("/tmp/linformer_pwned").exists()


# A config must say what to train on and what to train: the schema's defaults (data/stdlib, the
# 102M-parameter BERT-base model) describe no run the user asked for (issue 14, point 3).
YAML_CASES = [
    ("empty-file", "", [], "the config file sets nothing"),
    ("only-comments", "# nothing here\n", [], "the config file sets nothing"),
    ("no-data-path", "model:\n  k: 32\n", [], "data.path: not set"),
    ("no-model", "data:\n  path: data/x\n", [], "model: not set; the config would train the "
     "schema's default 102M-parameter model"),
    ("no-config-at-all", None, [], "no job config: pass --config FILE"),
]  # fmt: skip


@pytest.mark.parametrize(
    "text,overrides,message", [c[1:] for c in YAML_CASES], ids=[c[0] for c in YAML_CASES]
)
def test_config_must_set_data_and_model(text, overrides, message, tmp_path, capsys):
    argv = list(overrides)
    if text is not None:
        (tmp_path / "job.yaml").write_text(text)
        argv = ["--config", str(tmp_path / "job.yaml"), *argv]
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err, err


def test_config_set_by_overrides_alone_is_enough():
    """The tests' style (and a user's): a model section and data.path given as overrides."""
    cfg = load_config(None, ["data.path=d", "model.hidden_size=64", "model.num_heads=4"])
    assert cfg.data.path == "d" and cfg.model.hidden_size == 64
    cfg = load_config(TINY_CONFIG, ["train.max_steps=3"])  # the README's command
    assert cfg.model.hidden_size == 128 and cfg.data.path == "data/stdlib"


def test_config_file_cannot_run_code(tmp_path, capsys):
    """YAML tags that construct Python objects are refused (OmegaConf loads YAML safely), and no
    resolver beyond OmegaConf's built-ins exists."""
    from omegaconf import OmegaConf

    target = tmp_path / "pwned"
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"name: !!python/object/apply:os.system ['touch {target}']\n")
    assert train.main(["--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: not valid YAML" in err and not target.exists()
    for name in ("eval", "exec", "python", "import", "shell", "env"):
        assert not OmegaConf.has_resolver(name), name


# ----------------------------------------------------------------------- dataset, directly
def test_tokens_outside_vocabulary_named_with_row(corpus_copy):
    d = corpus_copy("oov")
    p = _shard(d)
    arr = np.load(p)
    arr[7, 5] = 65000
    np.save(p, arr)
    ds = ShardDataset(d, "train")
    assert torch.equal(ds[6], torch.from_numpy(arr[6].astype(np.int64)))  # other rows fine
    with pytest.raises(DataError, match=r"row 7 holds token id 65000 >= vocab_size 2000"):
        ds[7]
    with pytest.raises(DataError, match=r"sha256 .* does not match the manifest"):
        ds.verify()


# ----------------------------------------------------------------------- model input
@pytest.fixture(scope="module")
def tiny_model():
    cfg = ModelConfig(
        vocab_size=100, max_seq_len=16, hidden_size=16, num_layers=1, num_heads=2,
        intermediate_size=32, k=4,
    )  # fmt: skip
    return LinformerForMaskedLM(cfg).eval()


MODEL_CASES = [
    ("too-long", dict(input_ids=torch.ones(2, 17, dtype=torch.long)), ValueError,
     "sequence length 17 exceeds the model's max_seq_len 16"),
    ("float-ids", dict(input_ids=torch.ones(2, 8)), TypeError,
     "input_ids must be an integer tensor, got dtype torch.float32"),
    ("1d-ids", dict(input_ids=torch.ones(8, dtype=torch.long)), ValueError,
     "input_ids must be [batch, seq_len], got shape (8,)"),
    ("mask-shape", dict(input_ids=torch.ones(2, 8, dtype=torch.long),
                        attention_mask=torch.ones(2, 7, dtype=torch.long)), ValueError,
     "attention_mask shape (2, 7) does not match input_ids shape (2, 8)"),
    ("labels-shape", dict(input_ids=torch.ones(2, 8, dtype=torch.long),
                          labels=torch.ones(2, 4, dtype=torch.long)), ValueError,
     "labels shape (2, 4) does not match input_ids (2, 8)"),
    ("list-ids", dict(input_ids=[[1, 2, 3]]), TypeError, "input_ids must be a torch.Tensor"),
]  # fmt: skip


@pytest.mark.parametrize(
    "kwargs,exc,message", [c[1:] for c in MODEL_CASES], ids=[c[0] for c in MODEL_CASES]
)
def test_model_input(tiny_model, kwargs, exc, message):
    with pytest.raises(exc) as e:
        tiny_model(**kwargs)
    assert message in str(e.value)


# ----------------------------------------------------------------------- export CLI
def _export_cases(root: Path) -> list:
    model = _model_dict()
    good = root / "good"
    _tag(good, "step_00000002", model)
    (good / "checkpoints" / "latest").write_text("step_00000002")
    nolatest = root / "nolatest"
    _tag(nolatest, "step_00000002", model)
    incomplete = root / "incomplete"
    _tag(incomplete, "step_00000002", model, complete=False)
    nometa = root / "nometa"
    _tag(nometa, "step_00000002", model, meta=False)
    out = root / "out_full"
    out.mkdir()
    (out / "x").write_text("x")
    c = "checkpoints"
    return [
        ("no-dir", ["--checkpoint", str(root / "nope")], "no such directory"),
        # without 'latest' the newest valid tag is used (as a resume would): its tokenizer
        ("no-latest", ["--checkpoint", str(nolatest / c)], "step_00000002/tokenizer.model not found"),
        ("missing-tag", ["--checkpoint", str(good / c), "--tag", "step_9"], "tag 'step_9' not found"),
        ("incomplete", ["--checkpoint", str(incomplete / c), "--tag", "step_00000002"],
         "is incomplete (no COMPLETE marker"),
        ("not-a-checkpoint", ["--checkpoint", str(nometa / c), "--tag", "step_00000002"],
         "is not a linformer_ds checkpoint"),
        ("no-tokenizer", ["--checkpoint", str(good / c), "--tokenizer", str(root / "nope.model")],
         "tokenizer"),
    ]  # fmt: skip


EXPORT_IDS = [
    "no-dir",
    "no-latest",
    "missing-tag",
    "incomplete",
    "not-a-checkpoint",
    "no-tokenizer",
]


@pytest.mark.parametrize("index", range(len(EXPORT_IDS)), ids=EXPORT_IDS)
def test_export_entry_point(index, tmp_path, capsys):
    _, argv, message = _export_cases(tmp_path)[index]
    rc = export_mod.main(argv + ["--out", str(tmp_path / "exported")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and message in err and err.startswith("export failed: "), err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_export_bad_dtype_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        export_mod.main(
            ["--checkpoint", str(tmp_path), "--out", str(tmp_path / "o"), "--dtype", "int3"]
        )
    assert e.value.code == 2
    assert "argument --dtype: invalid choice: 'int3'" in capsys.readouterr().err


# ----------------------------------------------------------------------- launcher environment
def test_bad_rank_variable(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "abc")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert train.main(["--config", TINY_CONFIG]) == 2
    err = capsys.readouterr().err.strip()
    assert "environment variable RANK must be an integer, got 'abc'" in err
    assert len(err.splitlines()) == 1


def test_validation_falls_back_from_damaged_tags(tmp_path):
    """Validate on load: the newest tags (truncated file, missing shard, no marker) are skipped
    with a warning naming each problem; the newest valid tag is used."""
    model = _model_dict()
    d = tmp_path / "checkpoints"
    good = _tag(tmp_path, "step_00000002", model)
    (good / MODEL_STATES).write_bytes(b"x" * 10)
    (good / COMPLETE_FILE).write_text(json.dumps({"files": {MODEL_STATES: 10}}))
    trunc = _tag(tmp_path, "step_00000004", model)
    (trunc / MODEL_STATES).write_bytes(b"x" * 5)
    (trunc / COMPLETE_FILE).write_text(json.dumps({"files": {MODEL_STATES: 10}}))
    shards = _tag(tmp_path, "step_00000006", model)
    meta = json.loads((shards / META_FILE).read_text())
    (shards / META_FILE).write_text(json.dumps(meta | {"zero_stage": 2, "world_size": 2}))
    (shards / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    _tag(tmp_path, "step_00000008", model, complete=False)
    (d / "latest").write_text("step_00000006")
    with pytest.warns(UserWarning) as rec:
        assert latest_tag(str(d)) == "step_00000002"
    msg = str(rec[0].message)
    assert "step_00000008 (incomplete (no COMPLETE marker" in msg
    assert "step_00000006 (1 optimizer shards for 2 saved ranks)" in msg
    assert f"step_00000004 ({MODEL_STATES} has 5 bytes, 10 when saved (truncated))" in msg
    assert remove_stale(str(d)) == ["step_00000008"]


# ----------------------------------------------------------------------- data_prep CLI
def _data_prep(argv: list[str], capsys) -> tuple:
    from data_prep.__main__ import main as data_prep_main

    # --valid-fraction 0: the inputs are a few documents, too few for a valid split
    rc = data_prep_main(["--seq-len", "32", "--vocab-size", "200", "--workers", "0",
                         "--valid-fraction", "0", *argv])  # fmt: skip
    return rc, capsys.readouterr().err.strip()


@pytest.fixture(scope="module")
def mixed_inputs(tmp_path_factory) -> Path:
    """A binary file, the same French-ish text as UTF-8 and as Latin-1 (3000 lines)."""
    import random

    d = tmp_path_factory.mktemp("mixed")
    rng = random.Random(0)
    words = "café été crêpe garçon naïve façade élève déjà où très père mère rôle forêt".split()
    words += ["".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(2, 8)))
              for _ in range(300)]  # fmt: skip
    text = "\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(3000)) + "\n"
    (d / "text").mkdir()
    (d / "text" / "utf8.txt").write_text(text, encoding="utf-8")
    (d / "latin1.txt").write_bytes(text.encode("latin-1"))
    (d / "text" / "image.bin").write_bytes(np.random.default_rng(0).bytes(20000))
    return d


def test_data_prep_skips_binary_files_and_counts_them(mixed_inputs, tmp_path, capsys):
    rc, err = _data_prep(["--source", str(mixed_inputs / "text"), "--out", str(tmp_path / "o"),
                          "--quiet"], capsys)  # fmt: skip
    assert rc == 0, err
    assert err == (
        "data_prep: warning: skipped 1 input file(s) that are not text (NUL or control bytes), "
        f"e.g. {mixed_inputs / 'text' / 'image.bin'}"
    )
    m = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert m["source"]["binary_files_skipped"] == 1 and m["source"]["undecodable_bytes"] == 0
    assert m["source"]["documents"] == 1  # only utf8.txt


def test_data_prep_only_binary_input_is_one_line_exit_2(mixed_inputs, tmp_path, capsys):
    rc, err = _data_prep(["--source", str(mixed_inputs / "text" / "image.bin"),
                          "--out", str(tmp_path / "o")], capsys)  # fmt: skip
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "the corpus is empty" in err and "1 file(s) skipped as not text" in err
    assert not (tmp_path / "o").exists()  # nothing of value: no trace left


def test_data_prep_latin1_with_and_without_encoding(mixed_inputs, tmp_path, capsys):
    """Read as UTF-8, every byte >= 0x80 of the Latin-1 file is lost (counted, warned about);
    with ``--encoding latin-1`` none is, and the tokenizer round-trips the accented words."""
    import sentencepiece as spm

    raw = (mixed_inputs / "latin1.txt").read_bytes()
    high = sum(b >= 0x80 for b in raw)
    src = ["--source", str(mixed_inputs / "latin1.txt"), "--quiet"]
    rc, err = _data_prep(src + ["--out", str(tmp_path / "utf8")], capsys)
    assert rc == 0, err
    assert f"replaced {high} bytes that are not utf-8 with U+FFFD" in err and "--encoding" in err
    m = json.loads((tmp_path / "utf8" / "manifest.json").read_text())
    assert m["source"]["undecodable_bytes"] == high > 0
    rc, err = _data_prep(src + ["--out", str(tmp_path / "l1"), "--encoding", "latin-1"], capsys)
    assert rc == 0 and err == "", err
    m = json.loads((tmp_path / "l1" / "manifest.json").read_text())
    assert m["source"]["undecodable_bytes"] == 0 and m["source"]["encoding"] == "latin-1"
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "l1" / "tokenizer.model"))
    for word in ("café", "garçon", "forêt"):
        assert sp.decode(sp.encode(word)) == word


DATA_PREP_CASES = [
    ("unknown-encoding", ["--encoding", "klingon"], "--encoding 'klingon' is not a text encoding"),
    ("coverage-zero", ["--character-coverage", "0"], "--character-coverage must be in (0, 1]"),
    ("coverage-nan", ["--character-coverage", "nan"], "--character-coverage must be in (0, 1]"),
    ("valid-fraction-one", ["--valid-fraction", "1"], "--valid-fraction must be in [0, 1)"),
    ("seq-len-tiny", ["--seq-len", "4"], "--seq-len 4 is too small"),
    ("seed-negative", ["--seed", "-1"], "--seed must be in [0, 2**32)"),
    ("missing-input", ["--source", "/nonexistent/x.txt"], "input path does not exist"),
]  # fmt: skip


@pytest.mark.parametrize(
    "argv,message", [c[1:] for c in DATA_PREP_CASES], ids=[c[0] for c in DATA_PREP_CASES]
)
def test_data_prep_bad_flags(argv, message, mixed_inputs, tmp_path, capsys):
    base = ["--source", str(mixed_inputs / "latin1.txt"), "--out", str(tmp_path / "o")]
    rc, err = _data_prep(base + argv, capsys)
    assert rc == 2 and message in err and err.startswith("data_prep: error: "), err
    assert len(err.splitlines()) == 1 and not (tmp_path / "o").exists()


# ----------------------------------------------------------------------- causal use of the export
def test_causal_use_is_refused_with_the_reason(tiny_corpus, tmp_path):
    """Linformer cannot be causal: AutoModelForCausalLM on an export, is_decoder=True,
    is_causal=True and a [B, n, n] mask each get one line with the reason."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    from linformer_ds.export import TIED_KEY, write_model_dir
    from linformer_ds.hf import LinformerConfig

    mc = ModelConfig(
        vocab_size=2000, max_seq_len=32, hidden_size=16, num_layers=1, num_heads=2,
        intermediate_size=32, k=4,
    )  # fmt: skip
    state = {k: v for k, v in LinformerForMaskedLM(mc).state_dict().items() if k != TIED_KEY}
    out = tmp_path / "export"
    write_model_dir(str(out), mc, state, str(tiny_corpus / "tokenizer.model"))
    reason = "Linformer cannot be causal: its sequence projections"
    with pytest.raises(ValueError, match=reason):
        AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    config = AutoConfig.from_pretrained(out, trust_remote_code=True)
    with pytest.raises(ValueError, match=reason):
        AutoModelForCausalLM.from_config(config, trust_remote_code=True)
    with pytest.raises(ValueError, match="is_decoder=True: " + reason):
        LinformerConfig(**mc.to_dict() | {"is_decoder": True})
    model = AutoModel.from_pretrained(out, trust_remote_code=True).eval()
    ids = torch.ones(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="is_causal is not supported: " + reason):
        model(ids, is_causal=True)
    causal = torch.tril(torch.ones(1, 8, 8, dtype=torch.long))
    with pytest.raises(ValueError, match=r"attention_mask must be \[batch, seq_len\]"):
        model(ids, attention_mask=causal)
    assert model(ids).last_hidden_state.shape == (1, 8, 16)  # the encoder itself works


# ----------------------------------------------------------------------- finetune CLI flags
FINETUNE_CASES = [
    ("epochs-nan", ["--epochs", "nan"], "--epochs must be > 0 (and finite), got nan"),
    ("lr-negative", ["--lr", "-1"], "--lr must be > 0 (and finite), got -1.0"),
    ("batch-size-zero", ["--batch-size", "0"], "--batch-size must be > 0 (and finite), got 0"),
    ("max-grad-norm-zero", ["--max-grad-norm", "0"], "--max-grad-norm must be > 0"),
    ("weight-decay-negative", ["--weight-decay", "-1"], "--weight-decay must be in [0, inf)"),
    ("warmup-ratio-above-1", ["--warmup-ratio", "1.5"], "--warmup-ratio must be in [0, 1)"),
    ("validation-fraction-0", ["--validation-fraction", "0"],
     "--validation-fraction must be in (0, 1), got 0.0"),
    ("seed-negative", ["--seed", "-1"], "--seed must be in [0, 2**32), got -1"),
    ("out-under-a-file", ["--out", "{root}/afile/sub"],
     "--out {root}/afile/sub: {root}/afile is not a directory"),
]  # fmt: skip


@pytest.mark.parametrize(
    "argv,message", [c[1:] for c in FINETUNE_CASES], ids=[c[0] for c in FINETUNE_CASES]
)
def test_finetune_bad_flags(argv, message, tmp_path, capsys):
    """Every numeric flag in range, --out writable: checked before data or model are loaded."""
    from linformer_ds.finetune import main as finetune_main

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (tmp_path / "afile").write_text("x")
    argv = [a.format(root=tmp_path) for a in argv]
    base = ["--model", str(model), "--train", str(tmp_path / "train.csv")]
    if "--out" not in argv:
        base += ["--out", str(tmp_path / "out")]
    rc = finetune_main(base + argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("finetune failed: ") and len(err.splitlines()) == 1, err
    assert message.format(root=tmp_path) in err, err


# ----------------------------------------------------------------------- checkpoint pointers
@pytest.mark.parametrize(
    "setup,override,message",
    [
        (
            lambda c: (c / "latest").mkdir(parents=True),
            [],
            r"latest is not a regular file \(the trainer writes the newest tag's name there\)",
        ),
        (
            lambda c: c.mkdir(parents=True),
            ["checkpoint.resume=../.."],
            r"checkpoint.resume: .*(is not a tag name|a tag name inside checkpoint.dir)",
        ),
        (
            lambda c: c.mkdir(parents=True),
            ["checkpoint.resume=../../other/step_00000004"],
            r"checkpoint.resume: .*(is not a tag name|a tag name inside checkpoint.dir)",
        ),
    ],
    ids=["latest-is-a-directory", "resume-dotdot", "resume-other-run"],
)
def test_checkpoint_pointer_problems_fail_at_start(tiny_corpus, tmp_path, capsys, monkeypatch,
                                                   setup, override, message):  # fmt: skip
    """issue 21: a `latest` that is a directory was reported only after training ("could not
    write step_8"); a tag that is a path could name another run's checkpoint. Both fail at
    start, before any process group, in one line. "Before any process group" is checked on the
    call itself: an earlier in-process run on the same test worker may have left one."""
    from linformer_ds import engine

    started = []
    monkeypatch.setattr(engine, "init_process_group", lambda *a, **k: started.append(a))
    setup(tmp_path / "run" / "checkpoints")
    argv = ["--config", TINY_CONFIG, *TEST_OVERRIDES, f"data.path={tiny_corpus}",
            f"logging.dir={tmp_path / 'run'}", *override]  # fmt: skip
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert re.search(message, err) and len(err.splitlines()) == 1, err
    assert started == []


def test_a_failed_start_in_process_leaves_the_callers_signals_alone(tmp_path):
    """train.main in a caller's own process (a notebook) that fails at data loading, after the
    start-up watchdog armed: the caller's handlers are back, and a signal reaches them. Before,
    the armed watchdog ended the caller's process on it (exit 75, "SIGUSR1 during start-up")."""
    got = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))
    try:
        handler = signal.getsignal(signal.SIGUSR1)
        argv = ["--config", TINY_CONFIG, *TEST_OVERRIDES, f"data.path={tmp_path / 'none'}",
                f"logging.dir={tmp_path / 'run'}"]  # fmt: skip
        assert train.main(argv) == 2
        assert signal.getsignal(signal.SIGUSR1) is handler
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.5)  # the watchdog's turn: it read the signal within its poll, if armed
        assert got == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_latest_that_is_not_a_tag_name_is_never_followed(tmp_path):
    """`latest` holding a path to another run's tag, or bytes ff fe: not followed; the newest
    valid tag of this directory is used, with a warning naming the problem."""
    model = _model_dict()
    other = _tag(tmp_path / "other", "step_00000004", model)
    _tag(tmp_path, "step_00000002", model)
    d = tmp_path / "checkpoints"
    for content in (b"../../other/checkpoints/step_00000004", b"\xff\xfe", str(other).encode()):
        (d / "latest").write_bytes(content)
        with pytest.warns(UserWarning, match=r"'latest' names '\(not a tag name\)'"):
            assert latest_tag(str(d)) == "step_00000002"
    assert tag_problem(str(d), "../../other/checkpoints/step_00000004").startswith(
        "'../../other/checkpoints/step_00000004' is not a tag name"
    )
    os.symlink(other, d / "step_00000009")  # a tag directory that links elsewhere
    assert "outside" in tag_problem(str(d), "step_00000009")


def test_checkpoint_past_ulimit_f_is_one_line(tiny_corpus, tmp_path):
    """issue 21: a checkpoint write stopped by `ulimit -f` said "unexpected pos" (torch.save);
    now one line that names the limit, exit 2, no traceback."""
    import resource
    import subprocess
    import sys

    from tests.pretrain_utils import PRETRAIN, REPO

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))

    env = child_env()
    cmd = [sys.executable, PRETRAIN, "--config", TINY_CONFIG, *TEST_OVERRIDES,
           f"data.path={tiny_corpus}", f"logging.dir={tmp_path / 'run'}", "train.max_steps=1",
           "deepspeed.precision=fp32"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
                          preexec_fn=limit)  # fmt: skip
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "could not write checkpoint" in errors[0] and "ulimit -f" in errors[0], errors[0]
    assert "Traceback" not in proc.stderr
