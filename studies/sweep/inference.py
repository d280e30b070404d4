"""Inference timing: encoder forward time per sample of each variant at each N (the study's
``inference.md``)."""

import statistics
import time
from collections.abc import Sequence
from typing import Any


def time_inference(
    seq_lens: Sequence[int],
    variants: dict[str, dict[str, Any]],
    model: dict[str, Any],
    batch: int = 4,
    iters: int = 3,
    warmup: int = 1,
    dtype: str = "bf16",
    threads: int | None = None,
    stat: str = "min",
) -> list[dict[str, Any]]:
    """Encoder forward wall time per sample (ms) of each variant at each N, same batch/width.

    The variants alternate in the inner loop so that machine drift hits them alike; the
    fastest (``stat="min"``, robust on a shared machine) or the median of ``iters`` timed
    forwards is reported.
    """
    import torch

    from linformer_ds.model import LinformerEncoder, ModelConfig

    if threads:
        torch.set_num_threads(threads)
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    rows = []
    for n in seq_lens:
        models = {}
        for name, ov in variants.items():
            mc = ModelConfig(
                **{**model, **ov, "max_seq_len": n, "dropout": 0.0, "attention_dropout": 0.0}
            )
            torch.manual_seed(0)
            models[name] = LinformerEncoder(mc).to(dt).eval()
        gen = torch.Generator().manual_seed(n)
        ids = torch.randint(5, model["vocab_size"], (batch, n), generator=gen)
        times: dict[str, list[float]] = {name: [] for name in models}
        with torch.inference_mode():
            for it in range(warmup + iters):
                for name, m in models.items():
                    t0 = time.perf_counter()
                    m(ids)
                    if it >= warmup:
                        times[name].append(time.perf_counter() - t0)
        for name in models:
            med = min(times[name]) if stat == "min" else statistics.median(times[name])
            rows.append(
                {
                    "variant": name,
                    "seq_len": n,
                    "batch": batch,
                    "ms_per_sample": 1000 * med / batch,
                    "ms_per_batch": 1000 * med,
                }
            )
    return rows


def inference_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: N down, variants across, ms per sample (and the ratio to dense)."""
    names = list(dict.fromkeys(r["variant"] for r in rows))
    ns = sorted({r["seq_len"] for r in rows})
    get = {(r["variant"], r["seq_len"]): r["ms_per_sample"] for r in rows}
    head = "| N | " + " | ".join(f"{v} ms/sample" for v in names) + " |"
    out = [head, "|" + "---|" * (len(names) + 1)]
    for n in ns:
        cells = []
        for v in names:
            t = get[(v, n)]
            rel = f" ({get[('dense', n)] / t:.2f}x)" if "dense" in names and v != "dense" else ""
            cells.append(f"{t:.1f}{rel}")
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"
