"""ONNX export of a Hugging Face model directory written by ``launch/export.py`` (or finetune).

``python -m linformer_ds.onnx_export EXPORT_DIR OUT.onnx`` loads the directory with
``transformers`` (its own remote code, float32), exports it with ``torch.onnx.export``
(the dynamo exporter) with dynamic batch and sequence axes, and checks onnxruntime against
PyTorch at batch sizes 1, 2 and 7 and two lengths (padded rows included).

Inputs ``input_ids`` and ``attention_mask`` (int64 ``[batch, seq]``, ``2 <= seq <=
max_seq_len``); outputs: the task's (``logits`` of the MLM or a classifier, ``start_logits``
and ``end_logits`` of QA) and ``last_hidden_state [batch, seq, D]``. Not exported:
``position_ids`` (document isolation: per-document spans are data-dependent shapes),
``inputs_embeds``, multiple choice. Needs the ``onnx`` extra (onnx, onnxscript, onnxruntime).

Run the file with :func:`session` (onnxruntime with all graph optimisations, as many threads as
torch uses, workers that sleep rather than spin between operators: on a shared or busy machine
spinning workers cost more than they save). Its speed against eager PyTorch is measured by
``bench/onnx_bench.py`` (BENCHMARKS.md).
"""

import sys

if __name__ == "__main__":  # the command: Ctrl-C while torch imports is one line, exit 130
    from linformer_ds import entry

    entry.arm("onnx_export")

import argparse
import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from linformer_ds.errors import LinformerError
from linformer_ds.log import LogLevelError, get_logger, setup_logging
from linformer_ds.model import ModelConfig, onnx_problem
from linformer_ds.outdir import error_line, write_error
from linformer_ds.outpath import OutPathError, check_out_file, interrupted, staged

log = get_logger(__name__)

# architecture in config.json -> (transformers Auto class, output fields besides the hidden state)
TASKS: dict[str, tuple[str, tuple[str, ...]]] = {
    "LinformerModel": ("AutoModel", ()),
    "LinformerForMaskedLM": ("AutoModelForMaskedLM", ("logits",)),
    "LinformerForSequenceClassification": ("AutoModelForSequenceClassification", ("logits",)),
    "LinformerForTokenClassification": ("AutoModelForTokenClassification", ("logits",)),
    "LinformerForQuestionAnswering": (
        "AutoModelForQuestionAnswering",
        ("start_logits", "end_logits"),
    ),
}
INPUT_NAMES = ["input_ids", "attention_mask"]
CHECK_BATCHES = (1, 2, 7)
TOLERANCE = 1e-4  # max |onnxruntime - PyTorch| accepted by the check (float32)


class OnnxExportError(LinformerError, RuntimeError):
    """The ONNX export cannot proceed or its check failed; the message says why."""


class _Outputs(nn.Module):
    """``(input_ids, attention_mask) -> (task outputs..., last_hidden_state)`` as a tuple."""

    def __init__(self, model: nn.Module, fields: Sequence[str]):
        super().__init__()
        self.model, self.fields = model, tuple(fields)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple:
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
            return_dict=True,
        )  # fmt: skip
        return tuple(getattr(out, f) for f in self.fields) + (out.hidden_states[-1],)


def _kind_problem(config: Any) -> str | None:
    """Why the attention kinds of ``config.json``'s model cannot export (each kind answers,
    :func:`linformer_ds.model.onnx_problem`); None: they can, or the options are not ours to
    read (the loader then says what is wrong)."""
    if not isinstance(config, dict):
        return None
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    try:
        model_config = ModelConfig.from_dict({k: v for k, v in config.items() if k in known})
    except (ValueError, TypeError):
        return None
    problem = onnx_problem(model_config)
    return None if problem is None else f"does not export to ONNX: {problem}"


def load(model_dir: str, architecture: str | None = None) -> tuple[nn.Module, list[str]]:
    """The directory's model (float32, eval mode) wrapped by :class:`_Outputs`, and the output
    names. ``architecture``: one of :data:`TASKS` (default: the one in ``config.json``)."""
    import transformers

    from linformer_ds.model_dir import check_remote_code

    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise OnnxExportError(f"{model_dir}: not an exported model directory ({e})") from None
    mixer = config.get("local_mixer", "none") if isinstance(config, dict) else "none"
    if mixer not in (None, "none"):
        raise OnnxExportError(
            f"{model_dir}: local_mixer {mixer!r} does not export to ONNX (torch.export cannot "
            "hold its per-document windows over a dynamic sequence axis: 'Constraints violated "
            "(seq)'); run it in PyTorch, or export a model trained with local_mixer: none"
        )
    kind_problem = _kind_problem(config)
    if kind_problem is not None:
        raise OnnxExportError(f"{model_dir}: {kind_problem}")
    arch = architecture or (config.get("architectures") or ["LinformerForMaskedLM"])[0]
    if arch not in TASKS:
        raise OnnxExportError(
            f"{model_dir}: architecture {arch!r} cannot be exported to ONNX; one of {sorted(TASKS)}"
        )
    problem = check_remote_code(model_dir)
    if problem is not None:
        raise OnnxExportError(f"{model_dir}: its code will not be run: {problem}")
    check_weights_file(model_dir)
    auto, fields = TASKS[arch]
    try:
        model = (
            getattr(transformers, auto)
            .from_pretrained(model_dir, trust_remote_code=True, dtype=torch.float32)
            .eval()
        )
    except (OSError, ValueError, RuntimeError, TypeError, KeyError) as e:  # (any library's)
        raise OnnxExportError(f"{model_dir}: the model does not load ({error_line(e)})") from None
    code = sys.modules[type(model.encoder).__module__]
    if not hasattr(code, "tracing"):
        raise OnnxExportError(
            f"{model_dir}: its modeling code predates ONNX export (linformer_model.py has no "
            "tracing()); export the checkpoint again with this version"
        )
    return _Outputs(model, fields), list(fields) + ["last_hidden_state"]


WEIGHTS_FILE = "model.safetensors"  # what launch/export.py and finetune write


def check_weights_file(model_dir: str) -> None:
    """``model_dir``'s ``model.safetensors`` opens as safetensors (its header parses, its tensors'
    offsets are consistent and fill the file exactly): a truncated, padded or overwritten file is
    :class:`OnnxExportError` naming it, not a library's traceback from inside ``from_pretrained``.
    Reads the header only. (No file: ``from_pretrained`` says what it looked for.)"""
    path = os.path.join(model_dir, WEIGHTS_FILE)
    if not os.path.isfile(path):
        return
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            f.keys()
    except Exception as e:  # noqa: BLE001  (SafetensorError, OSError, ...: the file is the problem)
        raise OnnxExportError(f"{path}: not a readable safetensors file ({error_line(e)}); "
                              "export the model again (launch/export.py)") from None  # fmt: skip


def _inputs(batch: int, n: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids ``[batch, n]`` (no special ids below 5) and a mask with padding: the last row
    right-padded after half its length, the first (batch > 1) left-padded by a quarter."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (batch, n), generator=g)
    mask = torch.ones(batch, n, dtype=torch.long)
    mask[-1, max(1, n // 2) :] = 0
    if batch > 1:
        mask[0, : n // 4] = 0
    ids = ids.masked_fill(mask == 0, 0)  # pad id
    return ids, mask


@contextlib.contextmanager
def _size_oblivious():
    """Reason about sizes without assuming 0/1 specialisation (conv blocks: c may be 1)."""
    try:
        from torch.fx.experimental import _config as fx_config

        patch = fx_config.patch(backed_size_oblivious=True)
    except (ImportError, AttributeError):  # an older torch: plain export
        patch = contextlib.nullcontext()
    with patch:
        yield


def export_onnx(
    model_dir: str,
    out: str,
    architecture: str | None = None,
    optimize: bool = True,
    check: bool = True,
    lengths: Sequence[int] | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write ``out`` (an ``.onnx`` file) from the export ``model_dir``; with ``check``, compare
    onnxruntime with PyTorch at :data:`CHECK_BATCHES` x ``lengths`` (default: a short length
    and ``max_seq_len``). Returns ``{"outputs", "export_s", "check": [{"batch", "seq",
    <output>: max abs diff}]}``; raises :class:`OnnxExportError` beyond :data:`TOLERANCE`.

    ``out`` follows the output contract (:mod:`linformer_ds.outpath`): checked before any work
    (an existing file only with ``overwrite``; never the input directory or inside it), written
    under a temporary name and renamed into place once the check has passed."""
    try:
        check_out_file(out, [("model_dir", model_dir)], overwrite, flag="OUT")
    except OutPathError as e:
        raise OnnxExportError(str(e)) from None
    wrapper, names = load(model_dir, architecture)
    cfg = wrapper.model.config
    n_max, vocab = int(cfg.max_seq_len), int(cfg.vocab_size)
    if n_max < 2:
        raise OnnxExportError(f"{model_dir}: max_seq_len {n_max} < 2")
    batch = torch.export.Dim("batch", min=1)
    seq = torch.export.Dim("seq", min=2, max=n_max)  # 1 would need its own graph (size 1)
    example = _inputs(2, max(2, n_max // 2 + 1), vocab, seed=0)
    start = time.perf_counter()
    try:
        with torch.no_grad(), _size_oblivious():
            program = torch.export.export(
                wrapper, example, dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}),
                strict=False,
            )  # fmt: skip
            onnx_program = torch.onnx.export(
                program, example, input_names=INPUT_NAMES, output_names=names, dynamo=True,
                optimize=optimize, verify=False, verbose=False,
            )  # fmt: skip
    except Exception as e:  # torch.export's and the translator's many error types
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise OnnxExportError(f"{model_dir}: torch.onnx.export failed: {first}") from e
    result: dict[str, Any] = {"outputs": names, "check": []}
    with staged(out) as tmp:
        try:
            onnx_program.save(tmp)
        except OSError as e:
            raise OnnxExportError(write_error(e, out)) from None
        result["export_s"] = round(time.perf_counter() - start, 1)
        if check:
            lengths = lengths or (max(2, min(n_max, 17)), n_max)
            try:
                result["check"] = check_onnx(wrapper, tmp, names, vocab, lengths)
            except OnnxExportError as e:  # named by the output, not its temporary name
                raise OnnxExportError(str(e).replace(tmp, out)) from None
    return result


def session(path: str, threads: int | None = None, spinning: bool = False) -> Any:
    """An onnxruntime CPU session of ``path``: every graph optimisation, ``threads`` intra-op
    threads (default: torch's), one inter-op thread, and (``spinning`` False) workers that wait
    passively between operators instead of spinning."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = int(threads or torch.get_num_threads())
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def check_onnx(
    wrapper: nn.Module, path: str, names: Sequence[str], vocab: int, lengths: Sequence[int]
) -> list[dict[str, Any]]:
    """Max abs difference of every output, onnxruntime vs PyTorch, at each batch size of
    :data:`CHECK_BATCHES` and each length; :class:`OnnxExportError` beyond :data:`TOLERANCE`."""
    sess = session(path)
    rows = []
    for b in CHECK_BATCHES:
        for n in lengths:
            ids, mask = _inputs(b, n, vocab, seed=b * 1000 + n)
            with torch.no_grad():
                want = wrapper(ids, mask)
            got = sess.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})
            row: dict[str, Any] = {"batch": b, "seq": n}
            for name, w, g in zip(names, want, got):
                row[name] = float((torch.from_numpy(g) - w).abs().max())
            rows.append(row)
            worst = max(row[name] for name in names)
            if not worst <= TOLERANCE:
                raise OnnxExportError(
                    f"{path}: onnxruntime differs from PyTorch by {worst:.3g} (> {TOLERANCE}) "
                    f"at batch {b}, length {n}: {row}"
                )
    return rows


def main(argv: list[str] | None = None) -> int:
    """``python -m linformer_ds.onnx_export EXPORT_DIR OUT.onnx``; returns the exit status."""
    p = argparse.ArgumentParser(
        description="Export a linformer_ds Hugging Face model directory to ONNX (dynamic batch "
        "and sequence axes) and check onnxruntime against PyTorch."
    )
    p.add_argument("model_dir", help="directory written by launch/export.py or finetune")
    p.add_argument("out", help="the .onnx file to write (a new file unless --overwrite; never "
                   "inside model_dir)")  # fmt: skip
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT file")
    p.add_argument("--architecture", default=None, choices=sorted(TASKS),
                   help="model class (default: the directory's config.json)")  # fmt: skip
    p.add_argument("--no-optimize", action="store_true", help="skip onnxscript's graph optimizer")
    p.add_argument("--no-check", action="store_true", help="skip the onnxruntime comparison")
    args = p.parse_args(argv)
    try:
        setup_logging()
        result = export_onnx(
            args.model_dir, args.out, args.architecture, not args.no_optimize, not args.no_check,
            overwrite=args.overwrite,
        )  # fmt: skip
    except (OnnxExportError, OSError, LogLevelError) as e:
        log.error(f"onnx export failed: {' '.join(str(e).split())}")
        return 1
    except KeyboardInterrupt:
        return interrupted("onnx export", args.out)
    for row in result["check"]:  # the result (the comparison and the file): stdout
        diffs = ", ".join(f"{k} {row[k]:.2g}" for k in result["outputs"])
        print(f"  batch {row['batch']}, length {row['seq']}: max |ort - torch| {diffs}")
    print(f"exported {args.model_dir} -> {args.out} ({result['export_s']} s)")
    return 0


if __name__ == "__main__":
    entry.run(main)
