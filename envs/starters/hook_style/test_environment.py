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


def count_with_the_tool(messages: Sequence[Message], turn: int) -> str:
    if turn == 0:
        word = re.findall(r"'(\w+)'", messages[-1]["content"])[0]
        return f"<tool_call>{json.dumps({'name': 'count_letters', 'arguments': {'word': word}})}</tool_call>"
    return messages[-1]["content"]  # the tool's answer


def test_a_tool_using_policy_gets_full_reward() -> None:
    handle = load_environment_handle(SPEC)
    items = handle.tasks("train")
    groups = asyncio.run(
        play_groups(handle, items, 2, ScriptedPolicy(count_with_the_tool), EpisodeLimits(), 4)
    )
    for item, group in zip(items, groups, strict=True):
        assert all(rollout.terminated and rollout.error is None for rollout in group)
        assert [score.reward for score in asyncio.run(handle.score(item, group))] == [1.0, 1.0]


def test_a_wrong_guess_without_the_tool_gets_nothing() -> None:
    handle = load_environment_handle(SPEC)
    item = handle.tasks("train")[0]
    rollout = asyncio.run(handle.play(item, ScriptedPolicy(lambda m, t: "1000"), EpisodeLimits()))
    [score] = asyncio.run(handle.score(item, [rollout]))
    assert rollout.terminated and score.reward == 0.0
