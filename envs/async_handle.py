"""The handle for async-style environments (``Env`` via ``AsyncEnvSuite``).

Each episode is a fresh ``env_factory(task)`` played by the one episode loop
(``rollflow.envs.loop``, which has the rules); an async-style environment has no turn
budget of its own, so ``EpisodeLimits.max_turns`` is required, and checked before the
environment is built.

Async scoring reads the episode's reward (0.0 when no step ran) and reports its metrics
as the components; the pass threshold is the suite's ``pass_threshold``, the same for every
task (None: ``passed`` is ``reward > 0``).
"""

from __future__ import annotations

from collections.abc import Sequence

from rollflow.envs.agent import Policy
from rollflow.envs.env import AsyncEnvSuite, Env
from rollflow.envs.episode import EpisodeRollout
from rollflow.envs.handle import (
    NO_TURN_LIMIT,
    UNSCORED_EPISODE,
    EpisodeLimits,
    EpisodeScore,
    Style,
    TaskItem,
    error_score,
    task_id_for,
)
from rollflow.envs.hooks import check_split
from rollflow.envs.loop import play_episode, stage
from rollflow.envs.types import Split, Task

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
        return await play_episode(policy, limits, lambda: self._open(item, limits))

    async def score(self, item: TaskItem, rollouts: Sequence[EpisodeRollout]) -> list[EpisodeScore]:
        return [
            error_score(UNSCORED_EPISODE)
            if rollout.error is not None
            else EpisodeScore(
                reward=0.0 if rollout.env_reward is None else rollout.env_reward,
                threshold=self.suite.pass_threshold,
                components=dict(rollout.env_metrics),
            )
            for rollout in rollouts
        ]

    def _open(self, item: TaskItem, limits: EpisodeLimits) -> tuple[Env, Task]:
        """The episode's environment, from the suite's ``env_factory``."""
        with stage("EpisodeLimits"):
            if limits.max_turns is None:  # before anything is built
                raise ValueError(NO_TURN_LIMIT)
            task = item.payload
            if not isinstance(task, Task):
                raise TypeError(f"task {item.task_id} holds a {type(task).__name__}; async style plays Tasks")
        with stage("env_factory"):
            env = self.suite.env_factory(task)
            if not all(hasattr(env, name) for name in ENV_METHODS):
                raise TypeError(
                    f"env_factory returned {type(env).__name__}, not an Env (reset/step/tool_specs/close)"
                )
        return env, task
