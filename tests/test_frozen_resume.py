"""Frozen E/F (``model.freeze_projection=true``) saved sharded over P = 2 sequence-parallel
ranks (issue 30 item 6): a resume in a layout that needs DeepSpeed's universal checkpoint is
refused in one line before anything is converted (DeepSpeed's converter fails on frozen
sharded parameters: ``AssertionError: Unused patterns``), and a failed conversion leaves no
empty ``universal/`` behind."""

import os
from pathlib import Path
from typing import Dict

import pytest

from linformer_ds.checkpoint.reshard import convert_to_universal, frozen_universal_refusal
from linformer_ds.checkpoint.tags import UNIVERSAL_DIR, CheckpointError
from tests.pretrain_utils import TEST_OVERRIDES, TINY_CONFIG, run_pretrain

FROZEN_SHARDED = [
    "model.freeze_projection=true",
    "parallel.sequence_parallel_size=2",
    "parallel.shard_sequence_parameters=true",
    "deepspeed.zero.stage=2",
    "train.max_steps=2",
    "checkpoint.save_interval=0",
]


def _tree(root: Path) -> Dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def frozen_run(tiny_corpus, tmp_path_factory) -> Path:
    """Two steps on 2 ranks, P = 2, E/F frozen and sharded, ZeRO-2: checkpoint step_00000002."""
    run = tmp_path_factory.mktemp("frozen")
    run_pretrain(tiny_corpus, run, FROZEN_SHARDED, nproc=2)
    return run


@pytest.fixture
def _clean_env():
    saved = dict(os.environ)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(var, None)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.slow  # one 2-rank launch (~1 min on 2 busy cores)
def test_frozen_sharded_resume_on_one_rank_is_one_line(
    frozen_run, tiny_corpus, tmp_path, capsys, _clean_env
):
    """Resume on one rank (P = 1): exit 2, one line naming the saved layout, nothing written
    (no universal/, the checkpoint directory byte-identical)."""
    from linformer_ds import train

    ckpts = frozen_run / "checkpoints"
    before = _tree(ckpts)
    argv = ["--config", TINY_CONFIG, *TEST_OVERRIDES, f"data.path={tiny_corpus}",
            f"logging.dir={tmp_path / 'run'}", f"checkpoint.dir={ckpts}",
            "model.freeze_projection=true", "deepspeed.zero.stage=2",
            "train.max_steps=4"]  # fmt: skip
    rc = train.main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and err == (
        f"error: {ckpts}/step_00000002 holds frozen E/F (model.freeze_projection=true) sharded "
        "over 2 sequence-parallel ranks; this layout or engine change loads through DeepSpeed's "
        "universal checkpoint, which cannot carry frozen sharded parameters. Resume with the "
        "saved layout (2 ranks, parallel.sequence_parallel_size=2, "
        "parallel.shard_sequence_parameters=true, deepspeed.zero.stage=2), or export the "
        "weights (launch/export.py) and start a new run\n"
    ), err
    assert not (ckpts / UNIVERSAL_DIR).exists()
    assert _tree(ckpts) == before


@pytest.mark.slow  # uses the 2-rank run
def test_failed_conversion_leaves_no_universal_dir(frozen_run):
    """DeepSpeed's converter on the frozen sharded checkpoint (what a resume did before the
    refusal): one CheckpointError, and neither universal/<tag> nor an empty universal/ stays."""
    ckpts = frozen_run / "checkpoints"
    before = _tree(ckpts)
    with pytest.raises(CheckpointError, match="Unused patterns"):
        convert_to_universal(str(ckpts), "step_00000002")
    assert not (ckpts / UNIVERSAL_DIR).exists()
    assert _tree(ckpts) == before


def test_refusal_only_for_frozen_sharded_checkpoints():
    meta = {"world_size": 2, "zero_stage": 3, "sequence_parallel_size": 2,
            "shard_sequence_parameters": True, "model": {"freeze_projection": True}}  # fmt: skip
    why = frozen_universal_refusal("ck/step_00000004", meta)
    assert why is not None and why.startswith("ck/step_00000004 holds frozen E/F")
    assert "deepspeed.zero.stage=3" in why and "\n" not in why
    assert frozen_universal_refusal("ck/t", {**meta, "model": {"freeze_projection": False}}) is None
    assert frozen_universal_refusal("ck/t", {**meta, "shard_sequence_parameters": False}) is None
    assert frozen_universal_refusal("ck/t", {**meta, "sequence_parallel_size": 1}) is None
