"""A task's opening prompt as the policy is given it, and its length in tokens.

``opening_prompt`` plays the task's episode up to its first action with a probe policy that
records the prompt and ends the episode there (``context``), so the environment's
``start_episode`` / ``Env.reset`` and its close really run; ``prompt_tokens`` renders that
prompt with the policy's chat template and tools and counts it. Preflight checks the first
task's prompt fits (``rollflow.ops.preflight``), ``rollflow env show`` prints it
(``rollflow.ops.prompt_preview``), the serving export keeps it as an example, and the
scoring stage measures it for a step whose every episode overflowed the context.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from rollflow.config.checks import PreflightError
from rollflow.config.run import RunConfig
from rollflow.envs.agent import PolicyAction
from rollflow.envs.handle import EnvironmentHandle, EpisodeLimits, TaskItem
from rollflow.envs.types import Message, ToolSpec


def prompt_tokens(config: RunConfig, handle: EnvironmentHandle, item: TaskItem) -> int:
    """The length in tokens of ``item``'s opening prompt as the policy would see it."""
    from rollflow.generators.models import base_model_ref
    from rollflow.policy.codec import ChatCodec
    from rollflow.policy.models import load_tokenizer

    messages, tool_specs = opening_prompt(config.env.name, handle, item)
    codec = ChatCodec(load_tokenizer(base_model_ref(config)))
    return len(codec.render_prompt_ids(messages, tool_specs))


def opening_prompt(
    env_name: str, handle: EnvironmentHandle, item: TaskItem
) -> tuple[list[Message], list[ToolSpec]]:
    """The messages and tool specs of ``item``'s first policy call: the episode is played
    up to its first action (its start and close really run), then ended there."""
    probe = _PromptProbe()
    rollout = asyncio.run(handle.play(item, probe, EpisodeLimits(max_turns=1)))
    if not probe.prompts:
        failure = rollout.error or "it never asked the policy for an action"
        raise PreflightError(f"[env].name = {env_name!r}: task {item.task_id!r} cannot start: {failure}")
    return probe.prompts[0]


class _PromptProbe:
    """A policy that records its first prompt and ends the episode there ("context")."""

    version = 0

    def __init__(self) -> None:
        self.prompts: list[tuple[list[Message], list[ToolSpec]]] = []

    def open_session(self, tool_specs: Sequence[ToolSpec]) -> _ProbeSession:
        return _ProbeSession(self, list(tool_specs))


class _ProbeSession:
    def __init__(self, probe: _PromptProbe, tool_specs: list[ToolSpec]) -> None:
        self.probe = probe
        self.tool_specs = tool_specs

    async def act(self, messages: Sequence[Message]) -> PolicyAction:
        self.probe.prompts.append((list(messages), self.tool_specs))
        return PolicyAction(text="", finish_reason="context", sampling_attempts=0)

    async def close(self) -> None:
        return None
