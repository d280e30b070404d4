"""Document isolation in packed rows: the documents of a batch (:func:`document_spans`), their
chunking for batched per-document work (:func:`document_chunks`) and the dense block mask."""

from collections.abc import Callable
from typing import NamedTuple

import torch


def _nonempty(mask: torch.Tensor) -> torch.Tensor:
    """Let fully padded rows attend everywhere (their output is ignored) instead of giving NaN."""
    return mask | ~mask.any(dim=-1, keepdim=True)


class DocumentSpan(NamedTuple):
    """One document's tokens in a ``[B, n]`` batch (this rank's slice under sequence parallelism):
    ``row``, ``[start, end)``, ``column``: the document position (E/F column) of ``start``,
    ``padded``: some of its tokens are masked, ``shared``: the index of its sum over the
    sequence-parallel group (-1: the document lies in this slice only)."""

    row: int
    start: int
    end: int
    column: int = 0
    padded: bool = False
    shared: int = -1


class Documents(NamedTuple):
    """The documents of a packed batch (:func:`document_spans`): spans in row-major order that
    cover every token once. ``whole_rows``: every row (all slices together) is one document, so
    the plain path computes exactly the same thing. ``block_mask [B, 1, N, N]`` (sequence
    parallel dense layers only): token i may attend to key j (same document, j not padding).
    ``per_span``: linear and conv layers run one product and one attention per span on views
    of the row (exactly the work of each document alone: the CPU choice); False: batched over
    :class:`DocumentChunks` (a few large ops, plus the chunks' padding and gathers)."""

    spans: list[DocumentSpan]
    num_shared: int = 0
    whole_rows: bool = False
    block_mask: torch.Tensor | None = None
    plans: dict | None = None  # chunk plans by size (document_chunks), built once per batch
    per_span: bool = False

    def split(self, t: torch.Tensor) -> tuple:
        """``t [B, n, ...]`` -> each span's ``[L_i, ...]`` (views; the backward is one cat, where
        slicing would zero-fill a whole ``[B, n, ...]`` gradient per span)."""
        flat = t.reshape((t.shape[0] * t.shape[1],) + tuple(t.shape[2:]))
        return flat.split([s.end - s.start for s in self.spans])

    def chunks(self, size: int, tokens: int, device: torch.device) -> "DocumentChunks":
        """:func:`document_chunks` of these spans (``tokens`` = B * n), cached per size."""
        plans = self.plans if self.plans is not None else {}
        if size not in plans:
            plans[size] = document_chunks(self.spans, size, tokens, device)
        return plans[size]


def each_document(
    fn: Callable[..., torch.Tensor],
    documents: "Documents",
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """``fn(q, k, v, mask, rotary)`` on each document alone (``q, k, v [B, n, h, d]`` -> each
    span's ``[1, L, h, d]``, its mask when padded, its slice of the rotary tables ``[B or 1, n,
    ...]``); the outputs concatenated in row-major order ``[B n, h, d]``."""
    ys = []
    for s, qi, ki, vi in zip(documents.spans, *(documents.split(t) for t in (q, k, v))):
        mi = mask[s.row, s.start : s.end][None] if mask is not None and s.padded else None
        rot = None
        if rotary is not None:
            row = s.row if rotary[0].shape[0] > 1 else 0
            rot = tuple(t[row, s.start : s.end][None] for t in rotary)
        ys.append(fn(qi[None], ki[None], vi[None], mi, rot)[0])
    return torch.cat(ys)


class DocumentChunks(NamedTuple):
    """The documents cut into chunks of ``size`` document positions (chunk j of a document holds
    its positions ``[j size, (j+1) size)``), so that per-document work runs as a few batched
    ops: ``tokens [C, size]`` the flat index (into ``B * n`` tokens) of each slot, ``B * n``
    for an empty slot; ``span [C]`` each chunk's span; ``block [C]`` its j; ``slot [B * n]``
    each token's place ``chunk * size + offset``; ``key_index [S, J]`` span i's chunk j (``C``:
    none), J the most chunks of one span."""

    size: int
    tokens: torch.Tensor
    span: torch.Tensor
    block: torch.Tensor
    slot: torch.Tensor
    key_index: torch.Tensor


def document_chunks(
    spans: list[DocumentSpan], size: int, tokens: int, device: torch.device
) -> DocumentChunks:
    """The :class:`DocumentChunks` of ``spans`` (covering ``tokens`` flat tokens in order),
    computed on the host and copied to ``device`` once."""
    num = len(spans)
    lens = torch.tensor([s.end - s.start for s in spans], dtype=torch.long)
    cols = torch.tensor([s.column for s in spans], dtype=torch.long)
    first = cols // size
    count = (cols + lens - 1) // size - first + 1  # chunks of each span
    base = torch.cumsum(count, 0) - count
    total = int(count.sum())
    tok_span = torch.repeat_interleave(torch.arange(num), lens)  # spans cover tokens in order
    flat_start = torch.cumsum(lens, 0) - lens
    pos = cols[tok_span] + torch.arange(tokens) - flat_start[tok_span]  # document position
    chunk = base[tok_span] + pos // size - first[tok_span]
    slot = chunk * size + pos % size
    index = torch.full((total * size,), tokens, dtype=torch.long)
    index[slot] = torch.arange(tokens)
    chunk_span = torch.repeat_interleave(torch.arange(num), count)
    within = torch.arange(total) - base[chunk_span]
    width = int(count.max())
    key_index = torch.full((num * width,), total, dtype=torch.long)
    key_index[chunk_span * width + within] = torch.arange(total)

    def put(t: torch.Tensor) -> torch.Tensor:  # pinned + non_blocking: no wait for the queue
        if device.type == "cuda":
            return t.pin_memory().to(device, non_blocking=True)
        return t.to(device)

    return DocumentChunks(
        size,
        put(index.view(total, size)),
        put(chunk_span),
        put(first[chunk_span] + within),
        put(slot),
        put(key_index.view(num, width)),
    )


def document_starts(
    position_ids: torch.Tensor, attention_mask: torch.Tensor | None
) -> torch.Tensor:
    """``[B, N]`` bool: where a document starts (each row start, every unmasked position 0).
    Masked positions never start one (padding joins the document before it)."""
    starts = position_ids == 0
    if attention_mask is not None:
        starts &= attention_mask.bool()
    starts[:, 0] = True
    return starts


def document_spans(
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    offset: int = 0,
    n_local: int | None = None,
    max_position: int | None = None,
) -> Documents:
    """The documents of ``position_ids [B, N]`` (a new one at every row start and every unmasked
    position 0), read to the host once. With ``n_local`` (sequence parallel) the inputs are the
    whole rows and the spans are those of the slice ``[offset, offset + n_local)``: a document
    in more than one slice gets a ``shared`` index (the same on every rank). ``max_position``:
    ids must lie in ``[0, max_position)`` (ValueError otherwise)."""
    b, n = position_ids.shape
    starts = document_starts(position_ids, attention_mask)
    rows = [starts]
    rows.append(~attention_mask.bool() if attention_mask is not None else torch.zeros_like(starts))
    if max_position is not None:
        rows.append((position_ids < 0) | (position_ids >= max_position))
    host = torch.stack(rows).cpu()  # the one device -> host read
    if max_position is not None and bool(host[2].any()):
        raise ValueError(f"position_ids must lie in [0, max_seq_len={max_position})")
    n_local = n if n_local is None else n_local
    lo, hi = offset, offset + n_local
    spans: list[DocumentSpan] = []
    num_shared, whole = 0, True
    pad = host[1]
    for r in range(b):
        bounds = torch.nonzero(host[0, r]).reshape(-1).tolist() + [n]
        whole = whole and len(bounds) == 2
        for s, e in zip(bounds[:-1], bounds[1:]):
            crosses = s // n_local != (e - 1) // n_local
            shared = -1
            if crosses:
                shared, num_shared = num_shared, num_shared + 1
            ls, le = max(s, lo), min(e, hi)
            if ls < le:
                padded = bool(pad[r, ls:le].any())
                spans.append(DocumentSpan(r, ls - lo, le - lo, ls - s, padded, shared))
    return Documents(spans, num_shared, whole, None, {})


def document_block_mask(
    position_ids: torch.Tensor, attention_mask: torch.Tensor | None
) -> torch.Tensor:
    """``[B, 1, N, N]`` bool: query i may attend to key j (same document, j not padding; a row
    with no allowed key may attend everywhere, its output is ignored)."""
    doc = document_starts(position_ids, attention_mask).cumsum(dim=1)
    allowed = doc[:, :, None] == doc[:, None, :]
    if attention_mask is not None:
        allowed &= attention_mask.bool()[:, None, :]
    return _nonempty(allowed)[:, None]
