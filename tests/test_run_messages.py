"""What the commands say in the smaller cases of issue 30 (item 7): the ``[done]`` lines with
TensorBoard off, ``[setup] train_rows`` of a mixture, a resume at or past ``train.max_steps``,
``--config`` naming a directory, and ``data_prep --resume`` with changed options."""

import json
from pathlib import Path

import pytest

from linformer_ds.config import ConfigError, load_config
from linformer_ds.data.shards import open_sources
from tests.pretrain_utils import REPO, TEST_OVERRIDES, TINY_CONFIG
from tests.test_mixture import docs_corpus, prepare, sources_override


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (relative path -> bytes)."""
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def _train(capsys, *args: str) -> tuple[int, str, str]:
    from linformer_ds import train

    rc = train.main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


# ===================================================================================== --config
def test_config_that_is_a_directory_is_named_so(tmp_path, capsys, _clean_env):
    """``--config DIR`` (and a ``defaults:`` naming a directory): one line saying it is a
    directory, exit 2; a missing file still says not found."""
    with pytest.raises(ConfigError, match=r"^config file .*configs is a directory: give a YAML"):
        load_config(str(REPO / "configs"))
    (tmp_path / "sub").mkdir()
    (tmp_path / "job.yaml").write_text("defaults: sub\nname: x\n")
    with pytest.raises(ConfigError, match=r"^config file .*sub is a directory"):
        load_config(str(tmp_path / "job.yaml"))
    with pytest.raises(ConfigError, match="^config file not found: "):
        load_config(str(tmp_path / "nope.yaml"))
    before = _tree(tmp_path)
    rc, out, err = _train(capsys, "--config", str(tmp_path))
    assert rc == 2 and out == "", (rc, out, err)
    assert err == f"config error: config file {tmp_path} is a directory: give a YAML file in it\n"
    assert _tree(tmp_path) == before


# ======================================================================== [setup] and [done] lines
def test_mixture_rows_tensorboard_line_and_resume_at_or_past_max_steps(
    tiny_corpus, tmp_path_factory, tmp_path, capsys, _clean_env
):
    """One 1-rank run of a two-source mixture, then three resumes of it:
    - ``[setup] train_rows`` is the total with each source's rows;
    - with ``logging.tensorboard=false`` no ``[done] TensorBoard`` line, with true one;
    - a resume past ``train.max_steps`` (or at it) trains nothing, says so in one ``[done]`` line
      (no ``first loss None``), saves nothing and exits 0."""
    docs = prepare(tmp_path_factory.mktemp("docs") / "docs_128", docs_corpus(tmp_path_factory),
                   128, "--tokenizer", tiny_corpus / "tokenizer.model", "--valid-fraction", "0.2",
                   "--max-docs", "12")  # fmt: skip
    rows = [len(ds) for ds in open_sources(["code", "docs"], [tiny_corpus, docs], "train")]
    run = tmp_path / "run"
    base = ["--config", TINY_CONFIG, *TEST_OVERRIDES, f"logging.dir={run}",
            sources_override(("code", tiny_corpus, 0.75), ("docs", docs, 0.25)),
            "checkpoint.save_interval=0"]  # fmt: skip

    def setup_line(out: str) -> str:
        return next(ln for ln in out.splitlines() if ln.startswith("[setup] "))

    def done_lines(out: str) -> list[str]:
        return [ln for ln in out.splitlines() if ln.startswith("[done] ")]

    rc, out, err = _train(capsys, *base, "train.max_steps=2")  # TEST_OVERRIDES: TensorBoard off
    assert rc == 0, err[-3000:]
    assert f" train_rows={sum(rows)} (code={rows[0]} docs={rows[1]}) " in setup_line(out)
    done = done_lines(out)
    assert [ln.split(":")[0] for ln in done] == ["[done] step 2", "[done] checkpoints"], done
    assert not (run / "tensorboard").exists()

    ckpts = run / "checkpoints"
    for max_steps, where in ((1, "past"), (2, "at")):
        before = _tree(ckpts)
        rc, out, err = _train(capsys, *base, f"train.max_steps={max_steps}")
        assert rc == 0, err[-3000:]
        assert done_lines(out) == [
            f"[done] step 2: nothing trained: the checkpoint step_00000002 is already {where} "
            f"train.max_steps={max_steps}; raise train.max_steps to train further",
            f"[done] checkpoints: {ckpts} (latest: step_00000002)",
        ], out[-3000:]
        assert "first loss" not in out and "[train]" not in out and "Traceback" not in err
        assert _tree(ckpts) == before  # nothing saved
    rc, out, err = _train(capsys, *base, "train.max_steps=2", "train.stop_at_step=1")
    assert rc == 0 and "already past train.stop_at_step=1; raise train.stop_at_step" in out, out

    rc, out, err = _train(capsys, *base, "train.max_steps=3", "logging.tensorboard=true")
    assert rc == 0, err[-3000:]
    assert done_lines(out)[1:] == [
        f"[done] TensorBoard: tensorboard --logdir {run}",
        f"[done] checkpoints: {ckpts} (latest: step_00000003)",
    ]
    assert done_lines(out)[0].startswith("[done] step 3: first loss ")


def test_one_source_train_rows_unchanged():
    """A single source's ``train_rows`` stays one number (the README demo's line)."""
    from linformer_ds.trainer import Trainer

    fake = Trainer.__new__(Trainer)
    fake.train_sets = {"train": list(range(7))}  # type: ignore[assignment]
    assert fake._train_rows() == "7"
    fake.train_sets = {"web": list(range(7)), "code": list(range(3))}  # type: ignore[assignment]
    assert fake._train_rows() == "10 (web=7 code=3)"


# ============================================================================ data_prep --resume
def test_data_prep_resume_with_other_options_names_each_difference(tmp_path, capsys):
    """``data_prep --resume`` with changed flags: one line naming each differing option with
    the saved and the new value (was the whole saved dict), exit 2, --out unchanged."""
    from data_prep.__main__ import main
    from data_prep.steps import PROGRESS, PrepConfig, options_diff

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("one document\n")
    out = tmp_path / "out"
    out.mkdir()
    saved = PrepConfig(sources=[str(src)], out=str(out), seq_len=128, vocab_size=300).fingerprint()
    (out / PROGRESS).write_text(json.dumps({"fingerprint": saved}))
    before = _tree(out)
    args = ["--source", str(src), "--out", str(out), "--vocab-size", "300", "--quiet", "--resume"]
    rc = main([*args, "--seq-len", "256", "--seed", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and err == (
        f"data_prep: error: cannot --resume: the interrupted run in {str(out)!r} used different "
        "options (--seq-len 128 -> 256, --seed 0 -> 1); rerun with the same options or "
        "--overwrite\n"
    ), err
    assert _tree(out) == before
    # options of older runs, defaults recorded only when not the default, lists and hashes
    new = dict(saved, sources=["b"], tokenizer_sha256="ab" * 32, encoding="latin-1")
    assert options_diff(dict(saved, gone=1), new) == (
        f"--source {src} -> b, --tokenizer none -> sha256 abababababab, "
        "--encoding utf-8 -> latin-1, --gone 1 -> none"
    )
    assert options_diff(None, new) == f"no options recorded in {PROGRESS}"
