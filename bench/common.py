"""What the benchmarks (``bench.model_bench``, ``bench.sp_bench``, ``bench.peer_bench``,
``bench.profile_step``) share: the benchmarked encoder (sizes -> ``ModelConfig``), its MLM batch,
the trainer's job config and DeepSpeed JSON for a run of it, option helpers, the record of the
machine and the results files."""

import argparse
import datetime
import json
import os
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from linformer_ds.config import JobConfig, from_dict
from linformer_ds.model import ModelConfig

SIZES = ("layers", "hidden", "heads", "k", "intermediate", "vocab")  # ModelSizes' int options


class BenchError(ValueError):
    """A benchmark option is invalid; the message names the option."""


@dataclass
class ModelSizes:
    """The benchmarked encoder's sizes (command-line options of the same names); each benchmark's
    config extends it with its own defaults."""

    layers: int = 2
    hidden: int = 768
    heads: int = 12
    k: int = 256
    intermediate: int = 3072
    vocab: int = 16000
    dropout: float = 0.1
    attention_dropout: float = 0.0

    def validate_sizes(self) -> None:
        """Raise BenchError naming the first bad size."""
        for name in SIZES:
            if getattr(self, name) < 1:
                raise BenchError(f"--{name}: must be >= 1, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise BenchError(f"--hidden {self.hidden} is not divisible by --heads {self.heads}")


# local + global variants (docs/long_context.md): a 128-token window (at most N) alone or beside
# k summaries
WINDOW = 128
WINDOWED = {"local": {"projection": "local"}, "local_linear": {"projection": "linear"}}
# the ModernBERT-like hybrid (Warner et al. 2024): dense attention every third layer (the first
# of each three), the 128-token window alone in the others
MODERN = "modern"


def _schedule(sizes: ModelSizes, variant: str) -> dict[str, Any]:
    if variant == MODERN:
        kinds = ["dense" if i % 3 == 0 else "local" for i in range(sizes.layers)]
        return {"layer_projections": kinds}
    return WINDOWED.get(variant, {"projection": variant})


def model_config(sizes: ModelSizes, variant: str, n: int) -> ModelConfig:
    """The benchmarked model: ``sizes``, ``variant``'s projection (hybrid: linear in the first
    half of the layers), layerwise sharing, ``max_seq_len = N``."""
    return ModelConfig(
        vocab_size=sizes.vocab,
        max_seq_len=n,
        hidden_size=sizes.hidden,
        num_layers=sizes.layers,
        num_heads=sizes.heads,
        intermediate_size=sizes.intermediate,
        dropout=sizes.dropout,
        attention_dropout=sizes.attention_dropout,
        hybrid_linear_layers=sizes.layers // 2 if variant == "hybrid" else 6,
        k=sizes.k,
        sharing="layerwise",
        **_schedule(sizes, variant),
        local_window=min(WINDOW, n - n % 2) if variant in (*WINDOWED, MODERN) else 0,
    )


def model_overrides(cfg: ModelConfig) -> list[str]:
    """``model.KEY=VALUE`` overrides that give ``launch/pretrain.py`` exactly this model."""
    return [f"model.{k}={v}" for k, v in asdict(cfg).items() if v is not None]


def job_config(
    model: ModelConfig, zero: int, precision: str, sp: int = 1, lr: float = 1e-4
) -> JobConfig:
    """The trainer's typed job config for one micro-batch of one row per data-parallel rank."""
    return from_dict(
        {
            "model": asdict(model),
            "optimizer": {"lr": lr},
            "train": {"micro_batch_size": 1, "gradient_accumulation_steps": 1},
            "deepspeed": {"precision": precision, "zero": {"stage": zero}},
            "parallel": {"sequence_parallel_size": sp},
        }
    )


def deepspeed_json(cfg: JobConfig, world_size: int) -> dict[str, Any]:
    """The JSON the trainer hands to ``deepspeed.initialize`` for ``cfg`` on ``world_size``
    ranks (gradient clipping, fp32 accumulation, overflow checks: the trainer's own function)."""
    from linformer_ds.engine import final_deepspeed_config

    return final_deepspeed_config(cfg, world_size)


def mlm_batch(
    vocab: int, batch: int, n: int, mlm_fraction: float, seed: int
) -> dict[str, torch.Tensor]:
    """``[batch, N]`` random non-special tokens with ``mlm_fraction`` of each row's positions
    labelled (at least one); ``labels`` is -100 elsewhere."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (batch, n), generator=g)
    labels = torch.full_like(ids, -100)
    n_mask = max(1, round(mlm_fraction * n))
    for b in range(batch):
        pos = torch.randperm(n, generator=g)[:n_mask]
        labels[b, pos] = ids[b, pos]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def add_size_options(p: argparse.ArgumentParser, defaults: Any, *more: str) -> None:
    """``--layers`` ... ``--vocab`` (:data:`SIZES`), then the int options ``more``, each with
    its default from ``defaults`` (the benchmark's config)."""
    for name in SIZES + more:
        p.add_argument(f"--{name}", type=int, default=getattr(defaults, name))


def parse_max_n(items: Sequence[str]) -> dict[str, int]:
    """``--max-n dense=8192 ...`` -> ``{"dense": 8192}``."""
    out = {}
    for item in items:
        v, sep, n = item.partition("=")
        if not sep or not n.isdigit():
            raise BenchError(f"--max-n: expected VARIANT=N (e.g. dense=8192), got {item!r}")
        out[v] = int(n)
    return out


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def environment(module: str, device: torch.device | None = None) -> dict[str, Any]:
    """Machine, load and versions, for the record; ``module`` names the benchmark run."""
    env: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "mem_total_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "torch_threads": torch.get_num_threads(),
        "load_avg_start": os.getloadavg(),
        "command": " ".join([Path(sys.executable).name, "-m", module] + sys.argv[1:]),
    }
    try:
        import deepspeed

        env["deepspeed"] = deepspeed.__version__
    except Exception:  # noqa: BLE001 - optional, and its import can fail in many ways
        env["deepspeed"] = None
    if device is not None:
        env["device"] = str(device)
        if device.type == "cuda":
            env["gpu"] = torch.cuda.get_device_name(device)
            env["cuda"] = torch.version.cuda
    return env


def write_results(
    results: dict[str, Any], out: Path, markdown: Callable[[dict[str, Any]], str]
) -> list[Path]:
    """Write ``out/results.json`` (the results, indented) and ``out/results.md``
    (``markdown(results)``); their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "results.md"]
    paths[0].write_text(json.dumps(results, indent=1) + "\n")
    paths[1].write_text(markdown(results))
    return paths
