"""Render the GPU check's results (scripts/gpu_check.py) as a markdown section for BENCHMARKS.md.

    python scripts/gpu_report.py OUT_DIR [--out FILE]

Reads OUT_DIR/results.json; writes the markdown to FILE (default: standard output). Needs only
the standard library, so the results of a GPU run can be rendered anywhere.
"""

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any


def _f(x: Any, spec: str = ".3g", none: str = "-") -> str:
    if x is None:
        return none
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return format(x, spec)


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**20:,.0f} MiB"


def header(r: dict[str, Any]) -> list[str]:
    env = r.get("environment", {})
    imports = env.get("imports", {})
    ver = {k: v.split(maxsplit=1)[1] if v.startswith("ok ") else v for k, v in imports.items()}
    gpu = env.get("gpu") or ("CPU (dry run)" if r.get("dry_run") else "no GPU seen")
    date = (r.get("started_utc") or "")[:10]
    lines = [f"## GPU check: {gpu}, {date}", ""]
    if r.get("dry_run"):
        lines += [
            "**DRY RUN** (CPU, tiny sizes): these numbers test the kit, not the hardware.",
            "",
        ]
    smi = env.get("nvidia_smi", "")
    lines += [
        f"- Command: `bash scripts/gpu_check.sh OUT{' --dry-run' if r.get('dry_run') else ''}` "
        f"(`{r.get('command', '')}`), {r.get('started_utc', '?')} to "
        f"{r.get('finished_utc', '?')}, {_f(r.get('elapsed_s'), '.0f')} s "
        + (
            f"of the {_f(r['budgets_s']['total'], '.0f')} s budget."
            if r.get("budgets_s", {}).get("total") is not None
            else "(no time budget: the dry run's work is fixed)."
        ),
        f"- Machine: {gpu}"
        + (
            f" ({env.get('gpu_memory_gib')} GiB, {env.get('sms')} SMs, capability "
            f"{env.get('capability')}; driver, max SM clock: {smi})"
            if env.get("gpu")
            else ""
        )
        + f"; {env.get('cpu_count', '?')} CPUs; {env.get('platform', '?')}.",
        f"- Versions: Python {env.get('python', '?')}, torch {env.get('torch', '?')}"
        + (f" (CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')})" if env.get("cuda") else "")
        + ", "
        + ", ".join(
            f"{k} {ver[k]}"
            for k in ("deepspeed", "triton", "omegaconf", "datasets", "pydantic", "numpy")
            if k in ver
        )
        + (f"; nvcc: {env['nvcc']}" if env.get("nvcc") else "")
        + ".",
    ]
    lines += [
        "",
        "| step | status | seconds | budget (s) | note |",
        "|---|---|---:|---:|---|",
    ]
    for name, s in r.get("steps", {}).items():
        note = str(s.get("reason", "")).replace("\n", " ").replace("|", "/")[:160]
        lines.append(
            f"| {name} | {s.get('status')} | {_f(s.get('seconds'), '.0f')} | "
            f"{_f(s.get('budget_s'), '.0f')} | {note} |"
        )
    return lines + [""]


def tests(s: dict[str, Any]) -> list[str]:
    lines = [
        "### GPU tests (`pytest -m gpu tests/test_gpu.py`)",
        "",
        f"{s.get('passed', 0)} passed, {s.get('failed', 0)} failed, {s.get('skipped', 0)} "
        f"skipped of {s.get('collected', 0)}.",
        "",
    ]
    for f in s.get("failures", []):
        lines.append(f"- FAILED `{f['name']}`: {f['message'][:200]}")
    m = s.get("measured", [])
    prec = [x for x in m if x["test"] == "bf16_vs_fp32"]
    if prec:
        lines += [
            "",
            "bf16 against an fp32 copy on the same device (relative L2 errors; per-parameter "
            "gradient error as RMS over the RMS of all gradients):",
            "",
            "| projection | sharing | loss | logits | all gradients | worst parameter |",
            "|---|---|---:|---:|---:|---|",
        ]
        for x in prec:
            lines.append(
                f"| {x['kind']} | {x['sharing']} | {_f(x['loss_rel_err'], '.1e')} | "
                f"{_f(x['logits_rel_err'], '.1e')} | {_f(x['grad_rel_err'], '.1e')} | "
                f"{_f(x['worst_param_rms_err'], '.1e')} ({x['worst_param']}) |"
            )
    dense = [x for x in m if x["test"] in ("dense_fused", "dense_math_control")]
    if dense:
        lines += ["", "Dense attention memory, one layer forward + backward, bf16:", ""]
        for x in dense:
            if x["test"] == "dense_fused":
                lines.append(
                    f"- fused `{x['kernel']}` kernel{' with padding mask' if x['masked'] else ''}"
                    f", N = {x['n']}: {_mib(x['transient_bytes'])} beyond the inputs; one head's "
                    f"N x N would be {_mib(x['one_head_nxn_bytes'])}, all {x['heads']} heads' "
                    f"{_mib(x['all_heads_nxn_bytes'])}"
                )
            else:
                lines.append(
                    f"- control, unfused `math` kernel at N = {x['n']}: "
                    f"{_mib(x['transient_bytes'])} (its scores alone: {_mib(x['scores_bytes'])})"
                )
    lin = [x for x in m if x["test"] == "linformer_memory"]
    for x in lin:
        rows = ", ".join(f"N={r['n']}: {_mib(r['transient_bytes'])}" for r in x["rows"])
        lines += [
            "",
            f"Linformer (k = {x['k']}, hidden {x['hidden']}) MLM forward + backward memory: "
            f"{rows}; {x['bytes_per_token'] / 1024:.1f} KiB per token, affine fit residual "
            f"{100 * x['fit_max_rel_residual']:.1f} %, doubling ratios "
            + ", ".join(f"{q:.2f}" for q in x["doubling_ratios"])
            + ".",
        ]
    return lines + [""]


def main_job(s: dict[str, Any]) -> list[str]:
    lines = ["### Main job (`configs/base_4096.yaml`, 1 GPU, bf16, ZeRO-2, checkpointing)", ""]
    lines.append(f"`{s.get('command', '')}`")
    lines.append("")
    if not s.get("logged_steps"):
        return lines + [f"No step logged ({s.get('status')}: {s.get('reason', '')}).", ""]
    model = s.get("model", {})
    lines += [
        f"- {s.get('setup', '')}",
        f"- model: hidden {model.get('hidden_size')}, {model.get('num_layers')} layers, N = "
        f"{model.get('max_seq_len')}, k = {model.get('k')}; micro batch "
        f"{s.get('micro_batch_size')}; steps logged: {s['logged_steps'][0]}..{s['logged_steps'][-1]}",
        f"- **{_f(s.get('tokens_per_s'), ',.0f')} tokens/s**, {_f(s.get('model_tflops'), '.1f')} "
        f"model TFLOP/s, **MFU {100 * (s.get('mfu') or 0):.1f} %** of the bf16 GEMM peak "
        + (
            "measured in the same run"
            if s.get("gemm_peak_source", "").startswith("measured")
            else "given as train.peak_tflops"
        )
        + f" ({_f(s.get('gemm_peak_tflops'), '.0f')} TFLOP/s); medians over the logged "
        "intervals after the first",
        f"- ZeRO-{s.get('zero_stage')}, {s.get('precision')}, activation checkpointing "
        f"{'on' if s.get('activation_checkpointing') else 'off'}",
        f"- peak memory (torch max allocated): {_f(s.get('peak_mem_gib'), '.2f')} GiB",
        f"- MLM loss {_f(s.get('first_loss'), '.3f')} (first interval) -> "
        f"{_f(s.get('last_loss'), '.3f')} (last), accuracy {_f(s.get('last_accuracy'), '.3f')}",
        "",
    ]
    return lines


def optimizers(s: dict[str, Any]) -> list[str]:
    lines = ["### Optimizers (short main-job runs alongside the sweep: function, not speed)", ""]
    jit = s.get("jit_build")
    if jit:
        lines.append(
            f"- FusedAdam nvcc JIT build: {jit.get('status')}"
            + (f" in {jit['build_s']} s" if "build_s" in jit else "")
        )
    for name, r in s.get("runs", {}).items():
        cmp = r.get("loss_vs_main")
        extra = (
            f"; loss at step {cmp['step']}: {cmp['this']:.4f} vs main job {cmp['main']:.4f}"
            if cmp
            else ""
        )
        lines.append(
            f"- {name} (`{' '.join(r.get('overrides', []))}`): {r.get('status')}{extra}"
            + (f" ({r['reason'][:160]})" if r.get("reason") else "")
        )
    return lines + [""]


def bench(s: dict[str, Any]) -> list[str]:
    lines = ["### Model-speed benchmark (`bench/gpu_bench.sh`, trimmed)", ""]
    lines.append(f"`{s.get('command', '')}`")
    lines.append("")
    if s.get("table_md"):
        lines.append(s["table_md"].rstrip())
    else:
        lines.append(f"No results ({s.get('status')}: {s.get('reason', '')[:200]}).")
    return lines + [""]


def peer(s: dict[str, Any]) -> list[str]:
    lines = ["### Equal work against lucidrains and HF BERT (`bench/peer_bench.py`)", ""]
    for name, run in s.get("runs", {}).items():
        lines += [f"`{name}`: `{run.get('command', '')}`", ""]
        if run.get("table_md"):
            lines.append(run["table_md"].rstrip())
        else:
            lines.append(f"No results ({run.get('status')}: {run.get('reason', '')[:200]}).")
        lines.append("")
    return lines


def sweep(s: dict[str, Any]) -> list[str]:
    lines = [f"### Quality sweep (`{s.get('sweep_file', '')}`)", ""]
    counts = s.get("status_counts", {})
    runs = s.get("runs", {})
    lines += [
        f"{s.get('points', '?')} points, {s.get('workers')} at a time on the device: "
        + ", ".join(f"{v} {k}" for k, v in counts.items())
        + f"; median point wall time {_f(runs.get('point_seconds_median'), '.0f')} s. "
        f"{s.get('tokens_per_step')} tokens per step; validation on the same "
        f"{s.get('eval_tokens')} tokens at every evaluation. Model and length: "
        f"`{' '.join(s.get('base_overrides', []))}`.",
        "",
        "Final validation perplexity over seeds (mean ± standard deviation, min-max); "
        "'/ unigram': the mean over the context-free reference (the training split's token "
        "frequencies on the same validation tokens).",
        "",
        "| variant | N | k | runs ok | val ppl mean ± sd | min-max | val loss | MLM acc "
        "| / unigram | steps |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for g in s.get("groups", []):
        sd = f" ± {g['ppl_std']:.1f}" if g.get("ppl_std") is not None else ""
        rng = f"{g['ppl_min']:.1f}-{g['ppl_max']:.1f}" if g.get("ppl_min") is not None else "-"
        bad = "".join(f", {g[k]} {k}" for k in ("diverged", "failed", "pending") if g.get(k))
        lines.append(
            f"| {g['variant']} | {g['n']} | {g['k'] if g['k'] is not None else '-'} | "
            f"{g['ok']}/{g['runs']}{bad} | "
            f"{_f(g.get('ppl_mean'), '.1f')}{sd} | {rng} | {_f(g.get('loss_mean'), '.3f')} | "
            f"{_f(g.get('acc_mean'), '.3f')} | {_f(g.get('ppl_over_unigram'), '.3f')} | "
            f"{g.get('steps')} |"
        )
    uni = s.get("unigram_ppl", {})
    if uni:
        lines += [
            "",
            "Unigram reference perplexity: "
            + ", ".join(f"N={n}: {v:.1f}" for n, v in uni.items())
            + ".",
        ]
    return lines + [""]


def render(results: dict[str, Any]) -> str:
    """The whole section as markdown."""
    steps = results.get("steps", {})
    out = header(results)
    if "tests" in steps:
        out += tests(steps["tests"])
    if "main" in steps:
        out += main_job(steps["main"])
    if "bench" in steps:
        out += bench(steps["bench"])
    if "peer" in steps:
        out += peer(steps["peer"])
    if "sweep" in steps:
        out += sweep(steps["sweep"])
    if "optimizers" in steps:
        out += optimizers(steps["optimizers"])
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out_dir", help="a scripts/gpu_check.py output folder")
    p.add_argument("--out", help="write the markdown here (default: standard output)")
    a = p.parse_args(argv)
    path = Path(a.out_dir) / "results.json"
    if not path.is_file():
        print(f"error: {path} does not exist (run scripts/gpu_check.sh first)", file=sys.stderr)
        return 2
    try:
        results = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        print(f"error: {path} is not valid JSON: {e}", file=sys.stderr)
        return 2
    md = render(results)
    if a.out:
        Path(a.out).write_text(md)
        print(f"wrote {a.out}")
    else:
        sys.stdout.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
