"""One entry for every command: Ctrl-C (SIGINT) at any moment is one stderr line and exit 130.

Importing torch, transformers or deepspeed takes seconds, and a KeyboardInterrupt raised inside
them is a traceback of dozens of lines. Every command's entry (``launch/export.py``,
``launch/convert.py``, ``launch/finetune.py``, ``launch/onnx_export.py``, ``python -m
data_prep``, ``python -m linformer_ds.context_curve``, ``python -m linformer_ds.onnx_export``)
calls :func:`arm` before its first heavy import and runs its ``main`` through :func:`run`:

* armed (the imports; nothing has been written): SIGINT writes ``PROG: interrupted (Ctrl-C)
  during start-up; nothing written`` and ends the process at once with ``os._exit(130)``, so no
  half-imported module runs any code;
* while ``main`` runs: Python's own handler (a KeyboardInterrupt), so that the command's cleanup
  runs (staging directories removed, locks released) and the command prints its own line; a
  KeyboardInterrupt that escapes ``main`` is the line ``PROG: interrupted (Ctrl-C)`` here;
* once ``main`` has returned: SIGINT is ignored, so that the exit code is main's (the work is
  published) and no interrupt lands in the interpreter's shutdown.

Standard library only (``linformer_ds/__init__`` imports no torch): importing this module is
milliseconds. ``launch/pretrain.py`` keeps its own start-up handler (exit 75, SIGTERM and SIGUSR1
too: the trainer's contract with the scheduler).
"""

import os
import signal
import sys
from collections.abc import Callable
from typing import NoReturn

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C

_prog = "linformer_ds"


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


def run(main: Callable[[], int | None], prog: str | None = None) -> NoReturn:
    """``sys.exit(main())`` with SIGINT as a KeyboardInterrupt while ``main`` runs (one line and
    exit 130 if it escapes ``main``) and ignored once ``main`` has ended, however it ended
    (a return, SystemExit from argparse, an exception's traceback)."""
    prog = prog or _prog
    try:
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        code = main()
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C: not in the line below
        print(f"{prog}: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
        code = EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(code)
