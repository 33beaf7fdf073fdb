"""Messages + tool specs -> prompt tokens, and sampled actions back into messages.

Token in, token out. Within an episode the prompt of turn t+1 is the exact ids of turn
t's prompt, then the ids sampled for turn t's action, then the tokens of whatever the
chat template adds after that action (the end of the assistant turn, the environment's
messages, the next generation prompt). The action is never decoded and re-encoded, so
training sees exactly the tokens that were sampled.

How the delta is found: ``TokenState`` keeps, next to the ids, the text they spell. The
runner appends the action as an assistant message whose content is the raw sampled text
(``ParsedAction.to_message``), so the template's full re-render normally starts with that
text; the delta is the rest of the render, encoded on its own. Two boundary details:

- an action that ended with a stop token (``<|im_end|>``) owns that token; the template
  writes the same text right after the content, so the render must show it there, and
  the delta starts after it (typically ``"\\n<|im_start|>tool\\n..."``);
- an action cut by the length limit has no stop token: the template's end of turn is
  context, part of the delta.

When the re-render does not extend the text (a template that rewrites history, e.g. one
that strips earlier ``<think>`` blocks, or a model that stopped on a different end token),
``next_prompt`` returns the full render with ``reset=True``: a new training sample starts.

One protocol for every template. The model is always asked, by
``rollflow.envs.protocol.describe_tools`` in the system prompt, for the protocol's
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, because that is all
``parse_action`` reads. A tool-aware template (Qwen2.5/3, Llama 3.1, Mistral) given
``tools=`` asks for its own syntax instead (Llama's bare ``{"name", "parameters"}`` JSON,
Mistral's ``[TOOL_CALLS]``, Qwen's newline-wrapped blocks), which the parser reads as final
answers; given both, the model would see two formats that contradict each other. So by
default the template is never passed ``tools=`` (the opt-in exception is at the end). The
alternative, a parser per template, would need one reader per model family and make an
episode's meaning depend on its template; one text format keeps one parser, and training
teaches it to the model anyway.

Simplifications, and why:
- The instructions are appended to a leading system message, or put in a new one. That
  replaces a template's default system prompt, which is what a caller giving tools would
  want anyway. A template that drops the system message or rewrites its text would lose
  them: rendering then fails with ``ChatTemplateError`` rather than asking a model to call
  tools it was never told about.
- An assistant message with structured ``tool_calls`` reaches the template without them,
  its calls only as protocol text in its content: a template printing ``tool_calls`` in its
  own syntax would show the model a format it must not write, and the render would not
  extend what was sampled. The runner's messages carry their calls verbatim already
  (``ParsedAction.to_message``); a hand-written turn with structured calls only gets
  ``render_tool_calls`` of them after its content (as the SFT rows do). Content whose calls
  differ from its structured ones is refused: which of the two was meant is unknowable.

The opt-in exception: tool specs wrapped as ``TemplateTool``
(``rollflow.envs.tool_formats.template_tools(specs)``) are given to the template as
``tools=``, for a model trained in its own family's format (the capture endpoint asks for
it). Then nothing of the
above applies: no protocol text, and messages reach the template as they are, structured
``tool_calls`` included (their ``arguments`` as JSON objects, which templates print with
``tojson``); the caller puts sampled text back in place of a reply it echoes. A template
that does not print every tool's name is refused: it ignores ``tools=``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from transformers import PreTrainedTokenizerBase

from rollflow.envs.protocol import ParsedAction, describe_tools, parse_action, render_tool_calls
from rollflow.envs.tool_formats import TemplateTool
from rollflow.envs.types import Message, ToolCall, ToolSpec


class ChatTemplateError(ValueError):
    """The tokenizer's chat template is missing or cannot render the conversation."""


@dataclass(frozen=True)
class TokenState:
    """One episode's token history: every id the model has seen or sampled, in order.

    ``text`` is what ``token_ids`` spell, kept to check that a re-render extends them.
    """

    token_ids: tuple[int, ...]
    text: str

    def __len__(self) -> int:
        return len(self.token_ids)


class ChatCodec:
    """Render conversations with a tokenizer's chat template; keep episodes token-exact."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        stop_token_ids: Iterable[int] | None = None,
    ) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError(
                f"tokenizer {type(tokenizer).__name__} has no chat template; "
                "a policy needs one to render conversations"
            )
        self.tokenizer = tokenizer
        stops = set(stop_token_ids or ())
        if tokenizer.eos_token_id is not None:
            stops.add(int(tokenizer.eos_token_id))
        if not stops:
            raise ChatTemplateError("no stop token: the tokenizer has no eos token and none given")
        self.stop_token_ids: frozenset[int] = frozenset(stops)

    # ------------------------------------------------------------ rendering

    def render_text(self, messages: Sequence[Message], tool_specs: Sequence[ToolSpec]) -> str:
        """The full prompt text: the conversation, tools, and the generation prompt.

        Tools are described in the system prompt, never given to the template as
        ``tools=`` (see the module note).
        """
        if not messages:
            raise ChatTemplateError("cannot render an empty conversation")
        in_template = [isinstance(spec, TemplateTool) for spec in tool_specs]
        if any(in_template):
            if not all(in_template):
                raise ChatTemplateError("tool specs mix template-rendered (TemplateTool) and protocol ones")
            return self._render_template_tools(messages, tool_specs)
        prepared = [_as_rendered(message, index) for index, message in enumerate(messages)]
        tools_text = describe_tools(tool_specs)
        if tools_text:
            prepared = with_tools_in_system_prompt(prepared, tools_text)
        rendered = self._apply_template(prepared)
        if tools_text not in rendered:
            raise ChatTemplateError(
                "the chat template did not render the system message, which carries the "
                "tool-call instructions; a template that drops or rewrites it is not supported"
            )
        return rendered

    def render_prompt_ids(
        self, messages: Sequence[Message], tool_specs: Sequence[ToolSpec]
    ) -> list[int]:
        """The full prompt as ids, exactly as ``apply_chat_template(tokenize=True)`` would."""
        return self.encode(self.render_text(messages, tool_specs))

    def encode(self, text: str) -> list[int]:
        """Text -> ids; special tokens written in the text are recognised, none are added."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    # ------------------------------------------------------------ token in, token out

    def next_prompt(
        self,
        state: TokenState | None,
        messages: Sequence[Message],
        tool_specs: Sequence[ToolSpec],
    ) -> tuple[TokenState, tuple[int, ...], bool]:
        """The context for the next action: ``(state, prompt_delta_ids, reset)``.

        ``state`` is None for an episode's first action. The returned state's ids are the
        whole context the model should continue; ``prompt_delta_ids`` is what was added.
        """
        full_text = self.render_text(messages, tool_specs)
        if state is None or not full_text.startswith(state.text):
            ids = tuple(self.encode(full_text))
            return TokenState(token_ids=ids, text=full_text), ids, state is not None
        delta_ids = tuple(self.encode(full_text[len(state.text) :]))
        return TokenState(token_ids=state.token_ids + delta_ids, text=full_text), delta_ids, False

    def record_action(self, state: TokenState, token_ids: Sequence[int]) -> TokenState:
        """``state`` followed by a sampled action (its stop token included, if it has one)."""
        action_ids = tuple(int(token) for token in token_ids)
        spelled = self._decode(action_ids)
        return TokenState(token_ids=state.token_ids + action_ids, text=state.text + spelled)

    def action_text(self, token_ids: Sequence[int]) -> str:
        """The raw text of an action: its tokens decoded as-is, minus a final stop token.

        This is what the runner puts in the assistant message's content.
        """
        body = list(token_ids)
        if body and body[-1] in self.stop_token_ids:
            body.pop()
        return self._decode(body)

    def ends_with_stop(self, token_ids: Sequence[int]) -> bool:
        return bool(token_ids) and token_ids[-1] in self.stop_token_ids

    # ------------------------------------------------------------ parsing

    @staticmethod
    def parse_action(text: str) -> tuple[ParsedAction, Message]:
        """The protocol's reading of an action and the assistant message to append."""
        parsed = parse_action(text)
        return parsed, parsed.to_message(text)

    # ------------------------------------------------------------ internals

    def _decode(self, token_ids: Sequence[int]) -> str:
        return str(
            self.tokenizer.decode(
                list(token_ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
        )

    def _render_template_tools(self, messages: Sequence[Message], tool_specs: Sequence[ToolSpec]) -> str:
        """The opt-in path: the template renders the tools and every message as it is."""
        prepared = [_with_object_arguments(message, index) for index, message in enumerate(messages)]
        rendered = self._apply_template(prepared, tools=[dict(spec) for spec in tool_specs])
        for spec in tool_specs:
            name = spec["function"]["name"]
            if name not in rendered:
                raise ChatTemplateError(
                    f"the chat template did not render tool {name!r} given as tools=: it does not "
                    "know tools; use rollflow's protocol (tool_format 'rollflow')"
                )
        return rendered

    def _apply_template(self, messages: Sequence[Message], tools: list[dict[str, object]] | None = None) -> str:
        extra = {} if tools is None else {"tools": tools}
        try:
            rendered = self.tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=True, **extra
            )
        except Exception as error:  # jinja raises many types; name the culprit once
            roles = [message.get("role") for message in messages]
            raise ChatTemplateError(
                f"the chat template could not render roles {roles}: "
                f"{type(error).__name__}: {error}"
            ) from error
        if not isinstance(rendered, str):
            raise ChatTemplateError(f"the chat template returned {type(rendered).__name__}")
        return rendered


def _as_rendered(message: Message, index: int) -> Message:
    """``message`` as the template should see it: its tool calls as protocol text only."""
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not calls:
        return message
    content = message.get("content") or ""
    without_calls = cast(Message, {key: value for key, value in message.items() if key != "tool_calls"})
    carried = parse_action(content)
    if carried.kind == "tool_calls" and _same_calls(carried.tool_calls, calls):
        return without_calls
    if carried.kind != "final":
        found = carried.error or f"{len(carried.tool_calls)} different ones"
        raise ChatTemplateError(
            f"assistant message {index} has {len(calls)} structured tool_calls but its content's "
            f"calls disagree ({found}); give the calls once, or the same in both"
        )
    try:
        calls_text = render_tool_calls(calls)
    except ValueError as error:
        raise ChatTemplateError(f"assistant message {index}: {error}") from error
    return cast(Message, {**without_calls, "content": "\n".join(p for p in (content, calls_text) if p)})


def _with_object_arguments(message: Message, index: int) -> Message:
    """``message`` with its calls' ``arguments`` as JSON objects, as templates print them."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    converted = []
    for number, call in enumerate(calls):
        try:
            arguments = json.loads(call["function"]["arguments"])
        except (KeyError, TypeError, ValueError) as error:
            raise ChatTemplateError(
                f"assistant message {index}: tool call {number} arguments are not JSON: {error}"
            ) from error
        converted.append({**call, "function": {**call["function"], "arguments": arguments}})
    return cast(Message, {**message, "tool_calls": converted})


def _same_calls(carried: Sequence[ToolCall], structured: Sequence[ToolCall]) -> bool:
    """The same calls in the same order: equal names, arguments equal as JSON values."""
    if len(carried) != len(structured):
        return False
    try:
        return all(
            ours["function"]["name"] == theirs["function"]["name"]
            and json.loads(ours["function"]["arguments"]) == json.loads(theirs["function"]["arguments"])
            for ours, theirs in zip(carried, structured, strict=True)
        )
    except (KeyError, TypeError, ValueError):
        return False


def with_tools_in_system_prompt(messages: Sequence[Message], tools_text: str) -> list[Message]:
    """``tools_text`` appended to a leading system message, or put in a new one."""
    if messages and messages[0].get("role") == "system":
        system: Message = {**messages[0], "content": f"{messages[0]['content']}\n\n{tools_text}"}
        return [system, *messages[1:]]
    return [{"role": "system", "content": tools_text}, *messages]
