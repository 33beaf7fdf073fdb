"""Policies without a model, for tests, demos and baselines.

``ScriptedPolicy`` wraps a function ``(messages, turn) -> text`` (or a full
``PolicyAction``, to script finish reasons such as ``"context"``). It produces no tokens:
its episodes have no ``actions`` and cannot be trained on, only played and scored.

``replay_policy`` plays known action texts per task: it finds the task by the content of
the latest user message (the request; later turns only add assistant and tool messages)
and plays that task's actions in order. Bundled games build their expert policies on it
from their expert transcripts (``tool_use_game.expert_policy``). Past the end of a script
it repeats the last action; an unknown task gets ``unknown_reply``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from rollflow.envs.agent import PolicyAction
from rollflow.envs.types import Message, ToolSpec

ScriptFunction = Callable[[Sequence[Message], int], "str | PolicyAction"]


class ScriptedPolicy:
    """A ``Policy`` whose every action comes from ``script(messages, turn)``.

    ``turn`` counts this episode's actions from 0. ``delay_s`` sleeps before each action
    (to exercise concurrency). ``opened_tool_specs`` records the tool specs each session
    was opened with, in order: what the runner showed the policy.
    """

    def __init__(self, script: ScriptFunction, *, version: int = 0, delay_s: float = 0.0) -> None:
        if not callable(script):
            raise TypeError(f"script must be callable (messages, turn) -> str, got {script!r:.100}")
        self.script = script
        self.version = version
        self.delay_s = delay_s
        self.opened_tool_specs: list[tuple[ToolSpec, ...]] = []

    def open_session(self, tool_specs: Sequence[ToolSpec]) -> ScriptedSession:
        self.opened_tool_specs.append(tuple(tool_specs))
        return ScriptedSession(policy=self)


@dataclass
class ScriptedSession:
    policy: ScriptedPolicy
    turn: int = 0
    closed: bool = False

    async def act(self, messages: Sequence[Message]) -> PolicyAction:
        if self.closed:
            raise RuntimeError("act() on a closed ScriptedSession")
        if self.policy.delay_s:
            await asyncio.sleep(self.policy.delay_s)
        reply = self.policy.script(messages, self.turn)
        self.turn += 1
        if isinstance(reply, PolicyAction):
            return reply
        if not isinstance(reply, str):
            raise TypeError(f"the script returned {type(reply).__name__}; expected str or PolicyAction")
        return PolicyAction(text=reply)

    async def close(self) -> None:
        self.closed = True


def constant_policy(text: str) -> ScriptedPolicy:
    """Always says ``text``."""
    return ScriptedPolicy(lambda messages, turn: text)


def replay_policy(
    actions_by_request: Mapping[str, Sequence[str]], unknown_reply: str = "I don't know."
) -> ScriptedPolicy:
    """Plays ``actions_by_request[latest user message]`` in order (see the module doc)."""
    scripts = {request: tuple(actions) for request, actions in actions_by_request.items()}
    empty = [request for request, actions in scripts.items() if not actions]
    if empty:
        raise ValueError(f"no actions to replay for {len(empty)} request(s), e.g. {empty[0]!r:.80}")

    def script(messages: Sequence[Message], turn: int) -> str:
        actions = scripts.get(latest_user_content(messages))
        if actions is None:
            return unknown_reply
        return actions[min(turn, len(actions) - 1)]

    return ScriptedPolicy(script)


def latest_user_content(messages: Sequence[Message]) -> str:
    for message in reversed(messages):
        if message.get("role") == "user":
            return message.get("content", "")
    return ""
