"""The tested dependency range: pyproject bounds, constraints.txt and the start-up refusal."""

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from linformer_ds import versions
from linformer_ds.versions import (
    TESTED,
    UNTESTED_ENV,
    UntestedVersionError,
    check_versions,
    installed_version,
)

REPO = Path(__file__).resolve().parents[1]


def test_installed_set_is_in_range():
    """This venv (the tested set) passes; pyproject's bounds are the same ranges."""
    assert versions.version_problems() == []
    text = (REPO / "pyproject.toml").read_text()  # (no tomllib on Python 3.10)
    deps = re.findall(r'^    "([^"]+)",', text.split("dependencies = [", 1)[1].split("]")[0], re.M)
    reqs = {Requirement(d).name: str(Requirement(d).specifier) for d in deps}
    for name, (spec, _) in TESTED.items():
        assert sorted(reqs[name].split(",")) == sorted(spec.split(",")), name


def test_constraints_pin_the_installed_set():
    pins = dict(
        line.split("==", 1)
        for line in (REPO / "constraints.txt").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert "linformer_ds" not in pins and "linformer-ds" not in pins
    for name in ("deepspeed", "torch", "numpy", "sentencepiece"):
        assert installed_version(name).split("+")[0] == pins[name], name


@pytest.mark.parametrize(
    "name, version", [("deepspeed", "0.20.1"), ("deepspeed", "0.16.0"), ("torch", "2.14.0")]
)
def test_refusal_outside_the_tested_range(monkeypatch, capsys, name, version):
    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda n: version if n == name else real(n))
    with pytest.raises(UntestedVersionError) as e:
        check_versions(env={})
    msg = str(e.value)
    assert "\n" not in msg
    assert re.search(rf"{name} {re.escape(version)} is outside the tested range ", msg)
    assert TESTED[name][0] in msg and UNTESTED_ENV in msg
    # the escape hatch: the same line as a warning, no refusal
    check_versions(env={UNTESTED_ENV: "1"})
    assert f"{name} {version} is outside the tested range" in capsys.readouterr().err


def test_trainer_refuses_at_start_up(monkeypatch, capsys):
    """The command line exits 2 with the one-line reason before any work."""
    from linformer_ds import train

    monkeypatch.delenv(UNTESTED_ENV, raising=False)
    monkeypatch.setattr(versions, "installed_version", lambda n: {"deepspeed": "0.20.0"}.get(n))
    monkeypatch.setattr(train, "resolve_stages", lambda cfg: None)  # no data needed to refuse
    code = train.main(["--config", str(REPO / "configs" / "tiny_cpu.yaml")])
    err = capsys.readouterr().err
    assert code == 2
    assert "error: deepspeed 0.20.0 is outside the tested range >=0.19.8,<0.20" in err


# ============================= one boolean rule for environment flags (issue 45 item 7)
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from linformer_ds.dist_env import DistEnvError  # noqa: E402
from linformer_ds.versions import FALSE_WORDS, TRUE_WORDS, env_flag  # noqa: E402


def _spelled(words):
    """A word of ``words`` in generated case with generated blanks around it."""
    return st.tuples(st.sampled_from(words), st.lists(st.booleans(), min_size=5, max_size=5),
                     st.sampled_from(["", " ", "\t"]), st.sampled_from(["", " ", "\n"])).map(
        lambda t: t[2] + "".join(c.upper() if u else c for c, u in zip(t[0], t[1] * 2)) + t[3]
    )  # fmt: skip


@settings(max_examples=60, deadline=None, derandomize=True)
@given(value=st.one_of(_spelled(TRUE_WORDS), _spelled(FALSE_WORDS), st.text(max_size=8)))
def test_environment_flags_parse_with_one_rule(value):
    """``false/no/off/0``/empty never turn the guard off (they did: any value but "" and "0"
    did); ``1/true/yes/on`` do; anything else is refused in one line naming the flag."""
    out_of_range = {"deepspeed": "0.99.0", "torch": installed_version("torch")}
    word = value.strip().lower()
    env = {UNTESTED_ENV: value}
    if word in TRUE_WORDS:
        assert env_flag(UNTESTED_ENV, env) is True
        check_versions(out_of_range, env=env)  # a warning, no refusal
    elif word in FALSE_WORDS:
        assert env_flag(UNTESTED_ENV, env) is False
        with pytest.raises(UntestedVersionError, match="deepspeed 0.99.0 is outside"):
            check_versions(out_of_range, env=env)
    else:
        with pytest.raises(DistEnvError) as e:
            check_versions(out_of_range, env=env)
        assert str(e.value).startswith(f"{UNTESTED_ENV}={value!r} is not a boolean: use one of ")
        assert "\n" not in str(e.value).replace(repr(value), "")
