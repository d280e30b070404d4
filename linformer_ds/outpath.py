"""The output contract of a command that writes one file (``launch/convert.py --out``, the ONNX
export's ``OUT.onnx``): nothing that existed before is destroyed.

* :func:`check_out_file`, before any work: the output is refused in one line
  (:class:`OutPathError`) when it is empty or names a directory; is, or lies inside, one of the
  command's inputs (compared after resolving links: a link to an input is the input); lies
  inside a directory another tool owns (a checkpoint directory and its ``latest``, a training
  run, an export, a data_prep output: :func:`linformer_ds.outdir.identify`); exists and the
  command's ``--overwrite`` is not given; lies under a regular file; or its nearest existing
  parent is not a writable directory.
* :func:`staged`: the command writes to a temporary name in a new hidden directory beside the
  output (same filesystem) and the finished file is renamed over the output, so a failure or
  Ctrl-C leaves the previous file (or none) and no partial one; files written beside the main
  one with its name as prefix (ONNX external data, ``OUT.onnx.data``) move with it.
* :func:`interrupted`: the one line and exit status 130 of a command stopped by Ctrl-C.

The checks before the existing-file rule are :func:`linformer_ds.outdir.check_path`, the same
for the output directories of data_prep, export and finetune (:mod:`linformer_ds.outdir`): one
contract for every command that writes an output path. Standard library only.
"""

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence

from linformer_ds import outdir
from linformer_ds.entry import EXIT_INTERRUPTED  # 128 + SIGINT: every command's Ctrl-C exit
from linformer_ds.errors import LinformerError
from linformer_ds.log import get_logger

log = get_logger(__name__)


class OutPathError(LinformerError, ValueError):
    """The output path cannot be used; the message names it and what to do."""


def check_out_file(
    out: str,
    inputs: Sequence[tuple[str, str | None]] = (),
    overwrite: bool = False,
    flag: str = "--out",
    overwrite_flag: str = "--overwrite",
) -> str:
    """Check the output file ``out`` (see the module docstring) before any work; returns
    ``"new"`` or ``"replace"`` (it exists and ``overwrite`` is given). ``inputs``: the
    ``(flag, path)`` pairs the command reads (None entries skipped)."""
    outdir.check_path(out, inputs, flag, directory=False, error=OutPathError)
    exists = os.path.lexists(out)
    if exists and not overwrite:
        raise OutPathError(f"{flag} {out} exists; nothing is replaced: choose a new name, or pass "
                           f"{overwrite_flag} to replace it")  # fmt: skip
    return "replace" if exists else "new"


@contextlib.contextmanager
def staged(out: str) -> Iterator[str]:
    """Yield the temporary path to write ``out`` to; when the block ends without an exception
    the file (with its ``<name>*`` companions) is renamed into place, else everything written
    (the temporary directory, parents made for it) is removed and the exception propagates."""
    out = os.path.abspath(out)
    parent, name = os.path.dirname(out), os.path.basename(out)
    made = []
    d = parent
    while not os.path.isdir(d):
        made.append(d)
        d = os.path.dirname(d)
    for p in reversed(made):
        os.mkdir(p)
    tmpdir = tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=parent)
    ok = False
    try:
        yield os.path.join(tmpdir, name)
        if not os.path.isfile(os.path.join(tmpdir, name)):
            raise OSError(f"{out}: the command wrote nothing")
        for extra in sorted(os.listdir(tmpdir)):  # companions first: the main file last
            if extra != name and extra.startswith(name):
                os.replace(os.path.join(tmpdir, extra), os.path.join(parent, extra))
        os.replace(os.path.join(tmpdir, name), out)
        ok = True
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
        if not ok:
            for p in made:
                with contextlib.suppress(OSError):
                    os.rmdir(p)
    with contextlib.suppress(OSError):
        fd = os.open(parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def interrupted(prefix: str, out: str | None) -> int:
    """The one stderr line of a command stopped by Ctrl-C (the package logger, ERROR); returns
    :data:`EXIT_INTERRUPTED`."""
    where = f"; {out} is as it was (nothing partial written)" if out else ""
    log.error(f"{prefix}: interrupted (Ctrl-C){where}")
    return EXIT_INTERRUPTED
