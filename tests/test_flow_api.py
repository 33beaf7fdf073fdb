"""train_multi_turn: the reference's Python API runs the same flow on live objects."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollflow.config.grpo import GRPOConfig
from rollflow.envs.calculator_math import load_environment as load_calculator_math
from rollflow.flows.api import train_multi_turn
from rollflow.storage.query import open_run_sql, run_query
from rollflow.storage.runfolder import RunFolder

pytestmark = pytest.mark.usefixtures("prefect_harness")


@pytest.mark.slow  # 17 s in a loaded suite run (docs/testing.md)
def test_train_multi_turn_runs_the_flow_on_python_objects(tiny_model_dir: Path, tmp_path: Path) -> None:
    suite = load_calculator_math(num_train=6, num_validation=2)
    config = GRPOConfig(
        model=str(tiny_model_dir),
        batch_size=2,
        episodes_per_task=2,
        num_steps=1,
        max_turns=2,
        max_model_length=1024,
        max_completion_tokens=8,
        validation_interval=1,
        learning_rate=1e-3,
        runs_dir=str(tmp_path / "runs"),
    )
    run_dir = train_multi_turn(config, tasks=suite.tasks, env_factory=suite.env_factory, val_tasks=suite.val_tasks)
    folder = RunFolder(run_dir)
    assert folder.completed_steps() == [0]
    assert folder.steps("validation") == [0, 1]
    con = open_run_sql([run_dir])
    _, rows = run_query(con, "SELECT split, count(*) FROM episodes GROUP BY split ORDER BY split")
    assert rows == [("train", 4), ("validation", 4)]  # 2 tasks x 2 episodes; 2 val tasks at 2 steps
    _, tasks = run_query(con, "SELECT DISTINCT task_id FROM episodes WHERE split = 'validation' ORDER BY 1")
    assert {t for (t,) in tasks} == {t.id for t in suite.val_tasks}

    # Resuming with the same objects finds the same run and redoes nothing.
    again = train_multi_turn(
        config, tasks=suite.tasks, env_factory=suite.env_factory, val_tasks=suite.val_tasks, run_dir=run_dir
    )
    assert again == run_dir and folder.completed_steps() == [0]


def test_a_run_of_python_objects_cannot_resume_without_them(tmp_path: Path) -> None:
    from rollflow.envs.registry import registered_environment

    with pytest.raises(LookupError, match="train_multi_turn"):
        registered_environment("never-registered")
