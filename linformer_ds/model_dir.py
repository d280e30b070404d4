"""A self-contained Hugging Face model directory: ``config.json`` (with the sha256 of each code
file), ``model.safetensors``, the remote code and the tokenizer files. Written by export and
finetune (:func:`write_model_dir`); :func:`check_remote_code` tells whether a directory's code
is still what was written.
"""

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import sentencepiece as spm
import torch
from sentencepiece import sentencepiece_model_pb2 as pb

from linformer_ds.errors import LinformerError
from linformer_ds.model import ModelConfig
from linformer_ds.outdir import error_line
from linformer_ds.special_tokens import (
    SPECIAL_IDS,
    SPECIAL_PIECES,
    copy_tokenizer_files,
    hf_special_tokens,
)
from linformer_ds.tokenizer_identity import record as tokenizer_record

EXPORT_FORMAT_VERSION = 1
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Special tokens of the SentencePiece models made by data_prep: HF name -> (piece, id), from
# data_prep's one table (a checkpoint's metadata records the ids it was trained with).
_HF_NAMES = {"pad": "pad_token", "unk": "unk_token", "cls": "bos_token", "sep": "eos_token",
             "mask": "mask_token"}  # fmt: skip
SPECIAL_TOKENS = {_HF_NAMES[key]: (SPECIAL_PIECES[key], SPECIAL_IDS[key]) for key in _HF_NAMES}
CLS_SEP = {"cls_token": "<s>", "sep_token": "</s>"}

_PKG = Path(__file__).resolve().parent
# exported file name -> (source file, import rewrites that make it a flat remote-code module)
# The model package ships file for file (its files import each other relatively, so they work
# unchanged as a flat remote-code directory); its __init__ is linformer_model.py.
MODEL_FILES = tuple(
    sorted(p.name for p in (_PKG / "model").glob("*.py") if p.name != "__init__.py")
)
REMOTE_CODE: dict[str, tuple[Path, tuple[tuple[str, str], ...]]] = {
    "linformer_model.py": (_PKG / "model" / "__init__.py", ()),
    **{name: (_PKG / "model" / name, ()) for name in MODEL_FILES},
    "configuration_linformer.py": (
        _PKG / "hf" / "configuration_linformer.py",
        (("from ..model import", "from .linformer_model import"),),
    ),
    "modeling_linformer.py": (
        _PKG / "hf" / "modeling_linformer.py",
        (("from ..model import", "from .linformer_model import"),),
    ),
}
# config.json key: {code file name: sha256 of its text} as written by the export
CODE_SHA_KEY = "linformer_code_sha256"
AUTO_MAP = {
    "AutoConfig": "configuration_linformer.LinformerConfig",
    "AutoModel": "modeling_linformer.LinformerModel",
    "AutoModelForMaskedLM": "modeling_linformer.LinformerForMaskedLM",
    "AutoModelForSequenceClassification": "modeling_linformer.LinformerForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_linformer.LinformerForTokenClassification",
    "AutoModelForQuestionAnswering": "modeling_linformer.LinformerForQuestionAnswering",
    "AutoModelForMultipleChoice": "modeling_linformer.LinformerForMultipleChoice",
    "AutoModelForCausalLM": "modeling_linformer.LinformerForCausalLM",  # refuses, with the reason
}


class ExportError(LinformerError, RuntimeError):
    """The export cannot proceed; the message names the problem and the path."""


def is_hf_tokenizer(path: str) -> bool:
    """A directory: a Hugging Face tokenizer (data_prep's ``tokenizer/``, an export); a file:
    a SentencePiece model."""
    return os.path.isdir(path)


def load_hf_tokenizer(path: str, **kwargs: Any) -> Any:
    """``AutoTokenizer`` of directory ``path`` (its tokenizer files); ExportError in one line."""
    from transformers import AutoTokenizer

    try:
        with tempfile.TemporaryDirectory() as tmp:  # the tokenizer's files only: no config.json
            copy_tokenizer_files(path, tmp)
            return AutoTokenizer.from_pretrained(tmp, **kwargs)
    except Exception as e:  # noqa: BLE001  (any loading failure: one line)
        raise ExportError(
            f"{path}: not a Hugging Face tokenizer directory ({error_line(e)})"
        ) from None


def hf_token_ids(path: str) -> tuple[dict[str, int], int]:
    """``({pad, unk, cls, sep, mask: id}, vocabulary size)`` of the tokenizer directory."""
    tok = load_hf_tokenizer(path)
    ids, _, missing = hf_special_tokens(tok)
    if missing:
        raise ExportError(f"{path}: the tokenizer has no {missing[0]}")
    return ids, max(tok.get_vocab().values()) + 1


def token_id_options(tokenizer_path: str) -> dict[str, int]:
    """``config.json``'s ``bos/eos/cls/sep/unk/mask_token_id`` for the tokenizer written
    (SentencePiece: the fixed ids; a Hugging Face tokenizer: its own)."""
    if is_hf_tokenizer(tokenizer_path):
        ids = hf_token_ids(tokenizer_path)[0]
    else:
        ids = dict(SPECIAL_IDS)
    return {"bos_token_id": ids["cls"], "eos_token_id": ids["sep"], "unk_token_id": ids["unk"],
            "mask_token_id": ids["mask"], "cls_token_id": ids["cls"],
            "sep_token_id": ids["sep"]}  # fmt: skip


def check_tokenizer(sp_model_path: str, model_config: ModelConfig) -> int:
    """Check the tokenizer's special ids and size against the model; returns its size. A
    SentencePiece model must have data_prep's fixed ids; a Hugging Face tokenizer directory
    (``tokenizer.json``) must have every special token and the model's pad id."""
    if is_hf_tokenizer(sp_model_path):
        ids, size = hf_token_ids(sp_model_path)
        if size > model_config.vocab_size:
            raise ExportError(f"{sp_model_path}: {size} ids, more than the model's vocab_size "
                              f"{model_config.vocab_size}")  # fmt: skip
        if model_config.pad_token_id != ids["pad"]:
            raise ExportError(f"model.pad_token_id={model_config.pad_token_id} but the tokenizer "
                              f"{sp_model_path} pads with id {ids['pad']}")  # fmt: skip
        return size
    try:
        sp = spm.SentencePieceProcessor(model_file=sp_model_path)
    except (OSError, RuntimeError) as e:
        raise ExportError(f"{sp_model_path}: not a SentencePiece model ({e})") from e
    size = sp.get_piece_size()
    if size > model_config.vocab_size:
        raise ExportError(
            f"{sp_model_path}: {size} pieces, more than the model's vocab_size "
            f"{model_config.vocab_size}"
        )
    for piece, want in SPECIAL_TOKENS.values():
        got = sp.piece_to_id(piece)
        if got != want or sp.id_to_piece(got) != piece:
            raise ExportError(
                f"{sp_model_path}: special token {piece!r} has id {got}, expected {want}"
            )
    if model_config.pad_token_id != SPECIAL_TOKENS["pad_token"][1]:
        raise ExportError(
            f"model.pad_token_id={model_config.pad_token_id} but the tokenizer pads with id "
            f"{SPECIAL_TOKENS['pad_token'][1]}"
        )
    return size


def write_tokenizer(out: str, sp_model_path: str, model_max_length: int) -> None:
    """Copy the SentencePiece model and write the fast tokenizer ``AutoTokenizer`` loads.

    ``tokenizer.json`` holds the SentencePiece model converted by transformers' own converter
    and a post-processor that adds ``<s> ... </s>`` (pairs: ``<s> A </s> B </s>``); transformers
    writes it back on every ``save_pretrained`` / ``Trainer.save_model``, so the pattern survives
    round trips. The ids are checked against SentencePiece's own before anything is written.
    A Hugging Face tokenizer directory is saved as it is (``save_pretrained``), with
    ``model_max_length`` N_max and no ``token_type_ids`` (the model has none).
    """
    if is_hf_tokenizer(sp_model_path):
        tok = load_hf_tokenizer(sp_model_path, model_max_length=int(model_max_length),
                                model_input_names=["input_ids", "attention_mask"])  # fmt: skip
        _mask_takes_left_space(tok)
        tok.save_pretrained(out)
        return
    shutil.copyfile(sp_model_path, os.path.join(out, "tokenizer.model"))
    build_fast_tokenizer(sp_model_path, model_max_length).save_pretrained(out)


# Texts the converted tokenizer must encode exactly as SentencePiece does (spaces, tabs,
# newlines, punctuation, accents, symbols outside a small vocabulary).
_CHECK_TEXTS = (
    "def encode(self, o):\n    return  o + 1  # done",
    "  JSON (JavaScript Object Notation) is a subset of JavaScript  ",
    "unicode: caf\u00e9 \u2603 tabs\tand   spaces, numbers 12,345.67e-8",
)


def _mask_takes_left_space(tok: Any) -> None:
    """A Hugging Face tokenizer's mask token strips the spaces on its left, as RoBERTa's: in
    ``be <mask>`` the space is the masked word's (byte-level BPE's ``Ġ``), not a token of its
    own before the mask (the training data's ids, issue 45 item 6). WordPiece drops the space
    either way."""
    from tokenizers import AddedToken

    mask = getattr(tok, "mask_token", None)
    if mask is None or tok.mask_token_id is None:
        return
    before = tok.mask_token_id
    tok.add_special_tokens({"mask_token": AddedToken(str(mask), lstrip=True, rstrip=False,
                                                     normalized=False, special=True)})  # fmt: skip
    if tok.mask_token_id != before:
        raise ExportError(f"the tokenizer's mask token {mask!r} changed its id when made to "
                          "strip the spaces on its left")  # fmt: skip


def _literal_mask_pipeline(backend: Any, proto: Any) -> bool:
    """Make ``backend`` (the converted SentencePiece tokenizer) encode a text that holds the
    literal mask token as the training data placed it: the text's own ids with the masked
    piece's id replaced by the mask id (issue 45 item 6). Returns whether it did (then the mask
    token must strip the spaces on its left: a word-initial piece's ``▁`` is the mask's).

    transformers' converter normalizes (strips) and prefixes ``▁`` (``prepend_scheme:
    always``) each chunk between added tokens, so ``be <mask>: and`` became ``▁be <mask> ▁ :
    ▁and``: a stray ``▁`` the model never saw after a mask. Here only the text's start gets
    SentencePiece's dummy prefix (``first``), spaces after a mask stay the next word's ``▁``,
    and only the text's end loses its spaces (before a mask, the mask takes them). Done for the
    normalizer settings data_prep trains with (dummy prefix, extra-whitespace removal and
    whitespace escaping all on); another SentencePiece model keeps the converter's pipeline."""
    from tokenizers import Regex, normalizers, pre_tokenizers

    spec = proto.normalizer_spec
    if not (spec.add_dummy_prefix and spec.remove_extra_whitespaces and spec.escape_whitespaces):
        return False
    steps = (
        [normalizers.Precompiled(spec.precompiled_charsmap)] if spec.precompiled_charsmap else []
    )
    steps += [
        normalizers.Replace(Regex("\\A\u2581"), "\u2581\u2581"),  # a literal ▁ first: prefixed
        normalizers.Replace(Regex(" +\\z"), ""),
        normalizers.Replace(Regex(" {2,}"), " "),
        normalizers.Replace(" ", "\u2581"),
    ]
    backend.normalizer = normalizers.Sequence(steps)
    pre = [pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)]
    user_defined = [p.piece for p in proto.pieces if p.type == 4]  # emitted whole (converter)
    if user_defined:
        pattern = "|".join(re.escape(u) for u in sorted(user_defined, key=len, reverse=True))
        pre.append(pre_tokenizers.Split(Regex(pattern), behavior="isolated"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(pre)
    return True


def build_fast_tokenizer(sp_model_path: str, model_max_length: int) -> Any:
    """A ``PreTrainedTokenizerFast`` equivalent to the SentencePiece model (ids checked)."""
    from tokenizers import AddedToken, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import SpmConverter

    proto = pb.ModelProto()
    with open(sp_model_path, "rb") as f:
        proto.ParseFromString(f.read())
    pieces = [(p.piece, p.score) for p in proto.pieces]
    kind = proto.trainer_spec.model_type  # 1 unigram, 2 bpe, 3 word, 4 char
    if kind not in (1, 2):
        raise ExportError(f"{sp_model_path}: only unigram and bpe SentencePiece models convert")
    vocab = pieces if kind == 1 else {piece: i for i, (piece, _) in enumerate(pieces)}
    backend = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab)
    mask_text = _literal_mask_pipeline(backend, proto)
    names = {name: piece for name, (piece, _) in SPECIAL_TOKENS.items()}
    added = {name: AddedToken(piece, special=True, normalized=False,
                              lstrip=mask_text and name == "mask_token")
             for name, piece in names.items()}  # fmt: skip
    backend.add_special_tokens(list(added.values()))
    bos, eos = SPECIAL_TOKENS["bos_token"], SPECIAL_TOKENS["eos_token"]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos[0]} $A {eos[0]}",
        pair=f"{bos[0]} $A {eos[0]} $B:1 {eos[0]}:1",
        special_tokens=[bos, eos],
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        model_max_length=int(model_max_length),
        padding_side="right",
        model_input_names=["input_ids", "attention_mask"],  # no token_type_ids: none in the model
        clean_up_tokenization_spaces=False,
        **added,
        **CLS_SEP,
    )
    sp = spm.SentencePieceProcessor(model_file=sp_model_path)
    for text in _CHECK_TEXTS:
        want = [bos[1], *sp.encode(text), eos[1]]
        got = tok(text)["input_ids"]
        if got != want:
            raise ExportError(
                f"{sp_model_path}: the converted tokenizer encodes {text!r} as {got}, "
                f"SentencePiece as {want}"
            )
    return tok


def remote_code() -> dict[str, str]:
    """``{file name: text}`` of the remote code: the model package and the HF wrappers, with their
    package imports made flat."""
    out = {}
    for name, (src, rewrites) in REMOTE_CODE.items():
        text = src.read_text()
        for old, new in rewrites:
            if old not in text:
                raise ExportError(f"{src}: expected import {old!r} not found (remote code layout)")
            text = text.replace(old, new)
        out[name] = text
    return out


def write_remote_code(out: str) -> dict[str, str]:
    """Write the remote code files into ``out``; returns ``{file name: sha256}``."""
    digests = {}
    for name, text in remote_code().items():
        Path(out, name).write_text(text)
        digests[name] = _sha256(Path(out, name).read_bytes())
    return digests


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_remote_code(model_dir: str) -> str | None:
    """Why the code files of the export ``model_dir`` must not run unasked, or None when each
    ``*.py`` there has the sha256 recorded in its ``config.json`` at export time and every
    ``auto_map`` entry (config and tokenizer) names one of them (no other file, no Hub repo)."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        return f"its config.json cannot be read ({e})"
    recorded = config.get(CODE_SHA_KEY) if isinstance(config, dict) else None
    if not (isinstance(recorded, dict) and recorded
            and all(isinstance(v, str) for v in recorded.values())):  # fmt: skip
        return (f"its config.json records no sha256 of its code files ({CODE_SHA_KEY}: exported "
                "before linformer_ds recorded them, or edited)")  # fmt: skip
    present = sorted(p.name for p in Path(model_dir).glob("*.py"))
    problems = [f"{n} is not recorded" for n in present if n not in recorded]
    problems += [f"{n} is missing" for n in sorted(recorded) if n not in present]
    problems += [
        f"{n} differs from the sha256 recorded at export"
        for n in sorted(recorded)
        if n in present and _sha256(Path(model_dir, n).read_bytes()) != recorded[n]
    ]
    maps = [config.get("auto_map")]
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(model_dir, "tokenizer_config.json"), encoding="utf-8") as f:
            maps.append(json.load(f).get("auto_map"))
    for auto_map in maps:
        for value in (auto_map or {}).values() if isinstance(auto_map, dict) else [auto_map]:
            for ref in value if isinstance(value, list) else [value]:
                if ref is not None and (
                    not isinstance(ref, str) or "--" in ref
                    or f"{ref.split('.')[0]}.py" not in recorded
                ):  # fmt: skip
                    problems.append(f"auto_map names {ref!r}, not a recorded code file")
    return "; ".join(problems) or None


def write_model_dir(
    out: str,
    model_config: ModelConfig,
    state_dict: dict[str, torch.Tensor],
    sp_model_path: str,
    architecture: str = "LinformerForMaskedLM",
    dtype: str = "float32",
    config_extra: dict[str, Any] | None = None,
    provenance: dict[str, Any] | None = None,
) -> None:
    """Write a self-contained HF model directory ``out`` (which must not exist yet or be empty).

    ``state_dict`` uses the training model's names (tied decoder weight left out);
    ``config_extra`` adds ``PretrainedConfig`` options (``id2label``, ...).
    """
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise ExportError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    check_tokenizer(sp_model_path, model_config)
    os.makedirs(out, exist_ok=True)
    tensors = {
        k: (v.to(DTYPES[dtype]) if v.is_floating_point() else v).detach().cpu().contiguous()
        for k, v in state_dict.items()
    }
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})

    extra = dict(config_extra or {})
    for name, token_id in token_id_options(sp_model_path).items():  # (pad: the model's)
        extra.setdefault(name, token_id)
    # lazy: transformers (optional, seconds to import) only when a directory is written
    from linformer_ds.hf.configuration_linformer import LinformerConfig

    hf_config = LinformerConfig.from_model_config(model_config, **extra)
    hf_config.architectures = [architecture]
    hf_config.auto_map = dict(AUTO_MAP)
    hf_config.dtype = dtype
    setattr(hf_config, CODE_SHA_KEY, write_remote_code(out))  # checked before the code runs
    hf_config.save_pretrained(out)
    write_tokenizer(out, sp_model_path, model_config.max_seq_len)
    if provenance is not None:  # with the tokenizer files' sha256 (tokenizer_identity)
        _write_json(
            os.path.join(out, "linformer_export.json"),
            {"export_format_version": EXPORT_FORMAT_VERSION, **provenance,
             "tokenizer": tokenizer_record(out)},
        )  # fmt: skip
    apply_umask(out)


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def apply_umask(directory: str) -> None:
    """Give ``directory`` and the files in it the modes any new file gets (0777/0666 & ~umask):
    ``tempfile.mkdtemp`` makes 0700 and some writers 0600, unreadable to the rest of a team."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for root, dirs, files in os.walk(directory):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o777 & ~umask)
        for f in files:
            os.chmod(os.path.join(root, f), 0o666 & ~umask)
