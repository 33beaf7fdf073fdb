"""Run structured tool calls against ``Tool`` objects: the model's mistakes become messages,
the tool author's bugs raise.

A tool call the model got wrong is part of the episode, not a crash: the model reads
``tool_error: ...`` in the tool message and may try again. Four things the model can get
wrong, each named in that message: the tool does not exist, the arguments are not a JSON
object, they fail the tool's ``parameters_schema`` (checked with ``jsonschema``, the
validator class the schema itself declares, Draft 2020-12 by default), or the tool raises
on them (a calculator dividing by zero is the model's feedback).

A bug in the tool itself is not the model's to fix, and a ``tool_error`` message would
hide it as feedback (the model reads it, the episode goes on, nothing counts it). So a tool
that returns something other than a ``ToolResult`` (or a ``ToolResult`` whose ``content``
is not text), or whose ``parameters_schema`` is not a valid JSON Schema, raises
``BrokenToolError``: the environment's step fails, the episode ends with that error and its
traceback goes to the step's ``errors.jsonl`` like any other environment error
(``tasks/step_health.py``).

Calls run one after another, in the order given: tools may act on shared state (a shop,
a file system) and an episode must replay the same way every time.

``run_tool_calls`` also reports whether any tool asked to stop (``ToolResult.should_stop``);
``execute_tool_calls`` is the messages-only form most environments want. The tool calls and
tool errors of each episode are counted from its transcript (``count_tool_messages``: one
tool message a call, the errors by their ``tool_error: `` prefix), so they are counted
whichever environment style ran the tools.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jsonschema import Draft202012Validator, validators
from jsonschema.exceptions import SchemaError, best_match
from jsonschema.protocols import Validator

from rollflow.envs.type_names import qualified_name, type_mismatch
from rollflow.envs.types import Message, Tool, ToolCall, ToolResult

TOOL_ERROR_PREFIX = "tool_error: "


class BrokenToolError(Exception):
    """A tool broke its contract (its return value or its ``parameters_schema``): a bug in
    the tool, which fails the episode instead of becoming the model's feedback."""


@dataclass(frozen=True)
class ToolCallsOutcome:
    messages: tuple[Message, ...]  # one tool message per call, in call order
    stop_requested: bool  # some tool returned should_stop=True
    errors: int  # calls that became tool_error messages


async def execute_tool_calls(tools: Mapping[str, Tool], calls: Sequence[ToolCall]) -> list[Message]:
    """One ``{"role": "tool", ...}`` message per call; failures become ``tool_error: ...``."""
    outcome = await run_tool_calls(tools, calls)
    return list(outcome.messages)


async def run_tool_calls(tools: Mapping[str, Tool], calls: Sequence[ToolCall]) -> ToolCallsOutcome:
    """Like ``execute_tool_calls``, and also says whether a tool asked to end the episode."""
    messages: list[Message] = []
    stop_requested = False
    errors = 0
    for index, call in enumerate(calls):
        call_id, name, arguments = _call_fields(call, index)
        result = await _run_one(tools, name, arguments)
        if isinstance(result, str):
            errors += 1
            content = TOOL_ERROR_PREFIX + result
        else:
            content = result.content
            stop_requested = stop_requested or result.should_stop
        messages.append({"role": "tool", "content": content, "tool_call_id": call_id, "name": name})
    return ToolCallsOutcome(messages=tuple(messages), stop_requested=stop_requested, errors=errors)


def is_tool_error(message: Message) -> bool:
    content = message.get("content")
    return message.get("role") == "tool" and isinstance(content, str) and content.startswith(TOOL_ERROR_PREFIX)


def count_tool_messages(messages: Sequence[Message]) -> tuple[int, int]:
    """(tool calls, tool errors) of a transcript: its tool messages, and those that are
    ``tool_error`` replies (the model's mistakes; a tool's own bug ends the episode)."""
    tool = [m for m in messages if m.get("role") == "tool"]
    return len(tool), sum(is_tool_error(m) for m in tool)


async def _run_one(tools: Mapping[str, Tool], name: str, arguments: str) -> ToolResult | str:
    """The tool's result, or the text of what the model got wrong; ``BrokenToolError`` for
    a bug in the tool."""
    tool = tools.get(name)
    if tool is None:
        known = ", ".join(sorted(tools)) or "none"
        return f"unknown tool {name!r}; the tools are: {known}"
    problem = _argument_problem(tool, arguments)
    if problem is not None:
        return problem
    try:
        result = await tool.execute(arguments)
    except BrokenToolError:  # the tool itself broke (an MCP server died): the episode's error
        raise
    except Exception as exc:  # a raising tool is the model's feedback, not our crash
        return f"{name} failed: {type(exc).__name__}: {exc}"
    if not isinstance(result, ToolResult):
        raise BrokenToolError(
            f"tool {name!r} returned {type_mismatch(result, ToolResult)} (a bug in the tool, not in the model's call)"
        )
    if not isinstance(result.content, str):
        raise BrokenToolError(
            f"tool {name!r} returned a ToolResult whose content is {qualified_name(type(result.content))}, "
            "not str (a bug in the tool, not in the model's call)"
        )
    return result


def _argument_problem(tool: Tool, arguments: str) -> str | None:
    try:
        value: Any = json.loads(arguments)
    except (ValueError, TypeError, RecursionError) as exc:
        return f"arguments of {tool.name} are not valid JSON: {exc}"
    if not isinstance(value, dict):
        return f"arguments of {tool.name} must be a JSON object, got {type(value).__name__}"
    validator = _validator(json.dumps(tool.parameters_schema, sort_keys=True, default=repr))
    if isinstance(validator, str):
        raise BrokenToolError(
            f"tool {tool.name!r} has an invalid parameters_schema (a bug in the tool, not in the "
            f"model's call): {validator}"
        )
    error = best_match(validator.iter_errors(value))
    if error is None:
        return None
    where = "/".join(str(part) for part in error.absolute_path)
    location = f" at {where!r}" if where else ""
    return f"arguments of {tool.name} do not match its schema{location}: {error.message}"


@functools.lru_cache(maxsize=256)
def _validator(schema_json: str) -> Validator | str:
    """A validator for a schema (by its JSON text), or why the schema itself is invalid.

    Cached: checking a schema and building its validator costs far more than validating.
    """
    schema = json.loads(schema_json)
    validator_class = validators.validator_for(schema, default=Draft202012Validator)
    try:
        validator_class.check_schema(schema)
    except SchemaError as exc:
        return exc.message
    return validator_class(schema)


def _call_fields(call: ToolCall, index: int) -> tuple[str, str, str]:
    """(id, name, arguments) of a call, tolerating a malformed dict (it then fails by name)."""
    function = call.get("function") if isinstance(call, Mapping) else None
    function = function if isinstance(function, Mapping) else {}
    call_id = call.get("id") if isinstance(call, Mapping) else None
    name = function.get("name")
    arguments = function.get("arguments", "{}")
    return (
        call_id if isinstance(call_id, str) else f"call_{index}",
        name if isinstance(name, str) else "",
        arguments if isinstance(arguments, str) else json.dumps(arguments, default=repr),
    )
