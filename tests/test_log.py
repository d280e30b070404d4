"""The package's console output (linformer_ds/log.py, issue 43 item 6): one logger with rank
prefixes. The prefix ``[rank R] `` on every line of a rank R > 0 of several, none on one rank
(nor on rank 0); one handler however often the set-up runs; levels and streams (INFO: stdout,
WARNING and up: stderr, ``LINFORMER_DS_LOG_LEVEL``); a real one-rank run's lines unchanged."""

import gc
import logging
import os
import random
import re
import signal
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from linformer_ds import log as lg
from tests.pretrain_utils import REPO, TEST_OVERRIDES, TINY_CONFIG


def _record(msg: str, level: int = logging.INFO) -> logging.LogRecord:
    return logging.LogRecord("linformer_ds.test", level, __file__, 1, msg, None, None)


@pytest.fixture
def package_logger():
    """The package logger with its handler, level INFO, output to stdout; as it was after."""
    logger = lg.setup_logging(logging.INFO)
    handler = lg._handler(logger)
    assert handler is not None
    level, stream = logger.level, handler.info_stream
    yield logger
    logger.setLevel(level)
    handler.info_stream = stream


# ===================================================================================== prefix
def test_prefix_on_every_line_of_a_rank_over_0_of_several():
    line = "[eval] step 2 loss=7.1"
    assert lg.RankFormatter(1, 2).format(_record(line)) == "[rank 1] " + line
    assert lg.RankFormatter(3, 4).format(_record("[done] a\n[done] b")) == (
        "[rank 3] [done] a\n[rank 3] [done] b"
    )
    assert lg.RankFormatter(0, 1).format(_record(line)) == line  # one rank: nothing extra
    assert lg.RankFormatter(0, 2).format(_record(line)) == line  # rank 0: the run's voice
    assert lg.rank_prefix(1, 2) == "[rank 1] " and lg.rank_prefix(0, 1) == ""


def test_rank_and_world_from_every_launcher():
    assert lg.rank_and_world({}) == (0, 1)
    assert lg.rank_and_world({"RANK": "2", "WORLD_SIZE": "4"}) == (2, 4)
    assert lg.rank_and_world({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}) == (1, 2)
    assert lg.rank_and_world({"PMI_RANK": "3", "PMI_SIZE": "8"}) == (3, 8)
    step = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_ID": "0"}
    assert lg.rank_and_world(step) == (1, 2)
    # the batch script (no step) is one process; mpirun inside it: MPI's ranks win
    assert lg.rank_and_world({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}) == (0, 1)
    both = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "SLURM_PROCID": "0"}
    assert lg.rank_and_world(both) == (1, 2)
    assert lg.rank_and_world({"RANK": "abc", "WORLD_SIZE": "2"}) == (0, 1)  # never raises


def test_a_rank_over_0_prefixes_in_a_fresh_process():
    """The real set-up in a process of its own: rank 1 of 2 (RANK/WORLD_SIZE), the set-up run
    twice, a progress line on stdout and an error line on stderr, each once and prefixed."""
    code = (
        "from linformer_ds import log, outdir\n"
        "log.setup_logging(); log.setup_logging()\n"
        "log.get_logger('linformer_ds.train').info('[train] step 1 loss=7')\n"
        "raise SystemExit(outdir.fail('export failed', 'no such tag'))\n"
    )
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2"}
    env.pop("LINFORMER_DS_LOG_LEVEL", None)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "[rank 1] [train] step 1 loss=7\n"
    assert proc.stderr == "[rank 1] export failed: no such tag\n"


# ============================================================================ handler and levels
def test_the_handler_is_installed_once(package_logger, capsys):
    for _ in range(3):
        lg.setup_logging()
    lg.get_logger("linformer_ds.metrics")
    lg.get_logger("elsewhere")  # another name goes under the package
    handlers = [h for h in package_logger.handlers if isinstance(h, lg.ConsoleHandler)]
    assert len(handlers) == 1 and not package_logger.propagate
    lg.get_logger("linformer_ds.metrics").info("[train] step 1")
    assert capsys.readouterr().out == "[train] step 1\n"  # once, as written
    assert lg.get_logger("elsewhere").name == "linformer_ds.elsewhere"


def test_levels_and_streams(package_logger, capsys, monkeypatch):
    log = lg.get_logger("linformer_ds.train")
    log.info("[setup] x")
    log.warning("[warn] y")
    log.error("error: z")
    got = capsys.readouterr()
    assert got.out == "[setup] x\n" and got.err == "[warn] y\nerror: z\n"
    package_logger.setLevel(logging.WARNING)  # the standard API: progress hidden
    log.info("[train] hidden")
    log.warning("[warn] shown")
    got = capsys.readouterr()
    assert got.out == "" and got.err == "[warn] shown\n"
    package_logger.setLevel(logging.DEBUG)
    log.debug("[debug] shown")
    assert capsys.readouterr().out == "[debug] shown\n"
    monkeypatch.setenv(lg.LEVEL_ENV, " Error ")  # the environment, read by the entry points
    lg.setup_logging()
    log.warning("[warn] hidden")
    log.error("error: shown")
    assert capsys.readouterr().err == "error: shown\n"
    monkeypatch.setenv(lg.LEVEL_ENV, "")  # empty: the level stays
    lg.setup_logging()
    assert package_logger.level == logging.ERROR
    monkeypatch.setenv(lg.LEVEL_ENV, "loud")
    with pytest.raises(lg.LogLevelError, match=r"LINFORMER_DS_LOG_LEVEL='loud' is not a log"):
        lg.setup_logging()
    assert lg.env_level(env={lg.LEVEL_ENV: "15"}) == 15 and lg.env_level(env={}) is None


def test_info_to_stderr_inside_the_block_only(package_logger, capsys):
    log = lg.get_logger("linformer_ds.context_curve")
    with lg.info_to("stderr"):
        log.info("[context] progress")
    log.info("[train] after")
    got = capsys.readouterr()
    assert got.err == "[context] progress\n" and got.out == "[train] after\n"


def test_a_bad_level_stops_the_trainer_in_one_line(package_logger, capsys, monkeypatch):
    from linformer_ds import train

    monkeypatch.setenv(lg.LEVEL_ENV, "verbose")
    assert train.main(["--config", TINY_CONFIG]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: LINFORMER_DS_LOG_LEVEL='verbose' is not a log level"), err
    assert len(err.splitlines()) == 1


# ==================================================================== data_prep obeys the level
LEVEL_NAMES = ("debug", "info", "warning", "error", "critical", "15", "25", "35", "45")


def _data_prep_lines(tmp_path, monkeypatch, capsys, level, binary, bad):
    """``python -m data_prep``'s main in this process on three small text files (and a file that
    is not text: a warning; or a --vocab-size too small: an error) at ``level``."""
    from data_prep.__main__ import main

    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    rng = random.Random(0)
    words = ["".join(rng.choices("abcdefghijklmnop", k=rng.randint(2, 7))) for _ in range(200)]
    for i in range(3):
        (src / f"d{i}.txt").write_text(
            "\n".join(" ".join(rng.choices(words, k=12)) for _ in range(30))
        )
    (src / "b.bin").unlink(missing_ok=True)
    if binary:
        (src / "b.bin").write_bytes(b"\x00\x01\x02 not text")
    monkeypatch.setenv(lg.LEVEL_ENV, level)
    out = tmp_path / f"out_{len(list(tmp_path.iterdir()))}"
    rc = main(["--source", str(src), "--out", str(out), "--seq-len", "16", "--vocab-size",
               "5" if bad else "40", "--workers", "0", "--valid-fraction", "0"])  # fmt: skip
    got = capsys.readouterr()
    return rc, got.out, [ln for ln in got.err.splitlines() if ln.strip()]


@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(level=st.sampled_from(LEVEL_NAMES), binary=st.booleans(), bad=st.booleans())
def test_data_prep_obeys_the_log_level(package_logger, tmp_path, monkeypatch, capsys, level,
                                       binary, bad):  # fmt: skip
    """Progress and summary lines are INFO, ``data_prep: warning:`` WARNING and ``data_prep:
    error:`` ERROR, as every command's lines through the package logger: each shown exactly when
    LINFORMER_DS_LOG_LEVEL lets its level through; the exit code does not depend on it."""
    want = lg.env_level(env={lg.LEVEL_ENV: level})
    try:
        rc, out, err = _data_prep_lines(tmp_path, monkeypatch, capsys, level, binary, bad)
    finally:
        package_logger.setLevel(logging.INFO)
    assert rc == (2 if bad else 0) and out == ""
    errors = [ln for ln in err if ln.startswith("data_prep: error:")]
    warnings = [ln for ln in err if ln.startswith("data_prep: warning:")]
    progress = [ln for ln in err if ln not in errors and ln not in warnings]
    assert len(errors) == (1 if bad and want <= logging.ERROR else 0), err
    assert len(warnings) == (1 if binary and not bad and want <= logging.WARNING else 0), err
    assert bool(progress) == (not bad and want <= logging.INFO), err


def test_data_prep_refuses_a_bad_level_in_one_line(package_logger, tmp_path, monkeypatch, capsys):
    rc, out, err = _data_prep_lines(tmp_path, monkeypatch, capsys, "verbose", True, False)
    assert rc == 2 and out == "" and len(err) == 1, err
    assert err[0].startswith("data_prep: error: LINFORMER_DS_LOG_LEVEL='verbose' is not a log")
    assert not (tmp_path / "out_1").exists()


# =================================================================== a real one-rank run's lines
def test_one_rank_run_lines_are_unchanged(tiny_corpus, tmp_path, capsys, _clean_env,
                                          package_logger):  # fmt: skip
    """A 2-step one-rank run with an evaluation (in this process): ``[train]``, ``[eval]`` and
    ``[done]`` lines on stdout as they always were, no rank prefix, nothing on stderr."""
    from linformer_ds import train

    run = tmp_path / "run"
    before = {s: signal.getsignal(s) for s in train.STOP_SIGNALS}
    frozen = gc.get_freeze_count()
    gc.disable()  # as launch/pretrain.py starts: start_trainer turns the collector back on
    try:
        rc = train.main(["--config", TINY_CONFIG, *TEST_OVERRIDES, f"data.path={tiny_corpus}",
                         f"logging.dir={run}", "train.max_steps=2", "train.eval_interval=2",
                         "train.eval_batches=1", "deepspeed.precision=fp32"])  # fmt: skip
        assert gc.isenabled() and gc.get_freeze_count() > frozen, gc.get_freeze_count()
    finally:
        gc.enable()
        gc.unfreeze()  # this process's objects collectable again
    got = capsys.readouterr()
    assert rc == 0, got.err[-3000:]
    # the caller's process has its signal handling back (the trainer's flag no longer eats them)
    assert {s: signal.getsignal(s) for s in train.STOP_SIGNALS} == before
    lines = got.out.splitlines()
    assert not any("[rank" in ln for ln in lines), got.out[-3000:]
    tagged = [ln for ln in lines if re.match(r"\[(train|eval|done|setup)\] ", ln)]
    assert [ln.split(" ")[0] for ln in tagged] == [
        "[setup]", "[train]", "[train]", "[eval]", "[done]", "[done]",
    ], tagged  # fmt: skip
    assert re.fullmatch(r"\[train\] step 1 loss=\S+ .*", tagged[1]), tagged[1]
    assert re.fullmatch(r"\[eval\] step 2 loss=\S+ perplexity=\S+ mlm_accuracy=.*", tagged[3])
    assert re.fullmatch(r"\[done\] step 2: first loss \d+\.\d+, last loss \d+\.\d+", tagged[4])
    ckpts = run / "checkpoints"
    assert tagged[5] == f"[done] checkpoints: {ckpts} (latest: step_00000002)"
    assert got.err == "", got.err[-3000:]
