"""The sweep's data: one data_prep output per sequence length N, built on demand under
``data.cache_dir`` with one shared SentencePiece tokenizer, and the unigram reference."""

import contextlib
import fcntl
import hashlib
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from studies.sweep.config import REPO, DataSpec, SweepError


def _data_key(spec: DataSpec) -> str:
    blob = json.dumps([spec.source, spec.vocab_size, spec.args], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:10]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_data(spec: DataSpec, seq_len: int, log: Any = None) -> Path:
    """The data_prep output for ``seq_len`` (built once, cached; one tokenizer for all N), or
    the prebuilt ``spec.path`` after checking that its rows hold ``seq_len`` tokens."""
    if spec.path is not None:
        return prebuilt_data(Path(spec.path), seq_len)
    out = data_dir(spec, seq_len)
    root = out.parent
    stamp = out / "sweep_data.json"
    if stamp.is_file():
        return out
    with _locked(root / ".lock"):
        if stamp.is_file():  # another process built it while we waited
            return out
        tok = root / "tokenizer.model"
        tmp = root / f".n{seq_len}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        cmd = [sys.executable, "-m", "data_prep", "--source", *spec.source, "--out", str(tmp)]
        cmd += ["--seq-len", str(seq_len), "--quiet", *spec.args]
        cmd += (
            ["--tokenizer", str(tok)] if tok.is_file() else ["--vocab-size", str(spec.vocab_size)]
        )
        if log:
            log(f"[data] N={seq_len}: {shlex.join(cmd)}")
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SweepError(
                f"data_prep for N={seq_len} failed ({proc.returncode}): {proc.stderr[-2000:]}"
            )
        if not tok.is_file():
            shutil.copyfile(tmp / "tokenizer.model", tok)
        (tmp / "sweep_data.json").write_text(
            json.dumps({"command": cmd, "seconds": time.perf_counter() - t0}, indent=2)
        )
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    return out


def prebuilt_data(path: Path, seq_len: int) -> Path:
    """``path`` when it is a data_prep output with rows of ``seq_len`` tokens, else SweepError."""
    manifest = path / "manifest.json"
    if not manifest.is_file():
        raise SweepError(f"data path {path}: no manifest.json (not a data_prep output)")
    n = json.loads(manifest.read_text()).get("seq_len")
    if n != seq_len:
        raise SweepError(f"data path {path}: rows of {n} tokens, the point needs N={seq_len}")
    return path


def data_dir(spec: DataSpec, seq_len: int) -> Path:
    """Where ``ensure_data`` puts (or put) the data_prep output for ``seq_len``."""
    if spec.path is not None:
        return Path(spec.path)
    key = "_".join(Path(x).name for x in spec.source)
    return Path(spec.cache_dir) / f"{key}-{_data_key(spec)}" / f"n{seq_len}"


def unigram_perplexity(path: Path, eval_tokens: int | None = None) -> float:
    """Perplexity of the train split's token frequencies (add-0.5) on the validation tokens
    that MLM can mask (special ids excluded), the first ``eval_tokens`` of them: the level a
    model reaches by predicting without context."""
    import numpy as np

    m = json.loads((path / "manifest.json").read_text())
    special = sorted(set(m["special_ids"].values()))
    v = int(m["vocab_size"])

    def tokens(split: str) -> "np.ndarray":
        files = [path / s["file"] for s in m["splits"][split]["shards"]]
        return np.concatenate([np.load(f).ravel() for f in files]).astype(np.int64)

    counts = np.bincount(tokens("train"), minlength=v).astype(np.float64) + 0.5
    counts[special] = 0.0  # never an MLM target
    p = counts / counts.sum()
    valid = tokens("valid")
    if eval_tokens is not None:
        valid = valid[:eval_tokens]
    valid = valid[~np.isin(valid, special)]
    return float(math.exp(-np.log(p[valid]).mean()))
