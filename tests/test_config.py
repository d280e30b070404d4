"""The job config's error contract over generated inputs (in-process, no training).

Any override value of any type for any key, any YAML document, any ``deepspeed.extra``: the
config either loads or raises one :class:`ConfigError` of one line naming the key; never another
exception. Every number of the schema declares its range, so the class of "huge value builds an
index list / allocates a tensor" cannot come back. ``deepspeed.extra`` never changes what the job
config owns, however it is spelled.
"""

import dataclasses
import os
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from linformer_ds import ds_config as ds_mod
from linformer_ds.config import ConfigError, JobConfig, from_dict, load_config, to_dict
from linformer_ds.ds_config import OWNED_DS_KEYS, deepspeed_config
from linformer_ds.model import ModelConfig, ModelConfigError
from linformer_ds.resolve import resolve
from tests.pretrain_utils import TEST_OVERRIDES, TINY_CONFIG

# CONFIG_FUZZ_EXAMPLES=2000 for a long run (the suite runs 60 per generated test)
FAST = settings(
    max_examples=int(os.environ.get("CONFIG_FUZZ_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    database=None,
)


def _leaf_keys(cls: Any = JobConfig, prefix: str = "") -> dict[str, Any]:
    """``{dotted key: field type}`` of every leaf field of the schema."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(f.type):
            out.update(_leaf_keys(f.type, key))
        else:
            out[key] = f.type
    return out


LEAF_KEYS = _leaf_keys()


def _number_kind(tp: Any) -> Any:
    """int or float if ``tp`` is int/float or ``int | None`` / ``float | None``, else None."""
    if typing.get_origin(tp) not in (None, typing.Union, types.UnionType):
        return None  # a list of numbers (optimizer.betas, model.layer_k): checked by code
    args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
    return args[0] if len(args) == 1 and args[0] in (int, float) else None


def _load(*overrides: str, path: str = TINY_CONFIG, world_size: int = 2):
    cfg = load_config(path, [*TEST_OVERRIDES, "data.path=/nonexistent", *overrides])
    return resolve(cfg, world_size)


def _refused(*overrides: str, **kw: Any) -> str:
    with pytest.raises(ConfigError) as e:
        _load(*overrides, **kw)
    msg = str(e.value)
    assert "\n" not in msg and msg.strip() == msg and "Traceback" not in msg, msg
    return msg


# ------------------------------------------------------------------------- declarations
def test_every_number_of_the_schema_declares_its_range():
    """Every int/float field of every section carries a Range (caps included), every model
    number is in ModelConfig's range tables: a value outside is refused by type, not by case."""
    from linformer_ds import model as model_mod

    undeclared = []
    for cls in set(_record_types(JobConfig)):
        for f in dataclasses.fields(cls):
            if _number_kind(f.type) and "range" not in f.metadata:
                undeclared.append(f"{cls.__name__}.{f.name}")
            rng = f.metadata.get("range")
            if _number_kind(f.type) is int and rng is not None:
                assert rng.hi is not None, f"{cls.__name__}.{f.name} has no upper bound"
    model_ranges = set(model_mod._INT_RANGES) | set(model_mod._FLOAT_RANGES)
    for f in dataclasses.fields(ModelConfig):
        if _number_kind(f.type) and f.name not in model_ranges:
            undeclared.append(f"ModelConfig.{f.name}")
    assert undeclared == []


def _record_types(cls: Any) -> list[Any]:
    """Every dataclass reachable from ``cls`` through its fields' types (lists included)."""
    out = []
    for f in dataclasses.fields(cls):
        for tp in (f.type, *typing.get_args(f.type)):
            for inner in (tp, *typing.get_args(tp)):
                if dataclasses.is_dataclass(inner) and inner is not ModelConfig:
                    out += [inner, *_record_types(inner)]
    return out


# ------------------------------------------------------------------------- generated overrides
YAML_ODDITIES = [
    "[1", "{a: 1}", "[1, 2]", "{", "}", "]", "null", "~", "''", '""', "true", "yes", "off",
    "${name}", "${nope}", "${oc.env:HOME}", "${eval:1}", "${train.max_steps}", "!!binary aGk=",
    "!!python/object/apply:os.system ['true']", "&a [*a]", "*a", "- 1", "a: b", "1e400",
    "-1e400", ".nan", ".inf", "0x10", "0o7", "1_000", "2^34", "${", "\\x00", "a\x00b", "é",
    "\u202e", "🙂", "'unterminated", "# comment", "1:2", "[[[[[[[[[[1]]]]]]]]]]", "{a: {b: {c: 1}}}",
]  # fmt: skip

values = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.sampled_from([str(2**62), str(2**34), str(2**31), str(-(2**63)), "0", "-1", "1"]),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(YAML_ODDITIES),
    st.text(max_size=20),
)
keys = st.one_of(
    st.sampled_from(sorted(LEAF_KEYS)),
    st.sampled_from(sorted(LEAF_KEYS)).map(lambda k: k + ".sub"),
    st.sampled_from(["model.nope", "nope", "train", "deepspeed", "deepspeed.zero", "model"]),
    st.builds(
        lambda a, b: f"deepspeed.extra.{a}.{b}",
        st.sampled_from(["zero_optimization", "flops_profiler", "data_types", "bf16", "x"]),
        st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12),
    ),
)


@FAST
@given(key=keys, value=values)
@example(key="train.max_steps", value="[1")
@example(key="optimizer.betas", value="{a: 1}")
@example(key="deepspeed.extra", value="[1]")
@example(key="model.vocab_size", value=str(2**34))
@example(key="train.micro_batch_size", value=str(2**62))
@example(key="deepspeed.extra.zero_optimization.stage", value="3")
@example(key="deepspeed.extra.activation_checkpointing.partition_activation", value="true")
@example(key="deepspeed.extra.flops_profiler.enabeld", value="true")
@example(key="deepspeed.extra.data_types.grad_accum_dtpye", value="fp32")
def test_any_override_loads_or_is_one_config_error(key, value):
    try:
        cfg = _load(f"{key}={value}")
    except ConfigError as e:
        msg = str(e)
        assert msg and "\n" not in msg and "Traceback" not in msg, msg
        return
    # accepted: the derived DeepSpeed config still says what the job config says, and the
    # config saved into checkpoints reads back as itself
    _assert_owned_unchanged(cfg)
    assert from_dict(to_dict(cfg)) == cfg


def _assert_owned_unchanged(cfg: JobConfig) -> None:
    from deepspeed.runtime.config import DeepSpeedConfig

    ds = deepspeed_config(cfg, 1)
    base = deepspeed_config(cfg, 1, with_extra=False)
    for c in (ds, base):
        c["train_batch_size"] = cfg.train.micro_batch_size * cfg.train.gradient_accumulation_steps
    parsed, reference = DeepSpeedConfig(ds), DeepSpeedConfig(base)
    assert parsed.zero_optimization_stage == cfg.deepspeed.zero.stage
    for what, (read, _) in ds_mod._OWNED_SETTINGS.items():
        assert read(parsed) == read(reference), what


def _ds_names() -> list[str]:
    """Key names DeepSpeed's config knows (top-level constants, ZeRO's fields and aliases) plus
    every owned key's parts, to build deepspeed.extra mappings from."""
    from deepspeed.runtime import constants
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    names = {v for k, v in vars(constants).items() if k.isupper() and isinstance(v, str)}
    names |= {n for name, f in DeepSpeedZeroConfig.model_fields.items() for n in (name, f.alias)}
    names |= {part for key in OWNED_DS_KEYS for part in key.split(".")}
    return sorted(n for n in names if n and n.isidentifier())


ds_names = st.deferred(lambda: st.sampled_from(_ds_names()))  # imports deepspeed when drawn
ds_scalars = st.one_of(
    st.booleans(), st.integers(-3, 2**33), st.sampled_from([0.5, "cpu", "fp32", "bf16", "none"])
)


@FAST
@given(
    extra=st.recursive(
        ds_scalars,
        lambda inner: st.dictionaries(ds_names, inner, min_size=1, max_size=3),
        max_leaves=6,
    ).filter(lambda x: isinstance(x, dict))
)
@example(extra={"zero_optimization": True})
@example(extra={"optimizer": False})
@example(extra={"optimizer": {"params": None}})
@example(extra={"zero_optimization": {"cpu_offload": True}})
@example(extra={"bfloat16": {"enabled": False}})
def test_any_deepspeed_extra_never_changes_what_the_job_config_owns(extra):
    """Whatever deepspeed.extra holds, however spelled: refused in one line, or the engine
    DeepSpeed would build has every owned setting (stage, offload, precision, clipping,
    optimizer, scheduler, batch sizes, activation checkpointing) as the job config set it."""
    import yaml

    value = yaml.safe_dump(extra, default_flow_style=True).strip()
    try:
        cfg = _load(f"deepspeed.extra={value}")
    except ConfigError as e:
        assert "\n" not in str(e), str(e)
        event("refused")
        return
    event("accepted")
    _assert_owned_unchanged(cfg)


# ------------------------------------------------------------------------- generated YAML files
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(), st.text(max_size=8), st.sampled_from(YAML_ODDITIES),
)  # fmt: skip
names = st.sampled_from(sorted({p for k in LEAF_KEYS for p in k.split(".")} | {"zz", "defaults"}))
documents = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(names, inner, max_size=4),
    max_leaves=12,
)


SECTION_KEYS = sorted({k.rsplit(".", 1)[0] for k in LEAF_KEYS if "." in k})


def _nest(pairs: list[Any]) -> dict[str, Any]:
    """``[(dotted key, value)]`` -> a nested mapping (a later key replaces an earlier one)."""
    doc: dict[str, Any] = {}
    for key, value in pairs:
        node = doc
        *parents, last = key.split(".")
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[last] = value
    return doc


@FAST
@given(
    doc=st.one_of(
        st.dictionaries(names, documents, max_size=5),
        st.lists(
            st.tuples(st.sampled_from(sorted(LEAF_KEYS) + SECTION_KEYS), documents), max_size=6
        ).map(_nest),
    )
)
def test_any_yaml_document_loads_or_is_one_config_error(doc, tmp_path_factory):
    import yaml

    path = tmp_path_factory.mktemp("yaml") / "job.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True))
    try:
        load_config(str(path), ["data.path=/nonexistent", "model.hidden_size=64"])
    except ConfigError as e:
        assert "\n" not in str(e), str(e)


@FAST
@given(doc=st.text(max_size=60))
@example(doc="deepspeed: {zero: [2]}")
@example(doc="\ufeffname: x\n")
@example(doc="a: [1\n")
@example(doc="- 1\n- 2\n")
def test_any_yaml_text_loads_or_is_one_config_error(doc, tmp_path_factory):
    path = tmp_path_factory.mktemp("yaml") / "job.yaml"
    path.write_text(doc)
    try:
        load_config(str(path), ["data.path=/nonexistent", "model.hidden_size=64"])
    except ConfigError as e:
        assert "\n" not in str(e), str(e)


def test_yaml_section_given_a_list_names_the_key(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("deepspeed: {zero: [2]}\n")
    msg = _refused(path=str(path))
    assert msg == f"{path}: deepspeed.zero: must be a mapping (a config section), got [2]"


@pytest.mark.parametrize(
    "chain", [["a.yaml"], ["a.yaml", "b.yaml"], ["a.yaml", "b.yaml", "c.yaml"]]
)
def test_defaults_cycle_is_named(chain, tmp_path):
    for this, parent in zip(chain, chain[1:] + chain[:1]):
        (tmp_path / this).write_text(f"defaults: {parent}\nname: {this}\n")
    msg = _refused(path=str(tmp_path / chain[0]))
    assert "includes itself (" + " -> ".join(chain + chain[:1]) + ")" in msg, msg
    assert "recursion" not in msg


# ------------------------------------------------------------------------- the issue's cases
@pytest.mark.parametrize(
    "override,message",
    [
        ("train.max_steps=[1", "override 'train.max_steps=[1': the value is not valid YAML"),
        ("optimizer.betas={a: 1}", "optimizer.betas: must be a list, got {'a': 1}"),
        ("deepspeed.extra=[1]", "deepspeed.extra: must be a mapping (a config section), got [1]"),
        ("model.vocab_size=17179869184", "model.vocab_size: must be <= 16777216"),
        ("train.micro_batch_size=4611686018427387904", "train.micro_batch_size: must be <= "),
        (
            "train.stages=[{path: x, micro_batch_size: 4611686018427387904}]",
            "train.stages[0].micro_batch_size: must be <= 1048576",
        ),
        (
            "deepspeed.extra.zero_optimization.stage=3",
            "deepspeed.extra.zero_optimization.stage: the job config sets it; use "
            "deepspeed.zero.stage instead",
        ),
        (
            "deepspeed.extra.activation_checkpointing.partition_activation=true",
            "use deepspeed.activation_checkpointing.partition_activations instead",
        ),
        (
            "deepspeed.extra.flops_profiler.enabeld=true",
            "deepspeed.extra.flops_profiler.enabeld: DeepSpeed does not read this key; did you "
            "mean 'enabled'?",
        ),
        (
            "deepspeed.extra.data_types.grad_accum_dtpye=fp32",
            "did you mean 'grad_accum_dtype'? (set by deepspeed.fp32_grad_accum)",
        ),
        ("deepspeed.extra.bf16.enabled=false", "use deepspeed.precision instead"),
        (
            "deepspeed.extra.optimizer.params.fusd=true",
            "deepspeed.extra.optimizer.params.fusd: AdamW (the optimizer DeepSpeed builds here) "
            "takes no such option; did you mean 'fused'?",
        ),
        ("deepspeed.extra.pipeline.stagse=2", "does not read this key; did you mean 'stages'?"),
        ("deepspeed.extra.fp16.enabled=true", "use deepspeed.precision instead"),
        ("deepspeed.extra.gradient_clipping=5", "use deepspeed.gradient_clipping instead"),
        ("deepspeed.extra.optimizer.params.lr=1", "use optimizer.lr instead"),
        ("deepspeed.extra.scheduler.type=WarmupLR", "use scheduler.* ("),
        ("deepspeed.extra.train_micro_batch_size_per_gpu=3", "use train.micro_batch_size"),
        ("deepspeed.extra.zero_optimization.cpu_offload=true", "deepspeed.zero.offload_optimizer"),
        (
            "deepspeed.extra.zero_optimization=true",  # the deprecated spelling of ZeRO-1
            "deepspeed.extra changes the ZeRO stage (2 -> 1), which the job config sets; use "
            "deepspeed.zero.stage instead",
        ),
    ],
)
def test_issue_cases(override, message):
    msg = _refused(override)
    assert message in msg, msg


def test_extra_keeps_what_the_job_config_does_not_own():
    """Tuning knobs DeepSpeed reads and the job config does not set still pass through."""
    cfg = _load(
        "deepspeed.extra.optimizer.params.fused=true",
        "deepspeed.extra.zero_optimization.reduce_scatter=false",
        "deepspeed.extra.flops_profiler.enabled=false",
        "deepspeed.extra.steps_per_print=5",
    )
    ds = deepspeed_config(cfg, 2)
    assert ds["optimizer"]["params"]["fused"] is True and ds["steps_per_print"] == 5
    assert ds["zero_optimization"]["reduce_scatter"] is False
    _assert_owned_unchanged(cfg)


def test_every_owned_key_is_refused():
    for key in OWNED_DS_KEYS:
        msg = _refused(f"deepspeed.extra.{key}=1")
        assert f"deepspeed.extra.{key}: the job config sets it; use " in msg, msg
    for key in ds_mod.FIXED_DS_KEYS:
        msg = _refused(f"deepspeed.extra.{key}=1")
        assert f"deepspeed.extra.{key}: the trainer sets it (" in msg and "; remove it" in msg


# ------------------------------------------------------------------------- the model on its own
model_values = {
    int: st.integers(min_value=-(2**70), max_value=2**70),
    float: st.floats(allow_nan=True, allow_infinity=True),
}
model_numbers = {
    f.name: model_values[_number_kind(f.type)]
    for f in dataclasses.fields(ModelConfig)
    if _number_kind(f.type)
}


@FAST
@given(kwargs=st.fixed_dictionaries({}, optional=model_numbers))
def test_standalone_model_config_validates_itself(kwargs):
    """ModelConfig without the job config: any numbers either make a valid config or one
    ModelConfigError naming ``model.<field>``."""
    try:
        cfg = ModelConfig(**kwargs)
    except ModelConfigError as e:
        assert str(e).startswith("model.") and "\n" not in str(e)
        return
    assert 1 <= cfg.vocab_size <= 2**24 and cfg.hidden_size % cfg.num_heads == 0


def test_job_and_model_agree_on_model_errors():
    """One home for model checks: the job config reports ModelConfig's own message."""
    with pytest.raises(ModelConfigError) as e:
        ModelConfig(layer_norm_eps=0.0)
    assert _refused("model.layer_norm_eps=0") == str(e.value)


def test_shipped_configs_validate(tmp_path):
    for path in sorted(Path(TINY_CONFIG).parent.glob("*.yaml")):
        resolve(load_config(str(path)), 8)


# ------------------------------------------------------------------------- the data a run uses
@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory) -> Path:
    """A real SentencePiece model with data_prep's special ids and 500 pieces (the data's has
    2000): trained on this repository's README."""
    from data_prep.tokenizer import train_tokenizer

    text = (Path(TINY_CONFIG).parents[1] / "README.md").read_text(encoding="utf-8")
    path = tmp_path_factory.mktemp("tok500") / "tokenizer.model"
    train_tokenizer([ln for ln in text.splitlines() if ln.strip()], str(path), 500)
    return path


@pytest.fixture
def corpus_copy(tiny_corpus, tmp_path) -> Path:
    import shutil

    return Path(shutil.copytree(tiny_corpus, tmp_path / "data"))


def _train_main(capsys, data: Path, run: Path, *overrides: str) -> str:
    from linformer_ds import train

    argv = ["--config", TINY_CONFIG, *TEST_OVERRIDES, f"data.path={data}", f"logging.dir={run}"]
    rc = train.main([*argv, *overrides])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, (rc, err)
    return err


def test_swapped_tokenizer_is_refused_at_start(
    corpus_copy, other_tokenizer, tmp_path, capsys, _clean_env
):
    """A 500-piece tokenizer.model copied over the 2000-vocab data's: refused at start, without
    verify_checksums (the sha256 data_prep recorded), before anything is written."""
    import shutil

    shutil.copyfile(other_tokenizer, corpus_copy / "tokenizer.model")
    err = _train_main(capsys, corpus_copy, tmp_path / "run", "data.verify_checksums=false")
    assert f"{corpus_copy / 'tokenizer.model'}: not the tokenizer this data was made with" in err
    assert "re-run data_prep" in err and not (tmp_path / "run" / "checkpoints").exists()
    (corpus_copy / "tokenizer.model").unlink()
    err = _train_main(capsys, corpus_copy, tmp_path / "run")
    assert "tokenizer.model: not found; the manifest records the tokenizer" in err


def _fake_tag(run: Path, meta_extra: dict[str, Any]) -> Path:
    """A complete tag of the test model whose metadata says what ``meta_extra`` says."""
    import json

    from linformer_ds.checkpoint.tags import COMPLETE_FILE, META_FILE, META_KEYS, MODEL_STATES

    cfg = load_config(TINY_CONFIG, TEST_OVERRIDES)
    d = run / "checkpoints" / "step_00000002"
    d.mkdir(parents=True)
    meta = {k: 0 for k in META_KEYS} | {"format_version": 1, "world_size": 1}
    meta.update(model=cfg.model.to_dict(), sampler={"epoch": 0, "consumed": 0})
    meta.update(zero_stage=2, precision=cfg.deepspeed.precision, **meta_extra)
    (d / META_FILE).write_text(json.dumps(meta))
    (d / MODEL_STATES).write_bytes(b"")
    (d / COMPLETE_FILE).write_text(json.dumps({"files": {}}))
    return d


def test_resume_on_other_data_is_refused_unless_allowed(tiny_corpus, tmp_path, capsys, _clean_env):
    """The checkpoint records the data it was trained on (N, tokenizer, shards' digest);
    resuming on other data names what differs and the flag that allows it."""
    from linformer_ds.checkpoint.io import check_run_config, data_identity

    here = load_config(TINY_CONFIG, [*TEST_OVERRIDES, f"data.path={tiny_corpus}"])
    ident = data_identity(here)
    assert len(ident) == 1 and ident[0]["seq_len"] == 128 and ident[0]["vocab_size"] == 2000
    cases = {
        "seq_len": (64, "N (the row length): checkpoint 64"),
        "tokenizer_sha256": ("0" * 64, "the tokenizer (ids would mean other tokens)"),
        "shards_sha256": ("f" * 64, "the data (manifest shards)"),
    }
    for key, (value, message) in cases.items():
        run = tmp_path / key
        tag = _fake_tag(run, {"data": [ident[0] | {key: value}]})
        err = _train_main(capsys, tiny_corpus, run)
        assert f"checkpoint.allow_data_change: {tag} was trained on other data; {message}" in err
        assert "set checkpoint.allow_data_change=true to continue on this data" in err
        meta = {"data": [ident[0] | {key: value}]}
        allowed = load_config(
            TINY_CONFIG,
            [*TEST_OVERRIDES, f"data.path={tiny_corpus}", "checkpoint.allow_data_change=true"],
        )
        check_run_config(meta, allowed, str(tag))  # allowed: no error
        check_run_config({"data": ident}, here, str(tag))  # the same data: no error


def test_the_same_data_copied_elsewhere_resumes(tiny_corpus, corpus_copy):
    """Identity is content, not place: a copy of the data dir (a new mount, a node-local copy)
    resumes; its manifest's timings do not count, its shards do."""
    from linformer_ds.checkpoint.io import check_run_config, data_identity

    def at(path: Path) -> JobConfig:
        return load_config(TINY_CONFIG, [*TEST_OVERRIDES, f"data.path={path}"])

    saved = data_identity(at(tiny_corpus))
    manifest = corpus_copy / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"seconds": ', '"seconds": 1'))
    moved = data_identity(at(corpus_copy))
    assert [d | {"path": ""} for d in saved] == [d | {"path": ""} for d in moved]
    check_run_config({"data": saved}, at(corpus_copy), "step_00000002")


def test_export_refuses_a_tokenizer_of_another_vocabulary(
    tiny_corpus, other_tokenizer, tmp_path, capsys
):
    import shutil

    from linformer_ds import export as export_mod

    tag = _fake_tag(tmp_path / "run", {})
    shutil.copyfile(tiny_corpus / "tokenizer.model", tag / "tokenizer.model")
    argv = ["--checkpoint", str(tag.parent), "--tag", tag.name, "--out", str(tmp_path / "out")]
    rc = export_mod.main([*argv, "--tokenizer", str(other_tokenizer)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    want = f"--tokenizer {other_tokenizer}: another tokenizer than the checkpoint was trained "
    assert want + "with (tokenizers differ: " in err and "500 ids vs 2000" in err, err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ resolve: once, then frozen
def test_resolved_config_is_frozen_and_the_loaded_one_untouched():
    """resolve returns a frozen copy: no field of any section (the model's included) can be set
    or deleted; the loaded config keeps its ``auto``; a copy (replace, from_dict) can change."""
    import pickle

    from linformer_ds.config import Resolved

    cfg = load_config(TINY_CONFIG, [*TEST_OVERRIDES, "data.path=/nonexistent"])
    job = resolve(cfg, 2, seq_len=128)
    for record, name in ((job, "name"), (job.train, "max_steps"), (job.model, "k"),
                         (job.parallel, "shard_sequence_parameters"), (job.deepspeed.zero, "stage"),
                         (job.debug, "sync_log")):  # fmt: skip
        with pytest.raises(dataclasses.FrozenInstanceError, match="frozen once resolved"):
            setattr(record, name, getattr(record, name))
    with pytest.raises(dataclasses.FrozenInstanceError):
        del job.train.seed
    assert job.parallel.shard_sequence_parameters is False and job.parallel.auto_shard
    assert cfg.parallel.shard_sequence_parameters == "auto" and cfg.parallel.auto_shard is None
    assert job.resolved == Resolved(world_size=2, data_parallel_size=2, seq_len=128)
    with pytest.raises(RuntimeError, match="not resolved"):
        cfg.resolved  # noqa: B018
    train = dataclasses.replace(job.train, micro_batch_size=2)
    train.seed = 7  # a replaced record is a new, changeable one
    assert from_dict(to_dict(job)) == job and pickle.loads(pickle.dumps(job)) == job
    with pytest.raises(dataclasses.FrozenInstanceError):
        pickle.loads(pickle.dumps(job)).train.seed = 7
    assert resolve(job, 4).resolved.data_parallel_size == 4  # a resolved config re-resolves


def test_trainer_validates_and_resolves_once(tiny_corpus, tmp_path, monkeypatch, _clean_env):
    """launch -> load_config -> Trainer: every section's checks run once, the config is resolved
    once (precision auto, sharding, world checks) before the engine, and the components get the
    frozen result."""
    import collections

    from linformer_ds import config as config_mod
    from linformer_ds import resolve as resolve_mod
    from linformer_ds import train
    from linformer_ds import trainer as trainer_mod

    calls: collections.Counter = collections.Counter()

    def counted(owner: Any, name: str, key: Any = None) -> None:
        original = getattr(owner, name)

        def wrapper(*args: Any, **kw: Any) -> Any:
            calls[key(*args) if key else name] += 1
            return original(*args, **kw)

        monkeypatch.setattr(owner, name, wrapper)

    counted(config_mod.Section, "validate", key=lambda section, job: section.key)
    counted(config_mod, "validate")
    for name in ("resolve_precision", "_resolve_shard", "check_deepspeed_extra"):
        counted(resolve_mod, name)
    counted(trainer_mod, "resolve")
    seen = {}

    class Built(Exception):
        pass

    def stop(self: Any) -> None:  # the engine would start the process group: stop before
        seen["cfg"] = self.cfg
        raise Built

    monkeypatch.setattr(trainer_mod.Trainer, "_build_engine", stop)
    argv = ["--config", TINY_CONFIG, *TEST_OVERRIDES, f"data.path={tiny_corpus}",
            f"logging.dir={tmp_path}", "train.max_steps=2"]  # fmt: skip
    with pytest.raises(Built):
        train.main(argv)
    sections = {f"{s}" for s in config_mod.SECTIONS} | {
        "deepspeed.zero", "deepspeed.activation_checkpointing"}  # fmt: skip
    assert {k: v for k, v in calls.items() if k in sections} == dict.fromkeys(sections, 1)
    assert calls["validate"] == 1 and calls["resolve"] == 1, calls
    assert calls["resolve_precision"] == calls["_resolve_shard"] == 1, calls
    assert calls["check_deepspeed_extra"] == 1, calls
    job = seen["cfg"]
    assert job.resolved.world_size == 1 and job.resolved.seq_len == 128
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.parallel.shard_sequence_parameters = True


@pytest.mark.parametrize("key", ["debug.sample_log", "debug.sync_log"])
@pytest.mark.parametrize("path", ["/proc/nope", "/etc/hostname/sub", ""])
def test_unusable_debug_directory_is_one_line(key, path):
    msg = _refused(f"{key}={path}" if path else f"{key}=''")
    assert msg.startswith(f"{key}: "), msg


def test_shard_auto_looks_at_every_stage():
    """auto shards only when every stage's N allows it (a later, shorter stage holds E/F whole)."""
    model = {"max_seq_len": 64, "hidden_size": 16, "num_heads": 4, "num_layers": 1,
             "intermediate_size": 32, "k": 8, "vocab_size": 50}  # fmt: skip
    cfg = from_dict({"model": model, "deepspeed": {"precision": "fp32", "zero": {"stage": 2}},
                     "parallel": {"sequence_parallel_size": 2}})  # fmt: skip
    assert resolve(cfg, 2, seq_len=[64]).parallel.shard_sequence_parameters is True
    staged = resolve(cfg, 2, seq_len=[64, 32])
    assert staged.parallel.shard_sequence_parameters is False
    assert staged.parallel.auto_shard.startswith("whole: sharding needs model.max_seq_len == N")
    assert staged.resolved.seq_len == 64
