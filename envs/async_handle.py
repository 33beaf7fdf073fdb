"""The one episode loop, and the handle for async-style environments (``Env`` via ``AsyncEnvSuite``).

``play_env_episode`` is the only multi-turn loop: async-style episodes run through it
directly, and hook-style ones through an adapter that gives one hook episode the ``Env``
shape (``rollflow.envs.hook_handle``), so turn handling and endings live here once.

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

Async scoring reads the episode's reward (0.0 when no step ran) and reports its metrics
as the components; an async task carries no pass threshold.
"""

from __future__ import annotations

from collections.abc import Sequence

from rollflow.envs.agent import Policy
from rollflow.envs.env import AnnotatedStepResult, AsyncEnvSuite, Env
from rollflow.envs.episode import EpisodeRollout
from rollflow.envs.handle import (
    NO_TURN_LIMIT,
    UNSCORED_EPISODE,
    Cleanup,
    EpisodeLimits,
    EpisodeScore,
    EpisodeTrace,
    Style,
    TaskItem,
    checked_metrics,
    checked_score,
    error_score,
    next_action,
    play_safely,
    task_id_for,
)
from rollflow.envs.hooks import check_split, checked_messages
from rollflow.envs.protocol import parse_action
from rollflow.envs.types import Message, Split, StepResult, Task, TruncationCause

ENV_METHODS = ("reset", "step", "tool_specs", "close")


class AsyncEnvironmentHandle:
    style: Style = "async"

    def __init__(self, suite: AsyncEnvSuite) -> None:
        if not isinstance(suite, AsyncEnvSuite):
            raise TypeError(f"expected an AsyncEnvSuite, got {type(suite).__name__}")
        self.suite = suite

    def tasks(self, split: Split) -> list[TaskItem]:
        check_split(split)
        tasks = self.suite.tasks if split == "train" else self.suite.val_tasks
        return [TaskItem(task_id=task_id_for(task), payload=task) for task in tasks]

    async def play(self, item: TaskItem, policy: Policy, limits: EpisodeLimits) -> EpisodeRollout:
        trace = EpisodeTrace(policy)
        return await play_safely(trace, lambda cleanup: self._run(item, policy, limits, trace, cleanup))

    async def score(self, item: TaskItem, rollouts: Sequence[EpisodeRollout]) -> list[EpisodeScore]:
        return [
            error_score(UNSCORED_EPISODE)
            if rollout.error is not None
            else EpisodeScore(
                reward=0.0 if rollout.env_reward is None else rollout.env_reward,
                threshold=None,
                components=dict(rollout.env_metrics),
            )
            for rollout in rollouts
        ]

    async def _run(
        self, item: TaskItem, policy: Policy, limits: EpisodeLimits, trace: EpisodeTrace, cleanup: Cleanup
    ) -> EpisodeRollout:
        trace.stage = "EpisodeLimits"
        if limits.max_turns is None:  # before anything is built
            raise ValueError(NO_TURN_LIMIT)
        task = item.payload
        if not isinstance(task, Task):
            raise TypeError(f"task {item.task_id} holds a {type(task).__name__}; async style plays Tasks")
        trace.stage = "env_factory"
        env = self.suite.env_factory(task)
        if not all(hasattr(env, name) for name in ENV_METHODS):
            raise TypeError(
                f"env_factory returned {type(env).__name__}, not an Env (reset/step/tool_specs/close)"
            )
        return await play_env_episode(env, task, policy, limits, trace, cleanup)


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
        raise TypeError(f"Env.step returned {type(result).__name__}, not a StepResult")
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
