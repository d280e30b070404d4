"""Shard files: 2-D ``.npy`` arrays ``[rows, N]`` written incrementally and renamed when complete.

A shard is written as ``shard_XXXXX.npy.partial`` (numpy header for 0 rows, then rows appended),
and on completion the header is rewritten with the final row count, the file is fsynced and
renamed to ``shard_XXXXX.npy``. numpy pads the header so that the first dimension can grow
without changing the header length, so the rewrite happens in place. A ``.partial`` file never
looks like a complete shard, and its recorded row count lets an interrupted run continue.
"""

import hashlib
import io
import os
from typing import Any

import numpy as np

from data_prep.errors import DataPrepError
from data_prep.verify import BLOCK, file_digest
from linformer_ds.fsio import fsync_dir


def npy_header(rows: int, seq_len: int, dtype: np.dtype) -> bytes:
    """The ``.npy`` (v1.0) header of a C-order array ``[rows, seq_len]`` of ``dtype``."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf,
        {
            "descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
            "fortran_order": False,
            "shape": (rows, seq_len),
        },
    )
    return buf.getvalue()


def shard_name(index: int) -> str:
    """File name of shard number ``index``."""
    return f"shard_{index:05d}.npy"


class ShardWriter:
    """Appends rows of one split to fixed-size shards under ``out_dir/split``."""

    def __init__(
        self,
        out_dir: str,
        split: str,
        seq_len: int,
        dtype: np.dtype,
        shard_rows: int,
        state: dict[str, Any] | None = None,
    ) -> None:
        self.out_dir = out_dir
        self.split = split
        self.seq_len = seq_len
        self.dtype = np.dtype(dtype)
        self.shard_rows = shard_rows
        self.header_len = len(npy_header(0, seq_len, self.dtype))
        self.row_bytes = seq_len * self.dtype.itemsize
        self.shards: list[dict[str, Any]] = []
        self.index = 0
        self.rows = 0  # rows in the current partial shard
        self._hash = hashlib.sha256()  # of its rows, as written
        self._file: Any | None = None
        os.makedirs(os.path.join(out_dir, split), exist_ok=True)
        if state is not None:
            self._restore(state)

    # --------------------------------------------------------------------------- paths/state
    def _rel(self, index: int) -> str:
        return f"{self.split}/{shard_name(index)}"

    def _partial_path(self) -> str:
        return os.path.join(self.out_dir, self._rel(self.index) + ".partial")

    def state(self) -> dict[str, Any]:
        """What a resumed run needs: finished shards, the current partial shard's rows and the
        sha256 of those rows as they were written (the header not included: it is rewritten)."""
        return {
            "shards": list(self.shards),
            "index": self.index,
            "rows": self.rows,
            "sha256": self._hash.hexdigest(),
        }

    def _restore(self, state: dict[str, Any]) -> None:
        """Continue from ``state``, every byte it keeps checked first: each finished shard's
        sha256, and the partial shard's recorded rows against the sha256 recorded as they were
        written. A mismatch is refused (one line naming the shard) before anything is changed:
        a shard's rows cannot be redone alone (they continue the rows before them)."""
        for shard in state["shards"]:
            path = os.path.join(self.out_dir, shard["file"])
            want = self.header_len + shard["rows"] * self.row_bytes
            if not os.path.isfile(path) or os.path.getsize(path) != want:
                raise DataPrepError(
                    f"cannot resume: finished shard {path!r} is missing or has the wrong size; "
                    "rerun with --overwrite"
                )
            got = file_digest(path).hexdigest()
            if got != shard["sha256"]:
                raise DataPrepError(
                    f"cannot resume: finished shard {path!r} changed since it was written "
                    f"(sha256 {shard['sha256'][:12]} recorded, {got[:12]} now); rerun with "
                    "--overwrite"
                )
        self.index = state["index"]
        rows = state["rows"]
        # A shard finished after the checkpoint holds the partial shard's rows: it becomes the
        # partial shard again (the header is rewritten when it is finished).
        final = os.path.join(self.out_dir, self._rel(self.index))
        found = final if os.path.exists(final) else self._partial_path()
        want = self.header_len + rows * self.row_bytes
        if rows:
            if not os.path.isfile(found) or os.path.getsize(found) < want:
                raise DataPrepError(
                    f"cannot resume: partial shard {found!r} is missing or shorter than the "
                    f"{rows} rows recorded; rerun with --overwrite"
                )
            if "sha256" not in state:
                raise DataPrepError(
                    f"cannot resume: progress.json records no sha256 of partial shard {found!r} "
                    "(written by an earlier data_prep), so it cannot be checked; rerun with "
                    "--overwrite"
                )
            h = file_digest(found, self.header_len, rows * self.row_bytes)
            if h.hexdigest() != state["sha256"]:
                raise DataPrepError(
                    f"cannot resume: partial shard {found!r} changed since the interrupted run "
                    f"recorded its {rows} rows (sha256 {state['sha256'][:12]} recorded, "
                    f"{h.hexdigest()[:12]} now); rerun with --overwrite"
                )
            self._hash = h
        self.shards = list(state["shards"])
        self.rows = rows
        if found == final:
            os.replace(final, self._partial_path())
        # Files of later shards (and later partials) are not recorded anywhere: delete them.
        keep = {s["file"] for s in self.shards} | {self._rel(self.index) + ".partial"}
        split_dir = os.path.join(self.out_dir, self.split)
        for name in os.listdir(split_dir):
            if f"{self.split}/{name}" not in keep:
                os.remove(os.path.join(split_dir, name))
        if self.rows:
            self._file = open(self._partial_path(), "r+b")
            self._file.truncate(want)  # drop rows written after the last checkpoint
            self._file.seek(want)

    # ------------------------------------------------------------------------------- writing
    def _open(self) -> None:
        self._file = open(self._partial_path(), "wb")
        self._file.write(npy_header(0, self.seq_len, self.dtype))
        self._hash = hashlib.sha256()

    def write(self, rows: np.ndarray) -> None:
        """Append rows ``[k, seq_len]``; finishes shards as they fill."""
        assert rows.ndim == 2 and rows.shape[1] == self.seq_len, rows.shape
        rows = np.ascontiguousarray(rows, dtype=self.dtype)
        start = 0
        while start < len(rows):
            if self._file is None:
                self._open()
            take = min(len(rows) - start, self.shard_rows - self.rows)
            data = rows[start : start + take].tobytes()
            self._file.write(data)
            self._hash.update(data)
            self.rows += take
            start += take
            if self.rows == self.shard_rows:
                self._finish_shard()

    def flush(self) -> None:
        """Make the rows written so far durable (before a checkpoint records them)."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())

    def _finish_shard(self) -> None:
        f = self._file
        f.seek(0)
        f.write(npy_header(self.rows, self.seq_len, self.dtype))
        f.flush()
        os.fsync(f.fileno())
        f.close()
        self._file = None
        partial = self._partial_path()
        final = os.path.join(self.out_dir, self._rel(self.index))
        os.replace(partial, final)
        fsync_dir(os.path.dirname(final))
        self.shards.append(
            {"file": self._rel(self.index), "rows": self.rows, "sha256": self.read_back(final)}
        )
        self.index += 1
        self.rows = 0
        self._hash = hashlib.sha256()

    def read_back(self, path: str) -> str:
        """The sha256 of the finished shard ``path`` as it is on disk (the manifest's), its
        rows checked against those written (:meth:`state`'s ``sha256``)."""
        with open(path, "rb") as f:
            header = f.read(self.header_len)
            whole, body = hashlib.sha256(header), hashlib.sha256()
            for block in iter(lambda: f.read(BLOCK), b""):
                whole.update(block)
                body.update(block)
        if body.digest() != self._hash.digest():
            raise DataPrepError(
                f"shard {path!r} changed while it was written (its rows read back differ from "
                "those written); rerun with --overwrite"
            )
        return whole.hexdigest()

    def close(self) -> list[dict[str, Any]]:
        """Finish the last (short) shard; returns every shard's ``{file, rows, sha256}``."""
        if self.rows:
            self._finish_shard()
        elif self._file is not None:
            self._file.close()
            self._file = None
            os.remove(self._partial_path())
        return list(self.shards)

    def abort(self) -> None:
        """Close the partial file without finishing it (an interrupted run)."""
        if self._file is not None:
            self._file.close()
            self._file = None
