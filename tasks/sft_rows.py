"""SFT rows: where supervised transcripts come from, and how they become tokens and a mask.

Not a stage: the SFT stage (``tasks/sft.py``) reads its rows through this module.

Sources (reference doc 000, "SFT targets for multi-turn"):

- a hook-style environment: one row per training example, ``prompt = start_episode(example,
  prompt_text)`` and ``target = sft_completion(example)``, with the example's
  ``tool_specs``. The multi-turn loop is not run.
- an agent environment (``rollflow.envs.openai_agent``) with an ``expert``: its agent played
  once per training task against the expert through the capture endpoint
  (``rollflow.envs.openai_agent_expert``); the prompt is the first call's messages as the
  policy sees them (system prompt and tool description in the tool-call format of training),
  the target the expert's replies and what the agent sent between them. Only the
  assistant's tokens are trained (``SFTExample.assistant_only``): the tool results are the
  user's own code's, which the policy never writes, and GRPO never trains them either.
- a transcripts file (``.jsonl`` or ``.parquet``), one message list per row: a JSON list, or
  an object ``{"messages": [...], "tools": [...], "id": "..."}`` (``tools`` and ``id``
  optional; in Parquet a ``messages`` column of structs or JSON text, optional ``tools``
  and ``id`` columns). The prompt is every message before the first assistant message;
  the target is the rest.

Tokens: a row is tokenised the way a rollout of its target would have been, through the
policy's chat codec (tool specs rendered exactly as during rollout):

    prompt ids   = codec.next_prompt(None, prompt)              mask 0
    per assistant message: its content's ids + the stop token    mask 1
    then the environment's messages that follow it, as the       mask 1
    codec's prompt delta (up to the next generation prompt)

so the tokens equal, id for id, what flattening a played episode with these actions gives;
only the mask differs: completion-only loss masks the prompt prefix and trains **every**
token of the target, the interleaved tool and user messages included (reference doc 000),
except in an ``assistant_only`` row, where those are context (mask 0), as in GRPO.

Simplified, and why:
- The target must start with an assistant message (the first thing the policy says after
  the opening messages); a template that rewrites earlier history between turns (the codec
  then resets) is refused rather than split into several rows.
- A target that ends on an environment message trains the next generation prompt too
  (the codec's delta runs up to it); targets normally end on the assistant's answer.
- File rows without ``tools`` render no tool descriptions: give the same ``tools`` the
  environment shows during rollout, or SFT and GRPO see different prompts.

A multi-turn environment that defines no ``sft_completion`` gets the default
(``envs/hooks.py: messages_from_output``): a scalar ``output`` becomes one assistant message,
the bare answer with no tool call. That is rarely the expert transcript SFT is for, so such
rows are marked (``SFTExample.bare_answer``) and ``bare_answer_note`` says so in one line
(a single-turn environment's reply *is* its answer: not marked). ``render_row`` shows a
row's text with its trained tokens marked (``rollflow sft CONFIG --preview N``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

from rollflow.envs.hook_handle import HookEnvironmentHandle
from rollflow.envs.mixture_handle import MixtureHandle
from rollflow.envs.openai_agent import AgentEnvironmentHandle
from rollflow.envs.openai_agent_expert import ExpertError, missing_expert, play_expert
from rollflow.envs.hooks import EnvironmentMultiTurn, call_hook, checked_message, example_prompt_text
from rollflow.envs.protocol import parse_action, render_tool_calls
from rollflow.envs.handle import task_id_for
from rollflow.envs.runner import load_environment_handle
from rollflow.envs.single_turn import EnvironmentSingleTurn
from rollflow.envs.types import Message, TaskExample, ToolCall, ToolSpec
from rollflow.policy.codec import ChatCodec


class SFTDataError(ValueError):
    """A transcript, file or environment cannot give SFT rows; the message names the row."""


@dataclass(frozen=True)
class SFTExample:
    """One supervised transcript before tokenisation."""

    row_id: str
    prompt: tuple[Message, ...]  # masked
    target: tuple[Message, ...]  # trained: every token, or the assistant's only (assistant_only)
    tool_specs: tuple[ToolSpec, ...] = ()
    bare_answer: bool = False  # the default sft_completion of a scalar output: one assistant message
    assistant_only: bool = False  # the target's non-assistant messages are context (mask 0)


@dataclass(frozen=True)
class SFTRow:
    row_id: str
    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]  # 0 = prompt (never trained), 1 = target

    def __post_init__(self) -> None:
        assert len(self.input_ids) == len(self.loss_mask), (
            f"row {self.row_id}: {len(self.input_ids)} ids but {len(self.loss_mask)} mask entries"
        )

    @property
    def num_trained(self) -> int:
        return sum(self.loss_mask)


# ---------------------------------------------------------------- sources


def examples_from_environment(
    spec: str, kwargs: Mapping[str, Any], limit: int | None = None, *,
    tokenizer: Callable[[], Any] | None = None, max_turns: int | None = None,
) -> list[SFTExample]:  # fmt: skip
    """``start_episode`` + ``sft_completion`` of each training example (the first ``limit``),
    or an agent environment's expert transcripts (``examples_from_agent``: ``tokenizer`` and
    ``max_turns`` are only for those)."""
    handle = load_environment_handle(spec, kwargs)
    if isinstance(handle, AgentEnvironmentHandle):
        return examples_from_agent(handle, limit, tokenizer, max_turns)
    if isinstance(handle, MixtureHandle):
        names = ", ".join(f"{m.label} ({m.name})" for m, _ in handle.members)
        raise SFTDataError(
            f"[env] is a mixture of {names}: SFT reads one hook-style environment's start_episode + "
            "sft_completion; run `rollflow sft` on a config naming one member, or give the transcripts "
            "as a file ([sft].transcripts)"
        )
    if not isinstance(handle, HookEnvironmentHandle):
        raise SFTDataError(
            f"{spec} is an async-style environment: SFT reads start_episode + sft_completion of a "
            "hook-style one; give the transcripts as a file instead ([sft].transcripts)"
        )
    env = handle.env
    default_hook = _uses_default_sft_completion(env)
    examples: list[SFTExample] = []
    for item in handle.tasks("train")[:limit]:
        example = cast(TaskExample, item.payload)
        where = f"{spec} example {item.task_id}"
        opening = asyncio.run(call_hook(env.start_episode, example, example_prompt_text(example)))
        prompt = [checked_message(m, f"{where} start_episode message {i}") for i, m in enumerate(opening)]
        target = [checked_message(m, f"{where} sft_completion message {i}")
                  for i, m in enumerate(env.sft_completion(example))]
        bare = default_hook and isinstance(example.output, str | int | float | bool)
        examples.append(_example(item.task_id, prompt, target, tuple(env.tool_specs(example)), where, bare))
    return examples


def examples_from_agent(
    handle: AgentEnvironmentHandle, limit: int | None, tokenizer: Callable[[], Any] | None, max_turns: int | None
) -> list[SFTExample]:
    """The expert transcripts of the first ``limit`` training tasks, trained on the assistant's
    tokens only. ``tokenizer`` loads the policy's: its chat template picks the tool format, as
    in training (None: the environment's ``tool_format``, rollflow's protocol for "auto")."""
    if handle.env.expert is None:
        raise SFTDataError(missing_expert(handle))
    codec = ChatCodec(tokenizer()) if tokenizer is not None else None
    try:
        played = asyncio.run(play_expert(handle, handle.tasks("train")[:limit], codec=codec, max_turns=max_turns))
    except ExpertError as error:
        raise SFTDataError(str(error)) from None
    where = handle.env.names.get("expert", "the expert")
    return [
        replace(_example(t.row_id, t.prompt, t.target, t.tool_specs, f"{where} task {t.row_id}"), assistant_only=True)
        for _, found in played for t in found
    ]  # fmt: skip


def _uses_default_sft_completion(env: EnvironmentMultiTurn) -> bool:
    """A multi-turn environment that inherits ``sft_completion`` (a single-turn one's reply is
    its answer, so the default is its right target)."""
    inherited = type(env).sft_completion is EnvironmentMultiTurn.sft_completion
    return inherited and not isinstance(env, EnvironmentSingleTurn)


def bare_answer_note(spec: str, examples: Sequence[SFTExample]) -> str | None:
    """One line when rows train on the bare answer (``SFTExample.bare_answer``); else None."""
    bare = [example for example in examples if example.bare_answer]
    if not bare:
        return None
    shown = bare[0].target[0]["content"]
    return (
        f"sft: {spec} defines no sft_completion, so {len(bare)} of {len(examples)} SFT rows train on "
        f"the example's output alone as one assistant message (e.g. {shown[:40]!r}), not an expert "
        "transcript with its tool calls; for those, define sft_completion(example) returning the "
        "expert's messages, or set [sft].transcripts to a .jsonl of transcripts "
        "(see the rows first: rollflow sft CONFIG --preview 3)"
    )


def examples_from_file(path: str | Path, limit: int | None = None) -> list[SFTExample]:
    """Transcripts from a ``.jsonl`` or ``.parquet`` file of message lists."""
    path = Path(path)
    if not path.is_file():
        raise SFTDataError(f"transcripts file not found: {path}")
    if path.suffix == ".jsonl":
        records = _jsonl_records(path)
    elif path.suffix == ".parquet":
        records = _parquet_records(path)
    else:
        raise SFTDataError(f"{path}: transcripts must be a .jsonl or .parquet file")
    examples = [_file_example(record, f"{path} row {index}") for index, record in enumerate(records)]
    if not examples:
        raise SFTDataError(f"{path} holds no transcripts")
    return examples[:limit]


def _jsonl_records(path: Path) -> list[Any]:
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise SFTDataError(f"{path} line {number} is not JSON: {error}") from None
    return records


def _parquet_records(path: Path) -> list[Any]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    if "messages" not in table.column_names:
        raise SFTDataError(f"{path} has no 'messages' column (it has {table.column_names})")
    return table.select([c for c in ("messages", "tools", "id") if c in table.column_names]).to_pylist()


def _file_example(record: Any, where: str) -> SFTExample:
    if isinstance(record, list):
        record = {"messages": record}
    if not isinstance(record, Mapping) or "messages" not in record:
        raise SFTDataError(f"{where}: expected a message list or an object with 'messages'")
    messages, tools = _decoded(record["messages"], where), _decoded(record.get("tools") or [], where)
    if not isinstance(messages, list) or not isinstance(tools, list):
        raise SFTDataError(f"{where}: 'messages' and 'tools' must be lists")
    checked = [_file_message(m, f"{where} message {i}") for i, m in enumerate(messages)]
    first = next((i for i, m in enumerate(checked) if m["role"] == "assistant"), None)
    if first is None:
        raise SFTDataError(f"{where}: no assistant message, so nothing to train on")
    row_id = str(record.get("id") or task_id_for(TaskExample(input=json.dumps(messages, sort_keys=True))))
    return _example(row_id, checked[:first], checked[first:], tuple(tools), where)


def _decoded(value: Any, where: str) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as error:
        raise SFTDataError(f"{where}: not JSON: {error}") from None


def _file_message(message: Any, where: str) -> Message:
    """A message from a file: null fields dropped (Parquet structs), flat tool calls nested."""
    if isinstance(message, Mapping):
        message = {k: v for k, v in message.items() if v is not None and k != "extra_json"}
        calls = message.get("tool_calls")
        if calls and all(isinstance(c, Mapping) and "function" not in c for c in calls):
            message["tool_calls"] = [
                {"id": c.get("id") or f"call_{i}", "type": "function",
                 "function": {"name": c["name"], "arguments": c["arguments"]}}
                for i, c in enumerate(calls)
            ]
    try:
        return checked_message(message, where)
    except TypeError as error:
        raise SFTDataError(str(error)) from None


def _example(
    row_id: str, prompt: Sequence[Message], target: Sequence[Message], tools: tuple[ToolSpec, ...], where: str,
    bare_answer: bool = False,
) -> SFTExample:
    if not prompt:
        raise SFTDataError(f"{where}: the prompt is empty; the policy needs something to answer")
    if not target or target[0]["role"] != "assistant":
        first = target[0]["role"] if target else "nothing"
        raise SFTDataError(
            f"{where}: the SFT target must start with an assistant message, got {first}; "
            "opening user/system messages belong in start_episode"
        )
    return SFTExample(row_id, tuple(prompt), tuple(_as_action(m) for m in target), tools, bare_answer)


def _as_action(message: Message) -> Message:
    """An assistant message whose calls are only structured gets them in its text too,
    as the runner writes every action, so the policy learns to write the protocol."""
    calls = message.get("tool_calls")
    if message["role"] != "assistant" or not calls:
        return message
    if len(parse_action(message["content"]).tool_calls) == len(calls):
        return message
    text = "\n".join(part for part in (message["content"], render_tool_calls(cast(list[ToolCall], calls))) if part)
    return parse_action(text).to_message(text)


# ---------------------------------------------------------------- tokens and mask


def tokenize_example(codec: ChatCodec, example: SFTExample) -> SFTRow:
    """The row's ids as a rollout of its target would give them; mask 0 on the prompt only."""
    tools, prompt, target = list(example.tool_specs), list(example.prompt), list(example.target)
    state, prompt_ids, _ = codec.next_prompt(None, prompt, tools)
    ids, mask = list(prompt_ids), [0] * len(prompt_ids)
    for start, end in _assistant_runs(target):
        content = target[start]["content"]
        rendered = codec.render_text([*prompt, *target[:end]], tools)
        if not rendered.startswith(state.text + content):
            raise SFTDataError(
                f"row {example.row_id}: the chat template does not render target message {start} "
                "after the conversation so far (it rewrites history); such templates are not supported"
            )
        action_ids = codec.encode(content) + _stop_after(codec, rendered[len(state.text) + len(content):])
        state = codec.record_action(state, action_ids)
        ids += action_ids
        mask += [1] * len(action_ids)
        if end > start + 1:  # the environment's messages after this action
            state, delta_ids, reset = codec.next_prompt(state, [*prompt, *target[:end]], tools)
            if reset:
                raise SFTDataError(f"row {example.row_id}: the template rewrote history after message {start}")
            ids += delta_ids
            mask += [0 if example.assistant_only else 1] * len(delta_ids)
    if not any(mask):
        raise SFTDataError(f"row {example.row_id}: the target renders to no tokens at all")
    return SFTRow(example.row_id, tuple(ids), tuple(mask))


def _assistant_runs(target: Sequence[Message]) -> list[tuple[int, int]]:
    """``(start, end)`` per assistant message: ``target[start]`` and the messages up to the next one."""
    starts = [i for i, m in enumerate(target) if m["role"] == "assistant"]
    return list(zip(starts, [*starts[1:], len(target)], strict=True))


def _stop_after(codec: ChatCodec, rest: str) -> list[int]:
    """The stop token the template writes right after an action's content, as a sampled
    action would end; none when the template writes something else there."""
    for stop_id in sorted(codec.stop_token_ids):
        text = codec.tokenizer.decode([stop_id], skip_special_tokens=False)
        if text and rest.startswith(text):
            return [stop_id]
    return []


TRAINED_MARKS = ("⟦", "⟧")  # around the trained tokens in ``render_row``


def render_row(codec: ChatCodec, row: SFTRow) -> str:
    """The row's text as the model reads it, its trained tokens (mask 1) between ``TRAINED_MARKS``."""
    parts: list[str] = []
    start = 0
    for end in range(1, len(row.input_ids) + 1):
        if end == len(row.input_ids) or row.loss_mask[end] != row.loss_mask[start]:
            text = codec.tokenizer.decode(list(row.input_ids[start:end]), skip_special_tokens=False)
            parts.append(f"{TRAINED_MARKS[0]}{text}{TRAINED_MARKS[1]}" if row.loss_mask[start] else text)
            start = end
    return "".join(parts)
