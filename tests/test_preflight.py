"""Checks before a run starts (ops/preflight.py): one line in seconds, no run folder left behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from rollflow.config.parsing import ConfigError
from rollflow.config.run import RunConfig, config_to_toml, load_config
from rollflow.config.checks import PreflightError
from rollflow.ops.preflight import preflight
from tiny_run import tiny_config_at

TESTS = Path(__file__).resolve().parent


def tiny_config(tmp_path: Path, model_dir: Path, **sections: dict) -> RunConfig:
    """configs/tiny.toml on the tiny model, with ``sections``' settings replaced."""
    config = load_config(tiny_config_at(tmp_path, model_dir))
    changes = {name: replace(getattr(config, name), **values) for name, values in sections.items()}
    return replace(config, **changes)


def rollflow_train(
    config: RunConfig, tmp_path: Path, command: str = "train"
) -> tuple[subprocess.CompletedProcess[str], float, Path]:
    """A real `rollflow train` (or ``command``) on ``config``; its result, its wall seconds and the
    run folder it was given."""
    path = tmp_path / "checked.toml"
    path.write_text(config_to_toml(config))
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    env.pop("PREFECT_API_URL", None)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "rollflow.flows.cli", command, str(path), "--run-dir", str(run_dir)],
        env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    return done, time.monotonic() - started, run_dir


@pytest.mark.slow  # 5 s in a loaded suite run (docs/testing.md)
def test_a_wrong_env_name_is_one_line_in_seconds_and_leaves_no_run_folder(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = tiny_config(tmp_path, tiny_model_dir, env={"name": "no_such_env:load_environment"})
    done, seconds, run_dir = rollflow_train(config, tmp_path)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "rollflow train: [env].name: no module named 'no_such_env' (environment spec 'no_such_env:load_environment')"
    ]
    # before Prefect starts (its start would be lines of its own): imports and the check only,
    # seconds on an idle machine; the bound is for a hang, not a busy machine's slow imports
    assert seconds < 120
    assert not run_dir.exists()


@pytest.mark.slow  # 4 s in a loaded suite run (docs/testing.md)
def test_the_pipeline_checks_its_config_before_prefect_starts(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = tiny_config(tmp_path, tiny_model_dir, env={"name": "no_such_env:load_environment"})
    done, seconds, run_dir = rollflow_train(config, tmp_path, command="pipeline")
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "rollflow pipeline: [env].name: no module named 'no_such_env' (environment spec 'no_such_env:load_environment')"
    ]
    assert seconds < 120 and not run_dir.exists()


@pytest.mark.slow  # 5 s in a loaded suite run (docs/testing.md)
def test_a_missing_model_path_names_the_setting_and_where_it_looked(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = tiny_config(tmp_path, tiny_model_dir, model={"path": "models/nope"})
    done, _, run_dir = rollflow_train(config, tmp_path)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f"rollflow train: [model].path = 'models/nope' does not exist (relative to the working directory {tmp_path})"
    ]
    assert not run_dir.exists()


def test_wrong_env_kwargs_name_the_setting(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = tiny_config(tmp_path, tiny_model_dir, env={"name": "broken_env:load_environment",
                                                        "kwargs": {"brokn": "score"}})
    with pytest.raises(PreflightError, match=r"^\[env\]\.kwargs = \{'brokn': 'score'\}: bad arguments for "
                       r"broken_env:load_environment: missing a required argument: 'broken'; it takes \(broken: 'str'\)"):
        preflight(config)


def test_kwargs_a_constructor_refuses_name_the_kwargs_setting(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The newcomer's item 14: a loader passing **kwargs on to a constructor that refuses
    one was reported under [env].name."""
    config = tiny_config(tmp_path, tiny_model_dir, env={"name": "broken_env:load_forwarding",
                                                        "kwargs": {"brokn": "score"}})
    with pytest.raises(PreflightError, match=r"^\[env\]\.kwargs = \{'brokn': 'score'\}: broken_env:load_forwarding\(.*"
                       r"raised TypeError: .*unexpected keyword argument 'brokn'"):
        preflight(config)


def test_a_missing_gguf_file_says_it_looked_inside_the_model_path(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = tiny_config(tmp_path, tiny_model_dir, model={"gguf_file": "model-q4.gguf"})
    with pytest.raises(PreflightError) as missing:
        preflight(config)
    assert str(missing.value) == (
        f"[model].gguf_file = 'model-q4.gguf' does not exist (looked for {tiny_model_dir / 'model-q4.gguf'}: "
        f"a name inside [model].path = '{tiny_model_dir}')"
    )


def test_a_model_path_that_is_no_model_folder_names_the_setting(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = tiny_config(tmp_path, tiny_model_dir, model={"path": str(tmp_path)})
    with pytest.raises(PreflightError, match=r"^\[model\]\.path = .* is a folder without config\.json"):
        preflight(config)


def test_a_prompt_that_cannot_fit_is_refused_with_its_length(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = tiny_config(tmp_path, tiny_model_dir, env={"name": "broken_env:load_environment",
                                                        "kwargs": {"broken": "long_prompt"}},
                         rollout={"max_model_length": 100})
    with pytest.raises(PreflightError, match=r"^\[rollout\]\.max_model_length = 100 cannot hold the prompt of "
                       r"train task 'say-\d': it is \d{3} tokens, with no room left for a reply$"):
        preflight(config)


def test_a_sound_config_passes(tiny_model_dir: Path, tmp_path: Path) -> None:
    preflight(tiny_config(tmp_path, tiny_model_dir))


def test_train_multi_turn_checks_before_the_flow_starts(tmp_path: Path) -> None:
    from rollflow.envs.calculator_math import load_environment as load_calculator_math
    from rollflow.flows.api import train_multi_turn
    from rollflow.config.grpo import GRPOConfig

    suite = load_calculator_math(num_train=2, num_validation=1)
    config = GRPOConfig(model=str(tmp_path / "no-model"), num_steps=1, max_turns=2, runs_dir=str(tmp_path / "runs"))
    with pytest.raises(PreflightError, match=r"^\[model\]\.path = '.*no-model' does not exist$"):
        train_multi_turn(config, tasks=suite.tasks, env_factory=suite.env_factory, val_tasks=suite.val_tasks)
    assert not (tmp_path / "runs").exists()


def test_the_rules_across_sections_come_first(tiny_model_dir: Path, tmp_path: Path) -> None:
    """``preflight`` is the one check before Prefect starts: a training run's cross-section rules
    (``config.checks.check_run_config``) fail there too, not later inside the flow."""
    nucleus = tiny_config(tmp_path, tiny_model_dir, rollout={"top_p": 0.9}, model={"path": "models/nope"})
    with pytest.raises(ConfigError, match=r"^\[rollout\]\.top_p = 0\.9: training needs 1\.0"):
        preflight(nucleus)
    drifting = tiny_config(tmp_path, tiny_model_dir, rollout={"weight_sync_type": "background_publish"})
    with pytest.raises(ConfigError, match=r"^\[rollout\]\.weight_sync_type = 'background_publish' defers"):
        preflight(drifting)


def test_train_multi_turn_refuses_a_nucleus_before_a_run_folder_is_made(tmp_path: Path) -> None:
    from rollflow.envs.calculator_math import load_environment as load_calculator_math
    from rollflow.flows.api import train_multi_turn
    from rollflow.config.grpo import GRPOConfig

    suite = load_calculator_math(num_train=2, num_validation=1)
    config = GRPOConfig(num_steps=1, max_turns=2, top_p=0.9, runs_dir=str(tmp_path / "runs"))
    with pytest.raises(ConfigError, match=r"^\[rollout\]\.top_p = 0\.9: training needs 1\.0"):
        train_multi_turn(config, tasks=suite.tasks, env_factory=suite.env_factory, val_tasks=suite.val_tasks)
    assert not (tmp_path / "runs").exists()
