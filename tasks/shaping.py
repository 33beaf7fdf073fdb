"""Reward shaping and the group decision: what the scoring stage computes per episode and
per group, as pure functions that the rollout stage's backfill (``tasks/rollout.py``) asks too.

Not a stage: scoring (``tasks/scoring.py``, whose docstring has the table of rules and the
formulas), the rollout stage's backfill and ``rollflow rescore`` (``ops/rescore.py``)
import it, so no stage imports another and a group the rollout kept for its reward variance is exactly a group
that scoring gives an advantage:

- ``score_groups``: the environment's scores of a step's episodes, one ``handle.score``
  per group (parse failures are not shown to it: ``PARSE_FAILURE_SCORE``);
- ``ending_of`` and ``shape_reward``: an episode's row of ``SHAPING_RULES`` and its final
  reward; ``env_passed``: the environment's verdict;
- ``group_baseline``: mean and population std of a group's counted final rewards, and
  whether it has no variance (fewer than two counted, or all equal);
- ``groups_with_variance``: the last two over a step's episodes, group by group;
- ``score_episodes_to_records``: a step's ``ScoreRecord``s (shaping, baselines,
  advantages, what is trained), what the scoring stage writes and ``rollflow rescore``
  recomputes.

Simplified, and why: the backfill decides on scores it asks the environment for itself,
before the scoring stage asks again. A deterministic scorer (every bundled one) gives the
same scores both times; a sampled judge could disagree with itself, and then a step trains
a group fewer or more than the rollout counted, which is harmless.
"""

from __future__ import annotations

import asyncio
import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import cast

from rollflow.config.run import RunConfig
from rollflow.envs.episode import EpisodeRollout
from rollflow.envs.handle import EnvironmentHandle, EpisodeScore, TaskItem
from rollflow.envs.types import Split, TruncationCause
from rollflow.storage.records import EpisodeRecord, ScoreRecord

STD_EPSILON = 1e-6
SPLITS = ("train", "validation")
BUFFER_FRACTION = 5  # default overlong buffer: L_max // 5, DAPO's proportion
PARSE_FAILURE_SCORE = EpisodeScore(reward=0.0, threshold=None, components={})


class ScoringError(ValueError):
    """Episodes and scores do not fit together; the message names the episode or task."""


@dataclass(frozen=True)
class ScoringSettings:
    failed_parse_reward: float = -0.1
    overlong_penalty_factor: float = 1.0
    max_model_length: int = 2048
    overlong_buffer_tokens: int | None = None  # None = max_model_length // 5
    scale_advantages_by_std: bool = True
    dynamic_sampling: bool = False
    overlong_masking: bool = False
    # A backfilled step ([rollout].backfill_rounds): at most this many groups with reward
    # variance are trained, the first ones the rollout played; None: every one.
    max_trained_groups: int | None = None

    def __post_init__(self) -> None:
        if self.max_model_length < 1:
            raise ScoringError(f"max_model_length must be >= 1, got {self.max_model_length}")
        if self.overlong_buffer_tokens is not None and self.overlong_buffer_tokens < 1:
            raise ScoringError(f"overlong_buffer_tokens must be >= 1, got {self.overlong_buffer_tokens}")

    @property
    def buffer_tokens(self) -> int:
        """``B``: the last tokens of the budget over which the overlong penalty ramps."""
        default = max(self.max_model_length // BUFFER_FRACTION, 1)
        return min(self.overlong_buffer_tokens or default, self.max_model_length)

    @classmethod
    def from_config(cls, config: RunConfig) -> ScoringSettings:
        train = config.train
        return cls(
            failed_parse_reward=train.failed_parse_reward,
            overlong_penalty_factor=train.overlong_penalty_factor,
            max_model_length=config.rollout.max_model_length,
            overlong_buffer_tokens=train.overlong_buffer_tokens,
            scale_advantages_by_std=train.scale_advantages_by_std,
            dynamic_sampling=train.dynamic_sampling,
            overlong_masking=train.overlong_masking,
            max_trained_groups=config.rollout.batch_size if config.rollout.backfill_rounds > 0 else None,
        )




# ---------------------------------------------------------------- reward shaping


class Ending(enum.StrEnum):
    """How an episode ended, as reward shaping sees it: one row of ``SHAPING_RULES`` each."""

    TERMINATED = "terminated"
    ENV = "env"
    MAX_TURNS = "max_turns"
    CONTEXT_OVERFLOW = "context_overflow"
    PARSE_FAILURE = "parse_failure"
    ERROR = "error"


class RewardSource(enum.StrEnum):
    ENV = "env"  # the environment's reward
    FAILED_PARSE = "failed_parse_reward"
    NONE = "none"  # 0.0: nothing to reward


class Overlong(enum.StrEnum):
    NONE = "none"
    BY_LENGTH = "by_length"  # the soft ramp over the last B tokens of the budget
    FULL = "full"  # -f: the budget was spent


@dataclass(frozen=True)
class ShapingRule:
    reward: RewardSource
    overlong: Overlong
    counted: bool  # in the group baseline (and trainable)
    can_pass: bool  # passed = the environment's reward vs its threshold, where this holds


_ENV_REWARD = ShapingRule(RewardSource.ENV, Overlong.NONE, counted=True, can_pass=True)
SHAPING_RULES: Mapping[Ending, ShapingRule] = MappingProxyType({
    Ending.TERMINATED: _ENV_REWARD,
    Ending.ENV: _ENV_REWARD,
    Ending.MAX_TURNS: ShapingRule(RewardSource.ENV, Overlong.BY_LENGTH, counted=True, can_pass=True),
    Ending.CONTEXT_OVERFLOW: ShapingRule(RewardSource.ENV, Overlong.FULL, counted=True, can_pass=True),
    Ending.PARSE_FAILURE: ShapingRule(RewardSource.FAILED_PARSE, Overlong.NONE, counted=True, can_pass=False),
    Ending.ERROR: ShapingRule(RewardSource.NONE, Overlong.NONE, counted=False, can_pass=False),
})


@dataclass(frozen=True)
class ShapedReward:
    final_reward: float
    overlong_penalty: float  # <= 0
    counted: bool  # in the group baseline


def ending_of(rollout: EpisodeRollout, score: EpisodeScore) -> Ending:
    """The row of ``SHAPING_RULES`` an episode falls in; a parse failure whatever the scorer said."""
    if rollout.error is not None:
        return Ending.ERROR
    if rollout.truncation_cause == TruncationCause.PARSE_FAILURE:
        return Ending.PARSE_FAILURE
    if score.error is not None:
        return Ending.ERROR
    if rollout.truncation_cause is None:
        return Ending.TERMINATED
    return Ending(TruncationCause(rollout.truncation_cause).value)


def shape_reward(
    ending: Ending, env_reward: float, context_tokens: int, settings: ScoringSettings
) -> ShapedReward:
    """The final reward of one episode: its ending's row of ``SHAPING_RULES`` applied."""
    rule = SHAPING_RULES[ending]
    base = {
        RewardSource.ENV: env_reward,
        RewardSource.FAILED_PARSE: settings.failed_parse_reward,
        RewardSource.NONE: 0.0,
    }[rule.reward]
    penalty = _overlong_penalty(rule.overlong, context_tokens, settings)
    return ShapedReward(base + penalty, penalty, rule.counted)


def _overlong_penalty(overlong: Overlong, context_tokens: int, settings: ScoringSettings) -> float:
    if overlong == Overlong.NONE:
        return 0.0
    budget, buffer = settings.max_model_length, settings.buffer_tokens
    used = budget if overlong == Overlong.FULL else context_tokens
    ramp = min(max((used - (budget - buffer)) / buffer, 0.0), 1.0)
    return -settings.overlong_penalty_factor * ramp if ramp > 0 else 0.0


def env_passed(ending: Ending, score: EpisodeScore) -> bool:
    """The environment's verdict: its reward ``>=`` its threshold (none: ``> 0``)."""
    if not SHAPING_RULES[ending].can_pass:
        return False
    return score.reward >= score.threshold if score.threshold is not None else score.reward > 0

# ---------------------------------------------------------------- the group decision


@dataclass(frozen=True)
class GroupBaseline:
    mean: float
    std: float  # population (ddof 0)
    counted: int  # episodes in the baseline
    zero_variance: bool  # fewer than two counted, or every counted final reward equal


def group_baseline(rewards_G: Sequence[float]) -> GroupBaseline:
    """The baseline of a group's counted final rewards ``rewards_G``."""
    mean = sum(rewards_G) / len(rewards_G) if rewards_G else 0.0
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards_G) / len(rewards_G)) if rewards_G else 0.0
    zero_variance = len(rewards_G) < 2 or max(rewards_G) - min(rewards_G) == 0.0
    return GroupBaseline(mean, std, len(rewards_G), zero_variance)


def shape_episode(episode: EpisodeRecord, score: EpisodeScore, settings: ScoringSettings) -> tuple[Ending, ShapedReward]:
    """One episode's ending and final reward."""
    ending = ending_of(episode.rollout, score)
    return ending, shape_reward(ending, score.reward, episode.rollout.context_tokens, settings)


def groups_with_variance(
    episodes: Sequence[EpisodeRecord], env_scores: Sequence[EpisodeScore], settings: ScoringSettings
) -> dict[str, bool]:
    """group_id -> whether its counted final rewards vary (not ``zero_variance``), in the
    order the groups first appear; ``env_scores[i]`` scores ``episodes[i]``."""
    if len(episodes) != len(env_scores):
        raise ScoringError(f"{len(episodes)} episodes but {len(env_scores)} scores")
    rewards: dict[str, list[float]] = {}
    for episode, score in zip(episodes, env_scores, strict=True):
        _, shaped = shape_episode(episode, score, settings)
        counted = rewards.setdefault(episode.group_id, [])
        if shaped.counted:
            counted.append(shaped.final_reward)
    return {group: not group_baseline(rewards_G).zero_variance for group, rewards_G in rewards.items()}


# ---------------------------------------------------------------- the environment's scores


async def score_groups(
    handle: EnvironmentHandle, split: str, episodes: Sequence[EpisodeRecord], concurrency: int,
) -> list[EpisodeScore]:
    """``handle.score`` once per group, at most ``concurrency`` groups at once, shown every
    episode but the parse failures (``PARSE_FAILURE_SCORE`` each); the scores come back
    aligned with ``episodes``."""
    if split not in SPLITS:
        raise ScoringError(f"split must be one of {SPLITS}, got {split!r}")
    items = {item.task_id: item for item in handle.tasks(cast(Split, split))}
    groups: dict[str, list[int]] = {}
    for index, episode in enumerate(episodes):
        groups.setdefault(episode.group_id, []).append(index)
    bound = asyncio.Semaphore(concurrency)

    async def score_group(indices: list[int]) -> list[EpisodeScore]:
        item = _group_item(items, [episodes[i] for i in indices], split)
        shown = [i for i in indices if episodes[i].rollout.truncation_cause != TruncationCause.PARSE_FAILURE]
        scores = dict.fromkeys(indices, PARSE_FAILURE_SCORE)
        if shown:
            async with bound:
                given = await handle.score(item, [episodes[i].rollout for i in shown])
            if len(given) != len(shown):
                raise ScoringError(f"the environment gave {len(given)} scores for {len(shown)} episodes")
            scores.update(zip(shown, given, strict=True))
        return [scores[i] for i in indices]

    results = await asyncio.gather(*(score_group(ix) for ix in groups.values()))
    aligned: list[EpisodeScore | None] = [None] * len(episodes)
    for indices, scores in zip(groups.values(), results, strict=True):
        for index, score in zip(indices, scores, strict=True):
            aligned[index] = score
    return [s for s in aligned if s is not None]


def _group_item(items: dict[str, TaskItem], members: list[EpisodeRecord], split: str) -> TaskItem:
    task_ids = {m.task_id for m in members}
    if len(task_ids) != 1:
        raise ScoringError(f"group {members[0].group_id!r} mixes tasks {sorted(task_ids)}")
    task_id = task_ids.pop()
    if task_id not in items:
        raise ScoringError(
            f"group {members[0].group_id!r}: task {task_id!r} is not among the environment's "
            f"{split} tasks (did the environment or its kwargs change since the rollout?)"
        )
    return items[task_id]


# ---------------------------------------------------------------- a step's score records


@dataclass(frozen=True)
class _Shaped:
    """One episode after shaping: its ending, final reward and whether it counts."""

    episode: EpisodeRecord
    score: EpisodeScore
    ending: Ending
    shaped: ShapedReward


def _shape(episode: EpisodeRecord, score: EpisodeScore, settings: ScoringSettings) -> _Shaped:
    return _Shaped(episode, score, *shape_episode(episode, score, settings))


def score_episodes_to_records(
    episodes: Sequence[EpisodeRecord],
    env_scores: Sequence[EpisodeScore],
    settings: ScoringSettings,
) -> list[ScoreRecord]:
    """One ``ScoreRecord`` per episode, in input order; ``env_scores[i]`` scores ``episodes[i]``."""
    if len(episodes) != len(env_scores):
        raise ScoringError(f"{len(episodes)} episodes but {len(env_scores)} scores")
    shaped = [_shape(e, s, settings) for e, s in zip(episodes, env_scores, strict=True)]
    groups: dict[str, list[_Shaped]] = {}
    for item in shaped:
        groups.setdefault(item.episode.group_id, []).append(item)
    baselines = {
        group: group_baseline([m.shaped.final_reward for m in members if m.shaped.counted])
        for group, members in groups.items()
    }
    surplus = _surplus_groups(baselines, settings.max_trained_groups)
    records = {}
    for group, members in groups.items():
        for member in members:
            record = _record(member, baselines[group], group in surplus, settings)
            records[record.episode_id] = record
    if len(records) != len(episodes):
        raise ScoringError("episode ids are not unique within the step")
    return [records[e.episode_id] for e in episodes]


def _surplus_groups(baselines: dict[str, GroupBaseline], max_trained: int | None) -> set[str]:
    """The groups with reward variance beyond the first ``max_trained`` of them, by group
    number (the order the rollout played them): a backfill round's overshoot, not trained."""
    if max_trained is None:
        return set()
    varied = sorted((g for g, b in baselines.items() if not b.zero_variance), key=_group_number)
    return set(varied[max_trained:])


def _group_number(group_id: str) -> int:
    return int(group_id.rsplit("/", 1)[1])  # f"{split}/{step}/{group}"


def _record(member: _Shaped, baseline: GroupBaseline, surplus: bool, settings: ScoringSettings) -> ScoreRecord:
    episode, score, shaped = member.episode, member.score, member.shaped
    mean, std, zero_variance = baseline.mean, baseline.std, baseline.zero_variance
    advantage = 0.0
    if shaped.counted and not zero_variance:
        advantage = shaped.final_reward - mean
        if settings.scale_advantages_by_std:
            advantage /= std + STD_EPSILON
    masked = settings.overlong_masking and episode.rollout.truncated
    skipped = (settings.dynamic_sampling and zero_variance) or surplus
    return ScoreRecord(
        run_id=episode.run_id, step=episode.step, split=episode.split, task_id=episode.task_id,
        group_id=episode.group_id, episode_id=episode.episode_id, reward=score.reward,
        threshold=score.threshold, components=dict(score.components),
        overlong_penalty=shaped.overlong_penalty, final_reward=shaped.final_reward,
        passed=env_passed(member.ending, score), group_mean=mean, group_std=std,
        group_size=baseline.counted, zero_variance=zero_variance, advantage=advantage,
        trained=episode.split == "train" and shaped.counted and not (masked or skipped),
        scoring_error=None if shaped.counted else _why_left_out(episode.rollout, score),
        env=episode.env,
    )


def _why_left_out(rollout: EpisodeRollout, score: EpisodeScore) -> str:
    if score.error is not None:
        return score.error
    assert rollout.error is not None, "an episode is left out only for an error"
    return rollout.error
