"""The trainer's step with two DeepSpeed optimizer settings, interleaved in one process.

    python -m bench.optimizer_ab [--seq-len 4096] [--rounds 3] [--a ''] [--b optimizer.params.fused=true]

Builds :class:`bench.profile_step.TrainerStep` twice (the same seed, model, batch; ``--a`` and
``--b`` are ``--ds-extra`` lists, whitespace-separated), then alternates their steps (AB, BA,
...) after one warm-up step each; prints and writes (``--out``) each one's median step and
optimizer-phase seconds and the median per-round ratio A / B, with the load average.
"""

import argparse
import json
import os
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import environment
from bench.profile_step import ProfileConfig, TrainerStep, run_step


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m bench.optimizer_ab``."""
    p = argparse.ArgumentParser(prog="python -m bench.optimizer_ab", description=__doc__)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--a", default="", help="--ds-extra of A (default: the trainer's JSON)")
    p.add_argument("--b", default="optimizer.params.fused=true", help="--ds-extra of B")
    p.add_argument("--beside", default="")
    p.add_argument("--out", default="bench/results/optimizer_ab")
    args = p.parse_args(argv)
    env = environment("bench.optimizer_ab")
    env["beside"] = args.beside
    steps = {}
    for name, extra in (("A", args.a), ("B", args.b)):
        pc = ProfileConfig(ds_extra=extra.split())
        pc.validate()
        steps[name] = TrainerStep(pc, args.seq_len)
        run_step(steps[name], lambda _: _null())  # warm-up
    walls: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
    for rnd in range(args.rounds):
        for name in "AB" if rnd % 2 == 0 else "BA":
            walls[name].append(run_step(steps[name], lambda _: _null()))
            print(f"round {rnd} {name}: {walls[name][-1]}", flush=True)
    env["load_avg_end"] = os.getloadavg()
    res: dict[str, Any] = {"args": vars(args), "environment": env, "walls": walls}
    for name in "AB":
        for key in ("total", "optimizer"):
            res[f"{name}_{key}_s_median"] = statistics.median(w[key] for w in walls[name])
        res[f"{name}_optimizer_class"] = steps[name].inner_defaults
    res["ratio_total_A_over_B"] = statistics.median(
        a["total"] / b["total"] for a, b in zip(walls["A"], walls["B"])
    )
    res["ratio_optimizer_A_over_B"] = statistics.median(
        a["optimizer"] / b["optimizer"] for a, b in zip(walls["A"], walls["B"])
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k not in ("walls", "environment")}, indent=1))
    return 0


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


if __name__ == "__main__":
    sys.exit(main())
