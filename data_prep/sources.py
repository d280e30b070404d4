"""Corpus sources: documents (strings) streamed from local files, the stdlib, or a HF dataset.

A *document* is the unit that is split into train/valid, separated by ``sep`` when packed, and
kept apart in ``pad`` packing:

* plain text files (any suffix not listed below): one document per file; a file larger than
  ``max_doc_bytes`` is cut at line boundaries into documents of at most that size, so memory
  stays bounded for huge single-file corpora;
* ``.jsonl`` / ``.ndjson`` / ``.json`` (JSON lines), ``.csv``, ``.tsv``, ``.parquet``: one
  document per record, taken from the text column;
* ``stdlib``: every ``.py`` file of the running interpreter's standard library
  (``sysconfig.get_paths()["stdlib"]``, without ``site-packages``/``dist-packages``), sorted;
* ``hf:NAME[:CONFIG][:SPLIT]``: the rows of a Hugging Face dataset (streamed), text column.
  NAME is a Hub dataset, a local directory of data files (``load_dataset``), or a directory
  written by ``save_to_disk`` (``load_from_disk``; SPLIT picks from a saved DatasetDict).

Files are read as UTF-8 (or ``encoding``); each undecodable byte becomes one U+FFFD and is
counted (``SourceStats.undecodable_bytes``, with the files that had any). A plain-text input
that is not text (a NUL byte, or over 5 % control bytes in its first 64 KiB, for byte-oriented
encodings) is skipped and counted (``SourceStats.binary_files``). Directories are walked recursively in sorted order, hidden
entries skipped; globs are expanded and sorted. Every order is deterministic.

Extending: each kind of spec is a :class:`SourceKind` in a registry (:func:`register_source_kind`;
the built-ins are ``stdlib``, ``huggingface`` and the ``files`` fallback), and each local file
format a reader keyed by suffix (:func:`register_file_format`). See docs/extending.md.
"""

import codecs
import csv
import glob
import json
import os
import re
import sys
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from data_prep.errors import DataPrepError

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet",)
EXCLUDED_STDLIB_DIRS = ("site-packages", "dist-packages")
DEFAULT_MAX_DOC_BYTES = 8 << 20
SNIFF_BYTES = 64 << 10
BINARY_CONTROL_FRACTION = 0.05
# Control bytes that plain text does not hold (tab, LF, VT, FF, CR and ESC are allowed).
_CONTROL = bytes(b for b in range(32) if b not in (9, 10, 11, 12, 13, 27)) + b"\x7f"


EXAMPLES = 3  # files named in a warning (binary_examples, undecodable_files)


@dataclass
class SourceStats:
    """Counters of reading a source, a work unit of it, or its documents up to one (the
    main process only): the manifest's source counts, the warnings' examples, and what the
    ``--max-*`` cut and the tokenizer sample need (``lines`` ... ``pieces``: counted by whoever
    reads the training lines, :func:`data_prep.parallel.scan_unit`). ``a + b``: the counters
    of ``a`` then ``b``."""

    documents: int = 0
    bytes: int = 0
    undecodable_bytes: int = 0
    files: int = 0
    binary_files: int = 0  # plain-text inputs skipped because they are not text
    lines: int = 0  # non-blank lines (the tokenizer's corpus)
    line_bytes: int = 0  # their UTF-8 bytes
    long_lines: int = 0  # lines split for the tokenizer (over MAX_SENTENCE_BYTES)
    pieces: int = 0  # tokenizer training lines (after splitting long lines)
    binary_examples: list[str] = field(default_factory=list)  # the first few of them
    undecodable_files: list[str] = field(default_factory=list)  # the first few with U+FFFD

    def __add__(self, other: "SourceStats") -> "SourceStats":
        ints = {k: getattr(self, k) + getattr(other, k) for k in _COUNTS}
        return SourceStats(
            **ints,
            binary_examples=(self.binary_examples + other.binary_examples)[:EXAMPLES],
            undecodable_files=_first(self.undecodable_files + other.undecodable_files),
        )

    def copy(self) -> "SourceStats":
        """The counters as they stand now."""
        return self + SourceStats()

    def record(self) -> dict[str, Any]:
        """A JSON-able record (a work unit's file); :meth:`from_record` reads it back."""
        return {k: getattr(self, k) for k in (*_COUNTS, "binary_examples", "undecodable_files")}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> "SourceStats":
        names = (*_COUNTS, "binary_examples", "undecodable_files")
        return cls(**{k: record[k] for k in names if k in record})


_COUNTS = ("documents", "bytes", "undecodable_bytes", "files", "binary_files", "lines",
           "line_bytes", "long_lines", "pieces")  # fmt: skip


def _first(names: list[str]) -> list[str]:
    """The first :data:`EXAMPLES` distinct names, in order."""
    return list(dict.fromkeys(names))[:EXAMPLES]


_ESCAPED = re.compile("[\udc80-\udcff]")  # undecodable bytes under "surrogateescape"


def _replace_escaped(text: str, stats: SourceStats) -> str:
    """Turn each escaped undecodable byte into U+FFFD, counting them."""
    if _ESCAPED.search(text) is None:
        return text
    stats.undecodable_bytes += len(_ESCAPED.findall(text))
    return _ESCAPED.sub("\ufffd", text)


def _decode(raw: bytes, stats: SourceStats, encoding: str = "utf-8") -> str:
    """The text of ``raw`` in ``encoding``; each undecodable byte becomes one U+FFFD and is
    counted."""
    try:
        text = raw.decode(encoding)
    except UnicodeDecodeError:
        try:
            text = _replace_escaped(raw.decode(encoding, "surrogateescape"), stats)
        except UnicodeDecodeError:  # e.g. UTF-16 with an odd byte count ("truncated data")
            text = raw.decode(encoding, "replace")
            stats.undecodable_bytes += max(1, text.count("\ufffd"))
    return text[1:] if text.startswith("\ufeff") else text


def check_encoding(name: str) -> str:
    """The canonical name of a text encoding; :class:`DataPrepError` if Python lacks it."""
    try:
        info = codecs.lookup(name)
    except LookupError:
        raise DataPrepError(
            f"--encoding {name!r} is not a text encoding Python knows (e.g. utf-8, latin-1, "
            "cp1252, utf-16)"
        ) from None
    if not getattr(info, "_is_text_encoding", True):
        raise DataPrepError(f"--encoding {name!r} is not a text encoding")
    return info.name


def looks_binary(sample: bytes, encoding: str = "utf-8") -> bool:
    """True if ``sample`` (a file's first bytes) is not text: for byte-oriented encodings a NUL
    byte or more than 5 % control bytes (UTF-16/32 text holds NULs: not judged)."""
    if not sample or codecs.lookup(encoding).name.startswith(("utf-16", "utf-32")):
        return False
    if b"\x00" in sample:
        return True
    control = len(sample) - len(sample.translate(None, _CONTROL))
    return control > BINARY_CONTROL_FRACTION * len(sample)


def stdlib_files() -> list[str]:
    """The interpreter's standard-library ``.py`` files, without site/dist-packages, sorted."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_STDLIB_DIRS)
        out.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    return sorted(out, key=lambda p: os.path.relpath(p, root))


def _walk(directory: str) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        out.extend(os.path.join(dirpath, f) for f in sorted(filenames) if not f.startswith("."))
    return out


def expand_paths(spec: str) -> list[str]:
    """Files named by one local spec (file, directory or glob); a clear error if there are none."""
    if any(c in spec for c in "*?["):
        files = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
        if not files:
            raise DataPrepError(f"input glob {spec!r} matches no files")
        return files
    if not os.path.exists(spec):
        raise DataPrepError(f"input path does not exist: {spec!r}")
    if os.path.isdir(spec):
        files = _walk(spec)
        if not files:
            raise DataPrepError(f"input directory {spec!r} contains no files")
        return files
    return [spec]


@dataclass
class HFSpec:
    """A parsed ``hf:NAME[:CONFIG][:SPLIT]`` source."""

    name: str
    config: str | None = None
    split: str = "train"


def parse_hf(spec: str) -> HFSpec:
    """Parse ``hf:NAME[:CONFIG][:SPLIT]`` (empty CONFIG allowed: ``hf:NAME::SPLIT``)."""
    parts = spec[3:].split(":")
    if not parts[0] or len(parts) > 3:
        raise DataPrepError(f"bad Hugging Face source {spec!r}: expected hf:NAME[:CONFIG][:SPLIT]")
    config = parts[1] if len(parts) > 1 and parts[1] else None
    split = parts[2] if len(parts) > 2 and parts[2] else "train"
    return HFSpec(parts[0], config, split)


@dataclass(frozen=True)
class FileRange:
    """Bytes ``[start, end)`` of a local file, both at boundaries between its documents (JSON
    lines: line starts; plain text: the ends of its ``max_doc_bytes`` documents; CSV: row
    ends): one work unit of a file larger than the unit size (its documents in order; the
    ranges of a file are the file)."""

    path: str
    start: int
    end: int


@dataclass(frozen=True)
class RowGroups:
    """Row groups ``[start, end)`` of a Parquet file, one work unit of a file larger than the
    unit size; ``nbytes``: its share of the file's size (its row groups' compressed bytes, the
    first unit also the file's header and footer: the shares of a file sum to its size)."""

    path: str
    start: int
    end: int
    nbytes: int


def _ranges(path: str, ends: Iterable[int], size: int, unit_bytes: int) -> list[FileRange]:
    """``path`` (``size`` bytes) cut at the first of ``ends`` (increasing document ends,
    streamed: only the cuts are kept) at or after each ``unit_bytes`` since the last cut."""
    cuts = [0]
    for e in ends:
        if e - cuts[-1] >= unit_bytes and e < size:
            cuts.append(e)
    cuts.append(size)
    return [FileRange(path, a, b) for a, b in zip(cuts, cuts[1:])]


def line_ranges(path: str, size: int, unit_bytes: int) -> list[FileRange]:
    """``path`` (``size`` bytes) cut into ranges of about ``unit_bytes``, each cut moved to the
    start of the next line (a line is never split); one range when it is smaller."""
    cuts = [0]
    with open(path, "rb") as f:
        for k in range(1, -(-size // max(unit_bytes, 1))):
            f.seek(max(k * unit_bytes - 1, cuts[-1]))
            f.readline()  # the rest of the line holding byte k * unit_bytes - 1
            if cuts[-1] < f.tell() < size:
                cuts.append(f.tell())
    cuts.append(size)
    return [FileRange(path, a, b) for a, b in zip(cuts, cuts[1:])]


def text_document_ends(path: str, size: int, max_doc_bytes: int) -> Iterator[int]:
    """Where the plain-text reader ends each document of a ``size``-byte file larger than
    ``max_doc_bytes``: after the line that brings the document to ``max_doc_bytes`` (the line
    holding its byte ``max_doc_bytes - 1``), found by seeking; the last document's end
    (``size``) is not given."""
    with open(path, "rb") as f:
        start = 0
        while start + max_doc_bytes - 1 < size:
            f.seek(start + max_doc_bytes - 1)
            f.readline()
            if f.tell() >= size:
                return
            start = f.tell()
            yield start


class _CsvLines:
    """The lines of a binary file from byte ``pos`` (to ``end``), split where text mode with
    ``newline=""`` splits them (``\n``, ``\r``, ``\r\n``) and decoded one at a time as UTF-8
    (undecodable bytes escaped, a BOM at byte 0 dropped: ``utf-8-sig``); ``pos``: the byte after
    the last line given, so after a CSV row is read, the end of that row."""

    def __init__(self, f: Any, pos: int, end: int | None = None) -> None:
        self.f, self.pos, self.end = f, pos, end
        f.seek(pos)

    def __iter__(self) -> Iterator[str]:
        for raw in self.f:
            for piece in raw.splitlines(keepends=True):
                if self.end is not None and self.pos >= self.end:
                    return
                text = piece[len(codecs.BOM_UTF8):] if self.pos == 0 and piece.startswith(
                    codecs.BOM_UTF8) else piece  # fmt: skip
                self.pos += len(piece)
                yield text.decode("utf-8", errors="surrogateescape")


def csv_row_ends(path: str, delimiter: str) -> Iterator[int]:
    """The byte offset after each row of a UTF-8 CSV file, by parsing it (a quoted field may
    hold newlines, so a row end cannot be found by seeking); ``csv.Error`` if the csv module
    refuses the file."""
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    with open(path, "rb") as f:
        lines = _CsvLines(f, 0)
        for _ in csv.reader(lines, delimiter=delimiter):
            yield lines.pos


@dataclass
class Source:
    """A deterministic stream of documents from one or more specs (see module docstring)."""

    specs: list[str]
    text_column: str = "text"
    max_doc_bytes: int = DEFAULT_MAX_DOC_BYTES
    encoding: str = "utf-8"
    stats: SourceStats = field(default_factory=SourceStats)
    _state: dict[str, Any] = field(default_factory=dict, repr=False)  # spec -> kind.resolve()
    _kinds: dict[str, "SourceKind"] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.specs:
            raise DataPrepError("no --source given")
        for spec in self.specs:  # resolve up front: missing paths fail before work
            kind = source_kind(spec)
            self._kinds[spec] = kind
            self._state[spec] = kind.resolve(spec, self)

    def kind(self, spec: str) -> "SourceKind":
        """The registered kind that reads ``spec``."""
        return self._kinds[spec]

    def state(self, spec: str) -> Any:
        """What the kind's ``resolve`` returned for ``spec`` (a local spec: its file list)."""
        return self._state[spec]

    def describe(self) -> dict[str, Any]:
        """A JSON-able description of the inputs, recorded in the manifest."""
        items = [self._kinds[spec].describe(spec, self) for spec in self.specs]
        return {"specs": list(self.specs), "text_column": self.text_column, "items": items}

    def total_bytes(self) -> int | None:
        """Total input size when every spec's kind knows it (local specs), else None."""
        sizes = [self._kinds[spec].total_bytes(spec, self) for spec in self.specs]
        return None if any(n is None for n in sizes) else sum(sizes)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[str]:
        for spec in self.specs:
            yield from self.read(spec)

    def units(self, spec: str, unit_bytes: int) -> list[tuple[Any, int]]:
        """``spec``'s work units in reading order: ``(part, size in bytes)`` (see SourceKind)."""
        return self._kinds[spec].units(spec, self, unit_bytes)

    def read(self, spec: str, part: Any = None) -> Iterator[str]:
        """The documents of one work unit of ``spec`` (``part=None``: all of them), in order,
        counted in ``stats`` (documents; bytes too unless the kind counts its own)."""
        kind = self._kinds[spec]
        stats = self.stats
        for doc in kind.read(spec, self, part):
            if not kind.counts_bytes:
                stats.bytes += len(doc.encode("utf-8"))
            stats.documents += 1
            yield doc

    def files(self, spec: str) -> list[str]:
        """The files of a local spec, in reading order."""
        return self._state[spec]

    def iter_files(self, paths: list[Any]) -> Iterator[str]:
        """The documents of some of the local files (or :class:`FileRange` / :class:`RowGroups`
        of them), in order (not counted as documents: see :meth:`read`)."""
        for path in paths:
            if isinstance(path, (FileRange, RowGroups)):
                self.stats.files += path.start == 0
                try:
                    yield from self._iter_part(path)
                except OSError as e:
                    raise DataPrepError(f"cannot read input file {path.path!r}: {e}") from e
                continue
            self.stats.files += 1
            yield from self.iter_file(path)

    def _iter_part(self, part: Any) -> Iterator[str]:
        """The documents of a :class:`FileRange` or :class:`RowGroups` (see :meth:`file_parts`)."""
        reader = file_reader(part.path)
        if isinstance(part, RowGroups):
            yield from self._iter_parquet(part.path, part)
        elif reader is _read_jsonl:
            yield from self._iter_jsonl(part.path, part.start, part.end)
        elif reader in (_read_csv, _read_tsv):
            yield from self._iter_csv_range(part.path, "\t" if reader is _read_tsv else ",",
                                            part.start, part.end)  # fmt: skip
        else:
            yield from self._iter_text_range(part.path, part.start, part.end)

    def file_parts(self, path: str, size: int, unit_bytes: int) -> list[Any] | None:
        """A file of ``size`` > ``unit_bytes`` bytes cut into work units read by the built-in
        readers, whose documents in order are those of the whole file: JSON lines at line
        starts, plain text at the ends of its documents (one of at most ``max_doc_bytes`` is
        never cut; a file that is not text is not cut), UTF-8 CSV/TSV at row ends (found by
        parsing it once), Parquet by row groups. None: one unit (another reader or encoding,
        a CSV the csv module refuses, a single document or row group)."""
        reader = file_reader(path)
        if reader is _read_jsonl:
            return line_ranges(path, size, unit_bytes)
        if reader is _read_parquet:
            return self._row_group_parts(path, size, unit_bytes)
        if reader in (_read_csv, _read_tsv) and codecs.lookup(self.encoding).name == "utf-8":
            ends = csv_row_ends(path, "\t" if reader is _read_tsv else ",")
        elif reader is None and size > self.max_doc_bytes:
            with open(path, "rb") as f:
                if looks_binary(f.read(SNIFF_BYTES), self.encoding):
                    return None
            ends = text_document_ends(path, size, self.max_doc_bytes)
        else:
            return None
        try:
            parts = _ranges(path, ends, size, unit_bytes)
        except csv.Error:  # the whole-file reader reports it
            return None
        return parts if len(parts) > 1 else None

    @staticmethod
    def _row_group_parts(path: str, size: int, unit_bytes: int) -> list[Any] | None:
        """Runs of consecutive row groups of about ``unit_bytes`` (compressed) of a Parquet
        file; None when it has one."""
        import pyarrow.parquet as pq

        try:
            meta = pq.ParquetFile(path).metadata
        except (OSError, ValueError):  # not Parquet (ArrowInvalid): the whole-file reader says so
            return None
        sizes = [
            sum(meta.row_group(g).column(c).total_compressed_size for c in range(meta.num_columns))
            for g in range(meta.num_row_groups)
        ]
        if len(sizes) < 2:
            return None
        parts: list[Any] = []
        first, n = 0, 0
        for g, b in enumerate(sizes):
            n += b
            if n >= unit_bytes or g == len(sizes) - 1:
                parts.append(RowGroups(path, first, g + 1, n))
                first, n = g + 1, 0
        if len(parts) < 2:
            return None
        head = parts[0]  # the header, footer and page indexes: counted by the first unit
        parts[0] = RowGroups(path, head.start, head.end, head.nbytes + size - sum(sizes))
        return parts

    # ------------------------------------------------------------------------------ readers
    def iter_file(self, path: str) -> Iterator[str]:
        """The documents of one local file, read by the format its suffix names (plain text if
        none matches: :func:`register_file_format`)."""
        reader = file_reader(path)
        try:
            if reader is not None:
                yield from reader(self, path)
            else:
                yield from self._iter_text(path)
        except OSError as e:
            raise DataPrepError(f"cannot read input file {path!r}: {e}") from e

    def _iter_text(self, path: str) -> Iterator[str]:
        size = os.path.getsize(path)
        before = self.stats.undecodable_bytes
        with open(path, "rb") as f:
            if looks_binary(f.read(SNIFF_BYTES), self.encoding):
                self.stats.binary_files += 1
                if len(self.stats.binary_examples) < EXAMPLES:
                    self.stats.binary_examples.append(path)
                return
            f.seek(0)
            yield from self._read_text(f, size)
        if self.stats.undecodable_bytes > before and len(self.stats.undecodable_files) < EXAMPLES:
            self.stats.undecodable_files.append(path)

    def _iter_text_range(self, path: str, start: int, end: int) -> Iterator[str]:
        """The documents of bytes ``[start, end)`` of a plain-text file, both document ends
        (:func:`text_document_ends`; the file is text: checked when it was cut)."""
        before = self.stats.undecodable_bytes
        with open(path, "rb") as f:
            f.seek(start)
            yield from self._read_text(f, os.path.getsize(path), end - start)
        listed = self.stats.undecodable_files
        if self.stats.undecodable_bytes > before and len(listed) < EXAMPLES and path not in listed:
            listed.append(path)

    def _read_text(self, f: Any, size: int, limit: int | None = None) -> Iterator[str]:
        """Documents of an open binary file of ``size`` bytes (cut at ``max_doc_bytes``), or of
        its next ``limit`` bytes from a document end."""
        enc = self.encoding
        if size <= self.max_doc_bytes:
            raw = f.read()
            self.stats.bytes += len(raw)
            yield _decode(raw, self.stats, enc)
            return
        buf: list[bytes] = []
        n = 0
        for line in f if limit is None else _lines_of(f, limit):
            buf.append(line)
            n += len(line)
            if n >= self.max_doc_bytes:
                self.stats.bytes += n
                yield _decode(b"".join(buf), self.stats, enc)
                buf, n = [], 0
        if buf:
            self.stats.bytes += n
            yield _decode(b"".join(buf), self.stats, enc)

    def _column_error(self, where: str, columns: Any) -> DataPrepError:
        return DataPrepError(
            f"{where}: no text column {self.text_column!r} (columns: {sorted(columns)}); "
            "choose one with --text-column"
        )

    def _text_value(self, value: Any, where: str) -> str | None:
        if value is None:
            return None
        if not isinstance(value, str):
            raise DataPrepError(
                f"{where}: column {self.text_column!r} holds {type(value).__name__}, not text"
            )
        return value

    def _iter_jsonl(self, path: str, start: int = 0, end: int | None = None) -> Iterator[str]:
        """The records of a JSON-lines file, or of its lines in bytes ``[start, end)``."""
        with open(path, "rb") as f:
            f.seek(start)
            pos = start
            for lineno, raw in enumerate(f, 1):
                if end is not None and pos >= end:
                    return
                pos += len(raw)
                self.stats.bytes += len(raw)
                line = _decode(raw, self.stats, self.encoding).strip()
                if not line:
                    continue
                where = (f"{path}:{lineno}" if start == 0
                         else f"{path}: the line ending at byte {pos}")  # fmt: skip
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataPrepError(f"{where}: invalid JSON ({e.msg})") from e
                if not isinstance(record, dict):
                    raise DataPrepError(f"{where}: expected a JSON object per line")
                if self.text_column not in record:
                    raise self._column_error(where, record.keys())
                text = self._text_value(record[self.text_column], where)
                if text is not None:
                    yield text

    def _iter_csv_range(self, path: str, delimiter: str, start: int, end: int) -> Iterator[str]:
        """The rows of bytes ``[start, end)`` of a UTF-8 CSV file, both row ends
        (:func:`csv_row_ends`), read as :meth:`_iter_csv` reads them; the header from byte 0."""
        csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
        self.stats.bytes += end - start
        with open(path, "rb") as f:
            header = next(csv.reader(_CsvLines(f, 0), delimiter=delimiter), None)
            if header is None or self.text_column not in header:
                raise self._column_error(path, header or [])
            rows = _CsvLines(f, start, end)
            # from byte 0 the reader takes the header row itself, as _iter_csv's does
            fields = None if start == 0 else header
            for row in csv.DictReader(rows, fieldnames=fields, delimiter=delimiter):
                where = f"{path}: the row ending at byte {rows.pos}"
                text = self._text_value(row[self.text_column], where)
                if text is not None:
                    yield _replace_escaped(text, self.stats)

    def _iter_csv(self, path: str, delimiter: str) -> Iterator[str]:
        csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
        self.stats.bytes += os.path.getsize(path)
        enc = "utf-8-sig" if codecs.lookup(self.encoding).name == "utf-8" else self.encoding
        with open(path, encoding=enc, errors="surrogateescape", newline="") as f:
            reader = csv.DictReader(f, delimiter=delimiter)
            if reader.fieldnames is None or self.text_column not in reader.fieldnames:
                raise self._column_error(path, reader.fieldnames or [])
            for row in reader:
                text = self._text_value(row[self.text_column], f"{path}:{reader.line_num}")
                if text is not None:
                    yield _replace_escaped(text, self.stats)

    def _iter_parquet(self, path: str, part: RowGroups | None = None) -> Iterator[str]:
        """The rows of a Parquet file, or of some of its row groups."""
        import pyarrow.parquet as pq

        self.stats.bytes += os.path.getsize(path) if part is None else part.nbytes
        pf = pq.ParquetFile(path)
        if self.text_column not in pf.schema_arrow.names:
            raise self._column_error(path, pf.schema_arrow.names)
        groups = None if part is None else list(range(part.start, part.end))
        for batch in pf.iter_batches(batch_size=1024, row_groups=groups,
                                     columns=[self.text_column]):  # fmt: skip
            for value in batch.column(0).to_pylist():
                text = self._text_value(value, path)
                if text is not None:
                    yield text


def is_saved_dataset(path: str) -> bool:
    """``path`` is a directory written by ``datasets``' ``save_to_disk``."""
    return os.path.isdir(path) and any(
        os.path.isfile(os.path.join(path, f)) for f in ("dataset_dict.json", "state.json")
    )


def _chain_first(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    yield first
    yield from rest


# =================================================================================== registries
FileReader = Callable[[Source, str], Iterator[str]]
_FILE_FORMATS: list[tuple[tuple[str, ...], FileReader]] = []


def register_file_format(suffixes: tuple[str, ...], reader: FileReader) -> None:
    """Read local files whose lower-cased name ends with one of ``suffixes`` with
    ``reader(source, path) -> documents`` (it adds the bytes it reads to ``source.stats.bytes``).
    Later registrations are tried first; files matching none are plain text."""
    _FILE_FORMATS.insert(0, (tuple(s.lower() for s in suffixes), reader))


def _read_parquet(src: Source, path: str) -> Iterator[str]:
    return src._iter_parquet(path)


def _read_tsv(src: Source, path: str) -> Iterator[str]:
    return src._iter_csv(path, "\t")


def _read_csv(src: Source, path: str) -> Iterator[str]:
    return src._iter_csv(path, ",")


def _read_jsonl(src: Source, path: str) -> Iterator[str]:
    return src._iter_jsonl(path)


def _lines_of(f: Any, limit: int) -> Iterator[bytes]:
    """The lines of an open binary file from its position through its next ``limit`` bytes
    (the caller's ``limit`` ends at a line end)."""
    for line in f:
        yield line
        limit -= len(line)
        if limit <= 0:
            return


register_file_format(PARQUET_SUFFIXES, _read_parquet)
register_file_format((".tsv",), _read_tsv)
register_file_format((".csv",), _read_csv)
register_file_format(JSONL_SUFFIXES, _read_jsonl)


def file_reader(path: str) -> FileReader | None:
    """The registered reader of ``path`` by its suffix (None: plain text)."""
    lower = path.lower()
    return next((fmt for suffixes, fmt in _FILE_FORMATS if lower.endswith(suffixes)), None)


class SourceKind:
    """One kind of ``--source`` spec. Register an instance with :func:`register_source_kind`.

    ``read(spec, source, part)`` yields the documents (``str``) of one work unit, ``part=None``
    meaning the whole spec; the parts ``units`` lists, read in order, must give exactly the
    documents of ``part=None`` in the same order (so any number of ranks writes the same bytes).
    :meth:`Source.read` counts the documents, and their UTF-8 bytes unless ``counts_bytes``.
    """

    name = ""  # the manifest's "kind"
    counts_bytes = False  # True: read() adds the bytes it reads to source.stats.bytes itself

    def matches(self, spec: str) -> bool:
        """Whether this kind reads ``spec`` (kinds are asked in registry order)."""
        raise NotImplementedError

    def resolve(self, spec: str, source: Source) -> Any:
        """Check ``spec`` before any work (raise :class:`DataPrepError`); the return value is
        kept as ``source.state(spec)``."""
        return None

    def units(self, spec: str, source: Source, unit_bytes: int) -> list[tuple[Any, int]]:
        """Work units in reading order: ``(part, size in bytes)``, the size for balancing only;
        units of about ``unit_bytes``. Default: one unit, the whole spec."""
        return [(None, 0)]

    def read(self, spec: str, source: Source, part: Any) -> Iterator[str]:
        raise NotImplementedError

    def describe(self, spec: str, source: Source) -> dict[str, Any]:
        """A JSON-able description of ``spec`` for the manifest's ``source.items``."""
        return {"kind": self.name, "spec": spec}

    def total_bytes(self, spec: str, source: Source) -> int | None:
        """The input size in bytes if known up front (sizes the default work unit), else None."""
        return None

    def roots(self, spec: str) -> list[str]:
        """Local paths the spec reads below (``--out`` must not lie inside them)."""
        return []


class FilesKind(SourceKind):
    """Local files: a file, a directory (walked) or a glob; each file read by its format."""

    name = "files"
    counts_bytes = True

    def matches(self, spec: str) -> bool:
        return True

    def resolve(self, spec: str, source: Source) -> list[str]:
        return expand_paths(spec)

    def units(self, spec: str, source: Source, unit_bytes: int) -> list[tuple[Any, int]]:
        """Runs of consecutive files of about ``unit_bytes``; a file larger than that is cut
        at document boundaries where its reader allows (:meth:`Source.file_parts`: JSON lines,
        plain text, CSV, Parquet), so that a corpus of a few huge files still has work for
        every rank."""
        out: list[tuple[Any, int]] = []
        group: list[str] = []
        size = 0
        for path in source.files(spec):
            n = os.path.getsize(path)
            parts = source.file_parts(path, n, unit_bytes) if n > unit_bytes else None
            if parts:
                if group:
                    out.append((tuple(group), size))
                    group, size = [], 0
                out += [((r,), getattr(r, "nbytes", r.end - r.start)) for r in parts]
                continue
            group.append(path)
            size += n
            if size >= unit_bytes:
                out.append((tuple(group), size))
                group, size = [], 0
        if group:
            out.append((tuple(group), size))
        return out

    def read(self, spec: str, source: Source, part: Any) -> Iterator[str]:
        return source.iter_files(list(source.files(spec) if part is None else part))

    def describe(self, spec: str, source: Source) -> dict[str, Any]:
        files = source.files(spec)
        return {
            "kind": self.name,
            "spec": spec,
            "files": len(files),
            "bytes": sum(os.path.getsize(f) for f in files),
        }

    def total_bytes(self, spec: str, source: Source) -> int | None:
        return sum(os.path.getsize(f) for f in source.files(spec))

    def roots(self, spec: str) -> list[str]:
        if any(c in spec for c in "*?["):  # a glob's fixed leading directory
            fixed = spec[: min(spec.index(c) for c in "*?[" if c in spec)]
            return [os.path.dirname(fixed) or "."]
        return [spec]


class StdlibKind(FilesKind):
    """``stdlib``: the running interpreter's standard-library ``.py`` files."""

    name = "stdlib"

    def matches(self, spec: str) -> bool:
        return spec == "stdlib"

    def resolve(self, spec: str, source: Source) -> list[str]:
        files = stdlib_files()
        if not files:
            raise DataPrepError("the stdlib source found no .py files")
        return files

    def describe(self, spec: str, source: Source) -> dict[str, Any]:
        item = super().describe(spec, source)
        item["root"] = sysconfig.get_paths()["stdlib"]
        item["python"] = sys.version.split()[0]
        return item

    def roots(self, spec: str) -> list[str]:
        return [sysconfig.get_paths()["stdlib"]]


class HFKind(SourceKind):
    """``hf:NAME[:CONFIG][:SPLIT]``: a Hugging Face dataset; units are contiguous shards."""

    name = "huggingface"

    def matches(self, spec: str) -> bool:
        return spec.startswith("hf:")

    def resolve(self, spec: str, source: Source) -> HFSpec:
        return parse_hf(spec)

    def units(self, spec: str, source: Source, unit_bytes: int) -> list[tuple[Any, int]]:
        n, size = self.shards(spec, unit_bytes)
        return [((n, i), size) for i in range(n)]

    def read(self, spec: str, source: Source, part: Any) -> Iterator[str]:
        return self.texts(source, parse_hf(spec), part)

    def describe(self, spec: str, source: Source) -> dict[str, Any]:
        hf = parse_hf(spec)
        return {
            "kind": self.name,
            "name": hf.name,
            "config": hf.config,
            "split": hf.split,
            "text_column": source.text_column,
        }

    def roots(self, spec: str) -> list[str]:
        return [spec[3:].split(":")[0]]

    @classmethod
    def shards(cls, spec: str, unit_bytes: int) -> tuple[int, int]:
        """``(num_shards, bytes per shard)`` to split an ``hf:`` spec into work units: a saved
        dataset into about ``unit_bytes`` of Arrow data each, a streamed one into its files."""
        hf = parse_hf(spec)
        where = f"Hugging Face dataset {hf.name!r} (config {hf.config!r}, split {hf.split!r})"
        if is_saved_dataset(hf.name):
            ds = cls._load_saved(hf, where)
            rows, nbytes = len(ds), int(ds.data.nbytes)
            n = max(1, min(rows, -(-nbytes // unit_bytes)))
            return n, -(-nbytes // n)
        ds = cls._load_hub(hf, where)
        return max(1, int(ds.n_shards)), unit_bytes

    def texts(
        self, source: Source, hf: HFSpec, shard: tuple[int, int] | None = None
    ) -> Iterator[str]:
        """The text column of the dataset's rows (of one contiguous shard of them)."""
        where = f"Hugging Face dataset {hf.name!r} (config {hf.config!r}, split {hf.split!r})"
        if is_saved_dataset(hf.name):
            rows = self._saved_dataset_rows(hf, where, shard)
            first = next(rows, None)
        else:
            rows, first = self._hub_rows(hf, where, shard)
        if first is None:
            return
        if source.text_column not in first:
            raise source._column_error(where, first.keys())
        for i, row in enumerate(_chain_first(first, rows)):
            text = source._text_value(row[source.text_column], f"{where} row {i}")
            if text is not None:
                yield text

    @staticmethod
    def _load_saved(hf: HFSpec, where: str) -> Any:
        """The ``Dataset`` of a directory written by ``Dataset(Dict).save_to_disk``."""
        import datasets

        try:
            ds = datasets.load_from_disk(hf.name)
        except Exception as e:
            raise DataPrepError(f"could not load {where}: {type(e).__name__}: {e}") from e
        if isinstance(ds, datasets.DatasetDict):
            if hf.split not in ds:
                raise DataPrepError(
                    f"{where}: the saved dataset has no split {hf.split!r} (splits: "
                    f"{', '.join(sorted(ds))}); name one as hf:PATH::SPLIT"
                )
            ds = ds[hf.split]
        return ds

    @classmethod
    def _saved_dataset_rows(
        cls, hf: HFSpec, where: str, shard: tuple[int, int] | None = None
    ) -> Iterator[Any]:
        """Rows of a directory written by ``Dataset(Dict).save_to_disk`` (memory-mapped Arrow)."""
        ds = cls._load_saved(hf, where)
        if shard is not None:
            ds = ds.shard(num_shards=shard[0], index=shard[1], contiguous=True)
        return iter(ds)

    @staticmethod
    def _load_hub(hf: HFSpec, where: str) -> Any:
        """``load_dataset`` streamed: a Hub name, or a local directory of data files."""
        try:
            import datasets

            return datasets.load_dataset(hf.name, hf.config, split=hf.split, streaming=True)
        except Exception as e:
            raise _hub_error(where, e) from e

    @classmethod
    def _hub_rows(cls, hf: HFSpec, where: str, shard: tuple[int, int] | None = None):
        """Rows (and the first row) of a streamed dataset, or of one of its shards."""
        ds = cls._load_hub(hf, where)
        try:
            if shard is not None:
                ds = ds.shard(num_shards=shard[0], index=shard[1], contiguous=True)
            rows = iter(ds)
            first = next(rows, None)
        except Exception as e:
            raise _hub_error(where, e) from e
        return rows, first


def _hub_error(where: str, e: Exception) -> DataPrepError:
    """The error for a Hugging Face dataset that could not be loaded or read."""
    return DataPrepError(
        f"could not load {where}: {type(e).__name__}: {e}. If this machine is offline "
        "or the Hub is unreachable, download the data elsewhere and pass local files "
        "(text, .jsonl, .csv, .parquet) to --source instead."
    )


_SOURCE_KINDS: list[SourceKind] = [StdlibKind(), HFKind()]
_FALLBACK_KIND = FilesKind()  # anything no registered kind matches: local files


def register_source_kind(kind: SourceKind, replace: bool = False) -> SourceKind:
    """Add a source kind, asked before the built-ins (``replace``: drop a kind of the same
    name first; otherwise a duplicate name is a ValueError). Returns ``kind``."""
    names = [k.name for k in _SOURCE_KINDS] + [_FALLBACK_KIND.name]
    if not kind.name:
        raise ValueError("a source kind needs a name (the manifest's 'kind')")
    if kind.name in names:
        if not replace:
            raise ValueError(f"source kind {kind.name!r} is already registered")
        unregister_source_kind(kind.name)
    _SOURCE_KINDS.insert(0, kind)
    return kind


def unregister_source_kind(name: str) -> None:
    """Remove the registered kind called ``name`` (no error if there is none)."""
    _SOURCE_KINDS[:] = [k for k in _SOURCE_KINDS if k.name != name]


def source_kind(spec: str) -> SourceKind:
    """The kind that reads ``spec``: the first registered one that matches, else local files."""
    return next((k for k in _SOURCE_KINDS if k.matches(spec)), _FALLBACK_KIND)
