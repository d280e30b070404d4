"""Frozen E/F (``model.freeze_projection=true``) saved sharded over P = 2 sequence-parallel
ranks (issue 30 item 6). DeepSpeed's universal converter failed on them (``AssertionError:
Unused patterns``: frozen parameters have no optimizer state) and left an empty
``universal/``. The conversion now allows those patterns and the frozen weights are
restored from the saved files: the run resumes on one rank and on DP = 2 (ZeRO-2), on one rank
(ZeRO-3); into a sharded ZeRO-3 layout it is refused in one line before anything is converted."""

import os
import shutil
from pathlib import Path
from typing import Dict

import pytest
import torch

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


def _saved_frozen_whole(ckpt: Path, tag: str, p: int) -> Dict[str, torch.Tensor]:
    """The frozen E/F of a checkpoint saved with them sharded over ``p`` ranks, whole."""
    mods = [torch.load(ckpt / tag / f"mp_rank_{r:02d}_model_states.pt", weights_only=False)["module"]
            for r in range(p)]  # fmt: skip
    names = [n for n in mods[0] if n.endswith(("proj_k.weight", "proj_v.weight",
                                               "shared_linear.weight"))]  # fmt: skip
    assert names
    return {n: torch.cat([m[n] for m in mods], 2) for n in names}


@pytest.mark.slow  # one 2-rank launch (~1 min on 2 busy cores)
def test_frozen_sharded_resumes_on_one_rank_with_its_frozen_weights(
    frozen_run, tiny_corpus, tmp_path, capsys, monkeypatch, _clean_env
):
    """ZeRO-2, saved P = 2 sharded -> one rank, P = 1: the universal conversion runs, the frozen
    E/F come back whole from the saved files (this test's model starts with other frozen values,
    as if its initialisation had changed), training continues to step 4 (exit 0), no universal/
    stays and the saved tag is unchanged."""
    from linformer_ds import engine as eng
    from linformer_ds.config import load_config
    from linformer_ds.data.stages import resolve_stages
    from linformer_ds.train import Trainer

    ckpts = tmp_path / "checkpoints"  # a copy: the module's run stays at step 2
    shutil.copytree(frozen_run / "checkpoints", ckpts)
    want = _saved_frozen_whole(ckpts, "step_00000002", 2)
    before = _tree(ckpts / "step_00000002")
    real = eng.build_model

    def other_init(cfg):
        model = real(cfg)
        with torch.no_grad():
            for p in model.parameters():
                if not p.requires_grad:
                    p.add_(1.0)
        return model

    monkeypatch.setattr(eng, "build_model", other_init)
    cfg = load_config(TINY_CONFIG, [*TEST_OVERRIDES, f"data.path={tiny_corpus}",
                                    f"logging.dir={tmp_path / 'run'}", f"checkpoint.dir={ckpts}",
                                    "model.freeze_projection=true", "deepspeed.zero.stage=2",
                                    "train.max_steps=4", "checkpoint.save_interval=0"])  # fmt: skip
    resolve_stages(cfg)
    trainer = Trainer(cfg)
    try:
        got = dict(trainer.engine.module.named_parameters())
        for name, whole in want.items():
            assert torch.equal(got[name].detach().to(whole.dtype), whole), name
        assert not got[name].requires_grad
        assert trainer.step == 2 and trainer.train() == 0
    finally:
        trainer.close()
    out = capsys.readouterr().out
    assert "[resume] " in out and "[done] step 4: first loss " in out, out[-3000:]
    assert not (ckpts / UNIVERSAL_DIR).exists()
    assert _tree(ckpts / "step_00000002") == before
    final = _saved_frozen_whole(ckpts, "step_00000004", 1)  # frozen: the same after 2 steps
    assert all(torch.equal(final[n], want[n]) for n in want)


@pytest.mark.slow  # a second 2-rank launch
def test_frozen_sharded_resumes_on_two_data_parallel_ranks(frozen_run, tiny_corpus, tmp_path):
    """ZeRO-2, saved P = 2 sharded -> DP = 2, P = 1 (was DeepSpeed's AssertionError): exit 0,
    the final checkpoint's frozen E/F equal the saved ones."""
    ckpts = tmp_path / "checkpoints"
    shutil.copytree(frozen_run / "checkpoints", ckpts)
    want = _saved_frozen_whole(ckpts, "step_00000002", 2)
    run_pretrain(tiny_corpus, tmp_path / "run", [
        "model.freeze_projection=true", "deepspeed.zero.stage=2", "train.max_steps=3",
        "checkpoint.save_interval=0", f"checkpoint.dir={ckpts}"], nproc=2)  # fmt: skip
    final = _saved_frozen_whole(ckpts, "step_00000003", 1)
    assert all(torch.equal(final[n], want[n]) for n in want)
    assert not (ckpts / UNIVERSAL_DIR).exists()


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


def test_refusal_only_for_frozen_sharded_checkpoints_into_sharded_zero3():
    meta = {"world_size": 2, "zero_stage": 3, "sequence_parallel_size": 2,
            "shard_sequence_parameters": True, "model": {"freeze_projection": True}}  # fmt: skip
    why = frozen_universal_refusal("ck/step_00000004", meta, 3, 2)
    assert why is not None and why.startswith("ck/step_00000004 holds frozen E/F")
    assert "under ZeRO-3 they cannot be loaded sharded over 2 ranks" in why and "\n" not in why
    assert frozen_universal_refusal("ck/t", meta, 3, 1) is None  # restored whole
    assert frozen_universal_refusal("ck/t", meta, 2, 2) is None  # restored and cut
    unfrozen = {**meta, "model": {"freeze_projection": False}}
    assert frozen_universal_refusal("ck/t", unfrozen, 3, 2) is None
    assert frozen_universal_refusal("ck/t", {**meta, "shard_sequence_parameters": False}, 3, 2) is None
    assert frozen_universal_refusal("ck/t", {**meta, "sequence_parallel_size": 1}, 3, 2) is None


@pytest.fixture(scope="module")
def frozen_run3(tiny_corpus, tmp_path_factory) -> Path:
    """As frozen_run under ZeRO-3."""
    run = tmp_path_factory.mktemp("frozen3")
    zero3 = [o for o in FROZEN_SHARDED if not o.startswith("deepspeed.zero.stage")]
    run_pretrain(tiny_corpus, run, [*zero3, "deepspeed.zero.stage=3"], nproc=2)
    return run


@pytest.mark.slow  # a 2-rank ZeRO-3 launch
def test_frozen_sharded_zero3_resumes_on_two_data_parallel_ranks(frozen_run3, tiny_corpus,
                                                                 tmp_path):  # fmt: skip
    """ZeRO-3, saved P = 2 sharded -> DP = 2, P = 1: exit 0, the final checkpoint's frozen E/F
    (export's consolidation) equal the saved ones."""
    from linformer_ds.export import consolidate

    ckpts = tmp_path / "checkpoints"
    shutil.copytree(frozen_run3 / "checkpoints", ckpts)
    run_pretrain(tiny_corpus, tmp_path / "run", [
        "model.freeze_projection=true", "deepspeed.zero.stage=3", "train.max_steps=3",
        "checkpoint.save_interval=0", f"checkpoint.dir={ckpts}"], nproc=2)  # fmt: skip
    saved, final = consolidate(str(ckpts), "step_00000002"), consolidate(str(ckpts), "step_00000003")
    names = [n for n in saved if n.endswith(("proj_k.weight", "proj_v.weight",
                                             "shared_linear.weight"))]  # fmt: skip
    assert names and all(torch.equal(final[n], saved[n]) for n in names)
    assert not (ckpts / UNIVERSAL_DIR).exists()


@pytest.mark.slow  # a 2-rank ZeRO-3 launch
def test_frozen_sharded_zero3_resumes_on_one_rank(frozen_run3, tiny_corpus, tmp_path, capsys,
                                                  monkeypatch, _clean_env):  # fmt: skip
    """ZeRO-3, saved P = 2 sharded -> one rank: the frozen E/F (other values at init, as if the
    initialisation had changed) are the saved ones after the load (export's consolidation of
    the saved tag), training continues (exit 0), no universal/ stays, the saved tag unchanged."""
    import deepspeed

    from linformer_ds import engine as eng
    from linformer_ds.config import load_config
    from linformer_ds.data.stages import resolve_stages
    from linformer_ds.export import consolidate
    from linformer_ds.train import Trainer

    ckpts = tmp_path / "checkpoints"
    shutil.copytree(frozen_run3 / "checkpoints", ckpts)
    saved = consolidate(str(ckpts), "step_00000002")
    before = _tree(ckpts / "step_00000002")
    real = eng.build_model

    def other_init(cfg):
        model = real(cfg)
        with torch.no_grad():
            for p in model.parameters():
                if not p.requires_grad:
                    p.add_(1.0)
        return model

    monkeypatch.setattr(eng, "build_model", other_init)
    cfg = load_config(TINY_CONFIG, [*TEST_OVERRIDES, f"data.path={tiny_corpus}",
                                    f"logging.dir={tmp_path / 'run'}", f"checkpoint.dir={ckpts}",
                                    "model.freeze_projection=true", "deepspeed.zero.stage=3",
                                    "train.max_steps=3", "checkpoint.save_interval=0"])  # fmt: skip
    resolve_stages(cfg)
    trainer = Trainer(cfg)
    try:
        frozen = [(n, p) for n, p in trainer.engine.module.named_parameters() if not p.requires_grad]
        assert frozen
        with deepspeed.zero.GatheredParameters([p for _, p in frozen]):
            for name, p in frozen:
                assert torch.equal(p.detach().float(), saved[name].float()), name
        assert trainer.step == 2 and trainer.train() == 0
    finally:
        trainer.close()
    assert "[done] step 3: first loss " in capsys.readouterr().out
    assert not (ckpts / UNIVERSAL_DIR).exists()
    assert _tree(ckpts / "step_00000002") == before
