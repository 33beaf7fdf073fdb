"""A task's opening prompt as the policy is given it, and its length in tokens.

``opening_prompt`` plays the task's episode up to its first action with a probe policy that
records the prompt and ends the episode there (``context``), so the environment's
``start_episode`` / ``Env.reset`` and its close really run; ``prompt_tokens`` renders that
prompt with the policy's chat template and tools and counts it. Preflight checks the first
task's prompt fits (``rollflow.ops.preflight``), ``rollflow env show`` prints it
(``rollflow.ops.prompt_preview``), the serving export keeps it as an example, and the
scoring stage measures it for a step whose every episode overflowed the context.

The probe carries the codec the prompt is rendered with (``codec``, as a real policy does),
so an environment that reads the policy's chat template sees that one: an agent
environment's ``tool_format = "auto"`` picks the family format the template knows
(``envs.tool_formats.chat_template_of``), as training on that model does. Without a codec
it is a policy whose template is not known here (one behind a server): rollflow's format.
A prompt the template cannot render is refused in one line (``unrenderable_prompt``): every
episode of that task would fail at its first action. ``first_policy_call`` also names the
tools the prompt offers: an agent's are its request's (the endpoint's ``serving_call()``
while the probe acts), since in rollflow's protocol the endpoint writes them into the
system message and opens the policy's session with no specs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rollflow.config.checks import PreflightError
from rollflow.config.run import RunConfig
from rollflow.envs.agent import PolicyAction
from rollflow.envs.handle import EnvironmentHandle, EpisodeLimits, TaskItem
from rollflow.envs.types import Message, ToolSpec

if TYPE_CHECKING:
    from rollflow.policy.codec import ChatCodec


def prompt_tokens(config: RunConfig, handle: EnvironmentHandle, item: TaskItem) -> int:
    """The length in tokens of ``item``'s opening prompt as the policy would see it."""
    from rollflow.generators.models import base_model_ref
    from rollflow.policy.codec import ChatCodec, ChatTemplateError
    from rollflow.policy.models import load_tokenizer

    codec = ChatCodec(load_tokenizer(base_model_ref(config)))
    messages, tool_specs = opening_prompt(config.env.name, handle, item, codec)
    try:
        return len(codec.render_prompt_ids(messages, tool_specs))
    except ChatTemplateError as error:
        raise unrenderable_prompt(config, item, error) from error


def unrenderable_prompt(config: RunConfig, item: TaskItem, error: Exception) -> PreflightError:
    """The one-line refusal of a task whose opening prompt the model's chat template cannot
    render (Llama 3.1's refuses two tool calls in one reply): every episode of it would fail."""
    model = config.model.path or "the bundled model"
    return PreflightError(f"[env].name = {config.env.name!r}: task {item.task_id!r} cannot start: its opening "
                          f"prompt does not render with the chat template of {model}: {error}")  # fmt: skip


def opening_prompt(
    env_name: str, handle: EnvironmentHandle, item: TaskItem, codec: ChatCodec | None = None
) -> tuple[list[Message], list[ToolSpec]]:
    """The messages and tool specs of ``item``'s first policy call: the episode is played
    up to its first action (its start and close really run), then ended there; by a
    policy rendering with ``codec`` (its chat template), when given."""
    first = first_policy_call(env_name, handle, item, codec)
    return first.messages, first.tool_specs


@dataclass(frozen=True)
class PolicyCall:
    """What a policy is given for an episode's first action, and the tools it offers."""

    messages: list[Message]
    tool_specs: list[ToolSpec]
    # by name: the specs', or an agent's own tools= (in rollflow's protocol its capture
    # endpoint describes them in the system message and gives the policy no specs)
    tools: tuple[str, ...]


def first_policy_call(
    env_name: str, handle: EnvironmentHandle, item: TaskItem, codec: ChatCodec | None = None
) -> PolicyCall:
    """``opening_prompt``'s call, with the names of the tools it offers."""
    probe = _PromptProbe(codec)
    rollout = asyncio.run(handle.play(item, probe, EpisodeLimits(max_turns=1)))
    if not probe.calls:
        failure = rollout.error or "it never asked the policy for an action"
        raise PreflightError(f"[env].name = {env_name!r}: task {item.task_id!r} cannot start: {failure}")
    return probe.calls[0]


class _PromptProbe:
    """A policy that records its first prompt and ends the episode there ("context");
    ``codec`` is the one it would render with (read, never used to sample)."""

    version = 0

    def __init__(self, codec: ChatCodec | None) -> None:
        self.codec = codec
        self.calls: list[PolicyCall] = []

    def open_session(self, tool_specs: Sequence[ToolSpec]) -> _ProbeSession:
        return _ProbeSession(self, list(tool_specs))


class _ProbeSession:
    def __init__(self, probe: _PromptProbe, tool_specs: list[ToolSpec]) -> None:
        self.probe = probe
        self.tool_specs = tool_specs

    async def act(self, messages: Sequence[Message]) -> PolicyAction:
        from rollflow.envs.openai_agent_endpoint import serving_call

        served = serving_call()  # an agent's call: its request's tools, whatever the format
        offered = served.request.tools if served is not None else self.tool_specs
        names = tuple(str(spec.get("function", {}).get("name", "?")) for spec in offered)
        self.probe.calls.append(PolicyCall(list(messages), self.tool_specs, names))
        return PolicyAction(text="", finish_reason="context", sampling_attempts=0)

    async def close(self) -> None:
        return None
