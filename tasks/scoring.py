"""Scoring stage: rewards, penalties and group-relative advantages (``scores.parquet``).

The environment scores each group once (``handle.score(item, rollouts)``: hook style
batches ``score_episodes`` over the group, async style takes the terminal step's reward).
Parse-failed episodes are not shown to it: their reward is ``failed_parse_reward`` whatever
a scorer would say, and a scorer written for well-formed transcripts (the reference's
refund agent ``json.loads`` every ``<tool_call>`` block) raises on exactly those, which
would drop them from the baseline, or, with a group ``score_episodes``, error the group.
They get ``PARSE_FAILURE_SCORE`` (reward 0.0, no threshold) in the scores' ``reward``.

Then, per episode:

1. **its ending**, one of six (``ending_of``): ``error`` when the rollout raised;
   ``parse_failure`` when it ended so, whatever the scorer said, errors included; else
   ``error`` when the scorer raised; else ``terminated`` or its truncation cause.
2. **its final reward**: ``shape_reward(ending, env_reward, context_tokens, settings)``,
   one pure function reading this table (``SHAPING_RULES``), one row per ending:

   ================  =======================  ================  ========  ======
   ending            reward                   overlong penalty  baseline  passes
   ================  =======================  ================  ========  ======
   terminated        the environment's        none              counted   if env
   env               the environment's        none              counted   if env
   max_turns         the environment's        by length         counted   if env
   context_overflow  the environment's        full (``-f``)     counted   if env
   parse_failure     ``failed_parse_reward``  none              counted   never
   error             0.0                      none              left out  never
   ================  =======================  ================  ========  ======

   ("if env": the environment's reward against its threshold; see 3.)

   **Soft overlong penalty** (DAPO's soft overlong punishment, applied as the reference
   docs say: only to the two length-budget truncations). With ``L`` the context length the
   episode ended at (``rollout.context_tokens``: the count restarts where the chat template
   re-rendered the prompt, so rewritten history is not counted twice), ``L_max =
   max_model_length``, a buffer ``B`` and ``f = overlong_penalty_factor``::

       penalty = -f * clip((L - (L_max - B)) / B, 0, 1)

   0 until the context enters the last ``B`` tokens of the budget, then linear to ``-f``
   at the budget. A ``context_overflow`` episode spent the budget by definition: ``-f``.
   ``B = overlong_buffer_tokens``, by default ``L_max // 5``, about DAPO's setting (a
   4,096-token buffer for 20,480-token responses): only an episode that came close to the
   budget pays. A buffer of the whole budget makes every ``max_turns`` episode pay
   ``f * L / L_max``, half the factor at half the budget, which
   swamps reward terms of a few tenths: the policy learns to be short, not to be right.
3. **passed** is the environment's verdict, not the shaped reward's: its reward ``>=`` its
   threshold (no threshold: ``> 0``), where the table says an ending can pass at all. So
   ``reward/pass_rate`` does not move with the overlong penalty or ``failed_parse_reward``.
4. **group baseline.** ``mean`` and ``std`` (population, ddof 0) are over the counted
   episodes' final rewards; ``advantage = final - mean``, divided by ``std + 1e-6`` when
   ``scale_advantages_by_std``. A group whose counted rewards are all equal (or that has
   fewer than two) is marked ``zero_variance`` and gets advantage 0.
5. **trained?** Never a validation episode; not when left out of the baseline; not when
   truncated (any cause) under ``overlong_masking``, though its reward stayed in the
   baseline; not in a zero-variance group under ``dynamic_sampling``.

The stage keeps each scorer's traceback in the step's ``errors.jsonl`` and refuses a step
whose every episode failed or overflowed the context (``StepFailedError``, before
``scores.parquet`` is written, so a resume scores again): ``tasks/step_health.py``.

Simplified on purpose: dynamic sampling only skips zero-variance groups; it does not
resample to refill the batch as DAPO does (a step trains on fewer groups instead). The
overlong length counts context tokens of scripted, tokenless episodes as 0. A group
``score_episodes`` sees the group without its parse failures.
"""

from __future__ import annotations

import asyncio
import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import MappingProxyType
from typing import cast

from rollflow.envs.episode import EpisodeRollout
from rollflow.envs.handle import EnvironmentHandle, EpisodeScore, TaskItem
from rollflow.envs.runner import load_environment_handle
from rollflow.envs.tracebacks import keeping_tracebacks
from rollflow.envs.types import Split, TruncationCause
from rollflow.storage.records import EpisodeRecord, ScoreRecord
from rollflow.storage.schemas import score_records_to_table, table_to_episode_records
from rollflow.storage.stage_outputs import locate_output, read_output, write_output
from rollflow.tasks.config import RunConfig
from rollflow.tasks.preflight import prompt_tokens
from rollflow.tasks.step_health import (
    StepFailedError,
    check_step_outcome,
    discard_episodes,
    episode_errors,
    errors_path,
    keep_episode_errors,
)

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


# ---------------------------------------------------------------- records


@dataclass(frozen=True)
class _Shaped:
    """One episode after shaping: its ending, final reward and whether it counts."""

    episode: EpisodeRecord
    score: EpisodeScore
    ending: Ending
    shaped: ShapedReward


def _shape(episode: EpisodeRecord, score: EpisodeScore, settings: ScoringSettings) -> _Shaped:
    rollout = episode.rollout
    ending = ending_of(rollout, score)
    return _Shaped(episode, score, ending, shape_reward(ending, score.reward, rollout.context_tokens, settings))


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
    records = {}
    for members in groups.values():
        for record in _group_records(members, settings):
            records[record.episode_id] = record
    if len(records) != len(episodes):
        raise ScoringError("episode ids are not unique within the step")
    return [records[e.episode_id] for e in episodes]


def _group_records(members: list[_Shaped], settings: ScoringSettings) -> list[ScoreRecord]:
    rewards_G = [m.shaped.final_reward for m in members if m.shaped.counted]
    mean = sum(rewards_G) / len(rewards_G) if rewards_G else 0.0
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards_G) / len(rewards_G)) if rewards_G else 0.0
    zero_variance = len(rewards_G) < 2 or max(rewards_G) - min(rewards_G) == 0.0
    return [_record(m, mean, std, len(rewards_G), zero_variance, settings) for m in members]


def _record(
    member: _Shaped, mean: float, std: float, group_size: int, zero_variance: bool,
    settings: ScoringSettings,
) -> ScoreRecord:
    episode, score, shaped = member.episode, member.score, member.shaped
    advantage = 0.0
    if shaped.counted and not zero_variance:
        advantage = shaped.final_reward - mean
        if settings.scale_advantages_by_std:
            advantage /= std + STD_EPSILON
    masked = settings.overlong_masking and episode.rollout.truncated
    skipped = settings.dynamic_sampling and zero_variance
    return ScoreRecord(
        run_id=episode.run_id, step=episode.step, split=episode.split, task_id=episode.task_id,
        group_id=episode.group_id, episode_id=episode.episode_id, reward=score.reward,
        threshold=score.threshold, components=dict(score.components),
        overlong_penalty=shaped.overlong_penalty, final_reward=shaped.final_reward,
        passed=env_passed(member.ending, score), group_mean=mean, group_std=std,
        group_size=group_size, zero_variance=zero_variance, advantage=advantage,
        trained=episode.split == "train" and shaped.counted and not (masked or skipped),
        scoring_error=None if shaped.counted else _why_left_out(episode.rollout, score),
    )


def _why_left_out(rollout: EpisodeRollout, score: EpisodeScore) -> str:
    if score.error is not None:
        return score.error
    assert rollout.error is not None, "an episode is left out only for an error"
    return rollout.error


# ---------------------------------------------------------------- the stage


def score_stage(
    config: RunConfig, episodes_path: Path, out: Path, handle: EnvironmentHandle | None = None
) -> Path:
    """Score a step's episodes and write ``out`` (its ``scores.parquet``) atomically.

    ``handle`` defaults to ``config.env``'s environment; the Python API passes the one it
    built from ``env_factory``. The step's ``errors.jsonl`` gains the scorer's failures.
    """
    where = locate_output(out)
    folder, step, split = where.folder, where.step, where.split
    episodes = table_to_episode_records(read_output(episodes_path))
    if handle is None:
        handle = load_environment_handle(config.env.name, config.env.kwargs)
    with keeping_tracebacks() as tracebacks:
        env_scores = asyncio.run(score_groups(handle, split, episodes, config.rollout.concurrency))
    records = score_episodes_to_records(episodes, env_scores, ScoringSettings.from_config(config))
    scorer_failed = [
        (e, r.scoring_error) for e, r in zip(episodes, records, strict=True)
        if r.scoring_error is not None and e.rollout.error is None  # the rollout kept its own
    ]
    errors = episode_errors("scoring", scorer_failed, tracebacks)
    keep_episode_errors(folder, step, split, "scoring", [e.episode_id for e in episodes], errors)
    measure = partial(_prompt_tokens, config, handle, split)
    try:
        check_step_outcome(episodes, records, errors_path(folder, step, split), config.rollout.max_model_length, measure)
    except StepFailedError as failed:
        if any(e.rollout.error for e in episodes):
            discard_episodes(folder, step, split)
            raise StepFailedError(f"{failed}; its episodes were discarded: `rollflow resume` plays them again") from None
        raise
    return write_output(score_records_to_table(records), out)


def _prompt_tokens(config: RunConfig, handle: EnvironmentHandle, split: str, episode: EpisodeRecord) -> int:
    items = {item.task_id: item for item in handle.tasks(cast(Split, split))}
    return prompt_tokens(config, handle, items[episode.task_id])


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
