"""Shard files: 2-D ``.npy`` arrays ``[rows, N]`` written incrementally and renamed when complete.

A shard is written as ``shard_XXXXX.npy.partial`` (numpy header for 0 rows, then rows appended),
and on completion the header is rewritten with the final row count, the file is fsynced and
renamed to ``shard_XXXXX.npy``. numpy pads the header so that the first dimension can grow
without changing the header length, so the rewrite happens in place. A ``.partial`` file never
looks like a complete shard, and its recorded row count lets an interrupted run continue.
"""

import io
import os
from typing import Any

import numpy as np

from data_prep.errors import DataPrepError
from data_prep.tokenizer import file_sha256
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
        """What a resumed run needs: finished shards and the current partial shard's rows."""
        return {"shards": list(self.shards), "index": self.index, "rows": self.rows}

    def _restore(self, state: dict[str, Any]) -> None:
        for shard in state["shards"]:
            path = os.path.join(self.out_dir, shard["file"])
            want = self.header_len + shard["rows"] * self.row_bytes
            if not os.path.isfile(path) or os.path.getsize(path) != want:
                raise DataPrepError(
                    f"cannot resume: finished shard {path!r} is missing or has the wrong size; "
                    "rerun with --overwrite"
                )
        self.shards = list(state["shards"])
        self.index = state["index"]
        self.rows = state["rows"]
        # A shard finished after the checkpoint: turn it back into the partial shard. Files of
        # later shards (and later partials) are not recorded anywhere: delete them.
        final = os.path.join(self.out_dir, self._rel(self.index))
        if os.path.exists(final):
            os.replace(final, self._partial_path())
        keep = {s["file"] for s in self.shards} | {self._rel(self.index) + ".partial"}
        split_dir = os.path.join(self.out_dir, self.split)
        for name in os.listdir(split_dir):
            if f"{self.split}/{name}" not in keep:
                os.remove(os.path.join(split_dir, name))
        if self.rows:
            path = self._partial_path()
            want = self.header_len + self.rows * self.row_bytes
            if not os.path.isfile(path) or os.path.getsize(path) < want:
                raise DataPrepError(
                    f"cannot resume: partial shard {path!r} is missing or shorter than the "
                    f"{self.rows} rows recorded; rerun with --overwrite"
                )
            self._file = open(path, "r+b")
            self._file.truncate(want)  # drop rows written after the last checkpoint
            self._file.seek(want)

    # ------------------------------------------------------------------------------- writing
    def _open(self) -> None:
        self._file = open(self._partial_path(), "wb")
        self._file.write(npy_header(0, self.seq_len, self.dtype))

    def write(self, rows: np.ndarray) -> None:
        """Append rows ``[k, seq_len]``; finishes shards as they fill."""
        assert rows.ndim == 2 and rows.shape[1] == self.seq_len, rows.shape
        rows = np.ascontiguousarray(rows, dtype=self.dtype)
        start = 0
        while start < len(rows):
            if self._file is None:
                self._open()
            take = min(len(rows) - start, self.shard_rows - self.rows)
            self._file.write(rows[start : start + take].tobytes())
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
            {"file": self._rel(self.index), "rows": self.rows, "sha256": file_sha256(final)}
        )
        self.index += 1
        self.rows = 0

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
