"""Corpus sources: documents (strings) streamed from local files, the stdlib, or a HF dataset.

A *document* is the unit that is split into train/valid, separated by ``sep`` when packed, and
kept apart in ``pad`` packing. Each kind of ``--source`` spec is a :class:`SourceKind` in a
registry (:func:`register_source_kind`), asked in order:

* ``stdlib``: every ``.py`` file of the running interpreter's standard library
  (``sysconfig.get_paths()["stdlib"]``, without ``site-packages``/``dist-packages``), sorted;
* ``hf:NAME[:CONFIG][:SPLIT]``: the rows of a Hugging Face dataset (streamed), text column.
  NAME is a Hub dataset, a local directory of data files (``load_dataset``), or a directory
  written by ``save_to_disk`` (``load_from_disk``; SPLIT picks from a saved DatasetDict);
* anything else: local files (a file, a directory walked recursively in sorted order with
  hidden entries skipped, or a glob, sorted), each read by its format (:mod:`data_prep.files`:
  plain text, JSON lines, CSV/TSV, Parquet, or one added with ``register_file_format``).

Every order is deterministic. :class:`Source` holds the specs, the reading options and the
statistics (:class:`SourceStats`); each kind reads its own specs. See docs/extending.md.
"""

import glob
import os
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from data_prep.errors import DataPrepError
from data_prep.files import EXAMPLES, column_error, file_parts, read_files, text_value
from data_prep.files import register_file_format as register_file_format  # its old home

EXCLUDED_STDLIB_DIRS = ("site-packages", "dist-packages")
DEFAULT_MAX_DOC_BYTES = 8 << 20


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


def is_saved_dataset(path: str) -> bool:
    """``path`` is a directory written by ``datasets``' ``save_to_disk``."""
    return os.path.isdir(path) and any(
        os.path.isfile(os.path.join(path, f)) for f in ("dataset_dict.json", "state.json")
    )


def _chain_first(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    yield first
    yield from rest


# =================================================================================== registries
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
        at document boundaries where its format allows (:func:`data_prep.files.file_parts`:
        JSON lines, plain text, CSV, Parquet), so that a corpus of a few huge files still has work for
        every rank."""
        out: list[tuple[Any, int]] = []
        group: list[str] = []
        size = 0
        for path in source.files(spec):
            n = os.path.getsize(path)
            parts = file_parts(source, path, n, unit_bytes) if n > unit_bytes else None
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
        return read_files(source, source.files(spec) if part is None else part)

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
            raise column_error(source, where, first.keys())
        for i, row in enumerate(_chain_first(first, rows)):
            text = text_value(source, row[source.text_column], f"{where} row {i}")
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
