"""pass@k and avg@k (storage/pass_at_k.py): the estimator against brute-force enumeration of
every k-subset, the SQL macro against the estimator, and the views on a stored run whose
pass counts per task are known."""

from __future__ import annotations

from fractions import Fraction
from itertools import combinations
from pathlib import Path

import duckdb
import pytest

from rollflow.flows.cli import main
from rollflow.flows.eval import eval_report, format_report
from rollflow.storage.pass_at_k import MACRO_SQL, overall_pass_at_k, pass_at_k_exact
from rollflow.storage.query import open_run_sql, run_query
from rollflow.storage.runfolder import RunFolder
from rollflow.storage.schemas import episode_records_to_table, score_records_to_table
from rollflow.storage.synthetic import synthetic_episode, synthetic_score

SIZES = [(n, c, k) for n in range(1, 8) for c in range(n + 1) for k in range(1, n + 1)]


def brute_force(n: int, c: int, k: int) -> tuple[Fraction, Fraction]:
    """Over every k-subset of n episodes (the first c pass): the share of subsets with a pass,
    and the mean share of passing episodes in a subset."""
    subsets = list(combinations(range(n), k))
    any_pass = sum(any(i < c for i in subset) for subset in subsets)
    passing = sum(Fraction(sum(i < c for i in subset), k) for subset in subsets)
    return Fraction(any_pass, len(subsets)), passing / len(subsets)


@pytest.mark.parametrize(("n", "c", "k"), SIZES)
def test_the_estimator_equals_enumeration(n: int, c: int, k: int) -> None:
    pass_k, avg_k = brute_force(n, c, k)
    assert pass_at_k_exact(n, c, k) == pass_k
    assert avg_k == Fraction(c, n)  # avg@k is the pass rate, whatever k


def test_the_sql_macro_equals_the_estimator() -> None:
    con = duckdb.connect()
    con.execute(MACRO_SQL)
    rows = con.execute(
        "SELECT n, c, k, pass_at_k(n, c, k) FROM range(1, 30) a(n), range(0, 30) b(c), range(1, 30) d(k) "
        "WHERE c <= n AND k <= n"
    ).fetchall()
    assert len(rows) > 4000
    for n, c, k, value in rows:
        assert value == pytest.approx(float(pass_at_k_exact(n, c, k)), abs=1e-12), (n, c, k)
    outside = con.execute("SELECT pass_at_k(3, 1, 4), pass_at_k(3, 1, 0), pass_at_k(3, 4, 1)").fetchone()
    assert outside == (None, None, None)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k_exact(3, 1, 4)


# Known counts per task: (episodes, passes).
COUNTS = {0: (4, 0), 1: (4, 1), 2: (4, 4), 3: (2, 1)}


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    folder = RunFolder(tmp_path / "eval-run")
    folder.write_config(
        '[env]\nname = "rollflow.envs.reasoning_gym:load_environment"\n'
        'kwargs = { dataset = "chain_sum", size = 8 }\n'
    )
    episodes, scores = [], []
    for task, (n, c) in COUNTS.items():
        for index in range(n):
            episode = synthetic_episode(folder.run_id, 0, task, index, split="validation")
            episodes.append(episode)
            scores.append(synthetic_score(episode, 1.0 if index < c else 0.25))
    folder.write_stage(episode_records_to_table(episodes), 0, "episodes", "validation")
    folder.write_stage(score_records_to_table(scores), 0, "scores", "validation")
    return folder.root


def test_the_views_read_a_stored_run(run_dir: Path) -> None:
    con = open_run_sql(run_dir)
    _, rows = run_query(
        con, "SELECT task_id, k, episodes, passes, pass_at_k, avg_at_k, reward_mean FROM task_pass_at_k ORDER BY ALL"
    )
    assert len(rows) == 4 + 4 + 4 + 2
    for task_id, k, n, c, pass_k, avg_k, reward in rows:
        assert (n, c) == COUNTS[int(task_id.removeprefix("task-"))]
        assert pass_k == pytest.approx(float(pass_at_k_exact(n, c, k)))
        assert avg_k == pytest.approx(c / n)
        assert reward == pytest.approx((c * 1.0 + (n - c) * 0.25) / n)  # no scoring errors here
    overall = overall_pass_at_k(con, "validation", 0)
    assert [row["k"] for row in overall] == [1, 2, 3, 4]
    assert [row["tasks"] for row in overall] == [4, 4, 3, 3]  # task 3 has two episodes only
    for row in overall:
        counted = [(n, c) for n, c in COUNTS.values() if n >= row["k"]]
        assert row["pass_at_k"] == pytest.approx(sum(float(pass_at_k_exact(n, c, row["k"])) for n, c in counted) / len(counted))
        assert row["avg_at_k"] == pytest.approx(sum(c / n for n, c in counted) / len(counted))
    assert overall[0]["pass_at_k"] == pytest.approx((0 + 0.25 + 1 + 0.5) / 4)  # pass@1 = the mean pass rate
    assert overall[3]["pass_at_k"] == pytest.approx((0 + 1 + 1) / 3)


def test_rollflow_sql_reads_the_view(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["sql", str(run_dir), "SELECT k, tasks, round(pass_at_k, 4) AS p FROM pass_at_k ORDER BY k", "--format", "csv"])
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    assert out.splitlines() == ["k,tasks,p", "1,4,0.4375", "2,4,0.625", "3,3,0.5833", "4,3,0.6667"]


def test_the_eval_report_names_the_environment_and_gives_pass_at_k(run_dir: Path) -> None:
    report = eval_report(run_dir)
    assert report.environment == "reasoning-gym dataset chain_sum (rollflow.envs.reasoning_gym:load_environment)"
    assert [row["k"] for row in report.pass_at_k] == [1, 2, 3, 4]
    text = format_report(report, "tiny")
    assert "  environment   reasoning-gym dataset chain_sum (" in text
    assert "  pass@k        @1 0.438  @2 0.625  @3 0.583  @4 0.667  (tasks 4;" in text
    assert "  avg@k         0.438  (mean pass rate per task" in text and "FROM task_pass_at_k" in text
    # the pass rate weighs episodes (6 of 14), avg@k weighs tasks (0, 1/4, 1, 1/2)
    assert f"{report.metrics['pass_rate']:.3f}" == "0.429"
