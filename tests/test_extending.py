"""The recipes of docs/extending.md, each added from outside the package and run for real:

* a data source kind (``zip:ARCHIVE``, every member a document) through data_prep to shards,
  in one process and on two ranks;
* a projection kind (``pool``: a learned weighted sum over windows of r = max_seq_len / k
  tokens) through the model's forward and backward;
* a metrics sink receiving a run's real records and every event;
* beside it, the built-in tracker sinks (``wandb`` offline, ``mlflow`` on a sqlite store) on
  the same run: one tracker run each across the resume, the TensorBoard scalars in both.

Then all three through the stock commands, as a user runs them: one ``--plugin`` module
(tests/extending_plugin.py) registers them; ``python -m data_prep --source zip:...`` prepares
the data, ``launch/pretrain.py --plugin ...`` trains a ``[linear, pool]`` model with
``logging.sinks: [collect]`` for 4 steps, then resumes it to 6 (the sink sees the resume).
"""

import dataclasses
import importlib.metadata
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from data_prep import DataPrepError, PrepConfig, prepare
from data_prep.sources import Source, SourceKind, register_source_kind, unregister_source_kind
from linformer_ds.metrics import Sink
from linformer_ds.model import (
    LinformerForMaskedLM,
    ModelConfig,
    ModelConfigError,
    flops_per_token,
    register_projection,
    unregister_projection,
)
from tests.pretrain_utils import (
    PRETRAIN,
    REPO,
    TEST_OVERRIDES,
    TINY_CONFIG,
    child_env,
    run_ranks_in_threads,
)
from tests.test_data_prep import make_docs, shard_hashes, write_text_corpus

MLFLOW_SITE = str(Path(sys.prefix) / "mlflow-site")  # the mlflow extra (scripts/setup_env.sh)


@pytest.fixture(scope="module", autouse=True)
def _mlflow_importable() -> Iterator[None]:
    """The mlflow extra on this process's path for this module's tests (the tracker tests read
    its store back and check the sink), and off it again after them: with mlflow importable,
    every `import deepspeed` imports it too (+1.5 s), in this process and in the processes it
    spawns (they inherit sys.path), so the rest of the suite goes without it."""
    saved = list(sys.path)
    if MLFLOW_SITE not in sys.path:
        sys.path.append(MLFLOW_SITE)
    yield
    sys.path[:] = saved


# ============================================================================ a data source kind
class ZipKind(SourceKind):
    """``zip:ARCHIVE``: every member of a zip archive is one document (UTF-8), in name order."""

    name = "zip"

    def matches(self, spec: str) -> bool:
        return spec.startswith("zip:")

    def resolve(self, spec: str, source: Source) -> list[tuple[str, int]]:
        path = spec[4:]
        if not zipfile.is_zipfile(path):
            raise DataPrepError(f"{spec!r}: not a zip archive")
        with zipfile.ZipFile(path) as z:
            return sorted((i.filename, i.file_size) for i in z.infolist() if not i.is_dir())

    def units(self, spec: str, source: Source, unit_bytes: int) -> list[tuple[Any, int]]:
        units, group, size = [], [], 0
        for member, n in source.state(spec):
            group.append(member)
            size += n
            if size >= unit_bytes:
                units.append((tuple(group), size))
                group, size = [], 0
        return units + ([(tuple(group), size)] if group else [])

    def read(self, spec: str, source: Source, part: Any) -> Iterator[str]:
        members = [m for m, _ in source.state(spec)] if part is None else part
        with zipfile.ZipFile(spec[4:]) as z:
            for member in members:
                yield z.read(member).decode("utf-8")

    def describe(self, spec: str, source: Source) -> dict[str, Any]:
        return {"kind": self.name, "spec": spec, "members": len(source.state(spec))}

    def total_bytes(self, spec: str, source: Source) -> int | None:
        return sum(n for _, n in source.state(spec))

    def roots(self, spec: str) -> list[str]:
        return [spec[4:]]


@pytest.fixture
def zip_kind():
    kind = register_source_kind(ZipKind())
    yield kind
    unregister_source_kind(kind.name)


def _prep(out: Path, sources: list[str], **kw) -> dict:
    kw = {"seq_len": 32, "vocab_size": 120, "workers": 0, "progress": False,
          "valid_fraction": 0.2, "shard_rows": 7, **kw}  # fmt: skip
    return prepare(PrepConfig(sources=sources, out=str(out), **kw)).manifest


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "manifest.json"
    }


def test_source_kind_zip_to_shards(zip_kind, tmp_path):
    """A zip archive's members give the same tokenizer and shards as the same documents as text
    files, and two ranks (threads, srun's file transport) write the same bytes as one process."""
    docs = make_docs(30)
    write_text_corpus(tmp_path / "txt", docs)
    archive = tmp_path / "docs.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for i, doc in enumerate(docs):
            z.writestr(f"doc_{i:04d}.txt", doc)
    spec = f"zip:{archive}"

    ref = _prep(tmp_path / "ref", [str(tmp_path / "txt")])
    got = _prep(tmp_path / "zip", [spec])
    assert got["tokenizer"]["sha256"] == ref["tokenizer"]["sha256"]
    assert shard_hashes(tmp_path / "zip", got) == shard_hashes(tmp_path / "ref", ref)
    assert got["source"]["items"] == [{"kind": "zip", "spec": spec, "members": len(docs)}]
    assert got["source"]["documents"] == ref["source"]["documents"] == len(docs)
    assert got["source"]["bytes"] == ref["source"]["bytes"]  # UTF-8 bytes, counted by Source

    cfg = dict(sources=[spec], out=str(tmp_path / "ranks"), seq_len=32, vocab_size=120,
               workers=0, progress=False, valid_fraction=0.2, shard_rows=7, unit_bytes=2000,
               rank_timeout=60.0)  # fmt: skip
    run_ranks_in_threads(cfg, 2, "ext", timeout=300)
    assert _tree(tmp_path / "ranks") == _tree(tmp_path / "zip")

    with pytest.raises(DataPrepError, match="not a zip archive"):  # resolved before any work
        _prep(tmp_path / "bad", [f"zip:{tmp_path / 'txt' / 'doc_0000.txt'}"])


# ============================================================================ a projection kind
class WindowPool(nn.Module):
    """``[B, n, H, d] -> [B, ceil(n / r), H, d]``: each window of r tokens summed with learned
    weights ``weight [H, r]`` (one set per head group; the same for every window)."""

    def __init__(self, stride: int, heads: int, frozen: bool):
        super().__init__()
        self.stride, self.heads = stride, heads
        self.weight = nn.Parameter(torch.empty(heads, stride), requires_grad=not frozen)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.constant_(self.weight, 1.0 / self.stride)

    def forward(self, x: torch.Tensor, documents: Any = None) -> torch.Tensor:
        if documents is not None:
            raise NotImplementedError("pool: document isolation")
        b, n, h, d = x.shape
        r = self.stride
        x = nn.functional.pad(x, (0, 0, 0, 0, 0, (-n) % r))
        x = x.view(b, -1, r, h // self.heads, self.heads, d)  # heads = 1 or h
        return torch.einsum("bcrgjd,jr->bcgjd", x, self.weight).reshape(b, -1, h, d)


def register_pool() -> None:
    """Register the ``pool`` projection kind (also run by the trainer driver below)."""
    register_projection(
        "pool",
        lambda cfg, i, heads: WindowPool(cfg.conv_stride(i), heads, cfg.freeze_projection),
        stride=lambda cfg, i: cfg.conv_stride(i),
        stride_rule="max_seq_len / k",
        check=lambda cfg, i: (
            None
            if cfg.max_seq_len % cfg.k_for_layer(i) == 0
            else (f"pool layer {i}: k={cfg.k_for_layer(i)} does not divide max_seq_len")
        ),
        flops=lambda cfg, i, n: (
            2 * 2 * cfg.hidden_size  # the weighted sums of K and V
            + 2 * 2 * math.ceil(n / cfg.conv_stride(i)) * cfg.hidden_size
        ),  # scores, weighted sum
        replace=True,
    )


@pytest.fixture
def pool_kind():
    register_pool()
    yield "pool"
    unregister_projection("pool")


SMALL = dict(vocab_size=50, max_seq_len=16, hidden_size=16, num_layers=2, num_heads=2,
             intermediate_size=32, k=4, dropout=0.0, attention_dropout=0.0)  # fmt: skip


def _pool_ref(t: torch.Tensor, w: torch.Tensor, r: int) -> torch.Tensor:
    """``[B, n, h, d] -> [B, ceil(n / r), h, d]`` by hand: zero-pad, weight each window's taps."""
    b, n, h, d = t.shape
    t = nn.functional.pad(t, (0, 0, 0, 0, 0, (-n) % r)).view(b, -1, r, h, d)
    return torch.einsum("bcrhd,hr->bchd", t, w.expand(h, r))


def test_projection_kind_forward_backward(pool_kind):
    with pytest.raises(ModelConfigError, match="must be one of"):
        unregister_projection("pool")
        ModelConfig(**SMALL, projection="pool")
    register_pool()
    with pytest.raises(ModelConfigError, match="pool layer 0: k=5 does not divide"):
        ModelConfig(**{**SMALL, "k": 5}, projection="pool")

    torch.manual_seed(0)
    ids = torch.randint(5, 50, (3, 12))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 9:] = 0
    for sharing in ("none", "headwise", "kv", "layerwise"):
        cfg = ModelConfig(**SMALL, layer_projections=["linear", "pool"], sharing=sharing)
        model = LinformerForMaskedLM(cfg)
        pools = [m for m in model.modules() if isinstance(m, WindowPool)]
        assert pools and all(m.projection_kind == "pool" for m in pools)
        if sharing == "layerwise":
            assert model.encoder.shared_pool is pools[0] and len(pools) == 1
        assert cfg.num_projection_parameters() == sum(
            p.numel() for n, p in model.named_parameters() if "proj_" in n or "shared_" in n
        )
        # the attention of the pool layer against a hand-written reference
        attn = model.encoder.layers[1].attention
        x = torch.randn(3, 12, 16, dtype=torch.float64)
        attn.double()
        shared = model.encoder.shared_pool.double() if sharing == "layerwise" else None
        q, k, v = attn.qkv(x).view(3, 12, 3, 2, 8).unbind(2)
        proj_k = attn.proj_k or shared
        proj_v = attn.proj_v or proj_k
        kp, vp = _pool_ref(k, proj_k.weight, 4), _pool_ref(v, proj_v.weight, 4)
        ref = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2)
        )
        want = attn.out(ref.transpose(1, 2).reshape(3, 12, 16))
        torch.testing.assert_close(attn(x, None, shared), want)
        attn.float()
        if shared is not None:
            shared.float()
        # the whole model: forward, backward, every projection weight gets a gradient
        out = model(ids, attention_mask=mask, labels=ids)
        out.loss.backward()
        assert torch.isfinite(out.loss)
        for m in pools:
            assert m.weight.grad is not None and m.weight.grad.abs().sum() > 0
    assert flops_per_token(cfg) > 0
    # sequence parallelism: refused for a kind registered without sequence_parallel=True
    from linformer_ds.parallel.checks import config_errors

    errors = config_errors(2, world_size=2, seq_len=16, model=cfg)
    assert any("the pool projection does not support sequence parallelism" in e for e in errors)


# ====================================================================== a sink and a trainer run
class CollectSink(Sink):
    """Keeps every record and event; ``path``: appended as one JSON line at close."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = []
        self.steps: list[int] = []
        self.events: list[list[Any]] = []

    @classmethod
    def for_rank(cls, cfg, rank: int, world_size: int) -> Optional["CollectSink"]:
        """The ``collect`` factory of ``logging.sinks``: rank 0 only."""
        return cls(os.path.join(cfg.logging.dir, "collected.jsonl")) if rank == 0 else None

    def record(self, step, split, values, console) -> None:
        self.records.append({"step": step, "split": split, **values})

    def step_done(self, step, seconds, tokens, skipped, eta) -> None:
        self.steps.append(step)

    def checkpoint_done(self, op, seconds) -> None:
        self.events.append(["checkpoint_done", op])

    def resumed(self, step, resumes) -> None:
        self.events.append(["resumed", step, resumes])

    def close(self) -> None:
        self.events.append(["close"])
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps({"records": self.records, "steps": self.steps,
                                    "events": self.events}) + "\n")  # fmt: skip


def _stdlib_zip(path: Path, members: int = 40) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for src in sorted(Path(os.__file__).parent.glob("*.py"))[:members]:
            z.writestr(src.name, src.read_text(encoding="utf-8", errors="replace"))
    return path


@pytest.fixture(scope="module")
def plugin_runs(tmp_path_factory):
    """The stock commands with ``--plugin tests.extending_plugin``: data_prep on a zip archive,
    4 trainer steps (one process) of a ``[linear, pool]`` model with ``logging.sinks:
    [collect, wandb, mlflow]`` and TensorBoard, then the same run resumed to step 6. W&B runs
    offline, MLflow logs to a sqlite store outside the run's directory."""
    tmp = tmp_path_factory.mktemp("ext")
    db = tmp / "mlflow.db"
    env = child_env(WANDB_MODE="offline", MLFLOW_TRACKING_URI=f"sqlite:///{db}")
    data, run_dir = tmp / "data", tmp / "run"
    prep = subprocess.run(
        [sys.executable, "-m", "data_prep", "--plugin", "tests.extending_plugin", "--source",
         f"zip:{_stdlib_zip(tmp / 'stdlib.zip')}", "--out", str(data), "--seq-len", "128",
         "--vocab-size", "2000", "--valid-fraction", "0.05", "--quiet"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert prep.returncode == 0, prep.stderr[-4000:]
    overrides = TEST_OVERRIDES + [
        f"data.path={data}", f"logging.dir={run_dir}", "model.num_layers=2",
        "model.layer_projections=[linear, pool]", "model.sharing=headwise",
        "train.micro_batch_size=2", "checkpoint.save_interval=0", "deepspeed.precision=fp32",
        "logging.sinks=[collect, wandb, mlflow]", "logging.tensorboard=true",
    ]  # fmt: skip
    procs = []
    for steps in (4, 6):
        cmd = [sys.executable, PRETRAIN, "--plugin", "tests.extending_plugin",
               "--config", TINY_CONFIG, *overrides, f"train.max_steps={steps}"]  # fmt: skip
        procs.append(subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                                    timeout=600))  # fmt: skip
        assert procs[-1].returncode == 0, procs[-1].stdout[-4000:] + procs[-1].stderr[-4000:]
    with open(run_dir / "collected.jsonl") as f:
        runs = [json.loads(line) for line in f]
    with open(run_dir / "metrics.jsonl") as f:
        jsonl = [json.loads(line) for line in f]
    manifest = json.loads((data / "manifest.json").read_text())
    return {"runs": runs, "jsonl": jsonl, "manifest": manifest, "stdout": [p.stdout for p in procs],
            "run_dir": run_dir, "mlflow_uri": f"sqlite:///{db}"}  # fmt: skip


def test_source_kind_through_data_prep_cli(plugin_runs):
    items = plugin_runs["manifest"]["source"]["items"]
    assert [i["kind"] for i in items] == ["zip"] and items[0]["members"] == 40


def test_projection_kind_trains(plugin_runs):
    first = plugin_runs["runs"][0]
    losses = [r["loss"] for r in first["records"] if r["split"] == "train"]
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses)
    setup = [ln for ln in plugin_runs["stdout"][0].splitlines() if ln.startswith("[setup]")]
    assert setup and "pool" in setup[0].split("schedule=")[1]


def test_sink_receives_real_metrics(plugin_runs):
    """The sink saw every optimizer step and the same train records as metrics.jsonl."""
    first = plugin_runs["runs"][0]
    assert first["steps"] == [1, 2, 3, 4]
    train = [r for r in first["records"] if r["split"] == "train"]
    want = [r for r in plugin_runs["jsonl"] if r["split"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert [r["loss"] for r in train] == [r["loss"] for r in want[:4]]
    assert {"loss", "mlm_accuracy", "lr", "tokens_per_s"} <= set(train[0])
    assert first["events"] == [["checkpoint_done", "save"], ["close"]]


def test_sink_sees_the_resume(plugin_runs):
    """Built from logging.sinks inside Metrics, the sink of a resumed run sees the load and the
    resume, which fire while the trainer is constructed, then steps 5 and 6."""
    second = plugin_runs["runs"][1]
    assert second["events"][:2] == [["checkpoint_done", "load"], ["resumed", 4, 1]]
    assert second["events"][-2:] == [["checkpoint_done", "save"], ["close"]]
    assert second["steps"] == [5, 6]
    assert [r["step"] for r in second["records"] if r["split"] == "train"] == [5, 6]


def test_unknown_plugin_or_sink_is_one_line(capsys):
    from linformer_ds import train
    from linformer_ds.config import ConfigError, load_config
    from linformer_ds.metrics import check_sinks

    assert train.main(["--plugin", "no_such_module_xyz", "--config", TINY_CONFIG]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --plugin no_such_module_xyz: ModuleNotFoundError: No module named "\
        "'no_such_module_xyz'"  # fmt: skip
    cfg = load_config(TINY_CONFIG, ["logging.sinks=[nope]"])
    with pytest.raises(ConfigError, match="logging.sinks: 'nope' is not a registered sink"):
        check_sinks(cfg)


# ============================================================= the tracker sinks on the same run
def _scalars_of_jsonl(records: list[dict]) -> dict[str, dict[int, float]]:
    """``split/name`` -> step -> value of metrics.jsonl's records (what every sink was given)."""
    out: dict[str, dict[int, float]] = {}
    for r in records:
        for k, v in r.items():
            if k not in ("step", "split"):
                out.setdefault(f"{r['split']}/{k}", {})[r["step"]] = float(v)
    return out


def _tensorboard_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """tag -> step -> value of every event file under ``run_dir/tensorboard`` (both runs')."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def _same(got: dict[str, dict[int, float]], want: dict[str, dict[int, float]], f32=False):
    """Tag by tag, step by step: equal (NaN equals NaN; ``f32``: at TensorBoard's float32)."""
    assert sorted(got) == sorted(want)
    for tag in want:
        assert sorted(got[tag]) == sorted(want[tag]), tag
        for step, v in want[tag].items():
            g = got[tag][step]
            if f32:
                g, v = (float(torch.tensor(x, dtype=torch.float32)) for x in (g, v))
            assert g == v or (math.isnan(g) and math.isnan(v)), (tag, step, g, v)


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {prefix + k: v})
    return out


def _first_config(run_dir: Path) -> dict[str, Any]:
    """The first run's resolved config, flattened: config.json is the resumed run's (it
    differs in train.max_steps only: config_history.jsonl says so)."""
    changed = [json.loads(line)["changed"] for line in open(run_dir / "config_history.jsonl")]
    assert changed == [{}, {"train.max_steps": [4, 6]}]
    return {**_flat(json.loads((run_dir / "config.json").read_text())), "train.max_steps": 4}


def _wandb_records(path: Path) -> Iterator[Any]:
    """The protobuf records of a W&B run file (``run-ID.wandb``), parsed with wandb's own
    ``Record``: a 7-byte header (``:W&B``, magic, version), then LevelDB log blocks of 32 KiB
    whose chunks (4-byte CRC, 2-byte length, 1-byte type: full, first, middle, last) carry one
    record each (wandb 0.31 no longer ships its Python reader)."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, part = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header: padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if kind == 0:
            break
        part += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full or last: a whole record
            record = Record()
            record.ParseFromString(part)
            part = b""
            yield record


def test_wandb_offline_records_one_resumed_run(plugin_runs):
    """Two processes (4 steps, then resumed to 6) wrote two offline run directories of one W&B
    run id; the config once (the first's); the history is TensorBoard's scalars, tag by tag and
    step by step, and metrics.jsonl's values exactly."""
    run_dir = plugin_runs["run_dir"]
    files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 2
    ids, configs, history = [], [], {}
    for path in files:
        for r in _wandb_records(path):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                ids.append(r.run.run_id)
                configs.append({i.key: json.loads(i.value_json) for i in r.run.config.update
                                if i.key != "_wandb"})  # fmt: skip
            elif kind == "history":
                step = r.history.step.num
                for i in r.history.item:
                    key = i.key or "/".join(i.nested_key)  # train/loss: nested ["train", "loss"]
                    if not key.startswith("_"):
                        history.setdefault(key, {})[step] = json.loads(i.value_json)
    assert len(ids) == 2 and len(set(ids)) == 1
    assert configs == [_first_config(run_dir), {}]
    _same(history, _tensorboard_scalars(run_dir), f32=True)
    _same(history, _scalars_of_jsonl(plugin_runs["jsonl"]))
    assert sorted(history["train/loss"]) == [1, 2, 3, 4, 5, 6]


def test_mlflow_records_one_resumed_run(plugin_runs):
    """Read back with MlflowClient from the sqlite store: one run, finished, the first run's
    resolved config as params, every TensorBoard scalar (steps 1-6) under the same tag."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(plugin_runs["mlflow_uri"])
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments)
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.params == {k: str(v) for k, v in _first_config(plugin_runs["run_dir"]).items()}
    history = {
        tag: {m.step: m.value for m in client.get_metric_history(run.info.run_id, tag)}
        for tag in run.data.metrics
    }
    _same(history, _tensorboard_scalars(plugin_runs["run_dir"]), f32=True)
    _same(history, _scalars_of_jsonl(plugin_runs["jsonl"]))
    assert sorted(history["train/loss"]) == [1, 2, 3, 4, 5, 6]


def test_a_tracker_not_installed_is_one_config_error(monkeypatch):
    """A tracker sink whose library does not import stops the run before any work (every rank:
    check_sinks) with one line naming the extra; the sink itself is rank 0's only."""
    from linformer_ds.config import ConfigError, load_config
    from linformer_ds.metrics import check_sinks
    from linformer_ds.trackers import TRACKERS

    cfg = load_config(TINY_CONFIG, ["logging.sinks=[mlflow, wandb]"])
    check_sinks(cfg)  # both installed here (the dev extra)
    assert TRACKERS["wandb"](cfg, 1, 2) is None and TRACKERS["mlflow"](cfg, 3, 4) is None
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now fails: not installed
    with pytest.raises(ConfigError) as e:
        check_sinks(cfg)
    assert str(e.value) == (
        "logging.sinks: wandb needs the wandb package, which is not installed; install it with: "
        "pip install linformer_ds[wandb]"
    )


# ================================================================= extensions that fail cleanly
# docs/extending.md: a sink that raises is one warning line naming it and the event, and is
# dropped (nothing more goes to it); the run and every other sink go on.
EVENTS = ("resumed", "data_wait", "step_done", "record", "checkpoint_done")
POINTS = ("factory", "load_state_dict", *EVENTS, "state_dict", "close")
ERRORS = (RuntimeError, ValueError, OSError, KeyError, ZeroDivisionError, AttributeError)


class _Recorder(Sink):
    """Every call it gets, in order; ``fail``: the call that raises ``error``."""

    def __init__(self, fail: str | None = None, error: Exception | None = None) -> None:
        self.calls: list[str] = []
        self.fail, self.error = fail, error

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name == self.fail:
            raise self.error

    def record(self, step, split, values, console):
        self._call("record")

    def data_wait(self, seconds):
        self._call("data_wait")

    def step_done(self, step, seconds, tokens, skipped, eta):
        self._call("step_done")

    def checkpoint_done(self, op, seconds):
        self._call("checkpoint_done")

    def resumed(self, step, resumes):
        self._call("resumed")

    def state_dict(self):
        self._call("state_dict")
        return {"calls": len(self.calls)}

    def load_state_dict(self, state):
        self._call("load_state_dict")

    def close(self):
        self._call("close")


def _drive(metrics) -> dict:
    """Every event of a resumed run, in the trainer's order; returns the checkpoint state."""
    metrics.load_state_dict({"window": [0.0] * 4, "elapsed": 1.0, "resumes": 0,
                             "sinks": {"boom": {"calls": 0}, "rec": {"calls": 0}}})  # fmt: skip
    metrics.on_resume(3, 0.25)  # checkpoint_done (load), resumed
    metrics.timed_batch(lambda: None)  # data_wait
    metrics.step_done(4, [2.0, 1.0, 4.0, 0.0], 0.5)  # step_done
    metrics.log_eval(4, {"loss": 0.5})  # record
    metrics.checkpoint_done("save", 0.25)
    state = metrics.state_dict()
    metrics.close()
    return state


_CONFIGS: dict[str, Any] = {}
# what a sink that never fails receives from _drive, in order
ALL_CALLS = ["load_state_dict", "checkpoint_done", "resumed", "data_wait", "step_done",
             "record", "checkpoint_done", "state_dict", "close"]  # fmt: skip


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(point=st.sampled_from(POINTS), error=st.sampled_from(ERRORS),
       text=st.text(alphabet="ab \n:'é", max_size=12), first=st.booleans())  # fmt: skip
def test_a_failing_sink_is_one_line_and_dropped(tmp_path, capsys, point, error, text, first):
    """A registered sink raising at a drawn point (its factory, any event, its state, close),
    listed before or after a sink that never fails: one stderr line naming the sink and the
    event, the failing sink gets nothing after it, the other sink and the run see everything."""
    from linformer_ds.config import load_config
    from linformer_ds.metrics import Metrics, register_sink, unregister_sink

    boom = _Recorder(point, error(text))
    rec = _Recorder()

    def boom_factory(cfg, rank, world):
        if point == "factory":
            raise error(text)
        return boom

    register_sink("boom", boom_factory, replace=True)
    register_sink("rec", lambda cfg, rank, world: rec, replace=True)
    names = "[boom, rec]" if first else "[rec, boom]"
    if names not in _CONFIGS:  # (loaded once: 0.1 s each)
        _CONFIGS[names] = load_config(TINY_CONFIG, [f"logging.sinks={names}",
                                                    "train.peak_tflops=1.0"])  # fmt: skip
    run = Path(tempfile.mkdtemp(dir=tmp_path))  # one per example
    cfg = _CONFIGS[names]
    cfg = dataclasses.replace(cfg, logging=dataclasses.replace(cfg.logging, dir=str(run)))
    capsys.readouterr()
    try:
        metrics = Metrics(cfg, 0, 1, torch.device("cpu"), flops_per_token=1e6,
                          tokens_per_step=64)  # fmt: skip
        state = _drive(metrics)
    finally:
        unregister_sink("boom")
        unregister_sink("rec")
    err = capsys.readouterr().err.strip().splitlines()
    event = "its factory" if point == "factory" else point
    assert len(err) == 1 and err[0].startswith(f"[warn] metrics sink 'boom' failed in {event} ("), (
        err
    )
    assert err[0].endswith("it is dropped (no further events go to it); training goes on")
    assert type(error(text)).__name__ in err[0]
    assert rec.calls == ALL_CALLS  # the other sink saw every event
    want = [] if point == "factory" else ALL_CALLS[: ALL_CALLS.index(point) + 1]
    assert boom.calls == want  # nothing after the failure, close included
    assert ("boom" in state["sinks"]) == (point == "close")  # dropped before the save: no state
    assert state["sinks"]["rec"] == {"calls": ALL_CALLS.index("state_dict") + 1}
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["split"] for line in lines] == ["eval"]  # the built-in sink too


def test_a_sink_refusing_the_config_stops_the_run_in_one_line():
    """The deliberate stop: a factory's ConfigError, or anything its check(cfg) raises, is one
    config error naming the sink, before any step."""
    from linformer_ds.config import ConfigError, load_config
    from linformer_ds.metrics import Metrics, check_sinks, register_sink, unregister_sink

    def factory(cfg, rank, world):
        raise ConfigError("logging.sinks: refuse needs refuse.url")

    def check(cfg):
        raise KeyError("url")

    factory.check = None
    register_sink("refuse", factory, replace=True)
    try:
        cfg = load_config(TINY_CONFIG, ["logging.sinks=[refuse]", "train.peak_tflops=1.0"])
        with pytest.raises(ConfigError, match="refuse needs refuse.url"):
            Metrics(cfg, 1, 2, torch.device("cpu"), flops_per_token=1e6, tokens_per_step=64)
        factory.check = check
        with pytest.raises(ConfigError) as e:
            check_sinks(cfg)
        assert (
            str(e.value) == "logging.sinks: sink 'refuse' failed its check(cfg) (KeyError: 'url')"
        )
    finally:
        unregister_sink("refuse")


# ------------------------------------------------------------------------- plugin module names
def _importable(name: str) -> bool:
    """The reference: ``name`` is a module this process imports without any plugin (the
    standard library, an installed module, one already imported)."""
    if name in sys.stdlib_module_names or name in sys.modules:
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return True


def _installed_names() -> list[str]:
    return sorted(n for n in importlib.metadata.packages_distributions()
                  if n.isidentifier() and _importable(n))  # fmt: skip


FRESH = st.from_regex(r"[a-z][a-z0-9_]{3,10}", fullmatch=True).filter(lambda n: not _importable(n))
PLUGIN_NAMES = st.one_of(
    st.sampled_from(sorted(n for n in sys.stdlib_module_names if n.isidentifier())),
    st.deferred(lambda: st.sampled_from(_installed_names())),  # (listed when first drawn: ~1 s)
    st.sampled_from(["linformer_ds", "data_prep", "tests", "hypothesis"]),  # already imported
    FRESH,
    FRESH,
)


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(name=PLUGIN_NAMES, form=st.sampled_from(["file", "package", "dotted"]))
def test_a_plugin_named_like_an_importable_module_is_refused(tmp_path_factory, monkeypatch,
                                                             name, form):  # fmt: skip
    """A plugin drawn from the standard library's names, the installed packages', modules
    already imported and fresh names, as a .py file, a package directory or a dotted name
    with its file in the working directory: refused in one line naming it exactly when the
    name is importable otherwise (a dotted name: when it is a standard-library or installed
    one), its code never run and sys.modules unchanged; a fresh name is imported."""
    from linformer_ds.plugins import PluginError, import_plugin

    root = tmp_path_factory.mktemp("plugin")
    marker = root / "ran"
    code = f"open({str(marker)!r}, 'w').close()\n"
    if form == "file":
        (root / f"{name}.py").write_text(code)
        arg = str(root / f"{name}.py")
    else:
        (root / name).mkdir()
        (root / name / "__init__.py").write_text(code)
        arg = str(root / name) if form == "package" else name
    monkeypatch.chdir(root)
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = sys.modules.get(name)
    refused = _importable(name)
    try:
        import_plugin(arg)
    except PluginError as e:
        message = str(e)
        assert refused, message
        assert "\n" not in message and message.startswith(f"--plugin {arg}")
        assert repr(name) in message
        assert message.endswith(("rename it", "give your plugin module another name"))
        assert not marker.exists() and sys.modules.get(name) is before
    else:
        try:
            assert not refused and marker.exists()
            where = root / (f"{name}.py" if form == "file" else f"{name}/__init__.py")
            assert os.path.realpath(sys.modules[name].__file__) == os.path.realpath(where)
        finally:
            sys.modules.pop(name, None)


def test_plugin_paths_and_the_command_line(tmp_path, capsys):
    """A directory without __init__.py and a missing path are one line saying what --plugin
    takes; a stdlib-named file is refused by the real commands (pretrain, data_prep)
    before it runs; an override after --plugin is read."""
    from data_prep.__main__ import main as data_prep_main
    from linformer_ds import train

    (tmp_path / "loose").mkdir()
    (tmp_path / "json.py").write_text("raise SystemExit('ran')\n")
    (tmp_path / "fresh_plugin_h3.py").write_text("X = 1\n")
    for arg, want in ((tmp_path / "loose", "a directory without __init__.py; pass a package "
                       "directory (one holding __init__.py), a .py file or a dotted module name"),
                      (tmp_path / "nope.py", "no such file or directory; pass a .py file, a "
                       "package directory or a dotted module name"),
                      (tmp_path / "json.py", "its module name 'json' is also the "
                       "standard-library module json; a plugin may not replace a module the "
                       "process imports: rename it")):  # fmt: skip
        capsys.readouterr()
        assert train.main(["--plugin", str(arg), "--config", TINY_CONFIG]) == 2
        assert capsys.readouterr().err.strip() == f"error: --plugin {arg}: {want}"
        rc = data_prep_main(
            [
                "--plugin",
                str(arg),
                "--source",
                "stdlib",
                "--out",
                str(tmp_path / "out"),
                "--seq-len",
                "16",
                "--vocab-size",
                "100",
            ]
        )
        assert (
            rc == 2
            and capsys.readouterr().err.strip() == f"data_prep: error: --plugin {arg}: {want}"
        )
    try:  # an override after --plugin is read (its value checked), not "unrecognized"
        capsys.readouterr()
        rc = train.main(["--plugin", str(tmp_path / "fresh_plugin_h3.py"), "--config",
                         TINY_CONFIG, "train.max_steps=-5"])  # fmt: skip
        err = capsys.readouterr().err.strip()
        assert rc == 2 and err == "config error: train.max_steps: must be >= 1, got -5"
        assert "fresh_plugin_h3" in sys.modules  # imported first
    finally:
        sys.modules.pop("fresh_plugin_h3", None)
    assert not (tmp_path / "out").exists()


OPTIONS = [["--plugin", "a_plugin"], ["--plugin", "b_plugin"], ["--config", "c.yaml"],
           ["--print-config"]]  # fmt: skip


@settings(max_examples=50, deadline=None, derandomize=True)
@given(order=st.permutations(OPTIONS + [["x.y=1"], ["z=[a, b]"], ["w.v=-3"]]))
def test_overrides_anywhere_on_the_command_line(order):
    """Any order of options and overrides gives the same arguments (plugins and overrides in
    their relative order)."""
    from linformer_ds.train import parse_args

    args = parse_args([tok for part in order for tok in part])
    plugins = [p[1] for p in order if p[0] == "--plugin"]
    overrides = [p[0] for p in order if "=" in p[0]]
    assert args.plugin == plugins and args.overrides == overrides
    assert args.config == "c.yaml" and args.print_config


@settings(max_examples=30, deadline=None, derandomize=True)
@given(order=st.permutations([["--from", "hf:src"], ["--out", "w.yaml"], ["--overwrite"],
                              ["model.k=8"], ["model.max_seq_len=32"]]))  # fmt: skip
def test_convert_reads_overrides_anywhere(order):
    """launch/convert.py likewise: its model overrides before, between or after the options."""
    from linformer_ds.warm_start import parse_args

    args = parse_args([tok for part in order for tok in part])
    assert args.overrides == [p[0] for p in order if "=" in p[0]]
    assert (args.source, args.out, args.overwrite) == ("hf:src", "w.yaml", True)
