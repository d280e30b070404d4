"""Command line: ``python -m data_prep --source stdlib --out data/stdlib --seq-len 128 --vocab-size 8000``."""

import sys

if __name__ == "__main__":  # the command: Ctrl-C while numpy imports is one line, exit 130
    from linformer_ds import entry

    entry.arm("data_prep")

import argparse
import logging

from data_prep import console
from data_prep.distributed import detect_world
from data_prep.errors import DataPrepError
from data_prep.pipeline import PrepConfig, prepare
from data_prep.sources import DEFAULT_MAX_DOC_BYTES
from data_prep.steps import source_roots
from linformer_ds import dirlock, outdir, plugins
from linformer_ds.log import LogLevelError, setup_logging


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (one flag per :class:`PrepConfig` field)."""
    p = argparse.ArgumentParser(
        prog="python -m data_prep",
        description="Turn raw corpora into a SentencePiece tokenizer and packed shards of "
        "fixed-length rows (OUT/manifest.json, OUT/tokenizer.model, OUT/{train,valid}/*.npy); "
        "or tokenize with a given tokenizer (--tokenizer: a SentencePiece .model, or a Hugging "
        "Face tokenizer directory, copied to OUT/tokenizer/).",
    )
    p.add_argument(
        "--source",
        nargs="+",
        required=True,
        metavar="SRC",
        help="'stdlib' (this interpreter's standard library .py files), local files, "
        "directories or globs (text: one document per file; .jsonl/.csv/.tsv/.parquet: one per "
        "record), or hf:NAME[:CONFIG][:SPLIT] (a Hugging Face dataset: a Hub name, which needs the "
        "Hub, a local directory of data files, or a directory written by save_to_disk)",
    )
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per row (N)")
    p.add_argument(
        "--vocab-size", type=int, help="tokenizer vocabulary (required unless --tokenizer)"
    )
    p.add_argument("--model-type", default="unigram", choices=["unigram", "bpe"])
    p.add_argument(
        "--tokenizer",
        help="use this tokenizer instead of training one: a SentencePiece .model (data_prep's "
        "special ids), or a Hugging Face tokenizer directory as save_pretrained writes it "
        "(tokenizer.json: WordPiece as BERT, byte-level BPE as RoBERTa; its own special ids)",
    )
    p.add_argument(
        "--character-coverage",
        type=float,
        default=None,
        help="SentencePiece character coverage (default: 1.0 when the alphabet fits the "
        "vocabulary, else 0.9995; byte fallback from 1024 pieces up)",
    )
    p.add_argument(
        "--max-sentences-for-tokenizer",
        type=int,
        default=300_000,
        help="lines sampled (reservoir) to train the tokenizer",
    )
    p.add_argument(
        "--tokenizer-threads",
        type=int,
        default=2,
        help="threads for tokenizer training (the trained model depends on it; default 2)",
    )
    p.add_argument("--text-column", default="text", help="column of jsonl/csv/parquet/HF inputs")
    p.add_argument(
        "--encoding",
        default="utf-8",
        help="encoding of text/jsonl/csv inputs (default utf-8; e.g. latin-1, cp1252, utf-16); "
        "files that are not text (NUL or control bytes) are skipped and counted",
    )
    p.add_argument(
        "--packing",
        default="full",
        choices=["full", "pad"],
        help="full: documents joined with sep and cut into rows; pad: one document per row(s)",
    )
    p.add_argument("--valid-fraction", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0, help="seed of the split and tokenizer sample")
    p.add_argument("--shard-rows", type=int, help="rows per shard (default: about 64 MiB)")
    p.add_argument("--max-docs", type=int, help="stop after this many documents")
    p.add_argument("--max-bytes", type=int, help="stop after about this many input bytes")
    p.add_argument(
        "--max-doc-bytes",
        type=int,
        default=DEFAULT_MAX_DOC_BYTES,
        help="cut larger text files into documents of this size (at line boundaries)",
    )
    p.add_argument(
        "--workers", type=int, help="tokenizer processes (default: CPU count; 0: inline)"
    )
    p.add_argument(
        "--unit-bytes",
        type=int,
        help="under mpirun/srun: bytes of input per work unit (default: corpus/256, 1-256 MiB); "
        "the output does not depend on it",
    )
    p.add_argument(
        "--rank-timeout",
        type=float,
        default=120.0,
        help="under mpirun/srun: fail the run when a rank gives no sign of life for this many "
        "seconds (default 120)",
    )
    p.add_argument("--overwrite", action="store_true", help="delete an existing output first")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run in --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    p.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE (a dotted name or a .py file) on every rank first: it registers "
        "source kinds or file formats (docs/extending.md); repeatable",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m data_prep`` and the ``linformer-data-prep`` script."""
    args = build_parser().parse_args(argv)
    try:  # LINFORMER_DS_LOG_LEVEL, as every command reads it (data_prep.console)
        setup_logging()
    except LogLevelError as e:
        print(f"data_prep: error: {e}", file=sys.stderr)
        return 2
    try:
        plugins.import_plugins(args.plugin)  # before the sources are read
    except plugins.PluginError as e:
        console.error(str(e))
        return 2
    outdir.ignore_file_size_signal()  # a write past `ulimit -f` is an error line, not SIGXFSZ
    if args.overwrite and args.resume:
        console.error("--overwrite and --resume exclude each other")
        return 2
    kwargs = dict(
        sources=args.source,
        out=args.out,
        seq_len=args.seq_len,
        vocab_size=args.vocab_size,
        model_type=args.model_type,
        tokenizer=args.tokenizer,
        character_coverage=args.character_coverage,
        max_sentences_for_tokenizer=args.max_sentences_for_tokenizer,
        tokenizer_threads=args.tokenizer_threads,
        text_column=args.text_column,
        encoding=args.encoding,
        packing=args.packing,
        valid_fraction=args.valid_fraction,
        seed=args.seed,
        shard_rows=args.shard_rows,
        max_docs=args.max_docs,
        max_bytes=args.max_bytes,
        max_doc_bytes=args.max_doc_bytes,
        overwrite=args.overwrite,
        resume=args.resume,
        progress=not args.quiet and console.shown(logging.INFO),
        unit_bytes=args.unit_bytes,
        rank_timeout=args.rank_timeout,
    )
    if args.workers is not None:
        kwargs["workers"] = args.workers
    try:  # the output contract before the lock file is made beside --out (again once locked)
        inputs = [("--source", p) for p in source_roots(args.source)]
        outdir.check_out(args.out, "data_prep", inputs + [("--tokenizer", args.tokenizer)],
                         args.overwrite, args.resume)  # fmt: skip
    except (outdir.OutDirError, DataPrepError) as e:
        console.error(str(e))
        return 2
    world = detect_world()
    lock = dirlock.output_lock(args.out, "data_prep")  # one data_prep per --out (rank 0 holds it)
    try:
        if world is None or world.rank == 0:
            try:
                lock.acquire()
                if lock.stale_note():
                    console.say(logging.WARNING, lock.stale_note())
            except OSError:  # no lock file can be made there: data_prep's --out checks say why
                pass
        prepare(PrepConfig(**kwargs))
    except dirlock.LockError as e:
        console.error(str(e))
        return 2
    except DataPrepError as e:  # bad input, options or output directory: one line, exit 2
        if not getattr(e, "quiet", False):  # (another rank of an mpirun/srun run prints it)
            console.error(str(e))
        return 2
    except KeyboardInterrupt:
        console.say(logging.ERROR, "data_prep: interrupted; rerun with --resume to continue")
        return 130
    finally:
        lock.release()
    return 0


if __name__ == "__main__":
    entry.run(main)
