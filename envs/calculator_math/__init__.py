"""``calculator_math``: the async-style bundled environment (the reference's ``MathEnv``).

Each task asks for the value of an integer expression ("What is 37 * 12 - 5?"). The
environment offers one tool, ``calculator`` (the AST-based ``rollflow.envs.arithmetic`` evaluator:
never ``eval``), ends the episode when the model replies without a tool call, and rewards
1.0 when that reply's last number is the target, else 0.0. It owns the transcript, as an
async ``Env`` does, and counts tool errors: after ``max_tool_errors`` of them it truncates
the episode itself (``truncated=True``, cause ``env``, reward 0.0), so a model stuck on
malformed calls stops early. A tool's ``should_stop`` ends the episode as terminated.

Metrics on the ending step: ``correct``, ``tool_calls``, ``tool_errors``.

``expert_policy()`` calls the calculator on the question's expression and then repeats
the result: the scripted baseline.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from functools import partial

from rollflow.envs.arithmetic import CalculatorTool, last_number, safe_eval
from rollflow.envs.checks import require_int
from rollflow.envs.env import AsyncEnvSuite, Env
from rollflow.envs.protocol import make_tool_call, render_tool_calls
from rollflow.envs.scripted import ScriptedPolicy, latest_user_content
from rollflow.envs.tools import run_tool_calls
from rollflow.envs.types import Message, StepResult, Task, Tool, ToolSpec, tool_to_spec

SYSTEM_PROMPT = "Use the calculator tool, then reply with only the final number."
_QUESTION = re.compile(r"^What is (.+)\?$")


class CalculatorMathEnv(Env):
    def __init__(self, max_tool_errors: int = 3) -> None:
        self._tools: dict[str, Tool] = {"calculator": CalculatorTool()}
        self._messages: list[Message] = []
        self._task: Task | None = None
        self._max_tool_errors = max_tool_errors
        self._tool_calls = 0
        self._tool_errors = 0

    async def reset(self, task: Task) -> list[Message]:
        self._task = task
        self._tool_calls = self._tool_errors = 0
        self._messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": task.prompt},
        ]
        return list(self._messages)

    async def step(self, message: Message) -> StepResult:
        if self._task is None:
            raise RuntimeError("step() before reset()")
        self._messages.append(message)
        calls = message.get("tool_calls", [])
        if not calls:
            answer = last_number(message.get("content", ""))
            correct = answer is not None and answer == float(self._task.target)
            return self._result(terminated=True, reward=float(correct), correct=correct)
        outcome = await run_tool_calls(self._tools, calls)
        self._messages.extend(outcome.messages)
        self._tool_calls += len(calls)
        self._tool_errors += outcome.errors
        if outcome.stop_requested:
            return self._result(terminated=True, reward=0.0, correct=False)
        if self._tool_errors >= self._max_tool_errors:
            return self._result(truncated=True, reward=0.0, correct=False)
        return StepResult(terminated=False, truncated=False, messages=list(self._messages))

    @property
    def tool_specs(self) -> list[ToolSpec]:
        return [tool_to_spec(tool) for tool in self._tools.values()]

    @property
    def messages(self) -> list[Message]:
        return list(self._messages)

    def _result(
        self, *, reward: float, correct: bool, terminated: bool = False, truncated: bool = False
    ) -> StepResult:
        metrics = {
            "correct": float(correct),
            "tool_calls": float(self._tool_calls),
            "tool_errors": float(self._tool_errors),
        }
        return StepResult(terminated, truncated, list(self._messages), reward=reward, metrics=metrics)


def generate_tasks(seed: int, count: int, id_offset: int = 0) -> list[Task]:
    """``count`` questions "What is a op b [op c]?" with integer targets, seeded."""
    rng = random.Random(seed)
    tasks = []
    for index in range(id_offset, id_offset + count):
        operands = [str(rng.randint(2, 99)) for _ in range(rng.choice((2, 3)))]
        expression = operands[0]
        for operand in operands[1:]:
            expression += f" {rng.choice('+-*')} {operand}"
        if len(operands) == 3 and rng.random() < 0.4:
            expression = f"({expression.rsplit(' ', 2)[0]}) {expression.rsplit(' ', 2)[1]} {operands[-1]}"
        tasks.append(
            Task(
                prompt=f"What is {expression}?",
                target=safe_eval(expression),
                id=f"calculator_math/seed={seed}/{index:05d}",
            )
        )
    return tasks


def load_environment(
    seed: int = 0, num_train: int = 200, num_validation: int = 50, max_tool_errors: int = 3
) -> AsyncEnvSuite:
    require_int("num_train", num_train, minimum=1)
    require_int("num_validation", num_validation, minimum=0)
    require_int("max_tool_errors", max_tool_errors, minimum=1)
    tasks = generate_tasks(seed, num_train + num_validation)
    return AsyncEnvSuite(
        tasks=tasks[:num_train],
        val_tasks=tasks[num_train:],
        env_factory=partial(_new_env, max_tool_errors=max_tool_errors),
    )


def _new_env(task: Task, max_tool_errors: int) -> CalculatorMathEnv:
    return CalculatorMathEnv(max_tool_errors=max_tool_errors)


def expert_policy() -> ScriptedPolicy:
    """Turn 0: calculate the question's expression; then: answer with the tool's result."""

    def script(messages: Sequence[Message], turn: int) -> str:
        if turn == 0:
            match = _QUESTION.match(latest_user_content(messages))
            expression = match.group(1) if match else "0"
            return render_tool_calls([make_tool_call("calculator", {"expression": expression})])
        return messages[-1]["content"]

    return ScriptedPolicy(script)
