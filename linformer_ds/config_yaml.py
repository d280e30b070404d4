"""YAML files and ``key=value`` overrides merged onto a structured OmegaConf schema, every
error one :class:`~linformer_ds.config_fields.ConfigError` line naming the file or the override
(and the key where it is known). Knows no field of the job config: ``linformer_ds.config``
(the schema, :func:`~linformer_ds.config.load_config`) calls it.
"""

import os
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from linformer_ds.config_fields import ConfigError

# Everything a user wrote passes through this boundary: every YAML, OmegaConf or type error
# becomes one ConfigError naming the file or the override (and the key where it is known).
LOAD_ERRORS = (OmegaConfBaseException, yaml.YAMLError, TypeError, ValueError, KeyError)


def load_yaml(path: str, chain: tuple[str, ...] = ()) -> DictConfig:
    """One YAML file, with its ``defaults: other.yaml`` (relative to it) merged underneath."""
    real = os.path.realpath(path)
    if real in chain:
        cycle = " -> ".join(os.path.basename(p) for p in (*chain, real))
        raise ConfigError(f"{path}: defaults: includes itself ({cycle}); remove the cycle")
    if os.path.isdir(path):
        raise ConfigError(f"config file {path} is a directory: give a YAML file in it")
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    try:
        cfg = OmegaConf.load(path)
    except Exception as e:  # yaml parse errors, undecodable bytes, unreadable file
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"{path}: top level must be a mapping")
    base = cfg.pop("defaults", None)
    if base is not None:
        if not isinstance(base, str) or not base.strip():
            raise ConfigError(
                f"{path}: defaults: must be one YAML file name (relative to this file), got {base}"
            )
        parent = load_yaml(os.path.join(os.path.dirname(path), base), (*chain, real))
        cfg = merge(parent, cfg, path)
    return cfg


def omegaconf_message(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None)
    msg = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return f"{key}: {msg}" if key else msg


def shape_mismatch(schema: Any, user: Any, prefix: str = "") -> str | None:
    """The first key where ``user`` puts a mapping, a list or a scalar in place of another kind
    in ``schema`` (OmegaConf's own error names neither the key nor the kinds)."""
    kinds = {DictConfig: "a mapping (a config section)", ListConfig: "a list"}

    def kind(node: Any) -> str:
        return next((v for t, v in kinds.items() if isinstance(node, t)), "a single value")

    if not isinstance(user, DictConfig) or not isinstance(schema, DictConfig):
        return None
    for key in user.keys():
        if key not in schema:
            continue
        path = f"{prefix}.{key}" if prefix else str(key)
        want = schema._get_node(key)
        got = user._get_node(key)
        if isinstance(want, DictConfig) and want._metadata.object_type in (dict, None):
            if not isinstance(got, DictConfig) and not got._is_none():
                return f"{path}: must be {kind(want)}, got {got._value()}"
            continue  # a free-form mapping (deepspeed.extra, model.extra)
        if kind(want) != kind(got) and not got._is_none() and not got._is_interpolation():
            value = (
                OmegaConf.to_container(got) if isinstance(got, (DictConfig, ListConfig)) else got
            )
            return f"{path}: must be {kind(want)}, got {value}"
        deeper = shape_mismatch(want, got, path)
        if deeper:
            return deeper
    return None


def check_shape(base: DictConfig, user: Any, source: str) -> None:
    try:
        mismatch = shape_mismatch(base, user)
    except AttributeError:  # OmegaConf's node API changed: its own merge error still names it
        mismatch = None
    if mismatch:
        raise ConfigError(f"{source}: {mismatch}")


def merge(base: DictConfig, user: Any, source: str) -> DictConfig:
    """``base`` <- ``user`` (read from ``source``: a file or an override), one line on error."""
    check_shape(base, user, source)
    try:
        return OmegaConf.merge(base, user)  # type: ignore[return-value]
    except OmegaConfBaseException as e:
        raise ConfigError(f"{source}: {omegaconf_message(e)}") from None
    except LOAD_ERRORS as e:
        raise ConfigError(f"{source}: {e}") from None


def parse_override(item: str) -> DictConfig:
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key=value")
    try:
        return OmegaConf.from_dotlist([item])
    except LOAD_ERRORS as e:
        if isinstance(e, yaml.MarkedYAMLError):
            msg = ": ".join(str(m) for m in (e.context, e.problem) if m)
        else:
            msg = omegaconf_message(e) if isinstance(e, OmegaConfBaseException) else str(e)
        raise ConfigError(f"override {item!r}: the value is not valid YAML ({msg})") from None
