"""Whose turn budget an episode plays: the hook environment's own, capped by [rollout].max_turns.

The reference's hook style takes the budget from ``max_episode_turns`` (its example: 8);
``[rollout].max_turns`` is unset by default and, when set, only caps it. The async style
has no budget of its own, so there ``[rollout].max_turns`` is required.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.compute as pc
import pytest

from rollflow.config.parsing import ConfigError
from rollflow.config.rollout import RolloutConfig
from rollflow.config.run import EnvConfig, RunConfig, ValidationConfig
from rollflow.envs.scripted import constant_policy
from rollflow.generators.policy_io import ActingPolicy
from rollflow.storage.runfolder import RunFolder
from rollflow.tasks.rollout import rollout_stage

GUESS_NUMBER = EnvConfig(
    name="rollflow.envs.guess_number:load_environment", kwargs={"num_train": 1, "num_validation": 1}
)  # max_episode_turns = 8, as in the reference's example
CALCULATOR = EnvConfig(
    name="rollflow.envs.calculator_math:load_environment", kwargs={"num_train": 1, "num_validation": 1}
)


def _config(env: EnvConfig, max_turns: int | None = None, val_max_turns: int | None = None) -> RunConfig:
    return RunConfig(
        env=env,
        rollout=RolloutConfig(batch_size=1, episodes_per_task=1, max_turns=max_turns),
        validation=ValidationConfig(val_max_turns=val_max_turns),
    )


def _turns(config: RunConfig, run_dir: Path, split: str = "train") -> list[int]:
    """Turns of each episode of step 0, played by a policy that never guesses right."""
    rollout_stage(config, RunFolder(run_dir).step_paths(0, split).episodes, 0, split, ActingPolicy.fixed(constant_policy("0")))
    episodes = RunFolder(run_dir).read_stage(0, "episodes", split)
    assert set(episodes.column("truncation_cause").to_pylist()) == {"max_turns"}
    return pc.cast(episodes.column("turns"), "int64").to_pylist()


def test_a_hook_env_plays_its_own_eight_turns_when_max_turns_is_unset(tmp_path: Path) -> None:
    config = _config(GUESS_NUMBER)
    assert config.rollout.max_turns is None and config.val_max_turns is None
    assert _turns(config, tmp_path / "run") == [8]
    assert _turns(config, tmp_path / "run", "validation") == [8]


def test_max_turns_when_set_caps_the_hook_envs_budget_and_never_raises_it(tmp_path: Path) -> None:
    assert _turns(_config(GUESS_NUMBER, max_turns=3), tmp_path / "capped") == [3]
    assert _turns(_config(GUESS_NUMBER, max_turns=20), tmp_path / "above") == [8]
    validation = _config(GUESS_NUMBER, max_turns=20, val_max_turns=2)
    assert _turns(validation, tmp_path / "val", "validation") == [2]


def test_an_async_env_without_max_turns_is_a_config_error_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"\[rollout\]\.max_turns"):
        rollout_stage(_config(CALCULATOR), RunFolder(tmp_path / "run").step_paths(0, "train").episodes, 0, "train", ActingPolicy.fixed(constant_policy("0")))
    with pytest.raises(ConfigError, match=r"\[validation\]\.val_max_turns or \[rollout\]\.max_turns"):
        rollout_stage(_config(CALCULATOR), RunFolder(tmp_path / "run").step_paths(0, "validation").episodes, 0, "validation", ActingPolicy.fixed(constant_policy("0")))
    assert not (tmp_path / "run").exists() or not RunFolder(tmp_path / "run").part_paths(0, "episodes")
    rollout_stage(_config(CALCULATOR, max_turns=2), RunFolder(tmp_path / "ok").step_paths(0, "train").episodes, 0, "train", ActingPolicy.fixed(constant_policy("0")))


def test_val_max_turns_falls_back_to_max_turns_and_then_to_none() -> None:
    assert RunConfig().rollout.max_turns is None and RunConfig().val_max_turns is None
    assert _config(GUESS_NUMBER, max_turns=4).val_max_turns == 4
    assert _config(GUESS_NUMBER, max_turns=4, val_max_turns=2).val_max_turns == 2
    assert _config(GUESS_NUMBER, val_max_turns=2).val_max_turns == 2
