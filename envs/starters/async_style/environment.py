"""A starter async-style environment: add two numbers with a tool.

Edit this into your own task. An async ``Env`` owns the transcript and the tools:

- ``reset(task)``: start an episode, return the opening messages.
- ``step(message)``: take the parsed assistant message (``content`` plus structured
  ``tool_calls``), run the calls, return a ``StepResult`` with the whole history.
  ``terminated=True`` ends the episode (here: a reply without a tool call); the reward and
  metrics of that ending step are what the episode scores.
- ``close()``: release anything ``reset`` started; it runs however the episode ends.

``load_environment`` returns an ``AsyncEnvSuite``: training tasks, validation tasks and a
factory that builds a fresh ``Env`` per episode (so instance state is fine here). Run
``python -m pytest`` on this folder to play it.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

from rollflow import (
    AsyncEnvSuite,
    Env,
    Message,
    StepResult,
    Task,
    Tool,
    ToolResult,
    ToolSpec,
    execute_tool_calls,
    tool_to_spec,
)


def last_number(text: str) -> float | None:
    """The last number written in ``text`` (the reply's answer), or None."""
    found = re.findall(r"-?\d+(?:\.\d+)?", text)
    return float(found[-1]) if found else None


class AddTool:
    name = "add"
    description = "Add two numbers."
    parameters_schema: dict[str, Any] = {
        "type": "object",
        "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
        "required": ["a", "b"],
    }

    async def execute(self, arguments: str) -> ToolResult:
        values = json.loads(arguments)
        return ToolResult(content=str(values["a"] + values["b"]))


class AsyncStarterEnv(Env):
    def __init__(self) -> None:
        self._tools: dict[str, Tool] = {"add": AddTool()}
        self._messages: list[Message] = []
        self._target: float = 0.0

    async def reset(self, task: Task) -> list[Message]:
        self._target = float(task.target)
        self._messages = [
            {"role": "system", "content": "Use the tools, then reply with only the final number."},
            {"role": "user", "content": task.prompt},
        ]
        return list(self._messages)

    async def step(self, message: Message) -> StepResult:
        self._messages.append(message)
        calls = message.get("tool_calls", [])
        if calls:
            self._messages += await execute_tool_calls(self._tools, calls)
            return StepResult(terminated=False, truncated=False, messages=list(self._messages))
        correct = last_number(message["content"]) == self._target
        return StepResult(
            terminated=True,
            truncated=False,
            messages=list(self._messages),
            reward=1.0 if correct else 0.0,
            metrics={"correct": float(correct)},
        )

    @property
    def tool_specs(self) -> list[ToolSpec]:
        return [tool_to_spec(tool) for tool in self._tools.values()]

    @property
    def messages(self) -> list[Message]:
        return list(self._messages)


def load_environment(seed: int = 0, num_tasks: int = 20) -> AsyncEnvSuite:
    rng = random.Random(seed)
    pairs = rng.sample([(a, b) for a in range(1, 100) for b in range(1, 100)], num_tasks)  # no repeats
    tasks = [Task(prompt=f"What is {a} plus {b}?", target=a + b) for a, b in pairs]
    split = max(1, num_tasks * 4 // 5)
    return AsyncEnvSuite(
        tasks=tasks[:split], val_tasks=tasks[split:], env_factory=lambda task: AsyncStarterEnv()
    )
