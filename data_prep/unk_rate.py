"""The unknown-token rate of a data_prep output, for every tokenizer kind (SentencePiece and
Hugging Face): how many of the content tokens are the tokenizer's unknown token, counted from
the shards written (so the figure is the data's, whatever encoded it). The manifest records it
(``unk``) and the summary says it; above :data:`WARN_RATE` data_prep warns in one line.

Why 1 %: a tokenizer that fits its text leaves (almost) nothing unknown: data_prep's own
SentencePiece tokenizers have byte fallback from a vocabulary of 1,024 pieces
(``data_prep.tokenizer.BYTE_FALLBACK_MIN_VOCAB``). A tokenizer that does not fit (an uncased
vocabulary whose lowercasing was turned off, a tokenizer of other text) makes whole classes of
words unknown: every capitalised word, 10.3 % of the tokens, in the case that prompted this
check. 1 % lies between the two with room on both sides; docs/data_prep.md gives the rates
measured on both kinds.
"""

import os
from collections.abc import Iterable
from typing import Any

import numpy as np

WARN_RATE = 0.01  # the share of content tokens above which data_prep warns
CHUNK = 1 << 22  # tokens read at a time (bounded memory for any shard)


def count_id(paths: Iterable[str], token_id: int) -> int:
    """How many times ``token_id`` occurs in the rows of the ``.npy`` shards ``paths``
    (memory-mapped, counted in chunks)."""
    n = 0
    for path in paths:
        flat = np.load(path, mmap_mode="r").reshape(-1)
        for start in range(0, flat.shape[0], CHUNK):
            n += int(np.count_nonzero(np.asarray(flat[start : start + CHUNK]) == token_id))
    return n


def unk_record(out: str, splits: dict[str, Any], unk_id: int, piece: str) -> dict[str, Any]:
    """The manifest's ``unk`` record: the unknown token (``id``, ``piece``), per split and in
    all its count among the content tokens (``tokens``, ``content``, ``rate``), and the rate
    above which data_prep warns (``warn_above``)."""
    per = {}
    for name, split in splits.items():
        n = count_id([os.path.join(out, s["file"]) for s in split["shards"]], unk_id)
        content = int(split["tokens"]["content"])
        per[name] = {"tokens": n, "content": content, "rate": n / content if content else 0.0}
    tokens, content = (
        sum(p["tokens"] for p in per.values()),
        sum(p["content"] for p in per.values()),
    )
    return {"id": int(unk_id), "piece": piece, "tokens": tokens, "content": content,
            "rate": tokens / content if content else 0.0, "warn_above": WARN_RATE,
            "splits": per}  # fmt: skip


def summary(record: dict[str, Any]) -> str:
    """The summary line: the rate, the count and the threshold."""
    return (f"unknown token {record['piece']!r}: {record['rate']:.4%} of the content tokens "
            f"({record['tokens']:,} of {record['content']:,}; warns above "
            f"{record['warn_above']:.0%})")  # fmt: skip


def warning(record: dict[str, Any], tokenizer: str | None) -> str | None:
    """The one-line warning when the rate is above the threshold (None otherwise)."""
    if record["rate"] <= record["warn_above"]:
        return None
    given = f"--tokenizer {tokenizer}" if tokenizer else "the tokenizer trained here"
    return (f"data_prep: warning: {record['rate']:.2%} of the content tokens are the unknown token "
            f"{record['piece']!r} ({record['tokens']:,} of {record['content']:,}), above "
            f"{record['warn_above']:.0%}: {given} does not fit this text (e.g. lowercasing turned "
            "off in an uncased tokenizer, or another language or script); the model cannot learn "
            "what became unknown")  # fmt: skip
