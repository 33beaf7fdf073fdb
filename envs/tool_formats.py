"""Tool-call formats: how a model family writes tool calls, and how to read them back.

A tool-aware chat template, given ``tools=``, describes the tools in its own words and asks
the model for calls in its family's syntax; vLLM reads that syntax back with the parser
named ``--tool-call-parser``. Each ``ToolFormat`` here is one family:

==============  =========================================================  ===============
name            what the model writes (and the template re-prints)          vLLM parser
==============  =========================================================  ===============
``rollflow``    rollflow's protocol, described in the system prompt        none (see below)
``hermes``      ``<tool_call>\\n{"name": .., "arguments": {..}}\\n</tool_call>`` ``hermes``
                (Qwen2.5, Qwen3, Hermes 2 Pro)
``llama3_json`` ``{"name": .., "parameters": {..}}``, several joined by     ``llama3_json``
                ``"; "`` (Llama 3.1+)
``mistral``     ``[TOOL_CALLS][{"name": .., "arguments": {..}}, ..]``        ``mistral``
==============  =========================================================  ===============

A format has a ``parse`` (text -> ``ParsedAction``, never raising: a malformed call is a
``parse_failure`` whose ``error`` names the first problem, as ``envs.protocol`` does), a
``render`` (the calls as the template prints an assistant turn that carries them, so
``parse(render(content, calls))`` gives them back), and how the endpoint gives a sampled
reply back to the template (``echo``):

- ``"raw"``: the sampled text as the turn's content, with no structured calls. Qwen's and
  Llama's templates print content as it is (Llama trims it), so the history re-renders to
  the sampled tokens and the next call continues the same training sample.
- ``"structured"``: the calls as structured ``tool_calls``, printed by the template.
  Mistral's template needs that (it counts an assistant turn without calls as a turn that
  must alternate with a user turn, and refuses the conversation otherwise) and adds each
  call's ``"id"``, which the model never wrote: a call after a tool call starts a new
  sample. Its ids must be 9 letters or digits (``call_id``).

Detection (``detect_tool_format``) reads the template's own text. A template "knows tools"
when a jinja tag of it reads the ``tools`` variable; then the first family whose markers
(literal strings the template prints when it renders calls) are all in it wins, in the
order of ``FORMATS``, unless one of its ``unless`` strings is there too. SmolLM2's template
(the bundled model) never reads ``tools``: it gets rollflow's protocol, and its export is
served with the tools in the system prompt and no vLLM parser (vLLM parses only requests
that carry ``tools=``, which that template would not show the model).

Simplified, on purpose, against vLLM 0.32's parsers: ``llama3_json`` reads calls only where
the reply starts with them (as Llama writes them; vLLM also finds JSON after prose), and
``mistral`` reads the JSON-list form of Mistral's v3 tokenizer models (7B v0.3, Nemo). The
``[TOOL_CALLS]name[ARGS]{..}`` form of later models is not read: a template that prints
``[ARGS]`` is not detected as ``mistral``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

from rollflow.envs.protocol import ParsedAction, parse_action, render_tool_calls
from rollflow.envs.types import ToolCall, ToolSpec


class TemplateTool(dict[str, Any]):
    """A tool spec for the chat template to render itself (``tools=``): the opt-in path of
    ``rollflow.policy.codec`` (its module note), kept here, below the codec, for the envs
    that ask for it.

    A marked dict, so that it reaches the codec through any session unchanged: a session
    keeps its specs as given (``tuple(tool_specs)`` keeps the elements).
    """


def template_tools(specs: Iterable[ToolSpec]) -> tuple[ToolSpec, ...]:
    """``specs`` marked for the template to render (the codec's opt-in path)."""
    return tuple(cast(ToolSpec, TemplateTool(spec)) for spec in specs)


Echo = Literal["raw", "structured"]
_READS_TOOLS = re.compile(r"(\{%|\{\{)[^}]*\btools\b")


@dataclass(frozen=True)
class ToolFormat:
    """One family's tool-call syntax (see the module note)."""

    name: str
    vllm_parser: str | None  # vLLM's --tool-call-parser for a policy served in this format
    markers: tuple[str, ...]  # all in a chat template that prints this format; () never detected
    parse: Callable[[str], ParsedAction]
    render: Callable[[str, Sequence[ToolCall]], str]
    echo: Echo
    call_id: Callable[[int, int], str]  # (call number in the episode, index in the reply) -> id
    unless: tuple[str, ...] = ()  # a template holding any of these is not this family's

    @property
    def in_template(self) -> bool:
        """The chat template renders ``tools=`` itself (else rollflow's system-prompt text)."""
        return self.name != "rollflow"


# ---------------------------------------------------------------- shared


def _failure(error: str) -> ParsedAction:
    return ParsedAction(kind="parse_failure", content="", tool_calls=(), error=error)


def _final(text: str) -> ParsedAction:
    return ParsedAction(kind="final", content=text.strip(), tool_calls=(), error=None)


def _refuse_constant(constant: str) -> Any:
    raise ValueError(f"{constant} is not valid JSON")


_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)


def _call(payload: object, index: int, arguments_key: str, call_id: str) -> ToolCall:
    """A ``{"name", <arguments_key>}`` object as a ``ToolCall``; ``ValueError`` names the flaw."""
    if not isinstance(payload, dict):
        raise ValueError(f"tool call {index}: expected a JSON object, got {type(payload).__name__}")
    name = payload.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f'tool call {index}: missing "name" (a non-empty string)')
    arguments = payload.get(arguments_key, {})
    if not isinstance(arguments, dict):
        raise ValueError(f'tool call {index}: "{arguments_key}" must be an object, got {type(arguments).__name__}')
    text = json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}


def _arguments(call: ToolCall, index: int) -> dict[str, Any]:
    """A call's arguments as the JSON object a template prints with ``tojson``."""
    try:
        value = json.loads(call["function"]["arguments"])
    except (ValueError, TypeError) as exc:
        raise ValueError(f"tool call {index}: arguments are not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"tool call {index}: arguments must be a JSON object, got {type(value).__name__}")
    return value


def _json(value: object) -> str:
    """As transformers' ``tojson`` writes it: ``json.dumps`` defaults, unicode kept."""
    return json.dumps(value, ensure_ascii=False)


def _openai_id(call_number: int, index: int) -> str:
    return f"call_{call_number}_{index}"


# ---------------------------------------------------------------- hermes (Qwen2.5, Qwen3)


def render_hermes(content: str, calls: Sequence[ToolCall]) -> str:
    """Content, then one ``<tool_call>`` block per call, each on lines of its own."""
    bodies = [
        f'{{"name": "{c["function"]["name"]}", "arguments": {_json(_arguments(c, i))}}}' for i, c in enumerate(calls)
    ]
    blocks = [f"<tool_call>\n{body}\n</tool_call>" for body in bodies]
    return "\n".join([content, *blocks] if content else blocks)


# rollflow's protocol reads Hermes blocks: JSON in <tool_call> tags, whitespace around it ignored
parse_hermes = parse_action


# ---------------------------------------------------------------- llama3_json (Llama 3.1+)

PYTHON_TAG = "<|python_tag|>"


def parse_llama3_json(text: str) -> ParsedAction:
    """A reply that starts with ``{`` (or ``<|python_tag|>``) is calls: JSON objects with
    ``name`` and ``parameters`` (or ``arguments``), joined by ``;``; anything else is a final
    answer, as vLLM's ``llama3_json`` parser reads it. Llama writes no content beside calls."""
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :].lstrip()
    elif not body.startswith("{"):
        return _final(text)
    calls: list[ToolCall] = []
    position = 0
    while True:
        try:
            payload, position = _DECODER.raw_decode(body, position)
            key = "parameters" if isinstance(payload, dict) and "parameters" in payload else "arguments"
            calls.append(_call(payload, len(calls), key, f"call_{len(calls)}"))
        except ValueError as exc:
            said = str(exc)
            return _failure(said if said.startswith("tool call") else f"tool call {len(calls)}: invalid JSON ({said})")
        rest = body[position:].lstrip()
        if not rest:
            return ParsedAction(kind="tool_calls", content="", tool_calls=tuple(calls), error=None)
        if not rest.startswith(";"):
            return _failure(f"text after tool call {len(calls) - 1} is not '; ' and another call: {rest[:40]!r}")
        position = len(body) - len(rest) + 1
        while position < len(body) and body[position].isspace():
            position += 1


def render_llama3_json(content: str, calls: Sequence[ToolCall]) -> str:
    """``{"name": .., "parameters": ..}`` per call, joined by ``"; "``. Llama's template prints
    only a turn's call (one: it refuses more), not its content."""
    return "; ".join(
        f'{{"name": "{call["function"]["name"]}", "parameters": {_json(_arguments(call, i))}}}'
        for i, call in enumerate(calls)
    )


# ---------------------------------------------------------------- mistral

TOOL_CALLS = "[TOOL_CALLS]"
_MISTRAL_ID = re.compile(r"^[A-Za-z0-9]{9}$")


def mistral_call_id(call_number: int, index: int) -> str:
    """Nine letters and digits, as Mistral's template demands: ``call`` + 3 + 2 digits."""
    if not (0 <= call_number < 1000 and 0 <= index < 100):
        raise ValueError(f"mistral call ids hold 1000 calls of 100 tool calls; got call {call_number}, index {index}")
    return f"call{call_number:03d}{index:02d}"


def parse_mistral(text: str) -> ParsedAction:
    """Content, then ``[TOOL_CALLS]`` and a JSON list of ``{"name", "arguments"}`` objects
    (an ``"id"`` of 9 letters or digits is kept, as the template prints one)."""
    start = text.find(TOOL_CALLS)
    if start == -1:
        return _final(text)
    body = text[start + len(TOOL_CALLS) :].strip()
    try:
        payload, end = _DECODER.raw_decode(body)
    except ValueError as exc:
        return _failure(f"the {TOOL_CALLS} list is not JSON ({exc})")
    if body[end:].strip():
        return _failure(f"text after the {TOOL_CALLS} list: {body[end:].strip()[:40]!r}")
    if not isinstance(payload, list) or not payload:
        return _failure(f"{TOOL_CALLS} must be followed by a non-empty JSON list of calls")
    calls: list[ToolCall] = []
    for index, item in enumerate(payload):
        given = item.get("id") if isinstance(item, dict) else None
        if given is not None and not (isinstance(given, str) and _MISTRAL_ID.match(given)):
            return _failure(f'tool call {index}: "id" must be 9 letters or digits, got {given!r}')
        try:
            calls.append(_call(item, index, "arguments", given or mistral_call_id(0, index)))
        except ValueError as exc:
            return _failure(str(exc))
    return ParsedAction(kind="tool_calls", content=text[:start].strip(), tool_calls=tuple(calls), error=None)


def render_mistral(content: str, calls: Sequence[ToolCall]) -> str:
    """``[TOOL_CALLS][..]`` with each call's id, as Mistral-Nemo's template prints a turn's
    calls (it drops the content). The id must already be 9 letters or digits."""
    items = []
    for index, call in enumerate(calls):
        if not _MISTRAL_ID.match(call["id"]):
            raise ValueError(f"tool call {index}: mistral's template takes 9-character ids, got {call['id']!r}")
        function = _json({"name": call["function"]["name"], "arguments": _arguments(call, index)})
        items.append(f'{function[:-1]}, "id": "{call["id"]}"}}')
    return f"{TOOL_CALLS}[{', '.join(items)}]"


# ---------------------------------------------------------------- the table

ROLLFLOW = ToolFormat(
    name="rollflow", vllm_parser=None, markers=(), parse=parse_action, echo="raw", call_id=_openai_id,
    render=lambda content, calls: "\n".join(p for p in (content, render_tool_calls(calls)) if p),
)  # fmt: skip
HERMES = ToolFormat(
    name="hermes", vllm_parser="hermes", markers=("<tool_call>", "</tool_call>"),
    parse=parse_hermes, render=render_hermes, echo="raw", call_id=_openai_id,
)  # fmt: skip
LLAMA3_JSON = ToolFormat(
    name="llama3_json", vllm_parser="llama3_json", markers=('"parameters": ', "<|start_header_id|>"),
    parse=parse_llama3_json, render=render_llama3_json, echo="raw", call_id=_openai_id,
)  # fmt: skip
MISTRAL = ToolFormat(
    name="mistral", vllm_parser="mistral", markers=(TOOL_CALLS, "[AVAILABLE_TOOLS]"), unless=("[ARGS]",),
    parse=parse_mistral, render=render_mistral, echo="structured", call_id=mistral_call_id,
)  # fmt: skip

# detection order: the first family whose markers are all in the template
FORMATS: Mapping[str, ToolFormat] = {f.name: f for f in (MISTRAL, HERMES, LLAMA3_JSON, ROLLFLOW)}
TOOL_FORMAT_CHOICES = ("auto", *FORMATS)


def template_reads_tools(template: str) -> bool:
    """Whether a jinja tag of ``template`` reads the ``tools`` variable (it renders ``tools=``)."""
    return bool(_READS_TOOLS.search(template))


def detect_tool_format(template: str | Mapping[str, str] | None) -> ToolFormat:
    """The family ``template`` prints calls in; ``ROLLFLOW`` for one that does not know tools.

    A tokenizer may hold several named templates: the ``tool_use`` one is read when there is
    one (transformers renders with it when given tools), else ``default``.
    """
    if isinstance(template, Mapping):
        template = template.get("tool_use") or template.get("default")
    if not isinstance(template, str) or not template_reads_tools(template):
        return ROLLFLOW
    for fmt in FORMATS.values():
        if fmt.markers and all(m in template for m in fmt.markers) and not any(u in template for u in fmt.unless):
            return fmt
    return ROLLFLOW


def chosen_tool_format(choice: str, template: str | Mapping[str, str] | None) -> ToolFormat:
    """The format for an env's ``tool_format`` choice: ``"auto"`` detects it from the policy's
    chat template (``None``: a served model whose template is not known here -> rollflow's).
    A named native format needs a template that renders ``tools=``, when the template is known."""
    if choice == "auto":
        return detect_tool_format(template)
    if choice not in FORMATS:
        raise ValueError(f"tool_format={choice!r} is not one of {', '.join(TOOL_FORMAT_CHOICES)}")
    chosen = FORMATS[choice]
    if chosen.in_template and template is not None and detect_tool_format(template) is ROLLFLOW:
        raise ValueError(
            f"tool_format={choice!r} has the chat template render tools=, but the policy's template "
            "never reads 'tools' (it would drop them): use tool_format='rollflow' or 'auto'"
        )
    return chosen


def chat_template_of(policy: object) -> str | Mapping[str, str] | None:
    """The chat template a policy renders with (its codec's tokenizer's), or None when it has
    none here (a policy behind an HTTP server). A wrapped policy is looked through (``inner``)."""
    for candidate in (policy, getattr(policy, "inner", None)):
        tokenizer = getattr(getattr(candidate, "codec", None), "tokenizer", None)
        if tokenizer is not None:
            return getattr(tokenizer, "chat_template", None)
    return None
