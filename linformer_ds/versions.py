"""The dependency versions the trainer is tested with, and the start-up check against them.

``linformer_ds.engine`` patches DeepSpeed internals (``engine._global_grad_norm``,
``engine.clip_fp32_gradients``) and ``linformer_ds.checkpoint`` repairs what DeepSpeed 0.19.8's
universal checkpoints carry: another DeepSpeed (or torch) may change them silently, so
:class:`linformer_ds.trainer.Trainer` refuses to start outside the tested range unless
``LINFORMER_DS_UNTESTED_DEPS=1`` (then it prints a one-line warning). The ranges match
``pyproject.toml``; ``constraints.txt`` pins the whole tested set (torch 2.13.0+cpu); the
torch range also admits 2.11, the device image's, for the GPU kit.
"""

import os
from collections.abc import Mapping
from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from linformer_ds.dist_env import DistEnvError
from linformer_ds.log import get_logger

log = get_logger(__name__)

# package -> (tested range, why it matters); keep in step with pyproject.toml's dependencies.
TESTED: dict[str, tuple[str, str]] = {
    "deepspeed": (">=0.19.8,<0.20", "engine.py patches its internals"),
    "torch": (">=2.11,<2.14", "the tested releases"),
}
UNTESTED_ENV = "LINFORMER_DS_UNTESTED_DEPS"


class UntestedVersionError(DistEnvError):
    """An installed dependency is outside the tested range (one line, names the range)."""


TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("", "0", "false", "no", "off")


def env_flag(name: str, env: Mapping[str, str] | None = None) -> bool:
    """The boolean environment flag ``name``, one rule for every flag: ``1/true/yes/on`` is
    on, ``0/false/no/off`` or empty (or unset) is off, case and surrounding blanks ignored;
    anything else is refused in one line (:class:`DistEnvError`)."""
    env = os.environ if env is None else env
    raw = env.get(name)
    value = "" if raw is None else raw.strip().lower()
    if value in TRUE_WORDS:
        return True
    if value in FALSE_WORDS:
        return False
    raise DistEnvError(f"{name}={raw!r} is not a boolean: use one of {'/'.join(TRUE_WORDS)} or "
                       f"{'/'.join(FALSE_WORDS[1:])} (or leave it unset)")  # fmt: skip


def installed_version(name: str) -> str | None:
    """The installed distribution's version, or None when it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def version_problems(versions: Mapping[str, str | None] | None = None) -> list[str]:
    """One message per installed dependency outside its tested range (``versions``: name ->
    version, default: what is installed)."""
    problems = []
    for name, (spec, why) in TESTED.items():
        got = versions[name] if versions is not None else installed_version(name)
        if got is None:
            continue
        try:
            ok = Version(got) in SpecifierSet(spec, prereleases=True)
        except InvalidVersion:
            ok = False
        if not ok:
            problems.append(f"{name} {got} is outside the tested range {spec} ({why})")
    return problems


def check_versions(
    versions: Mapping[str, str | None] | None = None,
    env: Mapping[str, str] | None = None,
) -> None:
    """Raise :class:`UntestedVersionError` (one line) when a dependency is outside its tested
    range; with ``LINFORMER_DS_UNTESTED_DEPS=1`` print the same line as a warning instead."""
    untested_ok = env_flag(UNTESTED_ENV, env)  # a bad value is refused even in range
    problems = version_problems(versions)
    if not problems:
        return
    line = "; ".join(problems)
    if untested_ok:
        log.warning(f"[warn] {line}; running anyway ({UNTESTED_ENV} is set)")
        return
    raise UntestedVersionError(
        f"{line}: install the tested set (pip install -c constraints.txt -e .) or set "
        f"{UNTESTED_ENV}=1 to run anyway"
    )
