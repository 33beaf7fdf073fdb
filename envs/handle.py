"""The records and the interface the episode runner shares across both environment styles.

``rollflow.envs.runner`` re-exports everything public here; import from there. This module also
holds ``EpisodeTrace``, the private accumulator one ``play`` call fills as its episode
runs, so both styles record actions, turns and endings the same way.

Rules both styles follow, recorded here once:
- ``finish_reason == "context"`` ends the episode ``context_overflow`` without stepping
  the environment. What was sampled, if anything, is kept (its text as a plain assistant
  message, its tokens in ``actions``, one turn); an action with neither text nor tokens
  (the prompt alone filled the budget) is not a turn and leaves nothing.
- An action's tokens become an ``ActionTokens`` only when the policy gave tokens; a
  scripted policy's episode has no ``actions``.
- ``policy_version`` is read when the episode starts: the age of an episode is measured
  from the policy that began it.
- The turn budget (``EpisodeLimits.turn_budget``): an environment's own budget (a hook
  environment's ``max_episode_turns``), capped by ``max_turns`` when that is set; an
  environment without one (async style) needs ``max_turns``.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from rollflow.envs.agent import Policy, PolicyAction, PolicySession
from rollflow.envs.checks import require_int
from rollflow.envs.episode import ActionTokens, EpisodeRollout
from rollflow.envs.tracebacks import keep_traceback
from rollflow.envs.types import Message, Split, Task, TaskExample, TruncationCause

Style = Literal["hook", "async"]


@dataclass(frozen=True)
class TaskItem:
    """One task to play, whatever the style. ``task_id`` is stable across processes."""

    task_id: str
    payload: TaskExample | Task


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


class StageFailure(Exception):
    """An exception raised inside a named call (a hook); the episode's error names that call."""

    def __init__(self, where: str, cause: Exception) -> None:
        super().__init__(f"{where}: {cause}")
        self.where = where
        self.cause = cause


@contextmanager
def stage(where: str) -> Iterator[None]:
    """Inside, an exception becomes the episode's error "(in ``where``)", whatever the
    loop's own stage: the hook adapter names the hook that raised, not ``Env.step``."""
    try:
        yield
    except StageFailure:
        raise
    except Exception as exc:
        raise StageFailure(where, exc) from exc


def error_score(error: str) -> EpisodeScore:
    return EpisodeScore(reward=0.0, threshold=None, components={}, error=error)


UNSCORED_EPISODE = "not scored: the episode ended with an error"


def checked_score(reward: object, where: str) -> float:
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise ValueError(f"{where} must be a finite number, got {reward!r}")
    return float(reward)


class EpisodeTrace:
    """What one episode has done so far; ``finish`` turns it into the rollout record.

    Private to one ``play`` call, so mutating it is safe; the record it yields is frozen.
    """

    def __init__(self, policy: Policy) -> None:
        self.started = time.perf_counter()
        self.policy_version = int(getattr(policy, "version", 0))
        self.messages: list[Message] = []
        self.actions: list[ActionTokens] = []
        self.step_metadata: list[Mapping[str, Any]] = []
        self.turns = 0
        self.sampling_attempts = 0
        self.response_text = ""
        self.stage = "start"  # the call in progress, named in the error if it raises

    def record_action(self, action: PolicyAction) -> None:
        """Count the action as a turn and keep its tokens (see the module rules)."""
        if not isinstance(action, PolicyAction):
            raise TypeError(f"the policy returned {type(action).__name__}, not a PolicyAction")
        if not isinstance(action.text, str):
            raise TypeError(f"the policy's action text is a {type(action.text).__name__}, not str")
        self.sampling_attempts += action.sampling_attempts
        if action.finish_reason == "context" and not action.text and not action.token_ids:
            return
        self.turns += 1
        self.response_text = action.text
        if action.token_ids or action.prompt_delta_ids:
            self.actions.append(
                ActionTokens(
                    prompt_delta_ids=action.prompt_delta_ids,
                    reset=action.reset,
                    token_ids=action.token_ids,
                    logprobs=action.logprobs,
                    finish_reason=action.finish_reason,
                )
            )

    def finish(
        self,
        *,
        terminated: bool = False,
        cause: TruncationCause | None = None,
        error: str | None = None,
        env_reward: float | None = None,
        env_metrics: Mapping[str, float] | None = None,
    ) -> EpisodeRollout:
        return EpisodeRollout(
            messages=tuple(self.messages),
            response_text=self.response_text,
            turns=self.turns,
            terminated=terminated and error is None,
            truncated=cause is not None and error is None,
            truncation_cause=cause if error is None else None,
            error=error,
            env_reward=env_reward if error is None else None,
            env_metrics=dict(env_metrics or {}) if error is None else {},
            step_metadata=tuple(self.step_metadata),
            actions=tuple(self.actions),
            latency_s=time.perf_counter() - self.started,
            policy_version=self.policy_version,
            sampling_attempts=self.sampling_attempts,
        )


async def next_action(session: PolicySession, trace: EpisodeTrace) -> PolicyAction | None:
    """The policy's next action, recorded on ``trace``.

    None when the policy reports the context budget spent: the caller ends the episode
    ``context_overflow`` without stepping the environment; partial text stays visible.
    """
    trace.stage = "PolicySession.act"
    action = await session.act(list(trace.messages))
    trace.record_action(action)
    if action.finish_reason == "context":
        if action.text:
            trace.messages.append({"role": "assistant", "content": action.text})
        return None
    return action


class Cleanup:
    """Closers to run when an episode ends, however it ends (cancellation included)."""

    def __init__(self) -> None:
        self._closers: list[tuple[str, Callable[[], Awaitable[object]]]] = []

    def add(self, where: str, close: Callable[[], Awaitable[object]]) -> None:
        self._closers.append((where, close))

    async def run(self) -> str | None:
        """Run every closer, newest first; the first failure, described, or None."""
        first_error: str | None = None
        for where, close in reversed(self._closers):
            try:
                await close()
            except Exception as exc:  # a failing close is recorded, the others still run
                first_error = first_error or describe_error(exc, where)
        self._closers.clear()
        return first_error


async def play_safely(
    trace: EpisodeTrace, run: Callable[[Cleanup], Awaitable[EpisodeRollout]]
) -> EpisodeRollout:
    """Run one episode body; an exception becomes the rollout's error, closers always run."""
    cleanup = Cleanup()
    try:
        try:
            rollout = await run(cleanup)
        except StageFailure as exc:
            rollout = trace.finish(error=describe_error(exc.cause, exc.where))
        except Exception as exc:  # failures are data: one bad episode never sinks the batch
            rollout = trace.finish(error=describe_error(exc, trace.stage))
    finally:
        close_error = await cleanup.run()
    if close_error is not None and rollout.error is None:
        rollout = trace.finish(error=close_error)
    return rollout


def checked_metrics(metrics: object, where: str) -> dict[str, float]:
    if not isinstance(metrics, Mapping):
        raise TypeError(f"{where} must be a mapping of name -> number, got {type(metrics).__name__}")
    return {str(name): checked_score(value, f"{where}[{name!r}]") for name, value in metrics.items()}
