"""Every exception class defined in the installed packages (linformer_ds, data_prep) is a
LinformerError, except the ones linformer_ds/errors.py names as outside (and says why)."""

import importlib
import inspect
import pkgutil

import linformer_ds
from linformer_ds.errors import LinformerError

PACKAGES = ("linformer_ds", "data_prep")
# the model package ships inside exported model directories and imports only torch, the standard
# library and itself (tests/test_import_graph.py): its errors cannot import linformer_ds.errors
SELF_CONTAINED = ("linformer_ds.model", "linformer_ds.hf")
NOT_ERRORS = {"linformer_ds.trainer.StopTraining"}  # the trainer's stop signal, not an error


def _walk(pkg, skipped: list):
    """``pkg`` and every module under it; a module that needs a missing optional dependency
    (transformers, onnx...) is left out (into ``skipped``), a broken one fails the test."""
    yield pkg
    for info in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + "."):
        try:
            mod = importlib.import_module(info.name)
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] in PACKAGES:
                raise
            skipped.append(f"{info.name} ({e.name})")
            continue
        if info.ispkg:
            yield from _walk(mod, skipped)
        else:
            yield mod


def _modules() -> list:
    skipped: list = []
    mods = [m for top in PACKAGES for m in _walk(importlib.import_module(top), skipped)]
    assert len(mods) > 50, f"the walk found only {len(mods)} modules (skipped: {skipped})"
    return mods


def _exception_classes() -> dict:
    """``{module.Class: class}`` of every exception class defined in the packages' modules."""
    found = {}
    for mod in _modules():
        for name, obj in vars(mod).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__ == mod.__name__
            ):
                found[f"{mod.__name__}.{name}"] = obj
    return found


def _outside(qualname: str) -> bool:
    return qualname in NOT_ERRORS or any(qualname.startswith(pkg + ".") for pkg in SELF_CONTAINED)


def test_every_error_of_the_packages_is_a_linformer_error():
    classes = _exception_classes()
    # the walk sees the errors (a broken walk would pass the check below on nothing)
    for known in (
        "linformer_ds.config_fields.ConfigError",
        "linformer_ds.data.shards.DataError",
        "linformer_ds.model_dir.ExportError",
        "data_prep.errors.DataPrepError",
        "linformer_ds.model.registry.ModelConfigError",
        *NOT_ERRORS,
    ):
        assert known in classes, f"{known} not found by the walk: {sorted(classes)}"
    not_based = sorted(
        name
        for name, cls in classes.items()
        if not _outside(name) and not issubclass(cls, LinformerError)
    )
    assert not_based == [], f"not a LinformerError (nor named outside in errors.py): {not_based}"
    # the exceptions are real: what linformer_ds/errors.py documents as outside stays outside
    outside = sorted(name for name, cls in classes.items() if _outside(name))
    assert not any(issubclass(classes[name], LinformerError) for name in outside), outside
    doc = importlib.import_module("linformer_ds.errors").__doc__
    for name in outside:
        assert name.rsplit(".", 1)[1] in doc, f"{name}: outside LinformerError, not in errors.py"


def test_errors_keep_their_builtin_base():
    """``except ValueError`` / ``except RuntimeError`` still catch what they caught."""
    from data_prep.errors import DataPrepError
    from linformer_ds.config_fields import ConfigError
    from linformer_ds.data.shards import DataError
    from linformer_ds.dist_env import DistEnvError
    from linformer_ds.model_dir import ExportError
    from linformer_ds.resolve import FrozenConfigError

    for cls, base in (
        (ConfigError, ValueError),
        (DataError, ValueError),
        (DataPrepError, ValueError),
        (DistEnvError, RuntimeError),
        (ExportError, RuntimeError),
        (FrozenConfigError, AttributeError),
    ):
        assert issubclass(cls, LinformerError) and issubclass(cls, base), cls
    try:
        raise ConfigError("train.max_steps: must be >= 1")
    except ValueError as e:
        assert str(e) == "train.max_steps: must be >= 1"


def test_linformer_error_is_exported():
    assert linformer_ds.LinformerError is LinformerError
    assert "LinformerError" in linformer_ds.__all__
