"""The context meter: the best context-free predictor, scored on the positions the model is.

A model that ignores context can do no better than the train split's unigram distribution:
its cross-entropy on the hidden labels (``unigram_loss``) and the accuracy of always
predicting the most frequent maskable token (``unigram_accuracy``). Every evaluation reports
both beside the model's figures on the same labels (``hidden_loss``, ``hidden_accuracy``), and
their differences ``context_gain_nats = unigram_loss - hidden_loss`` and
``context_gain_accuracy = hidden_accuracy - unigram_accuracy``: what the model has learned
from context.

Hidden labels: the labelled positions whose input is the mask token (80 % of them under BERT's
80/10/10 rule). The other 20 % are not context-free tasks: a position kept unchanged (10 %)
shows the model its own answer, and a model that copies its input there scores ~6 nats below
the unigram level on them (measured on the English recipe: 0.77 vs 7.18 nats), which made the
meter over all labels (``loss``, as before) read ~0.5 nats of "context" that is copying.

Counts: the train split's token counts without the ids that are never masked (pad, unk, cls,
sep, mask). They come from the data_prep output's ``unigram`` record (``unigram_counts.npy``,
written at prep time), else from a cache file in the run directory, else are counted once
(``np.bincount`` over the memory-mapped rows) and cached, so a resumed run does not recount.

Smoothing: add-one (Laplace) over the maskable ids, ``p(t) = (c_t + 1) / (C + V_m)`` with
``C`` the counted tokens and ``V_m`` the maskable ids of the vocabulary: a token the train split
never holds still has a finite loss.
"""

import hashlib
import io
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # numpy only at run time: data_prep records the counts without torch
    import torch

IGNORE_INDEX = -100  # = linformer_ds.loss.IGNORE_INDEX (not imported: torch-free here)
COUNTS_FILE = "unigram_counts.npy"  # data_prep's record of the train split's counts
CHUNK_TOKENS = 1 << 22  # tokens per bincount (bounded memory for any corpus size)
FIELDS = (
    "hidden_loss",
    "hidden_accuracy",
    "unigram_loss",
    "unigram_accuracy",
    "context_gain_nats",
    "context_gain_accuracy",
)


def count_tokens(
    paths: Sequence[str | os.PathLike], vocab_size: int, excluded: Sequence[int]
) -> np.ndarray:
    """``int64 [vocab_size]`` token counts over the rows of the ``.npy`` shards ``paths``
    (memory-mapped, counted in chunks), with the ``excluded`` ids set to 0."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for path in paths:
        arr = np.load(path, mmap_mode="r")
        flat = arr.reshape(-1)
        for start in range(0, flat.shape[0], CHUNK_TOKENS):
            chunk = np.asarray(flat[start : start + CHUNK_TOKENS])
            counts += np.bincount(chunk, minlength=vocab_size)[:vocab_size]
    counts[[i for i in excluded if 0 <= i < vocab_size]] = 0
    return counts


def counts_record(out: str | os.PathLike, shards: list[dict[str, Any]], vocab_size: int,
                  excluded: Sequence[int], split: str = "train") -> dict[str, Any]:  # fmt: skip
    """data_prep: count ``split``'s ``shards`` under ``out``, write ``out/unigram_counts.npy``
    and return the manifest's ``unigram`` record (file, sha256, split, excluded ids, tokens)."""
    counts = count_tokens([os.path.join(out, s["file"]) for s in shards], vocab_size, excluded)
    path = os.path.join(out, COUNTS_FILE)
    np.save(path, counts)
    with open(path, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    return {
        "file": COUNTS_FILE,
        "sha256": sha,
        "split": split,
        "excluded_ids": sorted(int(i) for i in excluded),
        "tokens": int(counts.sum()),
    }


def _split_key(dataset: Any, excluded: Sequence[int]) -> str:
    """A digest of what the counts depend on: the split's shards (file, rows, sha256), the
    vocabulary and the excluded ids."""
    shards = [(s.get("file"), s.get("rows"), s.get("sha256")) for s in dataset.shards]
    if any(sha is None for _, _, sha in shards):  # no checksums recorded: the files themselves
        shards = [(str(Path(dataset.path, f).resolve()), r, os.path.getsize(Path(dataset.path, f)))
                  for f, r, _ in shards]  # fmt: skip
    text = json.dumps([shards, int(dataset.vocab_size), sorted(excluded)])
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _recorded_sha(dataset: Any, excluded: Sequence[int]) -> str | None:
    """The sha256 the manifest records for this split's counts (with these excluded ids)."""
    rec = dataset.manifest.get("unigram")
    if not isinstance(rec, dict) or rec.get("split") != dataset.split:
        return None
    if sorted(rec.get("excluded_ids", [])) != sorted(excluded):
        return None
    return str(rec["sha256"]) if rec.get("sha256") else None


def _parse(data: bytes, vocab_size: int) -> np.ndarray | None:
    """``data`` (the bytes of a ``.npy`` file) as ``int64 [vocab_size]`` counts, else None."""
    try:
        counts = np.load(io.BytesIO(data), allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    if counts.shape != (vocab_size,) or counts.dtype.kind not in "iu" or (counts < 0).any():
        return None
    return counts.astype(np.int64)


def _recorded(dataset: Any, excluded: Sequence[int]) -> "tuple[np.ndarray | None, str]":
    """data_prep's counts of this split, when its manifest records them and the file is the
    one recorded (sha256, token total); else ``(None, why not)`` (empty: nothing recorded)."""
    want = _recorded_sha(dataset, excluded)
    rec = dataset.manifest.get("unigram")
    if not isinstance(rec, dict) or rec.get("split") != dataset.split:
        return None, ""
    if sorted(rec.get("excluded_ids", [])) != sorted(excluded):
        return None, ""
    path = Path(dataset.path, str(rec.get("file", COUNTS_FILE)))
    try:
        data = path.read_bytes()
    except OSError as e:
        return None, f"{path.name} unreadable ({e.strerror or type(e).__name__})"
    if want is not None and _sha256(data) != want:
        return None, (f"{path.name} sha256 {_sha256(data)[:12]} is not the manifest's "
                      f"{want[:12]}")  # fmt: skip
    counts = _parse(data, dataset.vocab_size)
    if counts is None or int(counts.sum()) != rec.get("tokens"):
        return None, f"{path.name} does not hold the manifest's counts"
    return counts, ""


def _cached(cache: Path, want: str | None, vocab_size: int) -> "tuple[np.ndarray | None, str]":
    """The cache file's counts when its bytes have the manifest's sha256 (``want``), else the
    sha256 its sidecar (``.sha256``) recorded when it was written; ``(None, why not)``."""
    try:
        data = cache.read_bytes()
    except FileNotFoundError:
        return None, ""
    except OSError as e:
        return None, f"cache {cache.name} unreadable ({e.strerror or type(e).__name__})"
    if want is None:
        try:
            want = cache.with_suffix(".sha256").read_text(encoding="utf-8").strip()
        except OSError:
            return None, f"cache {cache.name} has no {cache.with_suffix('.sha256').name}"
    got = _sha256(data)
    if got != want:
        return None, f"cache {cache.name} sha256 {got[:12]} is not the recorded {want[:12]}"
    counts = _parse(data, vocab_size)
    if counts is None:
        return None, f"cache {cache.name} does not hold counts of {vocab_size} ids"
    return counts, ""


def load_counts(
    dataset: Any, cache_dir: str | os.PathLike | None, write_cache: bool = True
) -> dict[str, Any]:
    """The unigram counts of ``dataset`` (a ``ShardDataset``, normally the train split):
    ``{"counts": int64 [V], "from": "manifest" | "cache" | "counted", "why": str}``. Files are
    verified by sha256 (the manifest's record; a cache's own ``.sha256`` beside it when the
    manifest records none): one that does not match is not used, the counts are recounted and
    ``why`` says which file failed. Counted ones are written to
    ``cache_dir/unigram_<split>_<key>.npy`` (atomically, with its sha256) when ``write_cache``."""
    excluded = sorted(set(int(i) for i in dataset.special_ids))
    counts, why = _recorded(dataset, excluded)
    if counts is not None:
        return {"counts": counts, "from": "manifest", "why": ""}
    reasons = [why] if why else []
    cache = None
    if cache_dir is not None:
        cache = Path(cache_dir, f"unigram_{dataset.split}_{_split_key(dataset, excluded)}.npy")
        counts, why = _cached(cache, _recorded_sha(dataset, excluded), dataset.vocab_size)
        if counts is not None:
            return {"counts": counts, "from": "cache", "why": "; ".join(reasons)}
        reasons += [why] if why else []
    paths = [Path(dataset.path, s["file"]) for s in dataset.shards]
    counts = count_tokens(paths, dataset.vocab_size, excluded)
    if cache is not None and write_cache:
        try:
            os.makedirs(cache.parent, exist_ok=True)
            buf = io.BytesIO()
            np.save(buf, counts)
            for path, data in ((cache.with_suffix(".sha256"), _sha256(buf.getvalue()).encode()),
                               (cache, buf.getvalue())):  # fmt: skip
                tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
                tmp.write_bytes(data)
                os.replace(tmp, path)
        except OSError:
            pass  # a cache only: the next run counts again
    why = "; ".join(reasons)
    return {"counts": counts, "from": "counted", "why": f"{why}: recounted" if why else ""}


class UnigramMeter:
    """Scores masked labels with the context-free predictor of ``counts`` (``int64 [V]``,
    excluded ids 0): add-one smoothed log-probabilities over the ids ``maskable``, and the most
    frequent of them as the constant guess."""

    def __init__(self, counts: np.ndarray, excluded: Sequence[int], source: str = "counted"):
        v = counts.shape[0]
        maskable = np.ones(v, dtype=bool)
        maskable[[i for i in excluded if 0 <= i < v]] = False
        c = np.where(maskable, counts, 0).astype(np.float64)
        total = c.sum() + maskable.sum()
        with np.errstate(divide="ignore"):
            self.log_prob = np.where(maskable, np.log((c + 1.0) / total), -np.inf)  # [V]
        self.top = int(np.argmax(np.where(maskable, c, -1.0)))
        self.tokens = int(c.sum())
        self.source = source

    @classmethod
    def for_dataset(cls, dataset: Any, cache_dir: str | os.PathLike | None = None,
                    write_cache: bool = True) -> "UnigramMeter":  # fmt: skip
        """The meter of a train split (see :func:`load_counts`)."""
        got = load_counts(dataset, cache_dir, write_cache)
        why = got.get("why")
        return cls(got["counts"], dataset.special_ids, got["from"] + (f": {why}" if why else ""))

    def stats(self, labels: "torch.Tensor") -> list[float]:
        """``[sum of -log p(label), labels equal to the top token]`` over the labelled positions
        (``!= IGNORE_INDEX``) of ``labels`` (any shape, on the host)."""
        lab = labels[labels != IGNORE_INDEX].numpy()
        if lab.size == 0:
            return [0.0, 0.0]
        return [float(-self.log_prob[lab].sum()), float((lab == self.top).sum())]


def unigram_bias(meters: Sequence[UnigramMeter], weights: Sequence[float],
                 vocab_size: int | None = None, floor_nats: float = 10.0) -> np.ndarray:  # fmt: skip
    """``float32 [vocab_size]``: the log of the ``weights``-mixture of the meters' unigram
    distributions, centred to mean 0 over the ids any of them can mask; the never-masked ids
    (pad, cls, ...) and those past the data's vocabulary (a model's ``vocab_size`` may be larger)
    ``floor_nats`` below the least likely maskable id. The MLM decoder's bias at a fresh start
    with ``model.output_bias_init: unigram``: the untrained model then predicts the context-free
    distribution (its loss on hidden labels is the meter's ``unigram_loss``)."""
    w = np.asarray(weights, dtype=np.float64)
    v = max(m.log_prob.shape[0] for m in meters) if vocab_size is None else int(vocab_size)
    p = np.zeros(v, dtype=np.float64)
    for wi, m in zip(w, meters):
        n = min(v, m.log_prob.shape[0])
        p[:n] += wi / w.sum() * np.exp(m.log_prob[:n])  # exp(-inf) = 0
    maskable = p > 0
    with np.errstate(divide="ignore"):
        logp = np.log(p)
    logp = np.where(maskable, logp, logp[maskable].min() - floor_nats)
    return (logp - logp[maskable].mean()).astype(np.float32)


def set_output_bias(model: Any, meters: dict[str, UnigramMeter], stage: Any,
                    vocab_size: int) -> str:  # fmt: skip
    """``model.output_bias_init: unigram`` at a fresh start: ``model.lm_head.decoder.bias`` =
    :func:`unigram_bias` of ``stage``'s train mixture (``names``, ``weights``); the log line."""
    import torch

    bias = unigram_bias([meters[n] for n in stage.names], stage.weights, vocab_size)
    with torch.no_grad():
        model.lm_head.decoder.bias.copy_(torch.from_numpy(bias))
    return (
        f"[setup] MLM decoder bias: log unigram of {'+'.join(stage.names)} "
        f"(range {bias.min():.2f} .. {bias.max():.2f})"
    )


def train_meters(datasets: dict[str, Any], cache_dir: str | os.PathLike | None,
                 write_cache: bool) -> "tuple[dict[str, UnigramMeter], str]":  # fmt: skip
    """The meter of each named train split (:meth:`UnigramMeter.for_dataset`) and a summary of
    where their counts came from (``name: N tokens (manifest|cache|counted)``)."""
    meters = {name: UnigramMeter.for_dataset(ds, cache_dir, write_cache=write_cache)
              for name, ds in datasets.items()}  # fmt: skip
    return meters, ", ".join(f"{n}: {m.tokens} tokens ({m.source})" for n, m in meters.items())


def figures(loss_sum: float, correct: float, count: float, loss: float, acc: float
            ) -> dict[str, float]:  # fmt: skip
    """The meter's fields of an eval record from its summed statistics over ``count`` labels
    (the hidden ones) and the model's ``loss`` / ``acc`` on the same labels."""
    u_loss = loss_sum / max(count, 1.0)
    u_acc = correct / max(count, 1.0)
    return {
        "unigram_loss": u_loss,
        "unigram_accuracy": u_acc,
        "context_gain_nats": u_loss - loss,
        "context_gain_accuracy": acc - u_acc,
    }


def with_mixture_meter(record: dict[str, float], names: Sequence[str], weights: Sequence[float],
                       per_source: dict[str, dict[str, float]]) -> dict[str, float]:  # fmt: skip
    """A mixture's eval ``record`` (data.stages.combine_eval) with the meter's fields of the mixture
    after ``mlm_accuracy``: the sources' hidden-label and unigram figures weighted as its
    ``loss`` is (by the training ``weights``), and the gains between them. Unchanged when a
    source has no meter or the record is one source's own."""
    if "unigram_loss" in record or not all("unigram_loss" in per_source[n] for n in names):
        return record

    def mean(key: str) -> float:
        return sum(w * per_source[n][key] for n, w in zip(names, weights))

    h_loss, h_acc = mean("hidden_loss"), mean("hidden_accuracy")
    u_loss, u_acc = mean("unigram_loss"), mean("unigram_accuracy")
    meter = {
        "hidden_loss": h_loss,
        "hidden_accuracy": h_acc,
        "unigram_loss": u_loss,
        "unigram_accuracy": u_acc,
        "context_gain_nats": u_loss - h_loss,
        "context_gain_accuracy": h_acc - u_acc,
    }
    out: dict[str, float] = {}
    for k, v in record.items():
        out[k] = v
        if k == "mlm_accuracy":
            out.update(meter)
    return out
