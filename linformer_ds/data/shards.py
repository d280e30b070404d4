"""The shard dataset written by ``data_prep`` (memory-mapped, checked against its manifest at
open) and the checks of datasets against the model and against each other (tokenizer, N)."""

import json
import os
from bisect import bisect_right
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece as spm
import torch

from linformer_ds.data.splits import empty_split_fix
from linformer_ds.errors import LinformerError
from linformer_ds.fsio import file_sha256
from linformer_ds.special_tokens import SPECIAL_IDS, SPECIAL_PIECES
from linformer_ds.tokenizer_identity import (
    TokenizerMismatch,
    check_tokenizers,
    of_data,
    read_checked,
)

MANIFEST_FORMAT_VERSION = 1  # = data_prep.FORMAT_VERSION (tests check they agree)
DTYPES = ("uint16", "uint32")
SPECIAL_KEYS = ("pad", "unk", "cls", "sep", "mask")  # manifest special_ids, all required
HF_KIND = "huggingface"  # manifest tokenizer.kind of a Hugging Face tokenizer directory


class DataError(LinformerError, ValueError):
    """A dataset is missing, corrupt, truncated or does not match its manifest or the model."""


def _read_npy_header(path: str) -> tuple:
    """(shape, dtype, header_bytes) of a ``.npy`` file, without reading its data."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise ValueError(f"unsupported .npy version {version}")
        if fortran:
            raise ValueError("Fortran-ordered array")
        return shape, dtype, f.tell()


class ShardDataset(torch.utils.data.Dataset):
    """The rows ``[N]`` of one split of a ``data_prep`` output, memory-mapped.

    Opening checks the manifest and every shard's header, shape, dtype and file size (cheap);
    :meth:`verify` (or ``verify_checksums=True``) also checks every sha256.
    """

    def __init__(
        self, path: str | os.PathLike, split: str = "train", verify_checksums: bool = False
    ) -> None:
        self.path = Path(path)
        self.split = split
        self.manifest = self._load_manifest()
        m = self.manifest
        self.seq_len = int(m["seq_len"])
        self.vocab_size = int(m["vocab_size"])
        self.dtype = np.dtype(m["dtype"])
        ids = m["special_ids"]
        self.pad_id, self.unk_id = int(ids["pad"]), int(ids["unk"])
        self.cls_id, self.sep_id, self.mask_id = int(ids["cls"]), int(ids["sep"]), int(ids["mask"])
        self.special_ids: list[int] = [
            self.pad_id,
            self.unk_id,
            self.cls_id,
            self.sep_id,
            self.mask_id,
        ]
        if split not in m["splits"]:
            raise DataError(
                f"{self.path}: no split {split!r} in the manifest (splits: {sorted(m['splits'])})"
            )
        info = m["splits"][split]
        try:
            self.shards: list[dict[str, Any]] = list(info["shards"])
            rows = [int(s["rows"]) for s in self.shards]
            [str(s["file"]) for s in self.shards]
            int(info["rows"])
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(
                f"{self.path / 'manifest.json'}: corrupt manifest: split {split!r} entry is "
                f"malformed ({type(e).__name__}: {e})"
            ) from None
        if not self.shards or sum(rows) == 0:
            raise DataError(f"{self.path}: split {split!r} is empty (0 rows): {self._empty_fix()}")
        if sum(rows) != int(info["rows"]):
            raise DataError(
                f"{self.path}: manifest mismatch: split {split!r} lists {info['rows']} rows but its "
                f"shards hold {sum(rows)}"
            )
        for shard in self.shards:
            self._check_shard(shard)
        self._starts = np.cumsum([0] + rows).tolist()
        self._arrays: list[np.ndarray] | None = None
        if verify_checksums:
            self.verify()

    # ------------------------------------------------------------------------------ checks
    def _load_manifest(self) -> dict[str, Any]:
        mpath = self.path / "manifest.json"
        if not mpath.is_file():
            hint = (
                "an unfinished data_prep run (rerun it with --resume)"
                if (self.path / "progress.json").is_file()
                else "not a data_prep output"
            )
            raise DataError(f"{self.path}: no manifest.json ({hint})")
        try:
            m = json.loads(mpath.read_bytes().decode("utf-8"))
        except (ValueError, OSError) as e:  # not JSON, not UTF-8 (e.g. UTF-16), unreadable
            raise DataError(f"{mpath}: corrupt manifest ({e}); rerun data_prep") from None
        if not isinstance(m, dict):
            raise DataError(f"{mpath}: corrupt manifest (not a JSON object)")
        if m.get("format_version") != MANIFEST_FORMAT_VERSION:
            raise DataError(
                f"{mpath}: format_version {m.get('format_version')!r}, this reader understands "
                f"{MANIFEST_FORMAT_VERSION}"
            )
        missing = [
            k for k in ("seq_len", "vocab_size", "dtype", "special_ids", "splits") if k not in m
        ]
        if missing:
            raise DataError(f"{mpath}: manifest lacks {missing}")
        if m["dtype"] not in DTYPES:
            raise DataError(f"{mpath}: dtype {m['dtype']!r} is not one of {DTYPES}")
        for key in ("seq_len", "vocab_size"):
            if not isinstance(m[key], int) or isinstance(m[key], bool) or m[key] < 1:
                raise DataError(f"{mpath}: {key} must be a positive integer, got {m[key]!r}")
        if int(m["vocab_size"]) > np.iinfo(np.dtype(m["dtype"])).max + 1:
            raise DataError(
                f"{mpath}: vocab_size {m['vocab_size']} does not fit dtype {m['dtype']}"
            )
        ids = m["special_ids"]
        if not isinstance(ids, dict):
            raise DataError(f"{mpath}: special_ids must be an object, got {ids!r}")
        lacking = [k for k in SPECIAL_KEYS if k not in ids]
        if lacking:
            raise DataError(
                f"{mpath}: special_ids lacks {lacking} (has {sorted(ids)}); rebuild the data "
                "with data_prep, whose tokenizers define all of " + ", ".join(SPECIAL_KEYS)
            )
        for k in SPECIAL_KEYS:
            v = ids[k]
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < m["vocab_size"]:
                raise DataError(
                    f"{mpath}: special_ids.{k} = {v!r} is not a token id in [0, {m['vocab_size']})"
                )
        if len({ids[k] for k in SPECIAL_KEYS}) != len(SPECIAL_KEYS):
            raise DataError(f"{mpath}: special_ids are not distinct: {ids}")
        if not isinstance(m["splits"], dict):
            raise DataError(f"{mpath}: splits must be an object")
        return m

    def _empty_fix(self) -> str:
        """Why this split is empty and the data_prep flag that fixes it (the advice data_prep
        itself gives, from the manifest's counts)."""
        src, how = self.manifest.get("source"), self.manifest.get("split")
        try:
            return empty_split_fix(
                self.split, int(src["documents"]) - int(src.get("empty_documents", 0)),
                int(src["bytes"]), int(src["max_doc_bytes"]), float(how["valid_fraction"]),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError):  # a manifest without the counts
            return "make a larger corpus or change --valid-fraction"

    def _shard_path(self, shard: dict[str, Any]) -> str:
        return str(self.path / shard["file"])

    def _check_shard(self, shard: dict[str, Any]) -> None:
        path = self._shard_path(shard)
        if not os.path.isfile(path):
            raise DataError(f"shard {path} is missing")
        try:
            shape, dtype, header = _read_npy_header(path)
        except (ValueError, OSError, EOFError) as e:
            raise DataError(f"shard {path} is corrupt: not a readable .npy file ({e})") from e
        rows = int(shard["rows"])
        if shape != (rows, self.seq_len):
            raise DataError(
                f"shard {path} does not match the manifest: shape {shape}, expected "
                f"({rows}, {self.seq_len})"
            )
        if dtype != self.dtype:
            raise DataError(f"shard {path} has dtype {dtype}, the manifest says {self.dtype}")
        want = header + rows * self.seq_len * self.dtype.itemsize
        size = os.path.getsize(path)
        if size != want:
            kind = "truncated" if size < want else "longer than its header says"
            raise DataError(f"shard {path} is {kind}: {size} bytes, expected {want}")

    def verify(self) -> None:
        """Check every shard's sha256 (and the tokenizer's) against the manifest."""
        items = [(self._shard_path(s), s["sha256"]) for s in self.shards]
        tok = self.manifest.get("tokenizer") or {}
        if tok.get("sha256") and (self.path / tok.get("file", "tokenizer.model")).is_file():
            items.append((str(self.path / tok.get("file", "tokenizer.model")), tok["sha256"]))
        for path, want in items:
            got = file_sha256(path)
            if got != want:
                raise DataError(
                    f"{path} is corrupt: sha256 {got} does not match the manifest's {want}"
                )

    # ----------------------------------------------------------------------------- access
    def _open(self) -> list[np.ndarray]:
        if self._arrays is None:
            self._arrays = [np.load(self._shard_path(s), mmap_mode="r") for s in self.shards]
        return self._arrays

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_arrays"] = None  # re-mapped lazily in the receiving process
        return state

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, i: int) -> torch.Tensor:
        """Row ``i`` as ``LongTensor [seq_len]``."""
        n = len(self)
        i = int(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"row {i} out of range for {n} rows")
        k = bisect_right(self._starts, i) - 1
        row = np.asarray(self._open()[k][i - self._starts[k]], dtype=np.int64)
        if row.max() >= self.vocab_size:
            raise DataError(
                f"shard {self._shard_path(self.shards[k])} is corrupt: row {i} holds token id "
                f"{int(row.max())} >= vocab_size {self.vocab_size}"
            )
        return torch.from_numpy(row)


def check_compatible(dataset: ShardDataset, model_config: Any, init_from: str | None = None
                     ) -> None:  # fmt: skip
    """Raise :class:`DataError` unless the dataset fits the model (vocab, length, pad id).
    ``init_from``: the run's ``checkpoint.init_from`` (``hf:PATH``), whose weights fix
    ``model.vocab_size``: a larger data vocabulary is then told to re-tokenize the data."""
    vocab = int(model_config.vocab_size)
    max_len = int(model_config.max_seq_len)
    if dataset.vocab_size > vocab:
        fix = f"set model.vocab_size >= {dataset.vocab_size}"
        if isinstance(init_from, str) and init_from.startswith("hf:"):
            from linformer_ds.warm_start import retokenize_advice  # (torch, omegaconf: loaded)

            fix = (f"checkpoint.init_from {init_from} fixes model.vocab_size; "
                   f"{retokenize_advice(init_from[3:], str(dataset.path))}")  # fmt: skip
        raise DataError(
            f"{dataset.path}: dataset vocab_size {dataset.vocab_size} > model vocab_size {vocab}; "
            f"{fix}"
        )
    if dataset.seq_len > max_len:
        raise DataError(
            f"{dataset.path}: dataset seq_len {dataset.seq_len} > model max_seq_len {max_len}; "
            f"set model.max_seq_len >= {dataset.seq_len} or rebuild the data with a smaller --seq-len"
        )
    pad = getattr(model_config, "pad_token_id", dataset.pad_id)
    if pad is not None and int(pad) != dataset.pad_id:
        raise DataError(
            f"{dataset.path}: dataset pad id {dataset.pad_id} != model pad_token_id {pad}"
        )
    check_tokenizer(dataset, vocab)


def check_tokenizer(dataset: ShardDataset, model_vocab: int) -> None:
    """The data's tokenizer (tokenizer.model, or a Hugging Face tokenizer/tokenizer.json) is the
    file data_prep recorded (size, sha256) and fits the model's vocabulary: a tokenizer swapped
    in later would be copied into every checkpoint and export, and would decode the ids as other
    tokens. Cheap (one small file), always run."""
    tok = dataset.manifest.get("tokenizer")
    if not isinstance(tok, dict):
        return  # a manifest without a tokenizer record: nothing recorded to compare with
    path = dataset.path / str(tok.get("file", "tokenizer.model"))
    name = tok.get("file", "tokenizer.model")
    redo = f"restore the data_prep output's {name} or re-run data_prep"
    if not path.is_file():
        raise DataError(f"{path}: not found; the manifest records the tokenizer the data was "
                        f"made with ({redo})")  # fmt: skip
    size = tok.get("size")
    if size is not None and path.stat().st_size != int(size):
        raise DataError(f"{path}: {path.stat().st_size} bytes, the manifest records {size}: not "
                        f"the tokenizer this data was made with ({redo})")  # fmt: skip
    try:  # the file has the sha256 the manifest records (the one identity check's reader)
        data = read_checked(of_data(str(dataset.path), dataset.manifest))[0] or b""
    except TokenizerMismatch as e:
        raise DataError(f"{e}; {redo}") from None
    pieces = tok.get("vocab_size")
    if pieces is not None and int(pieces) > model_vocab:
        raise DataError(f"{path}: {pieces} pieces, more than model vocab_size {model_vocab}; set "
                        f"model.vocab_size >= {pieces}")  # fmt: skip
    if tok.get("kind") == HF_KIND:
        check_hf_tokenizer(path, data, dataset, redo)
        return
    check_tokenizer_model(path, data, dataset.vocab_size, redo)


def check_hf_tokenizer(path: Path, data: bytes, dataset: ShardDataset, redo: str) -> None:
    """The bytes of ``path`` are a ``tokenizers`` JSON of the manifest's vocabulary whose
    special tokens (``special_pieces``) have the manifest's ``special_ids``."""
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_str(data.decode("utf-8"))
    except Exception as e:  # noqa: BLE001  (tokenizers raises its own Exception type)
        why = " ".join(str(e).split())[:120]
        raise DataError(f"{path}: not a Hugging Face tokenizer.json ({why}); {redo}") from None
    n = max(tok.get_vocab(with_added_tokens=True).values()) + 1
    if n != dataset.vocab_size:
        raise DataError(f"{path}: {n} ids, the manifest's vocab_size is {dataset.vocab_size}: not "
                        f"the tokenizer this data was made with; {redo}")  # fmt: skip
    pieces = dataset.manifest.get("special_pieces") or {}
    ids = dataset.manifest["special_ids"]
    wrong = [f"{pieces.get(k)!r} = {tok.token_to_id(str(pieces.get(k)))} (not {ids[k]})"
             for k in SPECIAL_KEYS if tok.token_to_id(str(pieces.get(k))) != ids[k]]  # fmt: skip
    if wrong:
        raise DataError(f"{path}: special tokens {', '.join(wrong)}: the manifest's special_ids "
                        f"are not this tokenizer's; {redo}")  # fmt: skip


def check_tokenizer_model(path: Path, data: bytes, vocab_size: int, redo: str) -> None:
    """The bytes of ``path`` are a SentencePiece model of ``vocab_size`` pieces with the fixed
    special tokens (:mod:`linformer_ds.special_tokens`): a matching sha256 only says the file is
    the one the manifest records, and a manifest can be edited with it."""
    try:
        sp = spm.SentencePieceProcessor(model_proto=data)
    except (OSError, RuntimeError, TypeError, ValueError) as e:
        why = " ".join(str(e).split())[:120]
        raise DataError(f"{path}: not a SentencePiece model ({why}); {redo}") from None
    n = sp.get_piece_size()
    if n != vocab_size:
        raise DataError(f"{path}: {n} pieces, the manifest's vocab_size is {vocab_size}: not the "
                        f"tokenizer this data was made with; {redo}")  # fmt: skip
    found = {}
    for key, want in SPECIAL_IDS.items():
        got = sp.piece_to_id(SPECIAL_PIECES[key])
        is_it = got == want and sp.id_to_piece(got) == SPECIAL_PIECES[key]
        found[key] = got if is_it or got != sp.unk_id() or key == "unk" else -1
    if found != SPECIAL_IDS:
        wrong = ", ".join(f"{SPECIAL_PIECES[k]} = {found[k]} (not {v})"
                          for k, v in SPECIAL_IDS.items() if found[k] != v)  # fmt: skip
        raise DataError(f"{path}: special tokens {wrong}; every data_prep tokenizer has "
                        f"{SPECIAL_IDS} (linformer_ds/special_tokens.py); {redo}")  # fmt: skip


def tokenizer_name(manifest: dict[str, Any]) -> str:
    """What a data_prep output's tokenizer is called in it, and in checkpoints and exports made
    from it: ``tokenizer.model`` (SentencePiece) or ``tokenizer`` (a Hugging Face tokenizer
    directory, ``tokenizer/tokenizer.json``)."""
    tok = manifest.get("tokenizer") if isinstance(manifest, dict) else None
    if isinstance(tok, dict) and tok.get("kind") == HF_KIND:
        return str(tok.get("dir", "tokenizer"))
    return "tokenizer.model"


# ================================================================================ opening data
def check_same_tokenizer(
    names: Sequence[str], datasets: Sequence[ShardDataset], same_seq_len: bool = True
) -> None:
    """Raise :class:`DataError` unless all datasets share the tokenizer (sha256, vocabulary,
    special ids) and, with ``same_seq_len``, N."""
    ref_name, ref = names[0], datasets[0]
    for name, d in zip(names[1:], datasets[1:]):
        a = of_data(str(ref.path), ref.manifest, f"source {ref_name!r}")
        b = of_data(str(d.path), d.manifest, f"source {name!r}")
        why = None
        if (a is None) != (b is None):
            why = f"only {(a or b).role} records one"
        elif a is not None and b is not None:
            try:  # the one identity check (same file, or the same pieces, normalizer, ...)
                check_tokenizers(a, b)
            except TokenizerMismatch as e:
                why = str(e)
        if why or d.vocab_size != ref.vocab_size or d.special_ids != ref.special_ids:
            raise DataError(
                f"sources {ref_name!r} ({ref.path}) and {name!r} ({d.path}) have different "
                f"tokenizers ({why or f'vocab {ref.vocab_size} vs {d.vocab_size}'}); prepare "
                "every source with the same tokenizer (data_prep --tokenizer "
                "FIRST/tokenizer.model, or FIRST/tokenizer for a Hugging Face tokenizer)"
            )
        if same_seq_len and d.seq_len != ref.seq_len:
            raise DataError(
                f"sources {ref_name!r} ({ref.path}) and {name!r} ({d.path}) have different "
                f"sequence lengths (N={ref.seq_len} vs {d.seq_len}); one mixture needs one N "
                "(put the lengths in separate train.stages)"
            )


def open_sources(
    names: Sequence[str],
    paths: Sequence[str],
    split: str,
    model_config: Any = None,
    verify_checksums: bool = False,
    same_seq_len: bool = True,
    init_from: str | None = None,
) -> list[ShardDataset]:
    """Open one split of every source, checked against the model (and ``init_from``, see
    :func:`check_compatible`) and against each other (same tokenizer; same N with
    ``same_seq_len``); :class:`DataError` names the source."""
    datasets = []
    for name, path in zip(names, paths):
        try:
            d = ShardDataset(path, split, verify_checksums)
            if model_config is not None:
                check_compatible(d, model_config, init_from)
        except DataError as e:
            raise DataError(f"source {name!r}: {e}") from None
        datasets.append(d)
    check_same_tokenizer(names, datasets, same_seq_len)
    return datasets
