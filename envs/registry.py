"""Environments handed over as Python objects rather than named as ``module:function``.

The Python API ``train_multi_turn(config, tasks, env_factory, val_tasks)`` receives live
objects, but the pipeline's stages load their environment from the config by name. The
API registers the objects here under a key and names ``rollflow.envs.registry:registered_environment``
with that key in the config, so every stage goes through the same loading path.

A registration lives as long as the process: a run started this way can be resumed only by
calling ``train_multi_turn`` again with the same objects (the error below says so).
"""

from __future__ import annotations

from rollflow.envs.env import AsyncEnvSuite
from rollflow.envs.hooks import EnvironmentMultiTurn

REGISTERED_SPEC = "rollflow.envs.registry:registered_environment"
_REGISTERED: dict[str, AsyncEnvSuite | EnvironmentMultiTurn] = {}


def register_environment(key: str, environment: AsyncEnvSuite | EnvironmentMultiTurn) -> str:
    """Make ``environment`` loadable as ``registered_environment(key=key)``; returns the spec."""
    _REGISTERED[key] = environment
    return REGISTERED_SPEC


def registered_environment(key: str) -> AsyncEnvSuite | EnvironmentMultiTurn:
    try:
        return _REGISTERED[key]
    except KeyError:
        raise LookupError(
            f"no environment registered as {key!r} in this process: this run's environment was "
            "given as Python objects (train_multi_turn); resume it by calling train_multi_turn "
            "again with the same tasks, env_factory and run_dir"
        ) from None
