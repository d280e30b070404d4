"""Hugging Face tokenizer directories as data_prep's ``--tokenizer`` (WordPiece as BERT has it,
byte-level BPE as RoBERTa has it, any ``tokenizer.json`` that ``save_pretrained`` writes).

The directory is loaded with ``transformers.AutoTokenizer`` (no Hub: local files only), its
special tokens give the special ids (pad, unk, cls = cls or bos, sep = sep or eos, mask), and
a copy is saved to ``OUT/tokenizer/`` with ``save_pretrained``. Workers encode with the
``tokenizers`` backend that ``AutoTokenizer`` builds from that copy (the tokenizer's own encode,
no special tokens added): each document's non-blank lines joined with ``\\n``, in one call, so
a byte-level BPE keeps the line breaks it was trained with. Text that spells a special token
(``[MASK]``, ``</s>``) is encoded as text (transformers' ``split_special_tokens=True``): as
with SentencePiece's control symbols, only the packing puts special ids into rows (a literal
``</s>`` would otherwise end a document early). transformers is imported only here
and only when a directory is given (it takes seconds).
"""

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

from data_prep.errors import DataPrepError
from linformer_ds.outdir import error_line
from linformer_ds.special_tokens import copy_tokenizer_files, hf_special_tokens

HF_DIR = "tokenizer"  # OUT/tokenizer/: the saved copy
HF_FILE = "tokenizer.json"
KIND = "huggingface"
ENCODING = (
    "each document's non-blank lines joined with \\n, encoded in one call by the tokenizer's "
    "own encode without special tokens; special-token text in a document (e.g. '[MASK]') is "
    "encoded as text (split_special_tokens=True): only packing adds special ids"
)


@dataclass(frozen=True)
class HFPayload:
    """What a worker needs to encode: the backend tokenizer's JSON (``Tokenizer.to_str``)."""

    json: str


class HFEncoder:
    """A ``tokenizers.Tokenizer`` behind SentencePiece's ``encode(list)`` signature; its input
    units are whole documents (:data:`whole_documents`), not lines."""

    whole_documents = True

    def __init__(self, payload: HFPayload) -> None:
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_str(payload.json)
        self.tok.no_truncation()
        self.tok.no_padding()
        self.tok.encode_special_tokens = True  # a literal "[SEP]" in a text is text, not a sep

    def encode(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        """Ids of each text, no special tokens (one thread: the workers are the parallelism)."""
        return [self.tok.encode(t, add_special_tokens=False).ids for t in texts]


def is_hf_tokenizer(path: str) -> bool:
    """Whether ``--tokenizer`` names a directory (a Hugging Face tokenizer, not a .model)."""
    return os.path.isdir(path)


def load(path: str, flag: str = "--tokenizer") -> Any:
    """``AutoTokenizer`` of directory ``path`` (its tokenizer files; fast only); one-line
    :class:`DataPrepError`."""
    if not os.path.isfile(os.path.join(path, HF_FILE)):
        raise DataPrepError(
            f"{flag} {path}: not a Hugging Face tokenizer directory (no {HF_FILE}; write one "
            "with tokenizer.save_pretrained(DIR), or pass a SentencePiece .model file)"
        )
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with tempfile.TemporaryDirectory() as tmp:  # the tokenizer's files only: a model
            copy_tokenizer_files(path, tmp)  # directory's config.json is never read
            tok = AutoTokenizer.from_pretrained(tmp)
    except Exception as e:  # noqa: BLE001  (any loading failure: one line)
        raise DataPrepError(f"{flag} {path}: cannot load the tokenizer: {error_line(e)}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    if not getattr(tok, "is_fast", False):
        raise DataPrepError(f"{flag} {path}: not a fast (tokenizers) tokenizer")
    return tok


def special_tokens(tok: Any, where: str) -> tuple[dict[str, int], dict[str, str]]:
    """``(special_ids, special_pieces)`` of ``tok`` keyed pad/unk/cls/sep/mask; refuses a
    tokenizer that lacks one (the MLM trainer masks with mask, pads with pad, ...)."""
    ids, pieces, missing = hf_special_tokens(tok)
    if missing:
        raise DataPrepError(
            f"--tokenizer {where}: the tokenizer has no {missing[0]}; data_prep needs pad, unk, "
            "cls/bos, sep/eos and mask tokens (set it and save_pretrained again)"
        )
    if len(set(ids.values())) != len(ids):
        raise DataPrepError(f"--tokenizer {where}: special tokens share ids: {pieces} -> {ids}")
    return ids, pieces


def vocab_size(tok: Any) -> int:
    """Highest id + 1 (base vocabulary and added tokens)."""
    return max(tok.get_vocab().values()) + 1


def payload(tok: Any) -> HFPayload:
    """The backend tokenizer ``tok`` encodes with, for the workers."""
    return HFPayload(tok.backend_tokenizer.to_str())


def copy_tokenizer(path: str, out: str, vocab: Any) -> tuple[HFPayload, dict[str, Any]]:
    """Check directory ``path``, save it to ``OUT/tokenizer/`` (atomically) and return the
    workers' payload and the manifest entry. ``vocab``: ``--vocab-size`` (None or equal)."""
    tok = load(path)
    ids, pieces = special_tokens(tok, path)
    size = vocab_size(tok)
    if vocab is not None and int(vocab) != size:
        raise DataPrepError(
            f"--vocab-size {vocab} does not match --tokenizer {path!r} (vocab {size}); "
            "omit --vocab-size"
        )
    dest = os.path.join(out, HF_DIR)
    tmp = dest + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tok.save_pretrained(tmp)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    return saved(out, {"special_ids": ids, "special_pieces": pieces, "vocab_size": size})


def saved(out: str, want: dict[str, Any]) -> tuple[HFPayload, dict[str, Any]]:
    """The payload and manifest entry of the copy in ``OUT/tokenizer/``, checked to have the
    special ids and size in ``want`` (the given tokenizer's, or a resumed run's record)."""
    from linformer_ds.fsio import file_sha256

    dest = os.path.join(out, HF_DIR)
    tok = load(dest, "saved tokenizer")
    ids, pieces = special_tokens(tok, dest)
    size = vocab_size(tok)
    if ids != want["special_ids"] or size != want["vocab_size"]:
        raise DataPrepError(
            f"{dest}: the saved copy has special ids {ids} and {size} ids, the tokenizer "
            f"{want['special_ids']} and {want['vocab_size']}: it does not survive save_pretrained"
        )
    with open(os.path.join(dest, HF_FILE), encoding="utf-8") as f:
        model_type = str(json.load(f).get("model", {}).get("type"))
    info = {
        "kind": KIND,
        "file": f"{HF_DIR}/{HF_FILE}",
        "dir": HF_DIR,
        "sha256": file_sha256(os.path.join(dest, HF_FILE)),
        "files": {n: file_sha256(os.path.join(dest, n)) for n in sorted(os.listdir(dest))},
        "class": type(tok).__name__,
        "model_type": model_type,
        "vocab_size": size,
        "special_ids": ids,
        "special_pieces": pieces,
        "encoding": ENCODING,
    }
    return payload(tok), info
