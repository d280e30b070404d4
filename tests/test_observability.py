"""Prometheus ``/metrics`` of a real 2-rank CPU training, scraped over HTTP while it runs and
parsed with prometheus_client's parser; elapsed time and ETA in metrics.jsonl; a port in use;
the endpoint is gone when training ends."""

import json
import math
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from linformer_ds.config import ConfigError, load_config
from linformer_ds.metrics import Metrics, format_duration
from linformer_ds.prometheus import TARGETS_FILE, PrometheusSink
from tests.pretrain_utils import (
    PRETRAIN,
    REPO,
    TEST_OVERRIDES,
    TINY_CONFIG,
    child_env,
    free_port,
    read_metrics,
    run_pretrain,
)

TOKENS_PER_RANK_STEP = 4 * 128  # TEST_OVERRIDES: micro_batch_size 4, seq_len 128, no accumulation
COMMON = ["train.max_steps=40", "checkpoint.save_interval=10"]


def scrape(endpoint: str, timeout: float = 5.0) -> dict[str, float]:
    """``{sample: value}`` of one rank's ``/metrics``; a sample's labels other than job_name
    and rank are part of its key (``linformer_memory_bytes{kind=peak}``), and ``rank`` and
    ``job_name`` are returned as values of their own."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=timeout) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            extra = sorted((k, v) for k, v in s.labels.items() if k not in ("job_name", "rank"))
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in extra) + "}" if extra else "")
            out[key] = s.value
            if s.name == "linformer_step":
                out["rank"] = float(s.labels["rank"])
                out["job_name"] = s.labels["job_name"]  # type: ignore[assignment]
    return out


def refused(endpoint: str) -> bool:
    try:
        scrape(endpoint, timeout=2)
    except (urllib.error.URLError, ConnectionError):
        return True
    return False


def popen_pretrain(data: Path, run_dir: Path, overrides: list[str], env_extra: dict[str, str]):
    """launch/pretrain.py under the deepspeed launcher with 2 CPU ranks, not waited for."""
    ov = TEST_OVERRIDES + [f"data.path={data}", f"logging.dir={run_dir}"] + overrides
    env = child_env(**env_extra)
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), PRETRAIN]
    cmd += ["--config", TINY_CONFIG] + ov
    log = open(run_dir / "launcher.log", "w")
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), log


@pytest.fixture(scope="module")
def scraped_run(tiny_corpus, tmp_path_factory):
    """Steps 1-10 without Prometheus (checkpoint at 10), then a resumed process to step 40
    with ``logging.prometheus_port=0``, a NaN loss at step 15 (skipped), evals every 10
    steps; both ranks' /metrics scraped every 100 ms while it runs."""
    run = tmp_path_factory.mktemp("prom")
    run_pretrain(tiny_corpus, run, COMMON + ["train.stop_at_step=10"])
    overrides = COMMON + [
        "logging.prometheus_port=0",
        "train.nonfinite=skip",
        "train.eval_interval=10",
        "train.eval_batches=1",
        "debug.nan_at_step=15",
    ]
    proc, log = popen_pretrain(tiny_corpus, run, overrides, {})
    targets_file = run / TARGETS_FILE
    endpoints: list[str] | None = None
    targets: list | None = None
    snaps: dict[int, list[dict[str, float]]] = {0: [], 1: []}
    deadline = time.monotonic() + 600
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if endpoints is None and targets_file.is_file():
                targets = json.loads(targets_file.read_text())
                endpoints = targets[0]["targets"]
            for ep in endpoints or []:
                try:
                    s = scrape(ep)
                except (urllib.error.URLError, ConnectionError):
                    continue  # not up yet, or closing at the end of training
                snaps[int(s["rank"])].append(s)
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        log.close()
    output = (run / "launcher.log").read_text()
    assert proc.returncode == 0, output[-6000:]
    return run, output, endpoints, targets, snaps


def test_scraped_metrics_increase_and_match_metrics_jsonl(scraped_run):
    run, output, endpoints, targets, snaps = scraped_run
    assert endpoints is not None and len(endpoints) == 2, "no targets file seen during the run"
    host = socket.gethostname()
    assert all(ep.startswith(f"{host}:") for ep in endpoints)
    assert targets[0]["labels"] == {"linformer_run": "tiny_cpu"}
    assert f"[prometheus] /metrics on {endpoints[0]} (rank 0), {endpoints[1]} (rank 1)" in output
    train, evals = read_metrics(run), read_metrics(run, "eval")
    assert sorted(train) == list(range(1, 41)) and sorted(evals) == [20, 30, 40]

    for rank in (0, 1):
        # Snapshots once the resume is known (before it: step 0, nothing trained yet).
        got = [s for s in snaps[rank] if s["linformer_resumes"] == 1]
        steps = [int(s["linformer_step"]) for s in got]
        print(f"rank {rank}: {len(snaps[rank])} scrapes, steps {sorted(set(steps))}")
        assert len(set(steps)) >= 3, f"rank {rank}: scraped steps {steps}"
        tokens = [s["linformer_tokens_total"] for s in got]
        assert steps == sorted(steps) and tokens == sorted(tokens)
        assert steps[-1] > steps[0] and tokens[-1] > tokens[0]  # the counters moved
        for s, step in zip(got, steps):
            where = f"rank {rank} step {step}"
            assert s["job_name"] == "tiny_cpu"
            assert s["linformer_start_step"] == 10 and s["linformer_max_steps"] == 40
            # Counters of this process: tokens and step times of steps 11..step.
            assert s["linformer_tokens_total"] == (step - 10) * TOKENS_PER_RANK_STEP, where
            assert s["linformer_step_seconds_count"] == step - 10, where
            assert s["linformer_step_seconds_bucket{le=+Inf}"] == step - 10, where
            assert s["linformer_nonfinite_steps_skipped_total"] == (1 if step >= 15 else 0), where
            # (a scrape may fall after a batch was read and before its step is done)
            assert 0 <= s["linformer_data_wait_seconds_total"] < s["linformer_elapsed_seconds"]
            if step > 10:
                assert s["linformer_data_wait_seconds_total"] > 0, where
            assert s["linformer_checkpoint_seconds_count{op=load}"] == 1
            assert s["linformer_checkpoint_last_seconds{op=load}"] > 0
            saves = s.get("linformer_checkpoint_seconds_count{op=save}", 0)
            assert saves in ((step - 10) // 10, (step - 10) // 10 - 1), where  # at 20, 30, 40
            mem, peak = s["linformer_memory_bytes{kind=current}"], s["linformer_memory_bytes{kind=peak}"]  # fmt: skip
            assert 50 * 2**20 < mem <= peak, where
            assert s["linformer_elapsed_seconds"] > 0
            eta = s["linformer_eta_seconds"]
            assert eta >= 0 if step > 10 else math.isnan(eta), where  # NaN before a step
            assert s["linformer_run_info{device=cpu,memory=rss,precision=bf16,world_size=2,zero_stage=2}"] == 1  # fmt: skip
            # Window gauges hold the [train] record of last_log_step: the same numbers as the
            # jsonl line (loss, accuracy, LR, grad norm are all-reduced: equal on every rank).
            logged = int(s["linformer_last_log_step"])
            if logged == 0:  # this process has not written a record yet
                assert step in (10, 11) and math.isnan(s["linformer_loss"]), where
                continue
            assert logged in (step, step - 1), where
            rec = train[logged]
            assert s["linformer_loss"] == rec["loss"], where
            assert s["linformer_mlm_accuracy"] == rec["mlm_accuracy"], where
            assert s["linformer_learning_rate"] == rec["lr"], where
            assert s["linformer_grad_norm"] == pytest.approx(rec["grad_norm"], rel=1e-6), where
            if rank == 0:  # jsonl's throughput is rank 0's, for all ranks together
                assert s["linformer_tokens_per_second"] * 2 == pytest.approx(rec["tokens_per_s"])
                assert s["linformer_mfu"] == rec["mfu"]
            else:  # its own clock: how close it is to rank 0's depends on the machine's load
                assert 0 < s["linformer_tokens_per_second"] < math.inf, where
            evaluated = int(s["linformer_eval_step"])
            assert evaluated in (0, 20, 30, 40) and evaluated <= step
            if evaluated:
                assert s["linformer_eval_loss"] == evals[evaluated]["loss"]


def test_endpoints_gone_after_the_run(scraped_run):
    run, _, endpoints, _, _ = scraped_run
    assert endpoints and all(refused(ep) for ep in endpoints)
    assert not (run / TARGETS_FILE).exists()


def test_elapsed_and_eta_in_jsonl_and_train_line(scraped_run):
    run, output, _, _, _ = scraped_run
    m = read_metrics(run)
    elapsed = [m[s]["elapsed_s"] for s in range(1, 41)]
    # Training time grows, and the resumed process continues from the checkpoint's figure.
    assert all(b > a for a, b in zip(elapsed, elapsed[1:]))
    assert m[40]["eta_s"] == 0
    # ETA = steps left x mean wall time per step since the process's first step (11).
    for s in range(13, 40):
        per_step = (m[s]["elapsed_s"] - m[11]["elapsed_s"]) / (s - 11)
        assert m[s]["eta_s"] == pytest.approx((40 - s) * per_step, rel=0.05, abs=0.05), s
    assert all(m[s]["eta_s"] > 0 for s in range(1, 40))
    line = next(ln for ln in output.splitlines() if "[train] step 40 " in ln)
    assert f"elapsed={format_duration(m[40]['elapsed_s'])} eta=0:00:00" in line
    assert "elapsed_s=" not in line and "eta_s=" not in line


def test_port_in_use_is_a_one_line_error(tiny_corpus, tmp_path):
    """Rank 0's port (base + local rank 0) is taken: the ranks exit 2 naming the key. (The
    launcher stops rank 1 when rank 0 has left: rank 1 prints the same line or, when the
    launcher's SIGTERM comes first, its start-up watchdog's one line.)"""
    with socket.socket() as blocker:
        blocker.bind(("0.0.0.0", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        proc = run_pretrain(
            tiny_corpus,
            tmp_path,
            ["train.max_steps=2", f"logging.prometheus_port={port}"],
            launcher="deepspeed",  # its exit code is the ranks' (2); torchrun's is 1
            check=False,
            timeout=300,
        )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if "logging.prometheus_port" in ln]
    stopped = [ln for ln in proc.stderr.splitlines() if "SIGTERM during start-up" in ln]
    assert len(lines) in (1, 2) and len(lines) + len(stopped) == 2, proc.stderr[-3000:]
    host = socket.gethostname()
    for ln in lines:
        assert f"config error: logging.prometheus_port: port {port} on {host} (rank 0, " in ln
        assert "Address already in use" in ln and "or 0 for free ports" in ln
    assert "Traceback" not in proc.stderr and "[train]" not in proc.stdout


def test_close_stops_serving_and_removes_targets(tmp_path):
    """In one process: the endpoint serves what the component was told, and close() frees the
    port and removes the targets file."""
    cfg = load_config(
        TINY_CONFIG,
        [
            f"logging.dir={tmp_path}",
            "logging.prometheus_port=0",
            "logging.tensorboard=false",
            "train.peak_tflops=1.0",
            "train.max_steps=10",
        ],
    )
    m = Metrics(cfg, 0, 1, torch.device("cpu"), flops_per_token=1e6, tokens_per_step=1024)
    endpoint = json.loads((tmp_path / TARGETS_FILE).read_text())[0]["targets"][0]
    s = scrape(endpoint)
    assert s["linformer_step"] == 0 and math.isnan(s["linformer_loss"])
    m.step_done(1, torch.tensor([20.0, 3, 10, 0], dtype=torch.float64), 0.5)
    m.step_done(2, torch.tensor([20.0, 3, 10, 0], dtype=torch.float64), 0.25, skipped=True)
    m.checkpoint_done("save", 1.5)
    s = scrape(endpoint)
    assert s["linformer_step"] == 2 and s["linformer_tokens_total"] == 2048
    assert s["linformer_step_seconds_sum"] == 0.75
    assert s["linformer_step_seconds_bucket{le=0.25}"] == 1
    assert s["linformer_step_seconds_bucket{le=0.5}"] == 2
    assert s["linformer_nonfinite_steps_skipped_total"] == 1
    assert s["linformer_checkpoint_last_seconds{op=save}"] == 1.5
    assert 0 < s["linformer_eta_seconds"] == m.eta
    # Every metric the dashboard and docs/observability.md query is one the endpoint serves.
    served = {key.split("{")[0] for key in s}
    served |= {re.sub(r"_(bucket|count|sum)$", "", name) for name in served}  # family names
    dashboard = json.loads((REPO / "docs" / "grafana_linformer.json").read_text())
    exprs = " ".join(t["expr"] for panel in dashboard["panels"] for t in panel["targets"])
    doc = (REPO / "docs" / "observability.md").read_text()
    for where, text in (("dashboard", exprs), ("observability.md", doc)):
        used = set(re.findall(r"\blinformer_[a-z_]+", text)) - {"linformer_ds", "linformer_run"}
        assert len(used) > 5 and used <= served, (where, sorted(used - served))
    m.close()
    assert refused(endpoint)
    assert not (tmp_path / TARGETS_FILE).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # config.json: Trainer


def test_format_duration():
    assert format_duration(0) == "0:00:00"
    assert format_duration(3725.4) == "1:02:05"
    assert format_duration(90061) == "25:01:01"
    assert format_duration(float("nan")) == "?"


def test_prometheus_host_sets_the_listening_address(tmp_path):
    """``logging.prometheus_host=127.0.0.1``: the endpoint listens on the loopback address only
    and its target names it; the default listens on every interface under the node's name; an
    address this host does not have, or a malformed one, is one ConfigError naming the key."""

    def metrics(*overrides: str) -> Metrics:
        ov = [f"logging.dir={tmp_path}", "logging.prometheus_port=0", "logging.tensorboard=false",
              "train.peak_tflops=1.0", *overrides]  # fmt: skip
        cfg = load_config(TINY_CONFIG, ov)
        return Metrics(cfg, 0, 1, torch.device("cpu"), flops_per_token=1e6, tokens_per_step=1024)

    def served(m: Metrics):
        sink = next(s for s in m.sinks if isinstance(s, PrometheusSink))
        target = json.loads((tmp_path / TARGETS_FILE).read_text())[0]["targets"][0]
        return sink.httpd.server_address[0], sink.port, target

    m = metrics("logging.prometheus_host=127.0.0.1")
    addr, port, target = served(m)
    assert (addr, target) == ("127.0.0.1", f"127.0.0.1:{port}")
    assert scrape(target)["linformer_step"] == 0
    m.close()
    assert refused(target)
    m = metrics()  # the default: every interface, as before the setting existed
    addr, port, target = served(m)
    assert (addr, target) == ("0.0.0.0", f"{socket.gethostname()}:{port}")
    assert scrape(f"127.0.0.1:{port}")["linformer_step"] == 0
    m.close()
    with pytest.raises(ConfigError) as e:  # TEST-NET-1 (RFC 5737): no host has it
        metrics("logging.prometheus_host=192.0.2.1")
    assert str(e.value).startswith(f"logging.prometheus_host: 192.0.2.1 on {socket.gethostname()}"
                                   " (rank 0, local rank 0) cannot be served: ")  # fmt: skip
    assert str(e.value).endswith("give an address of this host (0.0.0.0: every interface, "
                                 "127.0.0.1: this host only)") and "\n" not in str(e.value)  # fmt: skip
    assert not (tmp_path / TARGETS_FILE).exists()
    with pytest.raises(ConfigError, match=r"^logging.prometheus_host: 'a host' is not an IP"):
        metrics("logging.prometheus_host=a host")
