"""Read-only SQL over run folders: ``rollflow sql``, the metrics and every reader of a run.

``open_run_sql`` returns an in-memory DuckDB connection with the views of
``storage/views.py``. It is then locked: external access is off except for exactly the
files behind the views (so a query can neither read other files nor write any), and the
configuration is frozen so no ``SET`` can undo that. ``run_query`` also refuses, by
parsed statement type, anything but one SELECT-like statement (``SELECT``, ``WITH``,
``FROM``, ``VALUES``, ``DESCRIBE``, ``SHOW``, ``SUMMARIZE``, ``EXPLAIN``): views live in
memory and the files are opened read-only, so no query changes a run.

The per-step metrics the pipeline logs are SQL over these views too:
``storage/step_metrics.py``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import duckdb

from rollflow.storage.derived import DERIVED_KINDS
from rollflow.storage.errors import StorageError
from rollflow.storage.pass_at_k import create_pass_at_k_views
from rollflow.storage.views import (
    VIEW_KINDS,
    admission_files,
    collect_files,
    create_admissions_view,
    create_derived_view,
    create_view,
    derived_view_files,
    resolve_run_folders,
)

_READ_ONLY_HINT = "only SELECT, WITH, FROM, VALUES, DESCRIBE, SHOW, SUMMARIZE, EXPLAIN"
# EXPLAIN [ANALYZE] [(options)]: ANALYZE runs the statement it explains, so that is checked too
_EXPLAIN_PREFIX = re.compile(r"^\s*explain\b(\s+analy[sz]e\b)?(\s*\([^)]*\))?", re.IGNORECASE)
# the first keyword after any blanks and comments; FORCE INSTALL counts as one
_LEADING_KEYWORD = re.compile(
    r"(?:\s+|--[^\n]*(?:\n|$)|/\*.*?\*/)*(force\s+install\b|[a-z]+)", re.IGNORECASE | re.DOTALL
)


class ReadOnlyQueryError(StorageError):
    """A statement that would write, or change the session, refused before it ran."""


class QueryError(StorageError):
    """DuckDB could not parse or run a query (bad SQL, unknown column...)."""


def open_run_sql(run_dirs: Sequence[Path | str] | Path | str) -> duckdb.DuckDBPyConnection:
    """A locked, read-only DuckDB connection with views over ``run_dirs`` (paths or a glob)."""
    folders = resolve_run_folders(run_dirs)
    con = duckdb.connect(":memory:")
    con.execute("SET parquet_metadata_cache = true")  # footers are read once, not per query
    allowed: list[str] = []
    for view in VIEW_KINDS:
        groups = collect_files(folders, view)
        create_view(con, view, groups)
        allowed.extend(str(p) for g in groups for p in g.paths)
    admissions = admission_files(folders)
    create_admissions_view(con, admissions)
    allowed.extend(str(p) for _, paths in admissions for p in paths)
    for view in DERIVED_KINDS:
        derived = derived_view_files(folders, view)
        create_derived_view(con, view, derived)
        allowed.extend(str(p) for _, paths in derived for p in paths)
    create_pass_at_k_views(con)  # over `scores`; storage/pass_at_k.py
    con.execute("SET allowed_paths = $paths", {"paths": allowed})
    con.execute("SET autoinstall_known_extensions = false")
    con.execute("SET autoload_known_extensions = false")
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")
    return con


def run_query(con: duckdb.DuckDBPyConnection, sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
    """Run one read-only statement; returns the column names and the rows."""
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as exc:
        raise QueryError(str(exc)) from exc
    if not statements:
        raise QueryError("no SQL statement given")
    if len(statements) > 1:
        raise QueryError(f"one statement at a time; got {len(statements)}")
    _refuse_writes(statements[0])
    try:
        result = con.execute(sql)
        columns = [d[0] for d in result.description or []]
        return columns, result.fetchall()
    except duckdb.Error as exc:
        raise QueryError(str(exc)) from exc


def _statement_name(statement: duckdb.Statement) -> str:
    """The statement's leading keyword as written (``INSTALL``, ``PRAGMA``, ``CHECKPOINT``):
    DuckDB's types lump some together (INSTALL is a LOAD, PRAGMA a SET, CHECKPOINT a CALL)."""
    found = _LEADING_KEYWORD.match(statement.query)
    word = " ".join(found.group(1).upper().split()) if found else "WITH"
    if word != "WITH":
        return word
    try:
        return statement.type.name
    except ValueError:  # a type the duckdb module has no name for
        return "this"


def _refuse_writes(statement: duckdb.Statement) -> None:
    try:
        kind = statement.type
    except ValueError:  # a type the duckdb module has no name for: not a query either
        kind = None
    if kind == duckdb.StatementType.EXPLAIN:
        inner = _EXPLAIN_PREFIX.sub("", statement.query, count=1)
        try:
            explained = duckdb.extract_statements(inner)
        except duckdb.Error:
            explained = []
        if len(explained) == 1 and explained[0].type == duckdb.StatementType.SELECT:
            return
        raise ReadOnlyQueryError(f"refused: EXPLAIN of anything but a query ({_READ_ONLY_HINT})")
    if kind != duckdb.StatementType.SELECT:
        raise ReadOnlyQueryError(
            f"refused: {_statement_name(statement)} statements change data or the session, and run SQL is "
            f"read-only ({_READ_ONLY_HINT})"
        )


def describe_views(con: duckdb.DuckDBPyConnection) -> dict[str, list[tuple[str, str]]]:
    """Each view's columns as (name, DuckDB type): the stored tables' views first, then every
    other one the connection has (``admissions``, ``rescores``, ``replays``, the pass@k
    ones), by name; the helpers whose names start with ``_`` are left out."""
    others = sorted(
        row[0] for row in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()
        if not row[0].startswith("_") and row[0] not in VIEW_KINDS
    )
    return {
        view: [(row[0], row[1]) for row in con.execute(f"DESCRIBE {view}").fetchall()]
        for view in (*VIEW_KINDS, *others)
    }
