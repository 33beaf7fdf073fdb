"""scripts/compare_policies.py: pooled, paired comparison of two policies' validation passes."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from repo_script import REPO, load_script

from rollflow.tasks.gate_rule import GateError

compare = load_script("scripts/compare_policies.py")
SCRIPT = REPO / "scripts" / "compare_policies.py"


def write_pass(run_dir: Path, step: int, seed: int, passed: dict[str, list[bool]]) -> Path:
    """A run folder's validation pass with these episodes (reward 1 if passed, else 0)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(f"[train]\nseed = {seed}\n")
    folder = run_dir / "validation" / f"step={step:06d}"
    folder.mkdir(parents=True)
    rows = [(task, ok) for task, outcomes in passed.items() for ok in outcomes]
    pq.write_table(pa.table({
        "task_id": [task for task, _ in rows],
        "passed": [ok for _, ok in rows],
        "final_reward": [float(ok) for _, ok in rows],
        "split": ["validation"] * len(rows),
    }), folder / "scores.parquet")
    return folder


def test_paired_change_is_the_mean_per_task_difference_with_its_standard_error() -> None:
    before = {"a": 0.0, "b": 0.5, "c": 0.5, "d": 1.0}
    after = {"a": 0.5, "b": 1.0, "c": 0.5, "d": 1.0}
    change = compare.paired_change(before, after)
    diffs = [0.5, 0.5, 0.0, 0.0]
    assert change.mean == pytest.approx(0.25)
    assert change.se == pytest.approx(math.sqrt(sum((d - 0.25) ** 2 for d in diffs) / 3) / 2)
    assert (change.gained, change.lost) == (2, 0)
    # Two tasks up by 0.5, two unchanged: a flip is as far from zero only when both 0.5s
    # keep one sign (both + or both -, whatever the zeros do), half the flips.
    assert change.p_value == pytest.approx(0.5, abs=0.02)
    assert math.isnan(compare.paired_change(before, after, draws=0).p_value)  # the figure's table draws none


def test_a_large_consistent_change_has_a_small_p_value_and_no_change_a_large_one() -> None:
    tasks = [f"t{i}" for i in range(40)]
    up = compare.paired_change({t: 0.0 for t in tasks}, {t: 0.5 for t in tasks}, draws=2000)
    assert up.p_value < 0.001 and up.mean == pytest.approx(0.5)
    mixed = compare.paired_change({t: 0.5 for t in tasks},
                                  {t: (1.0 if i % 2 else 0.0) for i, t in enumerate(tasks)}, draws=2000)
    assert mixed.mean == pytest.approx(0.0) and mixed.p_value > 0.9


def test_passes_of_one_policy_pool_by_task(tmp_path: Path) -> None:
    run = write_pass(tmp_path / "grpo", step=30, seed=0, passed={"a": [True, False], "b": [False, False]})
    evaluated = write_pass(tmp_path / "eval", step=0, seed=1, passed={"a": [True, True], "b": [True, False]})
    passes = [compare.find_pass(run), compare.find_pass(tmp_path / "eval")]  # a run folder finds its one pass
    assert [p.folder for p in passes] == [run, evaluated]
    compare.check_independent("after", passes)
    pooled = compare.per_task(compare.episodes_by_task([p.folder / "scores.parquet" for p in passes]), "passed")
    assert pooled == {"a": 0.75, "b": 0.25}


def test_the_same_seed_and_step_twice_on_one_side_is_refused(tmp_path: Path) -> None:
    # An eval of the SFT policy with the run's own seed replays the run's step-0 validation
    # episode for episode; pooling it would shrink the error bar without new data.
    run = write_pass(tmp_path / "grpo", step=0, seed=0, passed={"a": [True]})
    again = write_pass(tmp_path / "eval", step=0, seed=0, passed={"a": [True]})
    with pytest.raises(SystemExit, match="same episodes"):
        compare.check_independent("before", [compare.find_pass(run), compare.find_pass(again)])


def test_sides_with_different_tasks_are_refused() -> None:
    with pytest.raises(GateError, match="different tasks"):
        compare.paired_change({"a": 0.0, "b": 1.0}, {"a": 1.0, "c": 0.0})


def test_the_command_prints_both_sides_and_the_change(tmp_path: Path) -> None:
    tasks = {f"t{i}": [False, False] for i in range(6)}
    before = write_pass(tmp_path / "grpo", step=0, seed=0, passed=tasks)
    after = write_pass(tmp_path / "grpo", step=10, seed=0, passed={t: [True, False] for t in tasks})
    result = subprocess.run([sys.executable, str(SCRIPT), "--before", str(before), "--after", str(after)],
                            capture_output=True, text=True, check=True)
    assert "| before | 1 | 6 | 12 | 0.000 | 0.000 |" in result.stdout
    assert "| after | 1 | 6 | 12 | 0.500 | 0.500 |" in result.stdout
    assert "pass rate: +0.500 +- 0.000" in result.stdout and "tasks up 6, down 0" in result.stdout
