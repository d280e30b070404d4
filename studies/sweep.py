"""Quality sweeps: train a grid of pretraining runs from one YAML and report validation quality.

A sweep file names a base job config, overrides shared by every run, named variants (override
sets such as ``dense = [model.projection=dense]``) and one or more grids (variant x N x k x
learning rate x seed). Every grid point runs the real trainer (``launch/pretrain.py``) as its
own process, in sequence here or as one task of a SLURM job array, and leaves
``<out>/runs/<point id>/{metrics.jsonl, tensorboard/, train.log, result.json}``. The report
(``report.md``, ``results.json``, ``results.csv`` and PNG plots) is built from the
``result.json`` files, so it can be rebuilt at any time and points that finished are skipped
on a rerun.

Divergence: a run is marked ``diverged`` (and the sweep goes on) when the trainer exits with
``EXIT_NONFINITE``, when any logged loss is non-finite, when a loss exceeds
``divergence.max_loss``, or when the last validation loss is more than ``divergence.max_rise``
nats above the best one. Other non-zero exits are ``failed`` and rerun on the next invocation.

Data: every sequence length N needs a data_prep output with ``--seq-len N``; they are built on
demand under ``data.cache_dir`` and share one SentencePiece tokenizer (``--tokenizer``).
"""

import contextlib
import csv
import fcntl
import hashlib
import itertools
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence

import yaml

REPO = Path(__file__).resolve().parents[1]
PRETRAIN = REPO / "launch" / "pretrain.py"
SWEEP_CLI = REPO / "studies" / "run_sweep.py"
EXIT_NONFINITE = 3  # linformer_ds.train.EXIT_NONFINITE (not imported: it pulls in deepspeed)
FINISHED = ("ok", "diverged")  # statuses that a rerun skips
# Keys that the runner sets per point; a sweep file must not set them in base/variant overrides.
RESERVED = (
    "model.max_seq_len",
    "model.k",
    "optimizer.lr",
    "train.seed",
    "data.path",
    "logging.dir",
    "name",
)


class SweepError(ValueError):
    """A sweep file or option is invalid; the message names the key."""


# ======================================================================================= schema
@dataclass
class Variant:
    """A named set of overrides; ``uses_k=False`` (dense) collapses the k axis to one run."""

    name: str
    overrides: List[str]
    uses_k: bool = True


@dataclass
class Grid:
    """One factorial block of the sweep; the sweep runs the union of its grids."""

    name: str
    variants: List[str]
    seq_len: List[int]
    k: List[int]
    lr: List[float]
    seed: List[int]


@dataclass
class DataSpec:
    """How to build the data_prep output for each N (one shared tokenizer)."""

    source: List[str] = field(default_factory=lambda: ["stdlib"])
    vocab_size: int = 8000
    args: List[str] = field(default_factory=list)  # extra data_prep flags, e.g. --max-bytes
    cache_dir: str = "data/sweep"


@dataclass
class Point:
    """One training run of the sweep."""

    index: int
    id: str
    grids: List[str]
    variant: str
    seq_len: int
    k: Optional[int]  # None for variants that do not use k
    lr: float
    seed: int


@dataclass
class SweepConfig:
    """A parsed sweep file; paths are absolute."""

    name: str
    path: Path
    base_config: Path
    base_overrides: List[str]
    variants: Dict[str, Variant]
    grids: List[Grid]
    data: DataSpec
    out: Path
    tokens_per_step: Optional[int] = None  # micro_batch_size = tokens_per_step // N
    eval_tokens: Optional[int] = None  # eval_batches = eval_tokens // (micro_batch_size * N)
    max_loss: Optional[float] = None  # default 1.5 * ln(vocab_size)
    max_rise: float = 1.0
    point_timeout_s: Optional[float] = None
    launcher: List[str] = field(default_factory=lambda: [sys.executable])
    env: Dict[str, str] = field(default_factory=dict)
    slurm: Dict[str, Any] = field(default_factory=dict)

    def points(self) -> List[Point]:
        """The union of all grids, in file order, without duplicates."""
        out: Dict[str, Point] = {}
        for g in self.grids:
            for v, n, k, lr, seed in itertools.product(g.variants, g.seq_len, g.k, g.lr, g.seed):
                kk = k if self.variants[v].uses_k else None
                pid = point_id(v, n, kk, lr, seed)
                if pid in out:
                    if g.name not in out[pid].grids:
                        out[pid].grids.append(g.name)
                    continue
                out[pid] = Point(len(out), pid, [g.name], v, n, kk, lr, seed)
        return list(out.values())

    def divergence_loss(self) -> float:
        """Loss above which a run counts as diverged."""
        return self.max_loss if self.max_loss is not None else 1.5 * math.log(self.data.vocab_size)


def point_id(variant: str, n: int, k: Optional[int], lr: float, seed: int) -> str:
    """A readable, filesystem-safe run name, e.g. ``linear_layerwise_n1024_k128_lr0.001_s0``."""
    kpart = f"_k{k}" if k is not None else ""
    return f"{variant}_n{n}{kpart}_lr{lr:g}_s{seed}"


def _as_list(value: Any, key: str, kind: type) -> list:
    items = value if isinstance(value, list) else [value]
    if not items:
        raise SweepError(f"{key}: must not be empty")
    try:
        return [kind(x) for x in items]
    except (TypeError, ValueError):
        raise SweepError(f"{key}: expected {kind.__name__} values, got {value!r}") from None


def _check_overrides(items: Any, key: str) -> List[str]:
    if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
        raise SweepError(f"{key}: must be a list of 'key=value' strings, got {items!r}")
    for item in items:
        if "=" not in item:
            raise SweepError(f"{key}: {item!r} is not of the form key=value")
        if item.split("=", 1)[0].strip() in RESERVED:
            raise SweepError(
                f"{key}: {item!r} sets a key that the sweep sets per point ({', '.join(RESERVED)})"
            )
    return list(items)


def _resolve(path: str, base: Path) -> Path:
    p = Path(path)
    if p.is_absolute():
        return p
    here = (base / p).resolve()
    return here if here.exists() else (REPO / p).resolve()


def load_sweep(path: str, out: Optional[str] = None) -> SweepConfig:
    """Parse and validate a sweep YAML; relative paths are taken from the repo root."""
    p = Path(path).resolve()
    if not p.is_file():
        raise SweepError(f"sweep file not found: {path}")
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise SweepError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise SweepError(f"{path}: top level must be a mapping")
    known = {
        "name",
        "base_config",
        "base_overrides",
        "variants",
        "grids",
        "data",
        "out",
        "tokens_per_step",
        "eval_tokens",
        "divergence",
        "point_timeout_s",
        "launcher",
        "env",
        "slurm",
    }
    unknown = sorted(set(raw) - known)
    if unknown:
        raise SweepError(f"{path}: unknown key(s) {unknown}; known: {sorted(known)}")
    for key in ("base_config", "variants", "grids"):
        if key not in raw:
            raise SweepError(f"{path}: missing required key {key!r}")

    base_config = (REPO / raw["base_config"]).resolve()
    if not base_config.is_file():
        raise SweepError(f"base_config: file not found: {raw['base_config']}")

    variants: Dict[str, Variant] = {}
    if not isinstance(raw["variants"], dict) or not raw["variants"]:
        raise SweepError("variants: must be a non-empty mapping name -> overrides")
    for name, spec in raw["variants"].items():
        if isinstance(spec, list):
            spec = {"overrides": spec}
        if not isinstance(spec, dict) or set(spec) - {"overrides", "uses_k"}:
            raise SweepError(
                f"variants.{name}: must be a list of overrides or {{overrides: [...], uses_k: bool}}"
            )
        ov = _check_overrides(spec.get("overrides", []), f"variants.{name}.overrides")
        variants[name] = Variant(name, ov, bool(spec.get("uses_k", True)))

    grids: List[Grid] = []
    if not isinstance(raw["grids"], list) or not raw["grids"]:
        raise SweepError("grids: must be a non-empty list")
    for i, g in enumerate(raw["grids"]):
        key = f"grids[{i}]"
        if not isinstance(g, dict):
            raise SweepError(f"{key}: must be a mapping")
        bad = sorted(set(g) - {"name", "variants", "seq_len", "k", "lr", "seed"})
        if bad:
            raise SweepError(f"{key}: unknown key(s) {bad}")
        for req in ("variants", "seq_len", "lr"):
            if req not in g:
                raise SweepError(f"{key}: missing required key {req!r}")
        grid = Grid(
            name=str(g.get("name", f"grid{i}")),
            variants=_as_list(g["variants"], f"{key}.variants", str),
            seq_len=_as_list(g["seq_len"], f"{key}.seq_len", int),
            k=_as_list(g.get("k", [256]), f"{key}.k", int),
            lr=_as_list(g["lr"], f"{key}.lr", float),
            seed=_as_list(g.get("seed", [0]), f"{key}.seed", int),
        )
        for v in grid.variants:
            if v not in variants:
                raise SweepError(f"{key}.variants: unknown variant {v!r}; known: {list(variants)}")
        for lr in grid.lr:
            if not lr > 0:
                raise SweepError(f"{key}.lr: must be > 0, got {lr}")
        for n in grid.seq_len:
            if n < 2:
                raise SweepError(f"{key}.seq_len: must be >= 2, got {n}")
        grids.append(grid)

    d = raw.get("data") or {}
    bad = sorted(set(d) - {"source", "vocab_size", "args", "cache_dir"})
    if bad:
        raise SweepError(f"data: unknown key(s) {bad}")
    data = DataSpec(
        source=_as_list(d.get("source", "stdlib"), "data.source", str),
        vocab_size=int(d.get("vocab_size", 8000)),
        args=[str(a) for a in d.get("args", [])],
        cache_dir=str((REPO / d.get("cache_dir", "data/sweep")).resolve()),
    )
    div = raw.get("divergence") or {}
    bad = sorted(set(div) - {"max_loss", "max_rise"})
    if bad:
        raise SweepError(f"divergence: unknown key(s) {bad}")
    launcher = raw.get("launcher", [sys.executable])
    if isinstance(launcher, str):
        launcher = shlex.split(launcher)
    launcher = [sys.executable if x == "python" else str(x) for x in launcher]
    name = str(raw.get("name", p.stem))
    cfg = SweepConfig(
        name=name,
        path=p,
        base_config=base_config,
        base_overrides=_check_overrides(raw.get("base_overrides", []), "base_overrides"),
        variants=variants,
        grids=grids,
        data=data,
        out=Path(out or (REPO / raw.get("out", f"runs/sweeps/{name}"))).resolve(),
        tokens_per_step=raw.get("tokens_per_step"),
        eval_tokens=raw.get("eval_tokens"),
        max_loss=div.get("max_loss"),
        max_rise=float(div.get("max_rise", 1.0)),
        point_timeout_s=raw.get("point_timeout_s"),
        launcher=launcher,
        env={str(k): str(v) for k, v in (raw.get("env") or {}).items()},
        slurm=dict(raw.get("slurm") or {}),
    )
    for key in ("tokens_per_step", "eval_tokens"):
        val = getattr(cfg, key)
        if val is not None and (not isinstance(val, int) or val < 1):
            raise SweepError(f"{key}: must be a positive integer, got {val!r}")
    if cfg.data.vocab_size < 10:
        raise SweepError(f"data.vocab_size: must be >= 10, got {cfg.data.vocab_size}")
    return cfg


# ========================================================================================= data
def _data_key(spec: DataSpec) -> str:
    blob = json.dumps([spec.source, spec.vocab_size, spec.args], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:10]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_data(spec: DataSpec, seq_len: int, log: Any = None) -> Path:
    """The data_prep output for ``seq_len`` (built once, cached; one tokenizer for all N)."""
    out = data_dir(spec, seq_len)
    root = out.parent
    stamp = out / "sweep_data.json"
    if stamp.is_file():
        return out
    with _locked(root / ".lock"):
        if stamp.is_file():  # another process built it while we waited
            return out
        tok = root / "tokenizer.model"
        tmp = root / f".n{seq_len}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        cmd = [sys.executable, "-m", "data_prep", "--source", *spec.source, "--out", str(tmp)]
        cmd += ["--seq-len", str(seq_len), "--quiet", *spec.args]
        cmd += (
            ["--tokenizer", str(tok)] if tok.is_file() else ["--vocab-size", str(spec.vocab_size)]
        )
        if log:
            log(f"[data] N={seq_len}: {shlex.join(cmd)}")
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SweepError(
                f"data_prep for N={seq_len} failed ({proc.returncode}): {proc.stderr[-2000:]}"
            )
        if not tok.is_file():
            shutil.copyfile(tmp / "tokenizer.model", tok)
        (tmp / "sweep_data.json").write_text(
            json.dumps({"command": cmd, "seconds": time.perf_counter() - t0}, indent=2)
        )
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    return out


# ======================================================================================== runs
def run_dir(cfg: SweepConfig, point: Point) -> Path:
    """Where a point's trainer output and result.json live."""
    return cfg.out / "runs" / point.id


def point_overrides(cfg: SweepConfig, point: Point, data_path: Path) -> List[str]:
    """The trainer's ``key=value`` overrides for one point (base, variant, then per point)."""
    ov = list(cfg.base_overrides) + list(cfg.variants[point.variant].overrides)
    ov += [f"model.max_seq_len={point.seq_len}", f"optimizer.lr={point.lr}"]
    if point.k is not None:
        ov.append(f"model.k={point.k}")
    ov += [f"train.seed={point.seed}", f"data.path={data_path}"]
    ov += [f"logging.dir={run_dir(cfg, point)}", f"name={cfg.name}-{point.id}"]
    if cfg.tokens_per_step is not None:
        mb = max(1, cfg.tokens_per_step // point.seq_len)
        ov.append(f"train.micro_batch_size={mb}")
        if cfg.eval_tokens is not None:
            ov.append(f"train.eval_batches={max(1, cfg.eval_tokens // (mb * point.seq_len))}")
    return ov


def read_metrics(path: Path) -> List[dict]:
    """All records of a metrics.jsonl (tolerates a torn last line)."""
    out = []
    if not path.is_file():
        return out
    with open(path) as f:
        for line in f:
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
    return out


def classify(
    returncode: Optional[int], records: List[dict], max_loss: float, max_rise: float
) -> Dict[str, Any]:
    """Status (ok/diverged/failed), reason and summary numbers of one finished run."""
    evals = [r for r in records if r.get("split") == "eval"]
    trains = [r for r in records if r.get("split") == "train"]
    curve = [[r["step"], r["loss"], r.get("perplexity", _ppl(r["loss"]))] for r in evals]
    status, reason = "ok", ""
    bad_train = [r for r in trains if not math.isfinite(r["loss"])]
    bad_eval = [r for r in evals if not math.isfinite(r["loss"])]
    high = [r for r in trains + evals if math.isfinite(r["loss"]) and r["loss"] > max_loss]
    if returncode == EXIT_NONFINITE:
        status, reason = "diverged", "non-finite loss (trainer exit 3)"
    elif bad_train or bad_eval:
        r = (bad_train or bad_eval)[0]
        status, reason = "diverged", f"non-finite {r['split']} loss at step {r['step']}"
    elif high:
        r = high[0]
        status = "diverged"
        reason = f"{r['split']} loss {r['loss']:.3g} > {max_loss:.3g} at step {r['step']}"
    elif evals and min(e["loss"] for e in evals) + max_rise < evals[-1]["loss"]:
        best = min(e["loss"] for e in evals)
        status = "diverged"
        reason = f"final eval loss {evals[-1]['loss']:.3f} > best {best:.3f} + {max_rise}"
    elif returncode != 0:
        status, reason = "failed", f"trainer exit code {returncode}"
    finite = [e for e in evals if math.isfinite(e["loss"])]
    tps = [r["tokens_per_s"] for r in trains if "tokens_per_s" in r]
    return {
        "status": status,
        "reason": reason,
        "steps": max((r["step"] for r in records), default=0),
        "final_eval_loss": evals[-1]["loss"] if evals else None,
        "final_eval_ppl": _ppl(evals[-1]["loss"]) if evals else None,
        "best_eval_ppl": _ppl(min(e["loss"] for e in finite)) if finite else None,
        "final_eval_accuracy": evals[-1].get("mlm_accuracy") if evals else None,
        "final_train_loss": trains[-1]["loss"] if trains else None,
        "tokens_per_s": statistics.median(tps) if tps else None,
        "eval_curve": curve,
    }


def _ppl(loss: float) -> float:
    return math.exp(min(loss, 50.0)) if math.isfinite(loss) else float("inf")


def run_point(cfg: SweepConfig, point: Point, log: Any = print) -> Dict[str, Any]:
    """Train one point (unless already finished); writes and returns its result.json dict."""
    rdir = run_dir(cfg, point)
    result_path = rdir / "result.json"
    if result_path.is_file():
        old = json.loads(result_path.read_text())
        if old.get("status") in FINISHED:
            log(f"[skip] {point.id}: already {old['status']}")
            return old
    data_path = ensure_data(cfg.data, point.seq_len, log)
    if rdir.exists():  # an interrupted or failed attempt: start clean (metrics.jsonl appends)
        shutil.rmtree(rdir)
    rdir.mkdir(parents=True)
    cmd = [*cfg.launcher, str(PRETRAIN), "--config", str(cfg.base_config)]
    cmd += point_overrides(cfg, point, data_path)
    env = dict(os.environ, PYTHONUNBUFFERED="1", **cfg.env)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    log(f"[run] {point.index}: {point.id}")
    t0 = time.perf_counter()
    returncode: Optional[int]
    with open(rdir / "train.log", "w") as logf:
        logf.write("$ " + shlex.join(cmd) + "\n")
        logf.flush()
        try:
            proc = subprocess.run(
                cmd,
                cwd=REPO,
                env=env,
                stdout=logf,
                stderr=subprocess.STDOUT,
                timeout=cfg.point_timeout_s,
            )
            returncode = proc.returncode
        except subprocess.TimeoutExpired:
            returncode = None
    wall = time.perf_counter() - t0
    res = classify(
        returncode, read_metrics(rdir / "metrics.jsonl"), cfg.divergence_loss(), cfg.max_rise
    )
    if returncode is None and res["status"] == "ok":
        res["status"], res["reason"] = "failed", f"timeout after {cfg.point_timeout_s}s"
    if res["status"] == "failed":
        tail = (rdir / "train.log").read_text().splitlines()[-5:]
        res["reason"] += ": " + " | ".join(tail)[-500:]
    result = {
        **asdict(point),
        **res,
        "returncode": returncode,
        "wall_s": round(wall, 2),
        "command": shlex.join(cmd),
    }
    tmp = result_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    os.replace(tmp, result_path)
    ppl = result["final_eval_ppl"]
    log(
        f"[{result['status']}] {point.id}: {wall:.0f}s, final eval ppl "
        f"{'-' if ppl is None else f'{ppl:.4g}'} {result['reason']}"
    )
    return result


def run_sweep(
    cfg: SweepConfig,
    only: Optional[Sequence[int]] = None,
    max_minutes: Optional[float] = None,
    log: Any = print,
) -> List[Dict[str, Any]]:
    """Run the points in order (skipping finished ones); stop starting new ones after
    ``max_minutes``. Returns the result dicts of the points run or skipped."""
    points = cfg.points()
    if only is not None:
        points = [points[i] for i in only]
    t0 = time.perf_counter()
    results = []
    for p in points:
        if max_minutes is not None and (time.perf_counter() - t0) / 60 > max_minutes:
            log(f"[budget] {max_minutes} min spent; not starting {p.id} and later points")
            break
        results.append(run_point(cfg, p, log))
    return results


def collect(cfg: SweepConfig) -> List[Dict[str, Any]]:
    """result.json of every point (``status='pending'`` for points not run yet), in grid order."""
    out = []
    for p in cfg.points():
        path = run_dir(cfg, p) / "result.json"
        if path.is_file():
            res = json.loads(path.read_text())
            res["grids"] = p.grids
            out.append(res)
        else:
            out.append({**asdict(p), "status": "pending", "reason": "", "eval_curve": []})
    return out


# ======================================================================================= SLURM
def slurm_script(cfg: SweepConfig, config_path: str, python: str = sys.executable) -> str:
    """An sbatch array script: task SLURM_ARRAY_TASK_ID runs grid point of that index."""
    n = len(cfg.points())
    s = cfg.slurm
    lines = ["#!/bin/bash", f"#SBATCH --job-name={s.get('job_name', cfg.name)}"]
    parallel = s.get("max_parallel")
    lines.append(f"#SBATCH --array=0-{n - 1}" + (f"%{parallel}" if parallel else ""))
    lines.append(f"#SBATCH --output={cfg.out}/slurm/%A_%a.out")
    lines.append("#SBATCH --ntasks=1")
    for key, flag in (
        ("partition", "partition"),
        ("time", "time"),
        ("cpus_per_task", "cpus-per-task"),
        ("gres", "gres"),
        ("mem", "mem"),
    ):
        if s.get(key) is not None:
            lines.append(f"#SBATCH --{flag}={s[key]}")
    for extra in s.get("extra", []):
        lines.append(f"#SBATCH {extra}")
    lines += [
        "# Generated by studies/run_sweep.py --slurm; one grid point per array task.",
        f"# After all tasks: {shlex.quote(python)} {SWEEP_CLI} {shlex.quote(config_path)} "
        f"--out {shlex.quote(str(cfg.out))} --report-only",
        "set -euo pipefail",
        f"cd {shlex.quote(str(REPO))}",
    ]
    for k, v in sorted(cfg.env.items()):
        lines.append(f"export {k}={shlex.quote(v)}")
    lines.append(
        f"exec {shlex.quote(python)} {shlex.quote(str(SWEEP_CLI))} {shlex.quote(config_path)} "
        f"--out {shlex.quote(str(cfg.out))} "
        '--point "${SLURM_ARRAY_TASK_ID:?run this script as a SLURM array task}"'
    )
    return "\n".join(lines) + "\n"


def write_slurm(cfg: SweepConfig, config_path: str) -> Path:
    """Write ``<out>/sweep_array.sbatch`` (and the slurm log folder); returns its path."""
    (cfg.out / "slurm").mkdir(parents=True, exist_ok=True)
    path = cfg.out / "sweep_array.sbatch"
    path.write_text(slurm_script(cfg, str(Path(config_path).resolve())))
    path.chmod(0o755)
    return path


# ====================================================================================== report
def _fmt(x: Optional[float], spec: str = ".4g") -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return format(x, spec)


def report_table(results: List[Dict[str, Any]]) -> str:
    """Markdown table: one row per point, diverged/failed marked in the status column."""
    head = (
        "| run | grid | variant | N | k | lr | seed | steps | final val loss | final val ppl "
        "| best val ppl | train tok/s | wall s | status |"
    )
    rows = [head, "|" + "---|" * 14]
    for r in results:
        status = r["status"] + (f" ({r['reason']})" if r.get("reason") else "")
        if r["status"] in ("diverged", "failed"):
            status = f"**{status.replace('|', '/')}**"
        rows.append(
            f"| {r['id']} | {','.join(r['grids'])} | {r['variant']} | {r['seq_len']} | "
            f"{r['k'] if r['k'] is not None else '-'} | {r['lr']:g} | {r['seed']} | "
            f"{r.get('steps', '-')} | {_fmt(r.get('final_eval_loss'), '.4f')} | "
            f"{_fmt(r.get('final_eval_ppl'), '.2f')} | {_fmt(r.get('best_eval_ppl'), '.2f')} | "
            f"{_fmt(r.get('tokens_per_s'), '.0f')} | {_fmt(r.get('wall_s'), '.0f')} | {status} |"
        )
    return "\n".join(rows) + "\n"


def pivot_tables(results: List[Dict[str, Any]]) -> str:
    """Markdown: final validation perplexity against N, k and lr; one row per series (variant,
    the other axes and the seed) that has at least two values of that axis."""
    out = []
    done = [r for r in results if r["status"] in FINISHED]
    for axis, title in (("seq_len", "N"), ("k", "k"), ("lr", "learning rate")):
        series = _series(done, axis)
        if not series:
            continue
        xs = sorted({x for s in series.values() for x in s if x is not None})
        names = [a for a in ("variant", "seq_len", "k", "lr", "seed") if a != axis]
        out += [f"Final validation perplexity vs {title}:", ""]
        out.append("| series | " + " | ".join(f"{title}={x:g}" for x in xs) + " |")
        out.append("|" + "---|" * (len(xs) + 1))
        for key, by_x in series.items():
            label = ", ".join(
                str(v) if n == "variant" else f"{n}={v:g}"
                for n, v in zip(names, key)
                if v is not None
            )
            cells = []
            for x in xs:
                runs = by_x.get(x, [])
                oks = [r["final_eval_ppl"] for r in runs if r["status"] == "ok"]
                div = sum(r["status"] == "diverged" for r in runs)
                cell = f"{statistics.mean(oks):.1f}" if oks else ""
                if div:
                    cell += f" (**{div}/{len(runs)} diverged**)" if oks else "**DIVERGED**"
                elif len(oks) > 1:
                    cell += f" (n={len(oks)})"
                cells.append(cell or "-")
            out.append(f"| {label} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out) + "\n"


def _series(results: List[Dict[str, Any]], axis: str) -> Dict[tuple, Dict[Any, List[dict]]]:
    """Group finished results by everything but ``axis``: key -> axis value -> runs (one series
    per seed: seeds shift all variants alike, so a mean over unequal seed sets would mislead)."""
    keys = [a for a in ("variant", "seq_len", "k", "lr", "seed") if a != axis]
    out: Dict[tuple, Dict[Any, List[dict]]] = {}
    for r in results:
        if r["status"] not in FINISHED:
            continue
        key = tuple(r[a] for a in keys)
        out.setdefault(key, {}).setdefault(r[axis], []).append(r)
    return {k: v for k, v in out.items() if len(v) >= 2}


def make_plots(results: List[Dict[str, Any]], out_dir: Path) -> List[Path]:
    """PNG plots: val perplexity vs step per variant; final val perplexity vs N, k and lr."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    done = [r for r in results if r["status"] in FINISHED]
    variants = list(dict.fromkeys(r["variant"] for r in results))
    colors = {v: f"C{i}" for i, v in enumerate(variants)}

    # 1. curves: one panel per variant
    if done:
        vs = [v for v in variants if any(r["variant"] == v for r in done)]
        cols = min(2, len(vs))
        rows = math.ceil(len(vs) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.2 * rows), squeeze=False)
        for ax, v in zip(axes.flat, vs):
            for r in (r for r in done if r["variant"] == v):
                pts = [(s, p) for s, _, p in r["eval_curve"] if p is not None]
                if not pts:
                    continue
                kk = f" k={r['k']}" if r["k"] is not None else ""
                label = f"N={r['seq_len']}{kk} lr={r['lr']:g} s{r['seed']}"
                div = r["status"] == "diverged"
                ys = [min(p, 1e6) for _, p in pts]
                (line,) = ax.plot(
                    [s for s, _ in pts],
                    ys,
                    ls="--" if div else "-",
                    marker=".",
                    label=label + (" DIVERGED" if div else ""),
                )
                if div:
                    ax.plot(pts[-1][0], ys[-1], "x", color="red", ms=10, mew=2)
            ax.set_title(v)
            ax.set_xlabel("step")
            ax.set_ylabel("validation perplexity")
            ax.set_yscale("log")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)
        for ax in list(axes.flat)[len(vs) :]:
            ax.axis("off")
        fig.tight_layout()
        path = out_dir / "val_ppl_vs_step.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    # 2-4. final perplexity against one axis
    for axis, xlabel, logx in (
        ("seq_len", "sequence length N", True),
        ("k", "k", True),
        ("lr", "learning rate", True),
    ):
        series = _series(done, axis)
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        top = max(
            (
                r["final_eval_ppl"]
                for by_x in series.values()
                for runs in by_x.values()
                for r in runs
                if r["status"] == "ok"
            ),
            default=1.0,
        )
        for key, by_x in series.items():
            xs = sorted(by_x)
            ys, div_x = [], []
            for x in xs:
                runs = by_x[x]
                oks = [r["final_eval_ppl"] for r in runs if r["status"] == "ok"]
                ys.append(statistics.mean(oks) if oks else float("nan"))
                if any(r["status"] == "diverged" for r in runs):
                    div_x.append(x)
            names = [a for a in ("variant", "seq_len", "k", "lr", "seed") if a != axis]
            label = " ".join(
                f"{n}={v}" if n != "variant" else str(v)
                for n, v in zip(names, key)
                if v is not None
            )
            color = colors[key[0]]
            ax.plot(
                xs,
                ys,
                marker="o",
                color=color,
                label=label,
                ls="-" if "layerwise" in key[0] or key[0] == "dense" else "--",
            )
            if div_x:
                ax.plot(div_x, [top * 1.15] * len(div_x), "x", color=color, ms=11, mew=2.5)
        if axis == "k":  # dense at the same (N, lr) as a k series: a horizontal reference
            shown = {(key[1], key[2], key[3]) for key in series}
            for r in done:
                where = (r["seq_len"], r["lr"], r["seed"])
                if r["k"] is None and r["status"] == "ok" and where in shown:
                    ax.axhline(
                        r["final_eval_ppl"],
                        color=colors[r["variant"]],
                        ls=":",
                        lw=1,
                        label=f"{r['variant']} N={r['seq_len']} lr={r['lr']:g} seed={r['seed']}",
                    )
        ax.set_xlabel(f"{xlabel}  (x at the top: diverged)")
        ax.set_ylabel("final validation perplexity")
        if logx:
            ax.set_xscale("log", base=2 if axis != "lr" else 10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
        name = {
            "seq_len": "final_ppl_vs_n.png",
            "k": "final_ppl_vs_k.png",
            "lr": "final_ppl_vs_lr.png",
        }[axis]
        path = out_dir / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def data_dir(spec: DataSpec, seq_len: int) -> Path:
    """Where ``ensure_data`` puts (or put) the data_prep output for ``seq_len``."""
    key = "_".join(Path(x).name for x in spec.source)
    return Path(spec.cache_dir) / f"{key}-{_data_key(spec)}" / f"n{seq_len}"


def unigram_perplexity(path: Path, eval_tokens: Optional[int] = None) -> float:
    """Perplexity of the train split's token frequencies (add-0.5) on the validation tokens
    that MLM can mask (special ids excluded), the first ``eval_tokens`` of them: the level a
    model reaches by predicting without context."""
    import numpy as np

    m = json.loads((path / "manifest.json").read_text())
    special = sorted(set(m["special_ids"].values()))
    v = int(m["vocab_size"])

    def tokens(split: str) -> "np.ndarray":
        files = [path / s["file"] for s in m["splits"][split]["shards"]]
        return np.concatenate([np.load(f).ravel() for f in files]).astype(np.int64)

    counts = np.bincount(tokens("train"), minlength=v).astype(np.float64) + 0.5
    counts[special] = 0.0  # never an MLM target
    p = counts / counts.sum()
    valid = tokens("valid")
    if eval_tokens is not None:
        valid = valid[:eval_tokens]
    valid = valid[~np.isin(valid, special)]
    return float(math.exp(-np.log(p[valid]).mean()))


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def write_report(cfg: SweepConfig, report_dir: Optional[Path] = None, plots: bool = True) -> Path:
    """results.json, results.csv, report.md and PNG plots under ``report_dir``."""
    rdir = Path(report_dir) if report_dir else cfg.out / "report"
    rdir.mkdir(parents=True, exist_ok=True)
    results = collect(cfg)
    (rdir / "results.json").write_text(json.dumps(results, indent=1))
    cols = [
        "id",
        "grids",
        "variant",
        "seq_len",
        "k",
        "lr",
        "seed",
        "status",
        "reason",
        "steps",
        "final_eval_loss",
        "final_eval_ppl",
        "best_eval_ppl",
        "final_eval_accuracy",
        "tokens_per_s",
        "wall_s",
    ]
    with open(rdir / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for r in results:
            w.writerow([",".join(r[c]) if c == "grids" else r.get(c, "") for c in cols])
    pngs = make_plots(results, rdir) if plots else []
    counts = {
        s: sum(r["status"] == s for r in results) for s in ("ok", "diverged", "failed", "pending")
    }
    md = [
        f"# Sweep report: {cfg.name}",
        "",
        f"Sweep file: `{_rel(cfg.path)}`; runs: `{_rel(cfg.out / 'runs')}`.",
        "",
        "Points: " + ", ".join(f"{v} {k}" for k, v in counts.items()) + ".",
        "",
        report_table(results),
    ]
    built = [
        n
        for n in sorted({r["seq_len"] for r in results})
        if (data_dir(cfg.data, n) / "manifest.json").is_file()
    ]
    if built:
        ppl = unigram_perplexity(data_dir(cfg.data, built[0]), cfg.eval_tokens)
        md += [
            f"Context-free reference: the unigram perplexity of the training split on the "
            f"validation tokens (N={built[0]} data) is {ppl:.1f}.",
            "",
        ]
    md += [pivot_tables(results)]
    md += [f"![{p.stem}]({p.name})" for p in pngs]
    path = rdir / "report.md"
    path.write_text("\n".join(md) + "\n")
    return path


# ============================================================================= inference timing
def time_inference(
    seq_lens: Sequence[int],
    variants: Dict[str, Dict[str, Any]],
    model: Dict[str, Any],
    batch: int = 4,
    iters: int = 3,
    warmup: int = 1,
    dtype: str = "bf16",
    threads: Optional[int] = None,
    stat: str = "min",
) -> List[Dict[str, Any]]:
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
        times: Dict[str, List[float]] = {name: [] for name in models}
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


def inference_table(rows: List[Dict[str, Any]]) -> str:
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
