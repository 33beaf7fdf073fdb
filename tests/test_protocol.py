"""The tool-call text protocol: the three outcomes, round trips, and a fuzzed parser."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollflow.envs.protocol import (
    CLOSE_TAG,
    OPEN_TAG,
    describe_tools,
    make_tool_call,
    parse_action,
    render_tool_calls,
)
from rollflow.envs.types import ToolSpec


def test_plain_reply_is_a_final_answer() -> None:
    parsed = parse_action("  The answer is 42.\n")
    assert parsed.kind == "final"
    assert parsed.content == "The answer is 42."
    assert parsed.tool_calls == ()
    assert parsed.error is None


def test_well_formed_calls_get_ids_in_order_and_json_arguments() -> None:
    text = (
        'Checking.\n<tool_call>{"name": "lookup", "arguments": {"key": "a"}}</tool_call>\n'
        '<tool_call>\n  {"name": "calculator", "arguments": {"expression": "1+2"}}\n</tool_call>'
    )
    parsed = parse_action(text)
    assert parsed.kind == "tool_calls"
    assert parsed.content == "Checking."
    assert [c["id"] for c in parsed.tool_calls] == ["call_0", "call_1"]
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["lookup", "calculator"]
    assert json.loads(parsed.tool_calls[1]["function"]["arguments"]) == {"expression": "1+2"}
    assert all(c["type"] == "function" for c in parsed.tool_calls)


def test_missing_arguments_mean_an_empty_object() -> None:
    parsed = parse_action('<tool_call>{"name": "list_fact_keys"}</tool_call>')
    assert parsed.kind == "tool_calls"
    assert parsed.tool_calls[0]["function"]["arguments"] == "{}"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('<tool_call>{"name": "x", "arguments": {}}', "never closed"),
        ('{"name": "x"}</tool_call>', "closes no"),
        ("<tool_call>{name: x}</tool_call>", "invalid JSON"),
        ("<tool_call></tool_call>", "invalid JSON"),
        ('<tool_call>["lookup"]</tool_call>', "expected a JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'missing "name"'),
        ('<tool_call>{"name": "  "}</tool_call>', 'missing "name"'),
        ('<tool_call>{"name": 3}</tool_call>', 'missing "name"'),
        ('<tool_call>{"name": "x", "arguments": "{}"}</tool_call>', '"arguments" must be an object'),
        ('<tool_call>{"name": "x", "arguments": [1]}</tool_call>', '"arguments" must be an object'),
        ('<tool_call>{"name": "x", "arguments": {"v": NaN}}</tool_call>', "invalid JSON"),
        ('<tool_call><tool_call>{"name": "x"}</tool_call>', "inside the block"),
        ('<tool_call>{"name": "a"}</tool_call> then </tool_call>', "closes no"),
        ('<tool_call>{"name": "a"}</tool_call><tool_call>{"name": ', "never closed"),
    ],
)
def test_malformed_calls_are_parse_failures_naming_the_problem(text: str, problem: str) -> None:
    parsed = parse_action(text)
    assert parsed.kind == "parse_failure"
    assert parsed.error is not None and problem in parsed.error
    assert parsed.tool_calls == ()


def test_second_bad_block_names_its_index() -> None:
    parsed = parse_action('<tool_call>{"name": "a"}</tool_call><tool_call>{}</tool_call>')
    assert parsed.error is not None and parsed.error.startswith("tool call 1:")


def test_to_message_keeps_the_raw_text_and_attaches_calls() -> None:
    raw = ' <tool_call>{"name": "lookup", "arguments": {"key": "a"}}</tool_call> '
    message = parse_action(raw).to_message(raw)
    assert message["role"] == "assistant"
    assert message["content"] == raw
    assert message["tool_calls"][0]["function"]["name"] == "lookup"
    final = parse_action("42").to_message("42")
    assert final == {"role": "assistant", "content": "42"}
    failed = parse_action("<tool_call>").to_message("<tool_call>")
    assert "tool_calls" not in failed


def test_to_message_does_not_share_call_dicts_with_the_parsed_action() -> None:
    parsed = parse_action('<tool_call>{"name": "a"}</tool_call>')
    message = parsed.to_message("x")
    message["tool_calls"][0]["function"]["name"] = "changed"
    assert parsed.tool_calls[0]["function"]["name"] == "a"


def test_render_refuses_arguments_that_are_not_an_object() -> None:
    call = make_tool_call("x", {})
    bad = {**call, "function": {"name": "x", "arguments": "[1, 2]"}}
    with pytest.raises(ValueError, match="must be a JSON object"):
        render_tool_calls([bad])  # type: ignore[list-item]
    not_json = {**call, "function": {"name": "x", "arguments": "{oops"}}
    with pytest.raises(ValueError, match="not JSON"):
        render_tool_calls([not_json])  # type: ignore[list-item]


def test_render_escapes_tags_inside_arguments() -> None:
    calls = [make_tool_call("echo", {"text": f"a {CLOSE_TAG} b {OPEN_TAG} c"})]
    text = render_tool_calls(calls)
    assert text.count(CLOSE_TAG) == 1
    assert parse_action(text).tool_calls == tuple(calls)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**6), 10**6)
    | st.text(max_size=12)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.text(min_size=1, max_size=20).filter(lambda s: s.strip() != ""),
            st.dictionaries(st.text(max_size=8), json_values, max_size=4),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_parse_inverts_render(specs: list[tuple[str, dict[str, object]]]) -> None:
    calls = [make_tool_call(name, args, index) for index, (name, args) in enumerate(specs)]
    parsed = parse_action(render_tool_calls(calls))
    assert parsed.kind == "tool_calls", parsed.error
    assert parsed.tool_calls == tuple(calls)


fragments = st.sampled_from(
    [
        OPEN_TAG,
        CLOSE_TAG,
        "{",
        "}",
        '"name"',
        '"arguments"',
        ":",
        ",",
        '"lookup"',
        "[",
        "]",
        "NaN",
        "1e400",
        " ",
        "\n",
        "<tool",
        "_call>",
        '"',
        "\\",
        "\x00",
        "é",
    ]
)


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.text(), st.lists(fragments | st.text(max_size=4), max_size=30).map("".join)))
def test_parser_never_raises_and_outcomes_are_consistent(text: str) -> None:
    parsed = parse_action(text)
    assert parsed.kind in ("final", "tool_calls", "parse_failure")
    assert (parsed.error is not None) == (parsed.kind == "parse_failure")
    assert bool(parsed.tool_calls) == (parsed.kind == "tool_calls")
    has_tag = OPEN_TAG in text or CLOSE_TAG in text
    assert (parsed.kind == "final") == (not has_tag)
    for call in parsed.tool_calls:
        assert isinstance(json.loads(call["function"]["arguments"]), dict)


def test_parser_survives_deep_nesting() -> None:
    text = OPEN_TAG + '{"name": "x", "arguments": ' + "[" * 100_000 + CLOSE_TAG
    assert parse_action(text).kind == "parse_failure"


def test_describe_tools_names_each_tool_its_schema_and_the_call_format() -> None:
    spec: ToolSpec = {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up a fact.",
            "parameters": {"type": "object", "properties": {"key": {"type": "string"}}},
        },
    }
    text = describe_tools([spec])
    assert "- lookup: Look up a fact." in text
    assert '"key": {"type": "string"}' in text
    assert OPEN_TAG in text and CLOSE_TAG in text
    assert "without any tool call" in text
    assert describe_tools([]) == ""
    with pytest.raises(ValueError, match="tool spec 0"):
        describe_tools([{"name": "lookup"}])  # type: ignore[list-item]


def _function(name: str, properties: dict, required: list[str] | None = None) -> ToolSpec:
    parameters: dict = {"type": "object", "properties": properties}
    if required is not None:
        parameters["required"] = required
    return {"type": "function", "function": {"name": name, "description": "d", "parameters": parameters}}


def test_the_example_call_is_a_call_of_a_real_tool_not_a_placeholder() -> None:
    """A 135M model copies the example; a placeholder name is an unknown tool every time."""
    convert = _function(
        "conversion_factor",
        {"from_unit": {"type": "string"}, "to_unit": {"type": "string"}, "digits": {"type": "integer"}},
        required=["from_unit", "to_unit"],
    )
    multiply = _function("multiply", {"a": {"type": "number"}, "b": {"type": "number"}})
    text = describe_tools([convert, multiply])
    assert "TOOL_NAME" not in text and "ARGUMENT" not in text
    examples = [line for line in text.splitlines() if line.startswith(OPEN_TAG)]
    assert len(examples) == 1
    parsed = parse_action(examples[0])
    assert parsed.kind == "tool_calls"
    (call,) = parsed.tool_calls
    assert call["function"]["name"] == "conversion_factor"
    assert json.loads(call["function"]["arguments"]) == {"from_unit": "...", "to_unit": "..."}  # the required ones


def test_the_example_arguments_have_the_schema_types() -> None:
    spec = _function("pick", {
        "n": {"type": "integer"}, "x": {"type": ["null", "number"]}, "flag": {"type": "boolean"},
        "color": {"type": "string", "enum": ["red", "blue"]}, "items": {"type": "array"}, "any": {},
    })
    text = describe_tools([spec])
    (example,) = [line for line in text.splitlines() if line.startswith(OPEN_TAG)]
    (call,) = parse_action(example).tool_calls
    assert json.loads(call["function"]["arguments"]) == {
        "n": 1, "x": 1, "flag": True, "color": "red", "items": [], "any": "...",
    }
    no_arguments = describe_tools([{"type": "function", "function": {"name": "ping"}}])
    assert f'{OPEN_TAG}{{"name": "ping", "arguments": {{}}}}{CLOSE_TAG}' in no_arguments
