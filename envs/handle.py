"""The records and the interface the episode runner shares across both environment styles.

The runner (``rollflow.envs.runner``) loads and plays environments through these. The one
episode loop both styles play through, and what it records per episode, is
``rollflow.envs.loop``; the checks here (``checked_score``, ``describe_error``, ...) are
shared by that loop and the scorers.

The turn budget (``EpisodeLimits.turn_budget``) is an environment's own budget (a hook
environment's ``max_episode_turns``), capped by ``max_turns`` when that is set; an
environment without one (async style) needs ``max_turns``.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from rollflow.envs.agent import Policy
from rollflow.envs.checks import require_int
from rollflow.envs.episode import EpisodeRollout
from rollflow.envs.tracebacks import keep_traceback
from rollflow.envs.types import Split, Task, TaskExample

Style = Literal["hook", "async"]


@dataclass(frozen=True)
class TaskItem:
    """One task to play, whatever the style. ``task_id`` is stable across processes."""

    task_id: str
    payload: TaskExample | Task
    env: str | None = None  # the mixture member it came from (``envs/mixture.py``); None: the run's one env


NO_TURN_LIMIT = (
    "async-style environments need a turn limit: set [rollout].max_turns "
    "(EpisodeLimits(max_turns=...) from Python)"
)


@dataclass(frozen=True)
class EpisodeLimits:
    """``max_turns``: a cap on the assistant actions of an episode, or None for no cap.

    Hook style: the budget is the environment's ``max_episode_turns(example)``, as in the
    reference; ``max_turns``, when set, caps it (never raises it). Async style: required,
    as in the reference (the environment has no turn limit of its own).
    """

    max_turns: int | None = None

    def __post_init__(self) -> None:
        if self.max_turns is not None:
            require_int("max_turns", self.max_turns, minimum=1)

    def turn_budget(self, env_turns: int | None) -> int:
        """The turns one episode may take, given the environment's own budget (or None)."""
        if env_turns is None:
            if self.max_turns is None:
                raise ValueError(NO_TURN_LIMIT)
            return self.max_turns
        return env_turns if self.max_turns is None else min(env_turns, self.max_turns)


@dataclass(frozen=True)
class EpisodeScore:
    reward: float
    threshold: float | None
    components: Mapping[str, float] = field(default_factory=dict)
    error: str | None = None  # the scorer raised, or the episode itself errored


class EnvironmentHandle(Protocol):
    """One loaded environment, either style, as the rollout and scoring stages see it."""

    style: Style

    def tasks(self, split: Split) -> list[TaskItem]: ...

    async def play(self, item: TaskItem, policy: Policy, limits: EpisodeLimits) -> EpisodeRollout:
        """Play one episode. Never raises: failures come back as ``error``."""
        ...

    async def score(self, item: TaskItem, rollouts: Sequence[EpisodeRollout]) -> list[EpisodeScore]:
        """One score per rollout, in order. Never raises."""
        ...


def task_id_for(payload: TaskExample | Task) -> str:
    """The payload's own id, else a short hash of its content (stable across processes)."""
    if payload.id:
        return payload.id
    if isinstance(payload, TaskExample):
        content: Any = {"input": payload.input, "output": payload.output, "metadata": payload.metadata}
    else:
        content = {"prompt": payload.prompt, "target": payload.target, "metadata": payload.metadata}
    text = json.dumps(content, sort_keys=True, ensure_ascii=False, default=repr)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def describe_error(exc: BaseException, where: str) -> str:
    """``"ExceptionType: message (in where)"``: what ``EpisodeRollout.error`` holds; its
    traceback goes to ``envs/tracebacks.py`` for a stage that keeps them."""
    error = f"{type(exc).__name__}: {exc} (in {where})"
    keep_traceback(exc, error)
    return error


def error_score(error: str) -> EpisodeScore:
    return EpisodeScore(reward=0.0, threshold=None, components={}, error=error)


UNSCORED_EPISODE = "not scored: the episode ended with an error"


def checked_score(reward: object, where: str) -> float:
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise ValueError(f"{where} must be a finite number, got {reward!r}")
    return float(reward)


def checked_metrics(metrics: object, where: str) -> dict[str, float]:
    if not isinstance(metrics, Mapping):
        raise TypeError(f"{where} must be a mapping of name -> number, got {type(metrics).__name__}")
    return {str(name): checked_score(value, f"{where}[{name!r}]") for name, value in metrics.items()}
