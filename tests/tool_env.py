"""A test environment with one lookup tool that can be broken on purpose (``bug``): it returns
a dict instead of a ``ToolResult``, or declares an invalid ``parameters_schema``
(``tests/test_tool_accounting.py``). The reply ``"7"`` earns 1, anything else 0."""

from __future__ import annotations

import json
from typing import Any

from rollflow.envs.env import AsyncEnvSuite, Env
from rollflow.envs.tools import run_tool_calls
from rollflow.envs.types import Message, StepResult, Task, Tool, ToolResult, ToolSpec, tool_to_spec

BUGS = ("none", "dict", "schema")


class LookupTool:
    name = "lookup"
    description = "Look up a word; returns its length."

    def __init__(self, bug: str) -> None:
        self.bug = bug
        self.parameters_schema: dict[str, Any] = (
            {"type": "no-such-type"} if bug == "schema"
            else {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}
        )

    async def execute(self, arguments: str) -> ToolResult:
        length = len(json.loads(arguments)["word"])
        if self.bug == "dict":
            return {"length": length}  # type: ignore[return-value]  - the bug under test
        return ToolResult(content=str(length))


class LookupEnv(Env):
    def __init__(self, bug: str) -> None:
        self._tools: dict[str, Tool] = {"lookup": LookupTool(bug)}
        self._messages: list[Message] = []

    async def reset(self, task: Task) -> list[Message]:
        self._messages = [{"role": "user", "content": task.prompt}]
        return list(self._messages)

    async def step(self, message: Message) -> StepResult:
        self._messages.append(message)
        calls = message.get("tool_calls", [])
        if not calls:
            reward = float(message["content"].strip() == "7")
            return StepResult(True, False, list(self._messages), reward=reward)
        outcome = await run_tool_calls(self._tools, calls)
        self._messages.extend(outcome.messages)
        return StepResult(False, False, list(self._messages))

    @property
    def tool_specs(self) -> list[ToolSpec]:
        return [tool_to_spec(tool) for tool in self._tools.values()]

    @property
    def messages(self) -> list[Message]:
        return list(self._messages)


def load_environment(bug: str = "none", tasks: int = 2) -> AsyncEnvSuite:
    if bug not in BUGS:
        raise ValueError(f"bug must be one of {BUGS}, got {bug!r}")
    suite = [Task(prompt=f"task {i}: how long is 'seven'?", target=5, id=f"lookup-{i}") for i in range(tasks)]
    return AsyncEnvSuite(tasks=suite, val_tasks=suite, env_factory=lambda task: LookupEnv(bug))
