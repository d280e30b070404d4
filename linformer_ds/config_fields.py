"""Declared checks of the job config's fields: each field states what values it takes next to
its definition (a range, a set of choices, non-empty), and :func:`check_fields` reads these
declarations. Also the one-line :class:`ConfigError` (imported from ``linformer_ds.config``)."""

import dataclasses
import ipaddress
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

from linformer_ds.errors import LinformerError


class ConfigError(LinformerError, ValueError):
    """A job config problem, in one line; the message names the key path."""

    def __init__(self, message: Any):
        super().__init__(" ".join(str(message).split()))


# ============================================================================ declared checks
# Every field states what values it takes next to its definition: numbers a range (``bounded``),
# strings a set of choices (``one_of``) or non-empty (``nonempty``). ``check_fields`` reads these
# declarations; a section's ``validate`` adds only the rules that involve other fields.
# Upper bounds on counts are sanity caps far above any real run: a typo such as
# micro_batch_size=2**62 is refused here, not found by building an index list of that size.
MAX_STEPS = 2**40
MAX_BATCH = 2**20
MAX_COUNT = 2**31 - 1


@dataclass(frozen=True)
class Range:
    """Valid values of a numeric field: ``lo``/``hi`` (None: unbounded), open or closed;
    ``note`` says what a boundary value means; ``text`` replaces the generated wording."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    note: str = ""
    text: str = ""

    def problem(self, value: Any) -> str | None:
        if value is None:
            return None
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite number, got {value}"
        low = self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo)
        high = self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi)
        if not (low or high):
            return None
        note = f" ({self.note})" if self.note else ""
        if self.text:
            return f"must be {self.text}{note}, got {value}"
        if low:
            return f"must be {'>' if self.lo_open else '>='} {self.lo}{note}, got {value}"
        return f"must be {'<' if self.hi_open else '<='} {self.hi}{note}, got {value}"


def bounded(default: Any, lo: float | None = None, hi: float | None = None, **kw: Any) -> Any:
    """A numeric field with its valid range (see :class:`Range`)."""
    return field(default=default, metadata={"range": Range(lo, hi, **kw)})


def one_of(
    default: str | None, choices: tuple[str, ...], note: str = "", also: tuple[str, ...] = ()
) -> Any:
    """A string field that takes one of ``choices`` (None also when the default is None);
    ``also``: accepted values that ``note`` describes (e.g. ``auto``)."""
    return field(default=default, metadata={"choices": choices, "note": note, "also": also})


# A host name: dot-separated labels of letters, digits and hyphens (RFC 1123), 253 at most.
_HOSTNAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                       r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")  # fmt: skip


def is_host(text: str) -> bool:
    """Whether ``text`` is an IP address (v4 or v6) or a well-formed host name."""
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return bool(_HOSTNAME.fullmatch(text))


def nonempty(default: str) -> Any:
    return field(default=default, metadata={"nonempty": True})


def _choices_text(choices: tuple[str, ...]) -> str:
    if len(choices) > 3:
        return "one of " + ", ".join(choices)
    return ", ".join(choices[:-1]) + f" or {choices[-1]}" if len(choices) > 1 else choices[0]


def field_problem(f: dataclasses.Field, value: Any) -> str | None:
    """Why ``value`` breaks the declaration of field ``f`` (None: it does not)."""
    meta = f.metadata
    if isinstance(value, str) and "\x00" in value:
        return "must not contain a NUL character"
    if "range" in meta:
        return meta["range"].problem(value)
    if "choices" in meta and value is not None and value not in meta["choices"] + meta["also"]:
        note = f" ({meta['note']})" if meta["note"] else ""
        return f"must be {_choices_text(meta['choices'])}{note}, got {value!r}"
    if meta.get("nonempty") and not str(value or "").strip():
        return "must not be empty"
    return None


def check_fields(section: Any, prefix: str) -> None:
    """Raise a :class:`ConfigError` for the first field of ``section`` outside its declaration
    (nested sections are checked by their own ``validate``)."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        key = f"{prefix}.{f.name}" if prefix else f.name
        problem = field_problem(f, value)
        if problem:
            raise ConfigError(f"{key}: {problem}")
        if isinstance(value, list):  # lists of records (data.sources, train.stages)
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    check_fields(item, f"{key}[{i}]")


def unusable_dir(path: str | None) -> str | None:
    """Why directory ``path`` cannot be written (or created) here, or None (also for None)."""
    if path is None:
        return None
    if not str(path).strip():
        return "must not be empty (null: off)"
    want = os.path.abspath(path)
    node = want
    while not os.path.exists(node):  # the deepest part that exists must be a writable directory
        node = os.path.dirname(node)
    if not os.path.isdir(node):
        return f"{path}: {node} is not a directory"
    pseudo = node.split(os.sep)[1:2] in (["proc"], ["sys"])  # kernel filesystems, root included
    if pseudo or not os.access(node, os.W_OK | os.X_OK):
        return f"{path}: {node} is not writable"
    return None
