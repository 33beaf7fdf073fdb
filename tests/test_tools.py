"""Tool execution: results in call order, every mistake of the model a readable tool_error
message, and a bug in the tool itself an exception (``BrokenToolError``)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from rollflow.envs.protocol import make_tool_call
from rollflow.envs.tools import BrokenToolError, count_tool_messages, execute_tool_calls, is_tool_error, run_tool_calls
from rollflow.envs.types import Tool, ToolCall, ToolResult


class AddTool:
    name = "add"
    description = "Add two integers."
    parameters_schema: dict[str, Any] = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def execute(self, arguments: str) -> ToolResult:
        self.calls.append(arguments)
        values = json.loads(arguments)
        return ToolResult(content=str(values["a"] + values["b"]))


class StopTool:
    name = "finish"
    description = "End the episode."
    parameters_schema: dict[str, Any] = {"type": "object", "properties": {}}

    async def execute(self, arguments: str) -> ToolResult:
        return ToolResult(content="bye", should_stop=True)


class RaisingTool:
    name = "explode"
    description = "Always raises."
    parameters_schema: dict[str, Any] = {"type": "object"}

    async def execute(self, arguments: str) -> ToolResult:
        raise KeyError("no such thing")


class BadSchemaTool(RaisingTool):
    name = "bad_schema"
    parameters_schema: dict[str, Any] = {"type": "no-such-type"}


class WrongReturnTool(RaisingTool):
    name = "wrong_return"

    async def execute(self, arguments: str) -> ToolResult:
        return "plain text"  # type: ignore[return-value]


def _tools(*tools: Tool) -> dict[str, Tool]:
    return {tool.name: tool for tool in tools}


def _raw_call(name: str, arguments: str, call_id: str = "call_0") -> ToolCall:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _contents(tools: dict[str, Tool], calls: list[ToolCall]) -> list[str]:
    return [m["content"] for m in asyncio.run(execute_tool_calls(tools, calls))]


def test_results_come_back_in_order_with_ids_and_names() -> None:
    add = AddTool()
    calls = [make_tool_call("add", {"a": 1, "b": 2}, 0), make_tool_call("add", {"a": 5, "b": 5}, 1)]
    messages = asyncio.run(execute_tool_calls(_tools(add), calls))
    assert messages == [
        {"role": "tool", "content": "3", "tool_call_id": "call_0", "name": "add"},
        {"role": "tool", "content": "10", "tool_call_id": "call_1", "name": "add"},
    ]
    assert add.calls == ['{"a": 1, "b": 2}', '{"a": 5, "b": 5}']


def test_unknown_tool_lists_the_known_ones() -> None:
    [content] = _contents(_tools(AddTool()), [make_tool_call("mul", {})])
    assert content == "tool_error: unknown tool 'mul'; the tools are: add"


def test_arguments_that_are_not_json_or_not_an_object() -> None:
    tools = _tools(AddTool())
    [not_json] = _contents(tools, [_raw_call("add", "{a: 1")])
    [not_object] = _contents(tools, [_raw_call("add", "[1, 2]")])
    assert not_json.startswith("tool_error: arguments of add are not valid JSON")
    assert not_object == "tool_error: arguments of add must be a JSON object, got list"


def test_schema_violations_name_the_field_and_the_tool_never_runs() -> None:
    add = AddTool()
    [missing] = _contents(_tools(add), [make_tool_call("add", {"a": 1})])
    [wrong_type] = _contents(_tools(add), [make_tool_call("add", {"a": 1, "b": "2"})])
    assert missing == "tool_error: arguments of add do not match its schema: 'b' is a required property"
    assert wrong_type.startswith("tool_error: arguments of add do not match its schema at 'b':")
    assert add.calls == []


def test_a_raising_tool_is_the_models_feedback() -> None:
    [raised] = _contents(_tools(RaisingTool()), [make_tool_call("explode", {})])
    assert raised == "tool_error: explode failed: KeyError: 'no such thing'"


class DictReturnTool(RaisingTool):
    name = "dict_return"

    async def execute(self, arguments: str) -> ToolResult:
        return {"length": 3}  # type: ignore[return-value]


class DictContentTool(RaisingTool):
    name = "dict_content"

    async def execute(self, arguments: str) -> ToolResult:
        return ToolResult(content={"length": 3})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("tool", "message"),
    [
        (WrongReturnTool(), "tool 'wrong_return' returned str, not rollflow.envs.types.ToolResult"),
        (DictReturnTool(), "tool 'dict_return' returned dict, not rollflow.envs.types.ToolResult"),
        (DictContentTool(), "tool 'dict_content' returned a ToolResult whose content is dict, not str (a bug"),
        (BadSchemaTool(), "tool 'bad_schema' has an invalid parameters_schema (a bug in the tool, not in the model's"),
    ],
)
def test_a_broken_tool_raises_instead_of_feeding_its_bug_to_the_model(tool: Tool, message: str) -> None:
    """An author's bug fails the episode (the loop records it with its traceback); a
    ``tool_error`` message would hide it as the model's feedback."""
    with pytest.raises(BrokenToolError) as raised:
        asyncio.run(run_tool_calls(_tools(AddTool(), tool), [make_tool_call(tool.name, {})]))
    assert str(raised.value).startswith(message)
    assert "(a bug in the tool, not in the model's call)" in str(raised.value)


def test_a_tool_result_class_of_another_module_is_named_with_its_module() -> None:
    """A second ``ToolResult`` class (a module imported under two names) is told apart."""
    other = type("ToolResult", (), {"__module__": "envs.types"})

    class Twin(RaisingTool):
        name = "twin"

        async def execute(self, arguments: str) -> ToolResult:
            return other()  # type: ignore[return-value]

    with pytest.raises(BrokenToolError, match=r"returned envs\.types\.ToolResult, not rollflow\.envs\.types\.ToolResult"):
        asyncio.run(run_tool_calls(_tools(Twin()), [make_tool_call("twin", {})]))


def test_tool_messages_and_tool_errors_are_counted_from_the_transcript() -> None:
    calls = [make_tool_call("nope", {}, 0), make_tool_call("add", {"a": 1, "b": 2}, 1), _raw_call("add", "[1]", "call_2")]
    replies = asyncio.run(execute_tool_calls(_tools(AddTool()), calls))
    transcript = [{"role": "user", "content": "tool_error: a user's words"}, {"role": "assistant", "content": "x"}, *replies]
    assert count_tool_messages(transcript) == (3, 2)
    assert count_tool_messages([]) == (0, 0)


def test_a_malformed_call_dict_fails_by_name_without_raising() -> None:
    messages = asyncio.run(execute_tool_calls(_tools(AddTool()), [{"oops": 1}]))  # type: ignore[list-item]
    assert messages[0]["tool_call_id"] == "call_0"
    assert is_tool_error(messages[0])


def test_outcome_counts_errors_and_reports_a_stop_request() -> None:
    tools = _tools(AddTool(), StopTool())
    outcome = asyncio.run(
        run_tool_calls(tools, [make_tool_call("nope", {}, 0), make_tool_call("finish", {}, 1)])
    )
    assert outcome.errors == 1
    assert outcome.stop_requested
    assert [m["content"] for m in outcome.messages][1] == "bye"
    calm = asyncio.run(run_tool_calls(tools, [make_tool_call("add", {"a": 0, "b": 0})]))
    assert not calm.stop_requested and calm.errors == 0
