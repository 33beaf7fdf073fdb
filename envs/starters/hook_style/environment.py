"""A starter hook-style environment: count the letters of a word with a tool.

Edit this into your own task. What each hook does:

- ``start_episode``: the opening messages (the tools are described to the model by the
  policy, from ``tool_specs``; you do not write them into the prompt).
- ``step_episode``: react to the action just sampled (it is already the last message).
  Tool calls -> run them, return their results, stay open. A plain reply -> done.
- ``score_episode``: grade the finished transcript. Score behaviours: here mostly the
  right answer, a little for using the tool.
- ``dataset``: the rows to play, each ``{"input": ..., "output": ...}``, per split:
  validation measures the policy on words it never trained on.

Keep the environment stateless: many episodes of one row run at once, and the transcript
is the only state. Run ``python -m pytest`` on this folder to play it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from rollflow import (
    EnvironmentEpisode,
    EnvironmentMultiTurn,
    EnvironmentStepResult,
    Message,
    RewardResult,
    TaskExample,
    ToolResult,
    ToolSpec,
    execute_tool_calls,
    parse_action,
    tool_to_spec,
)

TRAIN_WORDS = ("banana", "tool", "rollout", "environment", "policy", "gradient", "token", "reward")
VALIDATION_WORDS = ("sampler", "episode", "checkpoint", "adapter")


def last_number(text: str) -> float | None:
    """The last number written in ``text`` (the reply's answer), or None."""
    found = re.findall(r"-?\d+(?:\.\d+)?", text)
    return float(found[-1]) if found else None


def letter_rows(words: Sequence[str]) -> list[dict[str, Any]]:
    return [{"input": f"How many letters are in the word {word!r}?", "output": len(word)} for word in words]


class CountLettersTool:
    name = "count_letters"
    description = "Count the letters of a word."
    parameters_schema: dict[str, Any] = {
        "type": "object",
        "properties": {"word": {"type": "string"}},
        "required": ["word"],
    }

    async def execute(self, arguments: str) -> ToolResult:
        return ToolResult(content=str(len(json.loads(arguments)["word"])))


class HookStarterEnv(EnvironmentMultiTurn):
    def __init__(self, max_turns: int = 4) -> None:
        self.max_turns = max_turns
        self.dataset = {"train": letter_rows(TRAIN_WORDS), "validation": letter_rows(VALIDATION_WORDS)}
        self.tools = {"count_letters": CountLettersTool()}

    def start_episode(self, example: TaskExample, prompt_text: str) -> list[Message]:
        return [
            {"role": "system", "content": "Use the tools, then reply with only the final number."},
            {"role": "user", "content": prompt_text},
        ]

    def max_episode_turns(self, example: TaskExample) -> int:
        return self.max_turns

    def tool_specs(self, example: TaskExample) -> Sequence[ToolSpec]:
        return [tool_to_spec(tool) for tool in self.tools.values()]

    async def step_episode(
        self, example: TaskExample, messages: list[Message], assistant_response: str
    ) -> EnvironmentStepResult:
        parsed = parse_action(assistant_response)
        if parsed.kind == "tool_calls":
            results = await execute_tool_calls(self.tools, parsed.tool_calls)
            return EnvironmentStepResult(done=False, messages=tuple(results))
        return EnvironmentStepResult(done=True, final_response_text=parsed.content)

    def score_episode(self, example: TaskExample, episode: EnvironmentEpisode) -> RewardResult:
        answer = last_number(episode.response_text)
        correct = float(answer is not None and answer == float(example.output))
        used_tool = float(any(m["role"] == "tool" for m in episode.messages))
        return RewardResult(
            score=0.9 * correct + 0.1 * used_tool,
            threshold=0.9,
            components={"correct": correct, "used_tool": used_tool},
        )


def load_environment(max_turns: int = 4) -> HookStarterEnv:
    return HookStarterEnv(max_turns=max_turns)
