"""Faults with real runs: SIGKILL of a rank (also in the middle of a checkpoint save), resume on
another number of ranks (DeepSpeed universal checkpoint), non-finite losses, a full or read-only
checkpoint disk, checkpoints that carry pickled code.

One uninterrupted 2-rank bf16 ZeRO-2 run (8 steps, a checkpoint every 2) is the reference of
every test here; the sample indices each rank consumes are logged (debug.sample_log).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import psutil
import pytest
import torch

from linformer_ds.checkpoint.io import safe_torch_load
from linformer_ds.checkpoint.tags import latest_tag, tag_dirs, tag_problem
from linformer_ds.data.shards import ShardDataset
from linformer_ds.fsio import read_jsonl
from tests.legacy_batches import ResumableDistributedSampler
from tests.pretrain_utils import (
    PRETRAIN,
    REPO,
    TEST_OVERRIDES,
    TINY_CONFIG,
    child_env,
    free_port,
    read_metrics,
    run_pretrain,
    run_worker_ranks,
    worker_run,
)

COMMON = ["train.max_steps=8", "checkpoint.save_interval=2", "checkpoint.keep_last=0"]
STEPS = range(1, 9)


def losses(run_dir: Path, steps) -> list[float]:
    m = read_metrics(run_dir)
    return [m[s]["loss"] for s in steps]


def samples(run_dir: Path) -> dict[int, list[int]]:
    """step -> sorted sample indices consumed by all ranks (last record of a (step, rank))."""
    per: dict[tuple, list[int]] = {}
    for path in sorted((run_dir / "samples").glob("samples.rank*.jsonl")):
        for rec in read_jsonl(path):
            per[(rec["step"], rec["rank"])] = rec["indices"]
    out: dict[int, list[int]] = {}
    for (step, _), idx in per.items():
        out.setdefault(step, []).extend(idx)
    return {s: sorted(v) for s, v in out.items()}


def weights(ckpt_dir: Path, tag: str) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sd = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)
    return {k: v.detach().float().clone() for k, v in sd.items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def l2(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return sum(float(((a[k] - b[k]) ** 2).sum()) for k in a) ** 0.5


def adam_steps(tag_dir: Path) -> list[float]:
    """Adam's step counter of every param group in every optimizer shard of a tag."""
    out = []
    for path in sorted(tag_dir.glob("*_optim_states.pt")):
        state = safe_torch_load(str(path))["optimizer_state_dict"]["base_optimizer_state"]
        out += [float(s["step"]) for s in state["state"].values()]
    return out


def copy_tag(src: Path, dst_run: Path, tag: str) -> None:
    (dst_run / "checkpoints").mkdir(parents=True)
    shutil.copytree(src / "checkpoints" / tag, dst_run / "checkpoints" / tag)
    (dst_run / "checkpoints" / "latest").write_text(tag)


def sample_log(run_dir: Path) -> str:
    """The override that logs each rank's sample indices per step into ``run_dir/samples``."""
    return f"debug.sample_log={run_dir / 'samples'}"


@pytest.fixture(scope="module")
def reference(tiny_corpus, tmp_path_factory):
    """The uninterrupted 2-rank run: checkpoints at steps 2, 4, 6, 8."""
    run = tmp_path_factory.mktemp("reference")
    run_pretrain(tiny_corpus, run, COMMON + [sample_log(run)])
    return run


# ==================================================================================== SIGKILL
def _launch(data: Path, run: Path, overrides: list[str], log: Path) -> subprocess.Popen:
    ov = TEST_OVERRIDES + [f"data.path={data}", f"logging.dir={run}", sample_log(run)] + overrides
    env = child_env()
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), PRETRAIN]
    cmd += ["--config", TINY_CONFIG] + ov
    with open(log, "a") as f:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)


def _ranks(proc: subprocess.Popen, timeout: float = 120) -> dict[int, psutil.Process]:
    """rank -> training process of a deepspeed launch (waits until both exist)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = {}
        for p in psutil.Process(proc.pid).children(recursive=True):
            try:
                if PRETRAIN in p.cmdline() and "RANK" in p.environ():
                    found[int(p.environ()["RANK"])] = p
            except psutil.Error:
                continue
        if len(found) == 2:
            return found
        time.sleep(0.2)
    raise AssertionError("the training ranks did not start")


def _wait_for(cond, timeout: float, what: str, poll: float = 0.002) -> None:
    deadline = time.time() + timeout
    while not cond():
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(poll)


def _finish_killed(proc: subprocess.Popen, ranks: dict[int, psutil.Process]) -> int:
    """The launcher must tear the other rank down and exit non-zero, well within the timeout."""
    rc = proc.wait(timeout=90)
    for p in ranks.values():
        assert not p.is_running() or p.status() == psutil.STATUS_ZOMBIE, f"rank pid {p.pid} left"
    return rc


@pytest.fixture(scope="module")
def crashed_run(tiny_corpus, tmp_path_factory):
    """The reference job, killed twice with SIGKILL, restarted after each kill until done.

    Kill 1: rank 1, in the middle of saving step_00000004 (the tag directory exists, COMPLETE
    does not; both ranks are frozen with SIGSTOP the moment the directory appears, so the state
    at the kill is known). Kill 2: rank 0, right after it logged step 7 (between checkpoints).
    """
    run = tmp_path_factory.mktemp("crashed")
    log = run / "launch.log"
    tag4 = run / "checkpoints" / "step_00000004"
    info = {}

    proc = _launch(tiny_corpus, run, COMMON, log)
    ranks = _ranks(proc)
    _wait_for(tag4.exists, 240, "step_00000004 to appear")
    for p in ranks.values():
        p.send_signal(signal.SIGSTOP)
    info["complete_at_kill1"] = (tag4 / "COMPLETE").exists()
    info["files_at_kill1"] = sorted(os.listdir(tag4))
    ranks[1].send_signal(signal.SIGKILL)
    ranks[0].send_signal(signal.SIGCONT)
    t0 = time.time()
    info["rc1"] = _finish_killed(proc, ranks)
    info["teardown1_s"] = time.time() - t0
    info["latest_after_kill1"] = (run / "checkpoints" / "latest").read_text()

    proc = _launch(tiny_corpus, run, COMMON, log)
    ranks = _ranks(proc)
    _wait_for(lambda: 7 in _logged_steps(run), 240, "step 7", poll=0.01)
    ranks[0].send_signal(signal.SIGKILL)
    info["rc2"] = _finish_killed(proc, ranks)
    info["latest_after_kill2"] = (run / "checkpoints" / "latest").read_text()

    info["final"] = run_pretrain(tiny_corpus, run, COMMON + [sample_log(run)])
    info["log"] = log.read_text()
    return run, info


def _logged_steps(run: Path) -> set:
    return {r["step"] for r in read_jsonl(run / "metrics.jsonl")}  # a torn last line is skipped


def test_sigkill_mid_save_and_mid_step_resume_equals_uninterrupted(reference, crashed_run):
    run, info = crashed_run
    # Kill 1 hit a save in progress: the tag existed without COMPLETE; 'latest' stayed on 2.
    assert not info["complete_at_kill1"], info["files_at_kill1"]
    assert info["latest_after_kill1"] == "step_00000002"
    assert info["rc1"] != 0 and info["rc2"] != 0
    assert info["teardown1_s"] < 60
    # Restart 1 resumed from step 2 (the partial step 4 was ignored), restart 2 from step 6.
    assert "[resume] " in info["log"] and "step_00000002: step 2," in info["log"]
    assert "step_00000006: step 6," in info["final"].stdout
    assert "step_00000008" not in info["latest_after_kill2"]
    # The losses of every step equal the uninterrupted run's, bit for bit.
    assert losses(run, STEPS) == losses(reference, STEPS)
    # Every tag is complete and valid now: the stale partial one was replaced on save.
    tags = tag_dirs(str(run / "checkpoints"))
    assert tags == [f"step_{s:08d}" for s in (2, 4, 6, 8)]
    assert all(tag_problem(str(run / "checkpoints"), t) is None for t in tags)
    # Same samples per step as the reference (the replayed steps consumed the same rows).
    assert samples(run) == samples(reference)


# ============================================================================ signal at start-up
def _catches(p: psutil.Process, signum: int) -> bool:
    """The process has a handler installed for ``signum`` (SigCgt in /proc/PID/status)."""
    try:
        with open(f"/proc/{p.pid}/status") as f:
            caught = next(int(ln.split()[1], 16) for ln in f if ln.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(caught >> (signum - 1) & 1)


def _maps_hold(p: psutil.Process, name: str) -> bool:
    try:
        with open(f"/proc/{p.pid}/maps") as f:
            return name in f.read()
    except OSError:
        return False


def test_signal_during_startup_ends_it_at_once(tiny_corpus, tmp_path):
    """SIGUSR1 to both ranks of a 2-rank job while they start up (launch/pretrain.py handles it
    from its first line, typically before torch is even imported; DeepSpeed not yet initialised:
    no "[setup]" line): each rank ends at once with one line and exit 75, nothing written (the
    last checkpoint is current; none here). It was kept for a step-1 checkpoint, which under
    SLURM, with another rank gone, left the rank waiting for the cluster's KillWait."""
    log = tmp_path / "launch.log"
    proc = _launch(tiny_corpus, tmp_path, COMMON, log)
    ranks = _ranks(proc)
    _wait_for(lambda: all(_catches(p, signal.SIGUSR1) for p in ranks.values()), 120,
              "the SIGUSR1 handler", poll=0.005)  # fmt: skip
    torch_loaded = [_maps_hold(p, "libtorch") for p in ranks.values()]
    for p in ranks.values():
        p.send_signal(signal.SIGUSR1)
    early = "[setup]" not in log.read_text()
    print(f"torch loaded in the ranks when signalled: {torch_loaded}")
    rc = proc.wait(timeout=300)
    out = log.read_text()
    assert early, "the signal came after DeepSpeed init; the test did not probe start-up"
    assert rc == 75, out[-3000:]
    assert "Traceback" not in out
    stopped = [ln for ln in out.splitlines() if "SIGUSR1 during start-up" in ln]
    assert 1 <= len(stopped) <= 2, out[-3000:]  # the launcher may stop the other rank first
    assert all(ln.endswith("stopped before the first step (the last checkpoint is current)")
               for ln in stopped), stopped  # fmt: skip
    assert "[checkpoint]" not in out and not (tmp_path / "checkpoints" / "latest").exists()


# ===================================================================== metrics window on resume
def test_logged_metrics_after_resume_equal_uninterrupted(tiny_corpus, tmp_path):
    """log_interval=4: a run stopped at step 6 (not a multiple) and resumed logs at step 8 the
    average of steps 5-8, as the uninterrupted run does (the window travels in the checkpoint)."""
    common = ["train.max_steps=12", "train.log_interval=4", "checkpoint.save_interval=0"]
    full, parts = tmp_path / "full", tmp_path / "parts"
    _single(tiny_corpus, full, common, {})
    first = _single(tiny_corpus, parts, common + ["train.stop_at_step=6"], {})
    assert first.returncode == 0 and sorted(read_metrics(parts)) == [4], first.stderr[-2000:]
    second = _single(tiny_corpus, parts, common + ["train.stop_at_step=10"], {})
    assert "step_00000006: step 6," in second.stdout, second.stderr[-2000:]
    _single(tiny_corpus, parts, common, {})
    ref, got = read_metrics(full), read_metrics(parts)
    assert sorted(ref) == sorted(got) == [4, 8, 12]
    for s in (4, 8, 12):
        for key in ("loss", "mlm_accuracy", "lr"):
            assert got[s][key] == ref[s][key], (s, key)


# ======================================================== ZeRO stage change on resume (universal)
def test_resume_under_another_zero_stage_via_universal_checkpoint(reference, resumed):
    """The reference's ZeRO-2 step 4, resumed on the same 2 ranks under ZeRO-1: converted to a
    universal checkpoint (said on the console), Adam's step counter continues, LR equal, losses
    within bf16 noise of the uninterrupted ZeRO-2 run."""
    run, stdout = resumed["zero1"]
    assert (
        "was saved with another engine config (deepspeed.zero.stage 2 -> 1): loading it "
        "through a universal checkpoint" in stdout
    )
    assert "step 4, epoch 0, sampler consumed 32" in stdout
    assert not (run / "checkpoints" / "universal").exists()
    ref, got = read_metrics(reference), read_metrics(run)
    assert sorted(got) == [5, 6, 7, 8]
    for s in (5, 6, 7, 8):
        assert got[s]["lr"] == ref[s]["lr"]
        assert got[s]["loss"] == pytest.approx(ref[s]["loss"], abs=0.02)
    assert adam_steps(run / "checkpoints" / "step_00000008") == [8.0] * 4


# ============================================================================ world-size change
@pytest.fixture(scope="module")
def resumed(reference, tiny_corpus, tmp_path_factory):
    """The reference resumed in other layouts: ``one``: its step 4 on 1 rank (to step 8);
    then, in one 2-rank process group (tests/layout_worker.py: the start-up paid once),
    ``two``: one's step 6 back on 2 ranks (to step 8), and ``zero1``: its step 4 on the same 2
    ranks under ZeRO-1. The global batch stays 8 rows (1 x 8 or 2 x 4), so each step sees the
    same rows. name -> (run directory, stdout)."""
    root = tmp_path_factory.mktemp("resumed")
    one, two, zero1 = root / "resize_2to1", root / "resize_1to2", root / "zero1"
    copy_tag(reference, one, "step_00000004")
    p1 = run_pretrain(tiny_corpus, one, COMMON + ["train.micro_batch_size=8", sample_log(one)],
                      nproc=1, launcher="python")  # fmt: skip
    copy_tag(one, two, "step_00000006")
    copy_tag(reference, zero1, "step_00000004")
    stdout = run_worker_ranks(2, [
        worker_run(two.name, tiny_corpus, COMMON + [sample_log(two)]),
        worker_run(zero1.name, tiny_corpus, COMMON + ["deepspeed.zero.stage=1"]),
    ], root, "launch")  # fmt: skip
    return {"one": (one, p1.stdout), "two": (two, stdout[two.name]),
            "zero1": (zero1, stdout[zero1.name])}  # fmt: skip


@pytest.fixture(scope="module")
def resized(resumed):
    """2 ranks (reference, step 4) -> 1 rank (to step 8) ; its step 6 -> 2 ranks (to step 8):
    ``(one, its stdout, two, its stdout)``."""
    return (*resumed["one"], *resumed["two"])


def test_resume_2_ranks_on_1_and_1_on_2_via_universal_checkpoint(reference, resized):
    one, p1, two, p2 = resized
    for stdout, saved, now, step in ((p1, 2, 1, 4), (p2, 1, 2, 6)):
        assert f"saved by {saved} rank(s), this run has {now}: converting" in stdout
        assert f"step {step}, epoch 0, sampler consumed {8 * step}" in stdout
    assert not (one / "checkpoints" / "universal").exists()  # derived data removed after load
    ref = read_metrics(reference)
    m1, m2 = read_metrics(one), read_metrics(two)
    # Step counter and LR schedule continue exactly; losses continue at the reference's level.
    assert sorted(m1) == [5, 6, 7, 8] and sorted(m2) == [7, 8]
    for s in (5, 6, 7, 8):
        assert m1[s]["lr"] == ref[s]["lr"]
        assert m1[s]["loss"] == pytest.approx(ref[s]["loss"], abs=0.02)
    for s in (7, 8):
        assert m2[s]["loss"] == pytest.approx(ref[s]["loss"], abs=0.02)
    # The optimizer state was restored (Adam's step counter continued, not restarted at 1) and
    # the weights track the reference's within bf16 noise: 1.3% of what 2 steps moved them.
    assert adam_steps(one / "checkpoints" / "step_00000006") == [6.0, 6.0]
    assert adam_steps(two / "checkpoints" / "step_00000008") == [8.0] * 4
    r4, r6, r8 = (weights(reference / "checkpoints", f"step_0000000{s}") for s in (4, 6, 8))
    moved = l2(r6, r4)
    assert l2(weights(one / "checkpoints", "step_00000006"), r6) < 0.05 * moved
    assert l2(weights(two / "checkpoints", "step_00000008"), r8) < 0.05 * moved


def test_resharded_sampler_neither_repeats_nor_skips(reference, resized, tiny_corpus):
    one, _, two, _ = resized
    ref = samples(reference)
    got = {s: ref[s] for s in (1, 2, 3, 4)}
    got.update({s: samples(one)[s] for s in (5, 6)})
    got.update({s: samples(two)[s] for s in (7, 8)})
    assert sorted(samples(one)) == [5, 6, 7, 8] and sorted(samples(two)) == [7, 8]
    # The same rows per step as the uninterrupted 2-rank run ...
    assert got == {s: ref[s] for s in STEPS}
    # ... and together exactly the first 64 positions of the epoch's permutation, once each.
    n = len(ShardDataset(tiny_corpus, "train"))
    perm = ResumableDistributedSampler(n, 0, 1, seed=42).permutation(0)
    flat = [i for s in STEPS for i in got[s]]
    assert len(flat) == len(set(flat)) == 64
    assert set(flat) == set(int(i) for i in perm[:64])


# ================================================================================== non-finite
def _single(data: Path, run: Path, overrides: list[str], env: dict[str, str]):
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        return run_pretrain(data, run, overrides, nproc=1, launcher="python", check=False)


def test_nonfinite_stop_keeps_last_good_checkpoint(tiny_corpus, tmp_path):
    proc = _single(
        tiny_corpus,
        tmp_path,
        [
            "train.max_steps=6",
            "checkpoint.save_interval=2",
            "train.nonfinite=stop",
            "debug.nan_at_step=3",
        ],
        {},
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    # an error: stderr (linformer_ds.log)
    assert "[error] non-finite loss at step 3 on 1 micro-batch(es); stopping" in proc.stderr
    assert f"Last good checkpoint: {tmp_path / 'checkpoints' / 'step_00000002'}" in proc.stderr
    assert tag_dirs(str(tmp_path / "checkpoints")) == ["step_00000002"]
    assert latest_tag(str(tmp_path / "checkpoints")) == "step_00000002"
    assert sorted(read_metrics(tmp_path)) == [1, 2]


def test_nonfinite_skip_leaves_weights_untouched_and_continues(tiny_corpus, tmp_path):
    """bf16 ZeRO-2: the NaN step is skipped before the update (DeepSpeed's overflow check):
    the weights after step 3 equal those after step 2, bit for bit; step 4 trains again."""
    proc = _single(
        tiny_corpus,
        tmp_path,
        [
            "train.max_steps=4",
            "checkpoint.save_interval=1",
            "checkpoint.keep_last=0",
            "train.nonfinite=skip",
            "debug.nan_at_step=3",
        ],
        {},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[warn] step 3: non-finite loss; step skipped (train.nonfinite=skip)" in proc.stderr
    d = tmp_path / "checkpoints"
    w2, w3, w4 = (weights(d, f"step_0000000{s}") for s in (2, 3, 4))
    assert max_diff(w2, w3) == 0.0
    assert max_diff(w3, w4) > 0 and all(torch.isfinite(v).all() for v in w4.values())
    m = read_metrics(tmp_path)
    assert m[4]["loss"] == m[4]["loss"] and m[4]["loss"] < 8.0  # finite


# ============================================================================ full / read-only disk
@pytest.fixture
def tmpfs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(mnt)], capture_output=True
    )
    assert res.returncode == 0, f"mount failed (tests need root): {res.stderr!r}"
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_during_save_names_dir_keeps_previous(tiny_corpus, tmp_path, tmpfs):
    """A 5 MiB tmpfs holds one 1-rank checkpoint (~3.3 MB) but not two."""
    ck = tmpfs / "ckpt"
    proc = _single(
        tiny_corpus,
        tmp_path / "run",
        [
            "train.max_steps=4",
            "checkpoint.save_interval=1",
            "checkpoint.keep_last=0",
            f"checkpoint.dir={ck}",
        ],
        {},
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: could not write checkpoint {ck / 'step_00000002'}: "), last
    assert "MiB free); earlier checkpoints in" in last and "Traceback" not in proc.stderr
    assert tag_dirs(str(ck)) == ["step_00000001"]
    assert latest_tag(str(ck)) == "step_00000001"
    assert tag_problem(str(ck), "step_00000001") is None


def test_read_only_checkpoint_dir_fails_before_training(tiny_corpus, tmp_path, tmpfs):
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    proc = _single(tiny_corpus, tmp_path / "run", [f"checkpoint.dir={tmpfs}/ckpt"], {})
    assert proc.returncode == 2
    assert (
        f"error: checkpoint.dir {tmpfs}/ckpt is not writable: Read-only file system" in proc.stderr
    )
    assert "Traceback" not in proc.stderr and "[train]" not in proc.stdout


def test_data_prep_and_export_to_read_only_out(reference, tiny_corpus, tmp_path, tmpfs, capsys):
    """``--out`` on a read-only file system: one line, exit 2, for data_prep and export; the
    checkpoint read by export is untouched."""
    from linformer_ds import export

    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    text = tmp_path / "doc.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 200)
    proc = subprocess.run(
        [sys.executable, "-m", "data_prep", "--source", str(text), "--tokenizer",
         str(tiny_corpus / "tokenizer.model"), "--seq-len", "32", "--out", str(tmpfs / "data")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        f"data_prep: error: --out {tmpfs}/data: cannot write there: Read-only file system "
        f"({tmpfs}); choose a writable --out"
    )
    before = sorted(os.listdir(reference / "checkpoints" / "step_00000008"))
    rc = export.main(["--checkpoint", str(reference / "checkpoints"), "--out", str(tmpfs / "hf")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err == (
        f"export failed: --out {tmpfs}/hf: cannot write there: Read-only file system "
        f"({tmpfs}); choose a writable --out"
    ), err
    assert sorted(os.listdir(reference / "checkpoints" / "step_00000008")) == before


# =================================================================================== security
class _Payload:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_checkpoint_with_pickled_code_is_refused_not_run(resized, tiny_corpus, tmp_path):
    """A 1-rank checkpoint whose optimizer file carries a pickled os.system call (inventory
    updated, as an attacker would): resume refuses it and the code never runs."""
    one = resized[0]
    copy_tag(one, tmp_path, "step_00000008")
    tag_dir = tmp_path / "checkpoints" / "step_00000008"
    pwned = tmp_path / "pwned"
    (optim,) = tag_dir.glob("*_optim_states.pt")
    torch.save({"optimizer_state_dict": _Payload(str(pwned))}, optim)
    complete = json.loads((tag_dir / "COMPLETE").read_text())
    complete["files"][optim.name] = optim.stat().st_size
    (tag_dir / "COMPLETE").write_text(json.dumps(complete))
    proc = _single(tiny_corpus, tmp_path, ["train.max_steps=10", "train.micro_batch_size=8"], {})
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"{optim} cannot be loaded safely (weights_only=True refused it" in proc.stderr
    assert not pwned.exists()
    # Our own checkpoints load with weights_only=True (the reference's files, all of them).
    for path in sorted((one / "checkpoints" / "step_00000008").glob("*.pt")):
        assert isinstance(safe_torch_load(str(path)), dict)
