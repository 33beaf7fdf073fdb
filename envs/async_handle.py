"""The episode loop and scoring for async-style environments (``Env`` via ``AsyncEnvSuite``).

Each episode gets a fresh ``Env`` from the suite's factory. The loop: ``reset(task)``;
then, up to ``EpisodeLimits.max_turns`` times, sample an action, parse it with the
tool-call protocol and hand the structured message to ``step(message)``. The history the
step returns becomes the transcript. ``terminated`` ends the episode (it wins when a step
says both); ``truncated`` ends it with cause ``env``; in both cases the reward and metrics
are read from that step. A malformed tool call ends it ``parse_failure`` and a spent
context budget ``context_overflow``, neither stepping the environment; running out of
turns gives ``max_turns`` and no environment reward. ``close()`` runs every time.

Scoring reads the reward of the ending step (0.0 when no step ended the episode) and
reports the step's metrics as the components; an async task carries no pass threshold.
"""

from __future__ import annotations

from collections.abc import Sequence

from rollflow.envs.agent import Policy
from rollflow.envs.env import AsyncEnvSuite
from rollflow.envs.episode import EpisodeRollout
from rollflow.envs.handle import (
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
from rollflow.envs.types import Split, StepResult, Task, TruncationCause


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
        if limits.max_turns is None:
            raise ValueError("async-style environments need a turn limit: EpisodeLimits(max_turns=...)")
        task = item.payload
        if not isinstance(task, Task):
            raise TypeError(f"task {item.task_id} holds a {type(task).__name__}; async style plays Tasks")
        trace.stage = "env_factory"
        env = self.suite.env_factory(task)
        if not all(hasattr(env, name) for name in ("reset", "step", "tool_specs", "close")):
            raise TypeError(
                f"env_factory returned {type(env).__name__}, not an Env (reset/step/tool_specs/close)"
            )
        cleanup.add("Env.close", env.close)
        trace.stage = "Env.reset"
        trace.messages = checked_messages(await env.reset(task), "Env.reset")
        trace.stage = "Env.tool_specs"
        tool_specs = list(env.tool_specs)
        trace.stage = "Policy.open_session"
        session = policy.open_session(tool_specs)
        cleanup.add("PolicySession.close", session.close)
        for _ in range(limits.max_turns):
            action = await next_action(session, trace)
            if action is None:
                return trace.finish(cause=TruncationCause.CONTEXT_OVERFLOW)
            parsed = parse_action(action.text)
            message = parsed.to_message(action.text)
            if parsed.kind == "parse_failure":
                trace.messages.append(message)
                return trace.finish(cause=TruncationCause.PARSE_FAILURE)
            trace.stage = "Env.step"
            result = await env.step(message)
            if not isinstance(result, StepResult):
                raise TypeError(f"Env.step returned {type(result).__name__}, not a StepResult")
            trace.messages = checked_messages(result.messages, "Env.step")
            if result.terminated or result.truncated:
                return trace.finish(
                    terminated=result.terminated,
                    cause=None if result.terminated else TruncationCause.ENV,
                    env_reward=checked_score(result.reward, "StepResult.reward"),
                    env_metrics=checked_metrics(result.metrics, "StepResult.metrics"),
                )
        return trace.finish(cause=TruncationCause.MAX_TURNS)
