"""Plays the starter environment end to end with scripted policies."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence

from rollflow import Message
from rollflow.envs.handle import EpisodeLimits
from rollflow.envs.runner import load_environment_handle, play_groups
from rollflow.envs.scripted import ScriptedPolicy

SPEC = f"{__package__}:load_environment"


def add_the_numbers(messages: Sequence[Message], turn: int) -> str:
    a, b = map(int, re.findall(r"\d+", messages[-1]["content"]))
    return str(a + b)


def test_the_right_sum_gets_full_reward_in_one_turn() -> None:
    handle = load_environment_handle(SPEC)
    items = handle.tasks("train")
    groups = asyncio.run(play_groups(handle, items, 2, ScriptedPolicy(add_the_numbers), EpisodeLimits(), 4))
    for item, group in zip(items, groups, strict=True):
        assert all(rollout.terminated and rollout.turns == 1 for rollout in group)
        assert [score.reward for score in asyncio.run(handle.score(item, group))] == [1.0, 1.0]


def test_a_reply_without_a_number_gets_nothing() -> None:
    handle = load_environment_handle(SPEC)
    item = handle.tasks("train")[0]
    rollout = asyncio.run(handle.play(item, ScriptedPolicy(lambda m, t: "I am not sure."), EpisodeLimits()))
    [score] = asyncio.run(handle.score(item, [rollout]))
    assert rollout.terminated and score.reward == 0.0
