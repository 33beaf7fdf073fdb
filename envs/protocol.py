"""The one tool-call text protocol: assistant text <-> structured message with tool calls.

A model we train is an open model, not a tool-use API, so it calls tools by writing
blocks into its reply::

    Let me look that up.
    <tool_call>{"name": "lookup", "arguments": {"key": "crates_at_north_depot"}}</tool_call>

``parse_action`` tells three outcomes apart and never raises, whatever the text:

- ``final``: no tool-call tag anywhere; the reply is the model's answer.
- ``tool_calls``: every block is well formed; each becomes an OpenAI-style ``ToolCall``
  with ids ``call_0``, ``call_1``... in order of appearance (ids only need to be unique
  within one message: each tool result names the call it answers).
- ``parse_failure``: a tag is there but something is wrong (an unclosed or stray tag, a
  block opened inside another, invalid JSON, not an object, a missing or empty ``name``,
  ``arguments`` not an object). The first problem found is named in ``error``.

Simplifications, on purpose:
- Keys other than ``name`` and ``arguments`` in a block are ignored, as common tool-call
  parsers do; a missing ``arguments`` means ``{}`` (tools without parameters).
- The JSON must be strict: ``NaN``/``Infinity`` are refused, so ``arguments`` always
  re-serializes as valid JSON for the tool.
- One text format only (Hermes/Qwen style). A model whose chat template has its own
  tool-call syntax is still asked, through ``describe_tools``, to use this one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rollflow.envs.types import Message, ToolCall, ToolSpec

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"

ActionKind = Literal["final", "tool_calls", "parse_failure"]


@dataclass(frozen=True)
class ParsedAction:
    """What one assistant action means under the protocol.

    ``content`` is the text outside the tool-call blocks, stripped (for ``final``: the
    whole reply, stripped). ``error`` is set exactly when ``kind`` is ``parse_failure``.
    """

    kind: ActionKind
    content: str
    tool_calls: tuple[ToolCall, ...]
    error: str | None

    def to_message(self, raw_text: str) -> Message:
        """The assistant message for the transcript.

        Its content is the raw sampled text, so a chat template re-renders exactly what
        was sampled; the structured calls ride along in ``tool_calls``.
        """
        message: Message = {"role": "assistant", "content": raw_text}
        if self.tool_calls:
            message["tool_calls"] = [_copy_call(call) for call in self.tool_calls]
        return message


class _BlockError(Exception):
    """A malformed tool-call block; internal to the parser, never escapes it."""


def parse_action(text: str) -> ParsedAction:
    """Parse an assistant reply under the tool-call protocol. Never raises."""
    if not isinstance(text, str):
        return _failure(f"the action is a {type(text).__name__}, not text")
    if OPEN_TAG not in text and CLOSE_TAG not in text:
        return ParsedAction(kind="final", content=text.strip(), tool_calls=(), error=None)
    calls: list[ToolCall] = []
    outside: list[str] = []
    position = 0
    while True:
        opened = text.find(OPEN_TAG, position)
        closed = text.find(CLOSE_TAG, position)
        if opened == -1 or (closed != -1 and closed < opened):
            if closed != -1:
                return _failure(f"a {CLOSE_TAG} at character {closed} closes no {OPEN_TAG}")
            outside.append(text[position:])
            break
        outside.append(text[position:opened])
        body_start = opened + len(OPEN_TAG)
        body_end = text.find(CLOSE_TAG, body_start)
        if body_end == -1:
            return _failure(f"the {OPEN_TAG} at character {opened} is never closed")
        body = text[body_start:body_end]
        if OPEN_TAG in body:
            return _failure(f"a {OPEN_TAG} is opened inside the block at character {opened}")
        try:
            calls.append(_parse_block(body, index=len(calls)))
        except _BlockError as exc:
            return _failure(f"tool call {len(calls)}: {exc}")
        position = body_end + len(CLOSE_TAG)
    return ParsedAction(
        kind="tool_calls", content="".join(outside).strip(), tool_calls=tuple(calls), error=None
    )


def render_tool_calls(calls: Sequence[ToolCall]) -> str:
    """Structured calls -> protocol text, one block per line; ``parse_action`` inverts it.

    Raises ``ValueError`` when a call's ``arguments`` is not a JSON object.
    """
    blocks = []
    for index, call in enumerate(calls):
        name = call["function"]["name"]
        try:
            arguments = _strict_json(call["function"]["arguments"])
        except ValueError as exc:
            raise ValueError(f"tool call {index} ({name!r}): arguments are not JSON: {exc}") from exc
        if not isinstance(arguments, dict):
            raise ValueError(
                f"tool call {index} ({name!r}): arguments must be a JSON object, "
                f"got {type(arguments).__name__}"
            )
        body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        blocks.append(f"{OPEN_TAG}{_escape_tags(body)}{CLOSE_TAG}")
    return "\n".join(blocks)


def make_tool_call(name: str, arguments: dict[str, Any], index: int = 0) -> ToolCall:
    """A structured call with the protocol's deterministic id (``call_<index>``)."""
    return {
        "id": f"call_{index}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def describe_tools(tool_specs: Sequence[ToolSpec]) -> str:
    """The one text that tells a model which tools exist and how to call them.

    The policy's chat codec puts it in the system prompt for every chat template, and never
    passes ``tools=`` to the template: a tool-aware template (Qwen, Llama 3.1, Mistral)
    would ask for its own call syntax, which ``parse_action`` does not read. No tools gives
    the empty string: there is nothing to describe.

    The example call is a call of the first tool (``example_call``), not a placeholder: a
    small model copies the example, and a placeholder name (``TOOL_NAME``) it copies is an
    ``unknown tool`` error every time, where a real name at least reaches a tool.
    Raises ``ValueError`` for a spec that is not an OpenAI-style function spec.
    """
    if not tool_specs:
        return ""
    lines = [
        "You can call tools. Each tool is listed with what it does and the JSON schema of its arguments:",
        "",
    ]
    functions = [_spec_function(spec, index) for index, spec in enumerate(tool_specs)]
    for function in functions:
        lines.append(f"- {function['name']}: {function.get('description', '').strip()}")
        schema = json.dumps(function.get("parameters", {}), ensure_ascii=False, sort_keys=True)
        lines.append(f"  arguments schema: {schema}")
    lines += [
        "",
        f"To call a tool, write exactly one block per call; a call of {functions[0]['name']} looks like this:",
        example_call(functions[0]),
        "You may write several blocks in one reply. The results come back in the next "
        "messages. When you are done, reply without any tool call: that reply is your "
        "final answer.",
    ]
    return "\n".join(lines)


def example_call(function: dict[str, Any]) -> str:
    """A protocol block calling ``function`` (an OpenAI ``function`` object): its real name
    and its arguments (the required ones, else all) with a value of each one's type."""
    parameters = function.get("parameters")
    parameters = parameters if isinstance(parameters, dict) else {}
    properties = parameters.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    required = parameters.get("required")
    names = [name for name in required if name in properties] if isinstance(required, list) else []
    arguments = {name: _example_value(properties[name]) for name in names or properties}
    body = json.dumps({"name": function["name"], "arguments": arguments}, ensure_ascii=False)
    return f"{OPEN_TAG}{_escape_tags(body)}{CLOSE_TAG}"


_EXAMPLE_VALUES: dict[str, Any] = {"string": "...", "integer": 1, "number": 1, "boolean": True, "array": [], "object": {}}


def _example_value(schema: Any) -> Any:
    """A value a property's schema accepts, for the example: its first enum value or
    example when it has one, else one of its type ("..." for text or an unknown type)."""
    if not isinstance(schema, dict):
        return "..."
    for key in ("enum", "examples"):
        values = schema.get(key)
        if isinstance(values, list) and values:
            return values[0]
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    return _EXAMPLE_VALUES.get(kind, "...") if isinstance(kind, str) else "..."


# ---------------------------------------------------------------- internals


def _failure(error: str) -> ParsedAction:
    return ParsedAction(kind="parse_failure", content="", tool_calls=(), error=error)


def _parse_block(body: str, index: int) -> ToolCall:
    try:
        payload = _strict_json(body.strip())
    except ValueError as exc:
        raise _BlockError(f"invalid JSON ({exc})") from exc
    if not isinstance(payload, dict):
        raise _BlockError(f"expected a JSON object, got {type(payload).__name__}")
    name = payload.get("name")
    if not isinstance(name, str) or not name.strip():
        raise _BlockError('missing "name" (a non-empty string)')
    arguments = payload.get("arguments", {})
    if not isinstance(arguments, dict):
        raise _BlockError(f'"arguments" must be an object, got {type(arguments).__name__}')
    return make_tool_call(name, arguments, index)


def _strict_json(text: str) -> Any:
    """``json.loads`` that refuses NaN/Infinity and reports every failure as ValueError."""

    def refuse_constant(constant: str) -> Any:
        raise ValueError(f"{constant} is not valid JSON")

    try:
        return json.loads(text, parse_constant=refuse_constant)
    except (ValueError, TypeError, RecursionError) as exc:
        raise ValueError(str(exc) or type(exc).__name__) from exc


def _escape_tags(json_text: str) -> str:
    """Escape tags inside JSON strings so a rendered block never closes early.

    In ``json.dumps`` output a ``<`` only occurs inside string literals and is never part
    of an escape sequence, so ``\\u003c`` in its place decodes to the same string.
    """
    for tag in (CLOSE_TAG, OPEN_TAG):
        json_text = json_text.replace(tag, "\\u003c" + tag[1:])
    return json_text


def _spec_function(spec: ToolSpec, index: int) -> dict[str, Any]:
    function = spec.get("function") if isinstance(spec, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(
            f"tool spec {index} is not an OpenAI-style function spec "
            '({"type": "function", "function": {"name": ..., ...}}): ' + repr(spec)[:200]
        )
    return dict(function)


def _copy_call(call: ToolCall) -> ToolCall:
    return {
        "id": call["id"],
        "type": "function",
        "function": {"name": call["function"]["name"], "arguments": call["function"]["arguments"]},
    }
