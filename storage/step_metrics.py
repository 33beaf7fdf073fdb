"""The per-step metrics the pipeline logs, as SQL over a run's views (``storage/query.py``).

The metrics are SQL texts kept here as constants, one per family, so the pipeline,
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

- ``ENV_METRICS_SQL`` (``env_metrics``): the reward, pass and zero-variance figures of each
  environment of a mixture (the ``env`` column), by the rules above.

Reading only ``scores`` (no join with ``episodes``) keeps the reward query at one pass
over a few narrow columns.

A step with episodes but no scores yet gets NaN for the reward family.
"""

from __future__ import annotations

import math
from typing import Any

import duckdb

from rollflow.storage.errors import NoDataError, StorageError

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


ENV_METRICS_SQL = """
WITH scored AS (
    SELECT env, group_id, final_reward, passed, scoring_error IS NULL AS counted
    FROM scores
    WHERE split = $split AND step = $step AND env IS NOT NULL
),
per_group AS (
    SELECT env, count_if(counted) < 2
        OR min(final_reward) FILTER (counted) = max(final_reward) FILTER (counted) AS all_equal
    FROM scored GROUP BY env, group_id
)
SELECT s.env, avg(final_reward) FILTER (counted), count_if(passed) / count(*), count(*),
       (SELECT count_if(all_equal) / count(*) FROM per_group g WHERE g.env = s.env)
FROM scored s GROUP BY s.env ORDER BY s.env
"""


def env_metrics(con: duckdb.DuckDBPyConnection, step: int, split: str) -> dict[str, dict[str, float]]:
    """Per environment label (the ``env`` column) of ``split`` step ``step``: ``reward``,
    ``pass`` and ``zero_variance`` by ``REWARD_METRICS_SQL``'s rules, and ``episodes``
    (``ENV_METRICS_SQL``); files written before the column contribute nothing."""
    rows = con.execute(ENV_METRICS_SQL, {"step": step, "split": split}).fetchall()
    return {
        env: {"reward": math.nan if reward is None else float(reward), "pass": float(passed),
              "episodes": float(episodes), "zero_variance": float(flat)}
        for env, reward, passed, episodes, flat in rows
    }  # fmt: skip


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
