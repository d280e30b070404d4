"""The run's stages (``train.stages``) over its sources (``data.sources`` or ``data.path``):
resolved and checked from the job config, opened, and their evaluations combined."""

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from linformer_ds.config import ConfigError
from linformer_ds.data.sampler import check_weight, normalized_weights
from linformer_ds.data.shards import ShardDataset, check_same_tokenizer, open_sources
from linformer_ds.model import get_projection, projection_stride
from linformer_ds.parallel.checks import config_errors


@dataclass
class Stage:
    """One stretch of the run: steps up to ``end_step`` train on a mixture of ``names`` (paths
    ``paths``, normalized ``weights``) with ``micro_batch_size`` rows per rank."""

    end_step: int
    names: list[str]
    paths: list[str]
    weights: list[float]
    micro_batch_size: int


def _fail(msg: str) -> None:
    raise ConfigError(msg)


def _path_name(path: str) -> str:
    return os.path.basename(os.path.normpath(str(path))) or str(path)


def _catalogue(cfg: Any) -> tuple[dict[str, tuple[str, float]], list[str]]:
    """``data.sources`` (or ``data.path``, the one-source shorthand) as ``name -> (path,
    weight)`` plus the names in order; a :class:`ConfigError` for a malformed entry."""
    sources = list(getattr(cfg.data, "sources", None) or [])
    if not sources:
        return {_path_name(cfg.data.path): (str(cfg.data.path), 1.0)}, [_path_name(cfg.data.path)]
    cat: dict[str, tuple[str, float]] = {}
    for i, s in enumerate(sources):
        key = f"data.sources[{i}]"
        name, path, weight = str(s.name or "").strip(), str(s.path or "").strip(), s.weight
        if not name:
            _fail(f"{key}.name: must not be empty (a short name for logs and metrics)")
        if any(c in name for c in "/ \t=,"):
            _fail(f"{key}.name: {name!r} must not contain '/', blanks, '=' or ','")
        if name in cat:
            _fail(f"{key}.name: {name!r} is used twice; give every source its own name")
        if not path:
            _fail(f"{key}.path: must not be empty (a data_prep output directory)")
        try:
            check_weight(weight)
        except (TypeError, ValueError) as e:
            _fail(f"{key}.weight: {e} (weights are relative: any numbers >= 0)")
        cat[name] = (path, float(weight))
    return cat, [str(s.name).strip() for s in sources]


def _same_dir(a: str, b: str) -> bool:
    return os.path.normpath(a) == os.path.normpath(b) or os.path.realpath(a) == os.path.realpath(b)


def _stage_path_name(
    k: int,
    path: str,
    cat: dict[str, tuple[str, float]],
    order: list[str],
    raw: list[Any],
    taken: dict[str, str],
) -> str:
    """The source name of ``train.stages[k].path``: the source with that directory (in
    data.sources, or an earlier stage path), else the folder's name, which must not name another
    directory, a source that a stage lists or another stage path (a name is one source in the
    sampler, the checkpoint and the metrics: two directories under one name would both open
    as one of them)."""
    same = [n for n in order if os.path.normpath(cat[n][0]) == os.path.normpath(path)]
    same += [n for n, p in taken.items() if _same_dir(p, path)]
    if same:
        return same[0]
    name = _path_name(path)
    listed = {n for st in raw for n in (st.sources or [])}
    other = taken.get(name) or (cat[name][0] if name in cat and name in listed else None)
    if other is not None and not _same_dir(other, path):
        where = "another stage's path" if name in taken else f"source {name!r} (data.sources)"
        _fail(
            f"train.stages[{k}].path: {path} would be named {name!r} after its folder, the name "
            f"of {where} at {other}; add it to data.sources under a name of its own ({{name: "
            f"{name}_{k}, path: {path}}}) and give this stage sources: [{name}_{k}]"
        )
    return name


def resolve_stages(cfg: Any) -> list[Stage]:
    """The run's stages from ``data.sources`` / ``data.path`` and ``train.stages`` (none: one
    stage over every source to ``train.max_steps``); a :class:`ConfigError` naming the key for
    unknown source names, bad weights and end steps."""
    cat, order = _catalogue(cfg)
    t = cfg.train
    max_steps, mb0 = int(t.max_steps), int(t.micro_batch_size)
    raw = list(getattr(t, "stages", None) or [])
    if not raw:
        try:
            weights = normalized_weights([cat[n][1] for n in order])
        except ValueError as e:
            _fail(f"data.sources: {e}")
        return [Stage(max_steps, order, [cat[n][0] for n in order], weights, mb0)]
    stages: list[Stage] = []
    prev = 0
    taken: dict[str, str] = {}  # names given to stage paths so far -> their path
    for k, st in enumerate(raw):
        key = f"train.stages[{k}]"
        names = list(st.sources or [])
        if bool(names) == bool(st.path):
            _fail(f"{key}: give either sources (names from data.sources) or path (one source)")
        if st.path:
            path = str(st.path)
            names = [_stage_path_name(k, path, cat, order, raw, taken)]
            paths, weights = [path], [1.0]
            taken[names[0]] = path
        else:
            unknown = [n for n in names if n not in cat]
            if unknown:
                _fail(
                    f"{key}.sources: unknown source {unknown[0]!r}; the sources (data.sources) "
                    f"are {', '.join(order)}"
                )
            if len(set(names)) != len(names):
                _fail(f"{key}.sources: a source is listed twice: {names}")
            paths = [cat[n][0] for n in names]
            weights = [cat[n][1] for n in names]
            if st.weights is not None:
                if len(st.weights) != len(names):
                    _fail(
                        f"{key}.weights: {len(st.weights)} weights for {len(names)} sources "
                        f"({names})"
                    )
                weights = list(st.weights)
        try:
            weights = normalized_weights(weights)
        except ValueError as e:  # the stage's own weights, or the sources' it uses
            _fail(f"{key}.weights: {e}" if st.weights is not None or st.path else
                  f"data.sources (weights of train.stages[{k}].sources): {e}")  # fmt: skip
        end = st.end_step
        last = k == len(raw) - 1
        if end is None and not last:
            _fail(f"{key}.end_step: only the last stage may leave it unset (= train.max_steps)")
        end = max_steps if end is None else int(end)
        if end <= prev:
            _fail(
                f"{key}.end_step: {end} must be greater than the previous stage's end "
                f"({prev}); stages are in step order"
            )
        if last and end != max_steps:
            _fail(
                f"{key}.end_step: the last stage must end at train.max_steps={max_steps} (the "
                f"LR schedule runs over the whole run), got {end}"
            )
        mb = mb0 if st.micro_batch_size is None else int(st.micro_batch_size)
        if mb < 1:
            _fail(f"{key}.micro_batch_size: must be >= 1 (or null: train.micro_batch_size)")
        if mb != mb0 and getattr(t, "global_batch_size", None) is not None:
            _fail(
                f"{key}.micro_batch_size: {mb} changes the global batch, which "
                "train.global_batch_size fixes; unset one of them"
            )
        stages.append(Stage(end, names, paths, weights, mb))
        prev = end
    return stages


def check_stage_lengths(
    cfg: Any, stages: list[Stage], seq_lens: list[int], world_size: int
) -> None:
    """What the data's N per stage must satisfy: N <= model.max_seq_len, every conv layer's
    stride divides N (a staged run; conv windows never straddle padding), and the
    sequence-parallel split of each stage's N."""
    model = cfg.model
    staged = len(list(getattr(cfg.train, "stages", None) or [])) > 0
    for k, (stage, n) in enumerate(zip(stages, seq_lens)):
        where = f"train.stages[{k}] (N={n} from {stage.paths[0]})" if staged else f"data (N={n})"
        if n > model.max_seq_len:
            _fail(f"{where}: N exceeds model.max_seq_len={model.max_seq_len}; size the model "
                  "for the largest stage")  # fmt: skip
        if staged:
            for i, kind in enumerate(model.projection_schedule()):
                r = projection_stride(model, i)  # conv: max_seq_len / k; None: any N
                if r is not None and n % r:
                    rule = get_projection(kind).stride_rule
                    _fail(
                        f"{where}: {kind} layer {i} has stride {rule + ' = ' if rule else ''}{r}, "
                        f"which does not divide N; use an N that is a multiple of {r}"
                    )
        sp = int(cfg.parallel.sequence_parallel_size)
        if sp > 1:
            extra = cfg.deepspeed.extra_dict() if hasattr(cfg.deepspeed, "extra_dict") else {}
            scatter = extra.get("zero_optimization", {}).get("reduce_scatter", True)
            errors = config_errors(
                sp, world_size=world_size, seq_len=n, model=model,
                zero_stage=cfg.deepspeed.zero.stage, zero_reduce_scatter=bool(scatter),
                shard=getattr(cfg.parallel, "shard_sequence_parameters", False),  # or auto
            )  # fmt: skip
            if errors:
                _fail(f"{where}: {errors[0]}")


def combine_eval(
    stage: Stage, figures: dict[str, dict[str, float]], legacy: bool
) -> dict[str, float]:
    """The ``[eval]`` record of a stage from each source's figures (``loss``, ``perplexity``,
    ``mlm_accuracy``): the mixture's ``loss`` and ``mlm_accuracy`` are the means weighted by the
    training weights (``perplexity`` = exp(loss)), plus ``loss/NAME`` etc. per source (not for
    a one-source run, whose record is the source's)."""
    if legacy:
        return dict(next(iter(figures.values())))
    loss = sum(w * figures[n]["loss"] for n, w in zip(stage.names, stage.weights))
    acc = sum(w * figures[n]["mlm_accuracy"] for n, w in zip(stage.names, stage.weights))
    out = {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "mlm_accuracy": acc}
    for n in stage.names:
        out.update({f"{k}/{n}": v for k, v in figures[n].items()})
    return out


def open_stages(
    cfg: Any, world_size: int, with_valid: bool, stages: Sequence[Stage] = ()
) -> tuple[list[Stage], dict[str, ShardDataset], dict[str, ShardDataset]]:
    """The run's stages (``stages``, as :func:`resolve_stages` gave them; resolved here when
    not given) and the train (and, ``with_valid``, valid) split of every source they use,
    checked: same tokenizer everywhere, one N per stage, each stage's N against the model
    (:func:`check_stage_lengths`). :class:`DataError` / ``ConfigError`` name the problem."""
    stages = list(stages) or resolve_stages(cfg)
    names = list(dict.fromkeys(n for s in stages for n in s.names))
    paths = {n: p for s in stages for n, p in zip(s.names, s.paths)}
    d, init_from = cfg.data, cfg.checkpoint.init_from
    opened = open_sources(names, [paths[n] for n in names], d.train_split, cfg.model,
                          d.verify_checksums, same_seq_len=False, init_from=init_from)  # fmt: skip
    train = dict(zip(names, opened))
    for s in stages:
        check_same_tokenizer(s.names, [train[n] for n in s.names])
    check_stage_lengths(cfg, stages, [train[s.names[0]].seq_len for s in stages], world_size)
    valid: dict[str, ShardDataset] = {}
    if with_valid:
        opened = open_sources(names, [paths[n] for n in names], d.valid_split, cfg.model,
                              d.verify_checksums, same_seq_len=False,
                              init_from=init_from)  # fmt: skip
        valid = dict(zip(names, opened))
    return stages, train, valid
