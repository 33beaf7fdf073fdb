"""Run structured tool calls against ``Tool`` objects; every failure is a message, never a raise.

A tool call the model got wrong is part of the episode, not a crash: the model reads
``tool_error: ...`` in the tool message and may try again. Four things can go wrong, each
named in that message: the tool does not exist, the arguments are not a JSON object, they
fail the tool's ``parameters_schema`` (checked with ``jsonschema``, the validator class
the schema itself declares, Draft 2020-12 by default), or the tool raises.

Calls run one after another, in the order given: tools may act on shared state (a shop,
a file system) and an episode must replay the same way every time.

``run_tool_calls`` also reports whether any tool asked to stop (``ToolResult.should_stop``);
``execute_tool_calls`` is the messages-only form most environments want.
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

from rollflow.envs.types import Message, Tool, ToolCall, ToolResult

TOOL_ERROR_PREFIX = "tool_error: "


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
    return message.get("role") == "tool" and message.get("content", "").startswith(TOOL_ERROR_PREFIX)


async def _run_one(tools: Mapping[str, Tool], name: str, arguments: str) -> ToolResult | str:
    """The tool's result, or the text of what went wrong."""
    tool = tools.get(name)
    if tool is None:
        known = ", ".join(sorted(tools)) or "none"
        return f"unknown tool {name!r}; the tools are: {known}"
    problem = _argument_problem(tool, arguments)
    if problem is not None:
        return problem
    try:
        result = await tool.execute(arguments)
    except Exception as exc:  # a raising tool is the model's feedback, not our crash
        return f"{name} failed: {type(exc).__name__}: {exc}"
    if not isinstance(result, ToolResult):
        return f"{name} returned {type(result).__name__}, not a ToolResult (a bug in the tool)"
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
        return f"{tool.name} has an invalid parameters_schema (a bug in the tool): {validator}"
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
