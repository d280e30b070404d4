"""onnxruntime against eager PyTorch on the same export (issue 46 item 6).

``python -m bench.onnx_bench`` writes a randomly initialised MLM export (the English recipe's
sizes without its local mixer, which does not export: vocabulary 8,000, ``max_seq_len`` 512,
hidden 256, 4 layers, 4 heads, FFN 1,024, linear, k 128, layerwise; the committed test
tokenizer), exports it with :func:`linformer_ds.onnx_export.export_onnx` and times, per batch
size x length, in one run, interleaved (the order reversing every round):

* ``eager``: the export loaded by transformers (:func:`linformer_ds.onnx_export.load`), no grad;
* ``ort``: the ONNX file in :func:`linformer_ds.onnx_export.session`;
* with ``--baseline-code FILE`` (e.g. ``git show REV:linformer_ds/hf/modeling_linformer.py``):
  ``eager-before`` and ``ort-before``, the same weights with that modeling code, exported again,
  in onnxruntime's default session (the state before a change, in the same run).

Inputs are :func:`linformer_ds.onnx_export._inputs`' (padded rows, one left-padded when B > 1).
``--clock cpu`` (default): this thread's CPU time at one thread for torch and onnxruntime alike
(each then runs on the calling thread; time spent descheduled on a busy machine is not counted);
``wall``: perf_counter at torch's thread count, onnxruntime given as many. Each figure is the
median over rounds; ``eager / ort`` the median of per-round ratios (> 1: onnxruntime faster).
Writes ``results.json`` and ``results.md`` to ``--out``, with the load average and ``--beside``.
"""

import argparse
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from linformer_ds.model_dir import CODE_SHA_KEY, REMOTE_CODE

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "tests" / "data" / "export_format1" / "tokenizer.model"
SIZES = dict(
    vocab_size=8000, max_seq_len=512, hidden_size=256, num_layers=4, num_heads=4,
    intermediate_size=1024, dropout=0.0, attention_dropout=0.0, projection="linear", k=128,
    sharing="layerwise",
)  # fmt: skip


def write_export(out: Path, seed: int) -> None:
    """A random MLM export of :data:`SIZES` in ``out``."""
    from linformer_ds.export import TIED_KEY
    from linformer_ds.model import LinformerForMaskedLM, ModelConfig
    from linformer_ds.model_dir import write_model_dir

    torch.manual_seed(seed)
    cfg = ModelConfig(**SIZES)
    state = {k: v for k, v in LinformerForMaskedLM(cfg).state_dict().items() if k != TIED_KEY}
    write_model_dir(str(out), cfg, state, str(TOKENIZER))


def interleaved(fns: dict[str, Callable[[], Any]], rounds: int, warmup: int, clock) -> dict:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(warmup + rounds):
        for name in list(fns)[:: 1 if r % 2 else -1]:
            t0 = clock()
            fns[name]()
            if r >= warmup:
                times[name].append(clock() - t0)
    return times


def run(a: argparse.Namespace) -> dict[str, Any]:
    import onnxruntime as ort

    from linformer_ds import onnx_export as ox

    threads = 1 if a.clock == "cpu" else torch.get_num_threads()
    torch.set_num_threads(threads)
    clock = time.thread_time if a.clock == "cpu" else time.perf_counter
    res: dict[str, Any] = {
        "args": vars(a), "threads": threads, "torch": torch.__version__,
        "onnxruntime": ort.__version__, "load_before": [round(x, 2) for x in os.getloadavg()],
        "rows": [],
    }  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="onnx_bench_"))
    try:
        arms: dict[str, Any] = {}
        dirs = {"": work / "export"}
        write_export(dirs[""], a.seed)
        if a.baseline_code:
            dirs["-before"] = work / "export_before"
            shutil.copytree(dirs[""], dirs["-before"])
            text = Path(a.baseline_code).read_text(encoding="utf-8")
            for old, new in REMOTE_CODE["modeling_linformer.py"][1]:  # as the export rewrites
                text = text.replace(old, new)
            code = text.encode("utf-8")
            (dirs["-before"] / "modeling_linformer.py").write_bytes(code)
            config = json.loads((dirs["-before"] / "config.json").read_text())
            config[CODE_SHA_KEY]["modeling_linformer.py"] = hashlib.sha256(code).hexdigest()
            (dirs["-before"] / "config.json").write_text(json.dumps(config, indent=2))
        for tag, d in dirs.items():
            path = str(work / f"model{tag}.onnx")
            t0 = time.perf_counter()
            ox.export_onnx(str(d), path, check=False)
            res[f"export{tag}_s"] = round(time.perf_counter() - t0, 1)
            wrapper, _ = ox.load(str(d))
            if tag:  # before: onnxruntime's default session (threads: as the arm after)
                options = ort.SessionOptions()
                options.intra_op_num_threads = threads
                sess = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
            else:
                sess = ox.session(path, threads)
            arms[f"eager{tag}"], arms[f"ort{tag}"] = wrapper, sess
        for b in a.batches:
            for n in a.seq_lens:
                ids, mask = ox._inputs(b, n, SIZES["vocab_size"], seed=b * 1000 + n)
                feeds = {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}
                fns = {
                    k: (lambda m=m, i=ids, am=mask: m(i, am)) if k.startswith("eager")
                    else (lambda m=m, f=feeds: m.run(None, f))
                    for k, m in arms.items()
                }  # fmt: skip
                with torch.no_grad():
                    want = arms["eager"](ids, mask)[0]
                    got = torch.from_numpy(arms["ort"].run(None, feeds)[0])
                    t = interleaved(fns, a.rounds, a.warmup, clock)
                row = {"batch": b, "seq": n, "max_abs_diff": float((got - want).abs().max())}
                row.update({f"{k}_ms": round(1e3 * statistics.median(v), 2) for k, v in t.items()})
                for tag in dirs:
                    row[f"eager{tag}_over_ort{tag}"] = round(statistics.median(
                        e / o for e, o in zip(t[f"eager{tag}"], t[f"ort{tag}"])), 3)  # fmt: skip
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["load_after"] = [round(x, 2) for x in os.getloadavg()]
    return res


def markdown(res: dict[str, Any]) -> str:
    before = "eager-before_ms" in res["rows"][0]
    head = "| B | n | eager (ms) | ort (ms) | eager / ort |"
    rule = "|---:|---:|---:|---:|---:|"
    if before:
        head += " eager before (ms) | ort before (ms) | eager / ort before |"
        rule += "---:|---:|---:|"
    lines = [f"{res['threads']} thread(s), {res['args']['clock']} clock; load average before "
             f"{res['load_before']}, after {res['load_after']}; beside: {res['args']['beside']}",
             "", head, rule]  # fmt: skip
    for r in res["rows"]:
        line = (f"| {r['batch']} | {r['seq']} | {r['eager_ms']} | {r['ort_ms']} | "
                f"{r['eager_over_ort']}x |")  # fmt: skip
        if before:
            line += (f" {r['eager-before_ms']} | {r['ort-before_ms']} | "
                     f"{r['eager-before_over_ort-before']}x |")  # fmt: skip
        lines.append(line)
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[31, 128, 500])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--clock", default="cpu", choices=["cpu", "wall"])
    p.add_argument("--baseline-code", default=None,
                   help="a modeling_linformer.py for the before arms (same weights)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--beside", default="", help="what else ran on the machine (recorded)")
    p.add_argument("--out", default="bench/results/onnx")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    res = run(a)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "results.md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
