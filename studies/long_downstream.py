"""Downstream score that needs long context (issue 44 item 7): "same document?" at N = 4,096.

python studies/long_downstream.py build --corpus data/long/text/long.jsonl \\
    --tokenizer data/long/data/tokenizer.model --out runs/long_downstream/task
python studies/long_downstream.py run --task runs/long_downstream/task \\
    --work runs/long_downstream --report-dir docs/quality_study/long_4096/downstream \\
    --models dense_s0 linear_mixer_s0 local_linear_mixer_s0 --untrained local_linear_mixer

``build``: from a corpus of long documents (JSONL, ``text`` and optionally ``source``, as
scripts/make_long_corpus.sh writes it) a binary task. A *span* of a document is, in its
whitespace-separated words (whitespace normalised to one space), a first part P of at most
``--first-tokens`` (1,900) tokens, then a gap of more than ``--gap-tokens`` (512) tokens that
no row shows, then a passage Q of at most ``--passage-tokens`` (2,100) tokens; a document gives
up to ``--spans-per-doc`` consecutive spans, the first at its start. A row is
``P </s> Q`` (finetune adds ``<s>`` ... ``</s>``: at most 1,900 + 2,100 + 3 = 4,003 tokens):
label 1 when Q is the passage of P's own span, 0 when it is the passage of a span of another
document B of the same package (``source``'s part before ``:``; one group when there is no
``source``). Rows come in quads: two spans (P_A, Q_A) and (P_B, Q_B) of different documents give
``P_A Q_A`` -> 1, ``P_B Q_B`` -> 1, ``P_A Q_B`` -> 0, ``P_B Q_A`` -> 0, so every P and every Q
occurs once with each label: neither part alone says anything about the label, only the two
together do. Documents are split (seeded, per package, ``--test-fraction`` of them, at least
two a side) before any span is made: no document has rows in both splits.

Controls (same rows, same labels, same order): ``tail512``: each row's last ``--control-tokens``
(512) tokens as finetune feeds them: the longest word-aligned tail of Q of at most 510 tokens,
plus ``<s>`` and ``</s>``; it is exactly the suffix of the full row's tokens (the tokenizer cuts
at whitespace). Since every Q occurs once with each label, any classifier of the tail scores
exactly 0.5 on a quad-complete test set: the task cannot be solved from the last 512 tokens.
``sep512``: 512 tokens around the separator (the last 254 tokens of P, ``</s>``, the first 254 of
Q): what a 512-token window *can* exploit, namely whether the text just before and just after
the separator share a topic (vocabulary of a kernel subsystem, of a Python chapter). The
full-row score minus the sep512 score is what the model gains from text more than 256 tokens
away from the separator.

The junction is a shortcut: with P and Q adjacent, a 512-token window across the separator
sees P's end and Q's start, and on long.jsonl their word overlap alone (tf-idf cosine, no
model) scores about as well on sep512 (0.84 on 188 test rows) as on whole rows (0.83): a local
model can solve most of it without long context. ``--filler-tokens C`` closes it: rows
``P </s> F </s> Q`` with F the first C tokens of a third document of the package (one F per
quad, so it says nothing about the label; e.g. ``--first-tokens 1300 --filler-tokens 600``);
then no window of 512 tokens holds text of both P and Q, and sep512 is the window around the
first separator (P's end and F's start), again exactly 0.5 at best.

``build`` writes train.jsonl / test.jsonl (``text``, ``label``, and where each part comes from),
train_tail512.jsonl, test_tail512.jsonl, train_sep512.jsonl, test_sep512.jsonl and task.json
(counts, documents per split, the layout, the majority baseline). Rows are written quad by quad
(quads in seeded random order), so any prefix of 4k rows is balanced and quad-complete:
``run --train-limit/--test-limit`` take such prefixes.

``run``: for each ``--models`` run directory (``--runs-root``/NAME/checkpoints) and an untrained
model of ``--untrained`` (one optimizer step at lr 1e-12 from the study config of
``--runs-root``/VARIANT_s0), launch/export.py, then launch/finetune.py on each view (``full``
at --max-length 4,096, ``tail512`` and ``sep512`` at 512; test split as validation). Results
already in ``--work`` are reused (so a run can be extended model by model); writes
downstream.json and downstream.md to ``--report-dir``.
"""

import argparse
import collections
import hashlib
import json
import math
import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SEP = "</s>"  # the tokenizer's sep piece: export tokenizers map it to the sep id (3)
VIEWS = ("full", "tail512", "sep512")
# words holding a special piece are dropped (the export's tokenizer would read them as specials)
SPECIAL_PIECES = ("<s>", "</s>", "<pad>", "<unk>", "<mask>")


# ======================================================================================== build
def group_of(rec: dict[str, Any]) -> str:
    """The package a document belongs to: ``source`` up to ``:`` (``"all"`` without one)."""
    src = rec.get("source")
    return str(src).split(":", 1)[0] if src else "all"


def split_documents(
    groups: dict[str, list[int]], fraction: float, seed: int, least: int = 2
) -> dict[int, str]:
    """``{document index: "train" | "test"}``: per group a seeded ``fraction`` of its documents
    (at least ``least``, leaving at least ``least``: two for pairs, three with a filler) are
    test documents; a group of fewer than 2 x ``least`` documents stays in train."""
    rng = random.Random(f"split:{seed}")
    side: dict[int, str] = {}
    for g in sorted(groups):
        docs = sorted(groups[g])
        rng.shuffle(docs)
        n = len(docs)
        n_test = 0 if n < 2 * least else min(n - least, max(least, round(fraction * n)))
        for i, d in enumerate(docs):
            side[d] = "test" if i < n_test else "train"
    return side


def take_tokens(lens: Sequence[int], start: int, budget: int) -> int:
    """End (exclusive) of the longest run of words from ``start`` whose tokens fit ``budget``."""
    end, used = start, 0
    while end < len(lens) and used + lens[end] <= budget:
        used += lens[end]
        end += 1
    return end


def word_lengths(sp: Any, words: list[str]) -> list[int]:
    """Tokens of each word (the tokenizer splits at whitespace, so a text's tokens are the sum
    of its words' tokens; :func:`build` checks this on every part it writes)."""
    return [len(ids) for ids in sp.encode(words)] if words else []


def doc_spans(
    words: list[str], lens: list[int], first: int, gap: int, passage: int, max_spans: int
) -> list[dict[str, int]]:
    """Up to ``max_spans`` consecutive spans (word indices): P = [p0, p1), gap [p1, q0) of more
    than ``gap`` tokens, Q = [q0, q1). A part is kept only when it fills its budget to within
    64 tokens (a very long "word" could leave it short)."""
    spans: list[dict[str, int]] = []
    s = 0
    while len(spans) < max_spans and s < len(words):
        p1 = take_tokens(lens, s, first)
        q0, used = p1, 0
        while q0 < len(words) and used <= gap:
            used += lens[q0]
            q0 += 1
        q1 = take_tokens(lens, q0, passage)
        pt, qt = sum(lens[s:p1]), sum(lens[q0:q1])
        if used <= gap or (q1 >= len(words) and qt < passage - 64):
            break
        if pt >= first - 64 and qt >= passage - 64:
            spans.append(
                {
                    "p0": s,
                    "p1": p1,
                    "q0": q0,
                    "q1": q1,
                    "p_tokens": pt,
                    "gap_tokens": used,
                    "q_tokens": qt,
                }
            )
        s = max(q1, s + 1)
    return spans


def tail_start(lens: Sequence[int], q0: int, q1: int, budget: int) -> int:
    """Start of the longest word-aligned tail of words [q0, q1) within ``budget`` tokens."""
    start, used = q1, 0
    while start > q0 and used + lens[start - 1] <= budget:
        start -= 1
        used += lens[start]
    return start


def encode_row(sp: Any, text: str) -> list[int]:
    """The ids finetune's tokenizer gives ``text``: ``<s>``, the parts between ``</s>`` pieces
    as SentencePiece encodes them, separated by the sep id, ``</s>``."""
    sep = sp.piece_to_id(SEP)
    ids = [sp.piece_to_id("<s>")]
    for i, part in enumerate(text.split(f" {SEP} ")):
        ids += ([sep] if i else []) + sp.encode(part)
    return ids + [sep]


def pair_spans(spans: list[tuple[int, int]], rng: random.Random) -> list[tuple[Any, Any]]:
    """Spans ``(doc, k)`` paired with a span of another document (seeded, greedy)."""
    pool = list(spans)
    rng.shuffle(pool)
    pairs = []
    while pool:
        a = pool.pop(0)
        j = next((j for j, b in enumerate(pool) if b[0] != a[0]), None)
        if j is None:
            continue
        pairs.append((a, pool.pop(j)))
    return pairs


def build(
    corpus: Path,
    tokenizer: Path,
    out: Path,
    n_train: int = 400,
    n_test: int = 200,
    test_fraction: float = 0.2,
    seed: int = 0,
    first_tokens: int = 1900,
    gap_tokens: int = 512,
    passage_tokens: int = 2100,
    spans_per_doc: int = 4,
    control_tokens: int = 512,
    filler_tokens: int = 0,
) -> dict[str, Any]:
    """Write the task (see the module docstring) under ``out``; returns task.json's dict."""
    import sentencepiece as spm

    if n_train % 4 or n_test % 4:
        raise ValueError("--train-examples and --test-examples must be multiples of 4 (quads)")
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer))
    docs: list[dict[str, Any]] = []
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                docs.append(
                    {
                        "source": rec.get("source") or f"doc{len(docs)}",
                        "group": group_of(rec),
                        "text": rec["text"],
                    }
                )
    groups: dict[str, list[int]] = {}
    for i, d in enumerate(docs):
        groups.setdefault(d["group"], []).append(i)
    side = split_documents(groups, test_fraction, seed, 3 if filler_tokens else 2)
    # only the words the spans can use are tokenized (documents run to 1.3M characters)
    need = spans_per_doc * (first_tokens + gap_tokens + passage_tokens + 64)
    spans: dict[str, dict[str, list[tuple[int, int]]]] = {"train": {}, "test": {}}
    for i, d in enumerate(docs):
        words = [w for w in d["text"].split() if not any(s in w for s in SPECIAL_PIECES)]
        lens: list[int] = []
        while len(lens) < len(words) and sum(lens) < need:
            lens += word_lengths(sp, words[len(lens) : len(lens) + 4096])
        d["words"], d["lens"] = words[: len(lens)], lens
        d["spans"] = doc_spans(
            d["words"], lens, first_tokens, gap_tokens, passage_tokens, spans_per_doc
        )
        for k in range(len(d["spans"])):
            spans[side[i]].setdefault(d["group"], []).append((i, k))
    rng = random.Random(f"rows:{seed}")
    out.mkdir(parents=True, exist_ok=True)
    half = (control_tokens - 3) // 2  # sep512: <s> P-tail </s> Q-head </s>
    counts: dict[str, Any] = {}
    for split, n in (("train", n_train), ("test", n_test)):
        pairs = [p for g in sorted(spans[split]) for p in pair_spans(spans[split][g], rng)]
        rng.shuffle(pairs)
        if len(pairs) < n // 4:
            print(
                f"[build] {split}: only {len(pairs)} quads ({4 * len(pairs)} rows) of "
                f"{n // 4} asked",
                file=sys.stderr,
            )
        rows: dict[str, list[dict[str, Any]]] = {v: [] for v in VIEWS}
        filler_rng = random.Random(f"filler:{seed}:{split}")
        for qi, (a, b) in enumerate(pairs[: n // 4]):
            quad = [(a, a, 1), (b, b, 1), (a, b, 0), (b, a, 0)]
            rng.shuffle(quad)
            c_text, c_tokens, c_doc, c_head, c_head_tokens = "", 0, None, "", 0
            if filler_tokens:  # one filler for the quad: a third document of the group
                g = docs[a[0]]["group"]
                others = [x for x in spans[split][g] if x[0] not in (a[0], b[0])]
                if not others:
                    raise RuntimeError(f"{split}: no third document in {g} for a filler")
                cd, ck = filler_rng.choice(others)
                C, sc = docs[cd], docs[cd]["spans"][ck]
                c1 = take_tokens(C["lens"], sc["p0"], filler_tokens)
                c_text, c_doc = " ".join(C["words"][sc["p0"] : c1]), C["source"]
                c_tokens = sum(C["lens"][sc["p0"] : c1])
                h = take_tokens(C["lens"], sc["p0"], half)
                c_head, c_head_tokens = (
                    " ".join(C["words"][sc["p0"] : h]),
                    sum(C["lens"][sc["p0"] : h]),
                )
            for (fd, fk), (pd, pk), label in quad:
                A, B = docs[fd], docs[pd]
                sa, sb = A["spans"][fk], B["spans"][pk]
                p_text = " ".join(A["words"][sa["p0"] : sa["p1"]])
                q_text = " ".join(B["words"][sb["q0"] : sb["q1"]])
                if filler_tokens:
                    q_text = f"{c_text} {SEP} {q_text}"
                t0 = tail_start(B["lens"], sb["q0"], sb["q1"], control_tokens - 2)
                h1 = take_tokens(B["lens"], sb["q0"], half)
                p_t0 = tail_start(A["lens"], sa["p0"], sa["p1"], half)
                meta = {
                    "label": label,
                    "quad": qi,
                    "first_doc": A["source"],
                    "passage_doc": B["source"],
                    "group": A["group"],
                    "first_words": [sa["p0"], sa["p1"]],
                    "passage_words": [sb["q0"], sb["q1"]],
                    "tokens": 3 + sa["p_tokens"] + sb["q_tokens"] + (c_tokens + 1 if c_text else 0),
                }
                if filler_tokens:
                    meta.update(filler_doc=c_doc, filler_tokens=c_tokens)
                rows["full"].append({"text": f"{p_text} {SEP} {q_text}", **meta})
                rows["tail512"].append(
                    {
                        "text": " ".join(B["words"][t0 : sb["q1"]]),
                        "label": label,
                        "quad": qi,
                        "tokens": 2 + sum(B["lens"][t0 : sb["q1"]]),
                    }
                )
                # the window around (the first) separator: P's end and what follows it in the row
                sep_text = " ".join(A["words"][p_t0 : sa["p1"]]) + f" {SEP} "
                sep_tokens = 3 + sum(A["lens"][p_t0 : sa["p1"]])
                if filler_tokens:
                    sep_text, sep_tokens = sep_text + c_head, sep_tokens + c_head_tokens
                else:
                    sep_text += " ".join(B["words"][sb["q0"] : h1])
                    sep_tokens += sum(B["lens"][sb["q0"] : h1])
                rows["sep512"].append(
                    {"text": sep_text, "label": label, "quad": qi, "tokens": sep_tokens}
                )
        for view, rs in rows.items():
            for r in rs:  # the word-sum token count is the tokenizer's (whitespace cuts)
                got = len(encode_row(sp, r["text"]))
                if got != r["tokens"]:
                    raise RuntimeError(
                        f"{split} {view} row of quad {r['quad']}: {got} tokens, "
                        f"expected {r['tokens']} (tokenizer crosses whitespace?)"
                    )
            name = split if view == "full" else f"{split}_{view}"
            with open(out / f"{name}.jsonl", "w", encoding="utf-8") as f:
                for r in rs:
                    f.write(json.dumps(r) + "\n")
        full = rows["full"]
        counts[split] = {
            "examples": len(full),
            "label_1": sum(r["label"] for r in full),
            "label_0": sum(1 - r["label"] for r in full),
            "documents": len({i for i in range(len(docs)) if side[i] == split}),
            "documents_with_spans": len({r["first_doc"] for r in full}),
            "spans_available": sum(len(v) for v in spans[split].values()),
            "groups": {g: sum(r["group"] == g for r in full) for g in sorted(groups)},
            "tokens_min": min((r["tokens"] for r in full), default=0),
            "tokens_max": max((r["tokens"] for r in full), default=0),
            "tail512_tokens_max": max((r["tokens"] for r in rows["tail512"]), default=0),
            "sep512_tokens_max": max((r["tokens"] for r in rows["sep512"]), default=0),
        }
    c_tr, c_te = counts["train"], counts["test"]
    major = 1 if c_tr["label_1"] >= c_tr["label_0"] else 0
    task = {
        "task": "same document? (P </s> [F </s>] Q: is passage Q from the document of first "
        "part P; F a filler of a third document)",
        "corpus": str(corpus),
        "tokenizer": str(tokenizer),
        "tokenizer_sha256": hashlib.sha256(tokenizer.read_bytes()).hexdigest(),
        "seed": seed,
        "test_fraction": test_fraction,
        "layout": {
            "first_tokens": first_tokens,
            "gap_tokens_more_than": gap_tokens,
            "passage_tokens": passage_tokens,
            "spans_per_doc": spans_per_doc,
            "control_tokens": control_tokens,
            "sep512_half": half,
            "filler_tokens": filler_tokens,
            "negatives": "passage of a span of another document of the same package",
            "design": "quads: every P and every Q once with each label",
        },
        "out": str(out),
        "asked": {"train": n_train, "test": n_test},
        "examples": counts,
        "majority_class": major,
        "majority_baseline_test_accuracy": (c_te[f"label_{major}"] / c_te["examples"])
        if c_te["examples"]
        else None,
        "tail512_ceiling": "0.5 on a quad-complete test set: every tail occurs once per label",
    }
    (out / "task.json").write_text(json.dumps(task, indent=1) + "\n")
    return task


# ========================================================================================== run
def _run(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> int:
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        return subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env).returncode


def untrained_checkpoint(variant: str, args: argparse.Namespace, log: Path) -> Path:
    """One optimizer step at lr 1e-12 (rows of 128) from the study config of ``variant``'s
    seed-0 run: an untrained model of that architecture that export.py reads."""
    run = Path(args.work) / f"untrained_{variant}"
    ckpt = run / "checkpoints"
    if (ckpt / "latest").is_file():
        return ckpt
    cfg = Path(args.runs_root) / f"{variant}_s0" / "study_config.yaml"
    if not cfg.is_file():
        raise RuntimeError(f"untrained {variant}: no {cfg}")
    cmd = [
        sys.executable,
        "launch/pretrain.py",
        "--config",
        str(cfg),
        f"logging.dir={run}",
        "train.max_steps=1",
        "train.stages=[{end_step: 1, sources: [long128], micro_batch_size: 4}]",
        "optimizer.lr=1e-12",
        "scheduler.warmup_steps=0",
        "train.eval_interval=0",
        "checkpoint.resume=never",
        f"name=untrained_{variant}",
    ]
    if _run(cmd, log, dict(os.environ, DS_ACCELERATOR="cpu")) != 0:
        raise RuntimeError(f"untrained {variant}: pretrain failed, see {log}")
    return ckpt


def subset(task: Path, work: Path, split: str, view: str, limit: int | None) -> Path:
    """The task file of ``split``/``view``, cut to its first ``limit`` rows (whole quads)."""
    name = split if view == "full" else f"{split}_{view}"
    src = task / f"{name}.jsonl"
    if not limit:
        return src
    if limit % 4:
        raise ValueError("--train-limit / --test-limit must be multiples of 4 (quads)")
    dst = work / "task_subset" / f"{name}_{limit}.jsonl"
    dst.parent.mkdir(parents=True, exist_ok=True)
    lines = src.read_text().splitlines()[:limit]
    dst.write_text("\n".join(lines) + "\n")
    return dst


def check_lengths(export: Path, files: dict[str, tuple[Path, int]]) -> dict[str, int]:
    """Longest row of each file in the export's own tokenizer; refuses a row that finetune
    would truncate (the comparison would silently lose its passage's end)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(export), trust_remote_code=True)
    longest = {}
    for name, (path, limit) in files.items():
        texts = [json.loads(line)["text"] for line in path.read_text().splitlines()]
        n = max(len(ids) for ids in tok(texts)["input_ids"])
        if n > limit:
            raise RuntimeError(f"{path}: a row of {n} tokens exceeds --max-length {limit}")
        longest[name] = n
    return longest


def finetune_view(
    export: Path,
    name: str,
    view: str,
    files: tuple[Path, Path],
    args: argparse.Namespace,
    log: Path,
) -> dict[str, Any] | None:
    """launch/finetune.py of ``export`` on one view; its results (None on failure)."""
    ft = Path(args.work) / "finetuned" / name / view
    res_path = ft / "finetune_results.json"
    if res_path.is_file():
        return json.loads(res_path.read_text())
    max_length = args.max_length if view == "full" else args.control_tokens
    cmd = [
        sys.executable,
        "launch/finetune.py",
        "--model",
        str(export),
        "--train",
        str(files[0]),
        "--validation",
        str(files[1]),
        "--max-length",
        str(max_length),
        "--epochs",
        str(args.epochs),
        "--batch-size",
        str(args.batch_size),
        "--eval-batch-size",
        str(args.eval_batch_size),
        "--seed",
        str(args.seed),
        "--out",
        str(ft),
        "--overwrite",
    ]
    if args.lr is not None:
        cmd += ["--lr", str(args.lr)]
    t0 = time.perf_counter()
    if _run(cmd, log) != 0:
        return None
    res = json.loads(res_path.read_text())
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    res_path.write_text(json.dumps(res, indent=1))
    return res


def lexical_baseline(train: Path, test: Path) -> dict[str, Any] | None:
    """No model: the tf-idf cosine of P's and Q's words (idf from the train rows' parts), label
    1 at or above the threshold that is best on train. How far word overlap alone goes on the
    rows (None for a view without a separator: tail512 holds Q alone)."""

    def parts(path: Path) -> list[tuple[collections.Counter, collections.Counter, int]]:
        out = []
        for line in path.read_text().splitlines():
            r = json.loads(line)
            halves = r["text"].split(f" {SEP} ")
            if len(halves) < 2:
                return []
            halves = [halves[0], halves[-1]]  # P and Q (a filler between them is left out)
            bags = [collections.Counter(re.findall(r"\w+", h.lower())) for h in halves]
            out.append((bags[0], bags[1], int(r["label"])))
        return out

    tr, te = parts(train), parts(test)
    if not tr or not te:
        return None
    df: collections.Counter = collections.Counter()
    for p, q, _ in tr:
        df.update(set(p))
        df.update(set(q))
    n_docs = 2 * len(tr)

    def cosine(p: collections.Counter, q: collections.Counter) -> float:
        w = {t: math.log((1 + n_docs) / (1 + df[t])) + 1 for t in set(p) | set(q)}
        dot = sum(p[t] * q[t] * w[t] ** 2 for t in set(p) & set(q))
        norm = math.sqrt(sum((c * w[t]) ** 2 for t, c in p.items()))
        norm *= math.sqrt(sum((c * w[t]) ** 2 for t, c in q.items()))
        return dot / norm if norm else 0.0

    s_tr = [(cosine(p, q), y) for p, q, y in tr]
    cands = sorted({s for s, _ in s_tr})
    best = max(cands, key=lambda t: sum((s >= t) == bool(y) for s, y in s_tr))
    acc_tr = sum((s >= best) == bool(y) for s, y in s_tr) / len(s_tr)
    acc_te = sum((cosine(p, q) >= best) == bool(y) for p, q, y in te) / len(te)
    return {
        "test_accuracy": acc_te,
        "n_test": len(te),
        "n_train": len(tr),
        "train_accuracy": acc_tr,
        "threshold": best,
    }


def wilson(acc: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson interval of an accuracy on ``n`` examples."""
    if n == 0:
        return (0.0, 1.0)
    d = 1 + z * z / n
    c = (acc + z * z / (2 * n)) / d
    h = z * math.sqrt(acc * (1 - acc) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))


def run(args: argparse.Namespace) -> int:
    """Export + fine-tune each model on each view; write downstream.json / downstream.md."""
    task, work = Path(args.task), Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    log = work / "downstream.log"
    info = json.loads((task / "task.json").read_text())
    jobs: list[tuple[str, str | None]] = [(m, None) for m in args.models]
    jobs += [(f"untrained_{v}", v) for v in args.untrained]
    views = [v for v in VIEWS if v in args.views]
    files = {
        v: (
            subset(task, work, "train", v, args.train_limit),
            subset(task, work, "test", v, args.test_limit),
        )
        for v in views
    }
    rows: list[dict[str, Any]] = []
    checked: dict[str, int] | None = None
    for name, untrained in jobs:
        if untrained:
            try:
                ckpt = untrained_checkpoint(untrained, args, log)
            except RuntimeError as e:
                rows.append({"run": name, "error": str(e)})
                continue
        else:
            ckpt = Path(args.runs_root) / name / "checkpoints"
        if not (ckpt / "latest").is_file():
            print(f"[downstream] {name}: no checkpoint at {ckpt}; skipped", flush=True)
            continue
        export = work / "exports" / name
        if not (export / "config.json").is_file():
            cmd = [
                sys.executable,
                "launch/export.py",
                "--checkpoint",
                str(ckpt),
                "--out",
                str(export),
                "--overwrite",
            ]
            if _run(cmd, log) != 0:
                rows.append({"run": name, "error": "export failed"})
                continue
        if checked is None:
            limits = {
                "full": args.max_length,
                "tail512": args.control_tokens,
                "sep512": args.control_tokens,
            }
            checked = check_lengths(
                export,
                {
                    f"{s}_{v}": (files[v][i], limits[v])
                    for v in views
                    for i, s in enumerate(("train", "test"))
                },
            )
        model_cfg = json.loads((export / "config.json").read_text())
        row: dict[str, Any] = {
            "run": name,
            "pretrained": untrained is None,
            "projection": model_cfg.get("projection"),
            "local_window": model_cfg.get("local_window"),
            "local_mixer": model_cfg.get("local_mixer"),
        }
        for view in views:
            print(f"[downstream] {name} {view}", flush=True)
            res = finetune_view(export, name, view, files[view], args, log)
            row[view] = (
                None
                if res is None
                else {
                    "test_accuracy": res["val_accuracy"],
                    "n_test": res["num_validation"],
                    "n_train": res["num_train"],
                    "wall_s": res.get("wall_s"),
                    "history": res.get("history"),
                    "lr": res.get("lr"),
                }
            )
            acc = None if res is None else res["val_accuracy"]
            print(
                f"[downstream] {name} {view}: {acc} ({row[view] and row[view]['wall_s']} s)",
                flush=True,
            )
        rows.append(row)
    out = Path(args.report_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = {
        k: getattr(args, k)
        for k in (
            "max_length",
            "control_tokens",
            "epochs",
            "batch_size",
            "eval_batch_size",
            "seed",
            "lr",
            "train_limit",
            "test_limit",
        )
    }
    command = list(getattr(args, "argv", None) or sys.argv[1:])
    lexical = {}
    for label, limits in (("used rows", True), ("all rows", False)):
        for view in views:
            tr = files[view][0] if limits else subset(task, work, "train", view, None)
            te = files[view][1] if limits else subset(task, work, "test", view, None)
            lexical.setdefault(label, {})[view] = lexical_baseline(tr, te)
    doc = {
        "task": info,
        "finetune": settings,
        "command": command,
        "longest_rows": checked,
        "rows": rows,
        "lexical_baseline": lexical,
    }
    (out / "downstream.json").write_text(json.dumps(doc, indent=1) + "\n")
    md = report_md(
        info, settings, rows, views, command[1:] if command[:1] == ["run"] else command, lexical
    )
    (out / "downstream.md").write_text(md)
    print(md)
    return 0 if all(r.get(v) for r in rows for v in views) else 1


def build_command(info: dict[str, Any]) -> str:
    """The ``build`` command line that makes the task of task.json ``info``."""
    lay, ex = info["layout"], info["examples"]
    asked = info.get("asked") or {s: ex[s]["examples"] for s in ("train", "test")}
    return (
        f"python studies/long_downstream.py build --corpus {info['corpus']} --tokenizer "
        f"{info['tokenizer']} --out {info.get('out', 'TASK')} --train-examples "
        f"{asked['train']} --test-examples {asked['test']} "
        f"--test-fraction {info['test_fraction']} --seed {info['seed']} "
        f"--first-tokens {lay['first_tokens']} --gap-tokens {lay['gap_tokens_more_than']} "
        f"--passage-tokens {lay['passage_tokens']} --spans-per-doc {lay['spans_per_doc']} "
        f"--control-tokens {lay['control_tokens']}"
        + (f" --filler-tokens {lay['filler_tokens']}" if lay.get("filler_tokens") else "")
    )


def report_md(
    info: dict[str, Any],
    settings: dict[str, Any],
    rows: list[dict[str, Any]],
    views: Sequence[str],
    command: list[str] | None = None,
    lexical: dict[str, dict[str, Any]] | None = None,
) -> str:
    """The markdown table of :func:`run`."""
    lay, ex = info["layout"], info["examples"]
    md = [
        f"Task: same document? Row = first part P of a document (<= {lay['first_tokens']} "
        f"tokens) `</s>` passage Q (<= {lay['passage_tokens']} tokens), Q either the text of "
        f"P's document after a gap of more than {lay['gap_tokens_more_than']} tokens (label 1) "
        "or the passage of another document of the same package (label 0); quads, so every P "
        "and every Q occurs once with each label"
        + (
            f"; between them a filler of {lay['filler_tokens']} tokens of a third document"
            if lay.get("filler_tokens")
            else ""
        )
        + ". Built: train "
        f"{ex['train']['examples']} / test {ex['test']['examples']} rows, documents disjoint "
        f"({ex['train']['documents']} / {ex['test']['documents']}). Majority baseline (test): "
        f"{info['majority_baseline_test_accuracy']:.4f}.",
        f"Views: full (rows of <= {ex['test']['tokens_max']} tokens, --max-length "
        f"{settings['max_length']}); tail512 (the last {lay['control_tokens']} tokens: Q's end "
        "only; ceiling 0.5 by construction); sep512 (the 254 tokens each side of `</s>`: what a "
        "512-token window can exploit, whether the end of P and the start of Q share a "
        "subsystem's or chapter's vocabulary). Full minus sep512 = what text farther than 256 "
        "tokens from the separator adds.",
        f"Used here: the first {settings['train_limit'] or 'all'} train and "
        f"{settings['test_limit'] or 'all'} test rows (whole quads). Fine-tuning: {settings}. "
        "`s` = wall-clock of the view's launch/finetune.py (load, train, test, save).",
        "",
        "Reproduce:",
        "",
        "```",
        build_command(info),
        "python studies/long_downstream.py run " + " ".join(command or []),
        "```",
        "",
        "| run | pretrained | " + " | ".join(f"{v} acc (95 % CI) | {v} s" for v in views) + " |",
        "|---|---|" + "---|---|" * len(views),
    ]
    for r in rows:
        if "error" in r:
            md.append(f"| {r['run']} | {r['error']} |")
            continue
        cells = []
        for v in views:
            x = r.get(v)
            if not x:
                cells += ["failed", "-"]
                continue
            lo, hi = wilson(x["test_accuracy"], x["n_test"])
            cells += [
                f"{x['test_accuracy']:.4f} on {x['n_test']} ({lo:.2f}-{hi:.2f})",
                f"{x['wall_s']:.0f}" if x.get("wall_s") is not None else "-",
            ]
        md.append(
            f"| {r['run']} | {'yes' if r['pretrained'] else 'no'} | " + " | ".join(cells) + " |"
        )
    for label, by_view in (lexical or {}).items():
        cells = []
        for v in views:
            x = by_view.get(v)
            if not x:
                cells += ["n/a", "-"]
                continue
            lo, hi = wilson(x["test_accuracy"], x["n_test"])
            cells += [f"{x['test_accuracy']:.4f} on {x['n_test']} ({lo:.2f}-{hi:.2f})", "-"]
        md.append(
            f"| no model: tf-idf cosine of P and Q, {label} | - | " + " | ".join(cells) + " |"
        )
    return "\n".join(md) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Command line: ``build`` or ``run``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write the labelled task")
    b.add_argument("--corpus", required=True, help="long.jsonl (scripts/make_long_corpus.sh)")
    b.add_argument("--tokenizer", required=True, help="the corpus' SentencePiece model")
    b.add_argument("--out", required=True)
    b.add_argument("--train-examples", type=int, default=400, help="a multiple of 4")
    b.add_argument("--test-examples", type=int, default=200, help="a multiple of 4")
    b.add_argument("--test-fraction", type=float, default=0.2, help="share of documents held out")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--first-tokens", type=int, default=1900)
    b.add_argument("--gap-tokens", type=int, default=512, help="the gap is longer than this")
    b.add_argument("--passage-tokens", type=int, default=2100)
    b.add_argument("--spans-per-doc", type=int, default=4)
    b.add_argument("--control-tokens", type=int, default=512)
    b.add_argument(
        "--filler-tokens",
        type=int,
        default=0,
        help="rows P </s> C </s> Q with C this many tokens of a third document (one per quad), "
        "so no 512-token window sees both P and Q (e.g. --first-tokens 1300 --filler-tokens 600)",
    )
    r = sub.add_parser("run", help="export + fine-tune each model on each view")
    r.add_argument("--task", required=True)
    r.add_argument("--work", required=True, help="exports, fine-tuned models, untrained runs")
    r.add_argument("--report-dir", required=True)
    r.add_argument("--runs-root", default="runs/long_study")
    r.add_argument(
        "--models",
        nargs="*",
        default=["dense_s0", "linear_mixer_s0", "local_linear_mixer_s0"],
        help="run directories under --runs-root",
    )
    r.add_argument(
        "--untrained",
        nargs="*",
        default=["local_linear_mixer"],
        help="variants (of --runs-root/VARIANT_s0) to fine-tune untrained",
    )
    r.add_argument("--views", nargs="*", default=list(VIEWS), choices=list(VIEWS))
    r.add_argument("--train-limit", type=int, default=None, help="first rows of train (x4)")
    r.add_argument("--test-limit", type=int, default=None, help="first rows of test (x4)")
    r.add_argument("--max-length", type=int, default=4096)
    r.add_argument("--control-tokens", type=int, default=512)
    r.add_argument("--epochs", type=float, default=1.0)
    r.add_argument("--batch-size", type=int, default=4)
    r.add_argument("--eval-batch-size", type=int, default=4)
    r.add_argument("--lr", type=float, default=None)
    r.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.cmd == "build":
        task = build(
            Path(args.corpus),
            Path(args.tokenizer),
            Path(args.out),
            args.train_examples,
            args.test_examples,
            args.test_fraction,
            args.seed,
            args.first_tokens,
            args.gap_tokens,
            args.passage_tokens,
            args.spans_per_doc,
            args.control_tokens,
            args.filler_tokens,
        )
        print(json.dumps(task, indent=1))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
