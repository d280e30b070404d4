"""The valid split of a long-document corpus: does it hold whole rows of N for the context curve
and the capability suite? Used by scripts/make_long_corpus.sh after each data_prep run.

    python scripts/long_split.py DATA [--fixed] [--rows 64] [--max-fraction 0.25]

``python -m linformer_ds.context_curve`` (window N) and ``python -m linformer_ds.capability copy``
(a view of N) score only rows whose N tokens are one document (no sep before the last position,
no pad: a *whole row*, :func:`data_prep.doc_stats.whole_rows`); they take the first ``--rows``
of them (64 and 16 by default) and refuse a valid split without any. data_prep's split is by
document (a keyed hash of its text below ``--valid-fraction``), so a corpus of few documents
can give a valid split of one row, or of rows that each hold a document boundary.

Reads DATA (a data_prep output) and writes to stderr:

* a warning with counts when documents are shorter than N (they never fill a row alone); when
  all are, the ``--seq-len`` that the corpus's documents reach;
* the valid split's whole rows, against :data:`TARGET_ROWS`.

When the valid split holds fewer than ``--rows`` whole rows and ``--fixed`` is not given (the
caller chose no ``--valid-fraction``), prints on stdout the larger ``--valid-fraction`` to run
data_prep with (at most ``--max-fraction``: the rest of the corpus stays for training), from
the whole rows of both splits; nothing when none would help. With ``--fixed`` (or at the
maximum) it says exactly what to pass instead. Exit 1 when the valid split has no whole row
(the context curve would refuse it), else 0. numpy and data_prep.doc_stats only.
"""

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data_prep.doc_stats import document_lengths, whole_rows  # noqa: E402

TARGET_ROWS = 64  # context_curve's --rows default (capability copy's is 16): tests check both
COPY_ROWS = 16
MAX_FRACTION = 0.25  # at most this share of the documents goes to validation
MARGIN = 1.25  # the hash split gives about the expected share: aim this much above it
GROWTH = 1.5  # each rerun's fraction at least this many times the last (few reruns)
ADVISE_MAX = 0.5  # a fraction above this is not advised (half the corpus or more not trained on)


def split_counts(data: str) -> dict:
    """``{seq_len, valid_fraction, splits: {split: {rows, whole_rows, documents, short,
    longest, lengths}}}`` of data_prep output ``data`` (``short``: documents of fewer than N
    tokens)."""
    with open(os.path.join(data, "manifest.json"), encoding="utf-8") as f:
        m = json.load(f)
    n, ids, packing = int(m["seq_len"]), m["special_ids"], m.get("packing", "full")
    out = {"seq_len": n, "valid_fraction": float((m.get("split") or {}).get("valid_fraction", 0)),
           "splits": {}}  # fmt: skip
    for split, rec in m["splits"].items():
        shards = rec["shards"]
        lengths = document_lengths(data, shards, packing, ids, n)
        out["splits"][split] = {
            "rows": int(rec["rows"]), "whole_rows": whole_rows(data, shards, ids),
            "documents": int(lengths.size), "short": int((lengths < n).sum()),
            "longest": int(lengths.max()) if lengths.size else 0, "lengths": lengths,
        }  # fmt: skip
    return out


def fraction_for(rows: int, whole_total: int) -> float:
    """The valid fraction expected to hold ``rows`` whole rows out of ``whole_total`` in the
    corpus (with :data:`MARGIN`), rounded up to two significant digits; 1.0 when it cannot."""
    if whole_total <= 0:
        return 1.0
    f = min(1.0, rows / whole_total * MARGIN)
    scale = 10 ** (1 - math.floor(math.log10(f)))
    return min(1.0, math.ceil(f * scale - 1e-9) / scale)


def next_fraction(current: float, valid_whole: int, whole_total: int, rows: int = TARGET_ROWS,
                  cap: float = MAX_FRACTION) -> float | None:  # fmt: skip
    """The ``--valid-fraction`` of the next data_prep run, or None: enough whole valid rows,
    no whole row anywhere (no fraction helps), or ``current`` already at ``cap``. Larger than
    ``current`` by at least :data:`GROWTH` (a run that came out short does not repeat itself)
    and at most ``cap``."""
    if valid_whole >= rows or whole_total <= 0 or current >= cap:
        return None
    return min(cap, max(fraction_for(rows, whole_total), round(current * GROWTH, 4)))


def suggest_seq_len(lengths, seq_len: int) -> int | None:
    """The largest power of two below ``seq_len`` (at least 64) that half the documents reach
    with a token to spare (a row is cls + N - 1 tokens); None when none is."""
    if len(lengths) == 0:
        return None
    median = sorted(int(x) for x in lengths)[len(lengths) // 2]
    p = 1 << max(0, (median + 1).bit_length() - 1)
    while p >= seq_len:
        p //= 2
    return p if p >= 64 else None


def report(c: dict, fixed: bool, rows: int = TARGET_ROWS, cap: float = MAX_FRACTION,
           prog: str = "make_long_corpus") -> tuple[list[str], float | None, int]:  # fmt: skip
    """``(stderr lines, the next --valid-fraction or None, exit code)`` for counts ``c``
    (:func:`split_counts`)."""
    n, splits = c["seq_len"], c["splits"]
    valid = splits.get("valid", {"rows": 0, "whole_rows": 0})
    docs = sum(s["documents"] for s in splits.values())
    short = sum(s["short"] for s in splits.values())
    longest = max((s["longest"] for s in splits.values()), default=0)
    whole_total = sum(s["whole_rows"] for s in splits.values())
    lines = []
    if short == docs and docs:
        alt = suggest_seq_len([x for s in splits.values() for x in s["lengths"]], n)
        fix = f"pass --seq-len {alt} (half the documents reach it) or" if alt else "use"
        lines.append(f"{prog}: warning: all {docs} documents are shorter than N = {n} tokens "
                     f"(the longest has {longest}): no row holds one document, so context_curve "
                     f"and capability copy have nothing to score at N; {fix} longer "
                     "documents")  # fmt: skip
    elif short:
        lines.append(f"{prog}: warning: {short} of {docs} documents ({short / docs:.0%}) are "
                     f"shorter than N = {n} tokens: they never fill a row alone")  # fmt: skip
    frac = c["valid_fraction"]
    lines.append(f"{prog}: valid split (--valid-fraction {frac:g}): {valid['whole_rows']} of "
                 f"{valid['rows']} rows are one document for all N = {n} tokens (context_curve "
                 f"scores up to --rows {rows}, capability copy --rows {COPY_ROWS}); "
                 f"{whole_total} such rows in train and valid")  # fmt: skip
    nxt = None if fixed else next_fraction(frac, valid["whole_rows"], whole_total, rows, cap)
    got = valid["whole_rows"]
    if nxt is not None:
        lines.append(f"{prog}: data_prep again with --valid-fraction {nxt:g} (about "
                     f"{round(nxt * whole_total)} such valid rows expected)")  # fmt: skip
    elif got < rows:
        want = max(fraction_for(rows, whole_total), round(frac * GROWTH, 4))
        if whole_total > got and want <= ADVISE_MAX:
            share = f" ({want:.0%} of the documents: less for training)" if want > cap else ""
            fix = f"rerun with --overwrite --valid-fraction {want:g}{share} for about {rows}"
        else:
            fix = f"the corpus holds {whole_total} in all: a larger corpus gives more"
        score = f", or score the {got} there are (context_curve --rows {got})" if got else ""
        lines.append(f"{prog}: warning: {got} whole valid rows, fewer than --rows {rows}: "
                     f"{fix}{score}")  # fmt: skip
    code = 0
    if got == 0 and nxt is None:
        lines.append(f"{prog}: error: the valid split holds no row of one document of N = {n} "
                     f"tokens: context_curve and capability copy refuse it (see above)")  # fmt: skip
        code = 1
    return lines, nxt, code


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", help="a data_prep output directory")
    ap.add_argument("--fixed", action="store_true", help="the valid fraction was chosen: "
                    "advise, never print a next fraction")  # fmt: skip
    ap.add_argument("--rows", type=int, default=TARGET_ROWS, help="whole valid rows wanted")
    ap.add_argument("--max-fraction", type=float, default=MAX_FRACTION,
                    help="never advise a larger --valid-fraction for a rerun")  # fmt: skip
    args = ap.parse_args(argv)
    try:
        counts = split_counts(args.data)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"make_long_corpus: error: {args.data}: not a readable data_prep output ({e})",
              file=sys.stderr)  # fmt: skip
        return 1
    lines, nxt, code = report(counts, args.fixed, args.rows, args.max_fraction)
    for line in lines:
        print(line, file=sys.stderr)
    if nxt is not None:
        print(f"{nxt:g}")
    return code


if __name__ == "__main__":
    sys.exit(main())
