"""The records an environment author writes against, for both environment styles.

Messages are plain dicts shaped like OpenAI chat messages (``role``, ``content``,
optionally ``tool_calls``, ``tool_call_id``, ``name``) because both reference APIs use
them and users build them by hand; ``Message`` is a ``TypedDict`` so type checkers still
see the keys. Everything else is a frozen dataclass: records are replaced, not mutated.

Hook style (``EnvironmentMultiTurn``): ``TaskExample``, ``EnvironmentStepResult``,
``EnvironmentTurn``, ``EnvironmentEpisode``, ``RewardResult``.
Async style (``Env``): ``Task``, ``ToolResult``, ``StepResult``, the ``Tool`` protocol and
``tool_to_spec``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NotRequired, Protocol, TypedDict, runtime_checkable


class ToolCallFunction(TypedDict):
    name: str
    arguments: str  # a JSON object, serialized: what OpenAI-style APIs carry


class ToolCall(TypedDict):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class Message(TypedDict):
    role: str  # "system" | "user" | "assistant" | "tool"
    content: str
    tool_calls: NotRequired[list[ToolCall]]
    tool_call_id: NotRequired[str]
    name: NotRequired[str]


class ToolSpecFunction(TypedDict):
    name: str
    description: str
    parameters: dict[str, Any]  # JSON Schema of the arguments object


class ToolSpec(TypedDict):
    """The OpenAI-style function spec a chat template renders (``{"type": "function", ...}``)."""

    type: Literal["function"]
    function: ToolSpecFunction


ChatMessage = Message  # the hook-style reference's name for the same thing
Split = Literal["train", "validation"]


class TruncationCause(enum.StrEnum):
    """Why an episode that did not terminate was cut short (stored as text)."""

    CONTEXT_OVERFLOW = "context_overflow"  # the context budget was spent: overlong penalty
    MAX_TURNS = "max_turns"  # the turn limit was reached: overlong penalty
    ENV = "env"  # the environment said truncated=True: no penalty
    PARSE_FAILURE = "parse_failure"  # the action could not be parsed: failed_parse_reward


# ---------------------------------------------------------------- hook style


@dataclass(frozen=True)
class TaskExample:
    """One row of a hook-style environment's dataset."""

    input: Any
    output: Any = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    id: str | None = None  # a stable id; derived from the row's content when absent


@dataclass(frozen=True)
class RewardResult:
    """A score for one finished episode. ``components`` name the parts that make it up."""

    score: float
    threshold: float | None = None  # score >= threshold counts as a pass
    components: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class EnvironmentStepResult:
    done: bool = True
    messages: tuple[Message, ...] = ()  # only the new environment-side messages
    final_response_text: str | None = None  # overrides the last action as the scored text
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EnvironmentTurn:
    role: str
    content: str
    name: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EnvironmentEpisode:
    messages: tuple[Message, ...]
    response_text: str
    turns: tuple[EnvironmentTurn, ...] = ()
    metadata: Mapping[str, Any] = field(default_factory=dict)  # "steps": per-step metadata
    latency_ms: int | None = None
    total_tokens: int | None = None


# ---------------------------------------------------------------- async style


@dataclass(frozen=True)
class Task:
    """The spec of one async-style episode: what to ask and what the reward checks."""

    prompt: str
    target: Any = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    id: str | None = None  # a stable id; derived from the prompt and target when absent


@dataclass(frozen=True)
class ToolResult:
    content: str
    should_stop: bool = False  # a request to end the episode; the environment decides


@dataclass(frozen=True)
class StepResult:
    terminated: bool
    truncated: bool
    messages: list[Message]
    reward: float = 0.0  # read only from the step that ends the episode
    metrics: Mapping[str, float] = field(default_factory=dict)


@runtime_checkable
class Tool(Protocol):
    name: str
    description: str
    parameters_schema: dict[str, Any]

    async def execute(self, arguments: str) -> ToolResult: ...


def tool_to_spec(tool: Tool) -> ToolSpec:
    """The schema a chat template renders for ``tool``."""
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description,
            "parameters": dict(tool.parameters_schema),
        },
    }
