"""Frozen E/F (``model.freeze_projection=true``) across layout changes (issue 30 item 6).

DeepSpeed's universal converter failed on a checkpoint saved with them sharded over P = 2
(``AssertionError: Unused patterns``: frozen parameters have no optimizer state) and left an
empty ``universal/``. The conversion now allows those patterns and the frozen weights are
restored from the saved files after the load (ZeRO-3: on rank 0 of each data-parallel group,
cut for its sequence-parallel rank). Tests: saved sharded at P = 2, resumed on one rank and on
DP = 2 under ZeRO-2 and ZeRO-3; an engine change (ZeRO-2 bf16 -> ZeRO-1 fp32); and a frozen
chain per ZeRO stage (0, 2 and 3) through 1 rank -> P = 2 sharded -> DP 2 x P = 2 sharded ->
DP 2, every resumed hop starting from other frozen values, equal to an uninterrupted one-rank
run, with the frozen E/F bit-equal to their initial values. Every multi-rank run of the module
is one of four process-group launches (``frozen_chain_launches``: start-up paid once per launch),
three of them shared with tests/test_resume_layout.py's chains (tests/conftest.py's
``layout_chains``)."""

import shutil
from pathlib import Path

import pytest
import torch

from linformer_ds.checkpoint.reshard import convert_to_universal
from linformer_ds.checkpoint.tags import UNIVERSAL_DIR, CheckpointError
from tests.layout_worker import perturbed_frozen
from tests.pretrain_utils import TEST_OVERRIDES, TINY_CONFIG, read_metrics
from tests.test_resume_layout import COMMON, HOP, RTOL, _overrides, _rel, read_chain

FROZEN_SHARDED = [
    "model.freeze_projection=true",
    "parallel.sequence_parallel_size=2",
    "parallel.shard_sequence_parameters=true",
    "deepspeed.zero.stage=2",
    "train.max_steps=2",
    "checkpoint.save_interval=0",
]


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.fixture(scope="module")
def frozen_run(frozen_launches) -> Path:
    """Two steps on 2 ranks, P = 2, E/F frozen and sharded, ZeRO-2: checkpoint step_00000002
    (a run of :func:`frozen_launches`' 2-rank launch)."""
    return frozen_launches[0] / "frozen2"


FROZEN_NAMES = ("proj_k.weight", "proj_v.weight", "shared_linear.weight")


def _trainer_with_other_frozen_init(monkeypatch, tiny_corpus, tmp_path: Path, ckpts: Path,
                                    stage: int, max_steps: int, *more: str,
                                    perturb: bool = True):  # fmt: skip
    """A one-rank Trainer resuming ``ckpts`` (E/F frozen, ZeRO ``stage``, overrides ``more``)
    whose model starts with every frozen parameter 1.0 off its initial value, as if the
    initialisation had changed (unless not ``perturb``): after the resume they must be the
    saved ones."""
    from linformer_ds import engine as eng
    from linformer_ds.config import load_config
    from linformer_ds.data.stages import resolve_stages
    from linformer_ds.trainer import Trainer

    if perturb:  # the layout worker's rule, also used by the chains below
        monkeypatch.setattr(eng, "build_model", perturbed_frozen)
    cfg = load_config(TINY_CONFIG, [*TEST_OVERRIDES, f"data.path={tiny_corpus}",
                                    f"logging.dir={tmp_path / 'run'}", f"checkpoint.dir={ckpts}",
                                    "model.freeze_projection=true", f"deepspeed.zero.stage={stage}",
                                    f"train.max_steps={max_steps}",
                                    "checkpoint.save_interval=0", *more])  # fmt: skip
    resolve_stages(cfg)
    return Trainer(cfg)


def _saved_frozen_whole(ckpt: Path, tag: str, p: int) -> dict[str, torch.Tensor]:
    """The frozen E/F of a checkpoint saved with them sharded over ``p`` ranks, whole."""
    mods = [torch.load(ckpt / tag / f"mp_rank_{r:02d}_model_states.pt", weights_only=False)["module"]
            for r in range(p)]  # fmt: skip
    names = [n for n in mods[0] if n.endswith(FROZEN_NAMES)]
    assert names
    return {n: torch.cat([m[n] for m in mods], 2) for n in names}


@pytest.mark.slow  # uses frozen_launches (a one-rank resume in this process)
def test_frozen_sharded_resumes_on_one_rank_with_its_frozen_weights(
    frozen_run, tiny_corpus, tmp_path, capsys, monkeypatch, _clean_env
):
    """ZeRO-2, saved P = 2 sharded -> one rank, P = 1: the universal conversion runs, the frozen
    E/F come back whole from the saved files (this test's model starts with other frozen values,
    as if its initialisation had changed), training continues to step 4 (exit 0), no universal/
    stays and the saved tag is unchanged."""
    ckpts = tmp_path / "checkpoints"  # a copy: the module's run stays at step 2
    shutil.copytree(frozen_run / "checkpoints", ckpts)
    want = _saved_frozen_whole(ckpts, "step_00000002", 2)
    before = _tree(ckpts / "step_00000002")
    trainer = _trainer_with_other_frozen_init(monkeypatch, tiny_corpus, tmp_path, ckpts, 2, 4)
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


@pytest.mark.slow  # a run of the last 2-rank launch
def test_frozen_sharded_resumes_on_two_data_parallel_ranks(frozen_launches):
    """ZeRO-2, saved P = 2 sharded -> DP = 2, P = 1 (was DeepSpeed's AssertionError): exit 0
    (the launch checks it), the final checkpoint's frozen E/F equal the saved ones."""
    ckpts = frozen_launches[0] / "frozen2_dp2_ckpt"  # a copy of frozen_run's, resumed to step 3
    want = _saved_frozen_whole(ckpts, "step_00000002", 2)
    final = _saved_frozen_whole(ckpts, "step_00000003", 1)
    assert all(torch.equal(final[n], want[n]) for n in want)
    assert not (ckpts / UNIVERSAL_DIR).exists()


@pytest.mark.slow  # uses frozen_launches
def test_failed_conversion_leaves_no_universal_dir(frozen_run):
    """DeepSpeed's converter on the frozen sharded checkpoint (what a resume did before the
    refusal): one CheckpointError, and neither universal/<tag> nor an empty universal/ stays."""
    ckpts = frozen_run / "checkpoints"
    before = _tree(ckpts)
    with pytest.raises(CheckpointError, match="Unused patterns"):
        convert_to_universal(str(ckpts), "step_00000002")
    assert not (ckpts / UNIVERSAL_DIR).exists()
    assert _tree(ckpts) == before


@pytest.mark.slow  # two one-rank trainers in this process (~1 min on 2 busy cores)
def test_frozen_resumes_under_another_zero_stage_and_precision(tiny_corpus, tmp_path, capsys,
                                                               monkeypatch, _clean_env):  # fmt: skip
    """An engine change the universal checkpoint carries (ZeRO-2 bf16 -> ZeRO-1 fp32, one
    rank): the frozen E/F (other values at init) are the saved ones after the load (the bf16
    run's values, exactly), training continues (exit 0), no universal/ stays."""
    ckpts = tmp_path / "checkpoints"
    first = _trainer_with_other_frozen_init(monkeypatch, tiny_corpus, tmp_path, ckpts, 2, 2,
                                            perturb=False)  # fmt: skip
    try:
        assert first.train() == 0
    finally:
        first.close()
    want = _saved_frozen_whole(ckpts, "step_00000002", 1)
    assert all(w.dtype == torch.bfloat16 for w in want.values())
    trainer = _trainer_with_other_frozen_init(monkeypatch, tiny_corpus, tmp_path, ckpts, 1, 3,
                                              "deepspeed.precision=fp32")  # fmt: skip
    try:
        got = dict(trainer.engine.module.named_parameters())
        for name, whole in want.items():
            assert got[name].dtype == torch.float32
            assert torch.equal(got[name].detach(), whole.float()), name
        assert trainer.step == 2 and trainer.train() == 0
    finally:
        trainer.close()
    out = capsys.readouterr().out
    assert "deepspeed.zero.stage 2 -> 1, deepspeed.precision bf16 -> fp32" in out, out[-3000:]
    assert "[done] step 3: first loss " in out
    assert not (ckpts / UNIVERSAL_DIR).exists()


@pytest.fixture(scope="module")
def frozen_run3(frozen_launches) -> Path:
    """As frozen_run under ZeRO-3."""
    return frozen_launches[0] / "frozen3"


@pytest.mark.slow  # a run of the last 2-rank launch
def test_frozen_sharded_zero3_resumes_on_two_data_parallel_ranks(frozen_launches):
    """ZeRO-3, saved P = 2 sharded -> DP = 2, P = 1: exit 0 (the launch checks it), the final
    checkpoint's frozen E/F (export's consolidation) equal the saved ones."""
    from linformer_ds.export import consolidate

    ckpts = frozen_launches[0] / "frozen3_dp2_ckpt"  # a copy of frozen_run3's, to step 3
    saved = consolidate(str(ckpts), "step_00000002")
    final = consolidate(str(ckpts), "step_00000003")
    names = [n for n in saved if n.endswith(FROZEN_NAMES)]
    assert names and all(torch.equal(final[n], saved[n]) for n in names)
    assert not (ckpts / UNIVERSAL_DIR).exists()


@pytest.mark.slow  # uses frozen_launches (a one-rank resume in this process)
def test_frozen_sharded_zero3_resumes_on_one_rank(frozen_run3, tiny_corpus, tmp_path, capsys,
                                                  monkeypatch, _clean_env):  # fmt: skip
    """ZeRO-3, saved P = 2 sharded -> one rank: the frozen E/F (other values at init, as if the
    initialisation had changed) are the saved ones after the load (export's consolidation of
    the saved tag), training continues (exit 0), no universal/ stays, the saved tag unchanged."""
    import deepspeed

    from linformer_ds.export import consolidate

    ckpts = tmp_path / "checkpoints"
    shutil.copytree(frozen_run3 / "checkpoints", ckpts)
    saved = consolidate(str(ckpts), "step_00000002")
    before = _tree(ckpts / "step_00000002")
    trainer = _trainer_with_other_frozen_init(monkeypatch, tiny_corpus, tmp_path, ckpts, 3, 3)
    try:
        named = trainer.engine.module.named_parameters()
        frozen = [(n, p) for n, p in named if not p.requires_grad]
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


# ================================================ a frozen chain through the layouts, per stage
# (ranks, P, E/F and positions sharded) of each hop, as tests/test_resume_layout.py's CHAIN; a
# 4-rank hop resumes the P = 2 sharded checkpoint into another sharded layout (DP 2 x P = 2),
# which ZeRO-3 refused before
FROZEN_CHAIN: list[tuple[int, int, bool]] = [
    (1, 1, False),  # steps 1-2 on one rank
    (2, 2, True),  # one rank -> P = 2 sharded
    (4, 2, True),  # P = 2 sharded -> DP 2 x P = 2 sharded (ZeRO-3: universal, cut per SP rank)
    (2, 1, False),  # DP 2 x P = 2 sharded -> DP 2
]
FROZEN_STEPS = HOP * len(FROZEN_CHAIN)
FROZEN_STAGES = (0, 2, 3)
FROZEN_MORE = [f"train.max_steps={FROZEN_STEPS}", "model.freeze_projection=true"]


def _zero3_last(runs: list[dict]) -> list[dict]:
    """``runs`` with the ZeRO-3 ones after the others (the chains' own order, stage by stage)."""
    return sorted(runs, key=lambda run: "deepspeed.zero.stage=3" in run["overrides"])


def frozen_chain_launches(data: Path, out: Path, prefix: str) -> list[dict]:
    """Every multi-rank run of this module as 4 process-group launches of 1, 2, 4 and 2 ranks
    (``{"ranks", "runs", "before"}``, in order; run ``NAME`` logs to ``out/NAME`` and is named
    ``prefix/NAME``): the reference (one rank, ZeRO-0, uninterrupted, E/F frozen) and one frozen
    chain per ZeRO stage, each resumed hop's model built with other frozen values; in the P = 2
    sharded launch also ``frozen2`` and ``frozen3`` (FROZEN_SHARDED under ZeRO-2 and ZeRO-3: 2
    steps, checkpoint step_00000002), and in the last (DP = 2) launch their resumes on DP = 2,
    P = 1 to step 3 from copies of their checkpoints (``frozen{2,3}_dp2_ckpt``, copied by its
    ``before``). In each launch the ZeRO-3 runs come last."""
    ref_over = _overrides(data, out / "ref_ckpt", 0, 1, 1, False) + FROZEN_MORE
    launches: list[tuple[int, list[dict]]] = [
        (1, [{"name": "ref", "overrides": ref_over + ["checkpoint.save_final=false"]}])
    ]
    for i, (ranks, p, shard) in enumerate(FROZEN_CHAIN):
        if launches[-1][0] != ranks:
            launches.append((ranks, []))
        for stage in FROZEN_STAGES:
            over = _overrides(data, out / f"z{stage}_ckpt", stage, ranks, p, shard)
            over += [*FROZEN_MORE, f"train.stop_at_step={HOP * (i + 1)}"]
            launches[-1][1].append({"name": f"z{stage}_hop{i}", "overrides": over,
                                    "perturb_frozen": i > 0})  # fmt: skip
    assert [ranks for ranks, _ in launches] == [1, 2, 4, 2]
    zero = [o for o in FROZEN_SHARDED if not o.startswith("deepspeed.zero.stage")]
    for stage in (2, 3):  # saved sharded at P = 2 (the chains' 2-rank launch is all P = 2 sharded)
        launches[1][1].append({"name": f"frozen{stage}", "overrides": [
            f"data.path={data}", *zero, f"deepspeed.zero.stage={stage}"]})  # fmt: skip
        launches[3][1].append({"name": f"frozen{stage}_dp2", "overrides": [  # all DP 2, P = 1
            f"data.path={data}", "model.freeze_projection=true", f"deepspeed.zero.stage={stage}",
            "train.max_steps=3", "checkpoint.save_interval=0",
            f"checkpoint.dir={out / f'frozen{stage}_dp2_ckpt'}"]})  # fmt: skip

    def copy_checkpoints() -> None:  # the DP = 2 resumes start from copies: frozen{2,3} stay
        for stage in (2, 3):
            shutil.copytree(out / f"frozen{stage}" / "checkpoints",
                            out / f"frozen{stage}_dp2_ckpt")  # fmt: skip

    named = [[{**r, "name": f"{prefix}/{r['name']}"} for r in _zero3_last(runs)]
             for _, runs in launches]  # fmt: skip
    return [{"ranks": ranks, "runs": runs, "before": copy_checkpoints if j == 3 else None}
            for j, ((ranks, _), runs) in enumerate(zip(launches, named))]  # fmt: skip


@pytest.fixture(scope="module")
def frozen_launches(layout_chains) -> tuple[Path, dict[int, list[str]]]:
    """The runs of :func:`frozen_chain_launches`, trained in launches shared with
    tests/test_resume_layout.py's chains (tests/conftest.py's ``layout_chains``). Returns the
    output directory and, per stage, rank 0's lines that name the stage's chain checkpoint
    directory."""
    out, logs = layout_chains["frozen"], layout_chains["logs"]
    said = {s: [ln for log in logs for ln in log.splitlines() if str(out / f"z{s}_ckpt") in ln]
            for s in FROZEN_STAGES}  # fmt: skip
    return out, said


@pytest.mark.slow  # 4 launches of 1, 2, 4 and 2 ranks
@pytest.mark.parametrize("stage", FROZEN_STAGES)
def test_frozen_chain_equals_uninterrupted_run(frozen_launches, stage):
    """ZeRO-0, 2 and 3, E/F frozen: 1 rank -> P = 2 sharded -> DP 2 x P = 2 sharded -> DP 2,
    every resumed hop built with frozen values 1.0 off (a restore that missed one shows in the
    loss): every step's loss and gradient norm within 1e-6 relative of the uninterrupted run,
    the final parameters within 1e-5, and the frozen E/F after every hop bit-equal to the
    initial ones (measured worst: printed)."""
    from linformer_ds import engine as eng
    from linformer_ds.config import load_config

    out, said = frozen_launches
    init_model = eng.build_model(load_config(TINY_CONFIG, TEST_OVERRIDES + COMMON + FROZEN_MORE))
    init = {n: p.detach().clone().float() for n, p in init_model.named_parameters()
            if not p.requires_grad}  # fmt: skip
    assert init and all(n.endswith(FROZEN_NAMES) for n in init)
    ref = read_metrics(out / "ref")
    got = read_chain(out, stage, len(FROZEN_CHAIN))
    for i in range(len(FROZEN_CHAIN)):
        params = torch.load(out / f"z{stage}_hop{i}" / "params.pt")
        for n, w in init.items():
            assert torch.equal(params[n], w), (i, n)
    worst = {"loss": 0.0, "grad_norm": 0.0, "param": 0.0}
    for s in range(1, FROZEN_STEPS + 1):
        for key in ("loss", "grad_norm"):
            worst[key] = max(worst[key], _rel(got[s][key], ref[s][key]))
    want = torch.load(out / "ref" / "params.pt")
    assert all(torch.equal(want[n], w) for n, w in init.items())
    assert params.keys() == want.keys()
    for k, w in want.items():
        d = (params[k] - w).double().norm().item() / max(w.double().norm().item(), 1e-12)
        worst["param"] = max(worst["param"], d)
    print(f"\nfrozen ZeRO-{stage} chain, {FROZEN_STEPS} steps, worst relative difference: {worst}")
    assert worst["loss"] <= RTOL and worst["grad_norm"] <= RTOL, worst
    assert worst["param"] <= 10 * RTOL, worst
    lines = said[stage]
    resumed = [ln for ln in lines if ": step " in ln and "sampler consumed" in ln]
    assert [int(ln.split(": step ")[1].split(",")[0]) for ln in resumed] == [
        HOP * i for i in range(1, len(FROZEN_CHAIN))
    ]
    text = "\n".join(lines)
    if stage:  # every hop changes the ranks: universal, frozen E/F from the saved files
        assert text.count("universal checkpoint") == 3, text
    else:  # the two sharding changes re-shard; the world change alone loads natively
        assert text.count("re-shard") == 2 and "universal" not in text, text
    assert not (out / f"z{stage}_ckpt" / "universal").exists()
