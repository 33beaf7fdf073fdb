"""What a user meets outside the checkout: ``from rollflow import ...`` and the ``rollflow`` command.

Each test works in a temporary folder that holds the user's own ``tasks.py`` and
``storage.py`` (the Celery / invoke convention), each raising if imported: rollflow's own
``tasks`` and ``storage`` live under ``rollflow.``, so neither file may ever be picked up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import rollflow
from rollflow.config.run import config_to_toml, load_config
from tiny_run import REPO

ROLLFLOW = Path(sys.executable).parent / "rollflow"  # the installed console script
REFERENCE_NAMES = (
    "train_multi_turn, GRPOConfig, EnvironmentMultiTurn, Env, Task, Tool, ToolResult, "
    "StepResult, tool_to_spec, RewardResult, TaskExample"
)


def user_folder(tmp_path: Path) -> Path:
    """A folder outside the repository with the user's own ``tasks.py`` and ``storage.py``."""
    folder = tmp_path / "user project"
    folder.mkdir()
    for name in ("tasks", "storage"):
        (folder / f"{name}.py").write_text(f"raise RuntimeError('the user\\'s own {name}.py was imported')\n")
    assert REPO not in folder.parents
    return folder


def user_env(folder: Path) -> dict[str, str]:
    # MLflow's default: the folder's; the outer pytest's PYTEST_ADDOPTS (e.g. -q) would change the inner summary
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "PYTEST_ADDOPTS")}
    env["PREFECT_HOME"] = str(folder / ".prefect")
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    env.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    return env


def run_in(folder: Path, *argv: str | Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in argv], cwd=folder, env=user_env(folder), capture_output=True, text=True, timeout=timeout
    )


def test_the_user_s_own_tasks_and_storage_would_be_imported_there(tmp_path: Path) -> None:
    """Guards the tests below: in that folder a bare ``import tasks`` finds the user's file."""
    folder = user_folder(tmp_path)
    for name in ("tasks", "storage"):
        result = run_in(folder, sys.executable, "-c", f"import {name}")
        assert result.returncode == 1 and f"the user's own {name}.py was imported" in result.stderr


def test_the_reference_names_import_from_rollflow_beside_the_user_s_tasks_and_storage(tmp_path: Path) -> None:
    folder = user_folder(tmp_path)
    script = (
        f"from rollflow import {REFERENCE_NAMES}\n"
        "import rollflow, json\n"
        "print(json.dumps({name: getattr(rollflow, name).__module__ for name in rollflow.__all__}))\n"
    )
    result = run_in(folder, sys.executable, "-c", script)
    assert result.returncode == 0, result.stderr
    modules = json.loads(result.stdout.splitlines()[-1])
    assert set(modules) == set(rollflow.__all__)
    assert {"train_multi_turn", "GRPOConfig", "EnvironmentMultiTurn", "Env", "TaskExample"} <= set(modules)
    assert all(module.startswith("rollflow.") for module in modules.values()), modules


@pytest.mark.slow
def test_env_new_then_train_with_the_rollflow_command_outside_the_checkout(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Bug 8: ``rollflow train`` on a user's ``my_env`` (written into the working directory)
    from the user's own folder, by the console script, which has no working directory on its
    ``sys.path`` of its own."""
    folder = user_folder(tmp_path)
    written = run_in(folder, ROLLFLOW, "env", "new", "my_env", "--multi-turn")
    assert written.returncode == 0, written.stderr
    assert 'name = "my_env:load_environment"' in written.stderr
    played = run_in(folder, sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "my_env")
    assert played.returncode == 0 and "2 passed" in played.stdout, played.stdout + played.stderr

    config = load_config(REPO / "configs" / "tiny.toml")
    config = replace(
        config,
        model=replace(config.model, path=str(tiny_model_dir)),
        env=replace(config.env, name="my_env:load_environment"),
        rollout=replace(config.rollout, batch_size=1),
        train=replace(config.train, num_steps=1),
        validation=replace(config.validation, validation_interval=0),
        storage=replace(config.storage, runs_dir="runs"),
    )
    (folder / "my_env.toml").write_text(config_to_toml(config))
    trained = run_in(folder, ROLLFLOW, "train", "my_env.toml", timeout=600)
    assert trained.returncode == 0, trained.stderr[-3000:]
    run_dir = Path(trained.stdout.splitlines()[-1])
    assert run_dir.parent == folder / "runs"
    metrics = json.loads((run_dir / "steps" / "step=000000" / "metrics.json").read_text())
    assert metrics["episodes/count"] == 2  # one task, two episodes of the user's environment
