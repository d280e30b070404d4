"""Sequence parallelism through the real trainer (DeepSpeed on CPU ranks, gloo, fp32): one
sequence split over P ranks trains like one rank holding it whole, under ZeRO 2 and 3, and a
DP 2 x SP 2 run on 4 ranks resumes exactly."""

import math
import shutil

import pytest

from tests.pretrain_utils import (
    read_metrics,
    run_pretrain,
    run_worker_ranks,
    start_worker_ranks,
    wait_worker_ranks,
    worker_run,
)

# linear, conv and dense layers in one model; fp32, no dropout: the runs must agree to rounding
SP_MODEL = [
    "deepspeed.precision=fp32",
    "model.attention_dropout=0.0",
    "model.num_layers=3",
    "model.layer_projections=[linear,conv,dense]",
    "model.sharing=headwise",
    "train.max_steps=5",
    "train.eval_interval=5",
    "train.eval_batches=2",
]


def _metrics(run_dir):
    train, evals = read_metrics(run_dir), read_metrics(run_dir, "eval")
    return train, evals


# (ZeRO stage, parallel.shard_sequence_parameters, activation checkpointing granularity);
# the sharded ones last: a sharded P > 1 run leaves DeepSpeed's global mpu set for the next
# run in the same process (tests/test_resume_layout.py)
SP2_CASES = [(2, False, None), (3, False, None), (2, "auto", None), (3, True, None),
             (3, True, "sublayer")]  # fmt: skip


def _sp2_name(stage, shard, ckpt) -> str:
    return f"sp2_z{stage}_{str(shard).lower()}_{ckpt or 'none'}"


# The sharded-export test's runs (2 steps, ZeRO-stage -> P = 2 run name, one-rank twin)
EXPORT_STAGES = (2, 3)
# auto with ZeRO-0 bf16, which sharding refuses: trains with E/F and positions whole
AUTO_WHOLE = SP_MODEL + ["deepspeed.precision=bf16", "deepspeed.zero.stage=0",
                         "deepspeed.fp32_grad_accum=false", "parallel.sequence_parallel_size=2",
                         "train.max_steps=1", "train.eval_interval=0"]  # fmt: skip


def _export_over(stage: int) -> list:
    return SP_MODEL + [
        f"deepspeed.zero.stage={stage}",
        "train.max_steps=2",
        "train.eval_interval=0",
    ]


# The universal-resume test's one-rank runs (``uni_ref`` uninterrupted, ``uni_half`` its first
# two steps) and, from copies of uni_half, its resumes onto P = 2 and DP 2 x SP 2 (2 rows per
# replica: the same global batch of 4 rows), trained in the launches of the fixtures below
UNI_OVER = SP_MODEL + ["deepspeed.zero.stage=2", "train.max_steps=4", "train.eval_interval=0"]
UNI_RESUMES = {
    "uni_sp2": ["parallel.sequence_parallel_size=2"],
    "uni_dp2sp2": ["parallel.sequence_parallel_size=2", "train.micro_batch_size=2"],
}


def _uni_resume(sp2_runs, tiny_corpus, out, name: str) -> dict:
    """A copy of sp2_runs' uni_half as ``out/name`` and the run that resumes it."""
    shutil.copytree(sp2_runs[0] / "uni_half", out / name)
    return worker_run(name, tiny_corpus, UNI_OVER + UNI_RESUMES[name])


@pytest.fixture(scope="module")
def sp2_runs(tiny_corpus, tmp_path_factory):
    """Every case of the test below trained in one 2-rank process group (tests/layout_worker.py,
    one run after the other: the start-up paid once), and beside it P = 1 on one rank with the
    same global batch (4 rows). The same two launches train the runs of the export and
    shard-auto tests further down (``auto_whole`` first: unsharded; ``export_sp2_z2/3`` last:
    sharded; their one-rank twins ``export_one_z2/3``; and ``uni_ref``, ``uni_half``). Returns the output directory, each run's
    stdout (2-rank group) and the reference's train and eval metrics."""
    out = tmp_path_factory.mktemp("sp2")
    runs = [worker_run("auto_whole", tiny_corpus, AUTO_WHOLE)]
    for stage, shard, ckpt in SP2_CASES:
        over = SP_MODEL + [f"deepspeed.zero.stage={stage}", "parallel.sequence_parallel_size=2"]
        over += [f"parallel.shard_sequence_parameters={str(shard).lower()}"]
        if ckpt:
            over += ["deepspeed.activation_checkpointing.enabled=true",
                     f"deepspeed.activation_checkpointing.granularity={ckpt}"]  # fmt: skip
        runs.append(worker_run(_sp2_name(stage, shard, ckpt), tiny_corpus, over))
    runs += [worker_run(f"export_sp2_z{stage}", tiny_corpus,
                        _export_over(stage) + ["parallel.sequence_parallel_size=2"])
             for stage in EXPORT_STAGES]  # fmt: skip
    procs = start_worker_ranks(2, runs, out, "launch")
    one = [worker_run("sp1", tiny_corpus, SP_MODEL + ["deepspeed.zero.stage=2"])]
    one += [worker_run(f"export_one_z{stage}", tiny_corpus, _export_over(stage))
            for stage in EXPORT_STAGES]  # fmt: skip
    one += [worker_run("uni_ref", tiny_corpus, UNI_OVER),
            worker_run("uni_half", tiny_corpus, UNI_OVER + ["train.stop_at_step=2"])]  # fmt: skip
    run_worker_ranks(1, one, out, "one")
    return out, wait_worker_ranks(procs, out, "launch"), _metrics(out / "sp1")


@pytest.mark.slow  # sp2_runs: 2 ranks
@pytest.mark.parametrize("stage,shard,ckpt", SP2_CASES)
def test_sequence_parallel_2_matches_one_rank(sp2_runs, stage, shard, ckpt):
    """Sharded (each rank holds half of E/F and the positions; auto chooses it here: N =
    max_seq_len, fp32), also under per-sub-layer activation checkpointing (embeddings,
    attention and feed-forward recomputed apart), and unsharded P = 2 log what one rank does:
    loss, accuracy, gradient norm, evaluation loss."""
    out, stdout, (ref_train, ref_eval) = sp2_runs
    name = _sp2_name(stage, shard, ckpt)
    text = stdout[name]
    assert "ranks=2" in text
    chosen = "[setup] parallel.shard_sequence_parameters=auto: sharded: P = 2, N = "
    assert (chosen in text) == (shard == "auto"), text[-2000:]
    assert text.count("shard_sequence_parameters=auto:") == (shard == "auto")
    train, evals = _metrics(out / name)
    assert sorted(train) == sorted(ref_train) == [1, 2, 3, 4, 5]
    for step in ref_train:
        for key in ("loss", "mlm_accuracy", "grad_norm"):
            got, want = train[step][key], ref_train[step][key]
            assert math.isclose(got, want, rel_tol=1e-5), (stage, step, key, got, want)
    assert math.isclose(evals[5]["loss"], ref_eval[5]["loss"], rel_tol=1e-5)
    assert train[5]["loss"] < train[1]["loss"]


@pytest.fixture(scope="module")
def four_ranks(tiny_corpus, sp2_runs, tmp_path_factory):
    """DP 2 x SP 2 on 4 ranks: the uninterrupted run (``full``) and the first half (``part``,
    stopped at step 3) in one process group (tests/layout_worker.py), the second half resumed
    in a new one, beside ``uni_dp2sp2`` (the universal-resume test's). Returns the output
    directory and the second group's stdout per run."""
    out = tmp_path_factory.mktemp("dp2_sp2")
    over = SP_MODEL + [
        "deepspeed.zero.stage=2",
        "parallel.sequence_parallel_size=2",
        "train.micro_batch_size=2",
        "train.max_steps=6",
        "train.eval_interval=0",
        "checkpoint.save_interval=3",
    ]
    first = [worker_run("full", tiny_corpus, over),
             worker_run("part", tiny_corpus, over + ["train.stop_at_step=3"])]  # fmt: skip
    run_worker_ranks(4, first, out, "first")
    resume = [worker_run("part", tiny_corpus, over),
              _uni_resume(sp2_runs, tiny_corpus, out, "uni_dp2sp2")]  # fmt: skip
    return out, run_worker_ranks(4, resume, out, "resume")


@pytest.mark.slow  # 4 ranks
def test_dp2_x_sp2_on_four_ranks_resumes_exactly(four_ranks):
    out, stdout = four_ranks
    assert "[resume]" in stdout["part"] and "step 3" in stdout["part"]
    a, b = read_metrics(out / "full"), read_metrics(out / "part")
    assert sorted(a) == list(range(1, 7))
    assert [a[s]["loss"] for s in range(1, 7)] == [b[s]["loss"] for s in range(1, 7)]
    assert [a[s]["grad_norm"] for s in range(4, 7)] == [b[s]["grad_norm"] for s in range(4, 7)]


RESUME_ACROSS = SP_MODEL + ["deepspeed.zero.stage=2", "train.max_steps=6", "train.eval_interval=0"]


@pytest.fixture(scope="module")
def resume_chains(tiny_corpus, sp2_runs, tmp_path_factory):
    """Both chains of the test below (E/F and positions sharded, and whole), hop by hop: each
    hop of both in one process group (tests/layout_worker.py; the sharded chain's after the
    other's; the second hop's also resumes ``uni_sp2``, the universal-resume test's, last), the last hop's with the uninterrupted one-rank run the chains must equal (P = 1,
    so ``parallel.shard_sequence_parameters`` is inert: no SP group, nothing sharded, recorded
    false: one run serves both chains). Returns the output directory and the stdout of every
    hop and the first hop's checkpoint record (linformer_meta.json), by chain, and uni_sp2's
    stdout."""
    out = tmp_path_factory.mktemp("resume_across")
    hops = [(2, ["parallel.sequence_parallel_size=2", "train.stop_at_step=2"]),
            (2, ["train.micro_batch_size=2", "train.stop_at_step=4"]),
            (1, [])]  # fmt: skip
    said: dict = {True: [], False: []}
    for i, (ranks, extra) in enumerate(hops):
        runs = [worker_run("ref", tiny_corpus, RESUME_ACROSS + [
            "parallel.shard_sequence_parameters=false"])] if i == len(hops) - 1 else []  # fmt: skip
        for shard in (False, True):
            over = RESUME_ACROSS + [f"parallel.shard_sequence_parameters={str(shard).lower()}"]
            runs.append(worker_run(f"run_{str(shard).lower()}", tiny_corpus, over + extra))
        if i == 1:
            runs.append(_uni_resume(sp2_runs, tiny_corpus, out, "uni_sp2"))
        stdout = run_worker_ranks(ranks, runs, out, f"hop{i}")
        if i == 1:
            uni_sp2 = stdout["uni_sp2"]
        for shard in (False, True):
            run = out / f"run_{str(shard).lower()}"
            said[shard].append(stdout[run.name])
            if i == 0:  # the P = 2 checkpoint's record, before later hops save theirs
                meta = run / "checkpoints" / "step_00000002" / "linformer_meta.json"
                said[shard].append(meta.read_text())
    return out, said, uni_sp2


@pytest.mark.slow  # resume_chains: 2 ranks
@pytest.mark.parametrize("shard", [True, False])
def test_resume_across_sequence_parallel_sizes_and_ranks(resume_chains, shard):
    """P=2 on 2 ranks -> P=1 on 2 ranks (unsharded: native load, ZeRO partitions over all ranks
    either way; sharded: the halves of E/F and the positions are joined through the universal
    checkpoint) -> one rank (universal checkpoint): every step's loss equals a one-rank run to
    1e-4 (the layouts sum gradients in different orders; Adam carries those last-bit
    differences on: measured 2e-5 at step 5)."""
    out, said, _ = resume_chains
    _, meta, dp2, one = said[shard]
    assert '"sequence_parallel_size": 2' in meta
    assert f'"shard_sequence_parameters": {str(shard).lower()}' in meta
    assert "[resume]" in dp2 and ("universal" in dp2) == shard
    assert "universal checkpoint" in one
    a, b = read_metrics(out / "ref"), read_metrics(out / f"run_{str(shard).lower()}")
    assert sorted(b) == list(range(1, 7))
    for s in range(1, 7):
        assert math.isclose(a[s]["loss"], b[s]["loss"], rel_tol=1e-4), (s, a[s], b[s])


def test_universal_resume_one_rank_onto_sp2_and_dp2_x_sp2(sp2_runs, resume_chains, four_ranks):
    """A one-rank checkpoint resumes through the universal checkpoint onto P = 2 (2 ranks) and
    onto DP 2 x SP 2 (4 ranks, 2 rows per replica: the same global batch of 4 rows); every
    step's loss equals the uninterrupted one-rank run to fp32 rounding carried by Adam."""
    # the first two steps on one rank, once (sp2_runs' uni_half): each resume starts from its
    # own copy (uni_sp2 in resume_chains' second launch, uni_dp2sp2 in four_ranks' second)
    want = read_metrics(sp2_runs[0] / "uni_ref")
    for name, out, text in (
        ("uni_sp2", resume_chains[0], resume_chains[2]),
        ("uni_dp2sp2", four_ranks[0], four_ranks[1]["uni_dp2sp2"]),
    ):
        assert "universal checkpoint" in text and "step 2" in text, text
        got = read_metrics(out / name)
        assert sorted(got) == [1, 2, 3, 4]
        for s in (3, 4):
            for key in ("loss", "grad_norm"):
                assert math.isclose(got[s][key], want[s][key], rel_tol=1e-4), (name, s, key)


@pytest.mark.parametrize("stage", EXPORT_STAGES)
def test_export_of_sharded_checkpoint_holds_whole_matrices(sp2_runs, tmp_path, stage):
    """A checkpoint whose E/F and positions are sharded over P = 2 exports the whole matrices,
    equal to what one rank trained (same steps) to fp32 rounding carried by Adam."""
    from safetensors.torch import load_file

    from linformer_ds.export import main as export_main

    runs = sp2_runs[0]
    exported = {}
    for name in ("one", "sp2"):
        out = tmp_path / f"{name}_export"
        ckpt = runs / f"export_{name}_z{stage}" / "checkpoints"
        assert export_main(["--checkpoint", str(ckpt), "--out", str(out)]) == 0
        exported[name] = load_file(str(out / "model.safetensors"))
    meta = runs / f"export_sp2_z{stage}" / "checkpoints" / "step_00000002" / "linformer_meta.json"
    assert '"shard_sequence_parameters": true' in meta.read_text()
    one, sp2 = exported["one"], exported["sp2"]
    assert one.keys() == sp2.keys()
    assert sp2["encoder.position_embeddings.weight"].shape == (128, 64)
    assert sp2["encoder.layers.0.attention.proj_k.weight"].shape == (1, 32, 128)
    for k in one:
        assert one[k].shape == sp2[k].shape, k
        assert (one[k] - sp2[k]).abs().max().item() <= 1e-5 * max(1.0, one[k].abs().max()), k


def test_shard_auto_holds_whole_where_sharding_is_refused(sp2_runs, tiny_corpus, tmp_path):
    """auto (the default) with ZeRO-0 bf16, which sharding refuses (DeepSpeed's BF16_Optimizer
    norm under the model-parallel mpu): the run trains with E/F and positions whole, the
    [setup] line says why, the checkpoint records whole; ``true`` refuses the same run."""
    runs, stdout, _ = sp2_runs
    line = "[setup] parallel.shard_sequence_parameters=auto: whole: zero.stage=0 with bf16"
    assert line in stdout["auto_whole"], stdout["auto_whole"][-2000:]
    meta = runs / "auto_whole" / "checkpoints" / "step_00000001" / "linformer_meta.json"
    assert '"shard_sequence_parameters": false' in meta.read_text()
    refused = run_pretrain(tiny_corpus, tmp_path / "true", AUTO_WHOLE + [
        "parallel.shard_sequence_parameters=true"], nproc=2, launcher="deepspeed",
        check=False)  # fmt: skip
    # the deepspeed launcher exits with the ranks' code (torchrun's would be 1)
    assert refused.returncode == 2 and "BF16_Optimizer" in refused.stderr
