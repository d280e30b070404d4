"""Export a DeepSpeed checkpoint to a self-contained Hugging Face model directory.

    python launch/export.py --checkpoint CKPT_DIR [--tag step_00001000] --out OUT [--dtype bfloat16]

The weights are consolidated with DeepSpeed's own ``zero_to_fp32`` functions (ZeRO 1-3, and
stage 0 with a bf16 optimizer); a stage-0 checkpoint without ZeRO optimizer files is read from
DeepSpeed's model-states file. The model is described by the ``linformer_meta.json`` the trainer
writes (JSON, never a pickle). ``OUT`` holds::

    config.json                 model_type "linformer", architectures, auto_map, every model option
    model.safetensors           weights (the tied MLM decoder weight is not stored)
    configuration_linformer.py  remote code: LinformerConfig
    modeling_linformer.py       remote code: LinformerModel, ...ForMaskedLM, ...ForSequenceClassification,
                                ...ForTokenClassification, ...ForQuestionAnswering, ...ForMultipleChoice
    linformer_model.py, *.py    the package linformer_ds/model/ file for file (its __init__ as
                                linformer_model.py; torch + stdlib only)
    tokenizer.model             the SentencePiece model (data made with a Hugging Face tokenizer:
                                that tokenizer's files instead, as save_pretrained writes them)
    tokenizer.json              the same model as a fast tokenizer, post-processor <s> X </s>
    tokenizer_config.json       AutoTokenizer -> TokenizersBackend, special tokens, N_max
    linformer_export.json       provenance: checkpoint (a relative path), tag, step, dtype, config

and loads with ``transformers`` alone (``trust_remote_code=True``), no linformer_ds installed.
The directory is written by :mod:`linformer_ds.model_dir` (also finetune's writer).
``config.json`` records the sha256 of each code file (``linformer_code_sha256``): finetune runs
the code only when they still match (:func:`check_remote_code`). The tag read is pinned (a shared
lock the trainer's pruning respects) and ``OUT`` is locked while the export runs.
"""

import argparse
import contextlib
import glob
import os
import shutil
import tempfile
import warnings
from typing import Any

import sentencepiece as spm
import torch

from linformer_ds import dirlock, outdir
from linformer_ds.checkpoint.io import safe_torch_load, weights_only_torch_load
from linformer_ds.checkpoint.tags import (
    META_FILE,
    MODEL_STATES,
    CheckpointError,
    resolve_checkpoint,
    sharded_sp_size,
    tag_problem,
)
from linformer_ds.checkpoint.tags import read_meta as read_tag_meta
from linformer_ds.log import LogLevelError, get_logger, setup_logging
from linformer_ds.model import LinformerForMaskedLM, ModelConfig, ModelConfigError
from linformer_ds.model_dir import (  # noqa: F401  (re-exported: the export's writer)
    AUTO_MAP,
    CODE_SHA_KEY,
    DTYPES,
    EXPORT_FORMAT_VERSION,
    REMOTE_CODE,
    SPECIAL_TOKENS,
    ExportError,
    apply_umask,
    build_fast_tokenizer,
    check_remote_code,
    check_tokenizer,
    hf_token_ids,
    is_hf_tokenizer,
    load_hf_tokenizer,
    remote_code,
    write_model_dir,
    write_remote_code,
    write_tokenizer,
)
from linformer_ds.parallel.sharding import consolidate_sharded
from linformer_ds.special_tokens import SPECIAL_IDS

TIED_KEY, TIED_SOURCE = "lm_head.decoder.weight", "encoder.token_embeddings.weight"
log = get_logger(__name__)


# ==================================================================================== checkpoint
def resolve_tag(checkpoint: str, tag: str | None = None) -> tuple[str, str]:
    """``(checkpoint_dir, tag)``, validated by the checkpoint manager's rules."""
    try:
        return resolve_checkpoint(checkpoint, tag)
    except CheckpointError as e:
        raise ExportError(f"--checkpoint {e}") from None


def read_meta(tag_dir: str) -> tuple[dict[str, Any], ModelConfig]:
    """The checkpoint's metadata and the ``ModelConfig`` it describes."""
    try:
        meta = read_tag_meta(os.path.dirname(tag_dir), os.path.basename(tag_dir))
    except CheckpointError as e:
        raise ExportError(str(e)) from None
    path = os.path.join(tag_dir, META_FILE)
    if not isinstance(meta.get("model"), dict):
        raise ExportError(f"{path}: has no 'model' section")
    try:
        model_config = ModelConfig.from_dict(meta["model"])
    except (ModelConfigError, TypeError) as e:
        raise ExportError(f"{path}: invalid model config: {e}") from e
    ids = meta.get("special_ids")
    sentencepiece = str(meta.get("tokenizer", "tokenizer.model")).endswith(".model")
    if sentencepiece and ids and any(int(ids.get(k, v)) != v for k, v in SPECIAL_IDS.items()):
        raise ExportError(
            f"{path}: the data was made with special ids {ids}; this exporter writes tokenizers "
            f"with data_prep's fixed ids {SPECIAL_IDS}"
        )
    return meta, model_config


def _listing(d: str, n: int = 8) -> str:
    names = sorted(os.listdir(d))
    return ", ".join(names[:n]) + (", ..." if len(names) > n else "") if names else "nothing"


def consolidate(checkpoint_dir: str, tag: str) -> dict[str, torch.Tensor]:
    """Full fp32 state dict of a ZeRO 0-3 checkpoint, by DeepSpeed's own consolidation (E/F
    and positions sharded over sequence-parallel ranks are joined whole)."""
    try:
        p = sharded_sp_size(read_tag_meta(checkpoint_dir, tag))
    except CheckpointError:
        p = 1
    if p > 1:
        return consolidate_sharded(checkpoint_dir, tag, p, _consolidate_one)
    return _consolidate_one(checkpoint_dir, tag)


def _consolidate_one(checkpoint_dir: str, tag: str) -> dict[str, torch.Tensor]:
    tag_dir = os.path.join(checkpoint_dir, tag)
    if glob.glob(os.path.join(tag_dir, "*_optim_states.pt")):
        try:
            with weights_only_torch_load():
                return _consolidate_zero(checkpoint_dir, tag)
        except CheckpointError as e:  # a file holding a pickled payload (it did not run)
            raise ExportError(str(e)) from None
        except (RuntimeError, ValueError, KeyError, OSError, EOFError, AssertionError) as e:
            raise ExportError(
                f"{tag_dir}: DeepSpeed's zero_to_fp32 could not read it ({outdir.error_line(e)})"
            ) from None
    return _consolidate_stage0(tag_dir)


def _consolidate_zero(checkpoint_dir: str, tag: str) -> dict[str, torch.Tensor]:
    """Weights of a ZeRO 1-3 checkpoint (fp32 master copy), via zero_to_fp32 lazy mode."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    lazy = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=tag, lazy_mode=True)
    out: dict[str, torch.Tensor] = {}
    done: dict[int, str] = {}
    for name, t in lazy.items():  # shared entries are one object: materialise it once
        if id(t) in done:
            out[name] = out[done[id(t)]]
        else:
            done[id(t)] = name
            full = t.contiguous()  # a GatheredTensor: concatenates this tensor's fragments
            out[name] = full.float() if full.is_floating_point() else full
    return out


def _consolidate_stage0(tag_dir: str) -> dict[str, torch.Tensor]:
    """ZeRO stage 0 without a ZeRO optimizer: the full weights are in the model-states file."""
    path = os.path.join(tag_dir, MODEL_STATES)
    if not os.path.isfile(path):
        raise ExportError(
            f"{tag_dir} holds neither ZeRO optimizer shards (*_optim_states.pt) nor "
            f"{MODEL_STATES}: not a DeepSpeed checkpoint (found: {_listing(tag_dir)})"
        )
    try:
        states = safe_torch_load(path)  # weights_only=True: no pickled code runs
    except CheckpointError as e:
        raise ExportError(str(e)) from None
    if "module" not in states:
        raise ExportError(f"{path} has no 'module' state dict")
    module = states["module"]
    if any(t.dtype in (torch.float16, torch.bfloat16) for t in module.values()):
        log.warning(
            f"warning: {path} holds 16-bit weights and no fp32 master copy; exporting those"
        )
    return {k: (v.float() if v.is_floating_point() else v) for k, v in module.items()}


def check_state_dict(
    state_dict: dict[str, torch.Tensor], model_config: ModelConfig, where: str
) -> dict[str, torch.Tensor]:
    """Match the consolidated weights to the model the config builds; returns what to store.

    Missing, unexpected or mis-shaped keys mean the config does not describe these weights. The
    tied decoder weight is dropped (the model re-ties it); if DeepSpeed recovered it, it must be
    the embedding itself (DeepSpeed issue 1896: a shared parameter recovered from the wrong
    partner).
    """
    with torch.device("meta"):
        reference = LinformerForMaskedLM(model_config).state_dict()
    tied = model_config.tie_word_embeddings
    expected = {k: tuple(v.shape) for k, v in reference.items() if not (tied and k == TIED_KEY)}
    got = {k: v for k, v in state_dict.items() if not (tied and k == TIED_KEY)}
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    shapes = sorted(
        f"{k}: checkpoint {tuple(got[k].shape)} vs config {expected[k]}"
        for k in set(expected) & set(got)
        if tuple(got[k].shape) != expected[k]
    )
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing {_short(missing)}")
        if unexpected:
            parts.append(f"unexpected {_short(unexpected)}")
        if shapes:
            parts.append(f"shape mismatch {_short(shapes)}")
        raise ExportError(
            f"{where}: the weights do not match the model config in {META_FILE} ("
            + "; ".join(parts)
            + ")"
        )
    if tied and TIED_KEY in state_dict and not torch.equal(state_dict[TIED_KEY], got[TIED_SOURCE]):
        raise ExportError(
            f"{where}: {TIED_KEY} is tied to {TIED_SOURCE} but the consolidated values differ "
            "(shared-parameter recovery went wrong, cf. DeepSpeed issue 1896)"
        )
    return {k: got[k] for k in sorted(got)}


def _short(items: list[str], n: int = 6) -> str:
    return ", ".join(items[:n]) + (f", ... ({len(items)} in all)" if len(items) > n else "")


# ===================================================================================== writing
def check_checkpoint_tokenizer(
    sp_model_path: str | None, tag_dir: str, meta: dict[str, Any]
) -> None:
    """The tokenizer written with the export is the one the checkpoint was trained with: the
    tag's own copy must still be the data's (the sha256 its metadata records), and
    ``--tokenizer`` (``sp_model_path``; None: the tag's own is written) must be that tokenizer
    by the one identity check (:func:`~linformer_ds.tokenizer_identity.check_tokenizers`:
    the same file, or the same pieces, normalizer, pre-tokenizer, ...); without a copy in the
    tag, its vocabulary size must be the one the checkpoint's data had."""
    from linformer_ds.tokenizer_identity import (
        TokenizerMismatch,
        check_tokenizers,
        of_file,
        of_model,
    )

    own = of_model(tag_dir, "the checkpoint's")
    given = of_file(sp_model_path, "--tokenizer") if sp_model_path else None
    hint = "; omit --tokenizer to export the checkpoint's own"
    try:
        check_tokenizers(given, own)
    except TokenizerMismatch as e:
        if given is None:
            raise ExportError(f"{e}: the checkpoint {tag_dir} was changed after training") from None
        raise ExportError(f"--tokenizer {sp_model_path}: another tokenizer than the checkpoint was "
                          f"trained with ({e}){hint}") from None  # fmt: skip
    if given is None or (own is not None and os.path.exists(own.path)):
        return
    if is_hf_tokenizer(sp_model_path):
        size = max(load_hf_tokenizer(sp_model_path).get_vocab().values()) + 1
    else:
        size = spm.SentencePieceProcessor(model_file=sp_model_path).get_piece_size()
    sizes = {d.get("vocab_size") for d in meta.get("data") or [] if isinstance(d, dict)}
    sizes.discard(None)
    if sizes and size not in sizes:
        raise ExportError(
            f"--tokenizer {sp_model_path}: {size} pieces, the checkpoint was trained on "
            f"data with a vocabulary of {sorted(sizes)[0]}{hint}"
        )


def check_special_ids(tokenizer: str, meta: dict[str, Any], tag_dir: str) -> None:
    """A Hugging Face tokenizer written with the export must have the special ids the model
    was trained with (the checkpoint's metadata records the data's)."""
    want = meta.get("special_ids")
    if not is_hf_tokenizer(tokenizer) or not isinstance(want, dict) or not want:
        return
    got = hf_token_ids(tokenizer)[0]
    wrong = [f"{k} {got.get(k)} (trained with {v})" for k, v in want.items() if got.get(k) != v]
    if wrong:
        raise ExportError(f"tokenizer {tokenizer}: special ids {', '.join(wrong)}; the "
                          f"checkpoint {tag_dir} was trained with {want}")  # fmt: skip


PROVENANCE = ("portable", "full")


def portable_paths(obj: Any, base: str | None = None) -> Any:
    """``obj`` (JSON-like) with every absolute path made shareable: relative to ``base``
    (default: the working directory) when inside it, else ``.../<last component>``."""
    base = os.path.abspath(base or os.getcwd())
    if isinstance(obj, dict):
        return {k: portable_paths(v, base) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [portable_paths(v, base) for v in obj]
    if isinstance(obj, str) and os.path.isabs(obj):
        path = os.path.normpath(obj)
        if path == base or path.startswith(base.rstrip(os.sep) + os.sep):
            return os.path.relpath(path, base)
        return ".../" + os.path.basename(path)
    return obj


# ======================================================================================= export
def export_checkpoint(
    checkpoint: str,
    out: str,
    tag: str | None = None,
    dtype: str = "float32",
    tokenizer: str | None = None,
    overwrite: bool = False,
    provenance: str = "portable",
) -> str:
    """Export ``checkpoint`` (tag ``tag``, default: ``latest``) to ``out``; returns ``out``.

    ``provenance='portable'`` (default) writes the paths in ``linformer_export.json`` relative to
    the working directory (or as ``.../name`` outside it); ``'full'`` keeps them absolute.
    """
    if dtype not in DTYPES:
        raise ExportError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if provenance not in PROVENANCE:
        raise ExportError(f"--provenance must be one of {PROVENANCE}, got {provenance!r}")
    try:  # the output contract before the lock file is made beside it (again once locked)
        outdir.check_out(out, "export", _inputs(checkpoint, tokenizer), overwrite)
    except outdir.OutDirError as e:
        raise ExportError(str(e)) from None
    with contextlib.ExitStack() as held:  # --out locked, the tag pinned: released at the end
        try:
            lock = held.enter_context(dirlock.output_lock(out, "export"))
            if lock.stale_note():
                log.warning(lock.stale_note())
        except dirlock.LockError as e:
            raise ExportError(str(e)) from None
        except OSError:  # no lock file can be made there: the --out checks below say why
            pass
        return _export(checkpoint, out, tag, dtype, tokenizer, overwrite, provenance, held)


def _inputs(checkpoint: str, tokenizer: str | None) -> list[tuple[str, str | None]]:
    return [("--checkpoint", checkpoint), ("--tokenizer", tokenizer)]


def _export(
    checkpoint: str,
    out: str,
    tag: str | None,
    dtype: str,
    tokenizer: str | None,
    overwrite: bool,
    provenance: str,
    held: contextlib.ExitStack,
) -> str:
    """:func:`export_checkpoint` once ``out`` is locked; ``held`` keeps the tag pinned."""
    try:  # before anything else: --out never replaces what export did not create
        state = outdir.check_out(out, "export", _inputs(checkpoint, tokenizer), overwrite)
    except outdir.OutDirError as e:
        raise ExportError(str(e)) from None
    if state == "exists":
        raise ExportError(f"--out {out} holds an earlier export; pass --overwrite to replace it")
    ckpt, tag_dir = _resolve_and_pin(checkpoint, tag, held)
    tag = os.path.basename(tag_dir)
    meta, model_config = read_meta(tag_dir)
    sp_path = tokenizer or os.path.join(tag_dir, str(meta.get("tokenizer", "tokenizer.model")))
    if not os.path.exists(sp_path):
        raise ExportError(
            f"tokenizer {sp_path} not found: the checkpoint has no tokenizer; pass --tokenizer "
            "PATH/tokenizer.model (or a Hugging Face tokenizer directory)"
        )
    check_tokenizer(sp_path, model_config)
    check_special_ids(sp_path, meta, tag_dir)
    check_checkpoint_tokenizer(tokenizer, tag_dir, meta)
    out = os.path.abspath(out)
    if os.path.exists(os.path.dirname(out)) and not os.path.isdir(os.path.dirname(out)):
        raise ExportError(f"--out {out}: {os.path.dirname(out)} is not a directory")
    try:  # --out writable? (before the slow consolidation)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        tempfile.TemporaryDirectory(prefix=".export-probe-", dir=os.path.dirname(out)).cleanup()
    except OSError as e:
        raise ExportError(f"--out {out}: cannot write there: {e.strerror or e}") from None
    state_dict = check_state_dict(consolidate(ckpt, tag), model_config, tag_dir)

    # Write next to the target, then swap in: a failed export leaves no half-written model and
    # the previous export (if any) whole.
    try:
        tmp = outdir.staging_dir(out, "export")  # 0700: write_model_dir fixes the modes
    except OSError as e:
        raise ExportError(f"--out {out}: cannot write there: {e.strerror or e}") from None
    record = {
        "checkpoint": ckpt,
        "tag": tag,
        "step": meta.get("step"),
        "dtype": dtype,
        "training_config": meta.get("config"),
    }
    try:
        write_model_dir(
            tmp,
            model_config,
            state_dict,
            sp_path,
            dtype=dtype,
            provenance=record if provenance == "full" else portable_paths(record),
        )
        apply_umask(tmp)
        _verify_weights(tmp, state_dict, dtype)
        outdir.swap_in(tmp, out)
    except ExportError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except Exception as e:  # e.g. the disk filled up: the partial copy goes, --out is untouched
        shutil.rmtree(tmp, ignore_errors=True)
        raise ExportError(outdir.write_error(e, f"--out {out}")) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _resolve_and_pin(
    checkpoint: str, tag: str | None, held: contextlib.ExitStack, attempts: int = 5
) -> tuple[str, str]:
    """``(checkpoint_dir, tag_dir)``, the tag pinned in ``held`` until the export ends (the
    trainer's pruning leaves it alone). A tag pruned between choosing and pinning it is chosen
    again (the newest, when no ``--tag`` was given)."""
    for _ in range(attempts):
        ckpt, name = resolve_tag(checkpoint, tag)
        tag_dir = os.path.join(ckpt, name)
        if held.enter_context(dirlock.pin_tag(tag_dir)) and tag_problem(ckpt, name) is None:
            return ckpt, tag_dir
        if tag is not None:
            break
    raise ExportError(
        f"--checkpoint {tag_dir} was removed or changed (pruned by the running training?) "
        "before export could pin it; run export again"
    )


def _verify_weights(out: str, state_dict: dict[str, torch.Tensor], dtype: str) -> None:
    """Read the written file back: every tensor equals the consolidated one (after the cast)."""
    from safetensors.torch import load_file

    written = load_file(os.path.join(out, "model.safetensors"))
    if set(written) != set(state_dict):
        raise ExportError(f"{out}/model.safetensors: keys differ from the consolidated weights")
    for k, v in state_dict.items():
        want = v.to(DTYPES[dtype]) if v.is_floating_point() else v
        if not torch.equal(written[k], want):
            raise ExportError(f"{out}/model.safetensors: {k} differs from the consolidated weights")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line of ``launch/export.py``."""
    p = argparse.ArgumentParser(
        description="Export a linformer_ds DeepSpeed checkpoint to a Hugging Face model directory."
    )
    p.add_argument("--checkpoint", required=True, help="checkpoint.dir of the training run")
    p.add_argument("--tag", default=None, help="tag to export (default: the one in 'latest')")
    p.add_argument("--out", required=True, help="output directory (created)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--tokenizer", default=None, help="SentencePiece model or Hugging Face "
                   "tokenizer directory (default: the tag's)")  # fmt: skip
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--provenance", default="portable", choices=PROVENANCE,
                   help="paths in linformer_export.json: relative to the working directory "
                   "(portable, default) or absolute (full)")  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status."""
    args = parse_args(argv)
    outdir.ignore_file_size_signal()
    with warnings.catch_warnings(record=True) as caught:  # shown after success: an error
        warnings.simplefilter("default")  # is one line
        try:
            setup_logging()
            out = export_checkpoint(
                args.checkpoint, args.out, args.tag, args.dtype, args.tokenizer, args.overwrite,
                args.provenance,
            )  # fmt: skip
        except (ExportError, LogLevelError) as e:
            return outdir.fail("export failed", str(e))
        except KeyboardInterrupt:  # the staging copy is already gone; --out untouched
            return outdir.fail("export interrupted", f"nothing written to --out {args.out}", 130)
    for w in caught:
        log.warning(f"warning: {w.message}")
    print(f"exported {args.checkpoint} -> {out} ({args.dtype})")  # the result: stdout
    return 0
