"""The one episode loop, shared by both environment styles.

``play_episode(policy, limits, open_env)`` is what a handle's ``play`` calls: ``open_env()``
builds the ``Env`` and the ``Task`` of one episode (an async-style suite's ``env_factory``;
for a hook-style environment an adapter, ``rollflow.envs.hook_handle.HookEpisodeEnv``, that
gives one hook episode the ``Env`` shape), and ``play_env_episode`` plays it, so turn
handling and endings live here once. It never raises: an exception becomes the rollout's
``error``, naming the call that raised (``stage``), and every closer runs (``Cleanup``).

The loop: ``reset(task)``; then, up to the turn budget (``EpisodeLimits.turn_budget``:
``[rollout].max_turns``, or an environment's own ``max_episode_turns()`` capped by it),
sample an action, parse it with the tool-call protocol and hand the structured message to
``step(message)``. The history the step returns must extend the previous one (start with
it) and becomes the transcript; a step that returns anything else, such as only the new
messages, fails its episode with an error naming ``Env.step``. We refuse rather than guess:
a list that does not start with the history could be a delta or a rewritten history, and
the two cannot be told apart in general. ``terminated`` ends the episode (it wins when a
step says both); ``truncated`` ends it with cause ``env``. A malformed tool call ends it
``parse_failure`` and a spent context budget ``context_overflow``, neither stepping the
environment; running out of turns gives ``max_turns``. The reward and metrics are those of
the last step taken (the one that ended the episode, or the last before the budget ran
out); none when no step ran. ``close()`` runs every time.

What one episode records (``EpisodeTrace``):
- ``finish_reason == "context"`` ends the episode ``context_overflow`` without stepping
  the environment. What was sampled, if anything, is kept (its text as a plain assistant
  message, its tokens in ``actions``, one turn); an action with neither text nor tokens
  (the prompt alone filled the budget) is not a turn and leaves nothing.
- An action's tokens become an ``ActionTokens`` only when the policy gave tokens; a
  scripted policy's episode has no ``actions``.
- ``policy_version`` is read when the episode starts: the age of an episode is measured
  from the policy that began it.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from rollflow.envs.agent import Policy, PolicyAction, PolicySession
from rollflow.envs.env import AnnotatedStepResult, Env
from rollflow.envs.episode import ActionTokens, EpisodeRollout
from rollflow.envs.handle import EpisodeLimits, checked_metrics, checked_score, describe_error
from rollflow.envs.hooks import checked_messages
from rollflow.envs.protocol import parse_action
from rollflow.envs.type_names import type_mismatch
from rollflow.envs.types import Message, StepResult, Task, TruncationCause


async def play_episode(
    policy: Policy, limits: EpisodeLimits, open_env: Callable[[], tuple[Env, Task]]
) -> EpisodeRollout:
    """Play one episode of the ``Env`` that ``open_env()`` builds. Never raises."""
    trace = EpisodeTrace(policy)

    async def run(cleanup: Cleanup) -> EpisodeRollout:
        env, task = open_env()
        return await play_env_episode(env, task, policy, limits, trace, cleanup)

    return await play_safely(trace, run)


async def play_env_episode(
    env: Env, task: Task, policy: Policy, limits: EpisodeLimits, trace: EpisodeTrace, cleanup: Cleanup
) -> EpisodeRollout:
    """Play one episode of ``env`` on ``trace`` (the module docstring has the rules)."""
    cleanup.add("Env.close", env.close)
    trace.stage = "Env.reset"
    trace.messages = checked_messages(await env.reset(task), "Env.reset")
    trace.stage = "EpisodeLimits"
    max_turns = limits.turn_budget(env.max_episode_turns() if isinstance(env, Env) else None)
    checks_protocol = env.checks_tool_protocol if isinstance(env, Env) else True
    trace.stage = "Env.tool_specs"
    tool_specs = list(env.tool_specs)
    trace.stage = "Policy.open_session"
    session = policy.open_session(tool_specs)
    cleanup.add("PolicySession.close", session.close)
    last: StepResult | None = None
    for _ in range(max_turns):
        action = await next_action(session, trace)
        if action is None:
            return _finish(trace, last, cause=TruncationCause.CONTEXT_OVERFLOW)
        message, parse_failed = _action_message(action.text, checks_protocol)
        if parse_failed:
            trace.messages.append(message)
            return _finish(trace, last, cause=TruncationCause.PARSE_FAILURE)
        last = await _step(env, message, trace)
        if last.terminated or last.truncated:
            return _finish(trace, last, cause=None if last.terminated else TruncationCause.ENV)
    return _finish(trace, last, cause=TruncationCause.MAX_TURNS)


def _action_message(text: str, checks_protocol: bool) -> tuple[Message, bool]:
    """The assistant message for ``text`` and whether it is a malformed tool call."""
    if not checks_protocol:
        return {"role": "assistant", "content": text}, False
    parsed = parse_action(text)
    return parsed.to_message(text), parsed.kind == "parse_failure"


async def _step(env: Env, message: Message, trace: EpisodeTrace) -> StepResult:
    """Step ``env`` with ``message`` and record the step on ``trace``."""
    before = trace.messages
    trace.messages = [*before, message]  # what an error record shows if the step fails
    trace.stage = "Env.step"
    result = await env.step(message)
    if not isinstance(result, StepResult):
        raise TypeError(f"Env.step returned {type_mismatch(result, StepResult)}")
    trace.messages = extended_history(before, checked_messages(result.messages, "Env.step"), message)
    if isinstance(result, AnnotatedStepResult):
        trace.step_metadata.append(dict(result.metadata))
        if result.final_response_text is not None:
            trace.response_text = result.final_response_text
    return result


def extended_history(before: list[Message], returned: list[Message], action: Message) -> list[Message]:
    """``returned`` when it starts with ``before`` (a step returns the whole history)."""
    if returned[: len(before)] == before:
        return returned
    mismatch = next(
        (i for i, (old, new) in enumerate(zip(before, returned, strict=False)) if old != new),
        len(returned),
    )
    hint = (
        "; it looks like only the new messages"
        if returned and returned[0].get("content") == action.get("content")
        else ""
    )
    raise ValueError(
        f"Env.step returned {len(returned)} messages that do not start with the {len(before)} "
        f"messages of the history before this step (first difference: message {mismatch}){hint}. "
        "Env.step must return the whole history so far: the previous messages, this action, "
        "then the environment's replies"
    )


def _finish(trace: EpisodeTrace, last: StepResult | None, *, cause: TruncationCause | None) -> EpisodeRollout:
    """The rollout, with the reward and metrics of the last step taken (if any)."""
    if last is None:
        return trace.finish(cause=cause)
    trace.stage = "Env.step"  # a bad reward or metric is that step's fault
    return trace.finish(
        terminated=cause is None,
        cause=cause,
        env_reward=checked_score(last.reward, "StepResult.reward"),
        env_metrics=checked_metrics(last.metrics, "StepResult.metrics"),
    )


# ---------------------------------------------------------------- one episode's record and cleanup


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
        self.replica: int | None = None
        self.response_text = ""
        self.stage = "start"  # the call in progress, named in the error if it raises

    def record_action(self, action: PolicyAction) -> None:
        """Count the action as a turn and keep its tokens (see the module rules)."""
        if not isinstance(action, PolicyAction):
            raise TypeError(f"the policy returned {type(action).__name__}, not a PolicyAction")
        if not isinstance(action.text, str):
            raise TypeError(f"the policy's action text is a {type(action.text).__name__}, not str")
        self.sampling_attempts += action.sampling_attempts
        if action.replica is not None:
            self.replica = action.replica
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
            replica=self.replica,
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
