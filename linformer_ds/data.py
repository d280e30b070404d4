"""Training-side data: the shard dataset written by ``data_prep``, MLM masking, and a resumable
distributed sampler.

Reproducibility contract: the rows a rank sees depend only on (seed, epoch, position in the
epoch's permutation), and the masking of a row only on (seed, epoch, row index). Neither depends
on the rank or on how rows are grouped into batches, so a run resumed from a checkpoint, even
with a different number of ranks, continues exactly.
"""

import hashlib
import json
import os
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import numpy as np
import torch

from linformer_ds.model import labelled_positions

MANIFEST_FORMAT_VERSION = 1  # = data_prep.FORMAT_VERSION (tests check they agree)
DTYPES = ("uint16", "uint32")
IGNORE_INDEX = -100
SPECIAL_KEYS = ("pad", "unk", "cls", "sep", "mask")  # manifest special_ids, all required


class DataError(ValueError):
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
        self, path: Union[str, os.PathLike], split: str = "train", verify_checksums: bool = False
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
        self.special_ids: List[int] = [
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
            self.shards: List[Dict[str, Any]] = list(info["shards"])
            rows = [int(s["rows"]) for s in self.shards]
            [str(s["file"]) for s in self.shards]
            int(info["rows"])
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(
                f"{self.path / 'manifest.json'}: corrupt manifest: split {split!r} entry is "
                f"malformed ({type(e).__name__}: {e})"
            ) from None
        if not self.shards or sum(rows) == 0:
            raise DataError(
                f"{self.path}: split {split!r} is empty (0 rows); make a larger corpus or "
                "change --valid-fraction"
            )
        if sum(rows) != int(info["rows"]):
            raise DataError(
                f"{self.path}: manifest mismatch: split {split!r} lists {info['rows']} rows but its "
                f"shards hold {sum(rows)}"
            )
        for shard in self.shards:
            self._check_shard(shard)
        self._starts = np.cumsum([0] + rows).tolist()
        self._arrays: Optional[List[np.ndarray]] = None
        if verify_checksums:
            self.verify()

    # ------------------------------------------------------------------------------ checks
    def _load_manifest(self) -> Dict[str, Any]:
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

    def _shard_path(self, shard: Dict[str, Any]) -> str:
        return str(self.path / shard["file"])

    def _check_shard(self, shard: Dict[str, Any]) -> None:
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
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            if h.hexdigest() != want:
                raise DataError(
                    f"{path} is corrupt: sha256 {h.hexdigest()} does not match the manifest's {want}"
                )

    # ----------------------------------------------------------------------------- access
    def _open(self) -> List[np.ndarray]:
        if self._arrays is None:
            self._arrays = [np.load(self._shard_path(s), mmap_mode="r") for s in self.shards]
        return self._arrays

    def __getstate__(self) -> Dict[str, Any]:
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


def check_compatible(dataset: ShardDataset, model_config: Any) -> None:
    """Raise :class:`DataError` unless the dataset fits the model (vocab, length, pad id)."""
    vocab = int(model_config.vocab_size)
    max_len = int(model_config.max_seq_len)
    if dataset.vocab_size > vocab:
        raise DataError(
            f"{dataset.path}: dataset vocab_size {dataset.vocab_size} > model vocab_size {vocab}; "
            f"set model.vocab_size >= {dataset.vocab_size}"
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


def file_sha256(path: Union[str, os.PathLike]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_tokenizer(dataset: ShardDataset, model_vocab: int) -> None:
    """The data's tokenizer.model is the file data_prep recorded (size, sha256) and fits the
    model's vocabulary: a tokenizer swapped in later would be copied into every checkpoint and
    export, and would decode the ids as other tokens. Cheap (one small file), always run."""
    tok = dataset.manifest.get("tokenizer")
    if not isinstance(tok, dict):
        return  # a manifest without a tokenizer record: nothing recorded to compare with
    path = dataset.path / str(tok.get("file", "tokenizer.model"))
    redo = "restore the data_prep output's tokenizer.model or re-run data_prep"
    if not path.is_file():
        raise DataError(f"{path}: not found; the manifest records the tokenizer the data was "
                        f"made with ({redo})")  # fmt: skip
    size = tok.get("size")
    if size is not None and path.stat().st_size != int(size):
        raise DataError(f"{path}: {path.stat().st_size} bytes, the manifest records {size}: not "
                        f"the tokenizer this data was made with ({redo})")  # fmt: skip
    want = tok.get("sha256")
    got = file_sha256(path) if want else None
    if want and got != want:
        raise DataError(f"{path}: not the tokenizer this data was made with (sha256 {got[:16]} "
                        f"vs the manifest's {str(want)[:16]}); {redo}")  # fmt: skip
    pieces = tok.get("vocab_size")
    if pieces is not None and int(pieces) > model_vocab:
        raise DataError(f"{path}: {pieces} pieces, more than model vocab_size {model_vocab}; set "
                        f"model.vocab_size >= {pieces}")  # fmt: skip


def _row_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The generator of one row: a function of (seed, epoch, index) only."""
    return np.random.default_rng([seed % 2**63, epoch % 2**63, index % 2**63, 0x4D4C4D])


class MLMMasking:
    """BERT masking: ``mlm_probability`` of the non-special tokens are predicted; of those 80%
    become ``mask_id``, 10% a random non-special token, 10% stay. Special tokens never are.

    Short inputs (BERT's ``short_seq_prob``): that fraction of rows is cut to a length drawn
    uniformly from ``[2, N - 1]``; the rest of the row becomes padding (attention mask 0, no
    labels), so the model also sees short sequences. ``0.0`` (default) leaves rows whole.

    The draws of a row depend only on ``(seed, epoch, sample index)``; the cut is drawn after the
    masking draws, so the masks of uncut rows do not depend on ``short_seq_prob``.
    """

    def __init__(
        self,
        vocab_size: int,
        mask_id: int,
        special_ids: Sequence[int],
        mlm_probability: float = 0.15,
        seed: int = 0,
        pad_id: int = 0,
        short_seq_prob: float = 0.0,
    ) -> None:
        if not 0.0 < mlm_probability < 1.0:
            raise ValueError(f"mlm_probability must be in (0, 1), got {mlm_probability}")
        if not 0.0 <= short_seq_prob <= 1.0:
            raise ValueError(f"short_seq_prob must be in [0, 1], got {short_seq_prob}")
        self.short_seq_prob = float(short_seq_prob)
        self.vocab_size = int(vocab_size)
        self.mask_id = int(mask_id)
        self.special_ids = sorted({int(s) for s in special_ids} | {int(mask_id), int(pad_id)})
        self.mlm_probability = float(mlm_probability)
        self.seed = int(seed)
        self.pad_id = int(pad_id)
        allowed = np.ones(self.vocab_size, dtype=bool)
        allowed[[s for s in self.special_ids if 0 <= s < self.vocab_size]] = False
        self.random_ids = np.flatnonzero(allowed)
        if len(self.random_ids) == 0:
            raise ValueError("the vocabulary holds no non-special token")
        self._special = torch.tensor(self.special_ids, dtype=torch.long)

    def __call__(
        self, tokens: torch.Tensor, sample_indices: torch.Tensor, epoch: int
    ) -> Dict[str, torch.Tensor]:
        """``tokens [B, N]`` -> ``input_ids, attention_mask, labels`` (all ``[B, N]`` long)."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [B, N], got shape {tuple(tokens.shape)}")
        b, n = tokens.shape
        idx = [int(i) for i in torch.as_tensor(sample_indices).reshape(-1).tolist()]
        if len(idx) != b:
            raise ValueError(f"{len(idx)} sample indices for {b} rows")
        u = np.empty((b, n))
        v = np.empty((b, n))
        rnd = np.empty((b, n), dtype=np.int64)
        lengths = np.full(b, n)
        for r, index in enumerate(idx):
            g = _row_rng(self.seed, epoch, index)
            u[r] = g.random(n)
            v[r] = g.random(n)
            rnd[r] = self.random_ids[g.integers(0, len(self.random_ids), n)]
            if self.short_seq_prob > 0.0 and n > 2 and g.random() < self.short_seq_prob:
                lengths[r] = g.integers(2, n)  # in [2, n - 1]
        tokens = tokens.long()
        if (lengths < n).any():  # cut rows: the tail becomes padding
            tail = torch.arange(n)[None, :] >= torch.from_numpy(lengths)[:, None]
            tokens = tokens.masked_fill(tail, self.pad_id)
        special = torch.isin(tokens, self._special)
        selected = torch.from_numpy(u < self.mlm_probability) & ~special
        v_t = torch.from_numpy(v)
        to_mask = selected & (v_t < 0.8)
        to_random = selected & (v_t >= 0.8) & (v_t < 0.9)
        input_ids = tokens.clone()
        input_ids[to_mask] = self.mask_id
        input_ids[to_random] = torch.from_numpy(rnd)[to_random]
        labels = torch.full_like(tokens, IGNORE_INDEX)
        labels[selected] = tokens[selected]
        return {
            "input_ids": input_ids,
            "attention_mask": (tokens != self.pad_id).long(),
            "labels": labels,
        }


class ResumableDistributedSampler(torch.utils.data.Sampler[int]):
    """Deterministic sharded sampling whose position can be saved and restored.

    Epoch ``e`` uses the permutation seeded by ``(seed, e)``. Starting from position ``start``
    (the samples all ranks together have consumed), rank ``r`` yields positions
    ``start + r, start + r + W, ...`` for ``(num_samples - start) // W`` steps (the ragged tail
    of fewer than ``W`` samples is dropped, so every rank yields the same count).

    Consumption is counted as indices are yielded, assuming the ranks advance in lockstep:
    ``consumed = start + W * yielded_by_this_rank``. Iterate it directly (or through a
    ``DataLoader`` without prefetching workers); a prefetching loader would count prefetched
    samples as consumed. :meth:`load_state_dict` accepts a state saved under any world size.
    The iterator ends when the epoch is exhausted; call :meth:`set_epoch` with the next epoch.
    """

    def __init__(
        self, num_samples: int, rank: int, world_size: int, seed: int = 0, shuffle: bool = True
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"bad rank {rank} for world_size {world_size}")
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        self.num_samples = int(num_samples)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.seed = int(seed)
        self.shuffle = shuffle
        self.epoch = 0
        self._start = 0  # consumed by all ranks when the current iterator began
        self._yielded = 0  # indices this rank's current iterator has yielded

    @property
    def consumed(self) -> int:
        """Samples of the current epoch consumed by all ranks together."""
        return self._start + self._yielded * self.world_size

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch`` (from its start); a no-op if already there, keeping the position."""
        if int(epoch) != self.epoch:
            self.epoch = int(epoch)
            self._start = 0
            self._yielded = 0

    def permutation(self, epoch: Optional[int] = None) -> np.ndarray:
        """The order of epoch ``epoch`` (default: the current one)."""
        e = self.epoch if epoch is None else int(epoch)
        if not self.shuffle:
            return np.arange(self.num_samples)
        return np.random.default_rng([self.seed % 2**63, e % 2**63]).permutation(self.num_samples)

    def __len__(self) -> int:
        return (self.num_samples - self.consumed) // self.world_size

    def __iter__(self) -> Iterator[int]:
        start = self.consumed
        self._start, self._yielded = start, 0
        perm = self.permutation()
        for j in range((self.num_samples - start) // self.world_size):
            self._yielded += 1  # counted when handed out
            yield int(perm[start + self.rank + j * self.world_size])

    def state_dict(self) -> Dict[str, int]:
        """``{"epoch", "consumed"}``: enough to continue under any world size."""
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        """Continue from a saved position (saved under any world size)."""
        consumed = int(state["consumed"])
        if not 0 <= consumed <= self.num_samples:
            raise ValueError(
                f"sampler state consumed={consumed} is outside [0, {self.num_samples}]: "
                "the dataset changed since the checkpoint"
            )
        self.epoch = int(state["epoch"])
        self._start, self._yielded = consumed, 0


def to_device(batch: Dict[str, torch.Tensor], device: Union[str, torch.device]) -> Dict[str, Any]:
    """A host batch (``input_ids, attention_mask, labels`` ``[B, n]``) on ``device``, with
    ``labelled_index``: the flat indices ``[M]`` of its labelled positions, computed here on
    the host (:func:`linformer_ds.model.labelled_positions`) so that the model's forward never
    waits for the device to learn M. On CUDA the tensors go through pinned memory with
    ``non_blocking``: a pageable copy would wait for the device's queue to drain."""
    device = torch.device(device)
    batch = dict(batch, labelled_index=labelled_positions(batch["labels"]))
    if device.type == "cuda":
        return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}
    return {k: v.to(device) for k, v in batch.items()}


class TrainBatches:
    """The training stream of one rank: sampler -> rows -> MLM masking -> device tensors.

    ``next_batch()`` returns ``input_ids, attention_mask, labels`` ``[micro_batch, N]`` and their
    ``labelled_index`` (see :func:`to_device`); it moves to the next epoch when the current one is exhausted. ``state_dict`` / ``load_state_dict``
    carry the position (any world size). ``on_batch(step_epoch, indices)`` is an optional
    observer (the trainer's sample-log debug hook).

    Sequence parallel: ``rank`` / ``world_size`` are the replica's (data-parallel) rank and
    count, so the ``sp_size`` ranks of a group read the same rows and masks; each keeps its
    ``[B, N / sp_size]`` slice (``sp_rank``).
    """

    def __init__(
        self,
        dataset: ShardDataset,
        masker: MLMMasking,
        rank: int,
        world_size: int,
        micro_batch_size: int,
        seed: int,
        device: Union[str, torch.device] = "cpu",
        sp_rank: int = 0,
        sp_size: int = 1,
    ) -> None:
        self.dataset, self.masker = dataset, masker
        self.sp_rank, self.sp_size = int(sp_rank), int(sp_size)
        self.micro_batch_size = int(micro_batch_size)
        self.device = torch.device(device)
        self.sampler = ResumableDistributedSampler(len(dataset), rank, world_size, seed=seed)
        self.world_size = world_size
        self.epoch = 0
        self._it: Optional[Iterator[int]] = None
        self.on_batch = None

    def state_dict(self) -> Dict[str, Any]:
        """``{"epoch", "sampler": {"epoch", "consumed"}}``: the position, for any world size."""
        return {"epoch": self.epoch, "sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s result (a ``ValueError`` if it cannot apply)."""
        self.sampler.load_state_dict(state["sampler"])
        self.epoch = int(state["epoch"])
        self._it = None

    def _next_index(self) -> int:
        if self._it is None:
            self.sampler.set_epoch(self.epoch)
            self._it = iter(self.sampler)
        try:
            return next(self._it)
        except StopIteration:
            self.epoch += 1
            self.sampler.set_epoch(self.epoch)
            self._it = iter(self.sampler)
            if len(self.sampler) == 0:
                raise DataError(
                    f"{self.dataset.path}: the {self.dataset.split} split has {len(self.dataset)} "
                    f"rows: too few for {self.world_size} ranks"
                ) from None
            return next(self._it)

    def next_batch(self) -> Dict[str, torch.Tensor]:
        idx = [self._next_index() for _ in range(self.micro_batch_size)]
        if self.on_batch is not None:
            self.on_batch(self.epoch, idx)
        tokens = torch.stack([self.dataset[i] for i in idx])
        batch = self.masker(tokens, torch.tensor(idx), self.epoch)
        if self.sp_size > 1:
            from linformer_ds.sequence_parallel import shard_batch

            batch, _ = shard_batch(batch, self.sp_rank, self.sp_size)
        return to_device(batch, self.device)  # labelled_index of this rank's slice
