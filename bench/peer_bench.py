"""Our Linformer against lucidrains' ``linformer`` package at equal work, the trainer's path beside.

``python -m bench.peer_bench`` times one training step (forward, backward, AdamW) of

* ``ours``: :class:`LinformerForMaskedLM`, logits for every position ``[B, N, V]``;
* ``lucidrains``: the same model with lucidrains' ``Linformer`` (pip ``linformer``) as the
  encoder body: the same embeddings (token + position, LayerNorm), the same final LayerNorm and
  the same MLM head (our :class:`MLMHead`, decoder tied to the token embeddings), full logits;
* ``ours-trainer``: :class:`LinformerForMaskedLMPretraining`, the head on the labelled positions
  only (what ``linformer_ds.train`` runs).

Equal work: same layers, width, heads, k, FFN size (lucidrains' is ``4 x hidden``), vocabulary;
pre-LN blocks; the same sharing: one E and one F per layer for all heads (our ``headwise``,
lucidrains' default ``share_kv=False``; their ``share_kv=True`` also drops the value projection
``to_v``, less work than our ``kv``, so it is not offered); keys and values per head (their
``one_kv_head=False``); no dropout in either (lucidrains drops attention
probabilities and FFN activations, we drop residual branches: ``p = 0`` makes them the same
work); the same loss (mean cross-entropy of the labelled 15 %, from full logits) and the same
optimizer step. The only parameters that differ are our q/k/v biases (``3 x hidden`` per
layer; lucidrains' ``to_q/to_k/to_v`` have none); the matrix-multiply FLOPs are the same.

Precision ``bf16`` (default): bf16 parameters with fp32 master weights updated by AdamW
(DeepSpeed's bf16 mode, :class:`bench.model_bench.MasterWeightAdamW`); ``autocast``: fp32
parameters under bf16 autocast; ``fp32``. The models' timed steps alternate within each round
(the order rotates every round), so machine drift hits all of them alike; a model's step time is
the median of its timed steps, and ``speedup`` is the median of the per-round ratios
lucidrains / ours. Model FLOPs come from ``flops_per_token`` in ``linformer_ds/model.py``; MFU is
against the best GEMM rate measured in the run's own precision (bf16 for bf16 and autocast,
fp32 for fp32), before and after the timed steps.

Writes ``results.json`` and ``results.md`` to ``--out``.
"""

import argparse
import contextlib
import json
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from bench.common import BenchError, ModelSizes, environment, mlm_batch
from bench.model_bench import ADAMW, MasterWeightAdamW, _adamw, resolve_device
from linformer_ds.model import (
    LinformerForMaskedLM,
    LinformerForMaskedLMPretraining,
    MLMHead,
    ModelConfig,
    flops_per_token,
    init_weights,
)
from linformer_ds.perf import measure_matmul_peak_tflops, time_call

MODELS = ("ours", "lucidrains", "ours-trainer")
PRECISIONS = ("bf16", "autocast", "fp32")


@dataclass
class PeerConfig(ModelSizes):
    """Everything one run depends on (stored in results.json)."""

    seq_lens: List[int] = field(default_factory=lambda: [4096, 16384])
    models: List[str] = field(default_factory=lambda: list(MODELS))
    dropout: float = 0.0
    batch: int = 1
    warmup: int = 1
    iters: int = 5
    precision: str = "bf16"
    mlm_fraction: float = 0.15
    device: str = "auto"
    gemm_n: int = 4096
    gemm_budget_s: float = 20.0
    seed: int = 0
    out: str = "bench/results/peer"

    def validate(self) -> None:
        """Raise BenchError naming the first bad option."""
        self.validate_sizes()
        if self.intermediate != 4 * self.hidden:
            raise BenchError(
                f"--intermediate {self.intermediate}: lucidrains' FFN is 4 x hidden = "
                f"{4 * self.hidden}; give that for equal work"
            )
        if self.dropout != 0.0 or self.attention_dropout != 0.0:
            raise BenchError("dropout: the two models drop different tensors; equal work is p=0")
        if not self.models or any(m not in MODELS for m in self.models):
            raise BenchError(f"--models: choose one or more of {MODELS}, got {self.models}")
        if not self.seq_lens or any(n < self.k for n in self.seq_lens):
            raise BenchError(f"--seq-lens: give lengths >= k={self.k}, got {self.seq_lens}")
        for name in ("batch", "iters"):
            if getattr(self, name) < 1:
                raise BenchError(f"--{name}: must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise BenchError(f"--warmup: must be >= 0, got {self.warmup}")
        if self.precision not in PRECISIONS:
            raise BenchError(f"--precision: must be one of {PRECISIONS}, got {self.precision!r}")
        if not 0.0 < self.mlm_fraction <= 1.0:
            raise BenchError(f"--mlm-fraction: must be in (0, 1], got {self.mlm_fraction}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise BenchError(f"--device: must be auto, cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise BenchError("--device cuda: torch.cuda.is_available() is False")


def our_config(pc: PeerConfig, n: int) -> ModelConfig:
    """Our model at ``pc``'s sizes: linear projection in every layer, pre-LN, no dropout."""
    return ModelConfig(
        vocab_size=pc.vocab,
        max_seq_len=n,
        hidden_size=pc.hidden,
        num_layers=pc.layers,
        num_heads=pc.heads,
        intermediate_size=pc.intermediate,
        dropout=0.0,
        attention_dropout=0.0,
        projection="linear",
        k=pc.k,
        sharing="headwise",
    )


# ==================================================================================== the peer
class LucidrainsMLM(nn.Module):
    """lucidrains' ``Linformer`` body between our embeddings and our MLM head (equal work).

    ``forward(input_ids [B, n]) -> logits [B, n, V]``. Their ``LinformerLM`` has no embedding or
    final LayerNorm and a bare untied decoder; those are ours here so that both models do the
    same work outside the attention blocks too.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        from linformer import Linformer

        if config.sharing != "headwise":
            raise ValueError(f"equal work needs sharing='headwise', got {config.sharing!r}")
        d = config.hidden_size
        self.token_embeddings = nn.Embedding(config.vocab_size, d)
        self.position_embeddings = nn.Embedding(config.max_seq_len, d)
        self.embed_ln = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.apply(lambda m: init_weights(m, config.initializer_range))
        self.body = Linformer(
            dim=d,
            seq_len=config.max_seq_len,
            depth=config.num_layers,
            k=config.k,
            heads=config.num_heads,
            one_kv_head=False,
            share_kv=False,
            dropout=0.0,
        )
        self.final_ln = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.lm_head = MLMHead(config)
        init_weights(self.lm_head.dense, config.initializer_range)
        self.lm_head.decoder.weight = self.token_embeddings.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embed_ln(self.token_embeddings(input_ids) + self.position_embeddings(pos)[None])
        return self.lm_head(self.final_ln(self.body(x)))


def full_logits_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the labelled positions from full ``[B, n, V]`` logits (our
    ``mlm_loss``, written out so that both models share it)."""
    return F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100
    )


def build(name: str, config: ModelConfig) -> nn.Module:
    """The model ``name`` (one of MODELS) at ``config``, in training mode."""
    if name == "ours":
        return LinformerForMaskedLM(config).train()
    if name == "ours-trainer":
        return LinformerForMaskedLMPretraining(config).train()
    return LucidrainsMLM(config).train()


def loss_of(name: str, model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The training loss of ``model``: full logits for ours and lucidrains, the trainer's
    labelled-only head for ours-trainer."""
    if name == "ours-trainer":
        return model(ids, labels=labels).loss
    logits = model(ids).logits if name == "ours" else model(ids)
    return full_logits_loss(logits, labels)


def unique_parameters(model: nn.Module) -> int:
    """Elements of the distinct parameters (a tied one counts once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


class Runner:
    """One model + optimizer + a fixed batch; ``step()`` is one training step."""

    def __init__(self, name: str, pc: PeerConfig, n: int, device: torch.device):
        self.name, self.config = name, our_config(pc, n)
        torch.manual_seed(pc.seed)
        self.model = build(name, self.config).to(device)
        params = list(self.model.parameters())
        self.autocast: Callable[[], Any] = contextlib.nullcontext
        if pc.precision == "bf16":
            self.model.to(torch.bfloat16)
            self.opt: Any = MasterWeightAdamW(params, **ADAMW)
        else:
            self.opt = _adamw(params, **ADAMW)
            if pc.precision == "autocast":
                self.autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16)
        rows = mlm_batch(pc.vocab, pc.batch, n, pc.mlm_fraction, seed=pc.seed + n)
        self.ids, self.labels = rows["input_ids"].to(device), rows["labels"].to(device)
        labelled = int((rows["labels"] != -100).sum()) / rows["labels"].numel()
        self.tokens = pc.batch * n
        # both full-logit models run the head on every position; the trainer on the labelled
        self.flops_per_token = flops_per_token(
            self.config, n, labelled if name == "ours-trainer" else 1.0
        )

    def step(self) -> float:
        with self.autocast():
            loss = loss_of(self.name, self.model, self.ids, self.labels)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())


# ========================================================================================== run
def gemm_peak(pc: PeerConfig, device: torch.device) -> float:
    """FLOP/s of the best square GEMM in the run's own precision."""
    dtype = torch.float32 if pc.precision == "fp32" else torch.bfloat16
    return measure_matmul_peak_tflops(dtype, device, pc.gemm_n, budget_s=pc.gemm_budget_s) * 1e12


def interleaved_times(
    runners: Sequence[Runner], warmup: int, iters: int, device: torch.device
) -> Dict[str, List[float]]:
    """Seconds per step of each runner: ``warmup + iters`` rounds, one step of each runner per
    round, the order rotated every round (ABC, BCA, CAB, ...); warm-up rounds are dropped."""
    times: Dict[str, List[float]] = {r.name: [] for r in runners}
    for rnd in range(warmup + iters):
        order = [runners[(rnd + j) % len(runners)] for j in range(len(runners))]
        for r in order:
            t = time_call(r.step, device)
            if rnd >= warmup:
                times[r.name].append(t)
    return times


def run_benchmark(pc: PeerConfig, log: Callable[[str], None] = print) -> Dict[str, Any]:
    """Every N: build the models, time them interleaved; returns the results dict."""
    pc.validate()
    device = resolve_device(pc.device)
    log(f"device {device}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    peaks = [gemm_peak(pc, device)]
    log(f"GEMM peak ({pc.precision}): {peaks[0] / 1e12:.3f} TFLOP/s")
    rows: List[Dict[str, Any]] = []
    for n in pc.seq_lens:
        runners = [Runner(m, pc, n, device) for m in pc.models]
        times = interleaved_times(runners, pc.warmup, pc.iters, device)
        for r in runners:
            ts = times[r.name]
            step = statistics.median(ts)
            row = {
                "n": n,
                "model": r.name,
                "params": unique_parameters(r.model),
                "step_s_median": step,
                "step_s_min": min(ts),
                "step_s_all": ts,
                "tokens_per_s": r.tokens / step,
                "flops_per_token": r.flops_per_token,
                "model_tflops": r.flops_per_token * r.tokens / step / 1e12,
            }
            if "lucidrains" in times and r.name != "lucidrains":
                ratios = [a / b for a, b in zip(times["lucidrains"], ts)]
                row["speedup_vs_lucidrains"] = statistics.median(ratios)
                row["speedup_per_round"] = ratios
            rows.append(row)
            log(
                f"N={n:>6} {r.name:<13} {step:8.3f} s (min {min(ts):.3f}) "
                f"{row['model_tflops']:.3f} TFLOP/s"
                + (
                    f" x{row['speedup_vs_lucidrains']:.3f}"
                    if "speedup_vs_lucidrains" in row
                    else ""
                )
            )
        del runners
    peaks.append(gemm_peak(pc, device))
    peak = max(peaks)
    for row in rows:
        row["mfu"] = row["model_tflops"] * 1e12 / peak
    env = environment("bench.peer_bench", device)
    env["load_avg_end"] = os.getloadavg()
    import linformer

    env["linformer"] = getattr(linformer, "__version__", _dist_version("linformer"))
    return {
        "config": asdict(pc),
        "environment": env,
        "gemm_peak_flops": peak,
        "gemm_flops_all": peaks,
        "gemm_dtype": "float32" if pc.precision == "fp32" else "bfloat16",
        "rows": rows,
    }


def _dist_version(name: str) -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def markdown_table(results: Dict[str, Any]) -> str:
    c, env = results["config"], results["environment"]
    lines = [
        f"{c['layers']} layers, d={c['hidden']}, {c['heads']} heads, k={c['k']}, "
        f"FFN {c['intermediate']}, V={c['vocab']}, headwise E/F, {c['precision']}, "
        f"batch {c['batch']}; {env.get('gpu') or env['cpu']}, torch {env['torch']}, "
        f"linformer {env.get('linformer')}; median of {c['iters']} interleaved steps "
        f"(fwd + bwd + AdamW); GEMM peak {results['gemm_peak_flops'] / 1e12:.2f} TFLOP/s "
        f"({results['gemm_dtype']})",
        "",
        "| N | model | step (s) | min (s) | tokens/s | TFLOP/s | MFU | vs lucidrains |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["rows"]:
        sp = r.get("speedup_vs_lucidrains")
        lines.append(
            f"| {r['n']} | {r['model']} | {r['step_s_median']:.3f} | {r['step_s_min']:.3f} | "
            f"{r['tokens_per_s']:.0f} | {r['model_tflops']:.3f} | {r['mfu'] * 100:.1f} % | "
            + (f"{sp:.3f}x |" if sp is not None else "- |")
        )
    return "\n".join(lines) + "\n"


def write_outputs(results: Dict[str, Any], out: Path) -> List[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "results.md"]
    paths[0].write_text(json.dumps(results, indent=1) + "\n")
    paths[1].write_text(markdown_table(results))
    return paths


# ========================================================================================== CLI
def parse_args(argv: Optional[Sequence[str]] = None) -> PeerConfig:
    d = PeerConfig()
    p = argparse.ArgumentParser(
        prog="python -m bench.peer_bench", description=__doc__.split("\n")[0]
    )
    p.add_argument("--seq-lens", type=int, nargs="+", default=d.seq_lens)
    p.add_argument("--models", nargs="+", default=d.models, help=f"some of {MODELS}")
    for name in ("layers", "hidden", "heads", "k", "intermediate", "vocab", "batch"):
        p.add_argument(f"--{name}", type=int, default=getattr(d, name))
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--iters", type=int, default=d.iters, help="timed rounds")
    p.add_argument("--precision", default=d.precision, help=f"one of {PRECISIONS}")
    p.add_argument("--mlm-fraction", type=float, default=d.mlm_fraction)
    p.add_argument("--device", default=d.device, help="auto, cpu or cuda")
    p.add_argument("--gemm-n", type=int, default=d.gemm_n)
    p.add_argument("--gemm-budget-s", type=float, default=d.gemm_budget_s)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", default=d.out)
    pc = PeerConfig(**vars(p.parse_args(argv)))
    pc.validate()
    return pc


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``python -m bench.peer_bench``."""
    try:
        pc = parse_args(argv)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        import linformer  # noqa: F401
    except ImportError:
        print(
            "error: lucidrains' linformer is not installed: pip install -e '.[bench]'",
            file=sys.stderr,
        )
        return 2
    results = run_benchmark(pc)
    for path in write_outputs(results, Path(pc.out)):
        print(f"wrote {path}")
    print(markdown_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
