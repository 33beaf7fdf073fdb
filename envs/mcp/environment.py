"""The config-only form: an MCP server, a task list and a reward, and no environment class.

::

    [env]
    name = "rollflow.envs.mcp:load_environment"
    kwargs = { servers = [{ command = ["python", "-m", "my_server"] }],
               tasks = "my_tasks:tasks", reward = "my_tasks:reward" }

``tasks(split)`` returns, for ``"train"`` and ``"validation"``, a list of dicts, each with a
``prompt`` (the user's message) and whatever the reward reads; an ``id`` names the task
(else a hash of it does), ``opening_messages`` come between the system prompt and the
prompt (a worked example), and an ``mcp_meta`` dict is sent as the ``_meta`` of every tool
call of its episodes (how a shared server learns which task it serves; the model never
sees it). ``reward(task, messages)`` returns a float, or a dict with a ``"reward"`` and
other numbers, reported as the episode's metrics.

An episode: the optional ``system_prompt``, the task's prompt, then up to ``max_turns``
actions; an action with tool calls runs them on the servers (``rollflow.envs.mcp.tools``),
one without ends the episode: it is the answer. The environment is async style (one
``Env`` per episode, which is where a server that ``keeps_state`` is started and stopped).

A pass: an episode passes when its reward is at least ``pass_threshold``; None (the
default) counts any reward above 0, right for a reward of 1 for a solved task and 0 else.
A reward that pays partial credit sets it to what only a solved task reaches, so that
``passed``, pass@k and the validation pass rate count solved tasks (the bundled game's
config sets 0.8, its weight of a right answer: the Python-tool game's own threshold).

Simplified: the reward is computed after every step, since the runner keeps the reward
of the last step taken and the episode may be cut off (out of turns, out of context)
after any of them; a reward that is costly pays that many times.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rollflow.envs.checks import require_int
from rollflow.envs.env import AsyncEnvSuite, Env
from rollflow.envs.handle import checked_score
from rollflow.envs.hooks import checked_messages
from rollflow.envs.mcp.servers import McpConfigError, McpServer
from rollflow.envs.mcp.tools import McpToolbox, check_servers, open_mcp_tools, parse_servers, with_meta
from rollflow.envs.tools import run_tool_calls
from rollflow.envs.type_names import type_mismatch
from rollflow.envs.types import Message, StepResult, Task, ToolSpec

TasksFunction = Callable[[str], Sequence[Mapping[str, Any]]]
RewardFunction = Callable[[Mapping[str, Any], list[Message]], float | Mapping[str, float]]


class McpTaskEnv(Env):
    """One episode of a task against the MCP servers' tools."""

    def __init__(
        self, task: Task, servers: Sequence[McpServer], specs: Sequence[ToolSpec], reward: RewardFunction,
        system_prompt: str | None, max_turns: int | None,
    ) -> None:  # fmt: skip
        self.task = task
        self.servers = tuple(servers)
        self._specs = list(specs)
        self.reward = reward
        self.system_prompt = system_prompt
        self.max_turns = max_turns
        self._messages: list[Message] = []
        self._toolbox: McpToolbox | None = None

    async def reset(self, task: Task) -> list[Message]:
        self._toolbox = await open_mcp_tools(self.servers)
        opening: list[Message] = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        opening += checked_messages(task.metadata.get("opening_messages", []), "the task's opening_messages")
        self._messages = [*opening, {"role": "user", "content": task.prompt}]
        return list(self._messages)

    async def step(self, message: Message) -> StepResult:
        self._messages = [*self._messages, message]
        calls = message.get("tool_calls") or []
        stop = not calls
        if calls:
            assert self._toolbox is not None, "step before reset"
            tools = with_meta(self._toolbox.tools, _meta(self.task))
            outcome = await run_tool_calls(tools, calls)
            self._messages += outcome.messages
            stop = outcome.stop_requested
        reward, metrics = scored(self.reward, dict(self.task.metadata), list(self._messages))
        return StepResult(terminated=stop, truncated=False, messages=list(self._messages), reward=reward, metrics=metrics)

    @property
    def tool_specs(self) -> list[ToolSpec]:
        return list(self._specs)

    @property
    def messages(self) -> list[Message]:
        return list(self._messages)

    async def close(self) -> None:
        if self._toolbox is not None:
            await self._toolbox.close()

    def max_episode_turns(self) -> int | None:
        return self.max_turns


def load_environment(
    servers: Sequence[Mapping[str, Any]],
    tasks: str,
    reward: str,
    system_prompt: str | None = None,
    max_turns: int | None = None,
    pass_threshold: float | None = None,
) -> AsyncEnvSuite:
    """The suite: every server started and its tools checked now (before any model loads),
    then the tasks of both splits read; see the module docstring for the arguments."""
    if max_turns is not None:
        require_int("max_turns", max_turns, minimum=1)
    threshold = None if pass_threshold is None else checked_score(pass_threshold, "pass_threshold")
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise McpConfigError(f"system_prompt must be a string, got {system_prompt!r:.100}")
    parsed = parse_servers(servers)
    specs = check_servers(parsed)
    tasks_function: TasksFunction = load_function(tasks, "tasks")
    reward_function: RewardFunction = load_function(reward, "reward")
    train, validation = (read_tasks(tasks_function, split, tasks) for split in ("train", "validation"))

    def env_factory(task: Task) -> McpTaskEnv:
        return McpTaskEnv(task, parsed, specs, reward_function, system_prompt, max_turns)

    return AsyncEnvSuite(tasks=train, val_tasks=validation, env_factory=env_factory, pass_threshold=threshold)


def read_tasks(function: TasksFunction, split: str, spec: str) -> tuple[Task, ...]:
    """``function(split)`` as ``Task`` s; the task dict is the task's metadata."""
    rows = function(split)
    if not isinstance(rows, Sequence) or isinstance(rows, str):
        raise McpConfigError(f"{spec}({split!r}) returned {type(rows).__name__}, not a list of task dicts")
    tasks = []
    for index, row in enumerate(rows):
        if not isinstance(row, Mapping) or not isinstance(row.get("prompt"), str):
            raise McpConfigError(f"{spec}({split!r})[{index}] must be a dict with a 'prompt' string, got {row!r:.100}")
        row_id = row.get("id")
        tasks.append(Task(prompt=row["prompt"], metadata=dict(row), id=None if row_id is None else str(row_id)))
    return tuple(tasks)


def scored(reward: RewardFunction, task: dict[str, Any], messages: list[Message]) -> tuple[float, dict[str, float]]:
    """(reward, metrics) from what ``reward`` returned: a number, or a dict with ``"reward"``."""
    value = reward(task, messages)
    if isinstance(value, Mapping):
        metrics = {key: number for key, number in value.items() if key != "reward"}
        if "reward" not in value:
            raise TypeError(f"the reward function returned a dict without a 'reward' key: {sorted(value)}")
        value = value["reward"]
    else:
        metrics = {}
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"the reward function returned {type_mismatch(value, float)}")
    return float(value), metrics


def load_function(spec: object, what: str) -> Any:
    """The function ``module:function`` names; ``McpConfigError`` naming ``what`` if not."""
    parts = spec.split(":") if isinstance(spec, str) else []
    if len(parts) != 2 or not all(parts):
        raise McpConfigError(f"{what} must be 'module:function', got {spec!r:.100}")
    try:
        module = importlib.import_module(parts[0])
    except Exception as exc:
        raise McpConfigError(f"{what} = {spec!r}: importing {parts[0]!r} raised {type(exc).__name__}: {exc}") from exc
    function = getattr(module, parts[1], None)
    if not callable(function):
        raise McpConfigError(f"{what} = {spec!r}: module {parts[0]!r} has no function {parts[1]!r}")
    return function


def _meta(task: Task) -> Mapping[str, Any] | None:
    meta = task.metadata.get("mcp_meta")
    return meta if isinstance(meta, Mapping) else None
