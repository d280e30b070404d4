"""What fixes an empty split of a data_prep output: data_prep's refusal and the trainer's message
for an empty split give the same advice, from the numbers the manifest records. Standard library
only (data_prep imports it)."""

import math

# the documents a split should get on average for the advice to (almost) never leave it empty:
# P(none of n documents lands in a split of share p) = (1 - p) ** n, about exp(-TARGET_DOCS)
TARGET_DOCS = 10
MIN_DOC_BYTES = 4096  # a smaller --max-doc-bytes would cut documents into scraps: more text instead


def _size(n: float) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n:.0f} bytes"


def empty_split_fix(
    split: str, documents: int, corpus_bytes: int, max_doc_bytes: int, valid_fraction: float
) -> str:
    """Why ``split`` ("train" or "valid") got no document, and the data_prep flag that fixes it.

    ``documents``: the corpus's documents with text (after the ``max_doc_bytes`` cut),
    ``corpus_bytes``: its size. Few huge documents (one big file is cut at ``--max-doc-bytes``):
    a smaller ``--max-doc-bytes`` that makes about ``TARGET_DOCS`` documents for the split; few
    small documents: a ``--valid-fraction`` that gives the split its share, else a larger corpus.
    """
    vf = float(valid_fraction)
    if split != "train" and vf <= 0:
        return ("data_prep ran with --valid-fraction 0 (no valid split); rerun it with "
                "--valid-fraction 0.01, or set train.eval_interval=0 (no evaluation)")  # fmt: skip
    share = vf if split != "train" else 1.0 - vf
    docs = max(int(documents), 0)
    mean = corpus_bytes / docs if docs else 0.0
    what = (f"{docs} document{'s' if docs != 1 else ''} ({_size(mean)} each on average) at "
            f"--valid-fraction {vf:g} put none in {split}")  # fmt: skip
    want_bytes = corpus_bytes * share / TARGET_DOCS  # a document size giving TARGET_DOCS there
    cut = 1 << int(math.log2(want_bytes)) if want_bytes >= 1 else 0
    if MIN_DOC_BYTES <= cut < min(max_doc_bytes, mean):
        n = corpus_bytes // cut
        return (
            f"{what}; rerun data_prep with --max-doc-bytes {cut} (documents cut at "
            f"{_size(cut)}: about {n}, {n * share:.0f} in {split}; now {max_doc_bytes})"
        )
    if split == "train":
        lower = min(vf / 2, 0.01)
        return (f"{what}; rerun data_prep with a lower --valid-fraction (e.g. {lower:g}) or on "
                "a corpus with more documents")  # fmt: skip
    need = TARGET_DOCS / max(docs, 1)
    if need <= 0.5:
        better = float(f"{need:.2g}")
        return (f"{what}; rerun data_prep with --valid-fraction {better:g} (about "
                f"{TARGET_DOCS} of the {docs} documents in valid)")  # fmt: skip
    return (f"{what}; rerun data_prep on a corpus with more documents (or with "
            "--valid-fraction 0 and train.eval_interval=0: no evaluation)")  # fmt: skip
