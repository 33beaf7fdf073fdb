"""Outputs derived from a stored run without touching it: rescores and replays.

```
runs/<run_id>/rescores/<name>/manifest.json                 what made it: env, kwargs, filter
runs/<run_id>/rescores/<name>/train/step=000003.parquet      one file per (split, step)
runs/<run_id>/rescores/<name>/validation/step=000002.parquet
runs/<run_id>/rescores/<name>/_complete.json                 written last
runs/<run_id>/replays/<name>/...                             the same layout
```

Nothing here writes outside ``rescores/`` and ``replays/``: the run's own files are never
opened for writing. Each chunk file is written atomically (``storage/parquet.py``), so one
that exists is complete and a resumed command skips it; ``_complete.json`` says every
chunk is written.

A name belongs to one manifest and one process at a time. ``DerivedOutput.open`` holds the
name's lock while its body writes (a second command on it is refused with
``DerivedBusyError``), and resumes the name when the manifest is the same and it is not
complete; a complete one, or one made with another environment, kwargs or filter, is
refused with ``DerivedNameError``. Its temporaries are discarded only there, under the lock:
a run's own clean-up (``RunFolder.discard_temporaries``) leaves ``rescores/`` and
``replays/`` alone, so a resume of the run never breaks a rescore that is writing.

The files carry their own record kind (``rescores``, ``replays``) in the Parquet footer,
checked before a view reads them, like the run's own stage files.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rollflow.storage.arrow_schemas import KIND_KEY, SCORE_SCHEMA, VERSION_KEY, schema_difference
from rollflow.storage.errors import CorruptFileError, SchemaMismatchError, StorageError
from rollflow.storage.parquet import atomic_file, is_temporary, remove_temporaries, write_bytes_atomic
from rollflow.storage.records import SCHEMA_VERSION
from rollflow.storage.runfolder import DERIVED_DIRS, RunFolder
from rollflow.storage.step_names import parse_step_dirname, step_dirname
from rollflow.storage.runlock import LOCK_FILE, RunFolderBusyError, acquire_run_folder, release_run_folder

DERIVED_KINDS = DERIVED_DIRS
MANIFEST = "manifest.json"
COMPLETE = "_complete.json"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def _schema(kind: str, fields: list[pa.Field]) -> pa.Schema:
    return pa.schema(fields, metadata={KIND_KEY: kind.encode(), VERSION_KEY: str(SCHEMA_VERSION).encode()})


# A rescore row is a scores row (storage/arrow_schemas.py) under the new environment, plus its name.
RESCORE_SCHEMA = _schema("rescores", [pa.field("rescore", pa.string()), *SCORE_SCHEMA])
REPLAY_SCHEMA = _schema(
    "replays",
    [
        pa.field("replay", pa.string()),
        pa.field("schema_version", pa.int32()),
        pa.field("run_id", pa.string()),
        pa.field("step", pa.int64()),
        pa.field("split", pa.string()),
        pa.field("task_id", pa.string()),
        pa.field("group_id", pa.string()),
        pa.field("episode_id", pa.string()),
        pa.field("matched", pa.bool_()),  # every message of the replay equals the stored one
        pa.field("first_diff_turn", pa.int32()),  # actions before the first differing message
        pa.field("first_diff_message", pa.int32()),  # its index in the transcript
        pa.field("old_role", pa.string()),
        pa.field("old_text", pa.string()),  # null: the stored transcript had ended there
        pa.field("new_role", pa.string()),
        pa.field("new_text", pa.string()),  # null: the replay had ended there
        pa.field("old_turns", pa.int32()),
        pa.field("new_turns", pa.int32()),
        pa.field("old_ending", pa.string()),  # terminated, a truncation cause, or error
        pa.field("new_ending", pa.string()),
        pa.field("replay_error", pa.string()),  # the replayed episode's error, if any
    ],
)
DERIVED_SCHEMAS: Mapping[str, pa.Schema] = {"rescores": RESCORE_SCHEMA, "replays": REPLAY_SCHEMA}


class DerivedNameError(StorageError):
    """A rescore or replay name that is malformed, or already used for something else."""


class DerivedBusyError(RunFolderBusyError):
    """Another process is writing this rescore or replay; the message names its PID."""


def check_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise DerivedNameError(
            f"name {name!r} must be letters, digits, '.', '_' or '-' (at most 100, no '/'), "
            "starting with a letter or digit"
        )
    return name


@dataclass(frozen=True)
class DerivedOutput:
    """The folder of one rescore or replay of one run."""

    run: RunFolder
    kind: str  # DERIVED_KINDS
    name: str

    @property
    def root(self) -> Path:
        return self.run.root / self.kind / self.name

    def chunk_path(self, split: str, step: int) -> Path:
        self.run.split_dir(split)  # names a bad split
        return self.root / split / f"{step_dirname(step)}.parquet"

    def is_complete(self) -> bool:
        return (self.root / COMPLETE).exists()

    def manifest(self) -> dict[str, Any] | None:
        path = self.root / MANIFEST
        if not path.exists():
            return None
        try:
            return dict(json.loads(path.read_text()))
        except (ValueError, TypeError) as exc:
            raise CorruptFileError(path, f"unreadable manifest: {exc}") from exc

    @classmethod
    @contextmanager
    def open(cls, run: RunFolder, kind: str, name: str, manifest: Mapping[str, Any]) -> Iterator[DerivedOutput]:
        """The output for ``manifest``, new or an unfinished one resumed, held for the body.

        The name's lock (``run.lock`` in its folder) is taken first, before the manifest is
        read or a temporary discarded, and released when the body ends, however it ends: a
        second command on the name is refused with ``DerivedBusyError`` and touches nothing.
        """
        if kind not in DERIVED_KINDS:
            raise ValueError(f"kind must be one of {DERIVED_KINDS}, got {kind!r}")
        output = cls(run, kind, check_name(name))
        try:
            acquire_run_folder(output.root)
        except RunFolderBusyError:
            holder = (output.root / LOCK_FILE).read_text().strip() or "unknown"
            raise DerivedBusyError(
                f"{output.root}: the {kind[:-1]} {name!r} is being written by another rollflow process "
                f"(PID {holder}); wait for it to end, or pick another --name"
            ) from None
        try:
            output._start(manifest)
            yield output
        finally:
            release_run_folder(output.root)

    def _start(self, manifest: Mapping[str, Any]) -> None:
        """Check the stored manifest against ``manifest`` (or write it), discard temporaries."""
        wanted = json.loads(json.dumps(dict(manifest)))  # as it reads back from JSON
        found = self.manifest()
        kind, name = self.kind[:-1], self.name
        if found is not None and found != wanted:
            differ = sorted(k for k in wanted.keys() | found.keys() if wanted.get(k) != found.get(k))
            shown = ", ".join(f"{k} ({found.get(k)!r} stored, {wanted.get(k)!r} given)" for k in differ)
            raise DerivedNameError(
                f"{self.root}: the {kind} name {name!r} is already used with other settings: "
                f"{shown}; pick another --name"
            )
        if self.is_complete():
            raise DerivedNameError(
                f"{self.root}: the {kind} {name!r} is already complete; query it "
                f"(rollflow sql {self.run.root} \"SELECT * FROM {self.kind}\") or pick another --name"
            )
        self.discard_temporaries()  # ours alone to discard: we hold the name's lock
        if found is None:
            write_bytes_atomic(json.dumps(wanted, indent=2).encode(), self.root / MANIFEST)

    def discard_temporaries(self) -> list[Path]:
        """What an interrupted write left here (only here: never the run's own files)."""
        return remove_temporaries([p for p in self.root.rglob("*") if is_temporary(p)] if self.root.is_dir() else [])

    def write_chunk(self, table: pa.Table, split: str, step: int) -> Path:
        """Write one chunk atomically; a chunk already written is never rewritten."""
        path = self.chunk_path(split, step)
        if path.exists():
            raise StorageError(f"{path}: this chunk is already written")
        _check_table(table, self.kind, path)
        with atomic_file(path) as handle:
            pq.write_table(table, handle, compression="zstd", write_page_checksum=True)
        return path

    def seal(self) -> Path:
        """Declare the output complete, with its chunk and row counts."""
        chunks = [p for p in sorted(self.root.glob("*/step=*.parquet")) if not is_temporary(p)]
        rows = sum(pq.read_metadata(p).num_rows for p in chunks)
        marker = {"chunks": len(chunks), "rows": rows}
        return write_bytes_atomic(json.dumps(marker).encode(), self.root / COMPLETE)


def _check_table(table: pa.Table, kind: str, path: Path) -> None:
    problem = schema_difference(table.schema, DERIVED_SCHEMAS[kind])
    if problem is not None:
        raise SchemaMismatchError(path, f"refusing to write a {kind} table: {problem}")


def check_derived_file(path: Path, kind: str) -> None:
    """A chunk file's footer: this kind, this schema version, these columns."""
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as exc:
        raise CorruptFileError(path, str(exc)) from exc
    metadata = schema.metadata or {}
    found = metadata.get(KIND_KEY, b"").decode()
    if found != kind:
        raise SchemaMismatchError(path, f"holds {found or 'no'} records, expected {kind}")
    if metadata.get(VERSION_KEY, b"").decode() != str(SCHEMA_VERSION):
        raise SchemaMismatchError(path, f"not schema version {SCHEMA_VERSION}")
    problem = schema_difference(schema, DERIVED_SCHEMAS[kind])
    if problem is not None:
        raise SchemaMismatchError(path, f"{kind} columns differ from the schema: {problem}")


def derived_files(run: RunFolder, kind: str) -> list[Path]:
    """Every chunk file of every ``kind`` output of ``run``, checked, in path order."""
    base = run.root / kind
    if not base.is_dir():
        return []
    paths = [
        p for p in sorted(base.glob("*/*/step=*.parquet"))
        if not is_temporary(p) and parse_step_dirname(p.stem) is not None
    ]
    for path in paths:
        check_derived_file(path, kind)
    return [p.resolve() for p in paths]
