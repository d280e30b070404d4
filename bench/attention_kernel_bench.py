"""SDPA or the explicit product on Linformer's short key axis (issue 46 item 3).

``python -m bench.attention_kernel_bench`` measures, in one run, interleaved:

* ``grid``: the attention core alone, forward + backward, ``q [B, h, n, d]`` (a strided view of
  ``[B, n, h, d]``, as the model holds it) against ``k, v [B, h, m, d]``, SDPA against
  :func:`linformer_ds.model.kernels.explicit_attention`, for every dtype x ``m`` x ``n``; each
  round runs both (the order alternating), a cell's figure is the median over rounds of
  ``t_sdpa / t_explicit`` (> 1: the explicit product is faster). From it, the rule
  (:data:`linformer_ds.model.kernels.EXPLICIT_UP_TO`): per dtype and ``m``, the largest ``n``
  up to which every measured length has the explicit product at least ``--margin`` faster.
* ``block``: the pre-LN attention block ``x + attention(LN(x))`` at ``--block-lens``, forward +
  backward in bf16, ours (the rule), ours with SDPA forced and lucidrains' ``linformer`` (the
  blocks of the models ``bench.peer_bench`` builds, E/F tied as it ties them; the
  ``bench/probes/attention_only.py`` measurement), median of per-round ratios.

Writes ``results.json`` and ``results.md`` to ``--out``; the load average before and after and
``--beside`` (what else ran) go in.
"""

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from linformer_ds.model.kernels import attention_kernel, explicit_attention

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
_clock = time.perf_counter


def _time(fn: Callable[[], Any]) -> float:
    t0 = _clock()
    fn()
    return _clock() - t0


def interleaved(fns: dict[str, Callable[[], Any]], rounds: int, warmup: int, reps: int) -> dict:
    """Per-round seconds of each of ``fns`` (``reps`` calls a turn; the order reverses every
    round), after ``warmup`` rounds."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(warmup + rounds):
        for name in list(fns)[:: 1 if r % 2 else -1]:
            dt = sum(_time(fns[name]) for _ in range(reps)) / reps
            if r >= warmup:
                times[name].append(dt)
    return times


def core_cell(dtype: torch.dtype, b: int, h: int, d: int, n: int, m: int, a: argparse.Namespace):
    """One grid cell: median seconds of each kernel and the median per-round ratio."""
    g = torch.Generator().manual_seed(n * 7919 + m)
    q = torch.randn(b, n, h, d, generator=g).to(dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(b, m, h, d, generator=g).to(dtype).transpose(1, 2).requires_grad_()
    v = torch.randn(b, m, h, d, generator=g).to(dtype).transpose(1, 2).requires_grad_()
    mask = torch.ones(b, 1, 1, m, dtype=torch.bool)
    mask[-1, ..., m - m // 4 :] = False  # one row's last summaries are padding
    dy = torch.randn(b, h, n, d, generator=g).to(dtype)
    fns = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask).backward(dy),
        "explicit": lambda: explicit_attention(q, k, v, mask).backward(dy),
    }
    reps = max(1, min(8, (1 << 20) // (b * n * m)))
    t = interleaved(fns, a.rounds, a.warmup, reps)
    ratio = statistics.median(s / e for s, e in zip(t["sdpa"], t["explicit"]))
    return {
        "sdpa_ms": round(1e3 * statistics.median(t["sdpa"]), 3),
        "explicit_ms": round(1e3 * statistics.median(t["explicit"]), 3),
        "sdpa_over_explicit": round(ratio, 3),
    }


def rule(cells: list[dict[str, Any]], margin: float) -> dict[str, list[list[int]]]:
    """Per dtype, ``[[m, n_max], ...]``: the explicit product up to the largest ``n`` below
    which every measured length has it ``margin`` faster (n_max 0: SDPA at every length)."""
    out: dict[str, list[list[int]]] = {}
    for dt in sorted({c["dtype"] for c in cells}):
        rows = []
        for m in sorted({c["m"] for c in cells if c["dtype"] == dt}):
            n_max = 0
            for c in sorted(
                (c for c in cells if c["dtype"] == dt and c["m"] == m), key=lambda c: c["n"]
            ):
                if c["sdpa_over_explicit"] < margin:
                    break
                n_max = c["n"]
            rows.append([m, n_max])
        out[dt] = rows
    return out


def block_rows(a: argparse.Namespace) -> list[dict[str, Any]]:
    """The attention block, ours (rule) / ours (SDPA) / lucidrains, per length and sharing."""
    from bench.peer_bench import PeerConfig, build, our_config

    rows = []
    for n in a.block_lens:
        for sharing in a.sharings:
            torch.manual_seed(0)
            cfg = our_config(PeerConfig(), n, sharing)
            ours = build("ours", cfg).to(torch.bfloat16)
            luc = build("lucidrains", cfg).to(torch.bfloat16)
            layer, shared = ours.encoder.layers[0], ours.encoder.shared_linear
            theirs = luc.body.net.layers[0][0]  # PreNorm(LinformerSelfAttention)
            x = torch.randn(a.block_batch, n, cfg.hidden_size, dtype=torch.bfloat16)
            x.requires_grad_()
            dy = torch.randn_like(x)

            def ours_with(kernel: str | None, a=layer, s=shared, x=x, dy=dy) -> Callable:
                def step() -> None:
                    with attention_kernel(kernel):
                        a.attention_block(x, None, s, None, None).backward(dy)

                return step

            fns = {
                "ours": ours_with(None),
                "ours_sdpa": ours_with("sdpa"),
                "lucidrains": lambda f=theirs, x=x, dy=dy: (x + f(x)).backward(dy),
            }
            t = interleaved(fns, a.block_rounds, a.warmup, 1)
            med = {k: statistics.median(v) for k, v in t.items()}
            rows.append({
                "n": n, "sharing": sharing, "batch": a.block_batch, "k": cfg.k,
                **{f"{k}_ms": round(1e3 * v, 2) for k, v in med.items()},
                "ours_vs_lucidrains": round(statistics.median(
                    lu / o for lu, o in zip(t["lucidrains"], t["ours"])), 3),
                "ours_sdpa_vs_lucidrains": round(statistics.median(
                    lu / o for lu, o in zip(t["lucidrains"], t["ours_sdpa"])), 3),
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
            del ours, luc, layer, shared, theirs
    return rows


def markdown(res: dict[str, Any]) -> str:
    lines = [f"load average before {res['load_before']}, after {res['load_after']}; "
             f"{res['threads']} threads, {res['clock']} clock; beside: {res['beside']}", ""]  # fmt: skip
    if res["grid"]:
        ms = sorted({c["m"] for c in res["grid"]})
        for dt in sorted({c["dtype"] for c in res["grid"]}):
            lines += [f"t_sdpa / t_explicit, {dt}, forward + backward, B = {res['batch']}, "
                      f"h = {res['heads']}, d = {res['head_dim']} (> 1: explicit faster)", "",
                      "| n \\ m | " + " | ".join(map(str, ms)) + " |",
                      "|---:|" + "---:|" * len(ms)]  # fmt: skip
            for n in sorted({c["n"] for c in res["grid"]}):
                cell = {c["m"]: c for c in res["grid"] if c["dtype"] == dt and c["n"] == n}
                lines.append(
                    f"| {n} | "
                    + " | ".join(
                        f"{cell[m]['sdpa_over_explicit']:.2f}" if m in cell else "" for m in ms
                    )
                    + " |"
                )
            lines += ["", f"rule ({dt}, margin {res['margin']}): "
                      + ", ".join(f"m <= {m}: n <= {n}" for m, n in res["rule"][dt]), ""]  # fmt: skip
    if res["block"]:
        lines += [
            "| N | sharing | ours (ms) | ours, SDPA forced (ms) | lucidrains (ms) | "
            "ours vs lucidrains | ours-SDPA vs lucidrains |",
            "|---:|---|---:|---:|---:|---:|---:|",
        ]
        for r in res["block"]:
            lines.append(f"| {r['n']} | {r['sharing']} | {r['ours_ms']} | {r['ours_sdpa_ms']} | "
                         f"{r['lucidrains_ms']} | {r['ours_vs_lucidrains']}x | "
                         f"{r['ours_sdpa_vs_lucidrains']}x |")  # fmt: skip
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=sorted(DTYPES))
    p.add_argument("--key-lens", type=int, nargs="*", default=[64, 128, 256, 512])
    p.add_argument("--seq-lens", type=int, nargs="*", default=[64, 128, 256, 512, 1024, 2048])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--margin", type=float, default=1.05, help="explicit must be this much faster")
    p.add_argument("--block-lens", type=int, nargs="*", default=[512])
    p.add_argument("--block-batch", type=int, default=1)
    p.add_argument("--block-rounds", type=int, default=9)
    p.add_argument("--sharings", nargs="+", default=["headwise", "layerwise"])
    p.add_argument(
        "--clock",
        default="wall",
        choices=sorted(CLOCKS),
        help="wall: perf_counter at torch's threads; cpu: this thread's CPU time, "
        "one thread (a busy shared machine: time descheduled is not counted)",
    )
    p.add_argument("--beside", default="", help="what else ran on the machine (recorded)")
    p.add_argument("--out", default="bench/results/attention_kernels")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    global _clock
    a = parse_args(argv)
    _clock = CLOCKS[a.clock]
    if a.clock == "cpu":
        torch.set_num_threads(1)
    res: dict[str, Any] = {
        "args": vars(a), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "beside": a.beside, "clock": a.clock,
        "batch": a.batch, "heads": a.heads, "head_dim": a.head_dim, "margin": a.margin,
        "load_before": [round(x, 2) for x in os.getloadavg()], "grid": [], "block": [],
    }  # fmt: skip
    for name in a.dtypes:
        for m in a.key_lens:
            for n in a.seq_lens:
                cell = core_cell(DTYPES[name], a.batch, a.heads, a.head_dim, n, m, a)
                res["grid"].append({"dtype": name, "m": m, "n": n, **cell})
                print(json.dumps(res["grid"][-1]), flush=True)
    res["rule"] = rule(res["grid"], a.margin)
    res["block"] = block_rows(a) if a.block_lens else []
    res["load_after"] = [round(x, 2) for x in os.getloadavg()]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "results.md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
