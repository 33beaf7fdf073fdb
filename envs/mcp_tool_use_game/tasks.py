"""The tool-use game's tasks and reward for the config-only MCP form (``rollflow.envs.mcp``).

``tasks(split)`` gives the same questions as ``rollflow.envs.tool_use_game`` with the same
seed, each opened by the same worked example (a whole solved episode before the question,
``opening_messages``: the game's default) and carrying its id to the server in
``mcp_meta``. ``tasks_without_worked_example(split)`` is the game of
``worked_example = false``, the one configs/learn_tool_use_game.toml trains on (SFT having
taught the protocol): the question alone. The config-only form names a tasks function and
passes it only the split, hence one function each. ``reward`` is the game's ``score_game`` on
the messages after the question, so both forms score alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rollflow.envs.hooks import check_split
from rollflow.envs.tool_use_game.environment import expert_transcript
from rollflow.envs.tool_use_game.reward import score_game
from rollflow.envs.tool_use_game.tasks import WORKED_EXAMPLE, generate_examples
from rollflow.envs.types import Message

SEED = 0
NUM_TRAIN = 200
NUM_VALIDATION = 50


def tasks(split: str) -> list[dict[str, Any]]:
    """The ``split``'s tasks, each opened by the worked example."""
    return game_tasks(split, worked_example=True)


def tasks_without_worked_example(split: str) -> list[dict[str, Any]]:
    """The ``split``'s tasks, the question alone after the system prompt."""
    return game_tasks(split, worked_example=False)


def game_tasks(split: str, worked_example: bool) -> list[dict[str, Any]]:
    """The ``split``'s tasks: the prompt, what the reward reads, and the server's task id."""
    check_split(split)
    train, validation = generate_examples(SEED, NUM_TRAIN, NUM_VALIDATION)
    worked = [{"role": "user", "content": WORKED_EXAMPLE.question}, *expert_transcript(WORKED_EXAMPLE)]
    return [
        {
            "id": example.id,
            "prompt": str(example.input),
            "opening_messages": worked if worked_example else [],
            "answer": int(example.output),
            "needed_keys": list(example.metadata["needed_keys"]),
            "difficulty": example.metadata["difficulty"],
            "mcp_meta": {"task_id": example.id},
        }
        for example in (train if split == "train" else validation)
    ]


def reward(task: Mapping[str, Any], messages: Sequence[Message]) -> dict[str, float]:
    """The game's reward and its components, on the agent's part of the transcript."""
    asked = max(i for i, m in enumerate(messages) if m.get("role") == "user" and m.get("content") == task["prompt"])
    agent = list(messages[asked + 1 :])
    answers = [m for m in agent if m.get("role") == "assistant"]
    result = score_game(
        needed_keys=task["needed_keys"],
        answer=float(task["answer"]),
        messages=agent,
        response_text=answers[-1]["content"] if answers else "",
    )
    return {"reward": result.score, **result.components}
