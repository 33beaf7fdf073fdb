"""The tool-use game as plain Python for an agent: its tasks, its tools as functions, its reward.

Everything is the bundled game's (``rollflow.envs.tool_use_game``): the same generated
questions (seed 0, 200 training and 50 validation tasks), the same three tools over each
task's fact table, the same reward. Only the shapes change: a task is a JSON dict, a tool
is called by name with the JSON arguments the model wrote, and a model's mistake comes
back as ``tool_error: ...`` text, as the native game's tool messages say it.
"""

from __future__ import annotations

import json
from typing import Any

from rollflow.envs.tool_use_game import (
    GAME_TOOL_SPECS,
    SYSTEM_PROMPT,
    WORKED_EXAMPLE,
    expert_transcript,
    game_tools,
    generate_examples,
    score_game,
)
from rollflow.envs.tools import TOOL_ERROR_PREFIX

TOOLS: list[dict[str, Any]] = [json.loads(json.dumps(spec)) for spec in GAME_TOOL_SPECS]
# One solved episode, as the native game shows it before the question: the bundled
# 135M model makes almost no tool call without it.
WORKED_EXAMPLE_MESSAGES: list[dict[str, Any]] = [
    {"role": "user", "content": WORKED_EXAMPLE.question},
    *(dict(message) for message in expert_transcript(WORKED_EXAMPLE)),
]
__all__ = ["SYSTEM_PROMPT", "TOOLS", "WORKED_EXAMPLE_MESSAGES", "call_tool", "reward", "tasks"]


def tasks(split: str) -> list[dict[str, Any]]:
    """The game's ``split`` tasks: question, fact table, needed keys, answer and the formula
    that gives it from the needed facts (for the expert, ``expert.py``)."""
    train, validation = generate_examples(seed=0, num_train=200, num_validation=50)
    return [
        {
            "id": example.id,
            "question": str(example.input),
            "facts": dict(example.metadata["facts"]),
            "needed_keys": list(example.metadata["needed_keys"]),
            "answer": int(example.output),
            "formula": str(example.metadata["formula"]),
            "difficulty": example.metadata["difficulty"],
        }
        for example in (train if split == "train" else validation)
    ]


def call_tool(task: dict[str, Any], name: str, arguments: str) -> str:
    """Run tool ``name`` of ``task``'s table on the model's JSON ``arguments``."""
    tool = game_tools(task["facts"]).get(name)
    if tool is None:
        return f"{TOOL_ERROR_PREFIX}unknown tool {name!r}; the tools are: calculator, list_fact_keys, lookup"
    try:
        parsed = json.loads(arguments)
        if not isinstance(parsed, dict):
            raise ValueError(f"arguments must be a JSON object, got {type(parsed).__name__}")
        return tool.run(parsed)
    except Exception as exc:  # the model's mistake is its feedback
        return f"{TOOL_ERROR_PREFIX}{name} failed: {type(exc).__name__}: {exc}"


def reward(task: dict[str, Any], result: Any, messages: list[dict[str, Any]]) -> dict[str, float]:
    """The game's score of the agent's part of the transcript (after the question)."""
    asked = max((i for i, m in enumerate(messages) if m["role"] == "user" and m["content"] == task["question"]), default=-1)
    scored = score_game(
        needed_keys=task["needed_keys"],
        answer=float(task["answer"]),
        messages=messages[asked + 1 :],  # type: ignore[arg-type]
        response_text=result if isinstance(result, str) else "",
    )
    return {"reward": scored.score, "threshold": float(scored.threshold or 0.0), **scored.components}
