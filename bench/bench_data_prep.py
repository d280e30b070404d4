"""Benchmark data_prep against raw SentencePiece on one corpus; records peak RSS.

In one run:

1. the README's job (``--source stdlib --seq-len 128 --vocab-size 8000``): wall time, which
   includes training the tokenizer; its ``tokenizer.model`` is reused below;
2. a corpus of about ``--corpus-mb`` MB made by copying the stdlib ``.py`` files repeatedly
   (real files on disk, one document per file);
3. raw SentencePiece throughput on that corpus: the non-blank lines of each batch of files
   (~``--batch-mb`` MB) encoded by one ``encode(list_of_lines)`` call using all cores; only
   the encode calls are timed (the limit of this pipeline);
4. data_prep end to end on that corpus with the same tokenizer (``--tokenizer``), as a child
   process: wall-clock tokens/s, and peak RSS summed over the process tree (main + workers),
   sampled every 0.1 s, plus the kernel's exact peak of the largest single process
   (``RUSAGE_CHILDREN`` of a wrapper process).

5. with ``--ranks 1 2``: the same job under ``mpirun -np R`` (data_prep/parallel.py) for each R:
   wall time, every rank's own tokenize rate (its ``data_prep: rank r/R`` line) against raw
   SentencePiece on one thread times the rank's ``--workers`` (the rate a rank could reach),
   and a check that the shards equal step 4's.

Usage: ``python bench/bench_data_prep.py --work /tmp/bench_dp --corpus-mb 1024 --workers 2``
(``--ranks 1 2 --workers 1`` for the per-rank figures on a 2-core machine).
"""

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from data_prep.sources import stdlib_files  # noqa: E402
from data_prep.tokenizer import document_lines  # noqa: E402


def make_corpus(dest: Path, target_bytes: int) -> dict[str, int]:
    """Copy the stdlib .py files into ``dest/rep_XXX/`` until ``target_bytes`` are written."""
    files = stdlib_files()
    root = os.path.commonpath(files)
    written, copies, reps = 0, 0, 0
    while written < target_bytes:
        for f in files:
            out = dest / f"rep_{reps:03d}" / os.path.relpath(f, root)
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, out)
            written += os.path.getsize(f)
            copies += 1
            if written >= target_bytes:
                break
        reps += 1
    return {"bytes": written, "files": copies, "repetitions": reps}


def corpus_files(root: Path) -> list[str]:
    return sorted(str(p) for p in root.rglob("*") if p.is_file())


def raw_sentencepiece(
    model: str, files: list[str], batch_bytes: int, threads: int = -1
) -> dict[str, float]:
    """Tokens/s of SentencePiece alone: one encode(list of lines) per ~batch_bytes of text
    (``threads``: SentencePiece's num_threads; -1 = all cores)."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=model)
    tokens, encode_s, lines_n = 0, 0.0, 0
    batch: list[str] = []
    size = 0

    def flush() -> None:
        nonlocal tokens, encode_s, lines_n, batch, size
        t0 = time.perf_counter()
        out = sp.encode(batch, num_threads=threads)
        encode_s += time.perf_counter() - t0
        tokens += sum(map(len, out))
        lines_n += len(batch)
        batch, size = [], 0

    for f in files:
        text = Path(f).read_bytes().decode("utf-8", "replace")
        batch.extend(document_lines(text))
        size += len(text)
        if size >= batch_bytes:
            flush()
    if batch:
        flush()
    return {
        "tokens": tokens,
        "lines": lines_n,
        "encode_s": encode_s,
        "tokens_per_s": tokens / encode_s,
    }


def run_measured(cmd: list[str]) -> dict[str, float]:
    """Run ``cmd``; wall time and peak RSS of its process tree (sampled) and per process."""
    import psutil

    # A wrapper process reports the largest ru_maxrss of its descendants (main and workers).
    wrapper = (
        "import resource, subprocess, sys; rc = subprocess.call(sys.argv[1:]); "
        "print('MAXRSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, "
        "file=sys.stderr); sys.exit(rc)"
    )
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", wrapper, *cmd], cwd=REPO, stderr=subprocess.PIPE, text=True
    )
    peak = {"tree": 0}
    stop = threading.Event()

    def sample() -> None:
        p = psutil.Process(proc.pid)
        while not stop.is_set():
            try:
                procs = [p] + p.children(recursive=True)
                total = 0
                for q in procs:
                    try:
                        total += q.memory_info().rss
                    except psutil.Error:
                        pass
                peak["tree"] = max(peak["tree"], total)
            except psutil.Error:
                break
            time.sleep(0.1)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    _, err = proc.communicate()
    wall = time.perf_counter() - t0
    stop.set()
    th.join()
    if proc.returncode != 0:
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{err[-3000:]}")
    maxrss = [line for line in err.splitlines() if line.startswith("MAXRSS_KB")]
    summary = [line for line in err.splitlines() if "tokens/s" in line and "documents" in line]
    return {
        "wall_s": wall,
        "peak_rss_tree_mb": peak["tree"] / 2**20,
        "peak_rss_largest_process_mb": int(maxrss[-1].split()[1]) / 1024,
        "summary": summary[-1].split("data_prep: ")[-1] if summary else "",
    }


def run_ranks(
    cmd: list[str], ranks: int, tokens: int, raw1: dict[str, float], workers: int
) -> dict[str, object]:
    """``cmd`` under ``mpirun -np ranks``: wall time, and each rank's tokenize rate against raw
    SentencePiece on one thread times ``workers``."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise SystemExit("--ranks needs mpirun (apt-get install openmpi-bin) and mpi4py")
    pre = [mpirun, "--oversubscribe", "-np", str(ranks)]
    if os.geteuid() == 0:
        pre.insert(1, "--allow-run-as-root")
    t0 = time.perf_counter()
    proc = subprocess.run([*pre, *cmd], cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"mpirun failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    per_rank = {}
    for m in re.finditer(r"rank (\d+)/\d+: (\d+) units, (\d+) tokens in ([\d.]+) s", proc.stderr):
        rank, units, tok, secs = int(m[1]), int(m[2]), int(m[3]), float(m[4])
        tps = tok / max(secs, 1e-9)
        per_rank[rank] = {
            "units": units,
            "tokens": tok,
            "tokenize_s": secs,
            "tokens_per_s": tps,
            "vs_raw_sentencepiece": tps / (raw1["tokens_per_s"] * workers),
        }
    return {
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "per_rank": per_rank,
        "workers_per_rank": workers,
    }


def main() -> None:
    """Run the benchmark and print a JSON report."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/bench_data_prep", help="scratch directory")
    ap.add_argument("--corpus-mb", type=int, default=1024)
    ap.add_argument("--batch-mb", type=int, default=16)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--vocab-size", type=int, default=8000)
    ap.add_argument(
        "--ranks", type=int, nargs="*", default=[], help="also run under mpirun -np R for each R"
    )
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = ap.parse_args()
    work = Path(args.work)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    py = sys.executable
    report: dict[str, object] = {
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, {platform.platform()}",
        "python": platform.python_version(),
    }
    import numpy
    import sentencepiece

    report["versions"] = {"sentencepiece": sentencepiece.__version__, "numpy": numpy.__version__}

    # 1. The README job (tokenizer training included).
    std_cmd = [py, "-m", "data_prep", "--source", "stdlib", "--out", str(work / "stdlib"),
               "--seq-len", str(args.seq_len), "--vocab-size", str(args.vocab_size),
               "--workers", str(args.workers)]  # fmt: skip
    std = run_measured(std_cmd)
    m = json.loads((work / "stdlib" / "manifest.json").read_text())
    std["tokenizer_train_s"] = m["tokenizer"]["trained"]["seconds"]
    std["tokens"] = sum(m["splits"][s]["tokens"]["content"] for s in ("train", "valid"))
    report["stdlib_job"] = std
    model = str(work / "stdlib" / "tokenizer.model")

    # 2. The big corpus.
    t0 = time.perf_counter()
    report["corpus"] = make_corpus(work / "corpus", args.corpus_mb << 20)
    report["corpus"]["make_s"] = time.perf_counter() - t0
    files = corpus_files(work / "corpus")

    # 3. Raw SentencePiece.
    raw = raw_sentencepiece(model, files, args.batch_mb << 20)
    report["raw_sentencepiece"] = raw

    # 4. data_prep end to end with the same tokenizer.
    big_cmd = [py, "-m", "data_prep", "--source", str(work / "corpus"), "--out", str(work / "big"),
               "--seq-len", str(args.seq_len), "--tokenizer", model,
               "--workers", str(args.workers)]  # fmt: skip
    big = run_measured(big_cmd)
    m = json.loads((work / "big" / "manifest.json").read_text())
    big["tokens"] = sum(m["splits"][s]["tokens"]["content"] for s in ("train", "valid"))
    big["rows"] = {s: m["splits"][s]["rows"] for s in ("train", "valid")}
    big["tokens_per_s"] = big["tokens"] / big["wall_s"]
    report["data_prep"] = big
    report["ratio_vs_raw"] = big["tokens_per_s"] / raw["tokens_per_s"]
    report["commands"] = {"stdlib": " ".join(std_cmd[1:]), "big": " ".join(big_cmd[1:])}
    assert big["tokens"] == raw["tokens"], (big["tokens"], raw["tokens"])

    # 5. The same job on R ranks.
    if args.ranks:
        raw1 = raw_sentencepiece(model, files, args.batch_mb << 20, threads=1)
        report["raw_sentencepiece_1_thread"] = raw1
        report["ranks"] = {}
        for r in args.ranks:
            out = work / f"mpi_{r}"
            cmd = [*big_cmd[:6], str(out), *big_cmd[7:]]
            report["ranks"][r] = run_ranks(cmd, r, big["tokens"], raw1, max(args.workers, 1))
            got = json.loads((out / "manifest.json").read_text())
            assert got["splits"] == m["splits"], f"{r} ranks wrote other shards than one process"
        report["commands"]["ranks"] = "mpirun -np R " + " ".join(big_cmd[1:])
    print(json.dumps(report, indent=2))
    if not args.keep:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
