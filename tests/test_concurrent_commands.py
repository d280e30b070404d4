"""Issue 30 item 8: generated pairs of commands on one directory, started a random time apart.

The commands: a pretrain into the run directory D, a second pretrain into D, an export of D's
checkpoints (reads D), an export into D, a finetune into D and a data_prep into D. For any pair
and start offset the contract (issue 30 item 2) holds for both commands: each either works
(exit 0, its output whole at the end) or is refused in one line, exit 2, naming the holder
(host, pid) when another command holds the directory. Never a traceback, never two owners of D
(the output of every command that exited 0 and writes D is whole at the end), never an
interleaved metrics.jsonl (each step once, in order), no lock or staging file left behind.

Real processes; the offsets make the second command meet the first in start-up, while it holds
the directory, or after it ended, whichever the machine's speed gives: every outcome is checked
against the same contract, none is assumed. ``LINFORMER_CONCURRENT_EXAMPLES=N`` runs N random
examples instead of the fixed ones.
"""

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from linformer_ds.fsio import read_jsonl
from tests.pretrain_utils import (
    PRETRAIN,
    REPO,
    TEST_OVERRIDES,
    TINY_CONFIG,
    child_env,
    run_pretrain,
)

EXAMPLES = int(os.environ.get("LINFORMER_CONCURRENT_EXAMPLES", "0"))
KINDS = ("pretrain", "pretrain2", "export_run", "export", "finetune", "data_prep")
WRITES_D = {"pretrain": "run", "pretrain2": "run", "export": "export", "finetune": "finetune",
            "data_prep": "data_prep"}  # fmt: skip
STEPS = 3
TIMEOUT_S = 600  # one command; a hang fails the example rather than the suite


def _env() -> dict:
    env = child_env(TOKENIZERS_PARALLELISM="0")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


@pytest.fixture(scope="module")
def inputs(tiny_corpus, tmp_path_factory) -> dict[str, Path]:
    """The corpus, a trained run (2 steps) to export, its export to fine-tune, a labelled CSV."""
    root = tmp_path_factory.mktemp("concurrent")
    src = root / "source_run"
    run_pretrain(tiny_corpus, src, ["train.max_steps=2"], nproc=1, launcher="python")
    model = root / "model"
    subprocess.run([sys.executable, str(REPO / "launch" / "export.py"), "--checkpoint",
                    str(src / "checkpoints"), "--out", str(model)], cwd=REPO, env=_env(),
                   check=True, capture_output=True, timeout=TIMEOUT_S)  # fmt: skip
    rows = ["text,label"] + [f"value number {i} is {'even' if i % 2 == 0 else 'odd'},{i % 2}"
                             for i in range(24)]  # fmt: skip
    (root / "train.csv").write_text("\n".join(rows) + "\n")
    return {"corpus": tiny_corpus, "source": src, "model": model, "csv": root / "train.csv"}


def command(kind: str, inputs: dict[str, Path], d: Path, side: Path) -> list[str]:
    """The command line of ``kind`` on directory ``d`` (``side``: export_run's own --out)."""
    py = sys.executable
    if kind in ("pretrain", "pretrain2"):
        return [py, PRETRAIN, "--config", TINY_CONFIG, *TEST_OVERRIDES,
                f"data.path={inputs['corpus']}", f"logging.dir={d}",
                f"train.max_steps={STEPS}", "checkpoint.save_interval=1"]  # fmt: skip
    export = [py, str(REPO / "launch" / "export.py"), "--checkpoint"]
    if kind == "export_run":
        return [*export, str(d / "checkpoints"), "--out", str(side)]
    if kind == "export":
        return [*export, str(inputs["source"] / "checkpoints"), "--out", str(d)]
    if kind == "finetune":
        return [py, str(REPO / "launch" / "finetune.py"), "--model", str(inputs["model"]),
                "--train", str(inputs["csv"]), "--validation-fraction", "0.25", "--epochs", "1",
                "--batch-size", "8", "--max-length", "16", "--out", str(d)]  # fmt: skip
    assert kind == "data_prep", kind
    return [py, "-m", "data_prep", "--source", "stdlib", "--out", str(d), "--seq-len", "64",
            "--vocab-size", "400", "--max-docs", "40", "--valid-fraction", "0", "--quiet"]  # fmt: skip


def whole(kind: str, d: Path, side: Path) -> str:
    """Why the output of ``kind`` (which exited 0) is not whole at the end; "" when it is."""
    if kind in ("pretrain", "pretrain2"):
        rows = read_jsonl(d / "metrics.jsonl") if (d / "metrics.jsonl").is_file() else []
        steps = [r["step"] for r in rows if r.get("split") == "train"]
        if steps != list(range(1, STEPS + 1)):
            return f"metrics.jsonl train steps {steps}"
        latest = d / "checkpoints" / "latest"
        if not latest.is_file() or latest.read_text().strip() != f"step_{STEPS:08d}":
            return "no latest checkpoint of the last step"
        if not (d / "checkpoints" / f"step_{STEPS:08d}" / "COMPLETE").is_file():
            return "the last tag is not complete"
        return ""
    if kind == "export_run":
        return "" if (side / "linformer_export.json").is_file() else "export_run: no export"
    own = {"export": "linformer_export.json", "finetune": "finetune_results.json",
           "data_prep": "manifest.json"}[kind]  # fmt: skip
    return "" if (d / own).is_file() else f"{kind}: {own} missing from {d}"


def check_refusal(kind: str, err: str, other_pid: int) -> None:
    """Exit 2: one line; a directory in use names its holder (host and the other's pid)."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.search(r"error|failed|refus|in use", ln, re.IGNORECASE)]
    assert len(errors) == 1, (kind, err[-3000:])
    if "in use by" in errors[0]:
        assert f"(host {socket.gethostname()}, pid {other_pid} " in errors[0], (kind, errors[0])


def leftovers(root: Path) -> list[str]:
    """Lock files and staging directories left anywhere below ``root``."""
    found = []
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            if name.endswith((".lock", ".data_prep-partial")) or name.startswith(
                (".export-", ".finetune-", ".data_prep-")
            ):
                found.append(os.path.relpath(os.path.join(dirpath, name), root))
    return found


def run_pair(inputs: dict[str, Path], first: str, second: str, offset: float) -> None:
    root = Path(tempfile.mkdtemp(prefix="pair-", dir=inputs["model"].parent))
    d, procs, logs = root / "target", [], []
    try:
        for i, kind in enumerate((first, second)):
            if i:
                time.sleep(offset)
            out, err = open(root / f"{i}.out", "w"), open(root / f"{i}.err", "w")
            logs.append((out, err))
            cmd = command(kind, inputs, d, root / f"side{i}")
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=out, stderr=err))
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=TIMEOUT_S))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for out, err in logs:
            out.close()
            err.close()
    kinds: tuple[str, str] = (first, second)
    texts = [((root / f"{i}.out").read_text(), (root / f"{i}.err").read_text()) for i in (0, 1)]
    what = f"{first} then {second} after {offset:.2f} s: exit {codes}"
    print(what)
    for i, (kind, code, (out, err)) in enumerate(zip(kinds, codes, texts)):
        context = (what, kind, out[-1500:], err[-3000:])
        assert code in (0, 2), context
        assert "Traceback" not in out + err, context
        if code == 2:
            check_refusal(kind, err, procs[1 - i].pid)
    ok = [(k, i) for i, (k, c) in enumerate(zip(kinds, codes)) if c == 0]
    owners = {WRITES_D[k] for k, _ in ok if k in WRITES_D}
    assert len(owners) <= 1, (what, "two owners of one directory", owners)
    for kind, i in ok:
        problem = whole(kind, d, root / f"side{i}")
        assert not problem, (what, kind, problem, texts[i][1][-2000:])
    assert leftovers(root) == [], (what, leftovers(root))
    shutil.rmtree(root, ignore_errors=True)


CONCURRENT = settings(
    max_examples=EXAMPLES or 2,  # besides the explicit examples: 5 pairs, ~5 min loaded
    deadline=None,
    derandomize=not EXAMPLES,  # the suite runs the same examples every time
    suppress_health_check=list(HealthCheck),
    database=None,
)


@pytest.mark.slow  # two real commands per example (trainers among them)
@CONCURRENT
@given(
    first=st.sampled_from(KINDS),
    second=st.sampled_from(KINDS),
    offset=st.floats(0.0, 12.0),
)
@example(first="pretrain", second="pretrain2", offset=0.0)
@example(first="data_prep", second="pretrain", offset=0.0)  # was: both exit 0, two owners
@example(first="export", second="finetune", offset=0.0)
def test_two_commands_on_one_directory_keep_the_contract(inputs, first, second, offset):
    run_pair(inputs, first, second, offset)


def test_a_run_locks_beside_its_directory_and_refuses_another_commands_output(tmp_path):
    """dirlock.run_dir_locks: the --out lock beside the run directory (data_prep, export and
    finetune are refused naming the run) and the lock inside; a data_prep output, an export or
    a fine-tuned model is refused as a run directory, leaving no lock file."""
    from linformer_ds import dirlock

    run = tmp_path / "run"
    locks = dirlock.run_dir_locks(str(run), "logging.dir", "training")
    assert sorted(Path(lk.path).relative_to(tmp_path).as_posix() for lk in locks) == [
        ".run.lock", "run/.linformer.lock"]  # fmt: skip
    for tool in ("data_prep", "export", "finetune"):
        with pytest.raises(dirlock.LockError) as e:
            dirlock.output_lock(str(run), tool).acquire()
        assert str(e.value).startswith(
            f"--out {run} is in use by training (host {socket.gethostname()}, pid {os.getpid()} "
        ), str(e.value)
    for lk in locks:
        lk.release()
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["run"]
    for own, made_by in (("manifest.json", "data_prep"), ("linformer_export.json", "export"),
                         ("finetune_results.json", "finetune")):  # fmt: skip
        out = tmp_path / made_by
        out.mkdir()
        (out / own).write_text("{}")
        (out / "tokenizer.model").write_text("")
        with pytest.raises(dirlock.LockError) as e:
            dirlock.run_dir_locks(str(out), "logging.dir", "training")
        assert f"logging.dir {out} is " in str(e.value) and f"(made by {made_by})" in str(e.value)
        assert not list(tmp_path.glob("**/*.lock")) and not list(tmp_path.glob(".*.lock"))


def test_a_refusal_waits_for_a_holder_that_has_not_written_its_record_yet(tmp_path):
    """The race the generated test met in CI: the other process has flocked the file but not
    yet written its record; the refusal waits for the record (bounded) and names the holder."""
    import fcntl
    import json
    import threading

    from linformer_ds import dirlock

    path = tmp_path / ".target.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held, no record yet
    record = {"host": socket.gethostname(), "pid": 4242, "command": "data_prep"}
    writer = threading.Timer(0.3, lambda: os.pwrite(fd, json.dumps(record).encode(), 0))
    writer.start()
    try:
        with pytest.raises(dirlock.LockError) as e:
            dirlock.DirLock(str(path), "--out target", "data_prep").acquire()
        assert f"in use by data_prep (host {socket.gethostname()}, pid 4242" in str(e.value)
    finally:
        writer.join()
        os.close(fd)
