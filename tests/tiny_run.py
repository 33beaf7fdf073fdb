"""The tiny-run config tests share: configs/tiny.toml on a tiny model, with varying rewards."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from rollflow.tasks.config import config_to_toml, load_config

REPO = Path(__file__).resolve().parent.parent


def tiny_config_at(dest: Path, model_dir: Path) -> Path:
    """Write configs/tiny.toml into ``dest`` on ``model_dir`` with an environment whose
    rewards vary (tests/varied_reward_env.py), so every update really changes the weights."""
    config = load_config(REPO / "configs" / "tiny.toml")
    config = replace(
        config,
        model=replace(config.model, path=str(model_dir)),
        env=replace(config.env, name="varied_reward_env:load_environment"),
        storage=replace(config.storage, runs_dir=str(dest / "runs")),
    )
    path = dest / "tiny.toml"
    path.write_text(config_to_toml(config))
    return path
