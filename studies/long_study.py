"""The long-context study at N = 4,096 (docs/quality_study.md, "Long context at N = 4,096").

Every attention variant trains under configs/long_cpu.yaml's two-stage schedule (rows of 128,
then rows of 4,096, the same tokens a step), shortened to ``--short-steps`` + ``--long-steps``
steps, on the same data, masks, optimizer and seed; then the context curve of its final
checkpoint (linformer_ds.context_curve: the same hidden labels through windows of 128 ... 4,096
tokens). One result row per variant: hidden-label loss and gain over the unigram level at the
end, the curve, long_context_gain = loss(512) - loss(4096), tokens/s and peak memory of the
4,096 stage, wall-clock.

    DS_ACCELERATOR=cpu python studies/long_study.py --out docs/quality_study/long_4096 \\
        [--variants dense,local_linear] [--seed 0] [--short-steps 400] [--long-steps 100]

A variant already finished (its result.json) is not run again; --report-only rebuilds the table.

``--equal-time``: the same comparison at equal wall-clock instead of equal tokens. First a
side-by-side probe (:func:`probe_step_seconds`, in this process, the variants' training steps
interleaved, one torch thread, CPU time: other load on the machine does not move it) times one
bf16 training step of each
variant on a batch of each stage (32 rows of 128, one row of 4,096); then each variant trains
``--short-steps x t_ref / t_variant`` and ``--long-steps x t_ref / t_variant`` steps (stage by
stage), ``t_ref`` the reference variant's (``--time-ref``, default dense) step, so every
variant gets the machine time the reference gets for the equal-token schedule. The probe is
kept in ``OUT/equal_time_probe.json`` and reused; run directories and results carry ``_time``.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[1]
BASE = REPO / "configs" / "long_cpu.yaml"
WINDOWS = "128,512,1024,2048,4096"
# name -> model overrides (on top of long_cpu.yaml's model; k = 128 where a kind has summaries;
# the attention and the mixer always named, so a change of long_cpu.yaml cannot move a variant)
VARIANTS: dict[str, dict[str, Any]] = {
    "dense": {"projection": "dense", "local_window": 0, "local_mixer": "none"},
    "linear_mixer": {"projection": "linear", "local_window": 0, "local_mixer": "layers"},
    "conv_hybrid": {"projection": "hybrid", "sharing": "headwise", "local_window": 0,
                    "local_mixer": "none"},
    "local": {"projection": "local", "local_window": 128, "local_mixer": "none"},
    "local_linear": {"projection": "linear", "local_window": 128, "local_mixer": "none"},
    "local_linear_rope": {"projection": "linear", "local_window": 128, "positions": "rope",
                          "local_mixer": "none"},
    "local_dynamic": {"projection": "dynamic", "sharing": "headwise", "local_window": 128,
                      "local_mixer": "none"},
    # the window beside the local mixer of the English recipe (every layer reads +-1 directly)
    "local_linear_mixer": {"projection": "linear", "local_window": 128, "local_mixer": "layers"},
    "modernbert_like": {"layer_projections": ["dense", "local", "local", "dense"],
                        "local_window": 128, "local_mixer": "none"},
}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="docs/quality_study/long_4096", help="results and report")
    p.add_argument("--runs", default="runs/long_study", help="run directories")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--short-steps", type=int, default=400, help="steps on rows of 128")
    p.add_argument("--long-steps", type=int, default=100, help="steps on rows of 4,096")
    p.add_argument("--curve-rows", type=int, default=16, help="valid rows the curve scores")
    p.add_argument("--report-only", action="store_true")
    p.add_argument(
        "--equal-time",
        action="store_true",
        help="equal wall-clock per stage (the probe's step times), not equal tokens",
    )
    p.add_argument(
        "--time-ref",
        default="dense",
        help="--equal-time: the variant whose --short-steps/--long-steps set the budget",
    )
    p.add_argument("--probe-rounds", type=int, default=7, help="--equal-time: timed rounds")
    return p.parse_args(argv)


def variant_config(name: str) -> Any:
    """long_cpu.yaml with the variant's attention."""
    cfg = OmegaConf.load(BASE)
    for key, value in VARIANTS[name].items():
        cfg.model[key] = value
    return cfg


def probe_step_seconds(names: list[str], rounds: int, seed: int = 0) -> dict[str, dict[str, float]]:
    """Seconds of one training step of each variant on each stage's batch (``short``: 32 x 128,
    ``long``: 1 x 4,096): bf16 weights with fp32 AdamW master copies (DeepSpeed's bf16 mode),
    the labelled positions known on the host, as the trainer runs it. One warm-up step, then
    ``rounds`` rounds that step every variant in turn; the best round counts. Timed as this
    thread's CPU time with one torch thread, so other work on a shared machine (which only
    delays a step) does not move the ratios."""
    import torch

    sys.path.insert(0, str(REPO))  # bench/ beside linformer_ds/
    from bench.common import mlm_batch
    from bench.model_bench import MasterWeightAdamW
    from linformer_ds.model import LinformerForMaskedLMPretraining, ModelConfig, labelled_positions

    shapes = {"short": (32, 128), "long": (1, 4096)}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    steps = {}
    for name in names:
        model_cfg = ModelConfig(**OmegaConf.to_container(variant_config(name).model))
        torch.manual_seed(seed)
        model = LinformerForMaskedLMPretraining(model_cfg).to(torch.bfloat16).train()
        model.encoder.check_token_ids = False
        opt = MasterWeightAdamW(list(model.parameters()), lr=1e-4)
        for stage, (b, n) in shapes.items():
            rows = mlm_batch(model_cfg.vocab_size, b, n, 0.4, seed=seed + n)
            ids, labels = rows["input_ids"], rows["labels"]
            index = labelled_positions(labels)

            def step(model=model, opt=opt, ids=ids, labels=labels, index=index) -> None:
                model(ids, labels=labels, labelled_index=index).loss.backward()
                opt.step()
                opt.zero_grad()

            steps[(name, stage)] = step
    times: dict[Any, list[float]] = {key: [] for key in steps}
    for step in steps.values():
        step()  # warm-up
    for r in range(rounds):
        for key, step in steps.items():
            t0 = time.thread_time()
            step()
            times[key].append(time.thread_time() - t0)
        print(f"[probe] round {r + 1}/{rounds}", flush=True)
    torch.set_num_threads(threads)
    out: dict[str, dict[str, float]] = {name: {} for name in names}
    for (name, stage), ts in times.items():
        out[name][stage] = min(ts)
    return out


def equal_time_steps(
    probe: dict[str, dict[str, float]], name: str, ref: str, short: int, long: int
) -> tuple[int, int]:
    """The steps ``name`` takes in the reference's time for ``short`` + ``long`` steps."""
    s = round(short * probe[ref]["short"] / probe[name]["short"])
    n = round(long * probe[ref]["long"] / probe[name]["long"])
    return max(1, s), max(1, n)


def study_config(name: str, args: argparse.Namespace) -> Any:
    """long_cpu.yaml with the variant's attention and the shortened schedule."""
    cfg = variant_config(name)
    total = args.short_steps + args.long_steps
    cfg.name = f"long_study-{name}-s{args.seed}"
    cfg.train.max_steps = total
    cfg.train.stages[0].end_step = args.short_steps
    cfg.train.stages[1].end_step = total
    cfg.train.eval_interval = args.long_steps if args.long_steps else total
    cfg.train.seed = args.seed
    cfg.scheduler.warmup_steps = max(1, total // 20)
    cfg.checkpoint.save_interval = 0
    cfg.checkpoint.keep_last = 1
    return cfg


def run_figures(run: Path, short_steps: int) -> dict[str, Any]:
    """The run's last evaluation (hidden-label loss, gain over the unigram level), its
    evaluations, and the median tokens/s and the peak memory of its 4,096-token stage."""
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    train = [r for r in records if r.get("split") == "train"]
    evals = [r for r in records if r.get("split") == "eval" and "hidden_loss" in r]
    long_train = [r for r in train if r["step"] > short_steps]
    out: dict[str, Any] = {}
    if evals:
        last = evals[-1]
        for key in ("hidden_loss", "hidden_accuracy", "unigram_loss", "context_gain_nats"):
            out[key] = last.get(key)
        out["evals"] = [
            {k: r.get(k) for k in ("step", "hidden_loss", "context_gain_nats")} for r in evals
        ]
    if long_train:
        tps = sorted(r["tokens_per_s"] for r in long_train[1:] or long_train)
        out["tokens_per_s_4096"] = tps[len(tps) // 2]
        out["peak_mem_gb"] = max(r.get("peak_mem_gb", 0.0) for r in long_train)
    return out


def run_variant(
    name: str, args: argparse.Namespace, probe: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Train one variant (``probe``: at equal time, :func:`equal_time_steps`), then its curve."""
    tag = f"{name}_s{args.seed}" + ("_time" if probe is not None else "")
    run = REPO / args.runs / tag
    result_path = Path(args.out) / "runs" / f"{tag}.json"
    if probe is not None:
        short, long = equal_time_steps(
            probe["step_seconds"], name, probe["ref"], probe["short_steps"], probe["long_steps"]
        )
        args = argparse.Namespace(**{**vars(args), "short_steps": short, "long_steps": long})
        same = Path(args.out) / "runs" / f"{name}_s{args.seed}.json"
        if not result_path.is_file() and same.is_file():  # the reference: its equal-token run
            earlier = json.loads(same.read_text())
            if (earlier["short_steps"], earlier["long_steps"]) == (short, long):
                earlier.update(arm="equal_time", probe_step_seconds=probe["step_seconds"][name])
                earlier["same_run_as"] = same.name
                result_path.write_text(json.dumps(earlier, indent=1))
    if result_path.is_file():
        print(f"[skip] {name}: {result_path} exists", flush=True)
        return json.loads(result_path.read_text())
    run.mkdir(parents=True, exist_ok=True)
    cfg_path = run / "study_config.yaml"
    OmegaConf.save(study_config(name, args), cfg_path)
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, str(REPO / "launch" / "pretrain.py"), "--config", str(cfg_path),
           f"logging.dir={run}", "checkpoint.resume=never"]  # fmt: skip
    print(f"[run] {name}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    with open(run / "train.log", "w") as log:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    result: dict[str, Any] = {
        "variant": name, "seed": args.seed, "model": VARIANTS[name], "returncode": rc,
        "wall_s": round(wall, 1), "short_steps": args.short_steps, "long_steps": args.long_steps,
        "tokens": 4096 * (args.short_steps + args.long_steps),
        "arm": "equal_time" if probe is not None else "equal_tokens",
    }  # fmt: skip
    if probe is not None:
        result["probe_step_seconds"] = probe["step_seconds"][name]
    result.update(run_figures(run, args.short_steps))
    curve_dir = run / "context_curve"
    curve_cmd = [sys.executable, "-m", "linformer_ds.context_curve", str(run / "checkpoints"),
                 str(REPO / "data" / "long" / "data"), "--windows", WINDOWS,
                 "--rows", str(args.curve_rows), "--out", str(curve_dir)]  # fmt: skip
    t1 = time.perf_counter()
    c = subprocess.run(curve_cmd, cwd=REPO, env=env, capture_output=True, text=True)
    result["curve_s"] = round(time.perf_counter() - t1, 1)
    if c.returncode == 0:
        curve = json.loads((curve_dir / "context_curve.json").read_text())
        result["curve"] = curve
    else:
        result["curve_error"] = (c.stderr or c.stdout).strip().splitlines()[-1:]
    result_path.parent.mkdir(parents=True, exist_ok=True)
    result_path.write_text(json.dumps(result, indent=1))
    print(f"[done] {name}: rc {rc}, {wall:.0f} s, hidden {result.get('hidden_loss')}", flush=True)
    return result


def _f(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _table(rows: list[dict[str, Any]], windows: list[int], equal_time: bool) -> list[str]:
    dense_tps = {r["seed"]: r.get("tokens_per_s_4096") for r in rows if r["variant"] == "dense"}
    head = ["variant", "seed"]
    if equal_time:
        head += ["steps 128 + 4096", "probe s/step 128", "probe s/step 4096"]
    head += ["hidden loss", "gain vs unigram (nats)"]
    head += [f"curve W={w}" for w in windows]
    head += ["long-context gain 512->N", "tokens/s at 4096", "x dense", "peak mem GB", "wall s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        curve = {w["window"]: w["loss"] for w in r.get("curve", {}).get("windows", [])}
        tps, d = r.get("tokens_per_s_4096"), dense_tps.get(r["seed"])
        cells = [r["variant"], str(r["seed"])]
        if equal_time:
            probe = r.get("probe_step_seconds", {})
            cells += [f"{r['short_steps']} + {r['long_steps']}", _f(probe.get("short"), ".4f"),
                      _f(probe.get("long"), ".4f")]  # fmt: skip
        cells += [_f(r.get("hidden_loss"), ".4f"), _f(r.get("context_gain_nats"), ".4f")]
        cells += [_f(curve.get(w), ".4f") for w in windows]
        cells += [_f(r.get("curve", {}).get("long_context_gain"), "+.4f"), _f(tps, ".0f"),
                  _f(tps / d if tps and d else None, ".2f"), _f(r.get("peak_mem_gb"), ".2f"),
                  _f(r.get("wall_s"), ".0f")]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def report(out: Path, runs: Path | None = None) -> Path:
    """``out/report.md``, ``results.json`` and ``context_curves.png`` from ``out/runs/*.json``
    (their run directories' metrics read again where ``runs`` still holds them): one table at
    equal tokens, one at equal time where ``--equal-time`` ran."""
    rows = []
    for p in sorted((out / "runs").glob("*.json")):
        r = json.loads(p.read_text())
        run = None if runs is None else runs / p.stem
        if run is not None and (run / "metrics.jsonl").is_file():
            r.update(run_figures(run, r["short_steps"]))
            p.write_text(json.dumps(r, indent=1))
        rows.append(r)
    order = {name: i for i, name in enumerate(VARIANTS)}
    rows.sort(key=lambda r: (order.get(r["variant"], 99), r["seed"]))
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    windows = sorted({w["window"] for r in rows for w in r.get("curve", {}).get("windows", [])})
    tokens = [r for r in rows if r.get("arm", "equal_tokens") == "equal_tokens"]
    timed = [r for r in rows if r.get("arm") == "equal_time"]
    lines = ["Equal tokens:", ""] + _table(tokens, windows, False)
    if timed:
        lines += ["", "Equal wall-clock (steps from the side-by-side probe):", ""]
        lines += _table(timed, windows, True)
    uni = [r["curve"].get("unigram_loss") for r in rows if r.get("curve")]
    text = "\n".join(lines) + "\n"
    if uni:
        text += f"\nUnigram (no context) loss on the curve's positions: {uni[0]:.4f}.\n"
    (out / "report.md").write_text(text)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return out / "report.md"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        ws = r.get("curve", {}).get("windows", [])
        if ws:
            timed_run = r.get("arm") == "equal_time"
            ax.plot([w["window"] for w in ws], [w["loss"] for w in ws], "s--" if timed_run else "o-",
                    label=f"{r['variant']} s{r['seed']}" + (" (equal time)" if timed_run else ""))  # fmt: skip
    if uni:
        ax.axhline(uni[0], color="grey", ls="--", label="unigram (no context)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("window around the scored position (tokens)")
    ax.set_ylabel("hidden-label loss (nats)")
    ax.set_title("Context curves at N = 4,096 (same positions and masks)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "context_curves.png", dpi=110)
    return out / "report.md"


def load_or_probe(out: Path, names: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """``out/equal_time_probe.json`` (made by :func:`probe_step_seconds` when missing or when
    it lacks one of ``names``): the step times and the reference budget."""
    path = out / "equal_time_probe.json"
    if path.is_file():
        probe = json.loads(path.read_text())
        if all(n in probe["step_seconds"] for n in names + [probe["ref"]]):
            print(f"[probe] reusing {path}", flush=True)
            return probe
    probed = list(dict.fromkeys([args.time_ref] + names))
    probe = {
        "ref": args.time_ref, "short_steps": args.short_steps, "long_steps": args.long_steps,
        "rounds": args.probe_rounds, "step_seconds": probe_step_seconds(probed, args.probe_rounds),
    }  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(probe, indent=1))
    return probe


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        print(f"long_study: unknown variant(s) {unknown}; known: {list(VARIANTS)}", file=sys.stderr)
        return 2
    if not args.report_only:
        probe = None
        if args.equal_time:
            probe = load_or_probe(Path(args.out), names, args)
        for name in names:
            run_variant(name, args, probe)
            report(Path(args.out), REPO / args.runs)
    print(report(Path(args.out), REPO / args.runs).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
