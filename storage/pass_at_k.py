"""pass@k and avg@k from stored episodes: a DuckDB macro and two views over ``scores``.

For a task played ``n`` times in one step (a GRPO group, or ``[validation].episodes_per_task``
episodes in an evaluation) of which ``c`` passed (``scores.passed``: the environment's own
verdict, an errored episode counting as a failure, as in ``pass_rate`` everywhere):

- **pass@k** is the chance that at least one of ``k`` episodes drawn from those ``n``
  without replacement passes: ``1 - C(n-c, k) / C(n, k)``, the unbiased estimator of
  "solved within k tries" (Chen et al., 2021). It is computed as the product
  ``1 - prod_{i=n-c+1..n} (1 - k/i)``, which never forms a large binomial. Defined for
  ``1 <= k <= n``.
- **avg@k** is the expected share of ``k`` drawn episodes that pass, which is the task's
  pass rate ``c / n`` whatever ``k`` is: it says how reliably the task is solved, where
  pass@k says whether it is solved at all. avg@1 = pass@1.

Overall figures average the per-task ones over the tasks with at least ``k`` episodes
(each task weighs the same, however many episodes it has).

In SQL (``rollflow sql``, ``open_run_sql``):

- ``pass_at_k(n, c, k)``: the macro, NULL outside ``1 <= k <= n``, ``0 <= c <= n``.
- ``task_pass_at_k``: one row per (run, split, step, task, k) for ``k = 1..n`` (with its ``env``):
  ``episodes`` (n), ``passes`` (c), ``pass_at_k``, ``avg_at_k``, ``reward_mean`` (mean
  ``final_reward`` of the episodes counted in the group baseline, those without a
  ``scoring_error``).
- ``pass_at_k``: one row per (run, split, step, k): ``tasks`` (those with n >= k) and the
  means of the three figures over them.
- ``env_pass_at_k``: the same per environment (``env``, a mixture member's label; the one
  environment's short name otherwise; NULL for files written before the column), so a
  mixture's members read apart. ``task_pass_at_k`` carries ``env`` too.

``pass_at_k_exact`` is the same estimator in Python with exact fractions, for checks.
"""

from __future__ import annotations

from fractions import Fraction
from math import comb

import duckdb

MACRO_SQL = """
CREATE MACRO pass_at_k(n, c, k) AS
    CASE WHEN k < 1 OR k > n OR c < 0 OR c > n THEN NULL
         WHEN c = 0 THEN 0.0
         WHEN n - c < k THEN 1.0
         ELSE 1.0 - list_product(list_transform(range(n - c + 1, n + 1), lambda i: 1.0 - k::DOUBLE / i))
    END
"""

TASK_VIEW_SQL = """
CREATE VIEW task_pass_at_k AS
WITH per_task AS (
    SELECT run_id, split, step, any_value(env) AS env, task_id,
           count(*)::BIGINT AS episodes,
           count_if(passed)::BIGINT AS passes,
           avg(final_reward) FILTER (WHERE scoring_error IS NULL) AS reward_mean
    FROM scores
    GROUP BY run_id, split, step, task_id
)
SELECT run_id, split, step, env, task_id, k, episodes, passes,
       pass_at_k(episodes, passes, k) AS pass_at_k,
       passes / episodes AS avg_at_k,
       reward_mean
FROM per_task, range(1, episodes + 1) AS ks(k)
"""

SUMMARY_VIEW_SQL = """
CREATE VIEW pass_at_k AS
SELECT run_id, split, step, k,
       count(*) AS tasks,
       avg(pass_at_k) AS pass_at_k,
       avg(avg_at_k) AS avg_at_k,
       avg(reward_mean) AS reward_mean
FROM task_pass_at_k
GROUP BY run_id, split, step, k
"""

ENV_SUMMARY_VIEW_SQL = """
CREATE VIEW env_pass_at_k AS
SELECT run_id, split, step, env, k,
       count(*) AS tasks,
       avg(pass_at_k) AS pass_at_k,
       avg(avg_at_k) AS avg_at_k,
       avg(reward_mean) AS reward_mean
FROM task_pass_at_k
GROUP BY run_id, split, step, env, k
"""

VIEWS = ("task_pass_at_k", "pass_at_k", "env_pass_at_k")


def create_pass_at_k_views(con: duckdb.DuckDBPyConnection) -> None:
    """The macro and both views, on a connection that already has the ``scores`` view."""
    con.execute(MACRO_SQL)
    con.execute(TASK_VIEW_SQL)
    con.execute(SUMMARY_VIEW_SQL)
    con.execute(ENV_SUMMARY_VIEW_SQL)


def pass_at_k_exact(n: int, c: int, k: int) -> Fraction:
    """``1 - C(n-c, k) / C(n, k)`` as an exact fraction (``1 <= k <= n``, ``0 <= c <= n``)."""
    if not (1 <= k <= n and 0 <= c <= n):
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    return 1 - Fraction(comb(n - c, k), comb(n, k))


def overall_pass_at_k(
    con: duckdb.DuckDBPyConnection, split: str, step: int, run_id: str | None = None
) -> list[dict[str, float]]:
    """The ``pass_at_k`` view's rows of one step, by ``k``: what ``rollflow eval`` reports."""
    result = con.execute(
        "SELECT k, tasks, pass_at_k, avg_at_k, reward_mean FROM pass_at_k "
        "WHERE split = $split AND step = $step AND ($run_id IS NULL OR run_id = $run_id) ORDER BY k",
        {"split": split, "step": step, "run_id": run_id},
    )
    names = [d[0] for d in result.description or []]
    return [dict(zip(names, row, strict=True)) for row in result.fetchall()]


def env_pass_at_k(
    con: duckdb.DuckDBPyConnection, split: str, step: int, env: str, run_id: str | None = None
) -> list[dict[str, float]]:
    """The ``env_pass_at_k`` view's rows of one step and environment, by ``k``."""
    result = con.execute(
        "SELECT k, tasks, pass_at_k, avg_at_k, reward_mean FROM env_pass_at_k WHERE split = $split AND "
        "step = $step AND env = $env AND ($run_id IS NULL OR run_id = $run_id) ORDER BY k",
        {"split": split, "step": step, "env": env, "run_id": run_id},
    )
    names = [d[0] for d in result.description or []]
    return [dict(zip(names, row, strict=True)) for row in result.fetchall()]
