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

Simplifications, and why:
- A template that ignores ``tools=`` (found by rendering a probe with and without a tool)
  gets ``rollflow.envs.protocol.describe_tools`` in its system prompt: appended to a leading system
  message, or as a new one. That replaces a template's default system prompt, which is
  what a caller giving tools would want anyway.
- An assistant message whose content already carries its tool calls verbatim (the
  protocol's ``<tool_call>`` blocks, as the runner writes it) is rendered without its
  structured ``tool_calls``: a template that prints both would show the calls twice and
  the render would never extend what was sampled.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

from transformers import PreTrainedTokenizerBase

from rollflow.envs.protocol import ParsedAction, describe_tools, parse_action
from rollflow.envs.types import Message, ToolSpec

_PROBE_MESSAGES: tuple[Message, ...] = ({"role": "user", "content": "ping"},)
_PROBE_TOOL: ToolSpec = {
    "type": "function",
    "function": {
        "name": "rollflow_probe_tool",
        "description": "A probe: does the chat template render tools?",
        "parameters": {"type": "object", "properties": {}},
    },
}


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
        self.template_renders_tools = self._detect_tool_rendering()

    # ------------------------------------------------------------ rendering

    def render_text(self, messages: Sequence[Message], tool_specs: Sequence[ToolSpec]) -> str:
        """The full prompt text: the conversation, tools, and the generation prompt."""
        if not messages:
            raise ChatTemplateError("cannot render an empty conversation")
        prepared = [_as_rendered(message) for message in messages]
        tools = list(tool_specs) or None
        if tools is not None and not self.template_renders_tools:
            prepared = with_tools_in_system_prompt(prepared, describe_tools(tool_specs))
            tools = None
        return self._apply_template(prepared, tools)

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

    def _apply_template(
        self, messages: Sequence[Message], tools: list[ToolSpec] | None
    ) -> str:
        try:
            rendered = self.tokenizer.apply_chat_template(
                list(messages), tools=tools, tokenize=False, add_generation_prompt=True
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

    def _detect_tool_rendering(self) -> bool:
        without = self._apply_template(_PROBE_MESSAGES, None)
        try:
            with_tools = self._apply_template(_PROBE_MESSAGES, [_PROBE_TOOL])
        except ChatTemplateError:
            return False
        return with_tools != without


def _as_rendered(message: Message) -> Message:
    """``message`` as the template should see it (see the module note on tool calls)."""
    if message.get("role") != "assistant" or not message.get("tool_calls"):
        return message
    carried = parse_action(message.get("content") or "")
    if len(carried.tool_calls) != len(message["tool_calls"]):
        return message
    without_calls = {key: value for key, value in message.items() if key != "tool_calls"}
    return cast(Message, without_calls)


def with_tools_in_system_prompt(messages: Sequence[Message], tools_text: str) -> list[Message]:
    """``tools_text`` appended to a leading system message, or put in a new one."""
    if messages and messages[0].get("role") == "system":
        system: Message = {**messages[0], "content": f"{messages[0]['content']}\n\n{tools_text}"}
        return [system, *messages[1:]]
    return [{"role": "system", "content": tools_text}, *messages]
