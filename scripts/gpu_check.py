"""The steps of the GPU check (docs/gpu.md), each under a hard time budget.

    python scripts/gpu_check.py OUT [--dry-run] [--only STEP ...] [--skip STEP ...]

Normally started by ``bash scripts/gpu_check.sh OUT`` (which installs the carried wheels first).
Steps, in order (GPU budgets in seconds; the sweep gets what is left, minus a reserve):

    data        the carried shards (GPU) / tiny stdlib shards built now (dry run)
    env         versions, GPU, driver; imports of deepspeed, omegaconf, datasets, pydantic
    tests       pytest -m gpu tests/test_gpu.py
    main        deepspeed launch/pretrain.py --config configs/base_4096.yaml, 300 steps (host
                synchronisations of two steps counted, with their step times)
    bench       bash bench/gpu_bench.sh, trimmed
    peer        bench/peer_bench.py: ours against lucidrains' linformer in every sharing mode
                and our dense model against Hugging Face BERT (SDPA), at equal work, N = 4096
                and 16384 (issue 31's CPU comparison, on the GPU)
    sweep       configs/sweeps/gpu_quality.yaml, several points at a time on the one GPU
    optimizers  (alongside the sweep) the main job with DeepSpeed's FusedAdam (nvcc JIT, built in
                the background from the start) and with torch's unfused AdamW (fused=false)

Every step writes its numbers to OUT/results.json as soon as it ends, so a failure or a kill
later keeps what came before. At the end OUT holds results.json, report.md (scripts/
gpu_report.py) and artifacts.tar.gz (logs, metrics, benchmark and sweep outputs); the shell
wrapper adds gpu_check.log. ``--dry-run`` runs every step on the CPU at tiny sizes (CI: tests/
test_gpu_kit.py) with no time budget: its work is fixed (2 sweep points, 6 main-job steps, ...)
and every step runs to its end, so a slow or loaded machine takes longer but finishes the same
work; the budgets and the hard limit are the GPU's. With no clock to share, the dry run runs the
steps that need no other (env, tests, bench, peer) in a second thread beside data -> main ->
sweep; the GPU run takes one step at a time. Exit status: 0 when every step that ran
passed, 1 otherwise, 2 bad input.
"""

import argparse
import datetime
import json
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from linformer_ds.dist_env import free_port, without_launcher_vars  # noqa: E402
from linformer_ds.fsio import atomic_write_text, read_jsonl  # noqa: E402
from studies import sweep  # noqa: E402

STEPS = ("data", "env", "tests", "main", "bench", "peer", "sweep", "optimizers")
SWEEP_FILE = REPO / "configs" / "sweeps" / "gpu_quality.yaml"
MAIN_CONFIG = REPO / "configs" / "base_4096.yaml"
# Seconds per step. GPU: 9 minutes in all with the wheel install (bash wrapper, ~15 s).
# The sweep gets what is left (at least its figure here, when every step before it uses all of
# its budget); the wrapper's hard limit (575 s) leaves room for report and tarball overruns.
# The dry run has none: its work is fixed and every step runs to its end (no clock in CI).
BUDGETS = {
    "gpu": {"data": 5, "env": 20, "tests": 60, "main": 100, "bench": 90, "peer": 45, "sweep": 180},
}
TOTAL_BUDGET_S = {"gpu": 525}
RESERVE_S = 25  # kept back from the sweep for its report, the tarball and report.md
SWEEP_WORKERS = {"gpu": 12, "dry": 2}  # GPU: 16 CPU cores; 2 waves of the 24 points
MAIN_STEPS = {"gpu": 300, "dry": 6}
LOG_INTERVAL = {"gpu": 25, "dry": 2}
OPT_STEPS = {"gpu": 25, "dry": 4}  # inside the warm-up (30 steps): the main job's LR at each step
# Steps of the main job counted for host synchronisations (debug.sync_log), and the step
# after them timed uncounted: inside the first logged interval, which the medians leave out.
SYNC_STEPS = {"gpu": (5, 6), "dry": (2,)}
JIT_BUDGET_S = 240  # FusedAdam's nvcc build, in the background

# Tiny sizes of the dry run (CPU): the main job and the sweep shrink to these.
DRY_MODEL = [
    "model.vocab_size=1000",
    "model.max_seq_len=128",
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.intermediate_size=128",
    "model.k=32",
]
DRY_N = 128


class KitError(ValueError):
    """Bad input or a missing prerequisite; the message says which."""


# ======================================================================================= helpers
def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the whole process group of ``proc`` (its children too: the trainer takes SIGTERM
    as "checkpoint at the next step boundary", which a budget cannot wait for)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


CHILDREN: list[subprocess.Popen] = []  # every process group started, for the SIGTERM handler


def on_sigterm(signum: int, frame: Any) -> None:  # noqa: ARG001
    """The wrapper's hard limit: take every child group down too, then leave (results.json
    already holds the steps that ended)."""
    for proc in CHILDREN:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    print("[gpu_check] SIGTERM: child processes killed; results.json has the finished steps")
    sys.stdout.flush()
    os._exit(124)


def start(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """Start ``cmd`` in its own process group (so a budget kill takes its children too)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    f = open(log, "w")
    f.write("$ " + shlex.join(cmd) + "\n")
    f.flush()
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
    )
    proc.log_file = f  # type: ignore[attr-defined]
    CHILDREN.append(proc)
    return proc


def finish(proc: subprocess.Popen, timeout: float | None) -> dict[str, Any]:
    """Wait up to ``timeout`` s (None or inf: to its end); kill the group past it. Returns
    returncode/timed_out."""
    timed_out = False
    if timeout is not None and math.isinf(timeout):
        timeout = None
    try:
        proc.wait(timeout=None if timeout is None else max(timeout, 0.1))
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_group(proc)
    proc.log_file.close()  # type: ignore[attr-defined]
    return {"returncode": None if timed_out else proc.returncode, "timed_out": timed_out}


def run(cmd: list[str], log: Path, env: dict[str, str], timeout: float | None) -> dict[str, Any]:
    """Run ``cmd`` to its end or to ``timeout`` seconds; output goes to ``log``."""
    t0 = time.perf_counter()
    res = finish(start(cmd, log, env), timeout)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    return res


def tail(path: Path, lines: int = 15) -> str:
    """The last ``lines`` lines of a text file ('' if missing)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


# ============================================================================================ kit
class Kit:
    """State of one check: options, budgets, the results dict and where things go."""

    def __init__(self, args: argparse.Namespace):
        self.dry = args.dry_run
        self.mode = "dry" if self.dry else "gpu"
        self.out = Path(args.out).resolve()
        self.work = Path(args.work or tempfile.mkdtemp(prefix="gpu_check_")).resolve()
        self.py = sys.executable
        self.clocked = not self.dry  # the dry run: no budgets, every step runs to its end
        self.budgets = dict(BUDGETS[self.mode]) if self.clocked else {}
        self.total = (args.total_budget_s or TOTAL_BUDGET_S[self.mode]) if self.clocked else None
        self.workers = args.workers or SWEEP_WORKERS[self.mode]
        self.steps = [s for s in STEPS if (not args.only or s in args.only) and s not in args.skip]
        self.t0 = time.perf_counter()
        self.lock = threading.Lock()
        self.sweep_cfg: sweep.SweepConfig | None = None
        self.main_data: Path | None = None
        self.jit: subprocess.Popen | None = None
        self.results: dict[str, Any] = {
            "kit_version": 1,
            "dry_run": self.dry,
            "started_utc": utc_now(),
            "command": shlex.join([Path(self.py).name, *sys.argv]),
            "budgets_s": {
                **self.budgets,
                "total": self.total,
                "reserve": RESERVE_S if self.clocked else None,
            },
            "steps": {},
        }

    # ---------------------------------------------------------------------------- bookkeeping
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        """Seconds of the total budget left (inf in the dry run: no budget)."""
        return math.inf if self.total is None else self.total - self.elapsed()

    def save(self) -> None:
        """results.json, written atomically (a kill never leaves half a file)."""
        self.out.mkdir(parents=True, exist_ok=True)
        with self.lock:  # the dry run's two lanes of steps (main()) write from two threads
            self.results["elapsed_s"] = round(self.elapsed(), 1)
            text = json.dumps(self.results, indent=1, default=str) + "\n"
            atomic_write_text(self.out / "results.json", text)

    def env(self, **extra: str) -> dict[str, str]:
        """Environment of child processes: the repo importable; CPU accelerator in the dry run."""
        env = without_launcher_vars(os.environ)
        env.update(PYTHONUNBUFFERED="1", **extra)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        )
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one machine: gloo over loopback
        if self.dry:
            env["DS_ACCELERATOR"] = "cpu"
        elif env.get("DS_ACCELERATOR") == "cpu":
            env.pop("DS_ACCELERATOR")
        return env

    def log(self, msg: str) -> None:
        print(f"[gpu_check {self.elapsed():5.0f}s] {msg}", flush=True)

    def step(self, name: str, fn: Callable[[float | None], dict[str, Any]]) -> None:
        """Run one step under its budget; record status, seconds and its numbers."""
        if name not in self.steps:
            return
        budget: float | None = None  # the dry run: no budget, the step runs to its end
        if self.clocked:
            budget = self.budgets.get(name, 0)
            if name == "sweep":
                budget = self.left() - RESERVE_S
            budget = min(budget, self.left() - RESERVE_S)
        rec: dict[str, Any] = {"budget_s": None if budget is None else round(budget, 1)}
        if budget is not None and budget < 5:
            rec.update(status="skipped", reason=f"only {self.left():.0f}s of the total left")
            with self.lock:
                self.results["steps"][name] = rec
            self.save()
            self.log(f"{name}: skipped ({rec['reason']})")
            return
        self.log(f"{name}: start ({'no budget' if budget is None else f'budget {budget:.0f}s'})")
        t0 = time.perf_counter()
        try:
            rec.update(fn(budget))
        except KitError as e:
            rec.update(status="failed", reason=str(e))
        except Exception as e:  # noqa: BLE001 - one step's bug must not lose the others
            rec.update(status="failed", reason=f"{type(e).__name__}: {e}")
        rec["seconds"] = round(time.perf_counter() - t0, 1)
        rec.setdefault("status", "ok")
        with self.lock:
            self.results["steps"][name] = rec
        self.save()
        self.log(f"{name}: {rec['status']} in {rec['seconds']:.0f}s {rec.get('reason', '')}")

    # ================================================================================ steps
    def do_data(self, budget: float | None) -> dict[str, Any]:
        """The shards: carried ones (GPU), or tiny stdlib ones made now (dry run)."""
        if not self.dry:
            cfg = sweep.load_sweep(str(SWEEP_FILE), out=str(self.work / "sweep"))
            self.sweep_cfg = cfg
            rec: dict[str, Any] = {"cache_dir": str(cfg.data.cache_dir), "splits": {}}
            for n in sorted({p.seq_len for p in cfg.points()}):
                path = sweep.data_dir(cfg.data, n)
                if not (path / "sweep_data.json").is_file():
                    raise KitError(
                        f"carried shards missing: {path} (run scripts/make_gpu_corpus.sh here, "
                        "and carry gpu_carry)"
                    )
                m = json.loads((path / "manifest.json").read_text())
                rec["splits"][n] = {s: m["splits"][s]["rows"] for s in m["splits"]}
            self.main_data = sweep.data_dir(cfg.data, 4096)
            return rec
        path = dry_sweep_file(self.work)
        cfg = sweep.load_sweep(str(path), out=str(self.work / "sweep"))
        self.sweep_cfg = cfg
        t0 = time.perf_counter()
        self.main_data = sweep.ensure_data(cfg.data, DRY_N, log=self.log)
        m = json.loads((self.main_data / "manifest.json").read_text())
        return {
            "sweep_file": str(path),
            "splits": {DRY_N: {s: m["splits"][s]["rows"] for s in m["splits"]}},
            "build_s": round(time.perf_counter() - t0, 1),
        }

    def do_env(self, budget: float | None) -> dict[str, Any]:
        """Versions and devices, from a child process (this one never touches CUDA)."""
        log = self.work / "env.log"
        res = run([self.py, "-c", ENV_PROBE], log, self.env(), budget)
        lines = [ln for ln in log.read_text().splitlines() if ln.startswith("ENV ")]
        if not lines:
            raise KitError(f"environment probe failed: {tail(log, 8)}")
        info = json.loads(lines[-1][4:])
        with self.lock:
            self.results["environment"] = info
        bad = {k: v for k, v in info["imports"].items() if not v.startswith("ok")}
        rec: dict[str, Any] = {"returncode": res["returncode"]}
        if bad:
            rec.update(status="failed", reason=f"imports failed: {bad}")
        elif not self.dry and not info.get("cuda_available"):
            rec.update(status="failed", reason="torch sees no CUDA device")
        if not self.dry and "optimizers" in self.steps:  # FusedAdam's JIT build, meanwhile
            self.jit = start(
                [self.py, "-c", JIT_BUILD],
                self.work / "optimizers" / "jit_build.log",
                self.jit_env(),
            )
        return rec

    def jit_env(self) -> dict[str, str]:
        return self.env(TORCH_EXTENSIONS_DIR=str(self.work / "torch_extensions"), MAX_JOBS="8")

    def do_tests(self, budget: float | None) -> dict[str, Any]:
        """pytest -m gpu on the device (CUDA; the CPU versions in the dry run)."""
        d = self.work / "tests"
        d.mkdir(parents=True, exist_ok=True)
        junit, record = d / "junit.xml", d / "record.jsonl"
        record.unlink(missing_ok=True)
        cmd = [self.py, "-m", "pytest", "-m", "gpu", "tests/test_gpu.py", "-q", "-rfE"]
        cmd += ["-p", "no:cacheprovider", f"--junitxml={junit}"]
        env = self.env(
            LINFORMER_GPU_TEST_DEVICE="cpu" if self.dry else "cuda",
            LINFORMER_GPU_TEST_RECORD=str(record),
        )
        res = run(cmd, d / "pytest.log", env, budget)
        rec: dict[str, Any] = {**res, "command": shlex.join(cmd[1:]), **parse_junit(junit)}
        rec["measured"] = read_jsonl(record)
        if res["timed_out"]:
            rec.update(status="timeout", reason=f"pytest passed the {budget:.0f}s budget")
        elif res["returncode"] != 0 or not rec.get("passed"):
            rec.update(
                status="failed",
                reason=f"{rec.get('failed', '?')} failed: {tail(d / 'pytest.log', 6)}",
            )
        return rec

    def main_overrides(self, steps: int, logdir: Path) -> list[str]:
        """The main job's overrides: few steps, the carried (or tiny) data, no checkpoints."""
        assert self.main_data is not None
        ov = [
            f"data.path={self.main_data}",
            f"train.max_steps={steps}",
            "train.gradient_accumulation_steps=1",
            f"train.log_interval={LOG_INTERVAL[self.mode]}",
            "train.eval_interval=0",
            "scheduler.warmup_steps=30",
            f"logging.dir={logdir}",
            "logging.tensorboard=false",
            "checkpoint.save_interval=0",
            "checkpoint.save_final=false",
            "checkpoint.resume=never",
        ]
        if self.dry:  # the GEMM peak is measured as on the GPU (the probe keeps to ~3 s)
            ov += DRY_MODEL + ["train.micro_batch_size=2"]
        return ov

    def launch_main(
        self, name: str, steps: int, extra: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        """``deepspeed launch/pretrain.py --config configs/base_4096.yaml ...`` on one device."""
        logdir = self.work / name
        cmd = [self.py, "-m", "deepspeed.launcher.runner", "--num_gpus", "1"]
        cmd += ["--master_port", str(free_port())]
        cmd += ["launch/pretrain.py"]
        cmd += ["--config", str(MAIN_CONFIG.relative_to(REPO))]
        cmd += self.main_overrides(steps, logdir) + extra
        # TORCH_EXTENSIONS_DIR: where the env step's background build put FusedAdam
        return start(cmd, self.work / f"{name}.log", {**self.jit_env(), **(env or {})})

    def do_main(self, budget: float | None) -> dict[str, Any]:
        """The main job: tokens/s, MFU against the trainer's GEMM peak, peak memory, loss, and
        the host synchronisations of a few steps (the trainer's debug.sync_log hook)."""
        t0 = time.perf_counter()
        syncs = self.work / "main" / "syncs"
        hook = [f"debug.sync_log={syncs}",
                f"debug.sync_steps=[{','.join(map(str, SYNC_STEPS[self.mode]))}]"]  # fmt: skip
        proc = self.launch_main("main", MAIN_STEPS[self.mode], hook)
        res = finish(proc, budget)
        res["seconds"] = round(time.perf_counter() - t0, 1)
        rec = {**res, "command": "deepspeed " + shlex.join(proc.args[3:])}  # type: ignore[index]
        rec.update(main_metrics(self.work / "main", self.work / "main.log"))
        rec["plan"] = plan_beside(self.work / "main", rec, "cpu" if self.dry else "cuda")
        if rec["plan"].get("predicted_peak_gib") is not None:
            p = rec["plan"]
            self.log(f"main: plan {p['predicted_peak_gib']:.2f} GiB peak, measured "
                     f"{p['measured_peak_gib']:.2f} GiB (ratio {p['peak_ratio']})")  # fmt: skip
        rec["syncs"] = sync_counts(syncs / "syncs.rank0.jsonl")
        if res["timed_out"]:
            rec.update(status="timeout", reason=f"stopped at the {budget:.0f}s budget")
        elif res["returncode"] != 0:
            rec.update(status="failed", reason=tail(self.work / "main.log", 8))
        elif not rec.get("logged_steps"):
            rec.update(status="failed", reason="the trainer logged no step")
        return rec

    def do_bench(self, budget: float | None) -> dict[str, Any]:
        """bench/gpu_bench.sh, trimmed (dry run: tiny CPU sizes)."""
        d = self.work / "bench"
        cmd = ["bash", "bench/gpu_bench.sh", str(d)]
        env = self.env(PYTHON=self.py)
        if self.dry:
            env["GPU_BENCH_ALLOW_CPU"] = "1"
            cmd += ["--device", "cpu", "--layers", "1", "--hidden", "64", "--heads", "2"]
            cmd += ["--k", "16", "--intermediate", "128", "--vocab", "500", "--tokens", "256"]
            cmd += ["--seq-lens", "64", "128", "--warmup", "1", "--iters", "1"]
            cmd += ["--gemm-n", "256", "--gemm-reps", "2", "--no-plots"]
            cmd += ["--step-budget-s", "inf"]  # no clock: every variant runs at both N
        else:
            cmd += ["--seq-lens", "1024", "4096", "16384", "32768", "--warmup", "2", "--iters", "5"]
        res = run(cmd, self.work / "bench.log", env, budget)
        rec: dict[str, Any] = {**res, "command": shlex.join(cmd)}
        path = d / "results.json"
        if path.is_file():
            b = json.loads(path.read_text())
            keys = ("variant", "n", "batch", "step_s", "tokens_per_s", "mfu", "peak_mem_mib")
            rec["rows"] = [
                {k: r.get(k) for k in keys} | {"skipped": r["skipped"]} for r in b["rows"]
            ]
            rec["gemm_peak_tflops"] = b["gemm_peak_flops"] / 1e12
            rec["summary"] = b["summary"]
            rec["table_md"] = (d / "results.md").read_text() if (d / "results.md").is_file() else ""
        if res["timed_out"]:
            rec.update(status="timeout", reason=f"stopped at the {budget:.0f}s budget")
        elif res["returncode"] != 0 or "rows" not in rec:
            rec.update(status="failed", reason=tail(self.work / "bench.log", 8))
        return rec

    # the peer comparison's two runs: (out folder, models, sharing modes)
    PEER_RUNS = (
        ("peer", ["ours", "lucidrains", "ours-trainer"], ["none", "headwise", "kv", "layerwise"]),
        ("peer_dense", ["ours-dense", "hf-bert"], ["headwise"]),
    )

    def do_peer(self, budget: float | None) -> dict[str, Any]:
        """bench.peer_bench at equal work: every sharing mode against lucidrains, then the dense
        pair (ours vs HF BERT SDPA). GPU: N = 4096 and 16384, the issue's sizes, the models of
        a group in this one process (``--isolation shared``: the GPU's memory holds them all,
        and a spawned process per model would spend the budget on CUDA start-ups); dry run:
        tiny CPU sizes."""
        rec: dict[str, Any] = {"runs": {}}
        end = None if budget is None else time.perf_counter() + budget
        for name, models, sharings in self.PEER_RUNS:
            d = self.work / name
            cmd = [self.py, "-m", "bench.peer_bench", "--out", str(d), "--models", *models,
                   "--sharings", *sharings, "--isolation", "shared"]  # fmt: skip
            if self.dry:
                cmd += ["--device", "cpu", "--seq-lens", "64", "--layers", "1", "--hidden", "32"]
                cmd += ["--heads", "2", "--k", "16", "--intermediate", "128", "--vocab", "500"]
                cmd += ["--warmup", "0", "--iters", "1", "--gemm-n", "128"]
                cmd += ["--gemm-budget-s", "0.2"]
            else:
                cmd += ["--device", "cuda", "--seq-lens", "4096", "16384", "--warmup", "2"]
                cmd += ["--iters", "5", "--gemm-n", "8192", "--gemm-budget-s", "3"]
            left = None if end is None else end - time.perf_counter()
            if left is not None and left < 5:
                rec["runs"][name] = {"status": "skipped", "reason": "no budget left"}
                continue
            res = run(cmd, self.work / f"{name}.log", self.env(), left)
            run_rec: dict[str, Any] = {**res, "command": shlex.join(cmd[1:])}
            path = d / "results.json"
            if not path.is_file():  # cut short: the groups that finished (written after each)
                path = d / "partial.json"
            if path.is_file():
                b = json.loads(path.read_text())
                keys = ("n", "sharing", "model", "step_s_median", "tokens_per_s", "mfu",
                        "speedup_vs_lucidrains", "speedup_vs_hf_bert", "equal_work")  # fmt: skip
                run_rec["rows"] = [{k: r.get(k) for k in keys} for r in b["rows"]]
                md = d / "results.md"
                run_rec["table_md"] = md.read_text() if md.is_file() else ""
            if res["timed_out"]:
                run_rec.update(status="timeout", reason="stopped at the step's budget")
            elif res["returncode"] != 0 or "rows" not in run_rec:
                run_rec.update(status="failed", reason=tail(self.work / f"{name}.log", 8))
            else:
                run_rec["status"] = "ok"
            rec["runs"][name] = run_rec
        bad = {k: v["status"] for k, v in rec["runs"].items() if v["status"] != "ok"}
        if bad:
            rec.update(status="failed" if "failed" in bad.values() else "timeout",
                       reason=", ".join(f"{k}: {v}" for k, v in bad.items()))  # fmt: skip
        return rec

    def do_sweep(self, budget: float | None) -> dict[str, Any]:
        """The quality sweep, ``workers`` points at a time; the optimizers step runs alongside."""
        cfg = self.sweep_cfg
        if cfg is None:
            raise KitError("the data step did not run or failed: no sweep config")
        # 20 s for the report; the dry run: no deadline (every point runs, to its end)
        deadline = math.inf if budget is None else time.perf_counter() + budget - 20
        opt = OptimizerChecks(self) if "optimizers" in self.steps else None
        runs = run_points(self, cfg, deadline, opt)
        if opt is not None:
            rec_opt = opt.finish(deadline)
            with self.lock:
                self.results["steps"]["optimizers"] = rec_opt
            self.save()
        report_dir = cfg.out / "report"
        rep = run(
            [self.py, str(sweep.SWEEP_CLI), str(cfg.path), "--out", str(cfg.out), "--report-only",
             "--report-dir", str(report_dir)],
            self.work / "sweep_report.log",
            self.env(),
            max(10.0, deadline + 20 - time.perf_counter()),
        )  # fmt: skip
        rec: dict[str, Any] = {
            "sweep_file": sweep.display_path(cfg.path),
            "workers": self.workers,
            "points": len(cfg.points()),
            "runs": runs,
            "report_returncode": rep["returncode"],
        }
        rec.update(summarize_sweep(cfg))
        done = rec["status_counts"]
        if done.get("failed") or done.get("pending"):
            rec.update(
                status="partial" if done.get("ok") else "failed",
                reason=", ".join(f"{v} {k}" for k, v in done.items()),
            )
        return rec

    def finish_up(self) -> int:
        """report.md, artifacts.tar.gz; the exit status."""
        if self.jit is not None and self.jit.poll() is None:
            kill_group(self.jit)
        self.results["finished_utc"] = utc_now()
        self.save()
        rep = run(
            [self.py, str(REPO / "scripts" / "gpu_report.py"), str(self.out), "--out",
             str(self.out / "report.md")],
            self.work / "report.log",
            self.env(),
            60 if self.clocked else None,
        )  # fmt: skip
        if rep["returncode"] != 0:
            self.log(f"gpu_report.py failed: {tail(self.work / 'report.log', 5)}")
        pack(self.work, self.out / "artifacts.tar.gz")
        statuses = {k: v["status"] for k, v in self.results["steps"].items()}
        self.log(f"done in {self.elapsed():.0f}s: {statuses}")
        self.log(f"results: {self.out}/results.json, {self.out}/report.md")
        bad = [k for k, v in statuses.items() if v not in ("ok", "skipped")]
        return 1 if bad or rep["returncode"] != 0 else 0


# ================================================================================ optimizer runs
class OptimizerChecks:
    """The main job for OPT_STEPS steps with other optimizers, one after another, alongside the
    sweep: DeepSpeed's FusedAdam (``torch_adam=false``: the CUDA op built by nvcc, whose build
    started at the env step) and torch's AdamW without its fused kernel (``fused=false``; the
    main job runs the fused one, the trainer's default). Each must run and match the main job's
    loss at the same step (same seed, data and warm-up LR)."""

    VARIANTS = {  # FusedAdam last: its nvcc build gets the most time
        "torch_unfused_adamw": ["deepspeed.extra.optimizer.params.fused=false"],
        "ds_fused_adam": ["deepspeed.extra.optimizer.params.torch_adam=false"],
    }

    def __init__(self, kit: Kit):
        self.kit = kit
        self.todo = list(self.VARIANTS)
        self.rec: dict[str, Any] = {"runs": {}}
        self.proc: subprocess.Popen | None = None
        self.current: str | None = None
        self.t_start = 0.0

    def poll(self, deadline: float) -> None:
        """Advance: collect a finished run, start the next one when it can start."""
        kit = self.kit
        if self.proc is not None:
            if self.proc.poll() is None:
                return
            self._collect(finish(self.proc, 1))
        while self.todo and self.proc is None and time.perf_counter() < deadline - 30:
            name = self.todo[0]
            if name == "ds_fused_adam":
                if kit.dry:
                    self.todo.pop(0)
                    self.rec["runs"][name] = {
                        "status": "skipped",
                        "reason": "dry run: FusedAdam is a CUDA op (nvcc JIT)",
                    }
                    continue
                if kit.jit is not None and kit.jit.poll() is None and kit.elapsed() < JIT_BUDGET_S:
                    return  # still compiling: try again on the next poll
                self.rec["jit_build"] = jit_result(kit)
                if self.rec["jit_build"]["status"] != "ok":
                    self.todo.pop(0)
                    self.rec["runs"][name] = {"status": "skipped", "reason": "JIT build failed"}
                    continue
            self.todo.pop(0)
            self.current, self.t_start = name, time.perf_counter()
            self.proc = kit.launch_main(
                f"optimizers_{name}", OPT_STEPS[kit.mode], self.VARIANTS[name]
            )
            return

    def _collect(self, res: dict[str, Any]) -> None:
        kit, name = self.kit, self.current
        assert name is not None
        d = kit.work / f"optimizers_{name}"
        m = main_metrics(d, kit.work / f"optimizers_{name}.log")
        rec = {**res, "seconds": round(time.perf_counter() - self.t_start, 1), **m}
        rec["overrides"] = self.VARIANTS[name]
        main = kit.results["steps"].get("main", {})
        ref = {r["step"]: r["loss"] for r in main.get("train_records", [])}
        mine = {r["step"]: r["loss"] for r in m.get("train_records", [])}
        common = sorted(set(ref) & set(mine))
        if common:
            s = common[-1]
            rec["loss_vs_main"] = {"step": s, "main": ref[s], "this": mine[s]}
            rec["loss_rel_diff"] = abs(mine[s] - ref[s]) / ref[s]
        ok = res["returncode"] == 0 and m.get("logged_steps")
        if ok and rec.get("loss_rel_diff", 0.0) > 0.05:
            ok = False
            rec["reason"] = f"loss differs from the main job's by {rec['loss_rel_diff']:.1%}"
        rec["status"] = "ok" if ok else ("timeout" if res["timed_out"] else "failed")
        if not ok and "reason" not in rec:
            rec["reason"] = tail(kit.work / f"optimizers_{name}.log", 6)
        self.rec["runs"][name] = rec
        self.proc, self.current = None, None

    def finish(self, deadline: float) -> dict[str, Any]:
        """Wait for the run in flight (to the deadline), mark the rest skipped."""
        if self.proc is not None:
            self._collect(finish(self.proc, deadline - time.perf_counter()))
        for name in self.todo:
            self.rec["runs"][name] = {"status": "skipped", "reason": "no time left"}
        if "jit_build" not in self.rec and not self.kit.dry:
            self.rec["jit_build"] = jit_result(self.kit)
        self.rec["seconds"] = round(sum(r.get("seconds", 0) for r in self.rec["runs"].values()), 1)
        statuses = [r["status"] for r in self.rec["runs"].values()]
        self.rec["status"] = "ok" if all(s in ("ok", "skipped") for s in statuses) else "failed"
        if self.rec["status"] != "ok":
            self.rec["reason"] = ", ".join(
                f"{k}: {v['status']}" for k, v in self.rec["runs"].items()
            )
        return self.rec


def jit_result(kit: Kit) -> dict[str, Any]:
    """How FusedAdam's background nvcc build went."""
    log = kit.work / "optimizers" / "jit_build.log"
    if kit.jit is None:
        return {"status": "skipped", "reason": "not started"}
    if kit.jit.poll() is None:
        if kit.elapsed() < JIT_BUDGET_S:
            return {"status": "running"}
        kill_group(kit.jit)
        return {"status": "timeout", "log_tail": tail(log, 8)}
    secs = [ln for ln in log.read_text().splitlines() if ln.startswith("JIT ")]
    ok = kit.jit.returncode == 0 and bool(secs)
    out: dict[str, Any] = {"status": "ok" if ok else "failed", "returncode": kit.jit.returncode}
    if secs:
        out.update(json.loads(secs[-1][4:]))
    if not ok:
        out["log_tail"] = tail(log, 8)
    return out


# ================================================================================= sweep helpers
def dry_sweep_file(work: Path) -> Path:
    """The GPU sweep file shrunk for the CPU: a tiny model, 2 points, stdlib data made here."""
    raw = yaml.safe_load(SWEEP_FILE.read_text())
    drop = ("model.", "train.max_steps", "scheduler.warmup", "train.log_interval", "train.eval_")
    raw["base_overrides"] = [o for o in raw["base_overrides"] if not o.startswith(drop)]
    raw["base_overrides"] += [
        o for o in DRY_MODEL if not o.startswith(("model.max_seq", "model.k"))
    ]
    raw["base_overrides"] += [
        "model.dropout=0.1",
        "train.max_steps=6",
        "scheduler.warmup_steps=2",
        "train.log_interval=2",
        "train.eval_interval=3",
    ]
    raw["tokens_per_step"] = 2 * DRY_N
    raw["eval_tokens"] = 2 * DRY_N
    raw["data"] = {
        "source": ["stdlib"],
        "vocab_size": 1000,
        "args": ["--max-docs", "80", "--valid-fraction", "0.1", "--workers", "0"],
        "cache_dir": str(work / "data"),
    }
    raw["divergence"] = {"max_loss": 14.5, "max_rise": 5.0}
    raw["grids"] = [
        {"name": "dry", "variants": ["dense", "linear"], "seq_len": [DRY_N], "k": [32],
         "lr": [1.0e-3], "seed": [0]},
    ]  # fmt: skip
    raw.pop("point_timeout_s", None)  # no clock in the dry run: each point runs to its end
    raw["name"] = "gpu_quality_dry"
    path = work / "gpu_quality_dry.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def run_points(
    kit: Kit, cfg: sweep.SweepConfig, deadline: float, opt: OptimizerChecks | None
) -> dict[str, Any]:
    """``run_sweep.py --point i`` for the points in order, ``kit.workers`` at a time; no point
    starts when it could not end before ``deadline`` (judged from the ones that ended), and the
    ones still running there are killed (they stay pending in the report)."""
    points = cfg.points()
    queue = list(range(len(points)))
    running: dict[int, tuple] = {}
    durations: list[float] = []
    started, killed = 0, []
    env = kit.env(OMP_NUM_THREADS="1")
    while queue or running:
        now = time.perf_counter()
        for i, (proc, t0) in list(running.items()):
            if proc.poll() is not None:
                finish(proc, 1)
                durations.append(now - t0)
                del running[i]
            elif now > deadline:
                finish(proc, 0)
                killed.append(points[i].id)
                del running[i]
        expect = max(durations) if durations else 0.0
        while queue and len(running) < kit.workers and now + expect < deadline:
            i = queue.pop(0)
            cmd = [kit.py, str(sweep.SWEEP_CLI), str(cfg.path), "--out", str(cfg.out)]
            cmd += ["--point", str(i)]
            running[i] = (start(cmd, cfg.out / "logs" / f"point_{i:03d}.log", env), now)
            started += 1
        if queue and not running and now + expect >= deadline:
            break
        if opt is not None:
            opt.poll(deadline)
        time.sleep(0.5)
    if opt is not None:
        opt.poll(deadline)
    return {
        "started": started,
        "not_started": len(queue),
        "killed_at_deadline": killed,
        "point_seconds_median": median(durations),
        "point_seconds_max": max(durations) if durations else None,
    }


def summarize_sweep(cfg: sweep.SweepConfig) -> dict[str, Any]:
    """Mean and spread over seeds per (variant, N, k); the unigram reference per N."""
    results = sweep.collect(cfg)
    counts: dict[str, int] = {}
    for r in results:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["variant"], r["seq_len"], r["k"]), []).append(r)
    rows = []
    for (variant, n, k), rs in groups.items():
        ok = [r for r in rs if r["status"] == "ok" and r.get("final_eval_ppl") is not None]
        ppl = [r["final_eval_ppl"] for r in ok]
        loss = [r["final_eval_loss"] for r in ok]
        acc = [r["final_eval_accuracy"] for r in ok if r.get("final_eval_accuracy") is not None]
        rows.append(
            {
                "variant": variant,
                "n": n,
                "k": k,
                "runs": len(rs),
                "ok": len(ok),
                "diverged": sum(r["status"] == "diverged" for r in rs),
                "failed": sum(r["status"] == "failed" for r in rs),
                "pending": sum(r["status"] == "pending" for r in rs),
                "seeds_ok": [r["seed"] for r in ok],
                "ppl_mean": statistics.mean(ppl) if ppl else None,
                "ppl_std": statistics.stdev(ppl) if len(ppl) > 1 else None,
                "ppl_min": min(ppl) if ppl else None,
                "ppl_max": max(ppl) if ppl else None,
                "loss_mean": statistics.mean(loss) if loss else None,
                "loss_std": statistics.stdev(loss) if len(loss) > 1 else None,
                "acc_mean": statistics.mean(acc) if acc else None,
                "steps": max((r.get("steps") or 0 for r in rs), default=0),
                "tokens_per_s_median": median(
                    [r["tokens_per_s"] for r in ok if r.get("tokens_per_s")]
                ),
                "wall_s_median": median([r["wall_s"] for r in rs if r.get("wall_s")]),
            }
        )
    unigram = {}
    for n in sorted({r["seq_len"] for r in results}):
        path = sweep.data_dir(cfg.data, n)
        if (path / "manifest.json").is_file():
            unigram[n] = sweep.unigram_perplexity(path, cfg.eval_tokens)
    for row in rows:
        u = unigram.get(row["n"])
        row["unigram_ppl"] = u
        row["ppl_over_unigram"] = row["ppl_mean"] / u if u and row["ppl_mean"] else None
    model = [o for o in cfg.base_overrides if o.startswith(("model.", "train.max_steps"))]
    return {
        "status_counts": counts,
        "groups": rows,
        "unigram_ppl": unigram,
        "tokens_per_step": cfg.tokens_per_step,
        "eval_tokens": cfg.eval_tokens,
        "base_overrides": model,
    }


# ============================================================================== parsing outputs
def parse_junit(path: Path) -> dict[str, Any]:
    """Counts and failures from pytest's JUnit XML."""
    if not path.is_file():
        return {}
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    assert suite is not None
    cases, failures = [], []
    for case in suite.iter("testcase"):
        name = case.get("name", "")
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        status = "passed" if bad is None else "failed"
        if case.find("skipped") is not None:
            status = "skipped"
        cases.append({"name": name, "status": status, "seconds": float(case.get("time", 0))})
        if bad is not None:
            failures.append({"name": name, "message": (bad.get("message") or "")[:400]})
    return {
        "collected": len(cases),
        "passed": sum(c["status"] == "passed" for c in cases),
        "failed": sum(c["status"] == "failed" for c in cases),
        "skipped": sum(c["status"] == "skipped" for c in cases),
        "cases": cases,
        "failures": failures,
    }


def main_metrics(logdir: Path, log: Path) -> dict[str, Any]:
    """Throughput, MFU, the GEMM peak and memory from a trainer's metrics.jsonl: the median
    over the logged intervals after the first (which holds start-up and warm-up)."""
    recs = [r for r in read_jsonl(logdir / "metrics.jsonl") if r.get("split") == "train"]
    out: dict[str, Any] = {"logged_steps": [r["step"] for r in recs]}
    if not recs:
        return out
    steady = recs[1:] or recs
    tps = median([r["tokens_per_s"] for r in steady])
    mfu = median([r["mfu"] for r in steady])
    tflops = median([r["tflops_per_rank"] for r in steady])
    out.update(
        tokens_per_s=tps,
        mfu=mfu,
        model_tflops=tflops,
        gemm_peak_tflops=(tflops / mfu) if mfu else None,
        peak_mem_gib=max(r["peak_mem_gb"] for r in recs),
        first_loss=recs[0]["loss"],
        last_loss=recs[-1]["loss"],
        last_accuracy=recs[-1].get("mlm_accuracy"),
        train_records=[
            {k: r.get(k) for k in ("step", "loss", "tokens_per_s", "mfu", "peak_mem_gb")}
            for r in recs
        ],
    )
    for line in tail(log, 10**6).splitlines():
        if "[setup]" in line:
            out["setup"] = line.split("[setup]", 1)[1].strip()
            break
    cfg = logdir / "config.json"
    if cfg.is_file():
        c = json.loads(cfg.read_text())
        out["model"] = {k: c["model"][k] for k in ("hidden_size", "num_layers", "max_seq_len", "k")}
        out["micro_batch_size"] = c["train"]["micro_batch_size"]
        out["zero_stage"] = c["deepspeed"]["zero"]["stage"]
        out["precision"] = c["deepspeed"]["precision"]
        out["activation_checkpointing"] = c["deepspeed"]["activation_checkpointing"]["enabled"]
        given = c["train"].get("peak_tflops")
        out["gemm_peak_source"] = "measured by the trainer" if given is None else "given"
    return out


def plan_beside(logdir: Path, measured: dict[str, Any], device: str) -> dict[str, Any]:
    """The planner's figures for the run of ``logdir`` (its config.json: the layout it ran, one
    rank) beside what it measured: the per-rank peak (CUDA's max allocated; the dry run's is the
    RSS, not comparable) and the tokens/s at the run's own model TFLOP/s (linformer_ds.plan,
    docs/cluster.md)."""
    from linformer_ds.config import from_dict
    from linformer_ds.plan import Hardware, Layout, plan_layout

    cfg_path = logdir / "config.json"
    if not cfg_path.is_file() or not measured.get("peak_mem_gib"):
        return {"reason": "no config.json or no logged step"}
    job = from_dict(json.loads(cfg_path.read_text()))
    ck = job.deepspeed.activation_checkpointing
    layout = Layout(1, job.parallel.sequence_parallel_size, job.deepspeed.zero.stage,
                    ck.granularity if ck.enabled else None, job.train.micro_batch_size,
                    job.model.max_seq_len, job.train.gradient_accumulation_steps)  # fmt: skip
    hw = Hardware(tflops=measured.get("model_tflops") or 1.0, device=device)
    plan = plan_layout(job, layout, hw)
    peak = plan["peak"] / 2**30
    return {
        "layout": layout.text(),
        "predicted_peak_gib": round(peak, 3),
        "measured_peak_gib": round(measured["peak_mem_gib"], 3),
        "peak_ratio": round(peak / measured["peak_mem_gib"], 3),
        "predicted_mib": {k: round(v / 2**20, 1) for k, v in plan["memory"].items()},
        "predicted_tokens_per_s": round(plan["tokens_per_s_per_gpu"], 1),
        "measured_tokens_per_s": measured.get("tokens_per_s"),
        "comparable": device == "cuda",
    }


def sync_counts(path: Path) -> dict[str, Any]:
    """The trainer's sync-log records of rank 0 (linformer_ds/testing/hostsync.py): per counted step
    its seconds, CUDA's count of synchronizing operations (set_sync_debug_mode("warn"); None
    off CUDA) and the dispatch-mode count by owner, and the seconds of the uncounted step after
    them. ``per_step``: CUDA's count on a GPU, else the dispatch count (never empty); the
    data pipeline's host work is left out of the dispatch count (host tensors by design)."""
    recs = read_jsonl(path) if path.is_file() else []
    counted = [r for r in recs if r.get("counted")]
    out: dict[str, Any] = {"steps": []}
    for r in counted:
        by_owner = r["dispatch"]["by_owner"]
        dispatch = sum(n for who, n in by_owner.items() if who != "data")
        cuda = r.get("cuda_syncs")
        out["steps"].append(
            {
                "step": r["step"],
                "step_s": r["step_s"],
                "syncs": cuda if cuda is not None else dispatch,
                "source": "cuda_sync_debug_mode" if cuda is not None else "dispatch_mode",
                "cuda_syncs": cuda,
                "cuda_sync_sites": r.get("cuda_sync_sites") or {},
                "dispatch": dispatch,
                "dispatch_by_owner": by_owner,
                "dispatch_by_reason": r["dispatch"]["by_reason"],
            }
        )
    if counted:
        last = out["steps"][-1]
        out["per_step"] = last["syncs"]
        out["source"] = last["source"]
        out["ours_per_step"] = sum(
            n for who, n in last["dispatch_by_owner"].items() if who in ("model", "trainer")
        )
        out["deepspeed_per_step"] = sum(
            n for who, n in last["dispatch_by_owner"].items() if who.startswith("deepspeed")
        )
        out["counted_step_s"] = last["step_s"]
    plain = [r for r in recs if not r.get("counted")]
    out["uncounted_step_s"] = plain[-1]["step_s"] if plain else None
    return out


def pack(work: Path, dest: Path) -> None:
    """Logs and small outputs of the work dir into one tarball (no shards, no checkpoints)."""
    keep = (".log", ".jsonl", ".json", ".xml", ".md", ".csv", ".png", ".txt", ".yaml")
    with tarfile.open(dest, "w:gz") as tar:
        for path in sorted(work.rglob("*")):
            rel = path.relative_to(work)
            if (
                path.is_file()
                and path.suffix in keep
                and "data" not in rel.parts[:1]
                and "torch_extensions" not in rel.parts
                and path.stat().st_size < 4 << 20
            ):
                tar.add(path, arcname=str(Path("gpu_check") / rel))


# ============================================================================ child-process code
ENV_PROBE = r"""
import importlib, json, os, platform, subprocess, sys
info = {"python": platform.python_version(), "platform": platform.platform(),
        "cpu_count": os.cpu_count(), "imports": {}}
for name in ("torch", "deepspeed", "omegaconf", "datasets", "pydantic", "pydantic_core", "hjson",
             "numpy", "triton", "sentencepiece", "yaml", "matplotlib", "linformer",
             "transformers"):
    try:
        mod = importlib.import_module(name)
        info["imports"][name] = "ok " + str(getattr(mod, "__version__", "?"))
    except Exception as e:  # noqa: BLE001
        info["imports"][name] = f"FAILED {type(e).__name__}: {e}"[:300]
for optional in ("triton", "matplotlib"):
    if not info["imports"][optional].startswith("ok"):
        info["imports"][optional] = "ok absent"
import torch
info["torch"] = torch.__version__
info["cuda_available"] = torch.cuda.is_available()
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1),
                capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        info["nvidia_smi"] = q.stdout.strip()
    except Exception as e:  # noqa: BLE001
        info["nvidia_smi"] = f"unavailable: {e}"
    try:
        q = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, timeout=20)
        info["nvcc"] = q.stdout.strip().splitlines()[-1] if q.returncode == 0 else "absent"
    except Exception:  # noqa: BLE001
        info["nvcc"] = "absent"
try:
    from deepspeed.accelerator import get_accelerator
    info["ds_accelerator"] = get_accelerator().device_name()
except Exception as e:  # noqa: BLE001
    info["ds_accelerator"] = f"FAILED {e}"
for name in ("deepspeed", "omegaconf", "datasets", "pydantic"):
    mod = sys.modules.get(name)
    if mod is not None:
        info[name + "_path"] = os.path.dirname(mod.__file__)
print("ENV " + json.dumps(info), flush=True)
"""

JIT_BUILD = r"""
import json, time
t0 = time.perf_counter()
from deepspeed.accelerator import get_accelerator
builder = get_accelerator().create_op_builder("FusedAdamBuilder")
builder.load()
print("JIT " + json.dumps({"op": "fused_adam", "build_s": round(time.perf_counter() - t0, 1)}))
"""


# ========================================================================================= main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out", help="results folder (results.json, report.md, artifacts.tar.gz)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes (CI)")
    p.add_argument("--only", nargs="+", default=[], choices=STEPS, help="run only these steps")
    p.add_argument("--skip", nargs="+", default=[], choices=STEPS, help="leave these steps out")
    p.add_argument("--work", help="scratch folder (default: a new temporary one)")
    p.add_argument("--workers", type=int, help="sweep points at a time (GPU 12, dry run 2)")
    p.add_argument(
        "--total-budget-s", type=float, help="all steps (GPU 525; the dry run has no budget)"
    )
    a = p.parse_args(argv)
    if a.workers is not None and a.workers < 1:
        p.error(f"--workers must be >= 1, got {a.workers}")
    if a.total_budget_s is not None and a.total_budget_s <= RESERVE_S:
        p.error(f"--total-budget-s must be > {RESERVE_S}")
    if a.total_budget_s is not None and a.dry_run:
        p.error("--total-budget-s is the GPU run's: the dry run has no time budget")
    needs = {"main": "data", "sweep": "data", "optimizers": "main"}
    for step, dep in needs.items():
        chosen = [s for s in STEPS if (not a.only or s in a.only) and s not in a.skip]
        if step in chosen and dep not in chosen:
            p.error(f"step {step} needs step {dep}")
    if "optimizers" in a.only and "sweep" not in a.only:
        p.error("step optimizers runs alongside the sweep: add sweep")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, on_sigterm)
    kit = Kit(args)
    if kit.clocked:
        budgets = (
            "budgets (s) "
            + ", ".join(f"{k} {v}" for k, v in kit.budgets.items() if k in kit.steps)
            + f" (sweep: the rest); total {kit.total:.0f} with a {RESERVE_S} s reserve"
        )
    else:
        budgets = "no time budgets: fixed work, every step runs to its end"
    kit.log(
        f"{'DRY RUN (CPU, tiny sizes)' if kit.dry else 'GPU'}: steps {kit.steps}; {budgets}; "
        f"work dir {kit.work}"
    )
    kit.save()
    chain = ("data", "main", "sweep")  # each needs the one before (the sweep: the data)
    free = ("env", "tests", "bench", "peer")  # need no other step
    if kit.dry:  # no clock to share: the free steps run beside the chain, on the other core
        side = threading.Thread(target=lambda: [kit.step(s, getattr(kit, f"do_{s}")) for s in free])
        side.start()
        for s in chain:
            kit.step(s, getattr(kit, f"do_{s}"))
        side.join()
    else:  # the GPU: one step at a time, each measured alone under its budget
        for s in ("data", "env", "tests", "main", "bench", "peer", "sweep"):
            kit.step(s, getattr(kit, f"do_{s}"))
    return kit.finish_up()


if __name__ == "__main__":
    sys.exit(main())
