"""Tool-call formats of model families, checked against their real chat templates.

The templates in ``tests/templates/`` (Qwen2.5-Instruct, Qwen3, Llama-3.1-Instruct,
Mistral-Nemo-Instruct-2407) are set on the real SmolLM2 tokenizer, as in
``test_codec_tool_templates.py``: their special tokens are plain text to it, which changes
how a prompt is tokenized but not what it says. SmolLM2's own template ignores tools.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from rollflow.envs.openai_agent_messages import for_template, reply_for
from rollflow.envs.protocol import describe_tools, make_tool_call
from rollflow.envs.tool_formats import (
    FORMATS,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    ROLLFLOW,
    ToolFormat,
    chat_template_of,
    chosen_tool_format,
    detect_tool_format,
)
from rollflow.envs.types import Message, ToolCall, ToolSpec
from rollflow.envs.tool_formats import template_tools
from rollflow.policy.codec import ChatCodec, ChatTemplateError
from rollflow.policy.models import ModelRef, load_tokenizer

TEMPLATES_DIR = Path(__file__).parent / "templates"
FAMILY = {
    "qwen2.5-instruct": HERMES,
    "qwen3": HERMES,
    "llama-3.1-instruct": LLAMA3_JSON,
    "mistral-nemo-instruct-2407": MISTRAL,
}
LOOKUP: ToolSpec = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look up a fact by key.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}},
    },
}
NESTED = {"query": {"where": {"city": "Zürich", "tags": ["café", "日本"]}, "limit": 3},
          "note": 'a "quoted" \\ path'}  # fmt: skip


def call(name: str, arguments: dict[str, Any], tool_format: ToolFormat, index: int = 0) -> ToolCall:
    made = make_tool_call(name, arguments, index)
    made["id"] = tool_format.call_id(0, index) if tool_format is MISTRAL else f"call_{index}"
    return made


def read(calls: Any) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.fixture(scope="module")
def smol() -> PreTrainedTokenizerBase:
    return load_tokenizer(ModelRef())


@pytest.fixture(scope="module", params=sorted(FAMILY))
def template(request: pytest.FixtureRequest, smol: PreTrainedTokenizerBase) -> tuple[str, ChatCodec]:
    tokenizer = load_tokenizer(ModelRef())
    tokenizer.chat_template = (TEMPLATES_DIR / f"{request.param}.jinja").read_text()
    return request.param, ChatCodec(tokenizer)


# ---------------------------------------------------------------- detection


def test_each_real_template_is_detected_as_its_family(
    template: tuple[str, ChatCodec], smol: PreTrainedTokenizerBase
) -> None:
    name, codec = template
    assert detect_tool_format(codec.tokenizer.chat_template) is FAMILY[name]
    for policy in (SimpleNamespace(codec=codec), SimpleNamespace(inner=SimpleNamespace(codec=codec))):
        assert chosen_tool_format("auto", chat_template_of(policy)) is FAMILY[name]  # a policy, or a wrapped one
    assert detect_tool_format(smol.chat_template) is ROLLFLOW  # SmolLM2's template ignores tools=


def test_the_choice_is_checked_against_the_template(smol: PreTrainedTokenizerBase) -> None:
    assert chosen_tool_format("auto", None) is ROLLFLOW  # a served model: its template is unknown here
    assert chosen_tool_format("mistral", None) is MISTRAL
    assert chosen_tool_format("rollflow", (TEMPLATES_DIR / "qwen3.jinja").read_text()) is ROLLFLOW
    with pytest.raises(ValueError, match="tool_format='hermes' .*never reads 'tools'"):
        chosen_tool_format("hermes", smol.chat_template)
    with pytest.raises(ValueError, match="'xml' is not one of auto, mistral, hermes, llama3_json, rollflow"):
        chosen_tool_format("xml", None)
    named = {"default": smol.chat_template, "tool_use": (TEMPLATES_DIR / "qwen2.5-instruct.jinja").read_text()}
    assert detect_tool_format(named) is HERMES  # transformers renders tools with "tool_use"
    later_mistral = (TEMPLATES_DIR / "mistral-nemo-instruct-2407.jinja").read_text().replace(
        '{{- "[TOOL_CALLS][" }}', '{{- "[TOOL_CALLS]" + tool_call.function.name + "[ARGS]" }}')  # fmt: skip
    assert detect_tool_format(later_mistral) is ROLLFLOW  # the name[ARGS] form is not read
    assert [f.vllm_parser for f in FORMATS.values()] == ["mistral", "hermes", "llama3_json", None]


# ---------------------------------------------------------------- render = what the template prints


def test_render_is_what_the_template_prints_for_an_assistant_turn(template: tuple[str, ChatCodec]) -> None:
    """A turn's structured call, re-printed by the template, is the family's ``render``; and
    the family's parser reads it back."""
    name, codec = template
    fmt = FAMILY[name]
    made = call("lookup", NESTED, fmt)
    history: list[Message] = [
        {"role": "user", "content": "Where?"},
        {"role": "assistant", "content": "", "tool_calls": [made]},
        {"role": "tool", "content": "17", "tool_call_id": made["id"]},
    ]
    rendered = codec.render_text(history, template_tools([LOOKUP]))
    printed = fmt.render("", [made])
    assert rendered.count(printed) == 1, rendered
    parsed = fmt.parse(printed)
    assert parsed.kind == "tool_calls" and read(parsed.tool_calls) == [("lookup", NESTED)]


@pytest.mark.parametrize("name", ["qwen2.5-instruct", "qwen3"])
def test_hermes_prints_content_and_every_call_as_qwen_does(name: str) -> None:
    """Qwen's templates print a turn's content and all its calls (Llama's and Mistral's print
    only the calls, Llama's only one)."""
    tokenizer = load_tokenizer(ModelRef())
    tokenizer.chat_template = (TEMPLATES_DIR / f"{name}.jinja").read_text()
    codec = ChatCodec(tokenizer)
    calls = [call("lookup", {"key": "depot"}, HERMES), call("lookup", NESTED, HERMES, index=1)]
    history: list[Message] = [
        {"role": "user", "content": "Where?"},
        {"role": "assistant", "content": "Checking both.", "tool_calls": calls},
        {"role": "tool", "content": "17", "tool_call_id": "call_0"},
    ]
    rendered = codec.render_text(history, template_tools([LOOKUP]))
    assert "<|im_start|>assistant\n" + HERMES.render("Checking both.", calls) + "<|im_end|>" in rendered


# ---------------------------------------------------------------- round trips and failures


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON, MISTRAL, ROLLFLOW], ids=lambda f: f.name)
def test_parse_inverts_render(fmt: ToolFormat) -> None:
    calls = [call("lookup", {"key": "depot"}, fmt), call("search", NESTED, fmt, 1), call("now", {}, fmt, 2)]
    for content in ("", "Let me check.") if fmt in (HERMES, ROLLFLOW) else ("",):
        parsed = fmt.parse(fmt.render(content, calls))
        assert (parsed.kind, parsed.content, parsed.error) == ("tool_calls", content, None)
        assert list(parsed.tool_calls) == calls  # names, arguments (as text) and ids alike
    final = fmt.parse("  The depot holds 17 crates.\n")
    assert (final.kind, final.content) == ("final", "The depot holds 17 crates.")


@pytest.mark.parametrize(
    ("fmt", "text", "error"),
    [
        (HERMES, '<tool_call>\n{"name": "lookup", "arguments": {"key": }\n</tool_call>', "invalid JSON"),
        (HERMES, '<tool_call>\n{"name": "lookup"}\n', "never closed"),
        (HERMES, '<tool_call>\n{"arguments": {}}\n</tool_call>', 'missing "name"'),
        (LLAMA3_JSON, '{"name": "lookup", "parameters": {"key": "depot"}', "invalid JSON"),
        (LLAMA3_JSON, '{"name": "lookup", "parameters": "depot"}', '"parameters" must be an object'),
        (LLAMA3_JSON, '{"name": "lookup", "parameters": {}} and then some', "text after tool call 0"),
        (LLAMA3_JSON, '{"answer": 17}', 'missing "name"'),
        (LLAMA3_JSON, '{"name": "lookup", "parameters": {"x": NaN}}', "NaN is not valid JSON"),
        (MISTRAL, '[TOOL_CALLS][{"name": "lookup", "arguments": {"key": "depot"}}', "not JSON"),
        (MISTRAL, "[TOOL_CALLS][]", "non-empty JSON list"),
        (MISTRAL, '[TOOL_CALLS][{"name": "lookup", "arguments": {}, "id": "call_0"}]', "9 letters or digits"),
        (MISTRAL, '[TOOL_CALLS][{"name": "lookup", "arguments": {}}] trailing', "text after the [TOOL_CALLS] list"),
    ],
)
def test_a_malformed_call_is_a_parse_failure_returned_as_text(fmt: ToolFormat, text: str, error: str) -> None:
    parsed = fmt.parse(text)
    assert parsed.kind == "parse_failure" and error in (parsed.error or ""), parsed
    reply = reply_for(text, cut_by_length=False, call_number=0, reads_tools=True, tool_format=fmt)
    assert reply.message == {"role": "assistant", "content": text} and reply.finish_reason == "stop"
    assert reply.parse_error == parsed.error


def test_the_other_families_forms_are_accepted_as_their_parsers_do() -> None:
    """Mistral v0.3 writes a space after [TOOL_CALLS]; Llama may open with <|python_tag|> and
    say "arguments"; several Llama calls are joined by ';'."""
    spaced = MISTRAL.parse('Sure. [TOOL_CALLS] [{"name": "lookup", "arguments": {"key": "depot"}}]')
    assert (spaced.content, read(spaced.tool_calls)) == ("Sure.", [("lookup", {"key": "depot"})])
    assert spaced.tool_calls[0]["id"] == "call00000"
    tagged = LLAMA3_JSON.parse('<|python_tag|>{"name": "a", "arguments": {"x": 1}};{"name": "b", "parameters": {}}')
    assert read(tagged.tool_calls) == [("a", {"x": 1}), ("b", {})]


def test_replies_carry_each_familys_ids() -> None:
    text = MISTRAL.render("", [call("lookup", {"key": "depot"}, MISTRAL)])
    reply = reply_for(text, cut_by_length=False, call_number=7, reads_tools=True, tool_format=MISTRAL)
    assert [c["id"] for c in reply.message["tool_calls"]] == ["call00700"]  # 9 letters or digits
    assert reply.finish_reason == "tool_calls" and reply.message["content"] is None
    hermes = reply_for(HERMES.render("", [call("lookup", {}, HERMES)]), cut_by_length=False, call_number=7,
                       reads_tools=True, tool_format=HERMES)  # fmt: skip
    assert [c["id"] for c in hermes.message["tool_calls"]] == ["call_7_0"]


# ---------------------------------------------------------------- token exactness through the codec


def sampled_ids(codec: ChatCodec, name: str, text: str) -> list[int]:
    """``text`` as sampled ids: ending on the stop token where the template's end of turn is
    SmolLM2's ``<|im_end|>`` (Qwen; Mistral's ``eos_token``), length-cut for Llama, whose
    ``<|eot_id|>`` is no token of this vocabulary (its end of turn is then context)."""
    stop = [] if name.startswith("llama") else [codec.tokenizer.eos_token_id]
    return codec.encode(text) + stop


def written_by_the_model(fmt: ToolFormat, made: ToolCall) -> str:
    """A call as the model writes it: the template's form, but without an id (Mistral's
    models write none; the endpoint gives one)."""
    if fmt is not MISTRAL:
        return fmt.render("", [made])
    arguments = json.loads(made["function"]["arguments"])
    return f"[TOOL_CALLS][{json.dumps({'name': 'lookup', 'arguments': arguments}, ensure_ascii=False)}]"


def test_an_agent_loop_is_one_sample_where_the_template_allows(template: tuple[str, ChatCodec]) -> None:
    """user -> assistant call -> tool result -> assistant answer, echoed as the endpoint does
    (``for_template``): Qwen's and Llama's templates re-render the sampled text, so the
    prompt of each call extends the last one's prompt and action (no reset). Mistral's adds
    the call's ``"id"``, which the model did not write: that call starts a new sample."""
    name, codec = template
    fmt = FAMILY[name]
    tools = template_tools([LOOKUP])
    made = call("lookup", {"key": "Zürich depot"}, fmt)
    messages: list[Message] = [{"role": "user", "content": "How many crates at the Zürich depot?"}]
    state, delta, reset = codec.next_prompt(None, messages, tools)
    sequence = list(delta)
    assert "lookup" in state.text and describe_tools([LOOKUP]) not in state.text
    resets = []
    for text, result in ((written_by_the_model(fmt, made), "17"), ("There are 17 crates.", None)):
        action = sampled_ids(codec, name, text)
        state = codec.record_action(state, action)
        reply = reply_for(codec.action_text(action), cut_by_length=False, call_number=0,
                          reads_tools=True, tool_format=fmt)  # fmt: skip
        messages.append(for_template(reply.transcript_message, fmt))
        if result is not None:
            ((given,),) = [reply.message["tool_calls"]]
            messages.append({"role": "tool", "content": result, "tool_call_id": given["id"]})
        else:
            messages.append({"role": "user", "content": "Thanks."})
        state, delta, reset = codec.next_prompt(state, messages, tools)
        resets.append(reset)
        sequence = list(delta) if reset else sequence + action + list(delta)
        assert list(state.token_ids) == sequence
    if fmt is MISTRAL:  # the id after the call; then tools move before the newest user turn
        assert resets == [True, True]
    else:
        assert resets == [False, False]


def test_qwen3_strips_earlier_thinking_so_a_new_user_turn_resets() -> None:
    """Qwen3's template drops the <think> block of turns before the newest user message:
    the history no longer spells what was sampled, and a new sample starts (counted)."""
    tokenizer = load_tokenizer(ModelRef())
    tokenizer.chat_template = (TEMPLATES_DIR / "qwen3.jinja").read_text()
    codec = ChatCodec(tokenizer)
    tools = template_tools([LOOKUP])
    messages: list[Message] = [{"role": "user", "content": "Hi?"}]
    state, _, _ = codec.next_prompt(None, messages, tools)
    action = codec.encode("<think>\nGreet back.\n</think>\n\nHello!") + [tokenizer.eos_token_id]
    state = codec.record_action(state, action)
    messages += [{"role": "assistant", "content": codec.action_text(action)}, {"role": "user", "content": "Bye."}]
    state, _, reset = codec.next_prompt(state, messages, tools)
    assert reset and "Greet back." not in state.text


def test_a_template_that_ignores_tools_is_refused_on_the_native_path(smol: PreTrainedTokenizerBase) -> None:
    codec = ChatCodec(smol)
    opening: list[Message] = [{"role": "user", "content": "Hi?"}]
    with pytest.raises(ChatTemplateError, match="did not render tool 'lookup' .*tool_format 'rollflow'"):
        codec.render_text(opening, template_tools([LOOKUP]))
    with pytest.raises(ChatTemplateError, match="mix"):
        codec.render_text(opening, [*template_tools([LOOKUP]), LOOKUP])
    assert describe_tools([LOOKUP]) in codec.render_text(opening, [LOOKUP])  # the default path is unchanged
