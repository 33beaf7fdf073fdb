"""OpenAI chat requests and replies <-> rollflow's messages and tool-call protocol.

The capture endpoint (``rollflow.envs.openai_agent_endpoint``) speaks OpenAI's
``/v1/chat/completions`` to the agent and rollflow's text protocol to the model. This
module is that translation, as plain functions:

- ``parse_request``: the request body, checked. What the endpoint cannot honour exactly
  is refused with a ``RequestError`` naming the parameter (HTTP 400): ``stream``,
  ``n > 1``, ``stop``, a ``response_format`` other than text, ``tool_choice``
  ``"required"`` or a named function, the legacy ``functions``, and a ``max_tokens`` /
  ``max_completion_tokens`` below the run's budget (a session samples up to the run's
  ``max_completion_tokens``; it takes no per-call cap yet). A larger cap is accepted and
  capped by the run's. Sampling settings (``temperature``, ``top_p``, ``seed``...) are
  ignored, as is any parameter the endpoint does not read: the run's settings are used, so
  the sampler's logprobs stay those of the distribution trained against; the reply's
  ``x-rollflow-ignored`` header names what was ignored.
- ``transcript_messages``: the agent's messages as rollflow's ``Message`` dicts (text
  content, structured calls, tool results named after the call they answer, as the native
  environments write them).
- ``reply_for``: a sampled action as an OpenAI assistant message. The tool format reads
  it: a well-formed call becomes ``tool_calls`` (finish reason ``"tool_calls"``), a
  malformed one stays plain content and its parse error is returned for the record (the
  agent sees what the model wrote).
- ``reply_key``: what identifies a reply when the agent sends it back, so the endpoint can
  put the raw sampled text back in its place: the history then re-renders to exactly the
  tokens that were sampled, and the next call continues the same training sample.

Which tool-call format the model is asked for is the episode's ``ToolFormat``
(``rollflow.envs.tool_formats``): rollflow's protocol described in the system prompt
(``describe_tools``, the default), or a family's own (Hermes, Llama 3 JSON, Mistral), whose
tools the chat template renders and whose ``parse`` reads the reply.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from rollflow.envs.protocol import describe_tools
from rollflow.envs.tool_formats import ROLLFLOW, ToolFormat
from rollflow.envs.types import Message, ToolCall, ToolSpec

# The parameters the endpoint reads; any other (temperature, top_p, seed, logprobs, user,
# parallel_tool_calls, a server's extra_body...) is accepted and ignored, named in the
# reply's x-rollflow-ignored header: the run decides how to sample.
KNOWN_PARAMETERS = frozenset({
    "model", "messages", "tools", "tool_choice", "max_tokens", "max_completion_tokens",
    "stream", "n", "stop", "response_format", "functions", "function_call",
})  # fmt: skip


class RequestError(ValueError):
    """A request the endpoint refuses; ``param`` names the culprit, ``status`` the HTTP code."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


@dataclass(frozen=True)
class ChatRequest:
    """One checked request: the agent's messages, its tools, what the endpoint ignored."""

    messages: tuple[Message, ...]
    tools: tuple[ToolSpec, ...]
    tools_text: str  # the protocol's description of ``tools``; "" with tool_choice "none" or a native format
    ignored: tuple[str, ...]
    reads_calls: bool = False  # tools were offered and tool_choice is not "none": the reply is parsed


def parse_request(body: object, run_max_tokens: int | None, tool_format: ToolFormat = ROLLFLOW) -> ChatRequest:
    """``body`` checked; a ``RequestError`` names what the endpoint refuses. With a native
    ``tool_format`` the tools are left to the chat template (no ``tools_text``); it renders
    them with ``tool_choice`` "none" too (as vLLM does), only the reply is not parsed."""
    if not isinstance(body, Mapping):
        raise RequestError("the request body must be a JSON object")
    _refuse_unsupported(body, run_max_tokens)
    tools = _checked_tools(body.get("tools"))
    choice = body.get("tool_choice", "auto")
    if choice not in (None, "auto", "none"):
        raise RequestError(
            f"tool_choice {choice!r} is not supported yet: only 'auto' and 'none' "
            "(the model is asked for calls in its tool-call format; it cannot be forced to make one)",
            param="tool_choice",
        )
    try:
        tools_text = "" if choice == "none" or tool_format.in_template else describe_tools(tools)
    except ValueError as exc:
        raise RequestError(str(exc), param="tools") from exc
    messages = transcript_messages(body.get("messages"))
    ignored = sorted(key for key in body if key not in KNOWN_PARAMETERS)
    return ChatRequest(messages=messages, tools=tools, tools_text=tools_text, ignored=tuple(ignored),
                       reads_calls=bool(tools) and choice != "none")  # fmt: skip


def _refuse_unsupported(body: Mapping[str, Any], run_max_tokens: int | None) -> None:
    if body.get("stream"):
        raise RequestError("stream=true is not supported: call without streaming", param="stream")
    n = body.get("n", 1)
    if n not in (None, 1):
        raise RequestError(f"n={n!r} is not supported: one choice per call (make n calls)", param="n")
    if body.get("stop"):
        raise RequestError("stop sequences are not supported yet: leave 'stop' out", param="stop")
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise RequestError("response_format is not supported yet: only plain text", param="response_format")
    for legacy in ("functions", "function_call"):
        if body.get(legacy) is not None:
            raise RequestError(f"the legacy {legacy!r} parameter is not supported: use 'tools'", param=legacy)
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise RequestError(f"{name} must be a positive integer, got {value!r}", param=name)
        if run_max_tokens is not None and value < run_max_tokens:
            raise RequestError(
                f"{name}={value} is below the run's max_completion_tokens={run_max_tokens}: a per-call "
                "cap below the run's is not supported yet; leave it out or lower [rollout].max_completion_tokens",
                param=name,
            )


def _checked_tools(tools: object) -> tuple[ToolSpec, ...]:
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise RequestError(f"tools must be a list, got {type(tools).__name__}", param="tools")
    for index, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise RequestError(f"tools[{index}] is not a function tool: {tool!r:.200}", param="tools")
        function = tool.get("function")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) or not function["name"]:
            raise RequestError(f"tools[{index}] has no function name: {tool!r:.200}", param="tools")
    return tuple(cast(ToolSpec, dict(tool)) for tool in tools)


# ---------------------------------------------------------------- agent messages -> transcript


def transcript_messages(messages: object) -> tuple[Message, ...]:
    """The agent's messages as rollflow ``Message`` dicts (a ``RequestError`` names a bad one).

    Content parts become one text; ``developer`` is a system message; assistant messages
    keep their structured calls; a tool result gets the ``name`` of the call it answers.
    Keys outside the chat-message shape (``refusal``, ``annotations``...) are dropped.
    """
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", param="messages")
    names_by_call: dict[str, str] = {}
    converted: list[Message] = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise RequestError(f"messages[{index}] is not an object", param="messages")
        role = message.get("role")
        role = "system" if role == "developer" else role
        if role not in ("system", "user", "assistant", "tool"):
            raise RequestError(f"messages[{index}] has role {role!r}: only system, user, assistant, tool", param="messages")
        out: dict[str, Any] = {"role": role, "content": _text_content(message.get("content"), index)}
        if role == "assistant" and message.get("tool_calls"):
            out["tool_calls"] = [_checked_call(call, index) for call in message["tool_calls"]]
            names_by_call.update({c["id"]: c["function"]["name"] for c in out["tool_calls"]})
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                raise RequestError(f"messages[{index}] (a tool result) has no tool_call_id", param="messages")
            out["tool_call_id"] = call_id
            name = message.get("name") or names_by_call.get(call_id)
            if isinstance(name, str):
                out["name"] = name
        converted.append(cast(Message, out))
    return tuple(converted)


def _text_content(content: object, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"messages[{index}] has a content part that is not text: {part!r:.100}", param="messages")
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(f"messages[{index}] content is a {type(content).__name__}, not text", param="messages")


def _checked_call(call: object, index: int) -> ToolCall:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(call, Mapping) or not isinstance(function, Mapping):
        raise RequestError(f"messages[{index}] has a malformed tool call: {call!r:.200}", param="messages")
    call_id, name, arguments = call.get("id"), function.get("name"), function.get("arguments", "{}")
    if not (isinstance(call_id, str) and isinstance(name, str) and isinstance(arguments, str)):
        raise RequestError(f"messages[{index}] has a tool call without a text id, name or arguments", param="messages")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def with_system_text(messages: Sequence[Message], text: str) -> list[Message]:
    """``text`` appended to a leading system message, or put in a new one (as the policy's
    codec does with the tool description); no text, no change."""
    if not text:
        return list(messages)
    if messages and messages[0].get("role") == "system":
        first = messages[0]
        joined = f"{first['content']}\n\n{text}" if first["content"] else text
        return [cast(Message, {**first, "content": joined}), *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


# ---------------------------------------------------------------- a sampled action -> the reply


@dataclass(frozen=True)
class Reply:
    """What one sampled action means, to the agent and to the transcript."""

    message: dict[str, Any]  # the OpenAI assistant message the agent receives
    finish_reason: str  # "stop", "length" or "tool_calls"
    transcript_message: Message  # the raw sampled text, with the same calls
    parse_error: str | None  # a malformed tool call: the protocol's reason


def reply_for(
    text: str, *, cut_by_length: bool, call_number: int, reads_tools: bool, tool_format: ToolFormat = ROLLFLOW
) -> Reply:
    """The reply for a sampled ``text``. With ``reads_tools`` (the call offered tools)
    ``tool_format`` reads it; ids are its ``call_id`` (rollflow's and most:
    ``call_<call number>_<index>``), unique in the episode."""
    parsed = tool_format.parse(text) if reads_tools else None
    finish = "length" if cut_by_length else "stop"
    if parsed is None or parsed.kind != "tool_calls":
        message: dict[str, Any] = {"role": "assistant", "content": text}
        error = parsed.error if parsed is not None else None
        return Reply(message, finish, {"role": "assistant", "content": text}, error)
    calls: list[ToolCall] = [
        {"id": tool_format.call_id(call_number, i), "type": "function", "function": dict(call["function"])}  # type: ignore[typeddict-item]
        for i, call in enumerate(parsed.tool_calls)
    ]
    message = {"role": "assistant", "content": parsed.content or None, "tool_calls": calls}
    transcript: Message = {"role": "assistant", "content": text, "tool_calls": [dict(c) for c in calls]}  # type: ignore[typeddict-item]
    return Reply(message, "tool_calls", transcript, None)


def for_template(raw_reply: Message, tool_format: ToolFormat) -> Message:
    """An echoed reply (its raw sampled text and calls) as a native template should see it:
    the raw text alone where the template prints content as it is (``echo`` "raw"), the
    structured calls where it must print them itself (``"structured"``, Mistral)."""
    if tool_format.echo == "structured" and raw_reply.get("tool_calls"):
        return raw_reply
    return {"role": "assistant", "content": raw_reply["content"]}


def reply_key(message: Mapping[str, Any]) -> tuple[str, tuple[tuple[str, str, str], ...]]:
    """What identifies an assistant message the agent sends back: its text and its calls
    (id, name, arguments as a JSON value), however the agent's SDK re-serialised them."""
    calls = message.get("tool_calls") or ()
    return (
        str(message.get("content") or ""),
        tuple((c["id"], c["function"]["name"], _canonical_json(c["function"]["arguments"])) for c in calls),
    )


def _canonical_json(text: str) -> str:
    try:
        return json.dumps(json.loads(text), sort_keys=True, ensure_ascii=False)
    except (ValueError, TypeError):
        return text
