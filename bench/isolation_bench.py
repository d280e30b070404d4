"""Training-step time of document isolation (issue 29) against today's packed step.

``python -m bench.isolation_bench`` builds rows of N tokens holding ``--docs`` documents each
(cut points drawn uniformly with a fixed seed, so lengths vary) and times one MLM training step
(forward, backward, AdamW) of each variant twice, alternating: packed as today (no
``position_ids``: one document per row as far as the model knows) and isolated (``position_ids``
restarting per document, as ``data.document_isolation`` trains). A row's time is the best of
its timed steps (load from other work only adds time). The ratio isolated / packed is the cost
of isolation; the goal is <= 1.10 at N = 4096 with ~8 documents per row.

Full size (the BENCHMARKS.md row; run it alone, on a GPU)::

    python -m bench.isolation_bench --seq-len 4096 --docs 8 --batch 4 --layers 12 \\
        --variants linear hybrid dense --precision bf16 --out bench_out/isolation

Writes ``results.json`` and ``results.md`` to ``--out``.
"""

import argparse
import contextlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.common import BenchError, ModelSizes, environment, mlm_batch, model_config
from linformer_ds.model import LinformerForMaskedLMPretraining, labelled_positions

VARIANTS = ("linear", "conv", "hybrid", "dense")


@dataclass
class IsolationBenchConfig(ModelSizes):
    """Everything one run depends on (stored in results.json)."""

    seq_len: int = 4096
    docs: int = 8  # documents per row
    batch: int = 4
    layers: int = 12
    variants: list[str] = field(default_factory=lambda: ["linear", "hybrid", "dense"])
    precision: str = "bf16"  # bf16 weights (as the GPU runs train) or fp32
    warmup: int = 2
    iters: int = 5
    mlm_fraction: float = 0.15
    device: str = "auto"
    seed: int = 0
    out: str = "bench_out/isolation"
    per_span: str = "auto"  # LinformerEncoder.document_per_span: auto (None), true, false

    def validate(self) -> None:
        self.validate_sizes()
        if self.docs < 1 or self.docs > self.seq_len:
            raise BenchError(f"--docs: must be in [1, --seq-len], got {self.docs}")
        for v in self.variants:
            if v not in VARIANTS:
                raise BenchError(f"--variants: {v!r} is not one of {VARIANTS}")
        if self.precision not in ("bf16", "fp32"):
            raise BenchError(f"--precision: bf16 or fp32, got {self.precision!r}")
        if self.iters < 1 or self.warmup < 0:
            raise BenchError("--iters must be >= 1 and --warmup >= 0")


def document_position_ids(batch: int, n: int, docs: int, seed: int) -> torch.Tensor:
    """``[batch, n]`` position ids of rows cut into ``docs`` documents at uniformly drawn
    points (each row its own), each counting from 0."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.empty(batch, n, dtype=torch.long)
    for r in range(batch):
        cuts = torch.randperm(n - 1, generator=g)[: docs - 1].add(1).sort().values.tolist()
        bounds = [0] + cuts + [n]
        pos[r] = torch.cat([torch.arange(e - s) for s, e in zip(bounds[:-1], bounds[1:])])
    return pos


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class Stepper:
    """One model + AdamW + a fixed packed batch; ``step(isolated)`` runs one training step."""

    def __init__(self, bc: IsolationBenchConfig, variant: str, device: torch.device):
        n = bc.seq_len
        torch.manual_seed(bc.seed)
        self.model = LinformerForMaskedLMPretraining(model_config(bc, variant, n)).to(device)
        if bc.precision == "bf16":
            self.model.to(torch.bfloat16)
        self.model.encoder.check_token_ids = False  # as the trainer runs it
        self.model.encoder.document_per_span = {"auto": None, "true": True, "false": False}[
            bc.per_span
        ]
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, foreach=True)
        rows = mlm_batch(bc.vocab, bc.batch, n, bc.mlm_fraction, seed=bc.seed + n)
        self.ids, self.labels = rows["input_ids"].to(device), rows["labels"].to(device)
        self.mask = rows["attention_mask"].to(device)
        self.index = labelled_positions(rows["labels"]).to(device)
        self.position_ids = document_position_ids(bc.batch, n, bc.docs, bc.seed).to(device)
        self.device = device

    def step(self, isolated: bool) -> float:
        """Seconds of one forward + backward + AdamW step (device synchronised)."""
        extra = {"position_ids": self.position_ids} if isolated else {}
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        c0, t0 = time.process_time(), time.perf_counter()
        loss = self.model(
            self.ids, self.mask, labels=self.labels, labelled_index=self.index, **extra
        ).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        float(loss.detach())  # synchronises the device
        self.last_cpu = time.process_time() - c0  # this process's CPU seconds (all threads)
        return time.perf_counter() - t0


def run(bc: IsolationBenchConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    bc.validate()
    device = _device(bc.device)
    rows = []
    for variant in bc.variants:
        stepper = Stepper(bc, variant, device)
        times: dict[bool, list[float]] = {False: [], True: []}
        cpu: dict[bool, list[float]] = {False: [], True: []}
        for i in range(bc.warmup + bc.iters):
            for isolated in (False, True):  # alternating: drift hits both alike
                t = stepper.step(isolated)
                if i >= bc.warmup:
                    times[isolated].append(t)
                    cpu[isolated].append(stepper.last_cpu)
        packed, iso = min(times[False]), min(times[True])
        # CPU time: less sensitive than wall time to other work on a shared machine
        packed_cpu, iso_cpu = min(cpu[False]), min(cpu[True])
        row = {
            "variant": variant, "seq_len": bc.seq_len, "batch": bc.batch, "docs": bc.docs,
            "packed_ms": 1e3 * packed, "isolated_ms": 1e3 * iso, "ratio": iso / packed,
            "packed_cpu_ms": 1e3 * packed_cpu, "isolated_cpu_ms": 1e3 * iso_cpu,
            "cpu_ratio": iso_cpu / packed_cpu,
        }  # fmt: skip
        log(f"{variant}: packed {row['packed_ms']:.1f} ms, isolated {row['isolated_ms']:.1f} ms,"
            f" ratio {row['ratio']:.3f} (CPU time ratio {row['cpu_ratio']:.3f})")  # fmt: skip
        rows.append(row)
        del stepper
    return {"config": asdict(bc), "environment": environment("bench.isolation_bench", device),
            "rows": rows}  # fmt: skip


def markdown_table(results: dict[str, Any]) -> str:
    lines = [
        "| variant | N | batch | docs/row | packed step (ms) | isolated step (ms) | ratio "
        "| CPU-time ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        lines.append(
            f"| {r['variant']} | {r['seq_len']} | {r['batch']} | {r['docs']} | "
            f"{r['packed_ms']:.1f} | {r['isolated_ms']:.1f} | {r['ratio']:.3f} | "
            f"{r['cpu_ratio']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> IsolationBenchConfig:
    d = IsolationBenchConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name in ("seq_len", "docs", "batch", "layers", "hidden", "heads", "k", "intermediate",
                 "vocab", "warmup", "iters", "seed"):  # fmt: skip
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    p.add_argument("--variants", nargs="+", default=d.variants)
    p.add_argument("--precision", default=d.precision)
    p.add_argument("--device", default=d.device)
    p.add_argument("--dropout", type=float, default=d.dropout)
    p.add_argument("--out", default=d.out)
    p.add_argument(
        "--per-span",
        default=d.per_span,
        choices=["auto", "true", "false"],
        help="document isolation path (LinformerEncoder.document_per_span)",
    )
    a = p.parse_args(argv)
    return IsolationBenchConfig(**{k: v for k, v in vars(a).items()})


def main(argv: Sequence[str] | None = None) -> int:
    try:
        bc = parse_args(argv)
        results = run(bc)
    except BenchError as e:
        print(f"error: {e}")
        return 2
    out = Path(bc.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(markdown_table(results))
    print(markdown_table(results))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main())
