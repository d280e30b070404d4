"""Documents in rows: the share of rows that hold a single document and the distribution of
document lengths, counted from a split's finished shards (so any run, resumed or on many ranks,
reports the same figures).

* ``full`` packing: a split's rows are ``[cls]`` + its stream, where every document is followed by
  ``sep``; a document is the content tokens between two seps (its length excludes the sep), as
  document isolation sees it. A row holds a single document when all its content tokens (not
  cls, sep or pad) lie between the same two seps.
* ``pad`` packing: each row is ``[cls] + chunk + [sep] + pad`` of one document (every row holds a
  single document); a document longer than ``N - 2`` tokens continues in the next rows, so a full
  row (``N - 2`` content tokens) and the rows after it, up to the first one that is not full, are
  one document (a document of an exact multiple of ``N - 2`` tokens is counted with the next one).
"""

import os
from typing import Any

import numpy as np

CHUNK_ROWS = 4096  # rows read at a time (bounded memory for any corpus)


def _rows(out: str, shards: list[dict[str, Any]]):
    for s in shards:
        arr = np.load(os.path.join(out, s["file"]), mmap_mode="r")
        for start in range(0, arr.shape[0], CHUNK_ROWS):
            yield np.asarray(arr[start : start + CHUNK_ROWS])


def length_summary(lengths: np.ndarray) -> dict[str, Any]:
    """``documents, min, median, p90, max, mean`` of document lengths in tokens (numpy's
    median and linear-interpolated 90th percentile; zeros when there is none)."""
    if lengths.size == 0:
        return {"documents": 0, "min": 0, "median": 0.0, "p90": 0.0, "max": 0, "mean": 0.0}
    return {
        "documents": int(lengths.size),
        "min": int(lengths.min()),
        "median": float(np.median(lengths)),
        "p90": float(np.percentile(lengths, 90)),
        "max": int(lengths.max()),
        "mean": float(lengths.mean()),
    }


def split_documents(out: str, shards: list[dict[str, Any]], packing: str, ids: dict[str, int],
                    seq_len: int) -> dict[str, Any]:  # fmt: skip
    """The ``documents_in_rows`` record of one split: ``rows``, ``single_document_rows``,
    ``single_document_share`` and ``document_tokens`` (:func:`length_summary`)."""
    rows, single, all_lengths = _scan(out, shards, packing, ids, seq_len)
    return {
        "rows": rows,
        "single_document_rows": single,
        "single_document_share": single / rows if rows else 0.0,
        "document_tokens": length_summary(all_lengths),
    }


def document_lengths(out: str, shards: list[dict[str, Any]], packing: str, ids: dict[str, int],
                     seq_len: int) -> np.ndarray:  # fmt: skip
    """The length in tokens (without the sep) of every document of one split, in order."""
    return _scan(out, shards, packing, ids, seq_len)[2]


def whole_rows(out: str, shards: list[dict[str, Any]], ids: dict[str, int]) -> int:
    """Rows of one split whose N tokens all belong to one document: no sep before the last
    position (document isolation starts a document after every sep) and no pad. The rows that
    ``python -m linformer_ds.context_curve`` (window N) and ``python -m linformer_ds.capability
    copy`` (a view of N) can score under document isolation; either packing."""
    sep, pad = int(ids["sep"]), int(ids["pad"])
    count = 0
    for block in _rows(out, shards):
        count += int((~(block[:, :-1] == sep).any(axis=1) & ~(block == pad).any(axis=1)).sum())
    return count


def _scan(out: str, shards: list[dict[str, Any]], packing: str, ids: dict[str, int],
          seq_len: int) -> tuple[int, int, np.ndarray]:  # fmt: skip
    """``(rows, single-document rows, document lengths)`` of one split (see the module)."""
    cls, sep, pad = int(ids["cls"]), int(ids["sep"]), int(ids["pad"])
    lengths: list[np.ndarray] = []
    rows = single = 0
    carry = 0  # tokens of the document still open at the end of the previous chunk
    for block in _rows(out, shards):
        rows += block.shape[0]
        if packing == "pad":
            content = ((block != cls) & (block != sep) & (block != pad)).sum(axis=1)
            single += int((content > 0).sum())
            for c in content.tolist():
                carry += c
                if c < seq_len - 2:
                    lengths.append(np.array([carry]))
                    carry = 0
            continue
        body = block[:, 1:]
        is_sep = body == sep
        content = (body != sep) & (body != pad) & (body != cls)
        # documents of each row: a content token's document is the number of seps before it
        doc = np.cumsum(is_sep, axis=1)
        lo = np.where(content, doc, np.iinfo(np.int64).max).min(axis=1)
        hi = np.where(content, doc, -1).max(axis=1)
        single += int(((hi >= 0) & (lo == hi)).sum())
        flat_sep = is_sep.reshape(-1)
        flat_content = content.reshape(-1).astype(np.int64)
        csum = np.concatenate([[0], np.cumsum(flat_content)])
        ends = np.flatnonzero(flat_sep)
        if ends.size:
            before = csum[ends]  # content tokens before each sep
            starts = np.concatenate([[0], before[:-1]])
            got = before - starts
            got[0] += carry
            lengths.append(got)
            carry = int(csum[-1] - before[-1])
        else:
            carry += int(csum[-1])
    if carry:
        lengths.append(np.array([carry]))
    all_lengths = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
    return rows, single, all_lengths


def summary_line(split: str, rec: dict[str, Any]) -> str:
    """One line of the data_prep summary for a split's ``documents_in_rows`` record."""
    d = rec["document_tokens"]
    return (f"{split}: {rec['single_document_share']:.1%} of {rec['rows']} rows hold a single "
            f"document; document tokens min {d['min']} median {d['median']:g} p90 {d['p90']:g} "
            f"max {d['max']} ({d['documents']} documents)")  # fmt: skip
