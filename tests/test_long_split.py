"""scripts/long_split.py and scripts/make_long_corpus.sh's valid split: the whole rows it counts
are the rows the context curve and capability copy score (their own row pickers, on generated
packings), documents shorter than N are counted, a short valid split leads to a data_prep rerun
with a larger --valid-fraction (or to the exact flag to pass) and one with no whole row fails in
one line naming what to do."""

import json
import os
import re
import subprocess
import sys

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from linformer_ds.capability.copy_distance import pick_views
from linformer_ds.context_curve import select_rows
from linformer_ds.data.shards import ShardDataset
from tests.pretrain_utils import REPO, child_env

sys.path.insert(0, str(REPO / "scripts"))
import long_split as ls  # noqa: E402

SPECIAL = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
V = 50
FAST = settings(max_examples=25, deadline=None, derandomize=True)


def pack(docs, n, packing):
    """Rows of ``docs`` (token lists) as data_prep packs them (data_prep/packing.py's layouts,
    written again here): ``full``: the stream of documents each followed by sep, cut into pieces
    of N - 1 after a cls, the last row padded; ``pad``: cls + chunk of at most N - 2 + sep + pad."""
    rows = []
    if packing == "full":
        stream = [t for d in docs for t in list(d) + [SPECIAL["sep"]]]
        for i in range(0, len(stream), n - 1):
            piece = stream[i : i + n - 1]
            rows.append([SPECIAL["cls"]] + piece + [SPECIAL["pad"]] * (n - 1 - len(piece)))
    else:
        for d in docs:
            for i in range(0, len(d), n - 2):
                chunk = list(d[i : i + n - 2])
                rows.append([SPECIAL["cls"]] + chunk + [SPECIAL["sep"]]
                            + [SPECIAL["pad"]] * (n - 2 - len(chunk)))  # fmt: skip
    return np.array(rows, dtype=np.uint16).reshape(-1, n)


def write_data(root, n, packing, docs_by_split, fraction=0.05):
    """A data_prep-like output of the documents of each split (one shard per split)."""
    root.mkdir(parents=True)
    splits = {}
    for split, docs in docs_by_split.items():
        rows = pack(docs, n, packing)
        (root / split).mkdir()
        np.save(root / split / "shard_00000.npy", rows)
        splits[split] = {"shards": [{"file": f"{split}/shard_00000.npy", "rows": len(rows)}],
                         "rows": len(rows)}  # fmt: skip
    manifest = {"format_version": 1, "seq_len": n, "vocab_size": V, "dtype": "uint16",
                "special_ids": SPECIAL, "splits": splits, "packing": packing,
                "split": {"valid_fraction": fraction, "seed": 0}}  # fmt: skip
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def whole_by_alignment(lengths, n):
    """Whole rows of a ``full`` packing from the documents' lengths alone: row r holds stream
    positions [r (N - 1), (r + 1)(N - 1)); it is one document's when that range lies inside a
    document's tokens, or ends with the document's sep at the row's last position."""
    count = 0
    total = sum(length + 1 for length in lengths)
    for r in range(total // (n - 1)):
        lo, hi = r * (n - 1), (r + 1) * (n - 1)  # the row's last position is hi - 1
        pos = 0
        for length in lengths:
            if pos <= lo and hi - 1 <= pos + length:  # tokens pos..pos+length-1, sep at +length
                count += 1
                break
            pos += length + 1
    return count


docs_strategy = st.lists(st.integers(1, 90), min_size=1, max_size=14)


@FAST
@given(n=st.sampled_from([8, 16, 32]), train=docs_strategy, valid=docs_strategy,
       packing=st.sampled_from(["full", "pad"]), seed=st.integers(0, 2**16))  # fmt: skip
def test_whole_rows_are_the_rows_context_curve_and_capability_copy_score(
    tmp_path_factory, n, train, valid, packing, seed
):
    rng = np.random.default_rng(seed)
    docs = {s: [rng.integers(5, V, size=k) for k in lens] for s, lens in
            (("train", train), ("valid", valid))}  # fmt: skip
    data = write_data(tmp_path_factory.mktemp("d") / "data", n, packing, docs)
    c = ls.split_counts(str(data))
    for split, lens in (("train", train), ("valid", valid)):
        got = c["splits"][split]
        ds = ShardDataset(data, split)
        views = pick_views(ds, 10**6, n, isolation=True)  # capability copy's picker
        assert got["whole_rows"] == len(views) == sum(start == 0 for _, start in views)
        # the context curve's picker at W = N: the whole rows that drew a hidden label
        picked = {r.index for r in select_rows(ds, 10**6, n, 0, True)}
        assert picked <= {i for i, _ in views}
        if packing == "full":
            assert got["whole_rows"] == whole_by_alignment(lens, n)
            assert got["documents"] == len(lens)
            assert got["short"] == sum(k < n for k in lens)
            assert got["longest"] == max(lens)


@FAST
@given(current=st.floats(0.001, 0.5), valid=st.integers(0, 200), extra=st.integers(0, 5000),
       rows=st.integers(1, 128))  # fmt: skip
def test_next_fraction_grows_to_the_cap_and_stops_when_enough(current, valid, extra, rows):
    total = valid + extra
    nxt = ls.next_fraction(current, valid, total, rows)
    if valid >= rows or total == 0 or current >= ls.MAX_FRACTION:
        assert nxt is None
    else:
        assert nxt is not None and current < nxt <= ls.MAX_FRACTION
        assert nxt >= min(ls.MAX_FRACTION, round(current * ls.GROWTH, 4))
        # enough whole rows in the corpus: the fraction aims above the share that holds them
        assert nxt == ls.MAX_FRACTION or nxt >= rows / total


def test_row_targets_are_the_tools_defaults():
    from linformer_ds.capability.__main__ import parse_args as capability_args
    from linformer_ds.context_curve import parse_args as curve_args

    assert curve_args(["M", "D"]).rows == ls.TARGET_ROWS
    assert capability_args(["copy", "M", "D"]).rows == ls.COPY_ROWS


@FAST
@given(n=st.sampled_from([16, 32]), lens=st.lists(st.integers(1, 120), min_size=1, max_size=30),
       cut=st.integers(0, 30), fixed=st.booleans())  # fmt: skip
def test_report_counts_short_documents_and_says_what_to_pass(tmp_path_factory, n, lens, cut,
                                                             fixed):  # fmt: skip
    rng = np.random.default_rng(0)
    docs = [rng.integers(5, V, size=k) for k in lens]
    data = write_data(tmp_path_factory.mktemp("d") / "data", n, "full",
                      {"train": docs[cut:] or docs[:1], "valid": docs[:cut]})  # fmt: skip
    c = ls.split_counts(str(data))
    lines, nxt, code = ls.report(c, fixed)
    text = "\n".join(lines)
    all_lens = [*(docs[cut:] or docs[:1]), *docs[:cut]]
    short = sum(len(d) < n for d in all_lens)
    whole_valid = c["splits"]["valid"]["whole_rows"]
    if short == len(all_lens):
        assert f"all {len(all_lens)} documents are shorter than N = {n} tokens" in text
        assert f"the longest has {max(map(len, all_lens))}" in text
    elif short:
        assert f"{short} of {len(all_lens)} documents" in text
    else:
        assert "shorter than N" not in text
    assert f": {whole_valid} of {c['splits']['valid']['rows']} rows are one document" in text
    if fixed:  # a --valid-fraction of the user's: advice only, never a rerun
        assert nxt is None
    assert code == (1 if whole_valid == 0 and nxt is None else 0)
    if code:
        assert lines[-1].startswith("make_long_corpus: error: the valid split holds no row")
    advice = re.search(r"--overwrite --valid-fraction ([0-9.e-]+)", text)
    if advice:  # what to pass: a larger fraction than the one that came out short, never most
        assert c["valid_fraction"] < float(advice.group(1)) <= ls.ADVISE_MAX
        assert whole_valid < ls.TARGET_ROWS
    if whole_valid < ls.TARGET_ROWS and nxt is None:  # says what to pass, or that none helps
        assert advice or "a larger corpus gives more" in text, text


# ============================================================================ the script itself
def _corpus(path, docs, words):
    rng = np.random.default_rng(0)
    letters = list("abcdefghijklmnopqrstuvwxyz")
    vocab = ["".join(rng.choice(letters, size=rng.integers(3, 8))) for _ in range(400)]
    with open(path, "w") as f:
        for _ in range(docs):
            f.write(json.dumps({"text": " ".join(rng.choice(vocab, size=words))}) + "\n")


def _script(out, *args):
    env = {**child_env(), "VIRTUAL_ENV": os.environ.get("VIRTUAL_ENV") or sys.prefix}
    env["PATH"] = f"{os.path.dirname(sys.executable)}:{env.get('PATH', '')}"
    return subprocess.run(["bash", str(REPO / "scripts" / "make_long_corpus.sh"), str(out), *args,
                           "--seq-len", "32", "--vocab-size", "120", "--workers", "0"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip


def test_script_reruns_data_prep_until_the_valid_split_holds_whole_rows(tmp_path):
    """80 documents of ~2-3 rows each: 0.05 gives a handful of whole valid rows; the script
    runs data_prep again with the fraction the corpus's whole rows call for, and the valid
    split then holds the target (counted by capability copy's own picker)."""
    _corpus(tmp_path / "docs.jsonl", 80, 60)
    r = _script(tmp_path / "long", "--source", str(tmp_path / "docs.jsonl"), "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    data = tmp_path / "long" / "data"
    fraction = json.loads((data / "manifest.json").read_text())["split"]["valid_fraction"]
    assert "data_prep again with --valid-fraction" in r.stderr and fraction > 0.05, r.stderr
    views = pick_views(ShardDataset(data, "valid"), 10**6, 32, isolation=True)
    assert len(views) >= ls.TARGET_ROWS or fraction == ls.MAX_FRACTION, (len(views), r.stderr)
    assert f": {len(views)} of " in r.stderr.strip().splitlines()[-1]


def test_script_fails_in_one_line_when_every_document_is_shorter_than_n(tmp_path):
    _corpus(tmp_path / "docs.jsonl", 40, 3)
    r = _script(tmp_path / "short", "--source", str(tmp_path / "docs.jsonl"), "--quiet",
                "--valid-fraction", "0.2")  # fmt: skip
    assert r.returncode == 1, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert re.search(r"warning: all 40 documents are shorter than N = 32 tokens", r.stderr)
    assert lines[-1].startswith("make_long_corpus: error: the valid split holds no row")
    assert "Traceback" not in r.stderr
    # --valid-fraction given: kept (no rerun)
    m = json.loads((tmp_path / "short" / "data" / "manifest.json").read_text())
    assert m["split"]["valid_fraction"] == 0.2 and "data_prep again" not in r.stderr
