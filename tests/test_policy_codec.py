"""The chat codec against Hugging Face ``apply_chat_template``, on two real templates.

- the bundled SmolLM2 ChatML template, which ignores ``tools=``;
- a Qwen-style template written here: tools rendered natively (which the codec must not
  use), tool calls printed from ``tool_calls``, tool results wrapped as user turns, and
  ``<think>`` blocks stripped from assistant turns that precede the last user message.

Real tool-aware templates (Qwen2.5, Qwen3, Llama 3.1) are in test_codec_tool_templates.py.

Actions are simulated with real token ids: the canonical encoding of a text plus the stop
token, or deliberately non-canonical splits to show the ids are kept, not re-encoded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import pytest
from transformers import PreTrainedTokenizerBase

from rollflow.envs.protocol import describe_tools, render_tool_calls
from rollflow.envs.types import Message, ToolSpec
from rollflow.policy.codec import ChatCodec, ChatTemplateError, TokenState
from rollflow.policy.models import ModelRef, load_tokenizer

QWEN_STYLE_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0].role == 'system' -%}{{- messages[0].content + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nFunctions you may call:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\nCall one inside <tool_call></tool_call> tags.<|im_end|>\\n' -}}"
    "{%- elif messages[0].role == 'system' -%}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}"
    "{{- '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- set content = m.content -%}"
    "{%- if loop.index0 < ns.last_user and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>assistant\\n' + content -}}"
    "{%- for call in m.tool_calls or [] -%}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": '"
    " + call.function.arguments + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

LOOKUP: ToolSpec = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look up a fact by key.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}},
    },
}
CALL_TEXT = '<tool_call>{"name": "lookup", "arguments": {"key": "depot"}}</tool_call>'


@pytest.fixture(scope="module")
def qwen_style_tokenizer() -> PreTrainedTokenizerBase:
    tokenizer = load_tokenizer(ModelRef())
    tokenizer.chat_template = QWEN_STYLE_TEMPLATE
    return tokenizer


@pytest.fixture(params=["smollm2", "qwen_style"])
def tokenizer(
    request: pytest.FixtureRequest,
    bundled_tokenizer: PreTrainedTokenizerBase,
    qwen_style_tokenizer: PreTrainedTokenizerBase,
) -> PreTrainedTokenizerBase:
    return bundled_tokenizer if request.param == "smollm2" else qwen_style_tokenizer


def hf_ids(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], tools: list[ToolSpec] | None
) -> list[int]:
    ids = tokenizer.apply_chat_template(
        list(messages), tools=tools, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    return list(ids)


def hf_reference(
    codec: ChatCodec, messages: Sequence[Message], tools: list[ToolSpec]
) -> list[int]:
    """HF's ids for the conversation, tools described in a new system message, never ``tools=``.

    Assistant turns carry their calls verbatim in the content, so HF is given them
    without the structured copy (see the codec's note on rendering tool calls once).
    """
    messages = [
        cast(Message, {key: value for key, value in message.items() if key != "tool_calls"})
        for message in messages
    ]
    system: Message = {"role": "system", "content": describe_tools(tools)}
    return hf_ids(codec.tokenizer, [system, *messages], None)


def sample(codec: ChatCodec, text: str, *, stop: bool = True) -> list[int]:
    """The ids a model would sample for ``text``: its canonical encoding, then the stop."""
    return codec.encode(text) + ([codec.tokenizer.eos_token_id] if stop else [])


def play_turn(
    codec: ChatCodec,
    state: TokenState,
    messages: list[Message],
    action_ids: list[int],
    env_messages: list[Message],
    tools: list[ToolSpec],
) -> tuple[TokenState, tuple[int, ...], bool]:
    """What the runner does: record the action, append its message and the env's reply."""
    state = codec.record_action(state, action_ids)
    _, assistant = codec.parse_action(codec.action_text(action_ids))
    messages += [assistant, *env_messages]
    return codec.next_prompt(state, messages, tools)


# ---------------------------------------------------------------- rendering


def test_first_prompt_is_exactly_hf_apply_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
    codec = ChatCodec(tokenizer)
    messages: list[Message] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there, what's 2 + 3?"},
    ]
    assert codec.render_prompt_ids(messages, []) == hf_ids(tokenizer, messages, None)
    state, delta, reset = codec.next_prompt(None, messages, [])
    assert list(delta) == list(state.token_ids) == hf_ids(tokenizer, messages, None)
    assert reset is False


def test_smollm2_template_ignores_tools_so_they_go_into_the_system_prompt(
    bundled_tokenizer: PreTrainedTokenizerBase,
) -> None:
    codec = ChatCodec(bundled_tokenizer)
    user: Message = {"role": "user", "content": "Which depot?"}
    text = codec.render_text([user], [LOOKUP])
    assert text.startswith("<|im_start|>system\n" + describe_tools([LOOKUP]) + "<|im_end|>")
    assert "You are a helpful AI assistant named SmolLM" not in text  # replaced, not doubled

    system: Message = {"role": "system", "content": "Be brief."}
    text = codec.render_text([system, user], [LOOKUP])
    assert text.startswith(f"<|im_start|>system\nBe brief.\n\n{describe_tools([LOOKUP])}<|im_end|>")
    assert text.count("<|im_start|>system") == 1


def test_a_template_that_renders_tools_gets_our_instructions_not_tools(
    qwen_style_tokenizer: PreTrainedTokenizerBase,
) -> None:
    codec = ChatCodec(qwen_style_tokenizer)
    messages: list[Message] = [{"role": "user", "content": "Which depot?"}]
    own = qwen_style_tokenizer.apply_chat_template(
        messages, tools=[LOOKUP], tokenize=False, add_generation_prompt=True
    )
    assert "# Tools" in own  # the template would describe tools its own way
    text = codec.render_text(messages, [LOOKUP])
    assert "# Tools" not in text and "<tools>" not in text
    assert text.startswith("<|im_start|>system\n" + describe_tools([LOOKUP]) + "<|im_end|>")
    system: Message = {"role": "system", "content": describe_tools([LOOKUP])}
    assert codec.render_prompt_ids(messages, [LOOKUP]) == hf_ids(
        qwen_style_tokenizer, [system, *messages], None
    )


def test_without_a_chat_template_the_codec_refuses(bundled_tokenizer: PreTrainedTokenizerBase) -> None:
    bare = load_tokenizer(ModelRef())
    bare.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatCodec(bare)
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        ChatCodec(bundled_tokenizer).render_text([], [])


# ---------------------------------------------------------------- token in, token out


def test_multi_turn_prompt_equals_full_render_and_only_grows(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    codec = ChatCodec(tokenizer)
    messages: list[Message] = [{"role": "user", "content": "How many crates at the depot?"}]
    state, delta, reset = codec.next_prompt(None, messages, [LOOKUP])
    sequence = list(delta)
    turns = [
        (f"Let me check.\n{CALL_TEXT}", [{"role": "tool", "content": "12", "tool_call_id": "call_0"}]),
        (CALL_TEXT, [{"role": "tool", "content": "12 again", "tool_call_id": "call_0"}]),
    ]
    for action_text, env_messages in turns:
        action = sample(codec, action_text)
        sequence += action
        state, delta, reset = play_turn(codec, state, messages, action, env_messages, [LOOKUP])
        assert reset is False
        sequence += delta
        assert list(state.token_ids) == sequence  # prompt t+1 = prompt t + action + delta
        assert list(state.token_ids) == hf_reference(codec, messages, [LOOKUP])
    assert state.text == codec.render_text(messages, [LOOKUP])


def test_delta_starts_after_the_sampled_stop_token(bundled_tokenizer: PreTrainedTokenizerBase) -> None:
    codec = ChatCodec(bundled_tokenizer)
    messages: list[Message] = [{"role": "user", "content": "Hi"}]
    state, _, _ = codec.next_prompt(None, messages, [])
    action = sample(codec, "Hello!")
    env: list[Message] = [{"role": "user", "content": "Again"}]
    _, delta, reset = play_turn(codec, state, messages, action, env, [])
    assert not reset
    assert codec.tokenizer.decode(list(delta)) == (
        "\n<|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\n"
    )


def test_sampled_ids_are_kept_even_when_not_the_canonical_encoding(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    codec = ChatCodec(tokenizer)
    messages: list[Message] = [{"role": "user", "content": "Spell it."}]
    state, _, _ = codec.next_prompt(None, messages, [])
    # one token per character: what a model may sample, never what encode() produces
    action = [codec.encode(char)[0] for char in "hello world"] + [tokenizer.eos_token_id]
    assert action[:-1] != codec.encode("hello world")
    before = state.token_ids
    env: list[Message] = [{"role": "user", "content": "Thanks"}]
    state, delta, reset = play_turn(codec, state, messages, action, env, [])
    assert not reset
    assert state.token_ids == before + tuple(action) + delta
    assert tokenizer.decode(list(state.token_ids)) == codec.render_text(messages, [])
    assert list(state.token_ids) != hf_ids(tokenizer, messages, None)  # HF re-encodes


def test_length_cut_action_gets_the_end_of_turn_as_context(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    codec = ChatCodec(tokenizer)
    messages: list[Message] = [{"role": "user", "content": "Tell me a story"}]
    state, _, _ = codec.next_prompt(None, messages, [])
    action = sample(codec, "Once upon a", stop=False)
    assert codec.action_text(action) == "Once upon a"
    env: list[Message] = [{"role": "user", "content": "Go on"}]
    state, delta, reset = play_turn(codec, state, messages, action, env, [])
    assert not reset
    assert delta[0] == tokenizer.eos_token_id  # the template closed the turn, not the model
    assert list(state.token_ids) == hf_ids(tokenizer, messages, None)


def test_stopping_on_a_different_end_token_starts_a_new_sample(
    bundled_tokenizer: PreTrainedTokenizerBase,
) -> None:
    end_of_text = bundled_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    codec = ChatCodec(bundled_tokenizer, stop_token_ids=[end_of_text])
    messages: list[Message] = [{"role": "user", "content": "Hi"}]
    state, _, _ = codec.next_prompt(None, messages, [])
    action = codec.encode("Hello") + [end_of_text]
    assert codec.action_text(action) == "Hello"
    env: list[Message] = [{"role": "user", "content": "Again"}]
    state, delta, reset = play_turn(codec, state, messages, action, env, [])
    assert reset is True  # the template ends the turn with <|im_end|>, not what was sampled
    assert list(delta) == list(state.token_ids) == hf_ids(bundled_tokenizer, messages, None)


def test_template_that_strips_earlier_thoughts_resets_and_otherwise_extends(
    qwen_style_tokenizer: PreTrainedTokenizerBase,
) -> None:
    codec = ChatCodec(qwen_style_tokenizer)
    messages: list[Message] = [{"role": "user", "content": "Find the depot count."}]
    state, _, _ = codec.next_prompt(None, messages, [LOOKUP])
    thought = f"<think>\nI should look it up.\n</think>\n{CALL_TEXT}"
    tool: list[Message] = [{"role": "tool", "content": "12", "tool_call_id": "call_0"}]
    state, _, reset = play_turn(codec, state, messages, sample(codec, thought), tool, [LOOKUP])
    assert reset is False  # thoughts after the last user turn are kept
    assert "I should look it up." in state.text

    answer = "<think>\nDone.\n</think>\nThere are 12."
    follow_up: list[Message] = [{"role": "user", "content": "And at the port?"}]
    state, delta, reset = play_turn(
        codec, state, messages, sample(codec, answer), follow_up, [LOOKUP]
    )
    assert reset is True  # the new user turn made the template drop both thoughts
    assert "I should look it up." not in state.text and "Done." not in state.text
    assert list(delta) == list(state.token_ids) == hf_reference(codec, messages, [LOOKUP])


def test_tool_calls_carried_in_the_content_are_rendered_once(
    qwen_style_tokenizer: PreTrainedTokenizerBase,
) -> None:
    codec = ChatCodec(qwen_style_tokenizer)
    parsed, message = codec.parse_action(CALL_TEXT)
    assert parsed.kind == "tool_calls" and "tool_calls" in message
    conversation: list[Message] = [{"role": "user", "content": "Go"}, message]
    rendered = codec.render_text(conversation, [LOOKUP])
    assert rendered.count('{"name": "lookup", "arguments": {"key": "depot"}}') == 1  # the call, once

    # A few-shot assistant turn written with structured calls only shows them in our format,
    # never in the template's own (newline-wrapped) one.
    structured: Message = {"role": "assistant", "content": "", "tool_calls": message["tool_calls"]}
    text = codec.render_text([{"role": "user", "content": "Go"}, structured], [LOOKUP])
    assert "<|im_start|>assistant\n" + render_tool_calls(message["tool_calls"]) + "<|im_end|>" in text
    assert "<tool_call>\n" not in text


def test_parse_action_keeps_the_raw_text_as_content(bundled_tokenizer: PreTrainedTokenizerBase) -> None:
    codec = ChatCodec(bundled_tokenizer)
    raw = f"  checking {CALL_TEXT} "
    parsed, message = codec.parse_action(raw)
    assert parsed.kind == "tool_calls"
    assert message["content"] == raw
    assert message["tool_calls"][0]["function"]["name"] == "lookup"

    parsed, message = codec.parse_action("<tool_call>{not json</tool_call>")
    assert parsed.kind == "parse_failure" and parsed.error
    assert "tool_calls" not in message
