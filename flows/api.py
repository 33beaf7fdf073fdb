"""The Python API of the reference docs: ``train_multi_turn(config, tasks, env_factory, val_tasks)``.

It runs the very same Prefect flow as ``rollflow train``, after the same checks
(``ops/preflight.py``): the environment objects are
registered in-process (``envs/registry.py``) and named in the run's config, so the stages
load them exactly as they load a bundled environment by name.

``config`` is either our ``RunConfig`` or the reference's flat ``GRPOConfig``.
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from rollflow.config.grpo import GRPOConfig
from rollflow.config.run import EnvConfig, RunConfig, config_to_toml
from rollflow.envs.env import AsyncEnvSuite, Env
from rollflow.envs.registry import register_environment
from rollflow.envs.types import Task
from rollflow.ops.preflight import preflight


def train_multi_turn(
    config: RunConfig | GRPOConfig,
    tasks: Sequence[Task],
    env_factory: Callable[[Task], Env],
    val_tasks: Sequence[Task] | None = None,
    *,
    run_dir: str | Path | None = None,
) -> Path:
    """Train on ``tasks`` with a fresh ``env_factory(task)`` environment per episode.

    Without ``val_tasks`` the training tasks are validated on (as the reference recipe
    does). Returns the run folder; call again with the same ``run_dir`` to resume.
    """
    from rollflow.flows.train import train_flow

    run_config = config.to_run_config() if isinstance(config, GRPOConfig) else config
    suite = AsyncEnvSuite(
        tasks=tuple(tasks), val_tasks=tuple(tasks if val_tasks is None else val_tasks), env_factory=env_factory
    )
    key = _environment_key(suite)
    spec = register_environment(key, suite)
    run_config = replace(run_config, env=EnvConfig(name=spec, kwargs={"key": key}))
    preflight(run_config)  # before Prefect starts and before a run folder is made
    with tempfile.TemporaryDirectory(prefix="rollflow-config-") as scratch:
        config_path = Path(scratch) / "train_multi_turn.toml"
        config_path.write_text(config_to_toml(run_config))
        return Path(train_flow(config_path=str(config_path), run_dir=None if run_dir is None else str(run_dir)))


def _environment_key(suite: AsyncEnvSuite) -> str:
    """A key that is the same for the same tasks, so a resumed run finds its config equal."""
    described = repr([(t.id, t.prompt, t.target) for t in (*suite.tasks, *suite.val_tasks)])
    return "train_multi_turn-" + hashlib.sha256(described.encode()).hexdigest()[:12]
