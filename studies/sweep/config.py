"""The sweep file: its schema (variants, grids, data, divergence limits, launcher) and
:func:`load_sweep`, which parses and checks it; every error names the key."""

import itertools
import math
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
PRETRAIN = REPO / "launch" / "pretrain.py"
SWEEP_CLI = REPO / "studies" / "run_sweep.py"
EXIT_NONFINITE = 3  # linformer_ds.trainer.EXIT_NONFINITE (not imported: it pulls in deepspeed)
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
TOP_KEYS = (
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
)
GRID_KEYS = ("name", "variants", "seq_len", "k", "lr", "seed")


class SweepError(ValueError):
    """A sweep file or option is invalid; the message names the key."""


# ======================================================================================= schema
@dataclass
class Variant:
    """A named set of overrides; ``uses_k=False`` (dense) collapses the k axis to one run;
    ``data_path`` (optional) trains this variant on that prebuilt data_prep output instead of
    the sweep's data (e.g. ``--packing pad`` beside ``full``)."""

    name: str
    overrides: list[str]
    uses_k: bool = True
    data_path: str | None = None


@dataclass
class Grid:
    """One factorial block of the sweep; the sweep runs the union of its grids."""

    name: str
    variants: list[str]
    seq_len: list[int]
    k: list[int]
    lr: list[float]
    seed: list[int]


@dataclass
class DataSpec:
    """How to build the data_prep output for each N (one shared tokenizer); ``path`` names a
    prebuilt data_prep output used as it is (its manifest's seq_len must equal every N)."""

    source: list[str] = field(default_factory=lambda: ["stdlib"])
    vocab_size: int = 8000
    args: list[str] = field(default_factory=list)  # extra data_prep flags, e.g. --max-bytes
    cache_dir: str = "data/sweep"
    path: str | None = None


@dataclass
class Point:
    """One training run of the sweep."""

    index: int
    id: str
    grids: list[str]
    variant: str
    seq_len: int
    k: int | None  # None for variants that do not use k
    lr: float
    seed: int


@dataclass
class SweepConfig:
    """A parsed sweep file; paths are absolute."""

    name: str
    path: Path
    base_config: Path
    base_overrides: list[str]
    variants: dict[str, Variant]
    grids: list[Grid]
    data: DataSpec
    out: Path
    tokens_per_step: int | None = None  # micro_batch_size = tokens_per_step // N
    eval_tokens: int | None = None  # eval_batches = eval_tokens // (micro_batch_size * N)
    max_loss: float | None = None  # default 1.5 * ln(vocab_size)
    max_rise: float = 1.0
    point_timeout_s: float | None = None
    launcher: list[str] = field(default_factory=lambda: [sys.executable])
    env: dict[str, str] = field(default_factory=dict)
    slurm: dict[str, Any] = field(default_factory=dict)

    def points(self) -> list[Point]:
        """The union of all grids, in file order, without duplicates."""
        out: dict[str, Point] = {}
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


def point_id(variant: str, n: int, k: int | None, lr: float, seed: int) -> str:
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


def _check_overrides(items: Any, key: str) -> list[str]:
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


def load_sweep(path: str, out: str | None = None) -> SweepConfig:
    """Parse and validate a sweep YAML; relative paths are taken from the repo root."""
    p = Path(path).resolve()
    raw = _read_mapping(p, path)
    base_config = (REPO / raw["base_config"]).resolve()
    if not base_config.is_file():
        raise SweepError(f"base_config: file not found: {raw['base_config']}")
    variants = _parse_variants(raw["variants"])
    if not isinstance(raw["grids"], list) or not raw["grids"]:
        raise SweepError("grids: must be a non-empty list")
    div = _only_keys(raw.get("divergence") or {}, "divergence", ("max_loss", "max_rise"))
    name = str(raw.get("name", p.stem))
    cfg = SweepConfig(
        name=name,
        path=p,
        base_config=base_config,
        base_overrides=_check_overrides(raw.get("base_overrides", []), "base_overrides"),
        variants=variants,
        grids=[_parse_grid(i, g, variants) for i, g in enumerate(raw["grids"])],
        data=_parse_data(raw.get("data") or {}),
        out=Path(out or (REPO / raw.get("out", f"runs/sweeps/{name}"))).resolve(),
        tokens_per_step=_positive_or_none(raw, "tokens_per_step"),
        eval_tokens=_positive_or_none(raw, "eval_tokens"),
        max_loss=div.get("max_loss"),
        max_rise=float(div.get("max_rise", 1.0)),
        point_timeout_s=raw.get("point_timeout_s"),
        launcher=_parse_launcher(raw.get("launcher", [sys.executable])),
        env={str(k): str(v) for k, v in (raw.get("env") or {}).items()},
        slurm=dict(raw.get("slurm") or {}),
    )
    return cfg


def _read_mapping(p: Path, path: str) -> dict[str, Any]:
    """The file's top-level mapping, with only known keys and the required ones present."""
    if not p.is_file():
        raise SweepError(f"sweep file not found: {path}")
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise SweepError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise SweepError(f"{path}: top level must be a mapping")
    unknown = sorted(set(raw) - set(TOP_KEYS))
    if unknown:
        raise SweepError(f"{path}: unknown key(s) {unknown}; known: {sorted(TOP_KEYS)}")
    for key in ("base_config", "variants", "grids"):
        if key not in raw:
            raise SweepError(f"{path}: missing required key {key!r}")
    return raw


def _only_keys(d: dict[str, Any], where: str, known: tuple) -> dict[str, Any]:
    bad = sorted(set(d) - set(known))
    if bad:
        raise SweepError(f"{where}: unknown key(s) {bad}")
    return d


def _parse_variants(raw: Any) -> dict[str, Variant]:
    """``name: [overrides]`` or ``name: {overrides: [...], uses_k: bool, data_path: str}``."""
    if not isinstance(raw, dict) or not raw:
        raise SweepError("variants: must be a non-empty mapping name -> overrides")
    variants: dict[str, Variant] = {}
    for name, spec in raw.items():
        if isinstance(spec, list):
            spec = {"overrides": spec}
        if not isinstance(spec, dict) or set(spec) - {"overrides", "uses_k", "data_path"}:
            raise SweepError(
                f"variants.{name}: must be a list of overrides or "
                "{overrides: [...], uses_k: bool, data_path: str}"
            )
        ov = _check_overrides(spec.get("overrides", []), f"variants.{name}.overrides")
        dp = spec.get("data_path")
        dp = None if dp is None else str((REPO / str(dp)).resolve())
        variants[name] = Variant(name, ov, bool(spec.get("uses_k", True)), dp)
    return variants


def _parse_grid(i: int, g: Any, variants: dict[str, Variant]) -> Grid:
    """Grid number ``i``: known variants, lr > 0, N >= 2 (k defaults to 256, seed to 0)."""
    key = f"grids[{i}]"
    if not isinstance(g, dict):
        raise SweepError(f"{key}: must be a mapping")
    _only_keys(g, key, GRID_KEYS)
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
    return grid


def _parse_data(d: dict[str, Any]) -> DataSpec:
    _only_keys(d, "data", ("source", "vocab_size", "args", "cache_dir", "path"))
    data = DataSpec(
        source=_as_list(d.get("source", "stdlib"), "data.source", str),
        vocab_size=int(d.get("vocab_size", 8000)),
        args=[str(a) for a in d.get("args", [])],
        cache_dir=str((REPO / d.get("cache_dir", "data/sweep")).resolve()),
        path=None if d.get("path") is None else str((REPO / str(d["path"])).resolve()),
    )
    if data.vocab_size < 10:
        raise SweepError(f"data.vocab_size: must be >= 10, got {data.vocab_size}")
    return data


def _parse_launcher(launcher: Any) -> list[str]:
    """A command prefix (list or shell string); ``python`` means this interpreter."""
    if isinstance(launcher, str):
        launcher = shlex.split(launcher)
    return [sys.executable if x == "python" else str(x) for x in launcher]


def _positive_or_none(raw: dict[str, Any], key: str) -> int | None:
    val = raw.get(key)
    if val is not None and (not isinstance(val, int) or val < 1):
        raise SweepError(f"{key}: must be a positive integer, got {val!r}")
    return val
