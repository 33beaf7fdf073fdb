"""The one episode runner: load an environment of either style, play groups, score them.

Everything a stage needs to drive an environment comes from here:

- ``load_environment_handle("module:function", kwargs)`` calls the environment's
  ``load_environment(**kwargs)``; an ``EnvironmentMultiTurn`` gives a hook-style handle, an
  ``AsyncEnvSuite`` an async one, an ``AgentEnvironment`` (``rollflow.envs.openai_agent``:
  a user's own ``openai``-SDK agent) one that plays the agent against a capture endpoint.
  ``handle_from_async`` / ``handle_from_hook`` wrap objects built in Python (the
  reference's ``train_multi_turn(config, tasks, env_factory, val_tasks)``).
- ``handle.tasks(split)`` lists ``TaskItem`` s; ``play_groups`` plays ``group_size``
  episodes of each, all concurrently under one bound; ``handle.score`` scores a group.

Failures are data: ``play`` and ``score`` never raise. An environment or policy exception
is recorded on its own episode (``EpisodeRollout.error``, ``EpisodeScore.error``) and the
other episodes go on. Exceptions are kept for what is wrong before anything runs: a bad
spec, bad arguments, an invalid limit (``EnvironmentLoadError``, ``ValueError``).

The one episode loop, with the trace of one episode and the ending rules, lives in
``rollflow.envs.loop``; ``rollflow.envs.async_handle`` builds each async-style episode's
``Env``, and ``rollflow.envs.hook_handle`` adapts each hook-style episode to that shape and
keeps the hook style's group scoring. The records both share and the turn budget are in
``rollflow.envs.handle``.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Mapping, Sequence

from rollflow.envs.agent import Policy
from rollflow.envs.async_handle import AsyncEnvironmentHandle
from rollflow.envs.checks import require_int
from rollflow.envs.env import AsyncEnvSuite, Env
from rollflow.envs.episode import EpisodeRollout
from rollflow.envs.handle import NO_TURN_LIMIT, EnvironmentHandle, EpisodeLimits, TaskItem
from rollflow.envs.hook_handle import HookEnvironmentHandle
from rollflow.envs.hooks import EnvironmentMultiTurn
from rollflow.envs.mixture_handle import MixtureHandle
from rollflow.envs.openai_agent import AgentEnvironment, AgentEnvironmentHandle
from rollflow.envs.type_names import type_mismatch
from rollflow.envs.types import Task

__all__ = [
    "EnvironmentLoadError",
    "handle_for",
    "handle_from_async",
    "handle_from_hook",
    "load_environment_handle",
    "play_groups",
]


class EnvironmentLoadError(ValueError):
    """The environment spec or its arguments are wrong; the message names the culprit."""


def load_environment_handle(spec: str, kwargs: Mapping[str, object] | None = None) -> EnvironmentHandle:
    """Import ``module:function``, call it with ``kwargs`` and wrap what it returns."""
    module_name, function_name = _split_spec(spec)
    module = _import(module_name, spec)
    function = getattr(module, function_name, None)
    if function is None:
        loaders = sorted(name for name in vars(module) if name.startswith("load"))
        hint = f"; it has {', '.join(loaders)}" if loaders else ""
        raise EnvironmentLoadError(f"module {module_name!r} has no {function_name!r}{hint}")
    if not callable(function):
        raise EnvironmentLoadError(f"{spec} is a {type(function).__name__}, not a function")
    arguments = _checked_kwargs(function, kwargs, spec)
    try:
        loaded = function(**arguments)
    except EnvironmentLoadError:
        raise  # a loader of loaders (envs/mixture.py) has named the culprit already
    except Exception as exc:
        raise EnvironmentLoadError(
            f"{spec}(**{arguments!r:.200}) raised {type(exc).__name__}: {exc}"
        ) from exc
    return handle_for(loaded, where=spec)


def handle_for(loaded: object, where: str = "the environment") -> EnvironmentHandle:
    """The handle for what a ``load_environment`` returned, or an error naming its type."""
    if isinstance(loaded, EnvironmentMultiTurn):
        return HookEnvironmentHandle(loaded)
    if isinstance(loaded, AsyncEnvSuite):
        return AsyncEnvironmentHandle(loaded)
    if isinstance(loaded, AgentEnvironment):  # rollflow.envs.openai_agent's, never a user's own
        return AgentEnvironmentHandle(loaded)
    if isinstance(loaded, MixtureHandle):  # rollflow.envs.mixture's: already a handle
        return loaded
    raise EnvironmentLoadError(f"{where} returned {type_mismatch(loaded, EnvironmentMultiTurn, AsyncEnvSuite)}")


def handle_from_async(
    tasks: Sequence[Task], env_factory: Callable[[Task], Env], val_tasks: Sequence[Task] | None = None
) -> EnvironmentHandle:
    """An async-style handle from the reference's ``train_multi_turn`` arguments.

    Without ``val_tasks`` the training tasks are validated on, as in the reference recipe.
    """
    suite = AsyncEnvSuite(
        tasks=tuple(tasks),
        val_tasks=tuple(tasks if val_tasks is None else val_tasks),
        env_factory=env_factory,
    )
    return AsyncEnvironmentHandle(suite)


def handle_from_hook(env: EnvironmentMultiTurn) -> EnvironmentHandle:
    return HookEnvironmentHandle(env)


async def play_groups(
    handle: EnvironmentHandle,
    items: Sequence[TaskItem],
    group_size: int,
    policy: Policy,
    limits: EpisodeLimits,
    concurrency: int,
) -> list[list[EpisodeRollout]]:
    """``group_size`` episodes of each item, at most ``concurrency`` in flight at once.

    Result order: items in the order given, then index in the group.
    """
    require_int("group_size", group_size, minimum=1)
    require_int("concurrency", concurrency, minimum=1)
    if handle.style == "async" and limits.max_turns is None:
        raise ValueError(NO_TURN_LIMIT)
    bound = asyncio.Semaphore(concurrency)

    async def play_one(item: TaskItem) -> EpisodeRollout:
        async with bound:
            return await handle.play(item, policy, limits)

    rollouts = await asyncio.gather(*(play_one(item) for item in items for _ in range(group_size)))
    return [list(rollouts[start : start + group_size]) for start in range(0, len(rollouts), group_size)]


def _split_spec(spec: str) -> tuple[str, str]:
    parts = spec.split(":") if isinstance(spec, str) else []
    if len(parts) != 2 or not all(part.strip() for part in parts):
        raise EnvironmentLoadError(
            f"environment spec {spec!r} must be 'module:function', e.g. 'rollflow.envs.tool_use_game:load_environment'"
        )
    module_name, function_name = (part.strip() for part in parts)
    if not function_name.isidentifier():
        raise EnvironmentLoadError(f"{function_name!r} in environment spec {spec!r} is not a Python name")
    return module_name, function_name


# The folders rollflow installs under its own name; a spec written before they moved
# (``envs.tool_use_game:load_environment`` in an older run's frozen config) still loads.
_OWN_FOLDERS = ("envs", "tasks", "flows", "storage", "policy")


def _import(module_name: str, spec: str) -> object:
    _working_directory_on_path()
    module_name = _current_module_name(module_name)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            raise EnvironmentLoadError(f"no module named {missing!r} (environment spec {spec!r})") from exc
        raise EnvironmentLoadError(f"importing {module_name!r} failed: {exc}") from exc
    except Exception as exc:
        raise EnvironmentLoadError(f"importing {module_name!r} raised {type(exc).__name__}: {exc}") from exc


def _working_directory_on_path() -> None:
    """A user's environment module lives in their working directory, which the ``rollflow``
    console script (unlike ``python -m``) does not put on ``sys.path``. It goes last, so it
    never shadows an installed package."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def _current_module_name(module_name: str) -> str:
    """``envs.x`` -> ``rollflow.envs.x`` when rollflow has that module; else unchanged.

    Checked first, not as a fallback: inside a checkout ``envs.x`` would also import from
    the working directory, as a second copy whose classes are not rollflow's.
    """
    top = module_name.split(".", 1)[0]
    if top not in _OWN_FOLDERS:
        return module_name
    candidate = f"rollflow.{module_name}"
    try:
        found = importlib.util.find_spec(candidate) is not None
    except ModuleNotFoundError:
        found = False
    return candidate if found else module_name


def _checked_kwargs(
    function: Callable[..., object], kwargs: Mapping[str, object] | None, spec: str
) -> dict[str, object]:
    arguments = dict(kwargs or {})
    bad_keys = [key for key in arguments if not isinstance(key, str)]
    if bad_keys:
        raise EnvironmentLoadError(f"argument names for {spec} must be strings, got {bad_keys!r}")
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return arguments  # a builtin or C function: let the call itself complain
    try:
        signature.bind(**arguments)
    except TypeError as exc:
        raise EnvironmentLoadError(f"bad arguments for {spec}: {exc}; it takes {signature}") from exc
    return arguments
