"""Hook-style environments (``EnvironmentMultiTurn``): the runner drives your hooks.

Subclass ``EnvironmentMultiTurn`` and implement four hooks: ``start_episode`` (the opening
messages), ``max_episode_turns``, ``step_episode`` (react to the action that was just
appended to ``messages``) and ``score_episode`` (grade a finished transcript). The runner
plays each episode through its one loop (``rollflow.envs.hook_handle`` adapts the hooks to
it); its semantics are the reference's exactly. ``max_episode_turns`` is the episode's
budget; ``[rollout].max_turns``, when set, caps it.

Environments are stateless between calls: many episodes of one example run at the same
time, so the transcript is the only episode state. That is also why hooks may run on
worker threads: a plain ``def`` hook is called through ``asyncio.to_thread`` so a slow one
does not stall other episodes, and a hook may instead be ``async def`` (the bundled
tool-use game is, because its tools are async).

Defaults and our additions:
- ``score_episodes`` calls ``score_episode`` for each episode, at most
  ``max_score_concurrency`` at a time (threads; an ``async`` scorer runs in each thread's
  own event loop). The runner calls it once per GRPO group.
- ``sft_completion`` turns ``example.output`` into target messages: a scalar becomes one
  assistant message; a message list, or ``{"messages": [...]}``, is the transcript. A
  scalar is the bare answer, without the tool calls that led to it, so ``rollflow sft``
  says in one line when it trains on such rows (``tasks/sft_rows.py: bare_answer_note``);
  override it to return the expert's transcript.
- ``tool_specs(example)`` (default: none) tells the policy which tools to describe.
- ``examples(split)``: the rows to play. The default reads a ``dataset`` attribute, like
  the reference's ``AgentEnv``: either one list of rows (the loader already chose the
  split, so both splits see it) or a mapping ``{"train": rows, "validation": rows}``. A row
  is a ``TaskExample`` or a dict with ``input`` (and optionally ``output``, ``metadata``,
  ``id``; other keys join ``metadata``). We chose an attribute over a required hook so the
  reference's examples run unchanged.
- ``checks_tool_protocol`` (default True): the runner parses each action with the
  tool-call protocol and ends the episode as ``parse_failure`` on malformed calls. Set it
  False for free-text games (e.g. ``guess_number``): actions are then never parse failures
  and carry no structured ``tool_calls``.
"""

from __future__ import annotations

import abc
import asyncio
import inspect
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

from rollflow.envs.type_names import type_mismatch
from rollflow.envs.types import (
    EnvironmentEpisode,
    EnvironmentStepResult,
    Message,
    RewardResult,
    Split,
    TaskExample,
    ToolSpec,
)

SPLITS: tuple[Split, ...] = ("train", "validation")


class EnvironmentMultiTurn(abc.ABC):
    max_score_concurrency: int = 8
    checks_tool_protocol: bool = True

    @abc.abstractmethod
    def start_episode(self, example: TaskExample, prompt_text: str) -> list[Message]:
        """The opening messages (e.g. a system prompt and the user's request)."""

    @abc.abstractmethod
    def max_episode_turns(self, example: TaskExample) -> int:
        """How many assistant actions this example may take before it is cut off."""

    @abc.abstractmethod
    def step_episode(
        self, example: TaskExample, messages: list[Message], assistant_response: str
    ) -> EnvironmentStepResult | Awaitable[EnvironmentStepResult]:
        """React to ``assistant_response``, already the last element of ``messages``.

        May be ``async def`` (hence the ``Awaitable`` in the type); the runner awaits it.
        """

    @abc.abstractmethod
    def score_episode(
        self, example: TaskExample, episode: EnvironmentEpisode
    ) -> RewardResult | Awaitable[RewardResult]:
        """Grade one finished transcript. May be ``async def``."""

    def score_episodes(
        self, example: TaskExample, episodes: Sequence[EnvironmentEpisode]
    ) -> list[RewardResult]:
        """Score a group: ``score_episode`` for each, ``max_score_concurrency`` at a time."""
        results = score_each(self, example, episodes)
        for result in results:
            if isinstance(result, Exception):
                raise result
        return [result for result in results if isinstance(result, RewardResult)]

    def sft_completion(self, example: TaskExample) -> list[Message]:
        """The supervised target for ``example``, built from ``example.output``."""
        return messages_from_output(example.output, where=f"example {example.id or example.input!r}")

    def tool_specs(self, example: TaskExample) -> Sequence[ToolSpec]:
        return ()

    def examples(self, split: Split) -> Sequence[TaskExample]:
        check_split(split)
        dataset = getattr(self, "dataset", None)
        name = type(self).__name__
        if dataset is None:
            raise NotImplementedError(
                f"{name} has no `dataset` attribute: set one (a list of rows, or "
                '{"train": rows, "validation": rows}) or override examples(split)'
            )
        if isinstance(dataset, Mapping):
            if split not in dataset:
                raise ValueError(f"{name}.dataset has no {split!r} split; it has {sorted(dataset)}")
            dataset = dataset[split]
        return [as_task_example(row, f"{name}.dataset[{index}]") for index, row in enumerate(dataset)]


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")


def as_task_example(row: object, where: str) -> TaskExample:
    """A dataset row as a ``TaskExample`` (see ``EnvironmentMultiTurn.examples``)."""
    if isinstance(row, TaskExample):
        return row
    if not isinstance(row, Mapping) or "input" not in row:
        raise ValueError(f"{where} must be a TaskExample or a dict with an 'input' key, got {row!r:.200}")
    known = {"input", "output", "metadata", "id"}
    metadata = dict(row.get("metadata") or {})
    metadata.update({key: value for key, value in row.items() if key not in known})
    row_id = row.get("id")
    return TaskExample(
        input=row["input"],
        output=row.get("output"),
        metadata=metadata,
        id=None if row_id is None else str(row_id),
    )


def example_prompt_text(example: TaskExample) -> str:
    """The ``prompt_text`` handed to ``start_episode``: the input, as text."""
    if isinstance(example.input, str):
        return example.input
    return json.dumps(example.input, sort_keys=True, ensure_ascii=False, default=str)


def messages_from_output(output: object, where: str) -> list[Message]:
    """A scalar -> one assistant message; a message list or ``{"messages": [...]}`` -> itself."""
    if output is None:
        raise ValueError(f"{where} has no output to build an SFT target from")
    if isinstance(output, str | int | float | bool):
        return [{"role": "assistant", "content": str(output)}]
    if isinstance(output, Mapping):
        if "messages" not in output:
            raise ValueError(f"{where}: a dict output needs a 'messages' key, got keys {sorted(output)}")
        output = output["messages"]
    if not isinstance(output, Sequence) or isinstance(output, str):
        raise ValueError(
            f"{where}: output must be a scalar or a list of messages, got {type(output).__name__}"
        )
    return [checked_message(message, f"{where} message {i}") for i, message in enumerate(output)]


def checked_message(message: object, where: str) -> Message:
    """A copy of ``message`` once it has a text ``role`` and ``content``; else a TypeError."""
    if not isinstance(message, Mapping):
        raise TypeError(f"{where} is a {type(message).__name__}, not a message dict")
    if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
        raise TypeError(f"{where} needs text 'role' and 'content', got {dict(message)!r:.200}")
    return cast(Message, dict(message))


def checked_messages(messages: object, where: str) -> list[Message]:
    """Copies of ``messages`` (a list or tuple of message dicts); else a TypeError."""
    if not isinstance(messages, list | tuple):
        raise TypeError(f"{where} returned {type(messages).__name__}; expected a list of messages")
    return [checked_message(message, f"{where} message {i}") for i, message in enumerate(messages)]


def score_each(
    env: EnvironmentMultiTurn, example: TaskExample, episodes: Sequence[EnvironmentEpisode]
) -> list[RewardResult | Exception]:
    """``score_episode`` for every episode, each failure kept apart as its exception."""
    if not episodes:
        return []
    workers = max(1, min(env.max_score_concurrency, len(episodes)))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="score") as pool:
        futures = [pool.submit(_score_one, env, example, episode) for episode in episodes]
        return [future.result() for future in futures]


def _score_one(
    env: EnvironmentMultiTurn, example: TaskExample, episode: EnvironmentEpisode
) -> RewardResult | Exception:
    try:
        result: Any = env.score_episode(example, episode)
        if inspect.isawaitable(result):
            result = asyncio.run(_awaited(result))
        if not isinstance(result, RewardResult):
            raise TypeError(f"score_episode returned {type_mismatch(result, RewardResult)}")
        return result
    except Exception as exc:  # kept as data: one bad score must not sink its group
        return exc


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


async def call_hook(hook: Callable[..., Any], *args: Any) -> Any:
    """Call a plain hook on a worker thread, or await an ``async`` one."""
    if inspect.iscoroutinefunction(hook):
        return await hook(*args)
    result = await asyncio.to_thread(hook, *args)
    if inspect.isawaitable(result):
        result = await result
    return result


async def call_setup_hook(hook: Callable[..., Any], *args: Any) -> Any:
    """Call a cheap set-up hook (``start_episode``, ``max_episode_turns``) in the event loop.

    Unlike ``call_hook`` it does not hop to a worker thread, so every episode of a batch
    reaches the policy in the order it was started: the first generation batch holds them
    all, in the same order on every run (a replayed rollout samples the same tokens with
    bit-identical logprobs). A set-up hook that blocks for long delays the others.
    """
    result = hook(*args)
    if inspect.isawaitable(result):
        result = await result
    return result


def overrides(env: object, name: str) -> bool:
    """Whether ``env``'s class replaces the base ``EnvironmentMultiTurn`` hook ``name``."""
    return getattr(type(env), name) is not getattr(EnvironmentMultiTurn, name)
