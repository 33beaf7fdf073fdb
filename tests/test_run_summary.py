"""ops/run_summary.py: the lines a finished run ends with (what validation says it learned)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rollflow.config.run import parse_config
from rollflow.storage.runfolder import RunFolder
from rollflow.ops.run_summary import CURVE_SQL, learning_summary, validation_change

TASKS = [f"t{i}" for i in range(12)]


def write_validation(folder: RunFolder, step: int, passed: dict[str, list[bool]]) -> None:
    path = folder.step_paths(step, "validation").scores
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [(task, ok) for task, outcomes in passed.items() for ok in outcomes]
    pq.write_table(pa.table({
        "task_id": [task for task, _ in rows],
        "split": ["validation"] * len(rows),
        "passed": [ok for _, ok in rows],
        "final_reward": [float(ok) for _, ok in rows],
    }), path)


def test_a_clear_gain_is_reported_paired_and_beyond_the_noise(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "run")
    write_validation(folder, 0, {task: [False, False, True, False] for task in TASKS})  # 0.25 each
    write_validation(folder, 5, {task: [False, True, False, False] for task in TASKS})  # unchanged
    write_validation(folder, 10, {task: [True, True, True, i % 3 == 0] for i, task in enumerate(TASKS)})
    (line,) = validation_change(folder)
    # first vs last pass, not the middle one; 12 tasks, every one up
    assert line.startswith("validation pass rate 0.250 at step 0 -> 0.833 at step 10: +0.583 +- ")
    assert "paired over 12 tasks (12 up, 0 down)" in line
    assert line.endswith("beyond the validation's noise")


def test_no_change_is_within_the_noise_and_too_little_to_compare_is_no_line(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "run")
    write_validation(folder, 0, {task: [i % 2 == 0, False] for i, task in enumerate(TASKS)})
    assert validation_change(folder) == []  # one pass: nothing to compare
    write_validation(folder, 3, {task: [i % 3 == 0, False] for i, task in enumerate(TASKS)})
    (line,) = validation_change(folder)
    assert line.endswith("within the validation's noise"), line
    write_validation(folder, 6, {"other": [True], "tasks": [False]})
    assert validation_change(folder) == []  # the last pass validated other tasks: no paired figure


def test_a_mixture_gets_a_paired_line_per_member(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "run")
    tasks = [f"a/{t}" for t in TASKS[:6]] + [f"b/{t}" for t in TASKS[6:]]
    write_validation(folder, 0, {task: [False, False] for task in tasks})
    write_validation(folder, 4, {task: [task.startswith("a/"), False] for task in tasks})
    whole, first, second = validation_change(folder, ["a", "b"])
    assert whole.startswith("validation pass rate 0.000 at step 0 -> 0.250 at step 4: +0.250")
    assert first.startswith("  a: validation pass rate 0.000 at step 0 -> 0.500 at step 4: +0.500")
    assert "paired over 6 tasks (6 up, 0 down)" in first
    assert second.startswith("  b: validation pass rate 0.000 at step 0 -> 0.000 at step 4: +0.000")


def test_the_summary_says_where_the_curve_is(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "run")
    write_validation(folder, 0, {task: [False] for task in TASKS})
    write_validation(folder, 2, {task: [True] for task in TASKS})
    (folder.root / "val_reward_curve.png").write_bytes(b"png")
    ref = {"tracking_uri": "sqlite:////somewhere/mlflow.db", "experiment_id": "1", "mlflow_run_id": "abc"}
    (folder.root / "tracking.json").write_text(json.dumps(ref))
    lines = learning_summary(parse_config({"tracking": {"experiment": "demo"}}), folder)
    assert lines[0].startswith("validation pass rate 0.000 at step 0 -> 1.000 at step 2: +1.000 +- 0.000")
    assert lines[1] == f"the curve: rollflow sql {folder.root} \"{CURVE_SQL}\""
    assert lines[2] == f"  drawn: {folder.root / 'val_reward_curve.png'}"
    assert lines[3] == "  in MLflow (experiment 'demo', run abc): mlflow ui --backend-store-uri sqlite:////somewhere/mlflow.db"
    untracked = learning_summary(parse_config({"tracking": {"enabled": False}}), folder)
    assert untracked == lines[:3]
