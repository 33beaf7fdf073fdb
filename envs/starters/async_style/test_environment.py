"""Plays the starter environment end to end with scripted policies."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Sequence

from rollflow import Message
from rollflow.envs.handle import EpisodeLimits
from rollflow.envs.runner import load_environment_handle, play_groups
from rollflow.envs.scripted import ScriptedPolicy

SPEC = f"{__package__}:load_environment"


def add_with_the_tool(messages: Sequence[Message], turn: int) -> str:
    if turn == 0:
        a, b = (int(n) for n in re.findall(r"\d+", messages[-1]["content"]))
        return f"<tool_call>{json.dumps({'name': 'add', 'arguments': {'a': a, 'b': b}})}</tool_call>"
    return messages[-1]["content"]  # the tool's answer


def test_a_tool_using_policy_gets_full_reward() -> None:
    handle = load_environment_handle(SPEC)
    items = handle.tasks("train")
    limits = EpisodeLimits(max_turns=4)
    groups = asyncio.run(play_groups(handle, items, 2, ScriptedPolicy(add_with_the_tool), limits, 4))
    for item, group in zip(items, groups, strict=True):
        assert all(rollout.terminated and rollout.turns == 2 for rollout in group)
        assert [score.reward for score in asyncio.run(handle.score(item, group))] == [1.0, 1.0]


def test_a_wrong_answer_gets_nothing() -> None:
    handle = load_environment_handle(SPEC)
    item = handle.tasks("validation")[0]
    rollout = asyncio.run(handle.play(item, ScriptedPolicy(lambda m, t: "-1"), EpisodeLimits(max_turns=4)))
    [score] = asyncio.run(handle.score(item, [rollout]))
    assert rollout.terminated and score.reward == 0.0
