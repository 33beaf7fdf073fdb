"""Atomic writes leave a whole file or none; reads refuse anything not whole or not ours."""

from __future__ import annotations

import json
from pathlib import Path
from typing import BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import rollflow.storage.parquet as parquet
from rollflow.storage.arrow_schemas import KIND_KEY, VERSION_KEY, RecordKind
from rollflow.storage.errors import (
    CorruptFileError,
    SchemaMismatchError,
    SchemaVersionError,
    StageExistsError,
    StorageError,
)
from rollflow.storage.parquet import (
    COMPLETE_MARKER,
    check_file,
    is_temporary,
    list_parts,
    read_table,
    seal_parts,
    temporary_path,
    write_part,
    write_table_atomic,
)
from rollflow.storage.records import SCHEMA_VERSION
from rollflow.storage.schemas import episode_records_to_table, table_to_episode_records
from rollflow.storage.synthetic import synthetic_episode


def _episodes(step: int = 0, tasks: int = 3) -> pa.Table:
    return episode_records_to_table(
        [synthetic_episode("run", step, t, i) for t in range(tasks) for i in range(4)]
    )


def test_write_then_read_gives_the_same_records(tmp_path: Path) -> None:
    table = _episodes()
    path = write_table_atomic(table, tmp_path / "deep" / "episodes.parquet")
    assert [p.name for p in path.parent.iterdir()] == ["episodes.parquet"], "no temporary left"
    back = read_table(path, RecordKind.EPISODES)
    assert table_to_episode_records(back) == table_to_episode_records(table)
    assert check_file(path) == table.num_rows


def test_a_failed_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(table: pa.Table, where: BinaryIO, **kwargs: object) -> None:
        where.write(b"PAR1 half a file")
        raise OSError("disk full")

    monkeypatch.setattr(parquet.pq, "write_table", crash)
    with pytest.raises(OSError, match="disk full"):
        write_table_atomic(_episodes(), tmp_path / "episodes.parquet")
    assert list(tmp_path.iterdir()) == []


def test_temporary_names_are_hidden_from_globs(tmp_path: Path) -> None:
    tmp = temporary_path(tmp_path / "scores.parquet")
    assert is_temporary(tmp) and tmp.parent == tmp_path
    assert not tmp.name.endswith(".parquet") and tmp.name.startswith(".")
    assert not is_temporary(tmp_path / "scores.parquet")


def test_refuses_to_write_a_table_that_is_not_a_record(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no rollflow record metadata"):
        write_table_atomic(pa.table({"x": [1]}), tmp_path / "x.parquet")
    table = _episodes()
    with pytest.raises(SchemaMismatchError, match="missing columns \\['error'\\]"):
        write_table_atomic(table.drop_columns(["error"]), tmp_path / "e.parquet")


def test_truncated_file_is_corrupt_and_named(tmp_path: Path) -> None:
    path = write_table_atomic(_episodes(), tmp_path / "episodes.parquet")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CorruptFileError, match=f"{path}: corrupt file"):
        read_table(path)


def test_flipped_bytes_in_a_page_are_caught(tmp_path: Path) -> None:
    path = write_table_atomic(_episodes(tasks=50), tmp_path / "episodes.parquet")
    data = bytearray(path.read_bytes())
    middle = len(data) // 3
    data[middle : middle + 4] = bytes(b ^ 0xFF for b in data[middle : middle + 4])
    path.write_bytes(bytes(data))
    check_file(path)  # the footer is intact ...
    with pytest.raises(CorruptFileError, match=str(path)):
        read_table(path)  # ... the pages are not, and their checksums say so


def test_foreign_files_are_refused(tmp_path: Path) -> None:
    plain = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"x": [1, 2]}), plain)
    with pytest.raises(SchemaMismatchError, match="not a rollflow record file"):
        read_table(plain)
    text = tmp_path / "notes.parquet"
    text.write_text("hello")
    with pytest.raises(CorruptFileError, match="notes.parquet"):
        read_table(text)
    with pytest.raises(StorageError, match="no such file"):
        read_table(tmp_path / "missing.parquet")


def test_wrong_kind_and_other_version_are_refused(tmp_path: Path) -> None:
    table = _episodes()
    path = write_table_atomic(table, tmp_path / "episodes.parquet")
    with pytest.raises(SchemaMismatchError, match="holds episodes records, expected scores"):
        read_table(path, RecordKind.SCORES)
    future = tmp_path / "future.parquet"
    metadata = {**table.schema.metadata, VERSION_KEY: str(SCHEMA_VERSION + 1).encode()}
    pq.write_table(table.replace_schema_metadata(metadata), future)
    with pytest.raises(
        SchemaVersionError, match=f"schema version {SCHEMA_VERSION + 1}; this rollflow reads version {SCHEMA_VERSION}"
    ):
        read_table(future)
    odd = tmp_path / "odd.parquet"
    ours = {KIND_KEY: b"episodes", VERSION_KEY: str(SCHEMA_VERSION).encode()}
    pq.write_table(pa.table({"x": [1]}).replace_schema_metadata(ours), odd)
    with pytest.raises(SchemaMismatchError, match="episodes columns differ"):
        read_table(odd)


def test_parts_read_in_order_and_temporaries_are_ignored(tmp_path: Path) -> None:
    folder = tmp_path / "episodes"
    tables = [_episodes(tasks=1 + i) for i in range(3)]
    for index in (2, 0, 1):
        write_part(tables[index], folder, index)
    temporary_path(folder / "part-00003.parquet").write_bytes(b"half written")
    assert [p.name for p in list_parts(folder)] == [f"part-0000{i}.parquet" for i in range(3)]
    back = read_table(folder, RecordKind.EPISODES)
    assert back.num_rows == sum(t.num_rows for t in tables)
    assert back.column("episode_id").to_pylist() == sum((t.column("episode_id").to_pylist() for t in tables), [])


def test_a_part_is_written_once(tmp_path: Path) -> None:
    write_part(_episodes(), tmp_path, 0)
    with pytest.raises(StageExistsError, match="part 0 is already written"):
        write_part(_episodes(), tmp_path, 0)
    seal_parts(tmp_path)
    with pytest.raises(StageExistsError, match="sealed"):
        write_part(_episodes(), tmp_path, 1)


def test_sealed_parts_must_all_be_there(tmp_path: Path) -> None:
    for index in range(3):
        write_part(_episodes(), tmp_path, index)
    rows = seal_parts(tmp_path)
    marker = json.loads((tmp_path / COMPLETE_MARKER).read_text())
    assert marker["parts"] == 3 and marker["rows"] == rows == 36
    (tmp_path / "part-00001.parquet").unlink()
    with pytest.raises(CorruptFileError, match="part files \\[1\\] are missing"):
        read_table(tmp_path)


def test_sealing_needs_contiguous_parts(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="no complete part files"):
        seal_parts(tmp_path)
    write_part(_episodes(), tmp_path, 0)
    write_part(_episodes(), tmp_path, 2)
    with pytest.raises(CorruptFileError, match="\\[1\\] are missing"):
        seal_parts(tmp_path)
    assert not (tmp_path / COMPLETE_MARKER).exists()
