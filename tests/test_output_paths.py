"""The output contract (linformer_ds.outpath, issue 45 item 1) of the commands that write one
file: ``launch/convert.py --out`` and the ONNX export's ``OUT``. Every command runs against the
same generated table of bad outputs (an input or a file inside one, the input directory, a link
to an input, an existing file without ``--overwrite``, a directory, a path under a file, a
checkpoint's ``latest`` or a new name inside a checkpoint directory, a read-only directory, an
empty path, a directory name), each with a generated file name and ``--overwrite`` on or off
where it stays bad: one stderr line, a non-zero exit, and every file that existed before byte
for byte (no temporary file left). Ctrl-C during the work exits 130 with one line and leaves
no partial output; a replaced file is swapped in whole."""

import json
import os
import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from linformer_ds import onnx_export, warm_start
from linformer_ds.outpath import EXIT_INTERRUPTED, OutPathError, check_out_file, staged

transformers = pytest.importorskip("transformers")

ROOT_USER = os.geteuid() == 0  # root writes into read-only directories: that case is moot


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """A warm-start source (a saved BERT), a job config, an export directory (its files only:
    the bad outputs are refused before it is read), a checkpoint directory, a plain file, a
    link to it, a link to an input, and a read-only directory."""
    root = tmp_path_factory.mktemp("outputs")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=32,
                                  max_position_embeddings=32)  # fmt: skip
    transformers.BertForMaskedLM(cfg).save_pretrained(str(root / "src"))
    (root / "base.yaml").write_text("model:\n  k: 8\n")
    export = root / "export"
    export.mkdir()
    (export / "config.json").write_text(json.dumps({"architectures": ["LinformerForMaskedLM"]}))
    (export / "model.safetensors").write_bytes(b"weights" * 100)
    (export / "linformer_export.json").write_text("{}")
    ckpt = root / "ckpt"
    (ckpt / "step_00000002").mkdir(parents=True)
    (ckpt / "step_00000002" / "COMPLETE").write_text("")
    (ckpt / "latest").write_text("step_00000002")
    (root / "notes.txt").write_text("precious notes\n")
    os.symlink(root / "notes.txt", root / "link_to_notes")
    os.symlink(root / "src" / "config.json", root / "link_to_src")
    os.symlink(root / "export" / "model.safetensors", root / "link_to_export")
    (root / "ro").mkdir()
    os.chmod(root / "ro", 0o555)
    (root / "adir").mkdir()
    return root


# name -> (path under the tree ({n}: a generated file name), bad even with --overwrite)
BAD = {
    "an input's own file": ("{input_file}", True),
    "the input directory": ("{input_dir}", True),
    "a new name inside the input": ("{input_dir}/{n}", True),
    "the job config read by --config": ("base.yaml", False),
    "a link to an input file": ("{input_link}", True),
    "an existing file": ("notes.txt", False),
    "a link to an existing file": ("link_to_notes", False),
    "a directory": ("adir", True),
    "a path under a regular file": ("notes.txt/{n}", True),
    "a checkpoint's latest": ("ckpt/latest", True),
    "a new name inside a checkpoint directory": ("ckpt/{n}", True),
    "a new name inside a checkpoint tag": ("ckpt/step_00000002/{n}", True),
    "a directory name": ("{n}/", True),
    "an empty path": ("", True),
}
if not ROOT_USER:
    BAD["a read-only directory"] = ("ro/{n}", True)
INPUT = {"convert": ("src", "src/config.json", "link_to_src"),
         "onnx": ("export", "export/model.safetensors", "link_to_export")}  # fmt: skip
NAMES = st.text(alphabet=st.sampled_from("abcxyz_-.é0"), min_size=1, max_size=10).filter(
    lambda n: n.strip(".") == n
)


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


def run_command(command, root, out, overwrite, capsys):
    """The command's main() on ``out``; returns (exit status, stdout, stderr)."""
    capsys.readouterr()
    if command == "convert":
        argv = ["--from", f"hf:{root / 'src'}", "--config", str(root / "base.yaml"),
                "--out", out, "model.max_seq_len=32", "model.k=8"]  # fmt: skip
        rc = warm_start.main(argv + (["--overwrite"] if overwrite else []))
    else:
        argv = [str(root / "export"), out, "--no-check"]
        rc = onnx_export.main(argv + (["--overwrite"] if overwrite else []))
    got = capsys.readouterr()
    return rc, got.out, got.err


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(case=st.sampled_from(sorted(BAD)), command=st.sampled_from(sorted(INPUT)),
       name=NAMES, overwrite=st.booleans())  # fmt: skip
def test_every_command_refuses_every_bad_output(tree, capsys, case, command, name, overwrite):
    template, always = BAD[case]
    overwrite = overwrite and always  # --overwrite makes the others legitimate
    input_dir, input_file, input_link = INPUT[command]
    rel = template.format(n=name, input_dir=input_dir, input_file=input_file,
                          input_link=input_link)  # fmt: skip
    out = str(tree / rel) if rel else ""
    if rel.endswith("/"):
        out += "/"
    before = snapshot(tree)
    rc, stdout, err = run_command(command, tree, out, overwrite, capsys)
    assert rc != 0, (case, command, out, stdout, err)
    assert len(err.strip().splitlines()) == 1, (case, command, err)
    assert "Traceback" not in err and stdout == ""
    assert snapshot(tree) == before, (case, command, out)


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
