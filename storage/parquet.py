"""Atomic Parquet writes and checked reads: a file that exists is complete and trusted.

A write goes to a hidden temporary name in the same folder (``.NAME.tmp-PID-HEX``), is
flushed and fsynced, renamed into place, and the folder is fsynced so the rename itself
survives a crash. Readers never look at temporaries, so they see a finished file or none.

A sharded stage output is a folder of ``part-00000.parquet, part-00001.parquet, ...``,
each written atomically, so a crash loses at most the part being written. When the stage
finishes, ``seal_parts`` writes ``_complete.json`` (part and row counts); a sealed folder
with a part missing is reported as corrupt rather than read short.

Every read checks the file's footer first: the ``rollflow.record`` kind and
``rollflow.schema_version`` metadata and the exact columns; then pages are read with
their CRC checksums verified. Anything off raises an error naming the file.

Simplified: one compression (zstd) for every table; the per-page checksums catch bit
flips, not a file swapped wholesale for another valid rollflow file.
"""

from __future__ import annotations

import json
import os
import shutil
import re
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import pyarrow as pa
import pyarrow.parquet as pq

from rollflow.storage.arrow_schemas import (
    KIND_KEY,
    SCHEMAS,
    VERSION_KEY,
    RecordKind,
    fill_optional_columns,
    readable_difference,
    schema_difference,
)
from rollflow.storage.errors import (
    CorruptFileError,
    SchemaMismatchError,
    SchemaVersionError,
    StageExistsError,
    StorageError,
)
from rollflow.storage.records import SCHEMA_VERSION

__all__ = [
    "COMPLETE_MARKER",
    "CorruptFileError",
    "SchemaMismatchError",
    "SchemaVersionError",
    "StorageError",
    "check_file",
    "is_temporary",
    "list_parts",
    "read_table",
    "seal_parts",
    "write_part",
    "write_table_atomic",
]

COMPLETE_MARKER = "_complete.json"
_TMP_INFIX = ".tmp-"
_PART_RE = re.compile(r"^part-(\d{5,})\.parquet$")


def temporary_path(final: Path) -> Path:
    """A hidden, unique sibling of ``final`` that no reader or glob of ``*.parquet`` sees."""
    return final.parent / f".{final.name}{_TMP_INFIX}{os.getpid()}-{secrets.token_hex(4)}"


def is_temporary(path: Path) -> bool:
    return path.name.startswith(".") and _TMP_INFIX in path.name


def remove_temporaries(found: list[Path]) -> list[Path]:
    """Delete the half-written files and folders in ``found`` (from ``is_temporary``); returns them."""
    for path in found:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    return found


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_file(path: Path) -> Iterator[IO[bytes]]:
    """Write ``path`` all or nothing: yields a binary file under a temporary name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(path)
    try:
        with open(tmp, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_bytes_atomic(data: bytes, path: Path) -> Path:
    with atomic_file(path) as handle:
        handle.write(data)
    return path


def _record_kind(schema: pa.Schema) -> RecordKind | None:
    raw = (schema.metadata or {}).get(KIND_KEY)
    try:
        return None if raw is None else RecordKind(raw.decode())
    except ValueError:
        return None


def write_table_atomic(table: pa.Table, path: Path) -> Path:
    """Write a record table (from ``rollflow.storage.schemas``) to ``path`` atomically."""
    kind = _record_kind(table.schema)
    if kind is None:
        raise ValueError(
            f"refusing to write {path}: the table has no rollflow record metadata; "
            "build it with storage.schemas (e.g. episode_records_to_table)"
        )
    problem = schema_difference(table.schema, SCHEMAS[kind])
    if problem is not None:
        raise SchemaMismatchError(path, f"refusing to write a {kind.value} table: {problem}")
    with atomic_file(Path(path)) as handle:
        pq.write_table(table, handle, compression="zstd", write_page_checksum=True)
    return Path(path)


def part_path(folder: Path, index: int) -> Path:
    if index < 0:
        raise ValueError(f"part index must be >= 0, got {index}")
    return Path(folder) / f"part-{index:05d}.parquet"


def write_part(table: pa.Table, folder: Path, index: int) -> Path:
    """Write part ``index`` of a sharded output; a part that exists is never rewritten."""
    path = part_path(folder, index)
    if path.exists():
        raise StageExistsError(f"{path}: part {index} is already written")
    if (Path(folder) / COMPLETE_MARKER).exists():
        raise StageExistsError(f"{folder}: sealed; no part can be added")
    return write_table_atomic(table, path)


def part_index(path: Path) -> int | None:
    """The index of a part file's name; None for anything else (temporaries included)."""
    match = _PART_RE.match(path.name)
    return None if match is None else int(match.group(1))


def list_parts(folder: Path) -> list[Path]:
    """The complete part files of ``folder`` in index order (temporaries are ignored)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    indexed = [(part_index(p), p) for p in folder.iterdir()]
    return [p for i, p in sorted((i, p) for i, p in indexed if i is not None)]


def seal_parts(folder: Path) -> int:
    """Mark a sharded output complete; returns its row count. Parts must be 0..n-1."""
    folder = Path(folder)
    parts = list_parts(folder)
    _check_contiguous(folder, parts)
    rows = sum(check_file(p) for p in parts)
    marker = {"parts": len(parts), "rows": rows, "schema_version": SCHEMA_VERSION}
    write_bytes_atomic(json.dumps(marker).encode(), folder / COMPLETE_MARKER)
    return rows


def _check_contiguous(folder: Path, parts: list[Path]) -> None:
    if not parts:
        raise StorageError(f"{folder}: no complete part files")
    indices = [i for i in map(part_index, parts) if i is not None]
    if indices != list(range(len(indices))):
        missing = sorted(set(range(max(indices) + 1)) - set(indices))
        raise CorruptFileError(folder, f"part files {missing} are missing")


def _read_marker(folder: Path) -> dict[str, int] | None:
    path = folder / COMPLETE_MARKER
    if not path.exists():
        return None
    try:
        marker = json.loads(path.read_text())
        return {"parts": int(marker["parts"]), "rows": int(marker["rows"])}
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptFileError(path, f"unreadable completion marker: {exc}") from exc


def check_file(path: Path, kind: RecordKind | None = None) -> int:
    """Check a Parquet file's footer (kind, version, columns); returns its row count."""
    path = Path(path)
    try:
        metadata = pq.read_metadata(path)
        schema = metadata.schema.to_arrow_schema()
    except FileNotFoundError:
        raise StorageError(f"{path}: no such file") from None
    except (pa.ArrowException, OSError) as exc:
        raise CorruptFileError(path, str(exc)) from exc
    _check_schema(path, schema, kind)
    return metadata.num_rows


def _check_schema(path: Path, schema: pa.Schema, kind: RecordKind | None) -> RecordKind:
    found = _record_kind(schema)
    if found is None:
        raise SchemaMismatchError(path, "not a rollflow record file (no rollflow.record metadata)")
    if kind is not None and found != kind:
        raise SchemaMismatchError(path, f"holds {found.value} records, expected {kind.value}")
    version = (schema.metadata or {}).get(VERSION_KEY, b"?").decode()
    if version != str(SCHEMA_VERSION):
        raise SchemaVersionError(
            path, f"schema version {version}; this rollflow reads version {SCHEMA_VERSION}"
        )
    problem = readable_difference(schema, found)  # a file older than an optional column reads
    if problem is not None:
        raise SchemaMismatchError(path, f"{found.value} columns differ from the schema: {problem}")
    return found


def _read_file(path: Path, kind: RecordKind | None) -> pa.Table:
    check_file(path, kind)
    try:
        table = pq.ParquetFile(path, page_checksum_verification=True).read()
    except (pa.ArrowException, OSError) as exc:
        raise CorruptFileError(path, str(exc)) from exc
    found = _record_kind(table.schema)
    assert found is not None  # check_file
    return fill_optional_columns(table, found)  # older parts concatenate with newer ones


def read_table(path_or_folder: Path | str, kind: RecordKind | None = None) -> pa.Table:
    """Read one record file, or every complete part of a sharded folder, checked.

    ``kind`` (when given) is the record the caller expects; a file of another kind is an
    error. A sealed folder must hold exactly the parts and rows its marker names.
    """
    path = Path(path_or_folder)
    if not path.is_dir():
        return _read_file(path, kind)
    parts = list_parts(path)
    marker = _read_marker(path)
    if marker is not None:
        _check_contiguous(path, parts)
        if len(parts) != marker["parts"]:
            raise CorruptFileError(path, f"{marker['parts']} parts sealed, {len(parts)} found")
    if not parts:
        raise StorageError(f"{path}: no complete part files")
    tables = [_read_file(p, kind) for p in parts]
    table = pa.concat_tables(tables)
    if marker is not None and table.num_rows != marker["rows"]:
        raise CorruptFileError(path, f"{marker['rows']} rows sealed, {table.num_rows} read")
    return table
