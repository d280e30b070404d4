"""Training metrics: the per-interval window (loss, MLM accuracy), throughput and MFU, and the
sinks (console ``[train]`` lines, ``metrics.jsonl``, TensorBoard) on rank 0.

The window's sums travel in checkpoints (:meth:`Metrics.state_dict`), so the first record after
a resume averages the same steps as an uninterrupted run would.
"""

import json
import math
import os
from typing import Any, Dict, Optional

import torch

from linformer_ds.config import JobConfig, to_dict

# Per-step statistics the loop accumulates (float64): sum of loss x labelled tokens, correct
# predictions, labelled tokens, non-finite micro-batches.
STAT_LOSS, STAT_CORRECT, STAT_COUNT, STAT_NONFINITE = range(4)


def step_stats(loss: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``[4]`` float64 statistics of one micro-batch (see ``STAT_*``)."""
    with torch.no_grad():
        n = targets.numel()
        value = float(loss.detach().float())
        finite = math.isfinite(value)
        correct = (logits.argmax(-1) == targets).sum().item()
        return torch.tensor(
            [value * n if finite else 0.0, correct, n, 0.0 if finite else 1.0], dtype=torch.float64
        )


class MetricsLogger:
    """Console + TensorBoard + ``metrics.jsonl`` on rank 0 (other ranks write nothing)."""

    def __init__(self, cfg: JobConfig, rank: int):
        self.rank = rank
        self.tb = None
        self.jsonl = None
        if rank != 0:
            return
        os.makedirs(cfg.logging.dir, exist_ok=True)
        self.jsonl = open(os.path.join(cfg.logging.dir, "metrics.jsonl"), "a")
        with open(os.path.join(cfg.logging.dir, "config.json"), "w") as f:
            json.dump(to_dict(cfg), f, indent=2)
        if cfg.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(cfg.logging.dir, "tensorboard"))

    def scalars(self, step: int, values: Dict[str, float], prefix: str = "train") -> None:
        if self.rank != 0:
            return
        shown = " ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items()
        )
        print(f"[{prefix}] step {step} {shown}", flush=True)
        assert self.jsonl is not None
        self.jsonl.write(json.dumps({"step": step, "split": prefix, **values}) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(f"{prefix}/{k}", v, step)
            self.tb.flush()

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()


class Metrics:
    """The trainer's metrics component: accumulate steps, log every ``train.log_interval``.

    ``flops_per_token`` and ``tokens_per_step`` give throughput and MFU against
    ``peak_tflops`` (per rank; measured at start when the config leaves it unset).
    """

    def __init__(
        self,
        cfg: JobConfig,
        rank: int,
        world_size: int,
        device: torch.device,
        flops_per_token: float,
        tokens_per_step: int,
    ):
        self.cfg, self.rank, self.world, self.device = cfg, rank, world_size, device
        self.flops_per_token = flops_per_token
        self.tokens_per_step = tokens_per_step
        self.peak_tflops = cfg.train.peak_tflops or self._measure_peak()
        self.logger = MetricsLogger(cfg, rank)
        self.window = torch.zeros(4, dtype=torch.float64)
        self.first_loss: Optional[float] = None
        self.last_loss: Optional[float] = None
        self._busy, self._steps_since = 0.0, 0

    def _measure_peak(self) -> float:
        from linformer_ds.perf import measure_matmul_peak_tflops

        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
            self.cfg.deepspeed.precision, torch.float32
        )
        size = 2048 if self.device.type == "cpu" else 8192
        return measure_matmul_peak_tflops(dtype, str(self.device), size=size, repeats=5)

    # ------------------------------------------------------------------------------ steps
    def step_done(self, step: int, stats: torch.Tensor, seconds: float) -> None:
        """Add an optimizer step's all-reduced statistics and its wall time (data included)."""
        self.window += stats
        self._busy += seconds
        loss = float(stats[STAT_LOSS] / max(stats[STAT_COUNT], 1))
        if self.first_loss is None:
            self.first_loss = loss
        self.last_loss = loss
        self._steps_since += 1

    def should_log(self, step: int) -> bool:
        return step % self.cfg.train.log_interval == 0 or step == self.cfg.train.max_steps

    def log_train(self, step: int, epoch: int, engine: Any) -> None:
        """One ``[train]`` record for the window that ends at ``step``; resets the window."""
        from linformer_ds.perf import peak_memory_bytes

        dt = self._busy
        tps = self._steps_since * self.tokens_per_step / max(dt, 1e-9)
        tflops = self.flops_per_token * tps / self.world / 1e12
        gn = engine.get_global_grad_norm()
        opt = engine.optimizer
        scale = getattr(opt, "cur_scale", None) or getattr(opt, "loss_scale", None) or 1.0
        w = self.window
        self.logger.scalars(
            step,
            {
                "loss": float(w[STAT_LOSS] / max(w[STAT_COUNT], 1)),
                "mlm_accuracy": float(w[STAT_CORRECT] / max(w[STAT_COUNT], 1)),
                "lr": engine.get_lr()[0],
                "grad_norm": float(gn) if gn is not None else float("nan"),
                "loss_scale": float(scale),
                "tokens_per_s": tps,
                "tflops_per_rank": tflops,
                "mfu": tflops / self.peak_tflops,
                "peak_mem_gb": peak_memory_bytes(str(self.device)) / 2**30,
                "epoch": epoch,
            },
        )
        self.window.zero_()
        self._busy, self._steps_since = 0.0, 0

    def log_eval(self, step: int, values: Dict[str, float]) -> None:
        self.logger.scalars(step, values, prefix="eval")

    # ------------------------------------------------------------------------------ state
    def state_dict(self) -> Dict[str, Any]:
        """The open window's sums: saved in checkpoints so logs after a resume are exact."""
        return {"window": [float(x) for x in self.window]}

    def load_state_dict(self, state: Optional[Dict[str, Any]]) -> None:
        if state and "window" in state:
            self.window = torch.tensor(state["window"], dtype=torch.float64)

    def close(self) -> None:
        self.logger.close()
