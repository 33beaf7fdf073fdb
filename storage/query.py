"""Read-only SQL over run folders, and the per-step metrics the pipeline logs.

``open_run_sql`` returns an in-memory DuckDB connection with the views of
``storage/views.py``. It is then locked: external access is off except for exactly the
files behind the views (so a query can neither read other files nor write any), and the
configuration is frozen so no ``SET`` can undo that. ``run_query`` also refuses, by
parsed statement type, anything but one SELECT-like statement (``SELECT``, ``WITH``,
``FROM``, ``VALUES``, ``DESCRIBE``, ``SHOW``, ``SUMMARIZE``, ``EXPLAIN``): views live in
memory and the files are opened read-only, so no query changes a run.

The metrics are two SQL texts kept here as constants, one per family, so the pipeline,
``rollflow sql`` users and the tests share one definition of each:

- ``EPISODE_METRICS_SQL``: how episodes ended (ratios over every episode of the step,
  errored ones included, so terminated + truncated + error ratios sum to 1), turns and
  tokens per episode, episode and group counts. ``tokens_mean`` is the mean length of
  the context an episode ended at (``context_tokens``, what the overlong penalty reads),
  not the tokens processed (``total_tokens``, which counts history again wherever the
  chat template re-rendered it).
  ``tool_calls`` and ``tool_errors`` are the step's totals of the episodes' columns (the
  ``tool_error`` replies the model read); NaN where the files predate those columns.
- ``REWARD_METRICS_SQL``: statistics of ``final_reward`` (the reward with the overlong
  penalty or failed-parse reward applied: what GRPO optimises) over the *counted*
  episodes, those with no ``scoring_error`` (the scoring stage records there why it left
  an episode out of the group baseline: the rollout's error or the scorer's).
  ``pass_rate`` is the share of *all* the step's scored episodes that the scoring stage
  marked ``passed``: the environment's own verdict (its reward against its threshold;
  never a parse failure, never an error), so shaping moves the reward statistics but not
  the pass rate, and an episode that errored counts as a failure, not as absent. That is
  the one pass rate everywhere: the step and validation lines, ``val/reward/pass_rate``,
  ``rollflow eval`` and the run's closing summary (``ops/run_summary.py``, per task over
  every episode) agree. Leaving errors out would let a broken environment look better.
  ``zero_variance_skip_ratio`` is the share of groups whose counted final rewards are all
  equal, trivially so with fewer than two (GRPO learns nothing from them; the same rule as
  ``ScoreRecord.zero_variance``).
  ``reward_std`` is the population standard deviation.

- ``TEACHER_METRICS_SQL`` (OPD runs, ``teacher_metrics``): ``teacher_kl``, the mean over
  the step's action tokens of ``sampler_logprob - teacher_logprob`` (each sample's mean
  weighted by its action tokens), logged as ``opd/teacher_kl``. A step without a teacher
  table has no such metric, rather than a NaN in every GRPO run.

Reading only ``scores`` (no join with ``episodes``) keeps the reward query at one pass
over a few narrow columns.

A step with episodes but no scores yet gets NaN for the reward family.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import duckdb

from rollflow.storage.derived import DERIVED_KINDS
from rollflow.storage.errors import NoDataError, StorageError
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

METRIC_NAMES = (
    "terminated_ratio",
    "truncated_ratio",
    "context_overflow_ratio",
    "max_turns_ratio",
    "env_truncated_ratio",
    "parse_failure_ratio",
    "error_ratio",
    "reward_mean",
    "reward_std",
    "reward_min",
    "reward_max",
    "pass_rate",
    "zero_variance_skip_ratio",
    "turns_mean",
    "tokens_mean",
    "num_episodes",
    "num_groups",
    "tool_calls",
    "tool_errors",
)

_FILTER = """split = $split
  AND ($step IS NULL OR step = $step)
  AND ($run_id IS NULL OR run_id = $run_id)"""

EPISODE_METRICS_SQL = f"""
SELECT
    run_id,
    step,
    count(*)                                                AS num_episodes,
    count(DISTINCT group_id)                                AS num_groups,
    count_if(terminated) / count(*)                         AS terminated_ratio,
    count_if(truncated) / count(*)                          AS truncated_ratio,
    -- IS NOT DISTINCT FROM: a step where nothing was truncated has only NULL causes, and
    -- count_if over NULLs alone is NULL, not 0
    count_if(truncation_cause IS NOT DISTINCT FROM 'context_overflow') / count(*) AS context_overflow_ratio,
    count_if(truncation_cause IS NOT DISTINCT FROM 'max_turns') / count(*)     AS max_turns_ratio,
    count_if(truncation_cause IS NOT DISTINCT FROM 'env') / count(*)           AS env_truncated_ratio,
    count_if(truncation_cause IS NOT DISTINCT FROM 'parse_failure') / count(*) AS parse_failure_ratio,
    count_if(error IS NOT NULL) / count(*)                  AS error_ratio,
    avg(turns)                                              AS turns_mean,
    avg(context_tokens)                                     AS tokens_mean,
    sum(tool_calls)                                         AS tool_calls,
    sum(tool_errors)                                        AS tool_errors
FROM episodes
WHERE {_FILTER}
GROUP BY run_id, step
ORDER BY run_id, step
"""

REWARD_METRICS_SQL = f"""
WITH scored AS (
    SELECT
        run_id, step, group_id, final_reward, passed,
        scoring_error IS NULL AS counted
    FROM scores
    WHERE {_FILTER}
),
rewards AS (
    SELECT
        run_id,
        step,
        avg(final_reward) FILTER (counted)        AS reward_mean,
        stddev_pop(final_reward) FILTER (counted) AS reward_std,
        min(final_reward) FILTER (counted)        AS reward_min,
        max(final_reward) FILTER (counted)        AS reward_max,
        count_if(passed) / count(*)               AS pass_rate  -- errored episodes are failures
    FROM scored
    GROUP BY run_id, step
),
per_group AS (
    SELECT
        run_id,
        step,
        count_if(counted) < 2
            OR min(final_reward) FILTER (counted) = max(final_reward) FILTER (counted) AS all_equal
    FROM scored
    GROUP BY run_id, step, group_id
),
groups AS (
    SELECT run_id, step, count_if(all_equal) / count(*) AS zero_variance_skip_ratio
    FROM per_group
    GROUP BY run_id, step
)
SELECT
    run_id, step, reward_mean, reward_std, reward_min, reward_max, pass_rate,
    zero_variance_skip_ratio
FROM groups
LEFT JOIN rewards USING (run_id, step)
ORDER BY run_id, step
"""

TEACHER_METRICS_SQL = """
SELECT
    run_id,
    step,
    sum(teacher_kl * num_action_tokens) / nullif(sum(num_action_tokens), 0) AS teacher_kl
FROM teacher
WHERE ($step IS NULL OR step = $step)
  AND ($run_id IS NULL OR run_id = $run_id)
GROUP BY run_id, step
ORDER BY run_id, step
"""
TEACHER_METRIC_KEYS = {"teacher_kl": "opd/teacher_kl"}

# The curriculum's record (tasks/curriculum.py): each training task's most recent groups
# before a step, newest first, with how many of their episodes passed. A task plays at most
# one group a step, so (step DESC) orders them; group_id breaks ties in files of old runs.
RECENT_TASK_GROUPS_SQL = """
WITH groups AS (
    SELECT task_id, step, group_id, count_if(passed) AS passes, count(*) AS episodes
    FROM scores
    WHERE split = 'train' AND step < $before_step
    GROUP BY task_id, step, group_id
),
ranked AS (
    SELECT *, row_number() OVER (PARTITION BY task_id ORDER BY step DESC, group_id DESC) AS recency
    FROM groups
)
SELECT task_id, passes, episodes FROM ranked WHERE recency <= $recent ORDER BY task_id, recency
"""

# Passes and episodes per task of one step's split (the metrics' pass rate by difficulty).
TASK_PASSES_SQL = """
SELECT task_id, count_if(passed) AS passes, count(*) AS episodes
FROM scores
WHERE split = $split AND step = $step
GROUP BY task_id
ORDER BY task_id
"""


def recent_task_groups(
    con: duckdb.DuckDBPyConnection, before_step: int, recent: int
) -> dict[str, list[tuple[int, int]]]:
    """task_id -> (passes, episodes) of its ``recent`` latest training groups before
    ``before_step``, newest first (``RECENT_TASK_GROUPS_SQL``)."""
    rows = con.execute(RECENT_TASK_GROUPS_SQL, {"before_step": before_step, "recent": recent}).fetchall()
    groups: dict[str, list[tuple[int, int]]] = {}
    for task_id, passes, episodes in rows:
        groups.setdefault(task_id, []).append((int(passes), int(episodes)))
    return groups


def task_passes(con: duckdb.DuckDBPyConnection, step: int, split: str) -> dict[str, tuple[int, int]]:
    """task_id -> (passes, episodes) in ``split`` step ``step`` (``TASK_PASSES_SQL``)."""
    rows = con.execute(TASK_PASSES_SQL, {"step": step, "split": split}).fetchall()
    return {task_id: (int(passes), int(episodes)) for task_id, passes, episodes in rows}


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


def _family(
    con: duckdb.DuckDBPyConnection, sql: str, params: dict[str, Any]
) -> dict[tuple[str, int], dict[str, float]]:
    result = con.execute(sql, params)
    names = [d[0] for d in result.description or []]
    rows: dict[tuple[str, int], dict[str, float]] = {}
    for row in result.fetchall():
        values = dict(zip(names, row, strict=True))
        key = (values.pop("run_id"), values.pop("step"))
        rows[key] = {k: math.nan if v is None else float(v) for k, v in values.items()}
    return rows


def _metrics(
    con: duckdb.DuckDBPyConnection, step: int | None, split: str, run_id: str | None
) -> dict[tuple[str, int], dict[str, float]]:
    params = {"split": split, "step": step, "run_id": run_id}
    episodes = _family(con, EPISODE_METRICS_SQL, params)
    rewards = _family(con, REWARD_METRICS_SQL, params)
    merged: dict[tuple[str, int], dict[str, float]] = {}
    for key, values in episodes.items():
        combined = {**values, **rewards.get(key, {})}  # no scores yet: reward keys are NaN
        merged[key] = {name: combined.get(name, math.nan) for name in METRIC_NAMES}
    return merged


def _one_run(rows: dict[tuple[str, int], dict[str, float]], what: str) -> str:
    runs = sorted({run for run, _ in rows})
    if not runs:
        raise NoDataError(f"no episodes for {what}")
    if len(runs) > 1:
        raise StorageError(f"{what} matches several runs {runs}; pass run_id")
    return runs[0]


def metrics_by_step(
    con: duckdb.DuckDBPyConnection, split: str = "train", run_id: str | None = None
) -> dict[int, dict[str, float]]:
    """Every step's metrics of one run, in one pass of each family's SQL."""
    rows = _metrics(con, None, split, run_id)
    run = _one_run(rows, f"split {split!r}" + (f" of run {run_id!r}" if run_id else ""))
    return {step: values for (r, step), values in rows.items() if r == run}


def step_metrics(
    con: duckdb.DuckDBPyConnection,
    step: int | None = None,
    split: str = "train",
    run_id: str | None = None,
) -> dict[str, float]:
    """The metrics of one step (None: the latest step with episodes) of one run's ``split``.

    Keys are exactly ``METRIC_NAMES``; counts are floats like the rest.
    """
    what = f"{split} step {step if step is not None else '(latest)'}"
    rows = _metrics(con, step, split, run_id)
    run = _one_run(rows, what + (f" of run {run_id!r}" if run_id else ""))
    latest = max(s for r, s in rows if r == run)
    return rows[(run, latest)]


def teacher_metrics(
    con: duckdb.DuckDBPyConnection, step: int, run_id: str | None = None
) -> dict[str, float]:
    """``{"opd/teacher_kl": ...}`` for a training step with a teacher table; ``{}`` without."""
    rows = _family(con, TEACHER_METRICS_SQL, {"step": step, "run_id": run_id})
    if not rows:
        return {}
    if len(rows) > 1:
        raise StorageError(f"step {step} matches several runs {sorted(r for r, _ in rows)}; pass run_id")
    (values,) = rows.values()
    return {TEACHER_METRIC_KEYS[name]: value for name, value in values.items()}
