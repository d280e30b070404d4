"""The synthetic probes' rows: masked associative recall and copying (numpy, seeded).

Vocabulary (:class:`Vocab`): the five specials (pad 0, unk 1, cls 2, sep 3, mask 4), then
``keys`` key tokens, ``keys`` query tokens (one per key), ``values`` value tokens,
``keys * values`` bound tokens (one per (key, value)) and ``filler`` filler tokens. A row is
``[cls]`` then N - 1 tokens of filler (drawn from ``filler`` tokens; one by default: a constant
background) with the task written over it; only the probe's positions carry a label (-100
elsewhere).

Tasks (each row holds ``items`` of them, each queried ``queries`` times; ``distance``: how far
the query or the copy lies from what it needs, drawn log-uniform in ``[min_distance, N - 4]``
and placed at random, before or after, so that every distance bucket is about as well
represented as the next):

* ``induction`` (associative recall, two-hop): pairs ``key value`` (adjacent tokens, distinct
  keys, a random value each) anywhere in the row; a query ``key [MASK]`` elsewhere, labelled with
  the pair's value. The masked position must know its left neighbour's key (hop 1: positions,
  or the local mixer), then find the position whose left neighbour is the same key (hop 2).
* ``recall`` (one-hop): each pair is one bound token; the query is one position whose input is
  the key's query token (the query names the key), labelled with the value.
* ``lookup``: as ``induction``, but the query is the key token alone, labelled with the value.
* ``copy``: a span of ``span`` random value tokens repeated ``distance`` tokens later (or
  earlier); every other token of the repeat (``mask_every``: 2) is masked and labelled. The
  unmasked neighbours locate the original; the masked tokens are read from it.

``chance``: the accuracy of a guess among the answers the task allows (1 / values);
:func:`bag_accuracy`: what the bag of a row's tokens gives without retrieving (the row's most
frequent value).
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

PAD, UNK, CLS, SEP, MASK = 0, 1, 2, 3, 4
SPECIALS = 5
TASKS = ("recall", "induction", "lookup", "copy")


@dataclass(frozen=True)
class Vocab:
    keys: int = 32
    values: int = 16
    filler: int = 1

    @property
    def key0(self) -> int:
        return SPECIALS

    @property
    def query0(self) -> int:
        return SPECIALS + self.keys

    @property
    def value0(self) -> int:
        return SPECIALS + 2 * self.keys

    @property
    def pair0(self) -> int:  # the recall task's bound (key, value) tokens, key-major
        return self.value0 + self.values

    @property
    def filler0(self) -> int:
        return self.pair0 + self.keys * self.values

    @property
    def size(self) -> int:
        return self.filler0 + self.filler


@dataclass(frozen=True)
class TaskSpec:
    task: str = "recall"
    seq_len: int = 512
    items: int = 32  # pairs (recall, induction, lookup) or spans (copy) per row
    min_distance: int = 16
    span: int = 8  # copy: tokens per span
    mask_every: int = 2  # copy: every mask_every-th token of the repeat is masked
    queries: int = 1  # queries (recall, induction) or repeats (copy) of every item

    def chance(self, vocab: Vocab) -> float:
        return 1.0 / vocab.values

    def check(self, vocab: Vocab) -> str | None:
        if self.task not in TASKS:
            return f"task {self.task!r} is not one of {TASKS}"
        width = {"copy": self.span, "induction": 2, "lookup": 2}.get(self.task, 1)
        if self.task != "copy" and self.items > vocab.keys:
            return f"{self.items} items need as many distinct keys; the vocabulary has {vocab.keys}"
        if self.queries < 1:
            return f"queries must be at least 1, got {self.queries}"
        if self.seq_len < 2 * self.items * (1 + self.queries) * width + self.min_distance + 8:
            return (f"N = {self.seq_len} is too short for {self.items} {self.task} items of "
                    f"{width} tokens at distance >= {self.min_distance}")  # fmt: skip
        return None


def _draw_distance(rng: np.random.Generator, lo: int, hi: int) -> int:
    return int(np.clip(round(float(np.exp(rng.uniform(np.log(lo), np.log(hi))))), lo, hi))


def _place(rng: np.random.Generator, free: np.ndarray, width: int, d: int
           ) -> tuple[int, int] | None:  # fmt: skip
    """Starts ``(a, b)`` of two free runs of ``width`` tokens with ``|b - a| = d`` (b: the
    query/copy), or None after a few tries."""
    n = free.shape[0]
    for _ in range(24):
        a = int(rng.integers(1, n - width + 1))
        b = a + d if rng.random() < 0.5 else a - d
        if not (1 <= b <= n - width) or abs(a - b) < width:
            b = a - d if b == a + d else a + d
            if not (1 <= b <= n - width) or abs(a - b) < width:
                continue
        if free[a : a + width].all() and free[b : b + width].all():
            return a, b
    return None


def _place_from(rng: np.random.Generator, free: np.ndarray, width: int, a: int, d: int
                ) -> int | None:  # fmt: skip
    """Start ``b`` of a free run of ``width`` tokens ``d`` tokens before or after ``a``."""
    n = free.shape[0]
    first = 1 if rng.random() < 0.5 else -1
    for b in (a + first * d, a - first * d):
        if 1 <= b <= n - width and abs(a - b) >= width and free[b : b + width].all():
            return b
    return None


def make_rows(spec: TaskSpec, vocab: Vocab, rows: int, seed: int
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """``(input_ids [R, N], labels [R, N], distance [R, N])`` int64; ``distance`` is -1 where
    there is no label."""
    rng = np.random.default_rng(seed)
    n = spec.seq_len
    ids = rng.integers(vocab.filler0, vocab.size, size=(rows, n))
    ids[:, 0] = CLS
    labels = np.full((rows, n), -100, dtype=np.int64)
    dist = np.full((rows, n), -1, dtype=np.int64)
    width = {"copy": spec.span, "induction": 2, "lookup": 2}.get(spec.task, 1)
    hi = max(spec.min_distance, n - width - 2)

    def shorter(place: Callable[..., Any], *args: Any) -> tuple[Any, int]:
        """``place(*args, d)`` at a drawn distance d, halved in a crowded row until it fits."""
        d = _draw_distance(rng, spec.min_distance, hi)
        got = place(*args, d)
        while got is None and d > spec.min_distance:
            d = max(spec.min_distance, d // 2)
            got = place(*args, d)
        return got, d

    for r in range(rows):
        free = np.ones(n, dtype=bool)
        free[0] = False
        keys = rng.permutation(vocab.keys)[: spec.items]
        for j in range(spec.items):
            got, d = shorter(_place, rng, free, width)
            if got is None:
                continue
            a, b = got
            free[a : a + width] = False
            key = vocab.key0 + int(keys[j])
            value = vocab.value0 + int(rng.integers(vocab.values))
            span = vocab.value0 + rng.integers(vocab.values, size=width)
            if spec.task == "copy":  # a span of random value tokens, repeated
                ids[r, a : a + width] = span
            elif spec.task in ("induction", "lookup"):
                ids[r, a], ids[r, a + 1] = key, value
            else:  # recall: one bound token
                ids[r, a] = vocab.pair0 + int(keys[j]) * vocab.values + (value - vocab.value0)
            for q in range(spec.queries):
                if q:
                    b, d = shorter(_place_from, rng, free, width, a)
                    if b is None:
                        continue
                free[b : b + width] = False
                if spec.task == "copy":
                    ids[r, b : b + width] = span
                    for t in range(b + spec.mask_every - 1, b + width, spec.mask_every):
                        labels[r, t], dist[r, t], ids[r, t] = ids[r, t], d, MASK
                elif spec.task == "induction":  # the query: key [MASK]
                    ids[r, b], ids[r, b + 1] = key, MASK
                    labels[r, b + 1], dist[r, b + 1] = value, d
                elif spec.task == "lookup":  # the query: the key alone, labelled with the value
                    ids[r, b] = key
                    labels[r, b], dist[r, b] = value, d
                else:  # recall: the query token names the key
                    ids[r, b] = vocab.query0 + int(keys[j])  # (the input at the labelled position)
                    labels[r, b], dist[r, b] = value, d
    return ids, labels, dist


def bag_accuracy(ids: np.ndarray, labels: np.ndarray, spec: TaskSpec, vocab: Vocab) -> float:
    """The expected top-1 accuracy of the best guess from the bag of a row's tokens (which tokens
    it holds and how often, not where): what a model reaches without retrieving anything.
    ``induction`` and ``copy``: the value token most frequent in the row (ties shared);
    ``recall``: the bound token of the query's key names the value, so the bag answers it
    exactly (1.0)."""
    if spec.task == "recall":
        return 1.0
    lo, count = vocab.value0, vocab.values
    hits, total = 0.0, 0
    for r in range(ids.shape[0]):
        targets = labels[r][labels[r] != -100]
        if not targets.size:
            continue
        row = ids[r][(ids[r] >= lo) & (ids[r] < lo + count)] - lo
        freq = np.bincount(row, minlength=count)
        best = freq == freq.max()
        hits += float(best[targets - lo].sum()) / int(best.sum())
        total += targets.size
    return hits / max(total, 1)
