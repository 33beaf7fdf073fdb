"""The DuckDB views over one or more run folders: ``episodes``, ``scores``, ``samples``,
``teacher`` (OPD runs only; empty elsewhere), ``steps``; and ``rescores`` and ``replays``
over what ``rollflow rescore`` / ``rollflow replay`` wrote beside a run (storage/derived.py).

Each view is a ``UNION ALL`` over (run, split) of one ``read_parquet`` (or ``read_json``
for ``train.json``) of the files listed here, so a half-written temporary is never read
and a stage that is missing simply contributes no rows: an empty run gives empty views
with the right columns. Part files are listed as soon as each is complete, so a rollout
still in progress is already visible.

Identity columns come from where a file sits: ``run_id`` is the run folder's name (the
path is the run's identity, so a renamed copy is its own run) and ``split`` is ``train``
under ``steps/`` and ``validation`` under ``validation/``. ``step`` is the data's own
column, which ``RunFolder`` checks against the ``step=`` folder on every write. The
views do not use DuckDB's hive-partition parsing: it would turn any ``key=value`` folder
above the run (a user's own path) into extra columns.

A file older than an optional column (``storage/arrow_schemas.py``'s ``OPTIONAL_COLUMNS``, e.g.
``episodes.node``) shows it as null: a group none of whose files has it selects a typed
NULL, a group where some have it reads by name (``union_by_name``).

Every file's footer is checked before a view is built, so a corrupt or foreign file
fails here with its path, not later in the middle of a query.
"""

from __future__ import annotations

import glob
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from rollflow.storage.arrow_schemas import OPTIONAL_COLUMNS, SCHEMAS, TRAIN_RESULT_SCHEMA, RecordKind
from rollflow.storage.derived import DERIVED_SCHEMAS, derived_files
from rollflow.storage.errors import SchemaMismatchError, StorageError
from rollflow.storage.parquet import check_file
from rollflow.storage.runfolder import OPTIONAL_STAGES, SPLIT_DIRS, STAGES, RunFolder
from rollflow.storage.step_names import parse_step_dirname
from rollflow.storage.runs import looks_like_run

VIEW_KINDS = {
    "episodes": RecordKind.EPISODES,
    "scores": RecordKind.SCORES,
    "samples": RecordKind.SAMPLES,
    "teacher": RecordKind.TEACHER,
    "steps": RecordKind.TRAIN,
}
_JSON_TYPES = {
    pa.int32(): "INTEGER",
    pa.int64(): "BIGINT",
    pa.float64(): "DOUBLE",
    pa.string(): "VARCHAR",
    pa.map_(pa.string(), pa.float64()): "MAP(VARCHAR, DOUBLE)",
}


@dataclass(frozen=True)
class ViewFiles:
    """The complete files of one view from one run and split."""

    run_id: str
    split: str
    paths: tuple[Path, ...]


def view_schema(view: str) -> pa.Schema:
    """The columns a view shows: the record's, plus ``split`` where the record lacks it."""
    schema = SCHEMAS[VIEW_KINDS[view]].remove_metadata()
    if "split" not in schema.names:
        schema = schema.insert(schema.get_field_index("step") + 1, pa.field("split", pa.string()))
    return schema


def _stage_files(folder: RunFolder, split: str, stage: str) -> list[Path]:
    files: list[Path] = []
    for step in folder.steps(split):
        single = folder.stage_path(step, stage, split)
        if single.exists():
            files.append(single)
        elif stage != "train":
            files.extend(folder.part_paths(step, stage, split))
    return files


def collect_files(folders: Sequence[RunFolder], view: str) -> list[ViewFiles]:
    """Every complete file of ``view`` in ``folders``, checked; grouped by run and split."""
    stage = "train" if view == "steps" else view
    groups = []
    for folder in folders:
        for split in SPLIT_DIRS:
            if stage not in STAGES[split] + OPTIONAL_STAGES[split]:
                continue
            paths = _stage_files(folder, split, stage)
            for path in paths:
                _check(folder, path, view)
            if paths:
                groups.append(ViewFiles(folder.run_id, split, tuple(p.resolve() for p in paths)))
    return groups


def _check(folder: RunFolder, path: Path, view: str) -> None:
    if view != "steps":
        check_file(path, VIEW_KINDS[view])
        return
    step = parse_step_dirname(path.parent.name)
    assert step is not None, f"{path} is not under a step= folder"
    folder.read_train_result(step)  # raises naming the file when it is not a train result


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _paths_literal(paths: Iterable[Path]) -> str:
    return "[" + ", ".join(_literal(str(p)) for p in paths) + "]"


def _json_columns() -> str:
    pairs = [f"{_literal(f.name)}: {_literal(_JSON_TYPES[f.type])}" for f in TRAIN_RESULT_SCHEMA]
    return "{" + ", ".join(pairs) + "}"


_DUCKDB_TYPES = {pa.string(): "VARCHAR", pa.int32(): "INTEGER"}  # of the optional columns


def _optional_presence(view: str, files: ViewFiles) -> dict[str, int]:
    """How many of the group's files have each optional column of the view."""
    optional = OPTIONAL_COLUMNS.get(VIEW_KINDS[view], ()) if view != "steps" else ()
    if not optional:
        return {}
    names = [set(pq.read_schema(path).names) for path in files.paths]
    return {column: sum(column in found for found in names) for column in optional}


def _select_one(view: str, files: ViewFiles) -> str:
    presence = _optional_presence(view, files)
    schema = view_schema(view)
    columns = []
    for name in schema.names:
        if name == "run_id":
            columns.append(f"{_literal(files.run_id)} AS run_id")
        elif name == "split":
            columns.append(f"{_literal(files.split)} AS split")
        elif presence.get(name, len(files.paths)) == 0:
            columns.append(f'CAST(NULL AS {_DUCKDB_TYPES[schema.field(name).type]}) AS "{name}"')
        else:
            columns.append(f'"{name}"')
    mixed = any(0 < count < len(files.paths) for count in presence.values())
    if view == "steps":
        source = f"read_json({_paths_literal(files.paths)}, columns = {_json_columns()}, hive_partitioning = false)"
    else:
        by_name = ", union_by_name = true" if mixed else ""
        source = f"read_parquet({_paths_literal(files.paths)}, hive_partitioning = false{by_name})"
    return f"SELECT {', '.join(columns)} FROM {source}"


def create_view(con: duckdb.DuckDBPyConnection, view: str, groups: Sequence[ViewFiles]) -> None:
    if groups:
        body = "\nUNION ALL\n".join(_select_one(view, g) for g in groups)
        con.execute(f"CREATE VIEW {view} AS\n{body}")
        return
    empty = view_schema(view).empty_table()
    con.register(f"_empty_{view}", empty)
    con.execute(f"CREATE VIEW {view} AS SELECT * FROM _empty_{view}")


def resolve_run_folders(run_dirs: Sequence[Path | str] | Path | str) -> list[RunFolder]:
    """Run folders from paths or one glob string (``runs/*``); each must look like a run."""
    if isinstance(run_dirs, str | Path):
        text = str(run_dirs)
        matched = sorted(glob.glob(text)) if glob.has_magic(text) else [text]
        if not matched:
            raise StorageError(f"{text}: no run folder matches")
        run_dirs = matched
    folders = []
    for raw in run_dirs:
        path = Path(raw)
        if not path.exists():
            raise StorageError(f"{path}: no such run folder")
        if not looks_like_run(path):
            raise SchemaMismatchError(
                path, "not a run folder (no config.toml, steps/, validation/ or checkpoints/)"
            )
        folders.append(RunFolder(path))
    unique: dict[str, RunFolder] = {}
    for folder in folders:
        known = unique.setdefault(folder.run_id, folder)
        if known.root.resolve() != folder.root.resolve():
            raise StorageError(
                f"two runs share the id {folder.run_id!r}: {known.root} and {folder.root}"
            )
    return list(unique.values())


# ---------------------------------------------------------------- async admissions

ADMISSION_JSON = "admission.json"  # tasks/collect.py writes one per async training step
_ADMISSION_COLUMNS = {
    "group": "BIGINT", "task_id": "VARCHAR", "admitted": "BOOLEAN", "trained_group_id": "VARCHAR",
    "start_version": "BIGINT", "finish_version": "BIGINT", "staleness": "BIGINT", "collect_s": "DOUBLE",
}  # fmt: skip


def admission_files(folders: Sequence[RunFolder]) -> list[tuple[str, list[Path]]]:
    """Each run's ``steps/step=*/admission.json`` (async runs only)."""
    found = []
    for folder in folders:
        paths = [folder.step_dir(step) / ADMISSION_JSON for step in folder.steps("train")]
        paths = [p.resolve() for p in paths if p.exists()]
        if paths:
            found.append((folder.run_id, paths))
    return found


def create_admissions_view(con: duckdb.DuckDBPyConnection, files: Sequence[tuple[str, list[Path]]]) -> None:
    """``admissions``: one row per group an async step took (``admitted``) or dropped as
    stale, with its age in optimizer steps (``staleness``) and the step's ``train_wait_s``."""
    group_type = "STRUCT(" + ", ".join(f'"{k}" {v}' for k, v in _ADMISSION_COLUMNS.items()) + ")"
    columns = "{'step': 'BIGINT', 'train_wait_s': 'DOUBLE', 'groups': '" + group_type + "[]'}"
    selects = [
        f"SELECT {_literal(run_id)} AS run_id, step, train_wait_s, UNNEST(groups, recursive := true) "
        f"FROM read_json({_paths_literal(paths)}, columns = {columns}, hive_partitioning = false)"
        for run_id, paths in files
    ]
    if selects:
        con.execute("CREATE VIEW admissions AS\n" + "\nUNION ALL\n".join(selects))
        return
    fields = ", ".join(f'NULL::{v} AS "{k}"' for k, v in _ADMISSION_COLUMNS.items())
    con.execute(
        "CREATE VIEW admissions AS SELECT NULL::VARCHAR AS run_id, NULL::BIGINT AS step, "
        f"NULL::DOUBLE AS train_wait_s, {fields} WHERE false"
    )


# ---------------------------------------------------------------- rescores and replays


def derived_view_files(folders: Sequence[RunFolder], view: str) -> list[tuple[str, list[Path]]]:
    """Each run's chunk files of ``view`` (``rescores`` or ``replays``; storage/derived.py)."""
    found = []
    for folder in folders:
        paths = derived_files(folder, view)
        if paths:
            found.append((folder.run_id, paths))
    return found


def create_derived_view(
    con: duckdb.DuckDBPyConnection, view: str, files: Sequence[tuple[str, list[Path]]]
) -> None:
    """``rescores``: one scores row per episode and rescore (its name in ``rescore``), joinable
    to ``scores`` and ``episodes`` on ``run_id, episode_id``. ``replays``: one row per episode
    and replay. ``run_id`` is the run folder's name, as in every other view."""
    schema = DERIVED_SCHEMAS[view].remove_metadata()
    if not files:
        con.register(f"_empty_{view}", schema.empty_table())
        con.execute(f"CREATE VIEW {view} AS SELECT * FROM _empty_{view}")
        return
    columns = ", ".join('{} AS run_id' if n == "run_id" else f'"{n}"' for n in schema.names)
    selects = [
        f"SELECT {columns.format(_literal(run_id))} "
        f"FROM read_parquet({_paths_literal(paths)}, hive_partitioning = false)"
        for run_id, paths in files
    ]
    con.execute(f"CREATE VIEW {view} AS\n" + "\nUNION ALL\n".join(selects))
