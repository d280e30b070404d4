"""Tokenization (in worker processes) and packing of documents into rows of exactly N tokens.

Row layouts (``N`` = seq_len):

* ``full`` (full-sentences packing, the default): every document's tokens are followed by
  ``sep``; the stream of a split is cut into pieces of ``N - 1`` tokens and every row is
  ``[cls] + piece``. A document may continue into the next row (after its ``cls``). Only the
  last row of a split is padded (``pad`` after the stream's end).
* ``pad``: documents never share a row. A document is cut into chunks of at most ``N - 2``
  tokens and each chunk becomes ``[cls] + chunk + [sep] + [pad] * rest``.

Empty documents (no non-blank line) produce nothing. The train/valid split is by document:
a document goes to ``valid`` when a keyed hash of its text (key = seed) falls below
``valid_fraction``, so the same text always lands in the same split whatever the corpus order.
"""

import hashlib
import itertools
import signal
from dataclasses import dataclass
from typing import Any

import numpy as np
import sentencepiece as spm

from data_prep.hf_tokenizer import HFEncoder, HFPayload
from data_prep.tokenizer import CLS_ID, PAD_ID, SEP_ID, document_lines
from linformer_ds.data.splits import empty_split_fix

SPLITS = ("train", "valid")
PACKINGS = ("full", "pad")


def assign_split(text: str, valid_fraction: float, seed: int) -> str:
    """``"valid"`` for a deterministic ``valid_fraction`` of documents (by keyed hash), else train."""
    if valid_fraction <= 0.0:
        return "train"
    digest = hashlib.blake2b(
        text.encode("utf-8", "surrogatepass"),
        digest_size=8,
        key=int(seed).to_bytes(8, "little", signed=True),
    ).digest()
    return "valid" if int.from_bytes(digest, "little") / 2.0**64 < valid_fraction else "train"


def empty_split(counters: dict[str, Any], valid_fraction: float, max_doc_bytes: int) -> str | None:
    """The refusal of an output whose train split (or valid split, when ``valid_fraction`` > 0)
    got no document, naming the flag that fixes it; None when both have documents."""
    docs = sum(counters["splits"][s]["documents"] for s in SPLITS)
    for s in SPLITS:
        if counters["splits"][s]["content"] == 0 and (s == "train" or valid_fraction > 0):
            fix = empty_split_fix(s, docs, counters["bytes"], max_doc_bytes, valid_fraction)
            return f"the {s} split would be empty: {fix}"
    return None


@dataclass
class EncodeSettings:
    """What a worker needs besides the tokenizer."""

    seq_len: int
    packing: str
    valid_fraction: float
    seed: int
    dtype: str
    cls_id: int = CLS_ID  # the tokenizer's special ids (SentencePiece: the fixed ones)
    sep_id: int = SEP_ID
    pad_id: int = PAD_ID


def special_settings(tok_info: dict[str, Any]) -> dict[str, int]:
    """The :class:`EncodeSettings` / :class:`FullPacker` ids of a manifest tokenizer entry
    (a Hugging Face tokenizer records its own; a SentencePiece one has the fixed ids)."""
    ids = tok_info.get("special_ids") or {"cls": CLS_ID, "sep": SEP_ID, "pad": PAD_ID}
    return {"cls_id": int(ids["cls"]), "sep_id": int(ids["sep"]), "pad_id": int(ids["pad"])}


def special_settings_ids(tok_info: dict[str, Any]) -> dict[str, int]:
    """``{cls, sep, pad}`` ids of a manifest tokenizer entry (see :func:`special_settings`)."""
    got = special_settings(tok_info)
    return {"cls": got["cls_id"], "sep": got["sep_id"], "pad": got["pad_id"]}


def make_encoder(model: Any) -> Any:
    """The worker's encoder: a SentencePiece model proto (bytes) or an :class:`HFPayload`."""
    if isinstance(model, HFPayload):
        return HFEncoder(model)
    return spm.SentencePieceProcessor(model_proto=model)


_worker: dict[str, Any] = {}


def init_worker(model_proto: Any, settings: EncodeSettings, worker: bool = True) -> None:
    """Pool initializer: load the tokenizer once per worker process (``worker=False``: in the
    main process, for ``--workers 0``)."""

    if worker:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is handled by the main process
    _worker["sp"] = make_encoder(model_proto)
    _worker["settings"] = settings


def encode_task(texts: list[str]) -> dict[str, Any]:
    """Tokenize a batch of documents in the worker; see :func:`encode_documents`."""
    return encode_documents(_worker["sp"], _worker["settings"], texts)


def encode_documents(sp: Any, settings: EncodeSettings, texts: list[str]) -> dict[str, Any]:
    """Tokenize documents and lay them out per split.

    Returns ``{"splits": {split: {"tokens", "documents", "content", "pad"}}, "empty": int}``
    where ``tokens`` is the 1-D stream (doc tokens + sep per document) for ``full`` packing
    and the finished rows ``[k, N]`` for ``pad`` packing.
    """
    dtype = np.dtype(settings.dtype)
    doc_lines = [document_lines(t) for t in texts]
    if getattr(sp, "whole_documents", False):  # a Hugging Face tokenizer: one call per document
        doc_lines = [["\n".join(lines)] if lines else [] for lines in doc_lines]
    all_lines = list(itertools.chain.from_iterable(doc_lines))
    encoded = sp.encode(all_lines, num_threads=1) if all_lines else []
    line_lens = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    flat = np.fromiter(
        itertools.chain.from_iterable(encoded), dtype=dtype, count=int(line_lens.sum())
    )
    # Token offsets of each document in `flat`.
    lines_per_doc = np.fromiter(map(len, doc_lines), dtype=np.int64, count=len(doc_lines))
    line_ends = np.concatenate([[0], np.cumsum(line_lens)])
    doc_bounds = line_ends[np.concatenate([[0], np.cumsum(lines_per_doc)])]

    pieces: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
    counts = {s: {"documents": 0, "content": 0, "pad": 0} for s in SPLITS}
    empty = 0
    n = settings.seq_len
    sep = np.array([settings.sep_id], dtype=dtype)
    for i, text in enumerate(texts):
        tokens = flat[doc_bounds[i] : doc_bounds[i + 1]]
        if len(tokens) == 0:
            empty += 1
            continue
        split = assign_split(text, settings.valid_fraction, settings.seed)
        counts[split]["documents"] += 1
        counts[split]["content"] += len(tokens)
        if settings.packing == "full":
            pieces[split].append(tokens)
            pieces[split].append(sep)
        else:
            chunk = n - 2
            k = -(-len(tokens) // chunk)
            rows = np.full((k, n), settings.pad_id, dtype=dtype)
            rows[:, 0] = settings.cls_id
            for r in range(k):
                part = tokens[r * chunk : (r + 1) * chunk]
                rows[r, 1 : 1 + len(part)] = part
                rows[r, 1 + len(part)] = settings.sep_id
            counts[split]["pad"] += k * n - len(tokens) - 2 * k
            pieces[split].append(rows)
    splits = {}
    for s in SPLITS:
        if settings.packing == "full":
            tokens = np.concatenate(pieces[s]) if pieces[s] else np.zeros(0, dtype=dtype)
        else:
            tokens = np.concatenate(pieces[s]) if pieces[s] else np.zeros((0, n), dtype=dtype)
        splits[s] = {"tokens": tokens, **counts[s]}
    return {"splits": splits, "empty": empty}


class FullPacker:
    """Main-process side of ``full`` packing: cuts a split's token stream into ``[cls] + N-1``."""

    def __init__(
        self,
        seq_len: int,
        dtype: np.dtype,
        carry: list[int] | None = None,
        cls_id: int = CLS_ID,
        pad_id: int = PAD_ID,
    ) -> None:
        self.seq_len = seq_len
        self.cls_id, self.pad_id = cls_id, pad_id
        self.dtype = np.dtype(dtype)
        self.carry = np.asarray(carry if carry is not None else [], dtype=self.dtype)

    def add(self, stream: np.ndarray) -> np.ndarray:
        """Append stream tokens; returns the rows ``[k, N]`` that are now complete."""
        body = self.seq_len - 1
        buf = np.concatenate([self.carry, stream]) if len(self.carry) else stream
        k = len(buf) // body
        rows = np.empty((k, self.seq_len), dtype=self.dtype)
        rows[:, 0] = self.cls_id
        rows[:, 1:] = buf[: k * body].reshape(k, body)
        self.carry = np.array(buf[k * body :], dtype=self.dtype)
        return rows

    def finish(self) -> np.ndarray:
        """The last, padded row (``[1, N]``), or ``[0, N]`` if nothing is left over."""
        if len(self.carry) == 0:
            return np.zeros((0, self.seq_len), dtype=self.dtype)
        row = np.full((1, self.seq_len), self.pad_id, dtype=self.dtype)
        row[0, 0] = self.cls_id
        row[0, 1 : 1 + len(self.carry)] = self.carry
        self.carry = np.zeros(0, dtype=self.dtype)
        return row

    def pending_pad(self) -> int:
        """Pad tokens :meth:`finish` will add."""
        return self.seq_len - 1 - len(self.carry) if len(self.carry) else 0
