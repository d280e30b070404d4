"""The package's console output: one ``logging`` logger, ``linformer_ds``, with rank prefixes.

Every module writes its lines through ``log = get_logger(__name__)`` (a child of
``linformer_ds``): ``log.info("[train] ...")`` for progress, ``log.warning`` / ``log.error``
for what went wrong. One handler on the package logger (installed by the first
:func:`get_logger` or :func:`setup_logging` of the process, never again) writes

- INFO and below to ``sys.stdout`` (inside :func:`info_to` ``("stderr")``: a command whose
  stdout is its result, e.g. ``context_curve``), WARNING and above to ``sys.stderr``; the stream
  is the one ``sys`` holds when the record is written (a redirect, pytest's ``capsys``), flushed
  per line;
- the message as it is (``%(message)s``), so ``[train] ...``, ``[eval] ...``, ``[done] ...``
  keep their exact format; on a rank other than 0 of a job of several ranks every line of it is
  prefixed ``[rank R] `` (rank 0's lines, the run's voice, are not prefixed).

Verbosity: the standard API (``logging.getLogger("linformer_ds").setLevel(logging.WARNING)``
hides the progress lines, ``DEBUG`` shows more), or ``LINFORMER_DS_LOG_LEVEL`` read by the entry
points (``debug``/``info``/``warning``/``error``/``critical`` or a number, case and blanks
ignored; unset or empty: the level stays, INFO by default; anything else is refused in one line).
The package logger does not propagate to the root logger (a ``logging.basicConfig`` of the
application would print every line twice); set ``propagate = True`` and remove the handler to
route the lines through your own handlers instead.

Standard library only: any module may import it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator, Mapping

from linformer_ds.errors import LinformerError

PACKAGE = "linformer_ds"
LEVEL_ENV = "LINFORMER_DS_LOG_LEVEL"
LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}
STREAMS = ("stdout", "stderr")  # where INFO lines go (ConsoleHandler.info_stream)


class LogLevelError(LinformerError, ValueError):
    """``LINFORMER_DS_LOG_LEVEL`` is not a level (one line naming the value)."""


def env_level(name: str = LEVEL_ENV, env: Mapping[str, str] | None = None) -> int | None:
    """The log level the environment variable ``name`` asks for, or None (unset or empty).
    The rule of :func:`linformer_ds.versions.env_flag`: case and surrounding blanks ignored,
    anything unknown refused in one line (:class:`LogLevelError`)."""
    env = os.environ if env is None else env
    raw = env.get(name)
    value = "" if raw is None else raw.strip().lower()
    if value == "":
        return None
    if value in LEVELS:
        return LEVELS[value]
    if value.isdigit():
        return int(value)
    names = "/".join(k for k in LEVELS if k != "warn")
    raise LogLevelError(f"{name}={raw!r} is not a log level: use one of {names} or a number "
                        "(or leave it unset)")  # fmt: skip


def _int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = env.get(name, "").strip()
        if value:
            try:
                return int(value)
            except ValueError:
                return None
    return None


def rank_and_world(env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """This process's rank and the job's world size: the initialized process group's, else
    RANK/WORLD_SIZE, else the launcher's variables (Open MPI, PMI, a SLURM step), as
    :func:`linformer_ds.dist_env.setup_distributed_env` reads them before it sets RANK; else
    ``(0, 1)``. Never raises (a bad value counts as unset)."""
    dist = sys.modules.get("torch.distributed")
    if env is None and dist is not None:
        try:
            if dist.is_available() and dist.is_initialized():
                return int(dist.get_rank()), int(dist.get_world_size())
        except Exception:  # noqa: BLE001 (a group being torn down: the environment's answer)
            pass
    env = os.environ if env is None else env
    step = _int(env, "SLURM_STEP_ID", "SLURM_STEPID")
    in_step = step is not None and step < 0xFFFFFFF0  # not the batch script (dist_env's rule)
    for rank_var, world_vars in (
        ("RANK", ("WORLD_SIZE",)),
        ("OMPI_COMM_WORLD_RANK", ("OMPI_COMM_WORLD_SIZE",)),
        ("PMI_RANK", ("PMI_SIZE",)),
        ("SLURM_PROCID", ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")),
    ):
        if rank_var == "SLURM_PROCID" and not in_step:
            continue
        rank, world = _int(env, rank_var), _int(env, *world_vars)
        if rank is not None and world is not None:
            return rank, world
    return 0, 1


def rank_prefix(rank: int, world: int) -> str:
    """``[rank R] `` for rank R > 0 of a job of several ranks; empty otherwise."""
    return f"[rank {rank}] " if world > 1 and rank > 0 else ""


class RankFormatter(logging.Formatter):
    """The message as it is, each of its lines prefixed with :func:`rank_prefix` of the rank
    that writes it (``rank``/``world`` fixed here, or looked up per record)."""

    def __init__(self, rank: int | None = None, world: int | None = None) -> None:
        super().__init__("%(message)s")
        self.rank, self.world = rank, world

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if self.rank is None or self.world is None:
            rank, world = rank_and_world()
        else:
            rank, world = self.rank, self.world
        prefix = rank_prefix(rank, world)
        return "\n".join(prefix + line for line in text.split("\n")) if prefix else text


class ConsoleHandler(logging.Handler):
    """INFO and below to ``sys.stdout`` (or ``sys.stderr``: ``info_stream``), WARNING and above
    to ``sys.stderr``; the streams looked up per record, each line flushed."""

    def __init__(self, info_stream: str = "stdout") -> None:
        super().__init__()
        if info_stream not in STREAMS:
            raise ValueError(f"info_stream must be one of {STREAMS}, got {info_stream!r}")
        self.info_stream = info_stream
        self.setFormatter(RankFormatter())

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = self.format(record)
            to_err = record.levelno >= logging.WARNING or self.info_stream == "stderr"
            stream = sys.stderr if to_err else sys.stdout
            stream.write(msg + "\n")
            stream.flush()
        except RecursionError:
            raise
        except Exception:  # noqa: BLE001 (logging's own rule: report, never raise)
            self.handleError(record)


def _handler(logger: logging.Logger) -> ConsoleHandler | None:
    return next((h for h in logger.handlers if isinstance(h, ConsoleHandler)), None)


_installed = False  # the handler is added once per process: one removed stays removed


def _install() -> logging.Logger:
    """The package logger; the first call adds its one :class:`ConsoleHandler` (a level set
    before is kept, else INFO) and stops propagation to the root logger."""
    global _installed
    logger = logging.getLogger(PACKAGE)
    if not _installed:
        _installed = True
        if _handler(logger) is None:
            logger.addHandler(ConsoleHandler())
            logger.propagate = False
            if logger.level == logging.NOTSET:
                logger.setLevel(logging.INFO)
    return logger


def get_logger(name: str) -> logging.Logger:
    """The logger of module ``name`` under the package logger (``__name__`` of a module of
    linformer_ds; another name goes under ``linformer_ds.``); the handler is installed."""
    _install()
    if name != PACKAGE and not name.startswith(PACKAGE + "."):
        name = f"{PACKAGE}.{name}"
    return logging.getLogger(name)


def setup_logging(level: int | str | None = None) -> logging.Logger:
    """The entry points' set-up, idempotent: the one handler (installed once per process, never
    twice); the level ``level`` if given, else ``LINFORMER_DS_LOG_LEVEL`` if set (a bad value
    raises :class:`LogLevelError`), else the level as it is (INFO unless set through
    ``logging``). Returns the package logger."""
    logger = _install()
    if level is None:
        level = env_level()
    if level is not None:
        logger.setLevel(level)
    return logger


@contextlib.contextmanager
def info_to(stream: str) -> Iterator[None]:
    """INFO lines to ``stream`` (``stdout``, ``stderr``) inside the block, as before after it:
    for a command whose stdout is its result (progress then goes to stderr)."""
    if stream not in STREAMS:
        raise ValueError(f"stream must be one of {STREAMS}, got {stream!r}")
    handler = _handler(_install())
    if handler is None:  # removed by the application: its handlers decide
        yield
        return
    before, handler.info_stream = handler.info_stream, stream
    try:
        yield
    finally:
        handler.info_stream = before
