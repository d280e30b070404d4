"""SentencePiece tokenizer: train one with the project's fixed special ids, or check a given one.

Fixed ids (the model and the reader rely on them): pad=0 ``<pad>``, unk=1 ``<unk>``,
bos/cls=2 ``<s>``, eos/sep=3 ``</s>``, mask=4 ``<mask>``. ``<mask>`` is a *control* symbol, so
no input text can ever produce id 4 (a user-defined symbol would match the literal text).

Documents are encoded line by line (``text.split("\\n")``, blank lines dropped) and the ids of
the lines concatenated; training samples lines the same way.
"""

import io
import os
import random
import threading
from collections.abc import Callable, Iterable
from typing import Any

import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as pb

from data_prep.errors import DataPrepError
from linformer_ds.fsio import file_sha256
from linformer_ds.special_tokens import (  # noqa: F401  (re-exported to data_prep's modules)
    CLS_ID,
    MASK_ID,
    PAD_ID,
    SEP_ID,
    SPECIAL_IDS,
    SPECIAL_PIECES,
    UNK_ID,
)

MODEL_TYPES = ("unigram", "bpe")
MAX_SENTENCE_BYTES = 4192  # SentencePiece's default max_sentence_length: longer lines are split
# Byte fallback (characters outside the vocabulary become their UTF-8 bytes, never <unk>) costs
# 256 pieces: on by default when they take at most a quarter of the vocabulary.
BYTE_FALLBACK_MIN_VOCAB = 4 * 256
# SentencePiece's own recommendation for scripts with many characters (CJK): rare ones are left
# out of the vocabulary (and go to bytes under byte fallback).
LARGE_ALPHABET_COVERAGE = 0.9995


def document_lines(text: str) -> list[str]:
    """The lines of a document that are encoded (non-blank lines, in order)."""
    return [line for line in text.split("\n") if line.strip()]


def split_long_line(line: str, max_bytes: int = MAX_SENTENCE_BYTES) -> list[str]:
    """``line`` cut into pieces of at most ``max_bytes`` UTF-8 bytes that concatenate back to it.

    SentencePiece's trainer skips longer sentences, so each cut goes after the last whitespace
    in the second half of a piece's budget (a hard cut at a character boundary otherwise).
    """
    if len(line) * 4 <= max_bytes or len(line.encode("utf-8")) <= max_bytes:
        return [line]
    pieces: list[str] = []
    start = 0
    while start < len(line):
        # the longest prefix of line[start:] within max_bytes (characters are 1-4 bytes)
        end = min(len(line), start + max_bytes)
        while len(line[start:end].encode("utf-8")) > max_bytes:
            over = len(line[start:end].encode("utf-8")) - max_bytes
            end -= max(1, over // 4)
        if end < len(line):
            cut = max(line.rfind(" ", start, end), line.rfind("\t", start, end))
            if cut >= start + (end - start) // 2:
                end = cut + 1  # the whitespace stays with the left piece: nothing is lost
        pieces.append(line[start:end])
        start = end
    return pieces


def sample_sentences(
    documents: Iterable[str],
    max_sentences: int,
    seed: int,
    stats: dict[str, int] | None = None,
) -> list[str]:
    """Uniform reservoir sample of at most ``max_sentences`` training lines (bounded memory).

    Lines longer than SentencePiece's ``MAX_SENTENCE_BYTES`` are split (:func:`split_long_line`),
    so every byte of the corpus can be sampled. ``stats``, if given, receives the truth:
    ``corpus_lines``, ``corpus_bytes`` (non-blank lines, UTF-8), ``long_lines`` (split),
    ``sampled_lines`` and ``sampled_bytes``.
    """
    rng = random.Random(seed)
    sample: list[str] = []
    seen = corpus_lines = corpus_bytes = long_lines = 0
    for doc in documents:
        for line in document_lines(doc):
            corpus_lines += 1
            corpus_bytes += len(line.encode("utf-8"))
            pieces = split_long_line(line)
            long_lines += len(pieces) > 1
            for piece in pieces:
                seen += 1
                if len(sample) < max_sentences:
                    sample.append(piece)
                else:
                    j = rng.randrange(seen)
                    if j < max_sentences:
                        sample[j] = piece
    if stats is not None:
        stats.update(
            corpus_lines=corpus_lines,
            corpus_bytes=corpus_bytes,
            long_lines=long_lines,
            sampled_lines=len(sample),
            sampled_bytes=sum(len(s.encode("utf-8")) for s in sample),
        )
    return sample


def alphabet_size(sentences: Iterable[str]) -> int:
    """Distinct non-whitespace characters in ``sentences``."""
    chars: set = set()
    for s in sentences:
        chars.update(s)
    return sum(not c.isspace() for c in chars)


def training_options(
    sentences: list[str],
    vocab_size: int,
    character_coverage: float | None = None,
    byte_fallback: bool | None = None,
) -> dict[str, Any]:
    """The ``character_coverage`` and ``byte_fallback`` a tokenizer is trained with (given
    values win). Defaults: byte fallback when the vocabulary has at least
    ``BYTE_FALLBACK_MIN_VOCAB`` pieces; full coverage (every character of the sample gets a
    piece) when the sample's alphabet fits in half the pieces left after the special and byte
    pieces (alphabetic scripts), else ``LARGE_ALPHABET_COVERAGE`` (CJK-sized alphabets)."""
    if byte_fallback is None:
        byte_fallback = vocab_size >= BYTE_FALLBACK_MIN_VOCAB
    if character_coverage is None:
        room = vocab_size - len(SPECIAL_IDS) - (256 if byte_fallback else 0)
        full = alphabet_size(sentences) <= room // 2
        character_coverage = 1.0 if full else LARGE_ALPHABET_COVERAGE
    return {"character_coverage": float(character_coverage), "byte_fallback": bool(byte_fallback)}


def normalized(sp: Any, text: str) -> str:
    """``text`` as SentencePiece normalizes it before encoding (NFKC, runs of spaces collapsed,
    ends stripped), in plain characters: what ``decode(encode(text))`` gives back at best."""
    return sp.normalize(text).replace("\u2581", " ").strip(" ")


def round_trip(sp: Any, lines: Iterable[str]) -> dict[str, Any]:
    """How faithfully ``sp`` encodes ``lines``: ``exact`` lines with decode(encode(x)) ==
    normalized(x) out of ``lines``, their ``rate``, and the ``unk_pieces`` encoding produced."""
    n = exact = unk = 0
    for line in lines:
        ids = sp.encode(line)
        n += 1
        unk += ids.count(UNK_ID)
        exact += sp.decode(ids) == normalized(sp, line)
    return {"lines": n, "exact": exact, "rate": exact / n if n else 1.0, "unk_pieces": unk}


def train_tokenizer(
    sentences: list[str],
    model_path: str,
    vocab_size: int,
    model_type: str = "unigram",
    character_coverage: float | None = None,
    num_threads: int = 2,
    seed: int = 0,
    byte_fallback: bool | None = None,
) -> str:
    """Train a SentencePiece model with the fixed special ids and write it to ``model_path``.

    ``character_coverage`` / ``byte_fallback``: ``None`` = decided by :func:`training_options`
    (the model file records the values used). The result depends on the sentences, the options
    and ``num_threads`` (SentencePiece's EM sums differ by thread count), never on the output
    path: the model is written from memory.
    """

    if model_type not in MODEL_TYPES:
        raise DataPrepError(f"--model-type must be one of {MODEL_TYPES}, got {model_type!r}")
    if vocab_size <= len(SPECIAL_IDS):
        raise DataPrepError(
            f"--vocab-size {vocab_size} is too small: it must exceed the {len(SPECIAL_IDS)} "
            "special tokens"
        )
    if not sentences:
        raise DataPrepError("the corpus is empty: no non-blank lines to train a tokenizer on")
    options = training_options(sentences, vocab_size, character_coverage, byte_fallback)
    # Shuffle deterministically so SentencePiece sees a representative order.
    sentences = list(sentences)
    random.Random(seed).shuffle(sentences)
    writer = io.BytesIO()
    try:
        interruptible(
            spm.SentencePieceTrainer.train,
            sentence_iterator=iter(sentences),
            model_writer=writer,
            vocab_size=vocab_size,
            model_type=model_type,
            character_coverage=options["character_coverage"],
            byte_fallback=options["byte_fallback"],
            pad_id=PAD_ID,
            unk_id=UNK_ID,
            bos_id=CLS_ID,
            eos_id=SEP_ID,
            pad_piece=SPECIAL_PIECES["pad"],
            unk_piece=SPECIAL_PIECES["unk"],
            bos_piece=SPECIAL_PIECES["cls"],
            eos_piece=SPECIAL_PIECES["sep"],
            control_symbols=[SPECIAL_PIECES["mask"]],
            num_threads=num_threads,
            minloglevel=2,
            shuffle_input_sentence=False,
        )
    except RuntimeError as e:
        msg = str(e).strip()
        if "smaller than required_chars" in msg:
            raise DataPrepError(
                f"--vocab-size {vocab_size} is too small for the corpus's alphabet "
                f"({alphabet_size(sentences)} characters, options {options}): use a larger "
                "--vocab-size or a smaller --character-coverage"
            ) from e
        if "Vocabulary size" in msg:
            detail = msg[msg.index("Vocabulary size") :].rstrip(".")
            raise DataPrepError(
                f"--vocab-size {vocab_size} is too large for this corpus "
                f"({len(sentences)} training lines): {detail}. Use a smaller --vocab-size "
                "or a larger corpus."
            ) from e
        raise DataPrepError(f"SentencePiece training failed: {msg.strip()}") from e
    tmp = model_path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(writer.getvalue())
    os.replace(tmp, model_path)
    return model_path


TRAINER_THREAD = "spm-train"  # the OS name of the trainer's thread (top -H, /proc/PID/task/*/comm)


def name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` (at most 15 bytes) as the OS sees it (Linux prctl
    PR_SET_NAME; elsewhere nothing): ``top -H`` and ``/proc/PID/task/TID/comm`` show it."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # 15: PR_SET_NAME
    except (OSError, AttributeError, TypeError):
        pass


def interruptible(fn: Callable[..., Any], **kwargs: Any) -> Any:
    """``fn(**kwargs)`` in a daemon thread while the calling thread waits in short joins, so
    Ctrl-C (KeyboardInterrupt) ends the wait within a fraction of a second: SentencePiece's C++
    training loop (which releases the GIL) never checks for signals itself. The result, and
    the output, are the same as a direct call; an exception of ``fn`` is raised here."""
    done: dict[str, Any] = {}

    def run() -> None:
        name_os_thread(TRAINER_THREAD)
        try:
            done["value"] = fn(**kwargs)
        except BaseException as e:  # noqa: BLE001  (handed to the caller)
            done["error"] = e

    if threading.current_thread() is not threading.main_thread():
        return fn(**kwargs)  # signals reach the main thread only: nothing to gain
    worker = threading.Thread(target=run, name="sentencepiece-train", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.2)
    if "error" in done:
        raise done["error"]
    return done.get("value")


def load_tokenizer(path: str) -> Any:
    """Load a ``.model`` file and check the fixed special ids; a clear error on mismatch."""

    try:
        sp = spm.SentencePieceProcessor(model_file=path)
    except (OSError, RuntimeError) as e:
        raise DataPrepError(f"cannot load SentencePiece model {path!r}: {e}") from e
    check_special_ids(sp, path)
    return sp


def check_special_ids(sp: Any, where: str) -> None:
    """Raise unless ``sp`` has pad=0, unk=1, bos=2, eos=3 and ``<mask>`` = 4."""
    found = {
        "pad": sp.pad_id(),
        "unk": sp.unk_id(),
        "cls": sp.bos_id(),
        "sep": sp.eos_id(),
        "mask": sp.piece_to_id(SPECIAL_PIECES["mask"]) if sp.get_piece_size() > MASK_ID else -1,
    }
    if found["mask"] == sp.unk_id():  # piece_to_id returns unk for unknown pieces
        found["mask"] = -1
    if found != SPECIAL_IDS:
        raise DataPrepError(
            f"tokenizer {where!r} has special ids {found}, expected {SPECIAL_IDS} "
            f"(train it with pad_id=0 unk_id=1 bos_id=2 eos_id=3 and control_symbols=<mask>, "
            "or let data_prep train one)"
        )


def tokenizer_info(path: str, sp: Any, trained: dict[str, Any] | None) -> dict[str, Any]:
    """The manifest's tokenizer entry."""

    proto = pb.ModelProto()
    with open(path, "rb") as f:
        proto.ParseFromString(f.read())
    model_type = pb.TrainerSpec.ModelType.Name(proto.trainer_spec.model_type).lower()
    info: dict[str, Any] = {
        "file": "tokenizer.model",
        "sha256": file_sha256(path),
        "model_type": model_type,
        "vocab_size": sp.get_piece_size(),
        "character_coverage": round(float(proto.trainer_spec.character_coverage), 6),
        "byte_fallback": bool(proto.trainer_spec.byte_fallback),
        "special_pieces": dict(SPECIAL_PIECES),
        "encoding": "each non-blank line encoded separately, ids concatenated per document",
    }
    if trained is not None:
        info["trained"] = trained
    return info
