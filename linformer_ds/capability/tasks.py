"""The synthetic probes' rows: masked associative recall and copying (numpy, seeded).

Vocabulary (:class:`Vocab`): the five specials (pad 0, unk 1, cls 2, sep 3, mask 4), then
``keys`` key tokens, ``keys`` query tokens (one per key), ``values`` value tokens,
``keys * values`` bound tokens (one per (key, value)) and ``filler`` filler tokens. A row is
``[cls]`` then N - 1 tokens of random filler with the task written over it; only the probe's
positions carry a label (-100 elsewhere).

Tasks (each row holds ``items`` of them; ``distance``: how far the query or the copy lies from
what it needs, drawn log-uniform in ``[min_distance, N - 4]`` and placed at random, before or
after, so that every distance bucket is as well represented as the next):

* ``induction`` (associative recall, two-hop): pairs ``key value`` (adjacent tokens, distinct
  keys, a random value each) anywhere in the row; a query ``key [MASK]`` elsewhere, labelled with
  the pair's value. The masked position must know its left neighbour's key (hop 1: positions,
  or the local mixer), then find the position whose left neighbour is the same key (hop 2).
* ``recall`` (one-hop): each pair is one bound token; the query is one position whose input is
  the key's query token (the query names the key), labelled with the value.
* ``copy``: a span of ``span`` random filler tokens repeated ``distance`` tokens later (or
  earlier); every other token of the repeat (``mask_every``: 2) is masked and labelled. The
  unmasked neighbours locate the original; the masked tokens are read from it.

``chance``: the accuracy of a guess among the answers the task allows (1 / values for recall,
1 / filler for copy); a model that only knows which values the row holds reaches about
1 / items (recall, induction).
"""

from dataclasses import dataclass

import numpy as np

PAD, UNK, CLS, SEP, MASK = 0, 1, 2, 3, 4
SPECIALS = 5
TASKS = ("recall", "induction", "copy")


@dataclass(frozen=True)
class Vocab:
    keys: int = 16
    values: int = 16
    filler: int = 64

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
    items: int = 8  # pairs (recall) or spans (copy) per row
    min_distance: int = 16
    span: int = 8  # copy: tokens per span
    mask_every: int = 2  # copy: every mask_every-th token of the repeat is masked

    def chance(self, vocab: Vocab) -> float:
        return 1.0 / (vocab.filler if self.task == "copy" else vocab.values)

    def check(self, vocab: Vocab) -> str | None:
        if self.task not in TASKS:
            return f"task {self.task!r} is not one of {TASKS}"
        width = {"copy": self.span, "induction": 2}.get(self.task, 1)
        if self.task != "copy" and self.items > vocab.keys:
            return f"{self.items} items need as many distinct keys; the vocabulary has {vocab.keys}"
        if self.seq_len < 4 * self.items * width + self.min_distance + 8:
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
    width = {"copy": spec.span, "induction": 2}.get(spec.task, 1)
    hi = max(spec.min_distance, n - width - 2)
    for r in range(rows):
        free = np.ones(n, dtype=bool)
        free[0] = False
        keys = rng.permutation(vocab.keys)[: spec.items]
        for j in range(spec.items):
            d = _draw_distance(rng, spec.min_distance, hi)
            got = _place(rng, free, width, d)
            while got is None and d > spec.min_distance:  # a crowded row: a shorter distance
                d = max(spec.min_distance, d // 2)
                got = _place(rng, free, width, d)
            if got is None:
                continue
            a, b = got
            free[a : a + width] = False
            free[b : b + width] = False
            if spec.task == "copy":
                ids[r, b : b + width] = ids[r, a : a + width]
                for t in range(b + spec.mask_every - 1, b + width, spec.mask_every):
                    labels[r, t] = ids[r, t]
                    dist[r, t] = d
                    ids[r, t] = MASK
                continue
            key = vocab.key0 + int(keys[j])
            value = vocab.value0 + int(rng.integers(vocab.values))
            if spec.task == "induction":
                ids[r, a], ids[r, a + 1] = key, value
                ids[r, b], ids[r, b + 1] = key, MASK
                labels[r, b + 1], dist[r, b + 1] = value, d
            else:  # recall: one bound token; the query token names the key
                ids[r, a] = vocab.pair0 + int(keys[j]) * vocab.values + (value - vocab.value0)
                ids[r, b] = vocab.query0 + int(keys[j])  # (the input at the labelled position)
                labels[r, b], dist[r, b] = value, d
    return ids, labels, dist
