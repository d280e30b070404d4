"""Warm start from a Hugging Face BERT or RoBERTa directory (issue 32): the source's weights
in our Linformer encoder (``checkpoint.init_from: hf:PATH``, read at a fresh start).

The mapping is exact: with dense attention in every layer, the converted model gives the
source's last hidden states and MLM logits (tests/test_warm_start.py: within 1e-5 in fp32).

* embeddings: word -> ``token_embeddings``; the token-type row 0 (every input is one segment)
  is added to every row of ``position_embeddings``; LayerNorm -> ``embed_ln``.
* positions: BERT's row j is position j; RoBERTa's position j is row ``padding_idx + 1 + j``
  (offset 2). The table is extended to ``model.max_seq_len`` by copying the source's P learned
  positions along it (Longformer's recipe): row j = source position ``j mod P``.
* layers (post-LN, erf GELU): query/key/value -> ``attention.qkv`` (concatenated), attention
  output -> ``attention.out``, its LayerNorm -> ``ln1``; intermediate/output -> ``ffn.fc1`` /
  ``fc2``, output LayerNorm -> ``ln2``.
* MLM head: transform dense + GELU + LayerNorm -> ``lm_head.dense/ln``; decoder (tied to the
  word embeddings unless the source unties them) and its bias -> ``lm_head.decoder``. A source
  without an MLM head (``BertModel``) leaves our head at its initialisation (said so).
* E/F (linear) and conv kernels are not in the source: ``model.projection_init`` sets them
  (``pooling``: each summary slot averages a window of positions; see docs/export.md).
* the BERT pooler is dropped.

The source is read with json and safetensors/torch only (no transformers import). What cannot
be mapped is refused in one line: another model_type, relative position embeddings, another
activation, a decoder, and a model section or data vocabulary that does not match.
"""

import argparse
import json
import os
import re
import shlex
from typing import Any

import torch
import yaml
from omegaconf import OmegaConf

from linformer_ds.config_fields import ConfigError
from linformer_ds.config_yaml import load_yaml
from linformer_ds.log import LogLevelError, get_logger, setup_logging
from linformer_ds.model import ModelConfig, layer_kinds
from linformer_ds.outdir import error_line
from linformer_ds.outpath import OutPathError, check_out_file, interrupted, staged

logger = get_logger(__name__)

HF_PREFIX = "hf:"
MODEL_TYPES = ("bert", "roberta")
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")  # fmt: skip


class WarmStartError(ConfigError):
    """The source cannot be mapped onto the model; one line naming the problem."""


def source_path(spec: str) -> str:
    """``hf:PATH`` -> PATH (WarmStartError for any other form)."""
    if not isinstance(spec, str) or not spec.startswith(HF_PREFIX) or not spec[3:].strip():
        raise WarmStartError(f"checkpoint.init_from: must be hf:PATH (a Hugging Face BERT or "
                             f"RoBERTa directory) or null, got {spec!r}")  # fmt: skip
    return spec[len(HF_PREFIX) :]


def read_source_config(path: str) -> dict[str, Any]:
    """The source's ``config.json``, checked to be a BERT or RoBERTa encoder we can map."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise WarmStartError(f"hf:{path}: not a directory (a save_pretrained output)")
    if not os.path.isfile(cfg_path):
        raise WarmStartError(f"hf:{path}: no config.json (a save_pretrained output has one)")
    try:
        with open(cfg_path) as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:
        raise WarmStartError(f"{cfg_path}: unreadable ({e})") from None
    if not isinstance(hf, dict):
        raise WarmStartError(f"{cfg_path}: not a JSON object")
    problem = source_problem(hf)
    if problem:
        raise WarmStartError(f"hf:{path}: {problem}")
    return hf


def source_problem(hf: dict[str, Any]) -> str | None:
    """Why ``config.json`` ``hf`` cannot be mapped onto our encoder (None: it can)."""
    kind = hf.get("model_type")
    if kind not in MODEL_TYPES:
        return f"model_type {kind!r} cannot be converted (only {' and '.join(MODEL_TYPES)})"
    pos = hf.get("position_embedding_type", "absolute")
    if pos != "absolute":
        return (f"position_embedding_type {pos!r}: only absolute learned positions map onto "
                "our position table")  # fmt: skip
    act = hf.get("hidden_act", "gelu")
    if act != "gelu":
        return f"hidden_act {act!r}: our layers and MLM head use the exact (erf) GELU ('gelu')"
    if hf.get("is_decoder") or hf.get("add_cross_attention"):
        return "a decoder (is_decoder / add_cross_attention): only encoders convert"
    sizes = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "intermediate_size", "max_position_embeddings")  # fmt: skip
    missing = [k for k in sizes if k not in hf or hf[k] is None]
    if missing:
        return f"config.json lacks {', '.join(missing)}"
    wrong = [f"{k}={hf[k]!r}" for k in sizes
             if not isinstance(hf[k], int) or isinstance(hf[k], bool)]  # fmt: skip
    if wrong:
        return f"config.json: {', '.join(wrong)}: sizes must be integers"
    if source_positions(hf) < 1:
        return f"max_position_embeddings {hf['max_position_embeddings']} leaves no position"
    return None


def position_offset(hf: dict[str, Any]) -> int:
    """The source row of position 0: RoBERTa's positions start after its padding index."""
    pad = hf.get("pad_token_id")
    return (1 if pad is None else int(pad)) + 1 if hf["model_type"] == "roberta" else 0


def source_positions(hf: dict[str, Any]) -> int:
    """P, the number of learned positions of the source (BERT 512, RoBERTa 514 - 2)."""
    return int(hf["max_position_embeddings"]) - position_offset(hf)


def model_options(hf: dict[str, Any]) -> dict[str, Any]:
    """The ``model.*`` options the source fixes (sizes, post-LN, eps, pad id, tying) and the
    ones it suggests (dropouts, initializer_range); the Linformer options are the run's."""
    return {
        "vocab_size": int(hf["vocab_size"]),
        "hidden_size": int(hf["hidden_size"]),
        "num_layers": int(hf["num_hidden_layers"]),
        "num_heads": int(hf["num_attention_heads"]),
        "intermediate_size": int(hf["intermediate_size"]),
        "layer_norm_eps": float(hf.get("layer_norm_eps", 1e-12)),
        "norm": "post",
        "pad_token_id": int(hf.get("pad_token_id") or 0),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
        "dropout": float(hf.get("hidden_dropout_prob", 0.1)),
        "attention_dropout": float(hf.get("attention_probs_dropout_prob", 0.1)),
        "initializer_range": float(hf.get("initializer_range", 0.02)),
    }


# the options that give the weights their meaning: the run's model section must equal them
FIXED = ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
         "layer_norm_eps", "norm", "pad_token_id", "tie_word_embeddings")  # fmt: skip


def check_model(model: ModelConfig, hf: dict[str, Any], where: str) -> None:
    """WarmStartError naming every ``model.*`` option that differs from the source's."""
    want = model_options(hf)
    diff = [f"model.{k}={getattr(model, k)!r} (source: {want[k]!r})"
            for k in FIXED if getattr(model, k) != want[k]]  # fmt: skip
    if diff:
        raise WarmStartError(
            f"{where}: the model section does not match the source: {', '.join(diff)} "
            "(launch/convert.py prints the matching section)"
        )


def check_vocabulary(hf: dict[str, Any], data_vocab: int | None, where: str, data: str,
                     data_ids: dict[str, int] | None = None) -> None:  # fmt: skip
    """The data's tokenizer must be the source's: refuse another vocabulary size, or special ids
    (the data manifest's ``special_ids``) that differ from the source config's token ids or from
    the special tokens of the tokenizer saved beside the source (if any)."""
    src = source_path(where) if where.startswith(HF_PREFIX) else ""
    if data_vocab is not None and int(data_vocab) != int(hf["vocab_size"]):
        raise WarmStartError(
            f"{where}: the source's vocabulary has {hf['vocab_size']} ids, the data's tokenizer "
            f"({data}) {data_vocab}: {retokenize_advice(src, data) if src else RETOKENIZE}"
        )
    if not data_ids:
        return
    source = {key: hf.get(f"{name}_token_id") for name, key in CONFIG_IDS}
    source.update(source_tokenizer_ids(src))
    wrong = [f"{k} {v} (data: {data_ids.get(k)})" for k, v in source.items()
             if v is not None and k in data_ids and int(v) != int(data_ids[k])]  # fmt: skip
    if wrong:
        raise WarmStartError(
            f"{where}: the source's special ids differ from the data's tokenizer ({data}): "
            f"{', '.join(wrong)}: {retokenize_advice(src, data) if src else RETOKENIZE}"
        )


RETOKENIZE = "the data must be tokenized with the source's tokenizer"


def retokenize_advice(source: str, data: str) -> str:
    """What to do when the data's vocabulary is not the source's (``source``: the source's
    directory, ``data``: a data_prep output): ``model.vocab_size`` is the source's (the weights
    fix it), so the data must be tokenized again with the source's tokenizer. The data_prep
    command that does it, with the options the data's manifest records (sources, N, packing,
    split); a source without a tokenizer.json (what ``--tokenizer DIR`` reads) is told to save
    one first."""
    try:
        with open(os.path.join(data, "manifest.json"), encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        manifest = {}
    manifest = manifest if isinstance(manifest, dict) else {}
    src = manifest.get("source") if isinstance(manifest.get("source"), dict) else {}
    split = manifest.get("split") if isinstance(manifest.get("split"), dict) else {}
    specs = [str(x) for x in src.get("specs") or ["SOURCE"]]
    # a path that starts with "-" would read as a flag: the same path from "./"
    specs = [os.path.join(".", x) if x.startswith("-") else x for x in specs]
    cmd = ["python", "-m", "data_prep", "--tokenizer", source, "--source", *specs]
    options = (("--text-column", src.get("text_column"), "text"),
               ("--encoding", src.get("encoding"), "utf-8"),
               ("--max-docs", src.get("max_docs"), None),
               ("--max-bytes", src.get("max_bytes"), None),
               ("--seq-len", manifest.get("seq_len", "N"), ""),
               ("--packing", manifest.get("packing"), "full"),
               ("--valid-fraction", split.get("valid_fraction"), 0.01),
               ("--seed", split.get("seed"), 0))  # fmt: skip
    for flag, value, default in options:
        if value is not None and value != default:
            cmd += [flag, str(value)]
    name = os.path.basename(os.path.normpath(source)) or "source"
    cmd += ["--out", f"{os.path.normpath(data)}_{name}"]
    line = shlex.join(cmd)
    if not os.path.isfile(os.path.join(source, "tokenizer.json")):
        return (f"{RETOKENIZE} (model.vocab_size is the source's): save it beside the source "
                f"first (AutoTokenizer.from_pretrained(...).save_pretrained({source!r}) writes "
                f"tokenizer.json), then {line}")  # fmt: skip
    return f"{RETOKENIZE} (model.vocab_size is the source's): {line}"


# config.json token ids -> the data manifest's special_ids keys
CONFIG_IDS = (("pad", "pad"), ("bos", "cls"), ("eos", "sep"), ("cls", "cls"), ("sep", "sep"),
              ("mask", "mask"), ("unk", "unk"))  # fmt: skip


def source_tokenizer_ids(path: str) -> dict[str, int]:
    """The special ids of the tokenizer saved beside the source (``tokenizer.json`` with its
    ``tokenizer_config.json``: what ``save_pretrained`` writes), by the data manifest's keys;
    empty when there is none. Read with ``tokenizers`` (no transformers import)."""
    tok_json = os.path.join(path, "tokenizer.json")
    tok_cfg = os.path.join(path, "tokenizer_config.json")
    if not (os.path.isfile(tok_json) and os.path.isfile(tok_cfg)):
        return {}
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(tok_json)
        with open(tok_cfg, encoding="utf-8") as f:
            config = json.load(f)
    except Exception as e:  # noqa: BLE001  (tokenizers raises its own Exception type)
        raise WarmStartError(f"{HF_PREFIX}{path}: its tokenizer cannot be read ({e})") from None
    out: dict[str, int] = {}
    for name, key in CONFIG_IDS:
        token = config.get(f"{name}_token")
        token = token.get("content") if isinstance(token, dict) else token
        token_id = tok.token_to_id(token) if isinstance(token, str) else None
        if token_id is not None:
            out.setdefault(key, int(token_id))
    return out


# ==================================================================== tokenizer identity
def check_data_tokenizer(where: str, data: str, manifest: dict[str, Any] | None) -> str:
    """The data's tokenizer is the source's (the one check, :func:`~linformer_ds.
    tokenizer_identity.check_tokenizers`: the same file, or the same pieces id for id and, for
    a tokenizer.json beside the source, the same model, normalizer, pre-tokenizer and special
    tokens); WarmStartError naming both files and what differs. Returns the ``[init]`` line's
    note on the comparison."""
    from linformer_ds.tokenizer_identity import (
        SOURCE_FILES,
        TokenizerMismatch,
        check_tokenizers,
        of_data,
        of_source,
    )

    path = source_path(where)
    src = of_source(path)
    if src is None:
        return f"tokenizer: not compared (no {', '.join(SOURCE_FILES)} beside the source)"
    got = of_data(data, manifest) if manifest else None
    if got is None:
        return f"tokenizer: not compared (no data tokenizer recorded for {data or 'the run'})"
    try:
        return check_tokenizers(got, src)
    except TokenizerMismatch as e:
        raise WarmStartError(f"{where}: {e}: the data must be tokenized with the source's "
                             f"tokenizer (data_prep --tokenizer {path})") from None  # fmt: skip


# ====================================================================================== weights
def _load_file(path: str) -> dict[str, torch.Tensor]:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file  # optional dependency (the hf extra)

        sd = load_file(path)
    else:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ValueError(f"not a state dict of tensors (a {type(sd).__name__})")
    return sd


def read_source_weights(path: str) -> dict[str, torch.Tensor]:
    """The source's state dict (safetensors or pytorch_model.bin, single or sharded); any read
    error (truncated, empty, not the format its name says) is one line naming the file."""
    found = next((f for f in _WEIGHT_FILES if os.path.isfile(os.path.join(path, f))), None)
    if found is None:
        raise WarmStartError(f"hf:{path}: no weights ({' or '.join(_WEIGHT_FILES[::2])})")
    full = os.path.join(path, found)
    try:
        if found.endswith(".index.json"):
            with open(full) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
            sd: dict[str, torch.Tensor] = {}
            for name in files:
                full = os.path.join(path, name)
                sd.update(_load_file(full))
            return sd
        return _load_file(full)
    except Exception as e:  # noqa: BLE001  (SafetensorError, UnpicklingError, zip errors, ...)
        raise WarmStartError(f"{full}: unreadable weights ({error_line(e)})") from None


_LAYER_RE = re.compile(r"^encoder\.layer\.(\d+)\.")


def check_weights(hf: dict[str, Any], source: dict[str, torch.Tensor], where: str) -> None:
    """config.json agrees with the weights (vocabulary, width, positions, layers, FFN width,
    token types); WarmStartError naming every key that does not."""
    sd = _strip(source, hf["model_type"])

    def shape(name: str) -> tuple[int, ...] | None:
        t = sd.get(name)
        return tuple(t.shape) if t is not None else None

    wrong: list[str] = []

    def agree(key: str, stored: int | None, what: str) -> None:
        if stored is not None and key in hf and hf[key] != stored:
            wrong.append(f"{key}={hf[key]!r} (the weights store {stored} {what})")

    word = shape("embeddings.word_embeddings.weight")
    agree("vocab_size", word[0] if word else None, "ids: embeddings.word_embeddings")
    agree("hidden_size", word[1] if word and len(word) > 1 else None,
          "features: embeddings.word_embeddings")  # fmt: skip
    pos = shape("embeddings.position_embeddings.weight")
    agree("max_position_embeddings", pos[0] if pos else None,
          "rows: embeddings.position_embeddings")  # fmt: skip
    types = shape("embeddings.token_type_embeddings.weight")
    agree("type_vocab_size", types[0] if types else None, "rows: embeddings.token_type_embeddings")
    layers = {int(m.group(1)) for m in map(_LAYER_RE.match, sd) if m}
    agree("num_hidden_layers", max(layers) + 1 if layers else 0, "layers: encoder.layer.*")
    fc1 = shape("encoder.layer.0.intermediate.dense.weight")
    agree("intermediate_size", fc1[0] if fc1 else None,
          "rows: encoder.layer.0.intermediate.dense")  # fmt: skip
    if wrong:
        raise WarmStartError(f"{where}: config.json does not agree with the weights: "
                             f"{', '.join(wrong)}: fix config.json or the weights")  # fmt: skip


def _strip(sd: dict[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
    """Names without the ``bert.`` / ``roberta.`` prefix, old ``gamma``/``beta`` renamed."""
    out = {}
    for name, t in sd.items():
        if name.startswith(kind + "."):
            name = name[len(kind) + 1 :]
        name = name.replace("LayerNorm.gamma", "LayerNorm.weight")
        name = name.replace("LayerNorm.beta", "LayerNorm.bias")
        out[name] = t
    return out


def extend_positions(table: torch.Tensor, length: int) -> torch.Tensor:
    """``[P, D]`` learned positions -> ``[length, D]``: row j is row ``j mod P`` (Longformer's
    copy; shorter: the first ``length`` rows)."""
    p = table.shape[0]
    return table[torch.arange(length) % p].clone()


def convert_state_dict(
    source: dict[str, torch.Tensor], hf: dict[str, Any], model: ModelConfig
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Our state dict (float32; E/F and conv kernels absent) from the source's, and notes on
    what was not mapped one to one (dropped pooler, missing head)."""
    kind = hf["model_type"]
    sd = _strip(source, kind)
    notes: list[str] = []

    def take(name: str) -> torch.Tensor:
        if name not in sd:
            raise WarmStartError(f"the source has no weight {name!r} ({kind} layout expected)")
        return sd.pop(name).float()

    out: dict[str, torch.Tensor] = {}
    word = take("embeddings.word_embeddings.weight")
    out["encoder.token_embeddings.weight"] = word
    pos = take("embeddings.position_embeddings.weight")
    off = position_offset(hf)
    pos = pos[off:]
    types = sd.pop("embeddings.token_type_embeddings.weight", None)
    if types is not None:
        pos = pos + types[0].float()  # every input is segment 0
    out["encoder.position_embeddings.weight"] = extend_positions(pos, model.max_seq_len)
    out["encoder.embed_ln.weight"] = take("embeddings.LayerNorm.weight")
    out["encoder.embed_ln.bias"] = take("embeddings.LayerNorm.bias")
    for i in range(model.num_layers):
        src, dst = f"encoder.layer.{i}.", f"encoder.layers.{i}."
        for part in ("weight", "bias"):
            out[dst + f"attention.qkv.{part}"] = torch.cat(
                [take(src + f"attention.self.{m}.{part}") for m in ("query", "key", "value")]
            )
            pairs = (("attention.output.dense", "attention.out"),
                     ("attention.output.LayerNorm", "ln1"), ("intermediate.dense", "ffn.fc1"),
                     ("output.dense", "ffn.fc2"), ("output.LayerNorm", "ln2"))  # fmt: skip
            for a, b in pairs:
                out[dst + f"{b}.{part}"] = take(src + f"{a}.{part}")
    head = _head_names(sd, kind)
    if head is None:
        notes.append("the source has no MLM head: lm_head keeps its initialisation")
    else:
        for ours, theirs in head.items():
            if ours == "lm_head.decoder.weight" and model.tie_word_embeddings:
                out[ours] = word  # tied: the word embeddings (a save may omit the copy)
            else:
                out[ours] = take(theirs)
    if any(k.startswith("pooler.") for k in sd):
        notes.append("the pooler is dropped")
    return out, notes


def _head_names(sd: dict[str, torch.Tensor], kind: str) -> dict[str, str] | None:
    """Our MLM head's names -> the source's (None: the source has no head)."""
    if kind == "bert":
        p, names = "cls.predictions.", ("transform.dense", "transform.LayerNorm", "decoder")
    else:
        p, names = "lm_head.", ("dense", "layer_norm", "decoder")
    if f"{p}{names[0]}.weight" not in sd:
        return None
    # the decoder's own bias is the one its forward adds (tied to ``bias`` unless untied)
    bias = f"{p}decoder.bias" if f"{p}decoder.bias" in sd else f"{p}bias"
    return {
        "lm_head.dense.weight": f"{p}{names[0]}.weight",
        "lm_head.dense.bias": f"{p}{names[0]}.bias",
        "lm_head.ln.weight": f"{p}{names[1]}.weight",
        "lm_head.ln.bias": f"{p}{names[1]}.bias",
        "lm_head.decoder.weight": f"{p}{names[2]}.weight",
        "lm_head.decoder.bias": bias,
    }


def _projection_param(name: str) -> bool:
    """E/F or conv kernels (layerwise-shared or per layer): not in any source."""
    return ".shared_" in f".{name}" or ".proj_k." in name or ".proj_v." in name


def _projection_init_note(cfg: ModelConfig) -> str:
    """What ``model.projection_init`` set, for the ``[init]`` line: the E/F (or conv kernels) of
    the layers whose kind has learned, freezable summary weights (each kind answers); a model
    without such layers (dense, dynamic: computed from the input, local, routed) has none."""
    kinds = layer_kinds(cfg)
    with_ef = [k.name for i, k in enumerate(kinds) if k.freezable and k.parameters_of(cfg, i)]
    names = ", ".join(dict.fromkeys(k.name for k in kinds))
    if not with_ef:
        return f"no E/F to initialise ({names} layers)"
    if len(with_ef) == len(kinds):
        return f"E/F: {cfg.projection_init}"
    return f"E/F: {cfg.projection_init} ({', '.join(dict.fromkeys(with_ef))} layers)"


def check_source(spec: str, model: ModelConfig, data_vocab: int | None = None,
                 data: str = "", data_ids: dict[str, int] | None = None,
                 manifest: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """Everything but the weights: the source maps, the model section and the data's
    vocabulary, special ids and (with the data's ``manifest``) pieces match it (WarmStartError
    otherwise); returns its config.json."""
    hf = read_source_config(source_path(spec))
    check_model(model, hf, spec)
    check_vocabulary(hf, data_vocab, spec, data, data_ids)
    return hf


def load_into(model: torch.nn.Module, spec: str, data_vocab: int | None = None,
              data: str = "", weights: dict[str, torch.Tensor] | None = None,
              tokenizer_note: str | None = None) -> str:  # fmt: skip
    """Load source ``spec`` (``hf:PATH``) into ``model`` (a task model built from its config,
    whole: before any sharding); returns the one-line summary for the run's log, which says
    what was copied. ``weights``: the source's state dict when already read (and checked)."""
    cfg: ModelConfig = model.config
    hf, path = check_source(spec, cfg, data_vocab, data), source_path(spec)
    if weights is None:
        weights = read_source_weights(path)
        check_weights(hf, weights, spec)
    table = _strip(weights, hf["model_type"]).get("embeddings.position_embeddings.weight")
    weights, notes = convert_state_dict(weights, hf, cfg)
    ours = model.state_dict()
    wrong = [f"{k} {tuple(v.shape)} vs {tuple(ours[k].shape)}" for k, v in weights.items()
             if k in ours and v.shape != ours[k].shape]  # fmt: skip
    if wrong:
        raise WarmStartError(f"{spec}: shapes differ: {', '.join(wrong[:3])}")
    missing, unexpected = model.load_state_dict(weights, strict=False)
    headless = not any(k.startswith("lm_head.") for k in weights)
    missing = [
        k
        for k in missing
        if not _projection_param(k) and not (headless and k.startswith("lm_head."))
    ]
    if missing or unexpected:
        raise WarmStartError(f"{spec}: not mapped: {', '.join((missing + unexpected)[:4])}")
    # what was copied: the rows of the source's table after RoBERTa's offset, the layers taken
    rows = table.shape[0] if table is not None else hf["max_position_embeddings"]
    p = rows - position_offset(hf)
    rule = (f"{p} positions copied to {cfg.max_seq_len}" if cfg.max_seq_len > p
            else f"the first {cfg.max_seq_len} of {p} positions")  # fmt: skip
    layers = len({k.split(".")[2] for k in weights if k.startswith("encoder.layers.")})
    where = f"{hf['model_type']}, {rule}, {layers} layers, {_projection_init_note(cfg)}"
    if not headless:
        notes.insert(0, "MLM head copied")
    if tokenizer_note:
        notes.append(tokenizer_note)
    return f"[init] weights from {spec} ({where}{''.join('; ' + n for n in notes)})"


class WarmStart:
    """A run's ``checkpoint.init_from``: checked when made (before any collective: the source,
    the model section, the data's vocabulary and pieces, config.json against the weights),
    loaded by :meth:`load`. Nothing to do when ``spec`` is None (no init_from, or a resume: the
    checkpoint has the weights)."""

    def __init__(self, spec: str | None, model: ModelConfig, data_vocab: int | None = None,
                 data: str = "", data_ids: dict[str, int] | None = None,
                 manifest: dict[str, Any] | None = None):  # fmt: skip
        self.spec, self.data_vocab, self.data = spec, data_vocab, data
        self.weights: dict[str, torch.Tensor] | None = None
        self.note: str | None = None
        if spec is not None:
            try:
                hf = check_source(spec, model, data_vocab, data, data_ids)
                self.note = check_data_tokenizer(spec, data, manifest)
                self.weights = read_source_weights(source_path(spec))
                check_weights(hf, self.weights, spec)
            except WarmStartError as e:  # name the key
                key = "checkpoint.init_from"
                raise WarmStartError(str(e) if str(e).startswith(key) else f"{key}: {e}") from None

    @classmethod
    def for_run(cls, cfg: Any, resume_tag: str | None, dataset: Any) -> "WarmStart":
        """``cfg`` a job config, ``dataset`` its first train split (ShardDataset)."""
        spec = cfg.checkpoint.init_from if resume_tag is None else None
        manifest = getattr(dataset, "manifest", {}) or {}
        ids = dict(manifest.get("special_ids") or {})
        return cls(spec, cfg.model, dataset.vocab_size, str(dataset.path), ids, manifest)

    def load(self, model: torch.nn.Module, log: Any = None) -> None:
        """The source's weights into ``model`` (whole, before any sharding); ``log`` the line
        (default: the package logger, INFO)."""
        if self.spec is not None:
            weights, self.weights = self.weights, None  # read once, at the check
            (log or logger.info)(
                load_into(model, self.spec, self.data_vocab, self.data, weights, self.note)
            )


def model_section(hf: dict[str, Any], **linformer: Any) -> dict[str, Any]:
    """The ``model:`` section that matches source ``hf``, with the run's Linformer options
    (max_seq_len, projection, k, sharing, projection_init, ...)."""
    section = model_options(hf)
    section.update({k: v for k, v in linformer.items() if v is not None})
    ModelConfig(**section)  # checked like a job config's
    return section


# ========================================================================= launch/convert.py
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Check a Hugging Face BERT/RoBERTa directory for a warm start and write the "
        "job config that starts from it (checkpoint.init_from, the matching model section).",
    )
    p.add_argument("--from", dest="source", required=True, help="hf:PATH (save_pretrained dir)")
    p.add_argument("--out", help="the job config to write (default: print it); a new file "
                   "unless --overwrite, never an input or inside one")  # fmt: skip
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    p.add_argument("--config", help="a job config the written one builds on (its defaults:)")
    p.add_argument("--data", help="a data_prep output: its tokenizer must be the source's")
    p.add_argument("overrides", nargs="*", help="model.KEY=VALUE: the Linformer options "
                   "(max_seq_len, projection, k, sharing, projection_init, ...)")  # fmt: skip
    return p.parse_intermixed_args(argv)  # overrides before, between or after the options


def _overrides(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("model.") or "." in key[6:]:
            raise WarmStartError(f"override {item!r}: only model.KEY=VALUE (a model option)")
        out[key[6:]] = yaml.safe_load(value)
    return out


def job_config_text(spec: str, section: dict[str, Any], base: str | None,
                    note: str = "") -> str:  # fmt: skip
    """The YAML of a job config: ``defaults: base``, the model section, ``init_from``."""
    head = f"# warm start from {spec} (launch/convert.py); see docs/export.md\n"
    if note:
        head += f"# {note}\n"
    if base:
        head += f"defaults: {os.path.abspath(base)}\n"
    body = {"model": section, "checkpoint": {"init_from": spec}}
    return head + yaml.safe_dump(body, sort_keys=False)


def _base_model(path: str) -> dict[str, Any]:
    """The ``model:`` section of job config ``path`` (with its ``defaults:`` chain)."""
    model = OmegaConf.to_container(load_yaml(path), resolve=True).get("model") or {}
    return dict(model) if isinstance(model, dict) else {}


def main(argv: list[str] | None = None) -> int:
    """Exit 0 with the config written (or printed), 2 with one line naming the problem."""
    args = parse_args(argv)
    try:
        setup_logging()
        if args.out is not None:  # before any work: the output never destroys what existed
            inputs = [("--from", args.source[len(HF_PREFIX):] if args.source.startswith(
                HF_PREFIX) else None), ("--config", args.config), ("--data", args.data)]  # fmt: skip
            check_out_file(args.out, inputs, args.overwrite)
        spec = HF_PREFIX + os.path.abspath(source_path(args.source))
        hf = read_source_config(source_path(spec))
        wanted = _overrides(args.overrides)
        clash = [f"model.{k}={v!r} (source: {model_options(hf)[k]!r})"
                 for k, v in wanted.items() if k in FIXED and v != model_options(hf)[k]]  # fmt: skip
        if clash:
            raise WarmStartError(f"{spec}: the source fixes {', '.join(clash)}")
        if args.config and not os.path.isfile(args.config):
            raise WarmStartError(f"--config {args.config}: no such file")
        section = {**model_options(hf), **wanted}
        base = _base_model(args.config) if args.config else {}
        try:  # checked as the written config will be read: the base's model under it
            ModelConfig(**{**base, **section})
        except (ValueError, TypeError) as e:
            raise WarmStartError(str(e).splitlines()[0]) from None
        if args.data:
            manifest = os.path.join(args.data, "manifest.json")
            try:
                with open(manifest) as f:
                    m = json.load(f)
                vocab, ids = int(m["vocab_size"]), dict(m.get("special_ids") or {})
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise WarmStartError(f"{manifest}: unreadable ({e})") from None
            check_vocabulary(hf, vocab, spec, args.data, ids)
            note = check_data_tokenizer(spec, args.data, m)
        else:
            note = "tokenizer: not compared (no --data)"
        check_weights(hf, read_source_weights(source_path(spec)), spec)
        text = job_config_text(spec, section, args.config, note)
        if args.out is not None:
            with staged(args.out) as tmp:
                with open(tmp, "w", encoding="utf-8") as f:
                    f.write(text)
            print(f"wrote {args.out}: launch/pretrain.py --config {args.out} [key=value ...]")
        else:
            print(text, end="")
        return 0
    except (ConfigError, OSError, OutPathError, LogLevelError) as e:
        logger.error(f"error: {' '.join(str(e).split())}")
        return 2
    except KeyboardInterrupt:
        return interrupted("error", args.out)
