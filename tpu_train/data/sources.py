"""Data files the way users have them: JSONL, plain text, JSON, Parquet and saved datasets.

=====================  ===========================  ==============================================
kind                   what                         read by
=====================  ===========================  ==============================================
``jsonl``              ``.jsonl``, ``.ndjson``      our streaming reader (bounded memory, resumes
                                                    from a byte offset)
``text``               ``.txt``, ``.text``          our streaming reader, one sample per line
``json``               ``.json`` (an array or        ``datasets.load_dataset("json", streaming=True)``
                       JSON Lines)
``parquet``            ``.parquet``                 ``datasets.load_dataset("parquet", streaming=True)``
``saved``              a directory written by       ``datasets.load_from_disk`` (memory-mapped)
                       ``Dataset.save_to_disk``
=====================  ===========================  ==============================================

Every kind yields the same :class:`~tpu_train.data.datasets.Located` records, so packing,
shuffling and resuming do not care where a record came from. For table kinds the position is the
row count (``offset`` and ``line`` both; errors name ``file:row``) and a resumed reader skips
that many rows without parsing them. A ``null`` cell counts as an absent field: tables give every
row every column, filling gaps with nulls.

``column_map`` renames the file's columns to our field names (``text``, ``prompt``,
``response``, ``instruction``, ``input``, ``output``, ``messages``) for every kind.

A :class:`DataFiles` also carries the prompt/response template (:mod:`tpu_train.data.datasets`)
and, optionally, a :class:`Holdout`: one side of a seeded split of its records (a held-out set
for validation when the user has none, and the rest for training), so every reader of the same
files sees the same records.

``datasets`` is imported only when a JSON, Parquet or saved-dataset source is read: it takes
over a second to import, and the CLI should start fast for JSONL users.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import hashlib
import logging
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from tpu_train.data.datasets import (
    TEXT_SUFFIXES,
    Located,
    check_data_file,
    check_format,
    check_template,
    parse_fields,
    read_records,
)
from tpu_train.data.errors import DataError

COLUMN_FIELDS = ("text", "prompt", "response", "instruction", "input", "output", "messages")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
TABLE_SUFFIXES = {".json": "json", ".parquet": "parquet"}
KNOWN_FILES = ".jsonl, .ndjson, .txt, .json, .parquet or a directory written by Dataset.save_to_disk"


@dataclass(frozen=True)
class Holdout:
    """One side of a seeded split of every file's records: a record is held out when a hash of
    (``seed``, the file's name, its line or row number) falls below ``fraction``; ``held_out``
    says which side this is. The split needs no pass over the data and is the same for every
    process, every epoch and every resumed run."""

    fraction: float
    held_out: bool
    seed: int = 0

    def keeps(self, path: Path, line: int) -> bool:
        digest = hashlib.blake2b(f"{self.seed}\0{path.name}\0{line}".encode(), digest_size=8).digest()
        return (int.from_bytes(digest, "big") / 2**64 < self.fraction) == self.held_out

    def describe(self) -> str:
        side = "held-out" if self.held_out else "training"
        return f"the {side} side of a {self.percent} held-out split"

    @property
    def percent(self) -> str:
        return f"{self.fraction * 100:g}%"


@dataclass(frozen=True)
class DataFiles:
    """Files read as one data set (in order) and what applies to all of them: the column map,
    the prompt/response template (``auto`` resolved) and the :class:`Holdout` side, if any.

    Loaders accept it wherever they accept paths; it carries these along paths that hand files
    on without knowing about them (validation passes, exact-match evaluation).
    """

    paths: tuple[Path, ...]
    column_map: tuple[tuple[str, str], ...] = ()
    template: str = "none"
    holdout: Holdout | None = None

    @classmethod
    def of(cls, paths: Any, column_map: Mapping[str, str] | None = None) -> "DataFiles":
        """``paths`` (a path, several, or a ``DataFiles``) with ``column_map`` (if given)."""
        if isinstance(paths, DataFiles):
            return paths if column_map is None else dataclasses.replace(
                paths, column_map=tuple(dict(column_map).items()))
        listed = [paths] if isinstance(paths, (str, Path)) else list(paths)
        return cls(tuple(Path(p) for p in listed), tuple(dict(column_map or {}).items()))

    @property
    def columns(self) -> dict[str, str]:
        return dict(self.column_map)

    def with_options(self, template: str | None = None, holdout: Holdout | None = None) -> "DataFiles":
        """The same files read with ``template`` and ``holdout`` (those given)."""
        changes = {"template": check_template(template)} if template is not None else {}
        return dataclasses.replace(self, **changes, **({"holdout": holdout} if holdout else {}))

    def only(self, index: int) -> "DataFiles":
        """File ``index`` alone, with the same options."""
        return dataclasses.replace(self, paths=(self.paths[index],))

    def read(
        self, index: int, fmt: str = "auto", offset: int = 0, line: int = 0, chunk_lines: int = 256
    ) -> Iterator[list[Located]]:
        """:func:`read_source` of file ``index`` with these options: only the records on this
        side of the holdout split (a file with no training record: ``DataError``)."""
        chunks = read_source(self.paths[index], fmt, offset, line, chunk_lines, self.columns, self.template)
        if self.holdout is None:
            return chunks
        return self._split(chunks, self.paths[index], from_start=offset == 0)

    def _split(self, chunks: Iterator[list[Located]], path: Path, from_start: bool) -> Iterator[list[Located]]:
        found = False
        for chunk in chunks:
            kept = [loc for loc in chunk if self.holdout.keeps(path, loc.line)]
            if kept:
                found = True
                yield kept
        # A file may have no held-out record; one with no training record would be read
        # forever by a stream that cycles it.
        if from_start and not found and not self.holdout.held_out:
            raise DataError(
                f"no record falls on {self.holdout.describe()} (too few records); set data.val_path "
                "to validate on a file of your own, or data.holdout=0 for no validation",
                path,
            )

    def __str__(self) -> str:
        listed = ", ".join(map(str, self.paths))
        return listed if self.holdout is None else f"{listed} ({self.holdout.describe()})"


def check_column_map(column_map: Mapping[str, str]) -> dict[str, str]:
    """``column_map`` as a dict, or ``ValueError`` naming an unknown field or a bad column."""
    column_map = dict(column_map)
    for ours, theirs in column_map.items():
        if ours not in COLUMN_FIELDS:
            raise ValueError(f"column_map key {ours!r} is not a field; mappable fields: {', '.join(COLUMN_FIELDS)}")
        if not isinstance(theirs, str) or not theirs:
            raise ValueError(f"column_map.{ours} must name a column of the file, got {theirs!r}")
    return column_map


def source_kind(path: str | Path) -> str:
    """``jsonl``, ``text``, ``json``, ``parquet`` or ``saved``; ``DataError`` if unreadable."""
    path = Path(path)
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
            raise DataError(
                f"a saved DatasetDict (splits: {', '.join(splits) or 'none'}); point the path at one "
                f"split's directory, e.g. {path / (splits[0] if splits else 'train')}",
                path,
            )
        if not ((path / "state.json").is_file() and (path / "dataset_info.json").is_file()):
            raise DataError(
                "a directory that is not a saved dataset (no state.json/dataset_info.json from "
                f"Dataset.save_to_disk); pass a data file ({KNOWN_FILES}), or list the files in it",
                path,
            )
        return "saved"
    check_data_file(path)
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix in TEXT_SUFFIXES:
        return "text"
    if suffix in TABLE_SUFFIXES:
        return TABLE_SUFFIXES[suffix]
    raise DataError(f"unknown data file type {suffix or '(no extension)'!r}; use {KNOWN_FILES}", path)


def check_sources(files: DataFiles) -> list[str]:
    """The kind of every file (``DataError`` for the first that cannot be read)."""
    if not files.paths:
        raise ValueError("no data file given; pass at least one")
    check_column_map(files.columns)
    return [source_kind(p) for p in files.paths]


def read_source(
    path: str | Path,
    fmt: str = "auto",
    offset: int = 0,
    line: int = 0,
    chunk_lines: int = 256,
    column_map: Mapping[str, str] | None = None,
    template: str = "none",
) -> Iterator[list[Located]]:
    """Parsed records of any kind of source, in chunks, from a position a previous read gave.

    For JSONL and text ``offset`` is a byte offset and ``line`` the lines read; for tables both
    are the rows read. A source without any record raises ``DataError``. Prompt/response
    records are joined by ``template`` (:mod:`tpu_train.data.datasets`; not ``auto``).
    """
    path = Path(path)
    kind = source_kind(path)
    check_format(fmt)
    if kind in ("jsonl", "text"):
        return read_records(path, fmt, offset, line, chunk_lines, column_map, template)
    return _read_table(path, kind, fmt, offset, chunk_lines, column_map, template)


# -- tables through Hugging Face datasets --------------------------------------------------------

# Streaming readers still open at exit are closed while their modules are intact: finalized
# during interpreter teardown, datasets' Parquet generator fails on its cleared globals and
# prints a traceback after an otherwise clean run.
_OPEN_STREAMS: "weakref.WeakSet[Any]" = weakref.WeakSet()


@atexit.register
def _close_open_streams() -> None:
    for stream in list(_OPEN_STREAMS):
        stream.close()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _table_batches(path: Path, kind: str, offset: int, chunk_rows: int) -> Iterator[dict[str, list]]:
    """Column batches of at most ``chunk_rows`` rows, from row ``offset``."""
    import datasets  # lazily: see the module docstring

    if kind == "saved":
        table = datasets.load_from_disk(str(path))
        if not isinstance(table, datasets.Dataset):
            raise DataError(f"holds a {type(table).__name__}, not one Dataset; point the path at one split", path)
        # Memory-mapped Arrow: slicing reads only the rows asked for.
        for start in range(offset, len(table), chunk_rows):
            yield table[start : start + chunk_rows]
        return
    if kind == "parquet":
        import pyarrow.parquet

        # datasets fails on a Parquet file without rows (a zero batch size), so say "empty".
        if pyarrow.parquet.read_metadata(path).num_rows == 0:
            return
    stream = datasets.load_dataset(kind, data_files=str(path), split="train", streaming=True)
    # skip() drops whole Arrow batches before any row becomes a Python object: resuming deep
    # into a file costs a read of the skipped bytes, not a parse.
    batches = stream.skip(offset).iter(batch_size=chunk_rows)
    _OPEN_STREAMS.add(batches)
    try:
        yield from batches
    finally:
        batches.close()


@contextlib.contextmanager
def _datasets_logs_quiet() -> Iterator[None]:
    """datasets logs a read failure to stderr before raising it; the error we raise from it
    says the same in one line, and CLI errors must be one line."""
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _read_table(
    path: Path,
    kind: str,
    fmt: str,
    offset: int,
    chunk_rows: int,
    column_map: Mapping[str, str] | None,
    template: str,
) -> Iterator[list[Located]]:
    row = offset
    batches = _table_batches(path, kind, offset, chunk_rows)
    while True:
        try:
            with _datasets_logs_quiet():
                batch = next(batches, None)
        except DataError:
            raise
        except Exception as exc:  # datasets and pyarrow raise many types for an unreadable file
            raise DataError(f"cannot read as {kind}: {_first_line(exc)}", path) from None
        if batch is None:
            break
        columns = list(batch)
        chunk = []
        for values in zip(*(batch[c] for c in columns)):
            row += 1
            record = {c: v for c, v in zip(columns, values) if v is not None}
            chunk.append(Located(parse_fields(record, path, row, fmt, column_map, template), row, row))
        yield chunk
    if row == 0:
        raise DataError("data file is empty (no rows); add at least one record", path)


def first_record_kind(files: DataFiles | str | Path | Sequence[str | Path] | None) -> str | None:
    """``text``, ``instruction`` or ``chat``: the kind of the first record of the first file."""
    if files is None:
        return None
    files = DataFiles.of(files)
    for chunk in files.read(0, chunk_lines=1):
        return chunk[0].example.kind
    return None
