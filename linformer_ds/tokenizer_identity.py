"""The one tokenizer identity check: is the tokenizer a model (a checkpoint, an export, a warm-start
source) was trained with the one that made the data it is given?

Ids mean tokens only through the tokenizer that made them, and a tokenizer is more than its
vocabulary: a copy of BERT's with lowercasing turned off has every piece at its id and still
turns every capitalised word into ``[UNK]``. So two tokenizers are the same when

1. their files are the same bytes (sha256; a data_prep output's manifest records its tokenizer's,
   and the file must still have it), or else
2. what they do is the same: the kind (SentencePiece or Hugging Face), the model type, the
   piece of every id, the model's scores and merges, the normalizer and the pre-tokenizer (for
   SentencePiece its normalizer spec), and the special tokens. What only decorates the output
   (a post-processor, a decoder, padding, an added token's strip flags, ``model_max_length``) is
   not compared: an export rewrites those.

A source with only a ``vocab.txt`` / ``vocab.json`` is compared by its pieces, and the note says
so. :func:`check_tokenizers` is the check; every command that pairs a model with data calls it
(launch/pretrain.py for a warm start and a mixture's sources, launch/convert.py, context_curve,
the capability suite's ``copy``, launch/export.py, launch/finetune.py; :func:`read_checked`, the
file against its owner's record, also at every start of a run). A mismatch is one line naming
both files and what differs. Standard library only at import: a tokenizer.json is read as JSON,
sentencepiece's protobuf module is imported when a SentencePiece model is read.
"""

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

from linformer_ds.errors import LinformerError
from linformer_ds.fsio import file_sha256

SP_KIND = "sentencepiece"
HF_KIND = "huggingface"  # = the manifest's tokenizer.kind of a Hugging Face tokenizer directory
VOCAB_KIND = "vocabulary"  # a vocab.txt / vocab.json: pieces only
HF_FILE = "tokenizer.json"
SP_FILE = "tokenizer.model"
# the tokenizer files a save_pretrained directory may hold, in the order they are read
SOURCE_FILES = (HF_FILE, "vocab.txt", "vocab.json")


class TokenizerMismatch(LinformerError, ValueError):
    """Two tokenizers that must be one differ (or one is not the file its record names)."""


@dataclass(frozen=True)
class TokenizerRef:
    """A tokenizer to compare: ``path`` (the file named in messages; it may be missing when
    ``sha256`` records it), its ``kind``, the ``sha256`` its owner recorded (a data manifest, a
    checkpoint's metadata, an export's record; None: nothing recorded) and ``role`` (whose it
    is, for messages: "the data's", "the model's", ...)."""

    path: str
    kind: str
    sha256: str | None = None
    role: str = ""
    made: str = "its record names"  # what a file without the recorded sha256 is not

    def named(self) -> str:
        return f"{self.path} ({self.role})" if self.role else self.path


# ====================================================================================== locating
def kind_of(path: str) -> str:
    """The kind of tokenizer file ``path``: a vocab.txt / vocab.json, a tokenizer JSON (any
    other ``.json``; a directory: its tokenizer.json), else a SentencePiece model."""
    name = os.path.basename(path)
    if name in ("vocab.txt", "vocab.json"):
        return VOCAB_KIND
    return HF_KIND if name.endswith(".json") or os.path.isdir(path) else SP_KIND


def of_file(path: str, role: str = "", sha256: str | None = None) -> TokenizerRef:
    """A SentencePiece ``.model`` file, a ``tokenizer.json``, or a Hugging Face tokenizer
    directory (its ``tokenizer.json``)."""
    path = str(path)
    if os.path.isdir(path):
        path = os.path.join(path, HF_FILE)
    return TokenizerRef(path, kind_of(path), sha256, role)


def of_data(data: str, manifest: dict[str, Any] | None = None,
            role: str = "the data's") -> TokenizerRef | None:  # fmt: skip
    """The tokenizer a data_prep output records (its file and sha256); None when its manifest
    records none (``manifest``: the one already read, else ``DATA/manifest.json``)."""
    if manifest is None:
        try:
            with open(os.path.join(data, "manifest.json"), encoding="utf-8") as f:
                manifest = json.load(f)
        except (OSError, ValueError):
            return None
    tok = manifest.get("tokenizer") if isinstance(manifest, dict) else None
    if not isinstance(tok, dict):
        return None
    path = os.path.join(str(data), str(tok.get("file", SP_FILE)))
    kind = HF_KIND if tok.get("kind") == HF_KIND else SP_KIND
    sha = tok.get("sha256") if isinstance(tok.get("sha256"), str) else None
    return TokenizerRef(path, kind, sha, role, "this data was made with")


def of_model(model: str, role: str = "the model's", name: str | None = None) -> TokenizerRef | None:
    """The tokenizer of an export directory (its ``tokenizer.model``, else its
    ``tokenizer.json``, with the sha256 the export recorded in ``linformer_export.json``) or of a
    checkpoint tag directory (the copy named by ``linformer_meta.json``, with the sha256 of the
    data it was trained on); None when it has none."""
    meta = _json(os.path.join(model, "linformer_meta.json"))
    if isinstance(meta, dict):  # a checkpoint tag
        name = str(meta.get("tokenizer") or SP_FILE)
        path = os.path.join(model, name)
        if os.path.isdir(path) or name != SP_FILE:
            path = os.path.join(path, HF_FILE)
        shas = {d.get("tokenizer_sha256") for d in meta.get("data") or [] if isinstance(d, dict)}
        shas.discard(None)
        sha = shas.pop() if len(shas) == 1 else None
        if not os.path.isfile(path) and sha is None:
            return None
        return TokenizerRef(path, kind_of(path), sha, role, "the checkpoint was trained with")
    export = _json(os.path.join(model, "linformer_export.json"))
    tok = export.get("tokenizer") if isinstance(export, dict) else None
    files = tok.get("files") if isinstance(tok, dict) else None
    files = files if isinstance(files, dict) else {}
    for file in (name,) if name else (SP_FILE, HF_FILE):
        path = os.path.join(model, file)
        sha = files.get(file) if isinstance(files.get(file), str) else None
        if os.path.isfile(path) or sha:
            return TokenizerRef(path, kind_of(path), sha, role, "the export was written with")
    return None


def of_source(source: str, role: str = "the source's") -> TokenizerRef | None:
    """The tokenizer saved beside a Hugging Face model (a warm-start source): tokenizer.json,
    else BERT's vocab.txt, else RoBERTa's vocab.json; None when it has none."""
    for name in SOURCE_FILES:
        path = os.path.join(source, name)
        if os.path.isfile(path):
            return TokenizerRef(path, kind_of(path), None, role)
    return None


def record(model_dir: str) -> dict[str, Any]:
    """What an export records of the tokenizer files it wrote (``linformer_export.json``'s
    ``tokenizer``): the sha256 of its tokenizer.model and tokenizer.json, for :func:`of_model`."""
    return {"files": {name: file_sha256(os.path.join(model_dir, name)) for name in
                      (SP_FILE, HF_FILE) if os.path.isfile(os.path.join(model_dir, name))}}  # fmt: skip


def _json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# ===================================================================================== content
def parts(ref: TokenizerRef, data: bytes) -> dict[str, Any]:
    """What a tokenizer does, by part (compared in this order): ``kind``, ``model type``,
    ``pieces`` (the piece of every id), ``model`` (scores, merges, options), ``normalizer``,
    ``pre-tokenizer``, ``special tokens``. A part it does not define is absent."""
    if ref.kind == SP_KIND:
        return _sp_parts(data)
    if ref.kind == VOCAB_KIND:
        if ref.path.endswith(".json"):
            return {"pieces": _by_id(json.loads(data.decode("utf-8")))}
        lines = data.decode("utf-8").split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        return {"pieces": _by_id({p.rstrip("\r"): i for i, p in enumerate(lines)})}
    spec = json.loads(data.decode("utf-8"))
    if not isinstance(spec, dict) or not isinstance(spec.get("model"), dict):
        raise ValueError("not a tokenizers JSON (no model)")
    model = dict(spec["model"])
    vocab = model.pop("vocab", {})
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        model["scores"] = [s for _, s in vocab]
        vocab = {p: i for i, (p, _) in enumerate(vocab)}
    added = sorted((t for t in spec.get("added_tokens") or [] if isinstance(t, dict)),
                   key=lambda t: t.get("id", -1))  # fmt: skip
    vocab = dict(vocab) if isinstance(vocab, dict) else vocab
    for t in added if isinstance(vocab, dict) else ():
        vocab[str(t.get("content"))] = int(t.get("id", -1))
    return {
        "kind": HF_KIND,
        "model type": model.pop("type", None),
        "pieces": _by_id(vocab),
        "model": model,
        "normalizer": spec.get("normalizer"),
        "pre-tokenizer": spec.get("pre_tokenizer"),
        "special tokens": {
            int(t.get("id", -1)): str(t.get("content")) for t in added if t.get("special")
        },  # fmt: skip
    }


def _sp_parts(data: bytes) -> dict[str, Any]:
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString(data)
    if not proto.pieces:
        raise ValueError("not a SentencePiece model (no pieces)")
    trainer = proto.trainer_spec

    def spec(message: Any) -> dict[str, Any]:  # every field, defaults included
        out = {}
        for field in message.DESCRIPTOR.fields:
            value = getattr(message, field.name)
            out[field.name] = hashlib.sha256(value).hexdigest()[:16] if isinstance(
                value, bytes) else value  # fmt: skip
        return out

    return {
        "kind": SP_KIND,
        "model type": pb.TrainerSpec.ModelType.Name(trainer.model_type),
        "pieces": [p.piece for p in proto.pieces],
        "model": {
            "scores": [p.score for p in proto.pieces],
            "types": [int(p.type) for p in proto.pieces],
            "byte_fallback": trainer.byte_fallback,
            "treat_whitespace_as_suffix": trainer.treat_whitespace_as_suffix,
            "denormalizer": spec(proto.denormalizer_spec),
        },  # fmt: skip
        "normalizer": spec(proto.normalizer_spec),
        "special tokens": {i: p.piece for i, p in enumerate(proto.pieces) if p.type in (2, 3)},
    }


def _by_id(vocab: Any) -> list[str | None]:
    """``{piece: id}`` -> the piece of every id (None where no piece has the id)."""
    if not isinstance(vocab, dict) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in vocab.values()
    ):
        raise ValueError("not a {piece: id} vocabulary")
    out: list[str | None] = [None] * (max(vocab.values(), default=-1) + 1)
    for piece, i in vocab.items():
        out[i] = piece
    return out


def _first_difference(a: Any, b: Any, where: str = "") -> str:
    """Where JSON-like ``a`` and ``b`` first differ: ``path: A vs B`` (short)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in list(a) + [k for k in b if k not in a]:
            if a.get(key, _MISSING) != b.get(key, _MISSING):
                return _first_difference(a.get(key, _MISSING), b.get(key, _MISSING),
                                         f"{where}.{key}" if where else str(key))  # fmt: skip
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return _first_difference(x, y, f"{where}[{i}]")
    return f"{where + ': ' if where else ''}{_short(a)} vs {_short(b)}"


class _Missing:
    def __repr__(self) -> str:
        return "absent"


_MISSING = _Missing()


def _short(value: Any, n: int = 60) -> str:
    text = value if isinstance(value, _Missing) else json.dumps(value, ensure_ascii=False,
                                                                sort_keys=True)  # fmt: skip
    text = str(text)
    return text if len(text) <= n else text[: n - 3] + "..."


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """What differs between two tokenizers' :func:`parts` (the parts both define), one
    phrase per part, in the parts' order."""
    out = []
    for part in ("kind", "model type", "pieces", "model", "normalizer", "pre-tokenizer",
                 "special tokens"):  # fmt: skip
        if part not in a or part not in b or a[part] == b[part]:
            continue
        x, y = a[part], b[part]
        if part == "pieces":
            n = max(len(x), len(y))
            x, y = x + [None] * (n - len(x)), y + [None] * (n - len(y))
            differ = [i for i in range(n) if x[i] != y[i]]
            i = differ[0]
            sizes = (
                f"{len(a[part])} ids vs {len(b[part])}, " if len(a[part]) != len(b[part]) else ""
            )
            out.append(f"{sizes}{len(differ)} of {n} ids are other pieces "
                       f"(id {i}: {x[i]!r} vs {y[i]!r})")  # fmt: skip
        elif part in ("kind", "model type"):
            out.append(f"{part} {x} vs {y}")
        else:
            out.append(f"{part} differs ({_first_difference(x, y)})")
    return out


# ========================================================================================= check
def read_checked(ref: TokenizerRef) -> tuple[bytes | None, str | None]:
    """``(bytes, sha256)`` of the file (None, None when it is missing), checked to have the
    sha256 its owner recorded (TokenizerMismatch, one line, otherwise)."""
    if not os.path.isfile(ref.path):
        return None, None
    with open(ref.path, "rb") as f:
        data = f.read()
    got = hashlib.sha256(data).hexdigest()
    if ref.sha256 and got != ref.sha256:
        raise TokenizerMismatch(f"{ref.path}: not the tokenizer {ref.made} (sha256 {got[:16]} "
                                f"vs the recorded {ref.sha256[:16]})")  # fmt: skip
    return data, got


def check_tokenizers(a: TokenizerRef | None, b: TokenizerRef | None) -> str:
    """THE tokenizer identity check: ``a`` and ``b`` are one tokenizer (the same bytes, or else
    the same kind, pieces, model, normalizer, pre-tokenizer and special tokens: see the module
    docstring). First each given file is checked to be the one its owner recorded (its
    sha256). Returns the note for a log line (what was compared); raises
    :class:`TokenizerMismatch`, one line naming both files and what differs. When either is
    None (no tokenizer recorded there) only the other's record is checked, and the note says
    that nothing was compared."""
    data_a, sha_a = read_checked(a) if a is not None else (None, None)
    data_b, sha_b = read_checked(b) if b is not None else (None, None)
    if a is None or b is None:
        known, sha = (a, sha_a) if a is not None else (b, sha_b)
        if known is not None and known.sha256 and sha:
            return f"tokenizer: {known.named()} is the file its record names (sha256 {sha[:12]})"
        return f"tokenizer: not compared ({'only ' + known.named() if known else 'none'} recorded)"
    sha_a, sha_b = sha_a or a.sha256, sha_b or b.sha256
    if sha_a and sha_a == sha_b:
        return f"tokenizer: the same file as {_short_name(b)} (sha256 {sha_a[:12]})"
    if data_a is None or data_b is None:
        gone = a if data_a is None else b
        if sha_a is None or sha_b is None:
            return f"tokenizer: not compared ({gone.path} is missing)"
        raise TokenizerMismatch(
            f"tokenizers differ: {a.named()} vs {b.named()}: sha256 {sha_a[:12]} vs "
            f"{sha_b[:12]} ({gone.path} is missing: its content cannot be compared)"
        )
    got = []
    for ref, data in ((a, data_a), (b, data_b)):
        try:
            got.append(parts(ref, data))
        except Exception as e:  # noqa: BLE001  (protobuf, json and tokenizers raise their own)
            why = " ".join(str(e).split())[:120] or type(e).__name__
            raise TokenizerMismatch(f"{ref.named()}: not a {ref.kind} tokenizer ({why})") from None
    diff = differences(*got)
    if diff:
        raise TokenizerMismatch(f"tokenizers differ: {a.named()} vs {b.named()}: "
                                f"{'; '.join(diff)}")  # fmt: skip
    compared = [p for p in ("normalizer", "pre-tokenizer") if p in got[0] and p in got[1]]
    n = len(got[0]["pieces"])
    what = f"{n} pieces" + (f", {' and '.join(compared)}" if compared else "")
    return f"tokenizer: {what} equal to {_short_name(b)}"


def _short_name(ref: TokenizerRef) -> str:
    """``the source's vocab.txt``: how a note names ``ref``."""
    return f"{ref.role} {os.path.basename(ref.path)}" if ref.role else ref.path
