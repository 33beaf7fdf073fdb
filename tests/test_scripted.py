"""Scripted policies: turn counting per session, replay by request, and bad scripts."""

from __future__ import annotations

import asyncio

import pytest

from rollflow.envs.agent import PolicyAction
from rollflow.envs.scripted import ScriptedPolicy, constant_policy, latest_user_content, replay_policy
from rollflow.envs.types import Message, ToolSpec

SPEC: ToolSpec = {"type": "function", "function": {"name": "t", "description": "", "parameters": {}}}


def _acts(policy: ScriptedPolicy, messages: list[Message], times: int) -> list[PolicyAction]:
    async def run() -> list[PolicyAction]:
        session = policy.open_session([SPEC])
        actions = [await session.act(messages) for _ in range(times)]
        await session.close()
        return actions

    return asyncio.run(run())


def test_turns_count_per_session_and_specs_are_recorded() -> None:
    policy = ScriptedPolicy(lambda messages, turn: f"turn {turn}", version=4)
    assert [a.text for a in _acts(policy, [], 3)] == ["turn 0", "turn 1", "turn 2"]
    assert [a.text for a in _acts(policy, [], 1)] == ["turn 0"]  # a new session starts over
    assert policy.opened_tool_specs == [(SPEC,), (SPEC,)]
    assert policy.version == 4


def test_a_script_may_return_a_full_action() -> None:
    action = PolicyAction(text="x", finish_reason="length")
    assert _acts(ScriptedPolicy(lambda m, t: action), [], 1) == [action]


def test_bad_scripts_fail_clearly() -> None:
    with pytest.raises(TypeError, match="script must be callable"):
        ScriptedPolicy("hello")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="returned int; expected str or PolicyAction"):
        _acts(ScriptedPolicy(lambda m, t: 3), [], 1)  # type: ignore[arg-type, return-value]

    async def act_after_close() -> None:
        session = constant_policy("x").open_session([])
        await session.close()
        await session.act([])

    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(act_after_close())


def test_replay_follows_the_latest_user_message_and_repeats_its_last_action() -> None:
    policy = replay_policy({"q1": ["a", "b"], "q2": ["c"]}, unknown_reply="?")
    history: list[Message] = [
        {"role": "user", "content": "q0"},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "q1"},
    ]
    assert [a.text for a in _acts(policy, [*history, {"role": "tool", "content": "r"}], 3)] == ["a", "b", "b"]
    assert [a.text for a in _acts(policy, [{"role": "user", "content": "q2"}], 1)] == ["c"]
    assert [a.text for a in _acts(policy, [{"role": "user", "content": "q9"}], 1)] == ["?"]
    assert latest_user_content([{"role": "system", "content": "s"}]) == ""
    with pytest.raises(ValueError, match="no actions to replay"):
        replay_policy({"q": []})


def test_delay_lets_sessions_overlap() -> None:
    policy = ScriptedPolicy(lambda m, t: "x", delay_s=0.2)

    async def many() -> float:
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.gather(*(policy.open_session([]).act([]) for _ in range(10)))
        return loop.time() - started

    assert asyncio.run(many()) < 1.0  # ten 0.2 s actions at once (0.2 s), not one after another (2 s)
