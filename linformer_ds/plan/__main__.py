"""``python -m linformer_ds.plan --config CONFIG [--gpus G] [--gpu-memory GiB] [--tflops T]
[--seq-len N] [key=value ...]``: the plan of the config's own layout (per-rank memory by part,
FLOPs, step time, collective bytes, the largest N that fits), then every layout of G GPUs that
fits, ranked by predicted tokens/s. ``--markdown N1,N2 --gpus G1,G2``: docs/cluster.md's table."""

import argparse
import sys

from ..config import ConfigError, load_config
from .core import GiB, Hardware, Layout, candidate_layouts, largest_seq_len, plan_layout


def _mib(x: float) -> str:
    return f"{x / 2**20:,.0f} MiB"


def _gib(x: float) -> str:
    return f"{x / GiB:,.1f}"


def describe(plan: dict) -> str:
    """The lines ``python -m linformer_ds.plan`` prints for one plan."""
    lay = plan["layout"]
    out = [f"layout: {lay.text()} N={lay.seq_len:,} (accumulation {lay.accumulation})"]
    out.append(f"  per-rank peak {_gib(plan['peak'])} GiB"
               + (f" (+ {_gib(plan['cpu'])} GiB offloaded to the CPU)" if plan["cpu"] else ""))  # fmt: skip
    for part, v in plan["memory"].items():
        out.append(f"    {part:12s} {_mib(v):>14s}")
    for kind, v in plan["per_layer"].items():
        out.append(f"    activations per {kind} layer (kept for backward): {_mib(v)}")
    c = plan["collectives"]
    out.append(f"  FLOPs/token {plan['flops_per_token']:.3g}, per step {plan['step_flops']:.3g}; "
               f"step {plan['step_s']:.3f} s (compute {plan['compute_s']:.3f} s); "
               f"{plan['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU")  # fmt: skip
    out.append("  bytes per step per rank: " + ", ".join(f"{k} {_mib(v)}" for k, v in c.items()))
    return "\n".join(out)


def markdown(job, seq_lens: list, gpus: list, hw: Hardware, name: str) -> str:  # noqa: ANN001
    """One row per (N, G): the best layout, its memory per rank, step time, tokens/s per GPU,
    and the best layout without sequence parallelism beside it (its tokens/s as a share of
    the best: where SP beats more ZeRO and checkpointing, the share is below 1)."""
    rows = [
        f"| {name} N | GPUs | layout (best) | GiB/rank | step s | tokens/s/GPU | "
        "best with P = 1 | P = 1 / best |",
        "|---:|---:|---|---:|---:|---:|---|---:|",
    ]
    for n in seq_lens:
        for g in gpus:
            plans = candidate_layouts(job, g, n, hw)
            if not plans:
                rows.append(f"| {n:,} | {g} | nothing fits | | | | | |")
                continue
            best = plans[0]
            flat = next((p for p in plans if p["layout"].sp == 1), None)
            other, share = "does not fit", "0"
            if flat is not None:
                other = f"{flat['layout'].text()}: {_gib(flat['peak'])} GiB"
                share = f"{flat['tokens_per_s_per_gpu'] / best['tokens_per_s_per_gpu']:.2f}"
            rows.append(
                f"| {n:,} | {g} | {best['layout'].text()} | {_gib(best['peak'])} | "
                f"{best['step_s']:.3f} | {best['tokens_per_s_per_gpu']:,.0f} | {other} | {share} |"
            )
    return "\n".join(rows)


def main(argv: list | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m linformer_ds.plan", description=__doc__)
    p.add_argument("--config", required=True)
    p.add_argument("--gpus", default="8", help="GPUs (a comma list with --markdown)")
    p.add_argument("--gpu-memory", type=float, default=80.0, help="GiB per GPU")
    p.add_argument("--tflops", type=float, default=400.0,
                   help="sustained TFLOP/s per GPU (MFU x peak)")  # fmt: skip
    p.add_argument("--seq-len", type=int, default=None, help="N (default: model.max_seq_len)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--top", type=int, default=10, help="ranked layouts shown")
    p.add_argument("--markdown", default=None, help="N1,N2,...: the table of docs/cluster.md")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = p.parse_args(argv)
    try:
        job = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    hw = Hardware(memory=args.gpu_memory * GiB, tflops=args.tflops, device=args.device)
    gpus = [int(g) for g in args.gpus.split(",")]
    if args.markdown:
        lens = [int(n) for n in args.markdown.split(",")]
        print(markdown(job, lens, gpus, hw, job.name))
        return 0
    g = gpus[0]
    n = args.seq_len or job.model.max_seq_len
    sp = job.parallel.sequence_parallel_size
    own = Layout(g, sp, job.deepspeed.zero.stage,
                 (job.deepspeed.activation_checkpointing.granularity
                  if job.deepspeed.activation_checkpointing.enabled else None),
                 job.train.micro_batch_size, n, job.train.gradient_accumulation_steps)  # fmt: skip
    plan = plan_layout(job, own, hw)
    print(f"{job.name}: {plan['parameters']:,} parameters, {g} GPUs of {args.gpu_memory:g} GiB, "
          f"{args.tflops:g} TFLOP/s sustained per GPU")  # fmt: skip
    print(describe(plan) + ("" if plan["fits"] else "\n  DOES NOT FIT"))
    print(f"  largest N that fits this layout: {largest_seq_len(job, own, hw):,}")
    plans = candidate_layouts(job, g, n, hw)
    print(f"layouts of {g} GPUs that fit at N={n:,}, by predicted tokens/s per GPU:")
    for q in plans[: args.top]:
        print(f"  {q['layout'].text():40s} {_gib(q['peak']):>7s} GiB  {q['step_s']:.3f} s/step"
              f"  {q['tokens_per_s_per_gpu']:>10,.0f} tokens/s/GPU")  # fmt: skip
    return 0


if __name__ == "__main__":
    from linformer_ds import entry

    entry.run(main)
