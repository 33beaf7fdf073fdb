"""Expert transcripts of an agent environment: the user's agent, unchanged, played against an
expert in place of the model, through the real capture endpoint (for ``rollflow sft``).

The agent module names the expert in ``[env].kwargs`` as ``expert = "module:function"``
(``rollflow.envs.openai_agent``)::

    def expert(task: dict, messages: list[dict], tools: list[dict]) -> dict

Called once per chat call of the agent with the task and the call's messages and tools as
the agent sent them (OpenAI form; ``async def`` works too), it returns the assistant message
a strong model would answer with: ``{"content": "..."}`` and/or ``{"tool_calls": [{"function":
{"name": ..., "arguments": ...}}]}`` (``arguments`` JSON text or an object; ids are the
endpoint's, as for the model's calls).

How. ``ExpertPolicy`` is a ``Policy`` without a model: its session writes the expert's
message as the model would write it in the episode's tool-call format (``ToolFormat.render``,
whose ``parse`` gives the same calls back; checked on every reply), so the endpoint reads it
as it reads a sampled reply and the agent goes on as it would with the model. Each session
records what it was asked to continue: the messages its chat codec would render, the system
prompt with the tool description of rollflow's protocol, or a native template's tool
specs, exactly as the policy sees them in training. So SFT teaches the format the policy is
trained and served in, token for token (``tasks/sft_rows.py`` tokenises the rows as a
rollout of them).

A transcript is one chain of calls whose histories extend each other (the previous call's
messages and reply, then what the agent added): its prompt is the first call's messages, its
target every reply and what the agent sent between them. An agent that rewrites its history
or starts a sub-agent's thread starts another chain, as it starts another training sample.

Simplified: an expert episode that errs or is cut short (call budget, context) fails SFT
with its task's id rather than training on an unfinished transcript; the episodes are not
scored here (the reward is the user's, and may be slow: the tests score them).
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollflow.envs.agent import PolicyAction
from rollflow.envs.episode import EpisodeRollout
from rollflow.envs.handle import EpisodeLimits, TaskItem
from rollflow.envs.openai_agent import AgentEnvironmentHandle
from rollflow.envs.openai_agent_endpoint import ServedCall, serving_call
from rollflow.envs.openai_agent_messages import for_template, reply_for
from rollflow.envs.tool_formats import ToolFormat
from rollflow.envs.types import Message, ToolCall, ToolSpec

EXPERT_CONCURRENCY = 16  # episodes at once: the expert and the agent's tools are the work


class ExpertError(ValueError):
    """The expert is missing, or its answer or episode cannot give a transcript."""


@dataclass(frozen=True)
class ExpertTranscript:
    """One chain of calls as the policy saw it: ``prompt`` (never trained), then ``target``."""

    row_id: str
    prompt: tuple[Message, ...]
    target: tuple[Message, ...]  # starts with the expert's first reply
    tool_specs: tuple[ToolSpec, ...]  # the session's: a native template's, else none


@dataclass(frozen=True)
class _Call:
    messages: tuple[Message, ...]  # what the session was asked to continue
    reply: Message  # the expert's reply, as the next call's messages carry it


@dataclass
class _Session:
    policy: ExpertPolicy
    tool_specs: tuple[ToolSpec, ...]
    calls: list[_Call] = field(default_factory=list)

    async def act(self, messages: Sequence[Message]) -> PolicyAction:
        served = serving_call()
        if served is None:
            raise ExpertError("an expert answers the capture endpoint's calls only, not a chat codec's prompt")
        request = served.request
        arguments = (self.policy.task_copy(), [dict(m) for m in request.messages], [dict(t) for t in request.tools])
        answer = self.policy.expert(*arguments)
        if inspect.isawaitable(answer):
            answer = await answer
        text = expert_text(answer, served)
        reply = reply_for(text, cut_by_length=False, call_number=served.number, reads_tools=request.reads_calls,
                          tool_format=served.tool_format).transcript_message  # fmt: skip
        if served.tool_format.in_template:
            reply = for_template(reply, served.tool_format)
        self.calls.append(_Call(tuple(messages), reply))
        return PolicyAction(text=text)

    async def close(self) -> None:
        pass


class ExpertPolicy:
    """A ``Policy`` whose replies are ``expert``'s for ``task`` (the module note).

    ``codec`` is the trained policy's chat codec (anything with a ``tokenizer``): the endpoint
    reads the chat template from it to pick the tool format, as it does in training.
    """

    version = 0

    def __init__(self, expert: Callable[..., Any], task: Mapping[str, Any], codec: object | None = None) -> None:
        self.expert, self.task, self.codec = expert, json.loads(json.dumps(dict(task))), codec
        self.sessions: list[_Session] = []

    def task_copy(self) -> dict[str, Any]:
        return json.loads(json.dumps(self.task))

    def open_session(self, tool_specs: Sequence[ToolSpec]) -> _Session:
        self.sessions.append(_Session(self, tuple(tool_specs)))
        return self.sessions[-1]


def expert_text(answer: object, served: ServedCall) -> str:
    """The expert's message as the model writes it in the call's tool format."""
    if not isinstance(answer, Mapping):
        raise ExpertError(f"the expert returned a {type(answer).__name__}, not an assistant message dict")
    content, calls = answer.get("content") or "", answer.get("tool_calls") or []
    if not isinstance(content, str) or not isinstance(calls, list):
        raise ExpertError(f"the expert's message needs text 'content' and/or a list of 'tool_calls': {answer!r:.200}")
    if not calls:
        if not content:
            raise ExpertError("the expert's message has neither content nor tool_calls")
        return content
    if not served.request.reads_calls:
        raise ExpertError("the expert made tool calls where the agent offered no tools (or tool_choice 'none')")
    fmt = served.tool_format
    checked = [_checked_call(call, served.number, index, fmt) for index, call in enumerate(calls)]
    text = fmt.render(content, checked)
    parsed = fmt.parse(text)
    if [_name_and_arguments(c) for c in parsed.tool_calls] != [_name_and_arguments(c) for c in checked]:
        raise ExpertError(f"the expert's calls do not read back from the {fmt.name} format: {text[:200]!r}")
    return text


def _checked_call(call: object, number: int, index: int, fmt: ToolFormat) -> ToolCall:
    function = call.get("function") if isinstance(call, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str) or not name:
        raise ExpertError(f"the expert's tool call {index} has no function name: {call!r:.200}")
    arguments = function.get("arguments", {})  # type: ignore[union-attr]
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError as exc:
            raise ExpertError(f"the expert's tool call {index} ({name}): arguments are not JSON: {exc}") from exc
    if not isinstance(arguments, dict):
        raise ExpertError(f"the expert's tool call {index} ({name}) needs a JSON object of arguments")
    return {"id": fmt.call_id(number, index), "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}  # fmt: skip


def _name_and_arguments(call: ToolCall) -> tuple[str, Any]:
    return call["function"]["name"], json.loads(call["function"]["arguments"])


# ---------------------------------------------------------------- transcripts


def transcripts(policy: ExpertPolicy, task_id: str) -> list[ExpertTranscript]:
    """The chains of ``policy``'s calls (the module note), one transcript each."""
    chains: list[tuple[_Session, list[_Call]]] = []
    for session in policy.sessions:
        for call in session.calls:
            if chains and chains[-1][0] is session and _extends(call, chains[-1][1][-1]):
                chains[-1][1].append(call)
            else:
                chains.append((session, [call]))
    found = []
    for number, (session, calls) in enumerate(chains):
        first, last = calls[0], calls[-1]
        target = (*last.messages[len(first.messages) :], last.reply)
        row_id = task_id if len(chains) == 1 else f"{task_id}/{number}"
        found.append(ExpertTranscript(row_id, first.messages, target, session.tool_specs))
    return found


def _extends(call: _Call, previous: _Call) -> bool:
    """Whether ``call``'s history is ``previous``'s messages and reply, then more."""
    before = [*previous.messages, previous.reply]
    return len(call.messages) > len(before) and all(
        (m["role"], m["content"]) == (b["role"], b["content"]) for m, b in zip(call.messages, before)
    )


async def play_expert(
    handle: AgentEnvironmentHandle, items: Sequence[TaskItem], *, codec: object | None = None,
    max_turns: int | None = None,
) -> list[tuple[EpisodeRollout, list[ExpertTranscript]]]:  # fmt: skip
    """Each of ``items`` played once by the agent with the environment's expert: the rollout
    (as training would store it) and its transcripts. ``ExpertError`` when one fails."""
    expert = handle.env.expert
    if expert is None:
        raise ExpertError(missing_expert(handle))
    bound = asyncio.Semaphore(EXPERT_CONCURRENCY)

    async def play(item: TaskItem) -> tuple[EpisodeRollout, list[ExpertTranscript]]:
        policy = ExpertPolicy(expert, item.payload.metadata, codec)  # type: ignore[union-attr]
        async with bound:
            rollout = await handle.play(item, policy, EpisodeLimits(max_turns=max_turns))
        ending = rollout.error or (rollout.truncation_cause.value if rollout.truncation_cause else None)
        if ending is not None:
            raise ExpertError(f"the expert's episode of task {item.task_id} did not finish: {ending.splitlines()[0]}")
        return rollout, transcripts(policy, item.task_id)

    return list(await asyncio.gather(*(play(item) for item in items)))


def missing_expert(handle: AgentEnvironmentHandle) -> str:
    agent = handle.env.names["agent"]
    return (
        f"{agent} has no expert to write SFT transcripts: add expert = \"module:function\" to [env].kwargs "
        "(def expert(task, messages, tools) -> the assistant message dict), or give the transcripts "
        "as a file ([sft].transcripts)"
    )
