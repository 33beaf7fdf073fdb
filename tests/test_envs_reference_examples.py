"""The two example environments of the reference docs, written against our API, played.

1. The hook-style refund agent (``AgentEnv``): its own regex protocol and a tool service,
   tool results fed back as a user message, scored on whether the resolving tool was used.
   One fix to the doc's code: it calls ``run_tool(**json.loads(block))`` but declares
   ``run_tool(name, args)``; a block has ``arguments``, so ours takes ``arguments``.
2. The async calculator ``MathEnv``: owns its messages, dispatches tool calls itself and
   turns a raising tool into ``tool_error: ...``. ``safe_eval`` is ours (``rollflow.envs.arithmetic``).

Both are played through the runner exactly as a stage would, by spec or by the
``train_multi_turn``-style arguments (tasks, env_factory, val_tasks).
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from rollflow.envs.arithmetic import safe_eval
from rollflow.envs.env import Env
from rollflow.envs.handle import EpisodeLimits
from rollflow.envs.hooks import EnvironmentMultiTurn
from rollflow.envs.runner import handle_from_async, load_environment_handle, play_groups
from rollflow.envs.scripted import ScriptedPolicy, constant_policy
from rollflow.envs.types import (
    EnvironmentEpisode,
    EnvironmentStepResult,
    Message,
    RewardResult,
    StepResult,
    Task,
    TaskExample,
    Tool,
    ToolResult,
    ToolSpec,
    TruncationCause,
    tool_to_spec,
)

# ---------------------------------------------------------------- 1. the refund agent

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def run_tool(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """A deterministic order service."""
    if name == "lookup_order":
        return {"order_id": "A17", "status": "delivered"}
    if name == "refund_order":
        return {"order_id": arguments.get("order_id"), "status": "refunded"}
    return {"error": f"unknown tool {name}"}


class AgentEnv(EnvironmentMultiTurn):
    def __init__(self, *, split: str = "train") -> None:
        self.dataset = [{"input": "Refund my last order.", "output": "refund_order"}]

    def start_episode(self, example: TaskExample, prompt_text: str) -> list[Message]:
        return [
            {
                "role": "system",
                "content": "Call tools with <tool_call>{...}</tool_call>; reply in plain text when done.",
            },
            {"role": "user", "content": example.input},
        ]

    def max_episode_turns(self, example: TaskExample) -> int:
        return 8

    def step_episode(
        self, example: TaskExample, messages: list[Message], assistant_response: str
    ) -> EnvironmentStepResult:
        blocks = TOOL_CALL.findall(assistant_response)
        if blocks:  # a TOOL turn: run the calls, feed results back, stay open
            results = [run_tool(**json.loads(b)) for b in blocks]
            return EnvironmentStepResult(
                done=False,
                messages=({"role": "user", "content": f"<tool_result>{json.dumps(results)}</tool_result>"},),
            )
        # a REPLY turn: no tool call -> the model is done
        return EnvironmentStepResult(done=True, final_response_text=assistant_response)

    def score_episode(self, example: TaskExample, episode: EnvironmentEpisode) -> RewardResult:
        used = [
            json.loads(b)["name"]
            for m in episode.messages
            for b in TOOL_CALL.findall(m["content"])
            if m["role"] == "assistant"
        ]
        hit = str(example.output) in used
        return RewardResult(score=1.0 if hit else 0.0, threshold=1.0)


def load_environment(split: str = "train", **kwargs: Any) -> AgentEnv:
    return AgentEnv(split=split)


LOOKUP = '<tool_call>{"name": "lookup_order", "arguments": {}}</tool_call>'
REFUND = '<tool_call>{"name": "refund_order", "arguments": {"order_id": "A17"}}</tool_call>'


def test_refund_agent_plays_and_scores_through_the_runner() -> None:
    handle = load_environment_handle(f"{__name__}:load_environment", {"split": "validation"})
    [item] = handle.tasks("validation")
    assert item.payload == TaskExample(input="Refund my last order.", output="refund_order")
    helpful = ScriptedPolicy(lambda m, turn: [LOOKUP, REFUND, "Your order A17 is refunded."][turn])
    policies = [
        helpful,
        constant_policy("Sorry, I cannot help."),
        constant_policy(LOOKUP),
        constant_policy("<tool_call>{oops"),
    ]
    rollouts = [asyncio.run(handle.play(item, p, EpisodeLimits())) for p in policies]
    assert rollouts[0].terminated and rollouts[0].turns == 3
    assert rollouts[0].response_text == "Your order A17 is refunded."
    assert json.loads(rollouts[0].messages[5]["content"][len("<tool_result>") : -len("</tool_result>")]) == [
        {"order_id": "A17", "status": "refunded"}
    ]
    assert rollouts[1].terminated
    assert rollouts[2].truncation_cause is TruncationCause.MAX_TURNS and rollouts[2].turns == 8
    assert rollouts[3].truncation_cause is TruncationCause.PARSE_FAILURE  # caught before run_tool could raise
    scores = asyncio.run(handle.score(item, rollouts))
    assert [s.reward for s in scores] == [1.0, 0.0, 0.0, 0.0]
    assert scores[0].threshold == 1.0


def test_refund_agent_default_sft_target_is_its_scalar_output() -> None:
    env = load_environment()
    assert env.sft_completion(env.examples("train")[0]) == [{"role": "assistant", "content": "refund_order"}]


# ---------------------------------------------------------------- 2. the calculator MathEnv

SYSTEM_PROMPT = "Use the calculator tool, then reply with only the final number."


class CalculatorTool:
    name = "calculator"
    description = "Evaluate an arithmetic expression."
    parameters_schema: dict[str, Any] = {
        "type": "object",
        "properties": {"expression": {"type": "string"}},
        "required": ["expression"],
    }

    async def execute(self, arguments: str) -> ToolResult:
        expression = json.loads(arguments)["expression"]
        return ToolResult(content=str(safe_eval(expression)))


class MathEnv(Env):
    def __init__(self) -> None:
        self._messages: list[Message] = []
        self._task: Task | None = None
        self._tools: dict[str, Tool] = {"calculator": CalculatorTool()}

    async def reset(self, task: Task) -> list[Message]:
        self._task = task
        self._messages = [
            Message(role="system", content=SYSTEM_PROMPT),
            Message(role="user", content=task.prompt),
        ]
        return list(self._messages)

    async def step(self, message: Message) -> StepResult:
        assert self._task is not None
        self._messages.append(message)
        tool_calls = message.get("tool_calls", [])
        if not tool_calls:
            correct = message.get("content", "").strip() == str(self._task.target)
            return StepResult(
                terminated=True,
                truncated=False,
                messages=list(self._messages),
                reward=1.0 if correct else 0.0,
            )
        for call in tool_calls:
            name = call["function"]["name"]
            try:
                tool = self._tools[name]
                result = await tool.execute(call["function"]["arguments"])
                content = result.content
            except Exception as exc:
                content = f"tool_error: {exc!r}"
            self._messages.append(Message(role="tool", content=content, tool_call_id=call["id"], name=name))
        return StepResult(terminated=False, truncated=False, messages=list(self._messages), reward=0.0)

    @property
    def tool_specs(self) -> list[ToolSpec]:
        return [tool_to_spec(tool) for tool in self._tools.values()]

    @property
    def messages(self) -> list[Message]:
        return list(self._messages)


def _calculate_then_answer(messages: list[Message], turn: int) -> str:
    if turn == 0:
        expression = messages[-1]["content"].removeprefix("What is ").removesuffix("?")
        return (
            f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'
        )
    return messages[-1]["content"]  # the tool's answer


def test_math_env_trains_like_train_multi_turn_would_call_it() -> None:
    tasks = [Task(prompt="What is 6 * 7?", target=42), Task(prompt="What is 100 - 58?", target=42)]
    handle = handle_from_async(tasks, env_factory=lambda task: MathEnv(), val_tasks=tasks)
    items = handle.tasks("train")
    groups = asyncio.run(
        play_groups(
            handle,
            items,
            4,
            ScriptedPolicy(_calculate_then_answer),
            EpisodeLimits(max_turns=6),
            concurrency=8,
        )
    )
    for item, group in zip(items, groups, strict=True):
        assert all(r.terminated and r.turns == 2 for r in group)
        assert group[0].messages[2]["tool_calls"][0]["id"] == "call_0"
        assert group[0].messages[3] == {
            "role": "tool",
            "content": "42",
            "tool_call_id": "call_0",
            "name": "calculator",
        }
        assert [s.reward for s in asyncio.run(handle.score(item, group))] == [1.0] * 4


def test_math_env_reports_a_failing_tool_to_the_model_and_goes_on() -> None:
    handle = handle_from_async([Task(prompt="What is 2 ^ 3?", target=8)], env_factory=lambda task: MathEnv())
    policy = ScriptedPolicy(_calculate_then_answer)
    rollout = asyncio.run(handle.play(handle.tasks("train")[0], policy, EpisodeLimits(max_turns=6)))
    assert rollout.messages[3]["content"].startswith("tool_error: ExpressionError(")
    assert rollout.terminated and rollout.env_reward == 0.0  # it answered with the error text
