"""Hook-style environments (``EnvironmentMultiTurn``): their episodes and their scoring.

Episodes run through the one loop, ``rollflow.envs.loop.play_episode``: each
episode adapts the environment and its example to the async ``Env`` shape
(``HookEpisodeEnv``), so turn handling and endings are written once. The loop is the
reference's, turn for turn: the action is appended to the transcript (as
``parse_action(text).to_message(text)``) before ``step_episode`` sees it;
``final_response_text`` overrides the action as the scored text; each step's metadata is
collected; the episode ends at ``done`` (terminated) or after the turn budget (truncated,
``max_turns``). The budget is ``max_episode_turns(example)``, as in the reference; an
explicit ``EpisodeLimits.max_turns`` (``[rollout].max_turns``) caps it and never raises it.
Two endings come before the environment is stepped: a malformed tool call
(``parse_failure``, unless the environment sets ``checks_tool_protocol = False``) and a
spent context budget (``context_overflow``). An error names the hook that raised. A hook
episode has no environment reward (``env_reward`` None): ``score_episode(s)`` gives it.

Scoring rebuilds each rollout as an ``EnvironmentEpisode`` (``metadata["steps"]`` holds the
step metadata; one ``EnvironmentTurn`` per message) and makes one ``score_episodes`` call
per group. When the environment keeps the default ``score_episodes``, each episode is
scored on its own so one raising ``score_episode`` errors only its episode; an overridden
``score_episodes`` that raises errors the whole group, since it answers for all of them.
Errored episodes are not shown to the scorer at all.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

from rollflow.envs.agent import Policy
from rollflow.envs.env import AnnotatedStepResult, Env
from rollflow.envs.episode import EpisodeRollout
from rollflow.envs.handle import (
    UNSCORED_EPISODE,
    EpisodeLimits,
    EpisodeScore,
    Style,
    TaskItem,
    checked_score,
    describe_error,
    error_score,
    task_id_for,
)
from rollflow.envs.hooks import (
    EnvironmentMultiTurn,
    call_hook,
    call_setup_hook,
    check_split,
    checked_messages,
    example_prompt_text,
    overrides,
    score_each,
)
from rollflow.envs.loop import play_episode, stage
from rollflow.envs.type_names import type_mismatch
from rollflow.envs.types import (
    EnvironmentEpisode,
    EnvironmentStepResult,
    EnvironmentTurn,
    Message,
    RewardResult,
    Split,
    Task,
    TaskExample,
    ToolSpec,
)


class HookEpisodeEnv(Env):
    """One episode of a hook environment in the ``Env`` shape the loop drives.

    The transcript lives here, as in the reference's loop: ``step`` appends the action
    before ``step_episode`` sees it, then the environment's replies. ``reset`` takes the
    task ``hook_task`` builds, whose prompt is the ``prompt_text`` for ``start_episode``.
    """

    def __init__(self, env: EnvironmentMultiTurn, example: TaskExample) -> None:
        self.env = env
        self.example = example
        self.checks_tool_protocol = env.checks_tool_protocol
        self._messages: list[Message] = []
        self._turns: int | None = None

    async def reset(self, task: Task) -> list[Message]:
        with stage("start_episode"):
            opening = await call_setup_hook(self.env.start_episode, self.example, task.prompt)
            self._messages = checked_messages(opening, "start_episode")
        with stage("max_episode_turns"):
            self._turns = _checked_turns(await call_setup_hook(self.env.max_episode_turns, self.example))
        return list(self._messages)

    def max_episode_turns(self) -> int | None:
        return self._turns

    @property
    def tool_specs(self) -> list[ToolSpec]:
        with stage("tool_specs"):
            return list(self.env.tool_specs(self.example))

    @property
    def messages(self) -> list[Message]:
        return list(self._messages)

    async def step(self, message: Message) -> AnnotatedStepResult:
        self._messages.append(message)
        with stage("step_episode"):
            result = await call_hook(
                self.env.step_episode, self.example, list(self._messages), message["content"]
            )
            if not isinstance(result, EnvironmentStepResult):
                raise TypeError(f"step_episode returned {type_mismatch(result, EnvironmentStepResult)}")
            self._messages.extend(checked_messages(result.messages, "step_episode"))
            metadata = dict(result.metadata)
        return AnnotatedStepResult(
            terminated=bool(result.done),
            truncated=False,
            messages=list(self._messages),
            final_response_text=result.final_response_text,
            metadata=metadata,
        )


def hook_task(example: TaskExample) -> Task:
    """The async ``Task`` for ``example``: its prompt is ``start_episode``'s ``prompt_text``."""
    return Task(
        prompt=example_prompt_text(example), target=example.output, metadata=example.metadata, id=example.id
    )


class HookEnvironmentHandle:
    style: Style = "hook"

    def __init__(self, env: EnvironmentMultiTurn) -> None:
        if not isinstance(env, EnvironmentMultiTurn):
            raise TypeError(f"expected an EnvironmentMultiTurn, got {type(env).__name__}")
        self.env = env

    def tasks(self, split: Split) -> list[TaskItem]:
        check_split(split)
        return [
            TaskItem(task_id=task_id_for(example), payload=example) for example in self.env.examples(split)
        ]

    async def play(self, item: TaskItem, policy: Policy, limits: EpisodeLimits) -> EpisodeRollout:
        rollout = await play_episode(policy, limits, lambda: self._open(item))
        return dataclasses.replace(rollout, env_reward=None, env_metrics={})  # score_episode rewards

    async def score(self, item: TaskItem, rollouts: Sequence[EpisodeRollout]) -> list[EpisodeScore]:
        try:
            return await self._score(_example(item), rollouts)
        except Exception as exc:  # never raises: the whole group carries the error
            return [error_score(describe_error(exc, "scoring")) for _ in rollouts]

    def _open(self, item: TaskItem) -> tuple[Env, Task]:
        """The episode's environment: the hook environment adapted to one example."""
        example = _example(item)
        return HookEpisodeEnv(self.env, example), hook_task(example)

    async def _score(self, example: TaskExample, rollouts: Sequence[EpisodeRollout]) -> list[EpisodeScore]:
        scored_indices = [index for index, rollout in enumerate(rollouts) if rollout.error is None]
        episodes = [to_environment_episode(rollouts[index]) for index in scored_indices]
        outcomes: list[RewardResult | Exception]
        scorer = "score_episodes" if overrides(self.env, "score_episodes") else "score_episode"
        if not episodes:
            outcomes = []
        elif scorer == "score_episodes":
            try:
                results = await call_hook(self.env.score_episodes, example, episodes)
                outcomes = _checked_group(results, len(episodes))
            except Exception as exc:  # the group's scorer failed: every episode carries it
                outcomes = [exc] * len(episodes)
        else:
            outcomes = await asyncio.to_thread(score_each, self.env, example, episodes)
        scores = [error_score(UNSCORED_EPISODE) for _ in rollouts]
        for index, outcome in zip(scored_indices, outcomes, strict=True):
            scores[index] = _to_episode_score(outcome, scorer)
        return scores


def to_environment_episode(rollout: EpisodeRollout) -> EnvironmentEpisode:
    """The reference's episode record, rebuilt from a played rollout for scoring."""
    return EnvironmentEpisode(
        messages=rollout.messages,
        response_text=rollout.response_text,
        turns=tuple(
            EnvironmentTurn(role=m["role"], content=m["content"], name=m.get("name"))
            for m in rollout.messages
        ),
        metadata={
            "steps": [dict(step) for step in rollout.step_metadata],
            "terminated": rollout.terminated,
            "truncation_cause": None if rollout.truncation_cause is None else str(rollout.truncation_cause),
            "turns": rollout.turns,
        },
        latency_ms=round(rollout.latency_s * 1000),
        total_tokens=rollout.total_tokens or None,
    )


def _example(item: TaskItem) -> TaskExample:
    if not isinstance(item.payload, TaskExample):
        raise TypeError(
            f"task {item.task_id} holds a {type(item.payload).__name__}; hook style plays TaskExamples"
        )
    return item.payload


def _checked_turns(env_turns: object) -> int:
    if isinstance(env_turns, bool) or not isinstance(env_turns, int) or env_turns < 1:
        raise ValueError(f"max_episode_turns returned {env_turns!r}; it must be a positive integer")
    return env_turns


def _checked_group(results: object, expected: int) -> list[RewardResult | Exception]:
    if not isinstance(results, list | tuple) or len(results) != expected:
        size = len(results) if isinstance(results, list | tuple) else type(results).__name__
        raise ValueError(f"score_episodes returned {size} results for {expected} episodes")
    return list(results)


def _to_episode_score(outcome: object, scorer: str) -> EpisodeScore:
    if isinstance(outcome, Exception):
        return error_score(describe_error(outcome, scorer))
    if not isinstance(outcome, RewardResult):
        return error_score(f"TypeError: scorer gave {type_mismatch(outcome, RewardResult)}")
    try:
        threshold = outcome.threshold
        return EpisodeScore(
            reward=checked_score(outcome.score, "RewardResult.score"),
            threshold=None if threshold is None else checked_score(threshold, "RewardResult.threshold"),
            components={
                str(name): checked_score(value, f"component {name!r}")
                for name, value in outcome.components.items()
            },
        )
    except (ValueError, TypeError, AttributeError) as exc:
        return error_score(describe_error(exc, scorer))
