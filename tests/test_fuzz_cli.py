"""The error contract over generated inputs (hypothesis).

Every run of ``python -m data_prep``, ``launch/export.py``, ``launch/finetune.py`` and
``launch/pretrain.py --print-config`` on generated flags, overrides and damaged inputs (data
directories, manifests, tokenizers, checkpoints, ``latest`` pointers, output directories) must

- exit 0 or 2 (argparse's usage errors are 2 too), never a traceback;
- on exit 2 write exactly one line to stderr;
- end within a deadline;
- leave every file that existed before byte-identical (the tree is hashed before and after;
  only an ``--overwrite`` of the command's own earlier output that succeeds may replace it).

The CLIs' ``main(argv)`` run in-process (faithful: each is the console entry point), plus a few
real subprocess runs of the launch scripts. The example count per test is small in the suite
(the whole file stays within ~90 s on 2 cores); ``LINFORMER_FUZZ_EXAMPLES=2000`` runs a long
campaign (see docs/reliability.md). Every case listed in issue 21 for these commands is an
explicit seed (``SEEDS``) run through the same checks.
"""

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from linformer_ds.dist_env import clear_launcher_vars, without_launcher_vars
from tests.pretrain_utils import REPO, TEST_OVERRIDES, TINY_CONFIG, child_env

EXAMPLES = int(os.environ.get("LINFORMER_FUZZ_EXAMPLES", "0"))
# CPU seconds of one in-process run (a tokenizer training or an export included): this
# process's CPU time, threads included, which a loaded machine does not stretch as it does the
# wall clock; a run that spins fails it, a run that blocks is pytest-timeout's.
DEADLINE_S = 120.0
FUZZ = settings(
    max_examples=EXAMPLES or 12,
    deadline=None,
    derandomize=not EXAMPLES,  # the suite runs the same examples every time
    suppress_health_check=list(HealthCheck),
    database=None,
)


# ====================================================================================== checks
def tree_hashes(root: Path) -> dict[str, str]:
    """sha256 of every file below ``root`` (relative path -> digest); links by their target."""
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                out[rel] = "link:" + os.readlink(path)
                continue
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            out[rel] = h.hexdigest()
    return out


def run_contract(
    main: Callable[[list[str]], int],
    argv: list[str],
    root: Path,
    replaceable: Path | None = None,
) -> tuple[int, str]:
    """Run ``main(argv)`` in-process under the contract; returns ``(exit code, stderr)``.

    ``replaceable``: a directory (the command's own earlier output) that a successful
    ``--overwrite`` may replace; every other file below ``root`` must stay byte-identical."""
    before = tree_hashes(root)
    err, out = io.StringIO(), io.StringIO()
    saved_env = dict(os.environ)
    t0 = time.process_time()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse
            rc = e.code if isinstance(e.code, int) else 2
    elapsed = time.process_time() - t0
    os.environ.clear()
    os.environ.update(saved_env)
    text = err.getvalue()
    where = f"argv={argv!r}\nstderr:\n{text}"
    assert elapsed < DEADLINE_S, f"took {elapsed:.0f} CPU s; {where}"
    assert rc in (0, 2), f"exit {rc}; {where}"
    assert "Traceback" not in text, where
    if rc == 2:
        lines = [line for line in text.splitlines() if line.strip()]
        assert lines, f"exit 2 without a message; {where}"
        if "usage:" not in text:  # argparse prints usage + one error line
            assert len(lines) == 1, f"exit 2 with {len(lines)} lines; {where}"
    after = tree_hashes(root)
    skip = ""
    if rc == 0 and replaceable is not None:
        skip = os.path.relpath(replaceable, root) + os.sep
    changed = [p for p, h in before.items() if not p.startswith(skip) and after.get(p) != h]
    assert not changed, f"files changed or deleted: {changed[:5]}; {where}"
    return rc, text


# ===================================================================================== fixtures
@pytest.fixture(scope="module")
def base(tiny_corpus, tmp_path_factory) -> dict[str, Path]:
    """The pristine inputs every example copies: a text corpus, a tokenizer, a run directory
    with a stage-0 checkpoint of a tiny model, an export of it, and fine-tuning files."""
    import torch

    from linformer_ds.checkpoint.tags import COMPLETE_FILE, META_FILE, MODEL_STATES
    from linformer_ds.config import load_config
    from linformer_ds.export import main as export_main
    from linformer_ds.model import LinformerForMaskedLM

    root = tmp_path_factory.mktemp("fuzz_base")
    src = root / "corpus"
    src.mkdir()
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    for i in range(6):
        (src / f"doc{i}.txt").write_text(
            "\n".join(
                " ".join(words[(i + j + k) % len(words)] for k in range(9)) for j in range(30)
            )
        )
    (src / "rows.jsonl").write_text(
        "".join(json.dumps({"text": " ".join(words[i:] + words[:i])}) + "\n" for i in range(12))
    )
    tok = root / "tokenizer.model"
    shutil.copyfile(tiny_corpus / "tokenizer.model", tok)

    cfg = load_config(
        TINY_CONFIG,
        TEST_OVERRIDES + ["model.hidden_size=16", "model.num_heads=2", "model.num_layers=1",
                          "model.intermediate_size=32", "model.k=8"],
    )  # fmt: skip
    run = root / "run"
    tag_dir = run / "checkpoints" / "step_00000002"
    tag_dir.mkdir(parents=True)
    torch.manual_seed(0)
    model = LinformerForMaskedLM(cfg.model)
    torch.save({"module": model.state_dict()}, tag_dir / MODEL_STATES)
    shutil.copyfile(tok, tag_dir / "tokenizer.model")
    meta = {"format_version": 1, "step": 2, "epoch": 0, "sampler": {"epoch": 0, "consumed": 8},
            "world_size": 1, "zero_stage": 0, "precision": "fp32", "model": cfg.model.to_dict(),
            "tokenizer": "tokenizer.model"}  # fmt: skip
    (tag_dir / META_FILE).write_text(json.dumps(meta))
    inventory = {p.name: p.stat().st_size for p in tag_dir.iterdir()}
    (tag_dir / COMPLETE_FILE).write_text(json.dumps({"files": inventory}))
    (run / "checkpoints" / "latest").write_text("step_00000002")
    (run / "metrics.jsonl").write_text('{"step": 1, "split": "train", "loss": 9.0}\n')
    (run / "config.json").write_text("{}\n")

    exported = root / "exported"
    with contextlib.redirect_stdout(io.StringIO()):
        assert export_main(["--checkpoint", str(run / "checkpoints"), "--out", str(exported)]) == 0

    ft = root / "ft"
    ft.mkdir()
    rows = [(f"{w} {v} {w}", "a" if i % 2 else "b") for i, (w, v) in
            enumerate(zip(words * 3, reversed(words * 3)))]  # fmt: skip
    (ft / "train.csv").write_text("text,label\n" + "".join(f"{t},{y}\n" for t, y in rows))
    (ft / "train.jsonl").write_text("".join(json.dumps({"text": t, "label": y}) + "\n"
                                            for t, y in rows))  # fmt: skip
    (ft / "empty.jsonl").write_text("")
    (ft / "header.csv").write_text("text,label\n")
    (ft / "malformed.csv").write_text('text,label\n"unclosed,a\nx,y,z,w\n\x00\x01,b\n')
    (ft / "lists.jsonl").write_text("".join(json.dumps({"text": t, "label": [y, y]}) + "\n"
                                            for t, y in rows))  # fmt: skip
    (ft / "utf16.jsonl").write_bytes((ft / "train.jsonl").read_text().encode("utf-16"))
    (ft / "train.txt").write_text("".join(f"{y}\t{t}\n" for t, y in rows))
    (ft / "bad.txt").write_bytes(b"\xff\xfe no tab here\n")
    return {"corpus": src, "tokenizer": tok, "run": run, "exported": exported, "ft": ft,
            "data": tiny_corpus}  # fmt: skip


@contextlib.contextmanager
def workspace(base: dict[str, Path]):
    """A fresh copy of the inputs plus a user's directory with files of their own."""
    d = Path(tempfile.mkdtemp(prefix="fuzz-"))
    try:
        for name in ("corpus", "run", "exported", "ft"):
            shutil.copytree(base[name], d / name)
        shutil.copyfile(base["tokenizer"], d / "tokenizer.model")
        (d / "user").mkdir()
        (d / "user" / "thesis.tex").write_text("my thesis\n")
        (d / "empty").mkdir()
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ============================================================================ damage and outs
CKPT_DAMAGE = {
    "none": lambda c: None,
    "latest-ff-fe": lambda c: (c / "latest").write_bytes(b"\xff\xfe"),
    "latest-path": lambda c: (c / "latest").write_text("../../other/step_00000004"),
    "latest-dotdot": lambda c: (c / "latest").write_text(".."),
    "latest-empty": lambda c: (c / "latest").write_text(""),
    "latest-dir": lambda c: ((c / "latest").unlink(), (c / "latest").mkdir()),
    "no-latest": lambda c: (c / "latest").unlink(),
    "truncated-states": lambda c: _truncate(c / "step_00000002" / "mp_rank_00_model_states.pt"),
    "garbage-states": lambda c: _garbage_same_size(
        c / "step_00000002" / "mp_rank_00_model_states.pt"
    ),
    "no-meta": lambda c: (c / "step_00000002" / "linformer_meta.json").unlink(),
    "meta-utf16": lambda c: _reencode(c / "step_00000002" / "linformer_meta.json", "utf-16"),
    "meta-types": lambda c: _edit_json(
        c / "step_00000002" / "linformer_meta.json",
        lambda m: m.update(world_size="two", zero_stage=[0], model=[1]),
    ),
    "meta-model-garbage": lambda c: _edit_json(
        c / "step_00000002" / "linformer_meta.json",
        lambda m: m["model"].update(hidden_size=-3, k="x"),
    ),
    "complete-garbage": lambda c: (c / "step_00000002" / "COMPLETE").write_bytes(b"\x00\xff{"),
    "complete-list": lambda c: (c / "step_00000002" / "COMPLETE").write_text('{"files": [1]}'),
    "no-tokenizer": lambda c: (c / "step_00000002" / "tokenizer.model").unlink(),
    "tokenizer-garbage": lambda c: _garbage_same_size(c / "step_00000002" / "tokenizer.model"),
    "no-tags": lambda c: shutil.rmtree(c / "step_00000002"),
}


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: max(1, p.stat().st_size // 3)])


def _garbage_same_size(p: Path) -> None:
    size = p.stat().st_size
    p.write_bytes((b"\x80\x02garbage" * (size // 9 + 1))[:size])


def _reencode(p: Path, encoding: str) -> None:
    p.write_bytes(p.read_text().encode(encoding))


def _edit_json(p: Path, edit: Callable[[dict], None]) -> None:
    m = json.loads(p.read_text())
    edit(m)
    p.write_text(json.dumps(m))


def out_path(ws: Path, kind: str, command: str) -> Path:
    """Where ``--out`` points: new, empty, a user's directory, inside/equal to the inputs, a
    run or checkpoint directory, a file, the command's own earlier output."""
    return {
        "new": ws / "out" / "new",
        "empty": ws / "empty",
        "user": ws / "user",
        "user-sub": ws / "user" / "sub",
        "file": ws / "user" / "thesis.tex",
        "run": ws / "run",
        "in-run": ws / "run" / "exported",
        "ckpt": ws / "run" / "checkpoints",
        "in-ckpt": ws / "run" / "checkpoints" / "x",
        "tag": ws / "run" / "checkpoints" / "step_00000002",
        "corpus": ws / "corpus",
        "in-corpus": ws / "corpus" / "out",
        "exported": ws / "exported",
        "in-exported": ws / "exported" / "x",
        "ft": ws / "ft",
    }[kind]


OUT_KINDS = ["new", "empty", "user", "user-sub", "file", "run", "in-run", "ckpt", "in-ckpt",
             "tag", "corpus", "in-corpus", "exported", "in-exported", "ft"]  # fmt: skip


# ====================================================================================== export
def export_case(ws: Path, damage: str, out: str, extra: list[str], tokenizer: str | None,
                tag: str | None) -> tuple[list[str], Path | None]:  # fmt: skip
    c = ws / "run" / "checkpoints"
    CKPT_DAMAGE[damage](c)
    o = out_path(ws, out, "export")
    argv = ["--checkpoint", str(c), "--out", str(o), *extra]
    if tokenizer == "good":
        argv += ["--tokenizer", str(ws / "tokenizer.model")]
    elif tokenizer == "garbage":
        argv += ["--tokenizer", str(ws / "corpus" / "doc0.txt")]
    elif tokenizer == "missing":
        argv += ["--tokenizer", str(ws / "nope.model")]
    if tag is not None:
        argv += ["--tag", tag]
    return argv, (o if out == "exported" else None)


@settings(FUZZ)
@given(
    damage=st.sampled_from(sorted(CKPT_DAMAGE)),
    out=st.sampled_from(OUT_KINDS),
    extra=st.lists(
        st.sampled_from(
            [
                ["--overwrite"],
                ["--dtype", "bfloat16"],
                ["--dtype", "int3"],
                ["--provenance", "full"],
            ]
        ),
        max_size=2,
    ).map(lambda xs: [a for x in xs for a in x]),  # fmt: skip
    tokenizer=st.sampled_from([None, None, "good", "garbage", "missing"]),
    tag=st.sampled_from([None, None, "step_00000002", "../..", "step_9", "", "latest"])
    | st.text(max_size=12),
)
def test_export_contract(base, damage, out, extra, tokenizer, tag):
    from linformer_ds.export import main

    with workspace(base) as ws:
        argv, own = export_case(ws, damage, out, extra, tokenizer, tag)
        run_contract(main, argv, ws, replaceable=own)


EXPORT_SEEDS = [
    # issue 21: export deleted every tag / metrics.jsonl / a user's files; latest ff fe; ../..
    ("none", "ckpt", ["--overwrite"], None, None),
    ("none", "run", ["--overwrite"], None, None),
    ("none", "user", ["--overwrite"], None, None),
    ("none", "in-ckpt", [], None, None),
    ("none", "tag", ["--overwrite"], None, None),
    ("latest-ff-fe", "new", [], None, None),
    ("latest-path", "new", [], None, None),
    ("latest-dir", "new", [], None, None),
    ("none", "new", [], None, "../.."),
    ("none", "exported", ["--overwrite"], None, None),
    ("none", "exported", [], None, None),
    ("none", "in-exported", [], None, None),
]


@pytest.mark.parametrize("damage,out,extra,tokenizer,tag", EXPORT_SEEDS)
def test_export_seeds(base, damage, out, extra, tokenizer, tag):
    from linformer_ds.export import main

    with workspace(base) as ws:
        argv, own = export_case(ws, damage, out, extra, tokenizer, tag)
        rc, err = run_contract(main, argv, ws, replaceable=own)
        if out in ("ckpt", "run", "user", "in-ckpt", "tag", "in-exported") or tag == "../..":
            assert rc == 2, err
        if damage == "latest-dir":
            assert rc == 2 and "latest is not a regular file" in err, err
        if out == "exported":  # its own earlier output: replaced only with --overwrite
            assert rc == (0 if "--overwrite" in extra else 2), err


# ==================================================================================== data_prep
def data_prep_case(ws: Path, source: str, out: str, flags: list[str]) -> list[str]:
    sources = {
        "dir": [str(ws / "corpus")],
        "jsonl": [str(ws / "corpus" / "rows.jsonl")],
        "glob": [str(ws / "corpus" / "*.txt")],
        "missing": [str(ws / "nope")],
        "utf16": [str(_utf16(ws))],
        "binary": [str(ws / "run" / "checkpoints" / "step_00000002" / "tokenizer.model")],
    }[source]
    return ["--source", *sources, "--out", str(out_path(ws, out, "data_prep")), "--quiet",
            "--workers", "0", *flags]  # fmt: skip


def _utf16(ws: Path) -> Path:
    p = ws / "utf16.txt"
    p.write_bytes((ws / "corpus" / "doc0.txt").read_text().encode("utf-16"))
    return p


INTS = st.one_of(st.integers(-3, 70000), st.sampled_from([0, 2**31, 2**63, -(2**63)]))
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 1.0]))


def _flag(name: str, values) -> st.SearchStrategy:
    return values.map(lambda v: [name, str(v)])


DATA_PREP_FLAGS = st.lists(
    st.one_of(
        _flag("--seq-len", st.one_of(st.integers(1, 300), st.sampled_from([2147483648, -1]))),
        _flag("--valid-fraction", FLOATS),
        _flag("--shard-rows", INTS),
        _flag("--max-docs", INTS),
        _flag("--max-bytes", INTS),
        _flag("--max-doc-bytes", INTS),
        _flag("--seed", INTS),
        _flag("--character-coverage", FLOATS),
        _flag("--encoding", st.sampled_from(["utf-8", "latin-1", "utf-16", "nope", "", "rot13"])),
        _flag("--packing", st.sampled_from(["full", "pad", "zip"])),
        _flag("--text-column", st.sampled_from(["text", "missing", ""])),
        _flag("--vocab-size", st.sampled_from([5, 6, 200, 70000, 2**40, -1])),
        st.just(["--overwrite"]),
        st.just(["--resume"]),
        st.sampled_from([["--seq-len", "abc"], ["--bogus"]]),
    ),
    max_size=4,
).map(lambda xs: [a for x in xs for a in x])


@settings(FUZZ)
@given(
    source=st.sampled_from(["dir", "jsonl", "glob", "missing", "utf16", "binary"]),
    out=st.sampled_from(OUT_KINDS),
    flags=DATA_PREP_FLAGS,
    tokenizer=st.sampled_from(["reuse", "reuse", "train", "garbage"]),
)
def test_data_prep_contract(base, source, out, flags, tokenizer):
    from data_prep.__main__ import main

    with workspace(base) as ws:
        if tokenizer == "reuse":
            flags = ["--tokenizer", str(ws / "tokenizer.model"), *flags]
        elif tokenizer == "garbage":
            flags = ["--tokenizer", str(ws / "corpus" / "doc1.txt"), *flags]
        elif "--vocab-size" not in flags:
            flags = ["--vocab-size", "200", *flags]
        if "--seq-len" not in flags:
            flags = ["--seq-len", "32", *flags]
        run_contract(main, data_prep_case(ws, source, out, flags), ws)


DATA_PREP_SEEDS = [
    # issue 21: --out inside --source ("progress.json:1: invalid JSON"); 4 GiB of padding
    ("dir", "in-corpus", ["--seq-len", "32"], "--out .* lies inside the input --source"),
    ("dir", "corpus", ["--seq-len", "32", "--overwrite"], "is the input --source"),
    ("dir", "new", ["--seq-len", "2147483648"], "--seq-len 2147483648 is too large"),
    ("dir", "user", ["--seq-len", "32", "--overwrite"], "refusing to --overwrite"),
    ("dir", "run", ["--seq-len", "32", "--overwrite"], "refusing to --overwrite"),
    ("dir", "in-ckpt", ["--seq-len", "32"], "lies inside a checkpoint directory"),
]


@pytest.mark.parametrize("source,out,flags,message", DATA_PREP_SEEDS)
def test_data_prep_seeds(base, source, out, flags, message):
    import re

    from data_prep.__main__ import main

    with workspace(base) as ws:
        argv = data_prep_case(ws, source, out, ["--tokenizer", str(ws / "tokenizer.model"), *flags])
        rc, err = run_contract(main, argv, ws)
        assert rc == 2 and re.search(message, err), err


# ===================================================================================== finetune
FT_TRAIN = ["train.csv", "train.jsonl", "train.txt", "empty.jsonl", "header.csv",
            "malformed.csv", "lists.jsonl", "utf16.jsonl", "bad.txt", "missing.csv"]  # fmt: skip
FT_FLAGS = st.lists(
    st.one_of(
        _flag("--epochs", st.sampled_from([0.05, 0, -1, float("nan"), 1e9])),
        _flag("--batch-size", st.sampled_from([0, -2, 4, 2**40])),
        _flag("--max-length", st.sampled_from([0, 2, 16, 10**9])),
        _flag("--lr", st.sampled_from([float("inf"), -1e-3, 1e-3])),
        _flag("--validation-fraction", st.sampled_from([0.0, 0.5, 1.0, float("nan")])),
        _flag("--warmup-ratio", st.sampled_from([-0.1, 0.5, 1.0])),
        _flag("--seed", st.sampled_from([-1, 3, 2**40])),
        _flag("--label-column", st.sampled_from(["label", "text", "nope"])),
        st.just(["--overwrite"]),
    ),
    max_size=3,
).map(lambda xs: [a for x in xs for a in x])


def finetune_case(ws: Path, train: str, out: str, flags: list[str]) -> list[str]:
    flags = list(flags)
    if "--epochs" not in flags:  # a real run stays a few steps long
        flags += ["--epochs", "0.05"]
    return ["--model", str(ws / "exported"), "--train", str(ws / "ft" / train),
            "--out", str(out_path(ws, out, "finetune")), "--eval-batch-size", "64", *flags]  # fmt: skip


@settings(FUZZ)
@given(train=st.sampled_from(FT_TRAIN), out=st.sampled_from(OUT_KINDS), flags=FT_FLAGS)
def test_finetune_contract(base, train, out, flags):
    from linformer_ds.finetune import main

    with workspace(base) as ws:
        run_contract(main, finetune_case(ws, train, out, flags), ws)


FT_SEEDS = [  # issue 21: finetune on these gave tracebacks
    ("empty.jsonl", "cannot be read as .jsonl data|is empty"),
    ("header.csv", "is empty|cannot be read"),
    ("malformed.csv", "cannot be read as .csv data|not text|missing|distinct labels"),
    ("lists.jsonl", "'label' in row 0 is a list, not one class label"),
    ("utf16.jsonl", "cannot be read as .jsonl data"),
]


@pytest.mark.parametrize("train,message", FT_SEEDS)
def test_finetune_seeds(base, train, message):
    import re

    from linformer_ds.finetune import main

    with workspace(base) as ws:
        rc, err = run_contract(main, finetune_case(ws, train, "new", []), ws)
        assert rc == 2 and re.search(message, err), err


# ================================================================ pretrain config and data dirs
OVERRIDE_KEYS = ["train.max_steps", "train.micro_batch_size", "model.k", "model.vocab_size",
                 "model.num_heads", "optimizer.lr", "optimizer.betas", "deepspeed.zero.stage",
                 "deepspeed.precision", "deepspeed.extra", "deepspeed.extra.zero_optimization",
                 "parallel.init_timeout_s", "parallel.sequence_parallel_size", "checkpoint.resume",
                 "logging.dir", "data.path", "train.seed", "scheduler.warmup_steps", "nope.key",
                 "model", "deepspeed"]  # fmt: skip
OVERRIDE_VALUES = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.floats().map(repr),
    st.sampled_from(
        [
            "[1",
            "{a: 1}",
            "[1, 2]",
            "null",
            "~",
            "",
            "nan",
            "-inf",
            "1e400",
            "0x10",
            "!!python/object/apply:os.system ['true']",
            "${oc.env:HOME}",
            "${nope}",
            "'quoted",
            "true",
            "{zero: [2]}",
            "../..",
            "step_00000002",
            "\u00e9\u2603",
            "2**34",
            "17179869184",
        ]
    ),  # fmt: skip
    st.text(max_size=8),
)


@settings(FUZZ)
@given(overrides=st.lists(st.tuples(st.sampled_from(OVERRIDE_KEYS), OVERRIDE_VALUES), max_size=3))
def test_pretrain_print_config_contract(base, overrides):
    """launch/pretrain.py --print-config with generated overrides: exit 0 or 2, one line."""
    from linformer_ds import train

    with workspace(base) as ws:
        argv = ["--config", TINY_CONFIG, *TEST_OVERRIDES, f"data.path={base['data']}",
                f"logging.dir={ws / 'run'}", "--print-config",
                *[f"{k}={v}" for k, v in overrides]]  # fmt: skip
        clear_launcher_vars(os.environ)
        run_contract(train.main, argv, ws)


DATA_DAMAGE = {
    "manifest-utf16": lambda d: _reencode(d / "manifest.json", "utf-16"),  # issue 21
    "manifest-truncated": lambda d: (d / "manifest.json").write_text(
        (d / "manifest.json").read_text()[:100]
    ),
    "manifest-types": lambda d: _edit_json(
        d / "manifest.json", lambda m: m.update(seq_len="128", splits=[1], special_ids=None)
    ),
    "no-train": lambda d: shutil.rmtree(d / "train"),
    "shard-truncated": lambda d: _truncate(next((d / "train").iterdir())),
}


@pytest.mark.parametrize("damage", sorted(DATA_DAMAGE))
def test_pretrain_on_damaged_data_dirs(base, damage):
    """The trainer's start-up on a damaged data_prep output: one line, exit 2, before any
    process group; the data directory is left as it was."""
    from linformer_ds import train

    with workspace(base) as ws:
        data = ws / "data"
        shutil.copytree(base["data"], data)
        DATA_DAMAGE[damage](data)
        argv = ["--config", TINY_CONFIG, *TEST_OVERRIDES, f"data.path={data}",
                f"logging.dir={ws / 'newrun'}", "train.max_steps=1"]  # fmt: skip
        clear_launcher_vars(os.environ)
        rc, err = run_contract(train.main, argv, ws)
        assert rc == 2, err


# ========================================================================== real subprocesses
@pytest.mark.parametrize(
    "script,args",
    [
        (
            "export.py",
            [
                "--checkpoint",
                "{ws}/run/checkpoints",
                "--out",
                "{ws}/run/checkpoints",
                "--overwrite",
            ],
        ),  # fmt: skip
        (
            "finetune.py",
            ["--model", "{ws}/exported", "--train", "{ws}/ft/lists.jsonl", "--out", "{ws}/out/ft"],
        ),  # fmt: skip
        ("pretrain.py", ["--config", TINY_CONFIG, "--print-config", "train.max_steps=[1"]),
    ],
    ids=["export-over-checkpoints", "finetune-list-labels", "pretrain-bad-override"],
)
def test_launch_scripts_in_subprocesses(base, script, args):
    """The launch scripts themselves (not main in-process): exit 2, one stderr line, and the
    inputs untouched."""
    with workspace(base) as ws:
        before = tree_hashes(ws)
        env = child_env()
        cmd = [sys.executable, str(REPO / "launch" / script)]
        cmd += [a.replace("{ws}", str(ws)) for a in args]
        # the timeout only catches a hang (exit 2 takes seconds on an idle machine)
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        lines = [line for line in proc.stderr.splitlines()
                 if line.strip() and "[WARNING]" not in line and "real_accelerator" not in line]  # fmt: skip
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert "Traceback" not in proc.stderr
        assert tree_hashes(ws) == before


# ============================================================================ full disks, limits
@pytest.fixture
def small_tmpfs(tmp_path):
    """A mount point for a tmpfs of a size the test picks (tests run as root)."""
    mounted = []

    def mount(size_bytes: int) -> Path:
        mnt = tmp_path / f"tmpfs{len(mounted)}"
        mnt.mkdir()
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs",
                              str(mnt)], capture_output=True, text=True)  # fmt: skip
        assert res.returncode == 0, f"mount failed (tests need root): {res.stderr!r}"
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_export_to_a_full_disk_keeps_the_previous_export(base, small_tmpfs):
    """issue 21: export to a full disk. The disk holds one export and a half: --overwrite of the
    earlier export (which needs room for both while swapping) fails with one line, the earlier
    export stays byte-identical and no partial directory is left."""
    from linformer_ds.export import main

    size = sum(p.stat().st_size for p in base["exported"].rglob("*") if p.is_file())
    mnt = small_tmpfs(int(size * 1.5) // 4096 * 4096 + 4096)
    shutil.copytree(base["exported"], mnt / "exp")
    with workspace(base) as ws:
        argv = ["--checkpoint", str(ws / "run" / "checkpoints"), "--out", str(mnt / "exp"),
                "--overwrite"]  # fmt: skip
        before = tree_hashes(mnt)
        rc, err = run_contract(main, argv, ws)
        assert rc == 2 and "could not write --out" in err and "No space left on device" in err
        assert tree_hashes(mnt) == before
        assert sorted(p.name for p in mnt.iterdir()) == ["exp"]  # no staging directory left


def test_export_past_ulimit_f_is_one_line(base):
    """issue 21: `ulimit -f` gave "unexpected pos". A write past the file-size limit fails with
    EFBIG (SIGXFSZ ignored) and one line naming the limit."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    with workspace(base) as ws:
        env = without_launcher_vars(os.environ)
        proc = subprocess.run(
            [sys.executable, str(REPO / "launch" / "export.py"), "--checkpoint",
             str(ws / "run" / "checkpoints"), "--out", str(ws / "out" / "e")],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=300, preexec_fn=limit,
        )  # fmt: skip
        lines = [line for line in proc.stderr.splitlines() if "export failed" in line]
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert "file-size limit (ulimit -f: 65536 bytes)" in lines[0], lines[0]
        assert not (ws / "out" / "e").exists() and "Traceback" not in proc.stderr


def test_metrics_jsonl_on_a_full_disk_ends_with_a_whole_record(small_tmpfs, capsys):
    """issue 21: logging.dir filling up mid-run left metrics.jsonl ending mid-record. The sink
    writes each record whole, cuts a failed write back and says so once; every line parses."""
    from linformer_ds.config import load_config
    from linformer_ds.metrics import JsonlSink

    mnt = small_tmpfs(32 * 1024)
    cfg = load_config(TINY_CONFIG, [*TEST_OVERRIDES, f"logging.dir={mnt / 'run'}"])
    sink = JsonlSink(cfg)
    values = {f"value_{i}": i * 0.1 for i in range(60)}  # ~1.2 KB a record
    for step in range(1, 80):
        sink.record(step, "train", values, {})
    sink.close()
    text = (mnt / "run" / "metrics.jsonl").read_text()
    records = [json.loads(line) for line in text.splitlines()]
    assert text.endswith("\n") and 5 < len(records) < 79
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    warnings = [line for line in capsys.readouterr().err.splitlines() if "[warn]" in line]
    assert len(warnings) == 1 and "No space left on device" in warnings[0], warnings


def test_data_prep_text_misread_as_utf16_is_counted_not_a_traceback(base):
    """Found by the long fuzz campaign: UTF-8 files read with --encoding utf-16 (an odd byte
    count: "truncated data") raised UnicodeDecodeError; the bytes are replaced and counted."""
    from data_prep.__main__ import main

    with workspace(base) as ws:
        flags = ["--tokenizer", str(ws / "tokenizer.model"), "--seq-len", "32"]
        argv = data_prep_case(ws, "dir", "new", [*flags, "--encoding", "utf-16"])
        rc, err = run_contract(main, argv, ws)  # exit 0 or 2 with one line, no traceback
        if rc == 0:
            out = out_path(ws, "new", "data_prep")
            manifest = json.loads((out / "manifest.json").read_text())
            assert manifest["source"]["undecodable_bytes"] > 0, err
