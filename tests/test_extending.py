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

import json
import math
import os
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
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
