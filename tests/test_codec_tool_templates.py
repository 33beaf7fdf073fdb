"""One tool-call protocol whatever the chat template, on real tool-aware templates.

The templates in ``tests/templates/`` (Qwen2.5-Instruct, Qwen3, Llama-3.1-Instruct) each
render ``tools=`` themselves, in their own call syntax. The codec must not let them: the
prompt carries our format instructions (``describe_tools``) and each tool spec exactly once,
none of the template's own tool instructions, and an assistant turn with tool calls is
shown as the protocol text that was sampled, never re-printed in the template's syntax.

The templates are set on the real SmolLM2 tokenizer; their special tokens are plain text
to it, which changes how the prompt is tokenized but not what it says.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from rollflow.envs.protocol import describe_tools, make_tool_call, render_tool_calls
from rollflow.envs.types import Message, ToolSpec
from rollflow.policy.codec import ChatCodec, ChatTemplateError
from rollflow.policy.models import ModelRef, load_tokenizer

TEMPLATES_DIR = Path(__file__).parent / "templates"

# What each template says about tools when it renders them itself: none may appear.
OWN_TOOL_TEXT: dict[str, tuple[str, ...]] = {
    "qwen2.5-instruct": ("# Tools", "<tools>", "For each function call", "<function-name>"),
    "qwen3": ("# Tools", "<tools>", "For each function call", "<function-name>"),
    "llama-3.1-instruct": (
        "Environment: ipython",
        "Given the following functions",
        '"parameters": dictionary of argument name',
    ),
}
# How each template prints a structured call: never what the model is asked to write.
OWN_CALL_TEXT: dict[str, str] = {
    "qwen2.5-instruct": '<tool_call>\n{"name": "lookup"',
    "qwen3": '<tool_call>\n{"name": "lookup"',
    "llama-3.1-instruct": '{"name": "lookup", "parameters"',
}

LOOKUP: ToolSpec = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look up a fact by key.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}},
    },
}
CALCULATOR: ToolSpec = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}
TOOLS = [LOOKUP, CALCULATOR]
OPENING: list[Message] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "How many crates at the depot, doubled?"},
]


@pytest.fixture(scope="module", params=sorted(OWN_TOOL_TEXT))
def template_codec(request: pytest.FixtureRequest) -> tuple[str, ChatCodec]:
    tokenizer: PreTrainedTokenizerBase = load_tokenizer(ModelRef())
    tokenizer.chat_template = (TEMPLATES_DIR / f"{request.param}.jinja").read_text()
    return request.param, ChatCodec(tokenizer)


def assert_one_protocol(name: str, text: str) -> None:
    """Our instructions and each spec once; nothing of the template's own tool format."""
    assert text.count(describe_tools(TOOLS)) == 1
    for spec in TOOLS:
        assert text.count(spec["function"]["description"]) == 1, spec["function"]["name"]
        schema = json.dumps(spec["function"]["parameters"], sort_keys=True)
        assert text.count(schema) == 1, spec["function"]["name"]
    for own in OWN_TOOL_TEXT[name]:
        assert own not in text, f"{name} template's own tool text {own!r} is in the prompt"


def test_the_templates_do_render_tools_themselves(template_codec: tuple[str, ChatCodec]) -> None:
    """The premise: given ``tools=``, each template writes its own tool instructions."""
    name, codec = template_codec
    own = codec.tokenizer.apply_chat_template(
        OPENING, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert all(text in own for text in OWN_TOOL_TEXT[name])


def test_prompt_has_our_instructions_and_each_spec_once(template_codec: tuple[str, ChatCodec]) -> None:
    name, codec = template_codec
    text = codec.render_text(OPENING, TOOLS)
    assert_one_protocol(name, text)
    assert "Be brief.\n\n" + describe_tools(TOOLS) in text  # appended to the caller's system prompt
    assert text.count("How many crates at the depot") == 1


def test_a_reply_in_our_format_round_trips_and_is_rendered_as_sampled(
    template_codec: tuple[str, ChatCodec],
) -> None:
    name, codec = template_codec
    calls = [
        make_tool_call("lookup", {"key": "depot"}),
        make_tool_call("calculator", {"expression": "12*2"}, index=1),
    ]
    reply = "Let me check.\n" + render_tool_calls(calls)
    parsed, message = codec.parse_action(reply)
    assert parsed.kind == "tool_calls"
    read = [(call["function"]["name"], json.loads(call["function"]["arguments"])) for call in message["tool_calls"]]
    assert read == [("lookup", {"key": "depot"}), ("calculator", {"expression": "12*2"})]
    results: list[Message] = [
        {"role": "tool", "content": "12", "tool_call_id": "call_0"},
        {"role": "tool", "content": "24", "tool_call_id": "call_1"},
    ]
    text = codec.render_text([*OPENING, message, *results], TOOLS)
    assert_one_protocol(name, text)
    assert text.count(reply) == 1  # the assistant turn is the sampled text, once
    assert OWN_CALL_TEXT[name] not in text


def test_calls_given_only_as_structured_tool_calls_are_shown_in_our_format(
    template_codec: tuple[str, ChatCodec],
) -> None:
    """A few-shot turn written by hand teaches the protocol, not the template's syntax."""
    name, codec = template_codec
    calls = [make_tool_call("lookup", {"key": "depot"})]
    few_shot: Message = {"role": "assistant", "content": "", "tool_calls": calls}
    tool: Message = {"role": "tool", "content": "12", "tool_call_id": "call_0"}
    text = codec.render_text([*OPENING, few_shot, tool], TOOLS)
    assert text.count(render_tool_calls(calls)) == 1
    assert OWN_CALL_TEXT[name] not in text

    with_words: Message = {"role": "assistant", "content": "Checking.", "tool_calls": calls}
    text = codec.render_text([*OPENING, with_words, tool], TOOLS)
    assert "Checking.\n" + render_tool_calls(calls) in text


def test_calls_that_disagree_with_the_content_are_refused(
    template_codec: tuple[str, ChatCodec],
) -> None:
    _, codec = template_codec
    _, message = codec.parse_action(render_tool_calls([make_tool_call("lookup", {"key": "depot"})]))
    message["tool_calls"] = [make_tool_call("lookup", {"key": "port"})]
    with pytest.raises(ChatTemplateError, match="message 2 .*tool_calls"):
        codec.render_text([*OPENING, message], TOOLS)

    unreadable = make_tool_call("lookup", {})
    unreadable["function"]["arguments"] = "{not json"
    few_shot: Message = {"role": "assistant", "content": "", "tool_calls": [unreadable]}
    with pytest.raises(ChatTemplateError, match="assistant message 2: tool call 0 .*not JSON"):
        codec.render_text([*OPENING, few_shot], TOOLS)


def test_episode_tokens_extend_turn_after_turn(template_codec: tuple[str, ChatCodec]) -> None:
    """Token in, token out still holds: prompt t+1 = prompt t + sampled ids + delta.

    Qwen's templates end a turn with ``<|im_end|>``, SmolLM2's stop token, so actions stop on
    it; Llama's ``<|eot_id|>`` is no token of this vocabulary, so its actions are length-cut
    and the template's end of turn is context.
    """
    name, codec = template_codec
    stop = [] if name.startswith("llama") else [codec.tokenizer.eos_token_id]
    messages = list(OPENING)
    state, sequence, _ = codec.next_prompt(None, messages, TOOLS)
    sequence = list(sequence)
    call = render_tool_calls([make_tool_call("lookup", {"key": "depot"})])
    for action_text, result in ((f"Checking.\n{call}", "12"), (call, "12 again")):
        action = codec.encode(action_text) + stop
        state = codec.record_action(state, action)
        _, assistant = codec.parse_action(codec.action_text(action))
        messages += [assistant, {"role": "tool", "content": result, "tool_call_id": "call_0"}]
        state, delta, reset = codec.next_prompt(state, messages, TOOLS)
        assert reset is False
        sequence += action + list(delta)
        assert list(state.token_ids) == sequence
    assert_one_protocol(name, state.text)


def test_a_template_that_drops_the_system_message_is_refused() -> None:
    """Without the system message the model would never see the instructions: say so."""
    tokenizer = load_tokenizer(ModelRef())
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m.role != 'system' %}"
        "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    codec = ChatCodec(tokenizer)
    with pytest.raises(ChatTemplateError, match="system message"):
        codec.render_text(OPENING, TOOLS)
    assert "Be brief." not in codec.render_text(OPENING, [])  # no tools: nothing to lose
