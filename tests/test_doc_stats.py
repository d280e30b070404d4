"""data_prep's documents-in-rows figures (data_prep/doc_stats.py): the share of rows holding a
single document and the document length distribution, against counts made here from the
documents themselves (SentencePiece run directly, the packing redone token by token)."""

import numpy as np
import pytest
import sentencepiece as spm

from data_prep.doc_stats import CHUNK_ROWS, length_summary, split_documents
from data_prep.packing import assign_split
from tests.test_data_prep import encode_doc, make_docs, run, write_text_corpus

N = 32


def expected(docs, model, split):
    sp = spm.SentencePieceProcessor(model_file=model)
    return [ids for ids in (encode_doc(sp, d) for d in docs if assign_split(d, 0.2, 0) == split)
            if ids]  # fmt: skip


def single_rows_full(doc_ids):
    """Rows of ``full`` packing, each token tagged with its document: rows whose content tokens
    all come from one document."""
    owner = [i for i, ids in enumerate(doc_ids) for _ in ids + [None]]  # (the sep: its document)
    is_sep = [j == len(ids) for ids in doc_ids for j in range(len(ids) + 1)]
    rows = [range(s, min(s + N - 1, len(owner))) for s in range(0, len(owner), N - 1)]
    single = sum(len({owner[t] for t in r if not is_sep[t]}) == 1 for r in rows)
    return single, len(rows)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("docstats")
    docs = make_docs(30, seed=3)
    return tmp, docs, write_text_corpus(tmp / "text", docs)


@pytest.fixture(scope="module")
def full_run(corpus):
    """The corpus prepared with ``full`` packing (its tokenizer serves the ``pad`` run too)."""
    tmp, _, text = corpus
    return run(tmp, "full", [str(text)])


def test_full_packing_counts(corpus, full_run):
    tmp, docs, _ = corpus
    m = full_run
    for split in ("train", "valid"):
        doc_ids = expected(docs, str(tmp / "full" / "tokenizer.model"), split)
        rec = m["splits"][split]["documents_in_rows"]
        lengths = np.array([len(ids) for ids in doc_ids])
        d = rec["document_tokens"]
        assert d["documents"] == len(doc_ids) == m["splits"][split]["documents"]
        assert (d["min"], d["max"]) == (lengths.min(), lengths.max())
        assert d["median"] == pytest.approx(float(np.median(lengths)))
        assert d["p90"] == pytest.approx(float(np.percentile(lengths, 90)))
        single, rows = single_rows_full(doc_ids)
        assert rec["rows"] == rows == m["splits"][split]["rows"]
        assert rec["single_document_rows"] == single
        assert rec["single_document_share"] == pytest.approx(single / rows)
    assert 0 < m["splits"]["train"]["documents_in_rows"]["single_document_share"] < 1


def test_pad_packing_counts(corpus, full_run):  # full_run: its tokenizer
    tmp, docs, text = corpus
    m = run(tmp, "pad", [str(text)], packing="pad", tokenizer=str(tmp / "full" / "tokenizer.model"))
    for split in ("train", "valid"):
        doc_ids = expected(docs, str(tmp / "full" / "tokenizer.model"), split)
        lengths, carry = [], 0
        for n in (len(ids) for ids in doc_ids):  # the documented rule: a document of an exact
            carry += n  # multiple of N - 2 tokens ends in a full row, counted with the next
            if n % (N - 2):
                lengths, carry = lengths + [carry], 0
        lengths += [carry] if carry else []
        rec = m["splits"][split]["documents_in_rows"]
        assert rec["single_document_share"] == 1.0
        assert rec["rows"] == sum(-(-len(ids) // (N - 2)) for ids in doc_ids)
        assert rec["document_tokens"] == length_summary(np.array(lengths))


def test_documents_across_read_chunks(tmp_path, monkeypatch):
    """A document that spans a chunk boundary of the reader is one document."""
    import data_prep.doc_stats as ds

    monkeypatch.setattr(ds, "CHUNK_ROWS", 2)
    assert CHUNK_ROWS > 2
    rng = np.random.default_rng(0)
    lengths = [5, 70, 3, 40, 1, 100]
    stream = [t for n in lengths for t in rng.integers(5, 50, size=n).tolist() + [3]]
    stream += [0] * (-len(stream) % (N - 1))
    rows = np.array([[2] + stream[i : i + N - 1] for i in range(0, len(stream), N - 1)])
    np.save(tmp_path / "s.npy", rows.astype(np.uint16))
    rec = split_documents(str(tmp_path), [{"file": "s.npy"}], "full",
                          {"cls": 2, "sep": 3, "pad": 0}, N)  # fmt: skip
    assert rec["document_tokens"] == length_summary(np.array(lengths))
    assert rec["rows"] == len(rows)
