"""Async-style environments (``Env``): the environment owns the transcript and the tools.

``reset(task)`` returns the opening messages; each ``step(message)`` takes the parsed
assistant message (``content`` plus any structured ``tool_calls``), runs what it asks and
returns a ``StepResult`` holding the whole history so far (it must start with the previous
history: a step that returns only the new messages fails its episode). ``terminated``
means the task logic ended the episode; ``truncated`` means the environment cut it short
(the runner records cause ``env``). The runner reads ``reward`` and ``metrics`` only from
the last step of the episode: the one that ends it, or the last one before the runner
ended it (out of turns, context or a parse failure). It always calls ``close()``, however
the episode ends.

One ``Env`` object plays one episode: the runner asks ``AsyncEnvSuite.env_factory`` for a
fresh one per episode, so instance state is safe here (unlike the hook style).

``AsyncEnvSuite`` is what an async-style ``load_environment(**kwargs)`` returns: the
train and validation tasks and the factory, the same three things the reference's
``train_multi_turn(config, tasks, env_factory, val_tasks)`` takes.

Our additions, so that hook-style episodes run through this same shape (one hook
environment's episode is adapted to an ``Env`` in ``rollflow.envs.hook_handle``) and the
runner has one loop; an async environment rarely needs them:
- ``max_episode_turns()``: the episode's own turn budget, read after ``reset``; None (the
  default) leaves ``[rollout].max_turns`` alone to bound it, which async style requires.
- ``checks_tool_protocol`` (default True): False means actions are free text: never a
  ``parse_failure``, never structured ``tool_calls``.
- ``AnnotatedStepResult``: a ``StepResult`` that also carries the hook style's
  ``final_response_text`` (the text scored) and per-step ``metadata`` (kept on the rollout).
- ``AsyncEnvSuite.pass_threshold``: the reward every episode of the suite must reach to
  count as passed (the hook style's ``RewardResult.threshold``); None (the default) leaves
  ``passed`` at ``reward > 0``. An adapter whose reward pays partial credit sets it, so that
  a pass means solved.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollflow.envs.handle import checked_score
from rollflow.envs.type_names import type_mismatch
from rollflow.envs.types import Message, StepResult, Task, ToolSpec


class Env(abc.ABC):
    checks_tool_protocol: bool = True

    @abc.abstractmethod
    async def reset(self, task: Task) -> list[Message]:
        """Start an episode of ``task``; return the opening messages."""

    @abc.abstractmethod
    async def step(self, message: Message) -> StepResult:
        """Consume one assistant message; return the history and whether it ended."""

    @property
    @abc.abstractmethod
    def tool_specs(self) -> list[ToolSpec]:
        """The tools the policy may call, rendered into its prompt."""

    @property
    @abc.abstractmethod
    def messages(self) -> list[Message]:
        """The transcript so far."""

    async def close(self) -> None:
        """Release what ``reset`` started (a subprocess, a connection). Default: nothing."""
        return None

    def max_episode_turns(self) -> int | None:
        """This episode's own turn budget, asked after ``reset``. Default: none of its own."""
        return None


@dataclass(frozen=True)
class AnnotatedStepResult(StepResult):
    """A ``StepResult`` plus what a hook-style ``EnvironmentStepResult`` also says."""

    final_response_text: str | None = None  # overrides the last action as the scored text
    metadata: Mapping[str, Any] = field(default_factory=dict)  # kept in rollout.step_metadata


@dataclass(frozen=True)
class AsyncEnvSuite:
    tasks: Sequence[Task]
    val_tasks: Sequence[Task]
    env_factory: Callable[[Task], Env]
    pass_threshold: float | None = None  # reward >= this is a pass; None: reward > 0

    def __post_init__(self) -> None:
        for name, tasks in (("tasks", self.tasks), ("val_tasks", self.val_tasks)):
            for index, task in enumerate(tasks):
                if not isinstance(task, Task):
                    raise TypeError(f"{name}[{index}] is {type_mismatch(task, Task)}")
        if not self.tasks:
            raise ValueError("an AsyncEnvSuite needs at least one training task")
        if not callable(self.env_factory):
            raise TypeError(f"env_factory must be callable (task -> Env), got {self.env_factory!r:.100}")
        if self.pass_threshold is not None:
            checked_score(self.pass_threshold, "AsyncEnvSuite.pass_threshold")
