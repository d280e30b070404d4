"""One entry for every command: Ctrl-C (SIGINT) at any moment is one stderr line and exit 130.

Importing torch, transformers or deepspeed takes seconds, and a KeyboardInterrupt raised inside
them is a traceback of dozens of lines. Every command's entry (``launch/export.py``,
``launch/convert.py``, ``launch/finetune.py``, ``launch/onnx_export.py``, ``python -m
data_prep``, ``python -m linformer_ds.context_curve``, ``python -m linformer_ds.onnx_export``)
calls :func:`arm` before its first heavy import (under ``python -m`` already
``linformer_ds/__init__`` does, :func:`arm_under_m`) and runs its ``main`` through :func:`run`:

* armed (the imports; nothing has been written): SIGINT writes ``PROG: interrupted (Ctrl-C)
  during start-up; nothing written`` and ends the process at once with ``os._exit(130)``, so no
  half-imported module runs any code;
* while ``main`` runs: Python's own handler (a KeyboardInterrupt), so that the command's cleanup
  runs (staging directories removed, locks released) and the command prints its own line; a
  KeyboardInterrupt that escapes ``main`` is the line ``PROG: interrupted (Ctrl-C)`` here;
* once ``main`` has returned: SIGINT is ignored, so that the exit code is main's (the work is
  published) and no interrupt lands in the interpreter's shutdown;
* a SIGINT that lands where Python cannot raise it (a finalizer, a weakref callback: importing a
  module runs the import system's lock callbacks, so a Ctrl-C inside a lazy import in ``main``
  often lands there) was printed as ``Exception ignored in ...`` with a traceback and then lost,
  ``main`` going on to its end: while ``main`` runs, ``sys.unraisablehook`` takes such a
  KeyboardInterrupt and delivers the signal again, from a thread, once the callback has returned,
  so ``main`` sees it as a KeyboardInterrupt like any other;
* a ``main`` that was interrupted (exit 130: its cleanup has run, its line is written) ends the
  process with ``os._exit`` after flushing stdout and stderr: no interpreter shutdown runs after it. A
  shutdown under a native thread the interrupt left running (SentencePiece's C++ trainer, which
  calls back into Python for its sentences) aborted the process (SIGABRT, rc -6), and the exit
  hooks of a module whose import the interrupt cut short can fail with a traceback.

Standard library only (``linformer_ds/__init__`` imports no torch): importing this module is
milliseconds. ``launch/pretrain.py`` keeps its own start-up handler (exit 75, SIGTERM and SIGUSR1
too: the trainer's contract with the scheduler).
"""

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import NoReturn

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C

_prog = "linformer_ds"
_interrupted = False  # a SIGINT reached main (see run)


def _before_main(signum, frame) -> None:
    os.write(2, f"{_prog}: interrupted (Ctrl-C) during start-up; nothing written\n".encode())
    os._exit(EXIT_INTERRUPTED)


def arm(prog: str) -> None:
    """From now until :func:`run` starts ``main``, SIGINT ends the process at once: one line
    naming ``prog``, exit 130. A process started with SIGINT ignored (``nohup``, ``cmd &`` in a
    script) keeps ignoring it, as Python itself does."""
    global _prog
    _prog = prog
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, _before_main)


# ``python -m NAME`` commands -> their prog; armed while their package imports (arm_under_m)
MODULE_COMMANDS = {
    "linformer_ds.context_curve": "context_curve",
    "linformer_ds.onnx_export": "onnx_export",
    "data_prep": "data_prep",
    "linformer_ds.capability": "capability",
    "linformer_ds.plan": "plan",
}


def arm_under_m() -> None:
    """Arm when this process is ``python -m`` of one of :data:`MODULE_COMMANDS` (called by
    ``linformer_ds/__init__``). Under ``-m`` the package is imported, and then the module compiled
    (``PYTHONDONTWRITEBYTECODE``: hundreds of lines, no cache), before the module's own first line
    can arm: this closes that window. Python sets ``sys.argv[0]`` to ``-m`` until the module is
    found, so any other process (``python -m pytest`` importing linformer_ds) is left alone."""
    if sys.argv[:1] != ["-m"]:
        return
    argv = list(getattr(sys, "orig_argv", []))
    for i, arg in enumerate(argv[1:], 1):
        if arg.startswith("-m"):
            name = arg[2:] or (argv[i + 1] if i + 1 < len(argv) else "")
            if name in MODULE_COMMANDS:
                arm(MODULE_COMMANDS[name])
            return


_in_hook = False  # inside _unraisable (until the signal is sent again)
REDELIVER_S = 0.005  # how long after the callback the signal is sent again


def _during_main(signum, frame) -> None:
    """SIGINT while main runs: noted (see :func:`run`), then Python's own KeyboardInterrupt (sent
    again later when it comes while :func:`_unraisable` runs)."""
    global _interrupted
    _interrupted = True
    if _in_hook:
        _redeliver()
        return
    raise KeyboardInterrupt


def _unraisable(unraisable) -> None:
    """``sys.unraisablehook`` while main runs: our KeyboardInterrupt raised inside a finalizer or
    a weakref callback (where Python can only print it and go on) is sent again, from a thread,
    to land in the code main runs; anything else goes to the hook as it was."""
    global _in_hook
    if not (_interrupted and isinstance(unraisable.exc_value, KeyboardInterrupt)):
        _previous_hook(unraisable)
        return
    _in_hook = True  # (reset by the thread, just before it sends the signal)
    _redeliver()


def _redeliver() -> None:
    def send() -> None:
        global _in_hook
        time.sleep(REDELIVER_S)
        _in_hook = False
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=send, name="sigint-again", daemon=True).start()


_previous_hook = sys.unraisablehook


def run(main: Callable[[], int | None], prog: str | None = None) -> NoReturn:
    """``sys.exit(main())`` with SIGINT as a KeyboardInterrupt while ``main`` runs (one line and
    exit 130 if it escapes ``main``) and ignored once ``main`` has ended, however it ended
    (a return, SystemExit from argparse, an exception's traceback). When a SIGINT reached
    ``main``, the process ends with ``os._exit(main's code)`` once stdout and stderr are
    flushed: nothing runs after main's own cleanup (see the module). A main that ended on its own
    despite a SIGINT (one that came as it returned) ends as usual, with its own code."""
    global _previous_hook
    prog = prog or _prog
    _previous_hook, sys.unraisablehook = sys.unraisablehook, _unraisable
    try:
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            signal.signal(signal.SIGINT, _during_main)
        code = main()
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C: not in the line below
        print(f"{prog}: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
        code = EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        sys.unraisablehook = _previous_hook
    if _interrupted and code == EXIT_INTERRUPTED:
        _exit_now(code)
    sys.exit(code)


def _exit_now(code: int | str | None) -> NoReturn:
    """``sys.exit(code)``'s status and message, without the interpreter's shutdown."""
    if isinstance(code, str):  # sys.exit("text"): the text on stderr, status 1
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed, or a broken pipe: nothing to keep
            pass
    os._exit(0 if code is None else int(code))
