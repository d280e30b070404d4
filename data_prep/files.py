"""Local files: how each format is read, and cut into work units when it is large.

The :class:`FileFormat` a file's lower-cased suffix selects reads it (:func:`file_format`,
:func:`register_file_format`): JSON lines, CSV, TSV and Parquet give one document per record
(the text column); any other file is plain text, one document per file cut at line ends at
``max_doc_bytes`` (one that is not text is skipped and counted). Readers take the source read
(:class:`Reading`), count its bytes and each undecodable byte (read as U+FFFD). ``parts`` cut
a large file at document boundaries: any number of ranks writes the bytes of one process.
"""

import codecs
import csv
import json
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from data_prep.errors import DataPrepError

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet",)
SNIFF_BYTES = 64 << 10
BINARY_CONTROL_FRACTION = 0.05
# Control bytes that plain text does not hold (tab, LF, VT, FF, CR and ESC are allowed).
_CONTROL = bytes(b for b in range(32) if b not in (9, 10, 11, 12, 13, 27)) + b"\x7f"
EXAMPLES = 3  # files named in a warning (binary_examples, undecodable_files)


class Reading(Protocol):
    """What a reader needs of the source it reads (:class:`data_prep.sources.Source`)."""

    text_column: str
    max_doc_bytes: int
    encoding: str
    stats: Any  # data_prep.sources.SourceStats: bytes, undecodable_bytes, binary_files, ...


_ESCAPED = re.compile("[\udc80-\udcff]")  # undecodable bytes under "surrogateescape"


def _replace_escaped(text: str, stats: Any) -> str:
    """Turn each escaped undecodable byte into U+FFFD, counting them."""
    if _ESCAPED.search(text) is None:
        return text
    stats.undecodable_bytes += len(_ESCAPED.findall(text))
    return _ESCAPED.sub("\ufffd", text)


def _decode(raw: bytes, stats: Any, encoding: str = "utf-8") -> str:
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


def _lines_of(f: Any, limit: int) -> Iterator[bytes]:
    """The lines of an open binary file from its position through its next ``limit`` bytes
    (the caller's ``limit`` ends at a line end)."""
    for line in f:
        yield line
        limit -= len(line)
        if limit <= 0:
            return


# ================================================================================== formats
FileReader = Callable[[Reading, str], Iterator[str]]


@dataclass(frozen=True)
class FileFormat:
    """How files whose lower-cased name ends with one of ``suffixes`` are read.

    ``read(src, path)``: the documents of the whole file (adding the bytes it reads to
    ``src.stats.bytes``). ``parts(src, path, size, unit_bytes)``: the file cut into work units
    of about ``unit_bytes`` at document boundaries, or None (one unit); ``read_part(src,
    part)``: the documents of one of them. Without ``parts`` a file is one unit."""

    suffixes: tuple[str, ...]
    read: FileReader
    parts: Callable[[Reading, str, int, int], list[Any] | None] | None = None
    read_part: Callable[[Reading, Any], Iterator[str]] | None = None


_FORMATS: list[FileFormat] = []


def register_file_format(
    suffixes: tuple[str, ...],
    reader: FileReader,
    parts: Callable[[Reading, str, int, int], list[Any] | None] | None = None,
    read_part: Callable[[Reading, Any], Iterator[str]] | None = None,
) -> FileFormat:
    """Read local files whose lower-cased name ends with one of ``suffixes`` with
    ``reader(source, path) -> documents`` (it adds the bytes it reads to ``source.stats.bytes``);
    ``parts`` and ``read_part`` (both or neither) cut a large file into work units
    (:class:`FileFormat`). Later registrations are tried first; files matching none are plain
    text."""
    if (parts is None) != (read_part is None):
        raise ValueError("register_file_format: give both parts and read_part, or neither")
    fmt = FileFormat(tuple(s.lower() for s in suffixes), reader, parts, read_part)
    _FORMATS.insert(0, fmt)
    return fmt


def file_format(path: str) -> FileFormat:
    """The format that reads ``path``: the registered one its suffix selects, else plain text."""
    lower = path.lower()
    return next((f for f in _FORMATS if f.suffixes and lower.endswith(f.suffixes)), TEXT)


def file_parts(src: Reading, path: str, size: int, unit_bytes: int) -> list[Any] | None:
    """A file of ``size`` > ``unit_bytes`` bytes cut into work units by its format, whose
    documents in order are those of the whole file: JSON lines at line starts, plain text at
    the ends of its documents (one of at most ``max_doc_bytes`` is never cut; a file that is
    not text is not cut), UTF-8 CSV/TSV at row ends (found by parsing it once), Parquet by row
    groups. None: one unit (a format without ``parts``, another encoding for CSV, a CSV the
    csv module refuses, a single document or row group)."""
    fmt = file_format(path)
    if fmt.parts is None:
        return None
    parts = fmt.parts(src, path, size, unit_bytes)
    return parts if parts is not None and len(parts) > 1 else None


def read_files(src: Reading, items: Iterable[Any]) -> Iterator[str]:
    """The documents of local files, or of parts of them (:func:`file_parts`), in order;
    ``src.stats.files`` counts each file once (a part at its start). An unreadable file is a
    :class:`DataPrepError` naming it."""
    for item in items:
        part = not isinstance(item, str)
        path = item.path if part else item
        src.stats.files += not part or item.start == 0
        fmt = file_format(path)
        try:
            if part:
                assert fmt.read_part is not None  # only a format with parts made it
                yield from fmt.read_part(src, item)
            else:
                yield from fmt.read(src, path)
        except OSError as e:
            raise DataPrepError(f"cannot read input file {path!r}: {e}") from e


# ================================================================================ plain text
def _read_text_file(src: Reading, path: str) -> Iterator[str]:
    size = os.path.getsize(path)
    before = src.stats.undecodable_bytes
    with open(path, "rb") as f:
        if looks_binary(f.read(SNIFF_BYTES), src.encoding):
            src.stats.binary_files += 1
            if len(src.stats.binary_examples) < EXAMPLES:
                src.stats.binary_examples.append(path)
            return
        f.seek(0)
        yield from _text_documents(src, f, size)
    if src.stats.undecodable_bytes > before and len(src.stats.undecodable_files) < EXAMPLES:
        src.stats.undecodable_files.append(path)


def _text_parts(src: Reading, path: str, size: int, unit_bytes: int) -> list[Any] | None:
    if size <= src.max_doc_bytes:
        return None
    with open(path, "rb") as f:
        if looks_binary(f.read(SNIFF_BYTES), src.encoding):
            return None
    return _ranges(path, text_document_ends(path, size, src.max_doc_bytes), size, unit_bytes)


def _read_text_range(src: Reading, part: "FileRange") -> Iterator[str]:
    """The documents of bytes ``[start, end)`` of a plain-text file, both document ends
    (:func:`text_document_ends`; the file is text: checked when it was cut)."""
    before = src.stats.undecodable_bytes
    with open(part.path, "rb") as f:
        f.seek(part.start)
        yield from _text_documents(src, f, os.path.getsize(part.path), part.end - part.start)
    listed = src.stats.undecodable_files
    if src.stats.undecodable_bytes > before and len(listed) < EXAMPLES and part.path not in listed:
        listed.append(part.path)


def _text_documents(src: Reading, f: Any, size: int, limit: int | None = None) -> Iterator[str]:
    """Documents of an open binary file of ``size`` bytes (cut at ``max_doc_bytes``), or of
    its next ``limit`` bytes from a document end."""
    enc, stats = src.encoding, src.stats
    if size <= src.max_doc_bytes:
        raw = f.read()
        stats.bytes += len(raw)
        yield _decode(raw, stats, enc)
        return
    buf: list[bytes] = []
    n = 0
    for line in f if limit is None else _lines_of(f, limit):
        buf.append(line)
        n += len(line)
        if n >= src.max_doc_bytes:
            stats.bytes += n
            yield _decode(b"".join(buf), stats, enc)
            buf, n = [], 0
    if buf:
        stats.bytes += n
        yield _decode(b"".join(buf), stats, enc)


TEXT = FileFormat((), _read_text_file, _text_parts, _read_text_range)  # no suffix: the fallback


# ====================================================================== records: a text column
def column_error(src: Reading, where: str, columns: Any) -> DataPrepError:
    """No text column ``src.text_column`` among ``columns`` (any record reader's error)."""
    return DataPrepError(
        f"{where}: no text column {src.text_column!r} (columns: {sorted(columns)}); "
        "choose one with --text-column"
    )


def text_value(src: Reading, value: Any, where: str) -> str | None:
    """A record's text column: the text, None for a missing value, else an error."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise DataPrepError(
            f"{where}: column {src.text_column!r} holds {type(value).__name__}, not text"
        )
    return value


def _read_jsonl(src: Reading, path: str, start: int = 0, end: int | None = None) -> Iterator[str]:
    """The records of a JSON-lines file, or of its lines in bytes ``[start, end)``."""
    with open(path, "rb") as f:
        f.seek(start)
        pos = start
        for lineno, raw in enumerate(f, 1):
            if end is not None and pos >= end:
                return
            pos += len(raw)
            src.stats.bytes += len(raw)
            line = _decode(raw, src.stats, src.encoding).strip()
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
            if src.text_column not in record:
                raise column_error(src, where, record.keys())
            text = text_value(src, record[src.text_column], where)
            if text is not None:
                yield text


JSONL = FileFormat(
    JSONL_SUFFIXES,
    _read_jsonl,
    lambda src, path, size, unit_bytes: line_ranges(path, size, unit_bytes),
    lambda src, part: _read_jsonl(src, part.path, part.start, part.end),
)


def _read_csv(src: Reading, path: str, delimiter: str) -> Iterator[str]:
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    src.stats.bytes += os.path.getsize(path)
    enc = "utf-8-sig" if codecs.lookup(src.encoding).name == "utf-8" else src.encoding
    with open(path, encoding=enc, errors="surrogateescape", newline="") as f:
        reader = csv.DictReader(f, delimiter=delimiter)
        if reader.fieldnames is None or src.text_column not in reader.fieldnames:
            raise column_error(src, path, reader.fieldnames or [])
        for row in reader:
            text = text_value(src, row[src.text_column], f"{path}:{reader.line_num}")
            if text is not None:
                yield _replace_escaped(text, src.stats)


def _csv_parts(src: Reading, path: str, size: int, unit_bytes: int, delimiter: str):
    if codecs.lookup(src.encoding).name != "utf-8":
        return None
    try:
        return _ranges(path, csv_row_ends(path, delimiter), size, unit_bytes)
    except csv.Error:  # the whole-file reader reports it
        return None


def _read_csv_range(src: Reading, part: "FileRange", delimiter: str) -> Iterator[str]:
    """The rows of bytes ``[start, end)`` of a UTF-8 CSV file, both row ends
    (:func:`csv_row_ends`), read as the whole-file reader reads them; the header from byte 0."""
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    path, start = part.path, part.start
    src.stats.bytes += part.end - start
    with open(path, "rb") as f:
        header = next(csv.reader(_CsvLines(f, 0), delimiter=delimiter), None)
        if header is None or src.text_column not in header:
            raise column_error(src, path, header or [])
        rows = _CsvLines(f, start, part.end)
        # from byte 0 the reader takes the header row itself, as the whole-file reader's does
        fields = None if start == 0 else header
        for row in csv.DictReader(rows, fieldnames=fields, delimiter=delimiter):
            where = f"{path}: the row ending at byte {rows.pos}"
            text = text_value(src, row[src.text_column], where)
            if text is not None:
                yield _replace_escaped(text, src.stats)


def _csv_format(suffix: str, delimiter: str) -> FileFormat:
    return FileFormat(
        (suffix,),
        lambda src, path: _read_csv(src, path, delimiter),
        lambda src, path, size, unit_bytes: _csv_parts(src, path, size, unit_bytes, delimiter),
        lambda src, part: _read_csv_range(src, part, delimiter),
    )


def _read_parquet(src: Reading, path: str, part: "RowGroups | None" = None) -> Iterator[str]:
    """The rows of a Parquet file, or of some of its row groups."""
    import pyarrow.parquet as pq

    src.stats.bytes += os.path.getsize(path) if part is None else part.nbytes
    pf = pq.ParquetFile(path)
    if src.text_column not in pf.schema_arrow.names:
        raise column_error(src, path, pf.schema_arrow.names)
    groups = None if part is None else list(range(part.start, part.end))
    for batch in pf.iter_batches(batch_size=1024, row_groups=groups,
                                 columns=[src.text_column]):  # fmt: skip
        for value in batch.column(0).to_pylist():
            text = text_value(src, value, path)
            if text is not None:
                yield text


def _row_group_parts(src: Reading, path: str, size: int, unit_bytes: int) -> list[Any] | None:
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


PARQUET = FileFormat(
    PARQUET_SUFFIXES, _read_parquet, _row_group_parts, lambda src, p: _read_parquet(src, p.path, p)
)

# the built-ins: asked JSON lines, CSV, TSV, then Parquet (later registrations come first)
for _fmt in (PARQUET, _csv_format(".tsv", "\t"), _csv_format(".csv", ","), JSONL):
    _FORMATS.insert(0, _fmt)
