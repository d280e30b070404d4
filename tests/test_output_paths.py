"""The output contract (linformer_ds.outdir.check_path, issue 45 item 1) of every command that
writes an output path: ``python -m data_prep``, ``launch/export.py`` and ``launch/finetune.py``
(a directory), ``launch/convert.py --out`` and the ONNX export's ``OUT`` (a file). Every command
runs against the same table of bad outputs (BAD: an input's file, the input directory, a new
name inside it, links to either, a directory holding the inputs, an existing file, a link to
one, a dangling link, a user's directory, an empty directory or a directory name where a file
is written, paths under a regular file, a checkpoint's ``latest``, a checkpoint directory, tag
or training run and new names inside them, another command's earlier output (export, data_prep,
fine-tuned model) and new names inside them, an empty path, a NUL byte, a read-only directory),
with generated file names and ``--overwrite`` drawn on or off wherever it leaves the output bad:
one stderr line that names the output flag, a non-zero exit, and every file that existed before
byte for byte with nothing added (no temporary name or lock file left). Ctrl-C during the work
exits 130 with one line and leaves no partial output (a real SIGINT to launch/finetune.py, and
to ``python -m data_prep``, whose ``--resume`` then completes to an uninterrupted run's bytes); a
replaced file is swapped in whole."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from data_prep import DataPrepError, PrepConfig, prepare
from data_prep.__main__ import main as data_prep_main
from data_prep.sources import SourceKind, register_source_kind, unregister_source_kind
from linformer_ds import onnx_export, warm_start
from linformer_ds.export import main as export_main
from linformer_ds.finetune import main as finetune_main
from linformer_ds.outpath import EXIT_INTERRUPTED, OutPathError, check_out_file, staged
from tests.pretrain_utils import REPO, child_env

transformers = pytest.importorskip("transformers")

ROOT_USER = os.geteuid() == 0  # root writes into a chmod 555 directory: an immutable one then


def _read_only(path) -> None:
    """Make the directory ``path`` unwritable: chmod 555, and as root (who writes there all
    the same) ``chattr +i`` where the file system has it (the read-only cases are skipped
    where ``path`` stays writable)."""
    os.chmod(path, 0o555)
    if ROOT_USER and shutil.which("chattr"):
        subprocess.run(["chattr", "+i", str(path)], capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """The inputs of every command and what a user has around them: a warm-start source (a
    saved BERT), a job config, an export directory (its files only: the bad outputs are refused
    before it is read), a checkpoint directory, a data_prep source and tokenizer file, a
    fine-tuning CSV, a training run, earlier outputs of export, data_prep and finetune, plain
    files, links, directories and a read-only directory."""
    root = tmp_path_factory.mktemp("outputs")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=32,
                                  max_position_embeddings=32)  # fmt: skip
    transformers.BertForMaskedLM(cfg).save_pretrained(str(root / "src"))
    (root / "base.yaml").write_text("model:\n  k: 8\n")
    files = {
        "export/config.json": json.dumps({"architectures": ["LinformerForMaskedLM"]}),
        "export/model.safetensors": "weights" * 100,
        "export/linformer_export.json": "{}",
        "ckpt/step_00000002/COMPLETE": "",
        "ckpt/latest": "step_00000002",
        "corpus/doc0.txt": "alpha beta gamma\ndelta epsilon\n",
        "sp.model": "a tokenizer file",
        "ft/train.csv": "text,label\nalpha beta,a\ngamma delta,b\n",
        "run/metrics.jsonl": '{"step": 1}\n',
        "prev_export/linformer_export.json": "{}",
        "prev_export/config.json": "{}",
        "prev_data/manifest.json": "{}",
        "prev_data/tokenizer.model": "sp",
        "prev_ft/finetune_results.json": "{}",
        "prev_ft/linformer_export.json": "{}",
        "notes.txt": "precious notes\n",
        "adir/thesis.tex": "my thesis\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    links = {"link_to_notes": "notes.txt", "link_to_src": "src/config.json",
             "link_to_srcdir": "src", "link_to_export": "export/model.safetensors",
             "link_to_exportdir": "export", "link_to_doc": "corpus/doc0.txt",
             "link_to_corpus": "corpus", "link_to_sp": "sp.model", "link_to_ckpt": "ckpt",
             "link_to_train": "ft/train.csv", "dangling": "nowhere"}  # fmt: skip
    for name, target in links.items():
        os.symlink(root / target, root / name)
    (root / "empty_dir").mkdir()
    (root / "ro").mkdir()
    _read_only(root / "ro")
    yield root
    if ROOT_USER:
        subprocess.run(["chattr", "-i", str(root / "ro")], capture_output=True, timeout=30)
    os.chmod(root / "ro", 0o755)


FILE, DIR = "file", "directory"
# command -> (what it writes, its inputs: file, link to it, directory, link to it)
COMMANDS = {
    "data_prep": (DIR, "corpus/doc0.txt", "link_to_doc", "corpus", "link_to_corpus"),
    "export": (DIR, "sp.model", "link_to_sp", "ckpt", "link_to_ckpt"),
    "finetune": (DIR, "ft/train.csv", "link_to_train", "export", "link_to_exportdir"),
    "convert": (FILE, "src/config.json", "link_to_src", "src", "link_to_srcdir"),
    "onnx": (FILE, "export/model.safetensors", "link_to_export", "export", "link_to_exportdir"),
}
BOTH = (FILE, DIR)
# name -> (path under the tree ({n}: a generated name), the kinds of command it is bad for,
#          the commands (or kinds) for which --overwrite makes it a legitimate output)
BAD = {
    "an input's own file": ("{input_file}", BOTH, ()),
    "a link to an input file": ("{input_link}", BOTH, ()),
    "the input directory": ("{input_dir}", BOTH, ()),
    "a link to the input directory": ("{input_dir_link}", BOTH, ()),
    "a new name inside the input directory": ("{input_dir}/{n}", BOTH, ()),
    "a new name under a link to the input directory": ("{input_dir_link}/{n}", BOTH, ()),
    "a directory holding the inputs": (".", BOTH, ()),
    "an existing file": ("notes.txt", BOTH, (FILE,)),
    "a link to an existing file": ("link_to_notes", BOTH, (FILE,)),
    "a dangling link": ("dangling", BOTH, (FILE,)),
    "a user's directory": ("adir", BOTH, ()),
    "an empty directory": ("empty_dir", (FILE,), ()),  # a new directory's legitimate place
    "a directory name": ("{n}/", (FILE,), ()),
    "a path under a regular file": ("notes.txt/{n}", BOTH, ()),
    "a path two levels under a regular file": ("notes.txt/{n}/{n}", BOTH, ()),
    "a checkpoint's latest": ("ckpt/latest", BOTH, ()),
    "a checkpoint directory": ("ckpt", BOTH, ()),
    "a new name inside a checkpoint directory": ("ckpt/{n}", BOTH, ()),
    "a new name inside a checkpoint tag": ("ckpt/step_00000002/{n}", BOTH, ()),
    "a training run": ("run", BOTH, ()),
    "a new name inside a training run": ("run/{n}", BOTH, ()),
    "an earlier export": ("prev_export", BOTH, ("export",)),
    "a new name inside an export": ("prev_export/{n}", BOTH, ()),
    "an earlier data_prep output": ("prev_data", BOTH, ("data_prep",)),
    "a new name inside a data_prep output": ("prev_data/{n}", BOTH, ()),
    "an earlier fine-tuned model": ("prev_ft", BOTH, ("finetune",)),
    "a new name inside a fine-tuned model": ("prev_ft/{n}", BOTH, ()),
    "an empty path": ("", BOTH, ()),
    "a path with a NUL byte": ("{n}\0{n}", BOTH, ()),
    "a read-only directory": ("ro/{n}", BOTH, ()),
    "two levels under a read-only directory": ("ro/{n}/{n}", BOTH, ()),
}
NAMES = st.text(alphabet=st.sampled_from("abcxyz_-.é0 "), min_size=1, max_size=10).filter(
    lambda n: n.strip(". ") == n
)
EXAMPLES = 25  # per command; each example runs the whole table


def snapshot(root):
    """Every path under ``root`` (links not followed) -> its bytes, link target or kind."""
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(d, n)
            if os.path.islink(p):
                out[p] = ("link", os.readlink(p))
            elif os.path.isdir(p):
                out[p] = "dir"
            else:
                with open(p, "rb") as f:
                    out[p] = f.read()
    return out


def argv_of(command, root, out, overwrite):
    """The command line of ``command`` on the tree's inputs, writing ``out``."""
    argv = {
        "data_prep": ["--source", f"{root}/corpus", "--tokenizer", f"{root}/sp.model",
                      "--seq-len", "16", "--quiet", "--workers", "0", "--out", out],
        "export": ["--checkpoint", f"{root}/ckpt", "--tokenizer", f"{root}/sp.model",
                   "--out", out],
        "finetune": ["--model", f"{root}/export", "--train", f"{root}/ft/train.csv",
                     "--out", out],
        "convert": ["--from", f"hf:{root / 'src'}", "--config", str(root / "base.yaml"),
                    "--out", out, "model.max_seq_len=32", "model.k=8"],
        "onnx": [str(root / "export"), out, "--no-check"],
    }[command]  # fmt: skip
    return argv + (["--overwrite"] if overwrite else [])


MAINS = {"data_prep": data_prep_main, "export": export_main, "finetune": finetune_main,
         "convert": warm_start.main, "onnx": onnx_export.main}  # fmt: skip


def run_command(command, root, out, overwrite, capsys):
    """The command's main() on ``out``; returns (exit status, stdout, stderr)."""
    capsys.readouterr()
    try:
        rc = MAINS[command](argv_of(command, root, out, overwrite))
    except SystemExit as e:  # argparse
        rc = e.code
    got = capsys.readouterr()
    return rc, got.out, got.err


def bad_out(tree, case, command, name):
    """The path of the table's ``case`` for ``command``."""
    _kind, input_file, input_link, input_dir, input_dir_link = COMMANDS[command]
    rel = BAD[case][0].format(n=name, input_dir=input_dir, input_file=input_file,
                              input_link=input_link, input_dir_link=input_dir_link)  # fmt: skip
    if not rel:
        return ""
    return str(tree / rel) + ("/" if rel.endswith("/") else "")


@pytest.mark.parametrize("command", sorted(COMMANDS))
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(name=NAMES, overwrite=st.lists(st.booleans(), min_size=len(BAD), max_size=len(BAD)))
def test_every_command_refuses_every_bad_output(tree, capsys, command, name, overwrite):
    """Each example runs the whole table (with one generated name, --overwrite drawn per
    case) against ``command``: one line naming the output flag, a non-zero exit, the tree as
    it was."""
    kind = COMMANDS[command][0]
    flag = "OUT" if command == "onnx" else "--out"
    read_only = not os.access(tree / "ro", os.W_OK)
    ran = 0
    for (case, (_, kinds, legit)), over in zip(sorted(BAD.items()), overwrite):
        if kind not in kinds or (case.startswith(("a read-only", "two levels under a read-only"))
                                 and not read_only):  # fmt: skip
            continue
        over = over and kind not in legit and command not in legit
        out = bad_out(tree, case, command, name)
        before = snapshot(tree)
        rc, stdout, err = run_command(command, tree, out, over, capsys)
        where = (case, command, out, over, err)
        assert rc not in (0, None), where
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, where
        assert (flag in err or out in err) and stdout == "", where  # the output named
        assert snapshot(tree) == before, where
        ran += 1
    mine = [c for c, (_, kinds, _) in BAD.items() if kind in kinds]
    assert ran == len(mine) - (0 if read_only else 2)  # read-only: where this user cannot


def test_a_good_output_is_written_and_replaced_only_with_overwrite(tree, tmp_path, capsys):
    out = str(tmp_path / "new" / "warm.yaml")  # a missing parent is made
    rc, stdout, err = run_command("convert", tree, out, False, capsys)
    assert rc == 0 and stdout.startswith(f"wrote {out}"), err
    first = open(out, "rb").read()
    assert b"init_from: hf:" in first
    rc, _, err = run_command("convert", tree, out, False, capsys)
    assert rc == 2 and "exists; nothing is replaced" in err and "--overwrite" in err
    rc, _, err = run_command("convert", tree, out, True, capsys)
    assert rc == 0 and open(out, "rb").read() == first
    assert sorted(os.listdir(tmp_path / "new")) == ["warm.yaml"]  # no temporary name left


class _Interrupting:
    """A fake ONNX program: ``save`` writes half a file, then Ctrl-C arrives."""

    def save(self, path):
        with open(path, "wb") as f:
            f.write(b"partial onnx bytes")
        raise KeyboardInterrupt


def _fake_load(model_dir, architecture=None):
    model = torch.nn.Identity()
    model.config = types.SimpleNamespace(max_seq_len=8, vocab_size=10)
    wrapper = torch.nn.Module()
    wrapper.model = model
    return wrapper, ["logits", "last_hidden_state"]


@pytest.mark.parametrize("existing", [False, True])
def test_ctrl_c_during_the_onnx_export_exits_130_and_leaves_no_partial_output(
    tree, tmp_path, capsys, monkeypatch, existing
):
    """Ctrl-C while the .onnx is being written (the exporter itself stubbed: the interrupt is
    what is tested): exit 130, one line, the output absent or byte for byte the old one, no
    temporary file; the same for launch/convert.py."""
    monkeypatch.setattr(onnx_export, "load", _fake_load)
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: None)
    monkeypatch.setattr(torch.onnx, "export", lambda *a, **k: _Interrupting())
    out = tmp_path / "model.onnx"
    if existing:
        out.write_bytes(b"the previous export")
    before = snapshot(tmp_path)
    rc, stdout, err = run_command("onnx", tree, str(out), existing, capsys)
    assert rc == EXIT_INTERRUPTED and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"onnx export: interrupted (Ctrl-C); {out} is as it was")
    assert snapshot(tmp_path) == before

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(warm_start, "check_weights", interrupt)
    rc, stdout, err = run_command("convert", tree, str(tmp_path / "w.yaml"), False, capsys)
    assert rc == EXIT_INTERRUPTED and len(err.strip().splitlines()) == 1, err
    assert snapshot(tmp_path) == before


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory):
    """A real export of a tiny untrained model (launch/export.py's main on a checkpoint written
    here, with a SentencePiece model trained by data_prep's trainer)."""
    import contextlib
    import io

    from data_prep.tokenizer import train_tokenizer
    from linformer_ds.checkpoint.tags import COMPLETE_FILE, META_FILE, MODEL_STATES
    from linformer_ds.config import load_config
    from linformer_ds.model import LinformerForMaskedLM
    from tests.pretrain_utils import TEST_OVERRIDES, TINY_CONFIG

    root = tmp_path_factory.mktemp("sigint_in")
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    lines = [" ".join(words[(i + k) % len(words)] for k in range(7)) for i in range(60)]
    tag = root / "ckpt" / "step_00000002"
    tag.mkdir(parents=True)
    train_tokenizer(lines, str(tag / "tokenizer.model"), 30, num_threads=1)
    cfg = load_config(TINY_CONFIG, TEST_OVERRIDES + [
        "model.hidden_size=16", "model.num_heads=2", "model.num_layers=1",
        "model.intermediate_size=32", "model.k=8", "model.max_seq_len=32"])  # fmt: skip
    torch.manual_seed(0)
    torch.save({"module": LinformerForMaskedLM(cfg.model).state_dict()}, tag / "x")
    os.replace(tag / "x", tag / MODEL_STATES)
    meta = {"format_version": 1, "step": 2, "epoch": 0, "sampler": {"epoch": 0, "consumed": 8},
            "world_size": 1, "zero_stage": 0, "precision": "fp32", "model": cfg.model.to_dict(),
            "tokenizer": "tokenizer.model"}  # fmt: skip
    (tag / META_FILE).write_text(json.dumps(meta))
    sizes = {p.name: p.stat().st_size for p in tag.iterdir()}
    (tag / COMPLETE_FILE).write_text(json.dumps({"files": sizes}))
    (tag.parent / "latest").write_text(tag.name)
    with contextlib.redirect_stdout(io.StringIO()):
        assert export_main(["--checkpoint", str(tag.parent), "--out", str(root / "exp")]) == 0
    rows = [(" ".join(words[i % 12 : i % 12 + 4]), "ab"[i % 2]) for i in range(8)]
    (root / "train.csv").write_text("text,label\n" + "".join(f"{t},{y}\n" for t, y in rows))
    return root / "exp"


def _interrupt_when_training(proc, deadline):
    """Send SIGINT once ``proc`` (launch/finetune.py) prints its ``[finetune] train=`` line and
    a second has passed (inside the training loop); returns (exit status, stderr)."""
    import queue

    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    try:
        while True:
            left = deadline - time.monotonic()
            assert left > 0 and proc.poll() is None, f"no training line; {proc.stderr.read()}"
            try:
                if lines.get(timeout=min(left, 1.0)).startswith("[finetune] train="):
                    break
            except queue.Empty:
                continue
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        return proc.wait(timeout=60), proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_sigint_during_finetune_exits_130_in_one_line_and_writes_nothing(tiny_export, tmp_path):
    """A real SIGINT to launch/finetune.py while it trains, replacing an earlier fine-tuned
    model with --overwrite: exit 130, one stderr line, and the tree as it was (the earlier
    model byte for byte, no staging directory, no lock file, nothing new). Every wait has a
    deadline. (One process: a second, writing a new --out, cost 14 s more on 2 cores.)"""
    model = tiny_export
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("precious\n")
    earlier = work / "earlier"  # its record files: replaced only once the new one is written
    earlier.mkdir()
    (earlier / "finetune_results.json").write_text('{"val_accuracy": 0.5}')
    (earlier / "linformer_export.json").write_text("{}")
    (earlier / "model.safetensors").write_bytes(b"the earlier weights" * 50)
    before = snapshot(tmp_path)
    env = child_env()
    procs = {}
    for out, extra in ((earlier, ["--overwrite"]),):
        cmd = [sys.executable, str(REPO / "launch" / "finetune.py"), "--model", str(model),
               "--train", str(model.parent / "train.csv"), "--out", str(out), "--epochs",
               "100000", "--batch-size", "2", "--validation-fraction", "0.25", *extra]  # fmt: skip
        procs[out] = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 180  # start-up (torch, transformers) on a loaded machine
    try:
        for out, proc in procs.items():
            rc, err = _interrupt_when_training(proc, deadline)
            assert rc == EXIT_INTERRUPTED, err
            assert err.strip() == f"finetune interrupted: nothing written to --out {out}", err
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    assert snapshot(tmp_path) == before


@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(data=st.binary(max_size=2000), fail=st.booleans(), extra=st.booleans())
def test_staged_writes_swap_in_whole_or_not_at_all(tmp_path_factory, data, fail, extra):
    """The helper itself: a block that raises leaves the old file byte for byte and nothing
    else; one that ends swaps the new bytes (and a companion ``<name>.data``) in."""
    root = tmp_path_factory.mktemp("staged")
    out = root / "model.onnx"
    out.write_bytes(b"old")
    assert check_out_file(str(out), overwrite=True) == "replace"
    with pytest.raises(OutPathError, match="exists; nothing is replaced"):
        check_out_file(str(out))
    try:
        with staged(str(out)) as tmp:
            with open(tmp, "wb") as f:
                f.write(data)
            if extra:
                with open(tmp + ".data", "wb") as f:
                    f.write(b"external")
            if fail:
                raise RuntimeError("the command failed")
    except RuntimeError:
        pass
    names = sorted(os.listdir(root))
    if fail:
        assert out.read_bytes() == b"old" and names == ["model.onnx"]
    else:
        assert out.read_bytes() == data
        assert names == (["model.onnx", "model.onnx.data"] if extra else ["model.onnx"])


SLOW_DATA_PREP = """
import sys, time
import data_prep.packing as pk
import data_prep.pipeline as pipeline
from data_prep.__main__ import main
encode, tasks = pk.encode_task, pipeline._tasks

def slow(texts):  # a slow machine: the test's SIGINT lands between tasks, midway
    time.sleep(0.3)
    return encode(texts)

pk.encode_task = slow
pipeline._tasks = lambda docs, source, task_bytes: tasks(docs, source, 1500)  # many tasks
sys.exit(main(sys.argv[1:]))
"""


def _files(d):
    return {os.path.relpath(os.path.join(r, n), d): open(os.path.join(r, n), "rb").read()
            for r, _, names in os.walk(d) for n in names}  # fmt: skip


@pytest.mark.parametrize("existing", [False, True], ids=["new-out", "overwrite"])
def test_sigint_during_data_prep_exits_130_leaves_out_as_it_was_and_resumes(tmp_path, existing):
    """A real SIGINT to ``python -m data_prep`` while it encodes (one process, the encoding
    slowed so that the signal lands midway): exit 130, one stderr line, ``--out`` absent (or,
    with --overwrite, the earlier output byte for byte), the work kept beside it in
    ``.<out>.data_prep-partial``; ``--resume`` then writes an uninterrupted run's bytes and
    leaves no partial directory."""
    from tests.test_data_prep import make_docs, write_text_corpus

    corpus = write_text_corpus(tmp_path / "corpus", make_docs(120, seed=5))
    env = child_env(PYTHONPATH=str(REPO))
    base = ["--source", str(corpus), "--seq-len", "32", "--valid-fraction", "0.2",
            "--shard-rows", "5", "--workers", "0", "--quiet"]  # fmt: skip

    def data_prep(out, *extra, slow=False):
        head = ["-c", SLOW_DATA_PREP] if slow else ["-m", "data_prep"]
        cmd = [sys.executable, *head, *base, "--out", str(out), *extra]
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)  # fmt: skip

    def done(proc):
        _, err = proc.communicate(timeout=300)
        return proc.returncode, err

    assert done(data_prep(tmp_path / "tok", "--vocab-size", "120")) == (0, "")
    tok = ["--tokenizer", str(tmp_path / "tok" / "tokenizer.model")]
    assert done(data_prep(tmp_path / "ref", *tok)) == (0, "")
    out, work = tmp_path / "out", tmp_path / ".out.data_prep-partial"
    extra = list(tok)
    if existing:  # an earlier output, replaced only once the new one is whole
        assert done(data_prep(out, *tok, "--valid-fraction", "0.5")) == (0, "")
        extra.append("--overwrite")
    before = _files(out) if existing else None
    proc = data_prep(out, *extra, slow=True)
    try:
        deadline = time.monotonic() + 300
        while True:  # the first shards are written and checkpointed: midway
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            try:
                progress = json.loads((work / "progress.json").read_text())
            except (OSError, ValueError):
                progress = {}
            if progress.get("counters", {}).get("documents_read", 0) > 0:
                break
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        rc, err = done(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert rc == 130, err
    assert err.strip() == "data_prep: interrupted; rerun with --resume to continue", err
    assert (_files(out) == before) if existing else not out.exists()
    progress = json.loads((work / "progress.json").read_text())
    assert 0 < progress["counters"]["documents_read"] < 120  # stopped midway, work kept
    assert done(data_prep(out, *tok, "--resume")) == (0, "")
    assert _files(out) == _files(tmp_path / "ref")
    assert not work.exists() and not (tmp_path / ".out.lock").exists()
    assert sorted(os.listdir(tmp_path)) == sorted(["corpus", "tok", "ref", "out"])


# ==================================================== what --out resolves to (docs/reliability.md)
# The rule for a directory output (data_prep, export, finetune): --out itself is never a
# symbolic link, whatever it leads to, nor a path that resolves elsewhere than its name says;
# links in its parents are followed. A refused output changes nothing.
LAYOUTS = {  # name -> (what to make in D, the --out path in D, refused for every command)
    "a new name": ({}, "n", False),
    "an empty directory": ({"e/": None}, "e", False),
    "a user's directory": ({"f/notes.txt": "mine"}, "f", True),
    "an earlier output of the command": ({"own/": "own"}, "own", None),  # --overwrite decides
    "a link to an empty directory": ({"e/": None, "l": "e"}, "l", True),
    "a link to a user's directory": ({"f/notes.txt": "mine", "l": "f"}, "l", True),
    "a link to an earlier output": ({"own/": "own", "l": "own"}, "l", True),
    "a dangling link": ({"l": "nowhere"}, "l", True),
    "a link to a link to an empty directory": ({"e/": None, "l1": "e", "l": "l1"}, "l", True),
    "a trailing slash on a link": ({"e/": None, "l": "e"}, "l/", True),
    "a link then ..": ({"a/b/": None, "l": "a/b"}, "l/../x", True),
    "a new name under a linked parent": ({"real/": None, "p": "real"}, "p/n", False),
    "an empty directory under a linked parent": ({"real/e/": None, "p": "real"}, "p/e", False),
}
DIR_COMMANDS = ("data_prep", "export", "finetune")


def _make_layout(d, items, command, tiny_export):
    for rel, what in items.items():
        path = d / rel.rstrip("/")
        if rel.endswith("/"):
            if what == "own":  # the command's own earlier output
                if command == "export":
                    shutil.copytree(tiny_export, path)
                else:
                    path.mkdir(parents=True)
                    for name in {"data_prep": ("manifest.json", "tokenizer.model"),
                                 "finetune": ("finetune_results.json",)}[command]:  # fmt: skip
                        (path / name).write_text("{}")
            else:
                path.mkdir(parents=True, exist_ok=True)
        elif rel in ("l", "l1", "p"):
            os.symlink(what, path)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(what)


@settings(max_examples=45, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(layout=st.sampled_from(sorted(LAYOUTS)), command=st.sampled_from(DIR_COMMANDS),
       overwrite=st.booleans())  # fmt: skip
def test_what_a_directory_output_resolves_to(tree, tiny_export, tmp_path_factory, capsys,
                                             layout, command, overwrite):  # fmt: skip
    """A drawn OUT layout for a drawn directory command: every link at OUT (to an empty or a
    user's directory, to an earlier output, to nothing, to a link; with a trailing slash; a
    link followed by ..) is refused by the real command in one line naming --out and the link,
    with every pre-existing file, link and directory as it was and nothing added (no lock
    file, no staging directory); the check accepts what the rule accepts (a new name, an empty
    directory, either under a linked parent, an earlier output with --overwrite), and a real
    export writes there, into the linked parent's target."""
    from linformer_ds import outdir

    d = Path(os.path.realpath(tmp_path_factory.mktemp("layout")))
    items, rel, refused = LAYOUTS[layout]
    _make_layout(d, items, command, tiny_export)
    out = str(d / rel) + ("/" if rel.endswith("/") else "")
    if refused is None:  # an earlier output: replaced only with --overwrite
        refused = False
    before, before_tree = snapshot(d), snapshot(tree)
    if refused:
        rc, stdout, err = run_command(command, tree, out, overwrite, capsys)
        where = (layout, command, overwrite, err)
        assert rc == 2 and stdout == "" and len(err.strip().splitlines()) == 1, where
        assert out.rstrip("/") in err and "Traceback" not in err, where  # the output named
        if "link" in layout and ".." not in rel:
            assert "is a symbolic link to" in err and "pass --out" in err, where
        assert snapshot(d) == before and snapshot(tree) == before_tree, where
        return
    state = outdir.check_out(out, command, overwrite=overwrite)
    want = {"a new name": "new", "a new name under a linked parent": "new",
            "an empty directory": "empty", "an empty directory under a linked parent": "empty",
            "an earlier output of the command": "replace" if overwrite else "exists"}[layout]  # fmt: skip
    assert state == want, (layout, command, overwrite)
    if command != "export":
        return
    capsys.readouterr()
    rc = export_main(["--checkpoint", str(tiny_export.parent / "ckpt"), "--out", out]
                     + (["--overwrite"] if overwrite else []))  # fmt: skip
    err = capsys.readouterr().err
    if want == "exists":
        assert rc == 2 and "holds an earlier export; pass --overwrite" in err
        assert snapshot(d) == before
        return
    assert rc == 0, err
    real = os.path.realpath(out)
    assert (os.path.dirname(real) == str(d / "real")) == ("linked parent" in layout)
    assert sorted(os.listdir(real)) == sorted(os.listdir(tiny_export))
    after = snapshot(d)
    for path, what in before.items():  # everything that was there, outside --out, unchanged
        if not path.startswith(real + os.sep) and path != real:
            assert after[path] == what, path
    added = {p for p in after if p not in before and not p.startswith(real + os.sep)}
    assert added == ({real} if want == "new" else set()), added  # no lock, no staging left


class _AppearingKind(SourceKind):
    """``appear:DIR``: the text files of DIR, one document each; once read, ``make()`` puts
    something at --out (another process's doing while data_prep works)."""

    name = "appear"

    def __init__(self) -> None:
        self.make = None

    def matches(self, spec):
        return spec.startswith("appear:")

    def resolve(self, spec, source):
        return sorted(os.listdir(spec[7:]))

    def read(self, spec, source, part):
        for name in source.state(spec):
            with open(os.path.join(spec[7:], name)) as f:
                yield f.read()
        if self.make is not None:
            self.make()
            self.make = None

    def roots(self, spec):
        return [spec[7:]]


@pytest.fixture(scope="module")
def appear_kind():
    kind = register_source_kind(_AppearingKind())
    yield kind
    unregister_source_kind(kind.name)


APPEARS = {  # what appears at --out during the run, and how a user clears it
    "a link to an empty directory": lambda out, d: (d / "t").mkdir() or os.symlink(d / "t", out),
    "a dangling link": lambda out, d: os.symlink(d / "nowhere", out),
    "a user's directory": lambda out, d: out.mkdir() or (out / "notes.txt").write_text("mine"),
    "a file": lambda out, d: out.write_text("mine"),
}


@pytest.mark.parametrize("appears", sorted(APPEARS))
def test_a_failed_publish_keeps_the_work_for_resume(appear_kind, tiny_export, tmp_path,
                                                    appears):  # fmt: skip
    """data_prep whose --out is taken while it works (a link, a user's directory, a file):
    one line saying the finished output is kept, --out as the other party left it, the
    partial directory whole; --resume with other options is refused, and once --out is
    cleared --resume publishes it without reading the sources, byte for byte an undisturbed
    run's output, leaving no partial directory."""
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(40):
        (docs / f"d{i:02d}.txt").write_text(" ".join(words[(i + k) % 12] for k in range(9 + i % 7)))
    tok = tiny_export.parent / "ckpt" / "step_00000002" / "tokenizer.model"

    def prep(out, **kw):
        kw = {"seq_len": 16, "tokenizer": str(tok), "workers": 0, "progress": False,
              "valid_fraction": 0.2, "shard_rows": 5, **kw}  # fmt: skip
        return prepare(PrepConfig(sources=[f"appear:{docs}"], out=str(out), **kw))

    prep(tmp_path / "ref")
    out, work = tmp_path / "out", tmp_path / ".out.data_prep-partial"
    appear_kind.make = lambda: APPEARS[appears](out, tmp_path)
    with pytest.raises(DataPrepError) as e:
        prep(out)
    message = str(e.value)
    assert "\n" not in message and f"--out {out}" in message, message
    assert message.endswith(f"the finished output is kept whole in {work}: fix --out and rerun "
                            "the same command with --resume to publish it"), message  # fmt: skip
    left = snapshot(tmp_path)
    assert os.path.lexists(out) and json.loads((work / "progress.json").read_text())["finished"]
    assert set(os.listdir(work)) == set(os.listdir(tmp_path / "ref")) | {"progress.json"}
    with pytest.raises(DataPrepError):  # --out still taken: refused up front, nothing changed
        prep(out, resume=True)
    assert snapshot(tmp_path) == left
    if os.path.isdir(out) and not os.path.islink(out):
        shutil.rmtree(out)
    else:
        os.remove(out)
    left = snapshot(tmp_path)
    with pytest.raises(DataPrepError, match="used different options"):
        prep(out, resume=True, shard_rows=6)
    assert snapshot(tmp_path) == left

    def read_again():
        raise AssertionError("a publish-only resume read the sources again")

    appear_kind.make = read_again
    result = prep(out, resume=True)
    appear_kind.make = None
    assert result.manifest == json.loads((tmp_path / "ref" / "manifest.json").read_text())
    assert _files(out) == _files(tmp_path / "ref")
    assert not work.exists()
