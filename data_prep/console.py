"""data_prep's console lines at the package's log level, as every command's.

``LINFORMER_DS_LOG_LEVEL`` (read by :func:`linformer_ds.log.setup_logging` in ``python -m
data_prep``'s main) or ``logging.getLogger("linformer_ds").setLevel(...)`` in a program that calls
:func:`data_prep.prepare`: ``data_prep: ...`` progress lines, the progress bar and the summary
are INFO, ``data_prep: warning: ...`` lines WARNING, ``data_prep: error: ...`` and the
interrupted line ERROR. Every line goes to stderr, as data_prep's always did (its stdout holds
nothing); a level above a line's hides it. Standard library and linformer_ds.log only.
"""

import logging
import sys

from linformer_ds.log import get_logger

_log = get_logger("linformer_ds.data_prep")  # installs the package logger (INFO unless set)


def shown(level: int) -> bool:
    """Whether a line of ``level`` is written at the package logger's level."""
    return _log.isEnabledFor(level)


def say(level: int, line: str) -> None:
    """``line`` on stderr when ``level`` is shown."""
    if shown(level):
        print(line, file=sys.stderr, flush=True)


def info(msg: str) -> None:
    say(logging.INFO, f"data_prep: {msg}")


def warning(msg: str) -> None:
    say(logging.WARNING, f"data_prep: warning: {msg}")


def error(msg: str) -> None:
    say(logging.ERROR, f"data_prep: error: {msg}")
