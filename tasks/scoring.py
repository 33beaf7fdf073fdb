"""Scoring stage: rewards, penalties and group-relative advantages (``scores.parquet``).

The environment scores each group once (``handle.score(item, rollouts)``: hook style
batches ``score_episodes`` over the group, async style takes the terminal step's reward).
Then, per episode, in this order:

1. **final reward.** A ``parse_failure`` truncation gets ``failed_parse_reward`` in place of
   the environment's reward. A ``context_overflow`` or ``max_turns`` truncation gets the
   soft overlong penalty added. An ``env`` truncation or a terminated episode keeps its
   reward as is.
2. **soft overlong penalty** (DAPO's soft overlong punishment, applied as the reference
   docs say: only to the two length-budget truncations). With ``L`` the tokens the episode
   put in its context (``rollout.total_tokens``), ``L_max = max_model_length``, a buffer
   ``B = overlong_buffer_tokens`` (default ``L_max``) and ``f = overlong_penalty_factor``::

       penalty = -f * clip((L - (L_max - B)) / B, 0, 1)

   So the penalty is 0 until the episode's context enters the last ``B`` tokens of its
   budget, then grows linearly to ``-f`` at the budget. A ``context_overflow`` episode spent
   the budget by definition (``L = L_max``: the full ``-f``), whatever it had stored; a
   ``max_turns`` episode pays by how much context it burned. With the default ``B = L_max``
   every budget truncation pays, in proportion to its length; DAPO's setting is about
   ``B = L_max / 5``.
3. **group baseline.** Errored episodes (the rollout or the scorer failed) are left out of
   the group's statistics and never trained. ``mean`` and ``std`` (population, ddof 0) are
   over the other episodes' final rewards; ``advantage = final - mean``, divided by
   ``std + 1e-6`` when ``scale_advantages_by_std``. A group whose counted rewards are all
   equal (or that has fewer than two) is marked ``zero_variance`` and gets advantage 0.
4. **trained?** Not when errored; not when truncated (any cause) under ``overlong_masking``,
   though its reward stayed in the baseline; not in a zero-variance group under
   ``dynamic_sampling``.

Simplified on purpose: dynamic sampling only skips zero-variance groups; it does not
resample to refill the batch as DAPO does (a step trains on fewer groups instead). The
overlong length counts context tokens of scripted, tokenless episodes as 0.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from rollflow.envs.episode import EpisodeRollout
from rollflow.envs.runner import EnvironmentHandle, EpisodeScore, TaskItem, load_environment_handle
from rollflow.envs.types import Split, TruncationCause
from rollflow.storage.records import EpisodeRecord, ScoreRecord
from rollflow.storage.runfolder import RunFolder
from rollflow.storage.schemas import score_records_to_table, table_to_episode_records
from rollflow.tasks.config import RunConfig

STD_EPSILON = 1e-6
SPLITS = ("train", "validation")
OVERLONG_CAUSES = (TruncationCause.CONTEXT_OVERFLOW, TruncationCause.MAX_TURNS)


class ScoringError(ValueError):
    """Episodes and scores do not fit together; the message names the episode or task."""


@dataclass(frozen=True)
class ScoringSettings:
    failed_parse_reward: float = -0.1
    overlong_penalty_factor: float = 1.0
    max_model_length: int = 2048
    overlong_buffer_tokens: int | None = None  # None = max_model_length
    scale_advantages_by_std: bool = True
    dynamic_sampling: bool = False
    overlong_masking: bool = False

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


def overlong_penalty(rollout: EpisodeRollout, settings: ScoringSettings) -> float:
    """The soft overlong penalty (<= 0) of one episode; see the module docstring."""
    if rollout.truncation_cause not in OVERLONG_CAUSES:
        return 0.0
    budget = settings.max_model_length
    buffer = min(settings.overlong_buffer_tokens or budget, budget)
    used = budget if rollout.truncation_cause == TruncationCause.CONTEXT_OVERFLOW else rollout.total_tokens
    ramp = min(max((used - (budget - buffer)) / buffer, 0.0), 1.0)
    return -settings.overlong_penalty_factor * ramp if ramp > 0 else 0.0


@dataclass(frozen=True)
class _Shaped:
    """One episode after step 1-2: its final reward and whether it counts in the baseline."""

    episode: EpisodeRecord
    score: EpisodeScore
    penalty: float
    final_reward: float
    errored: bool


def _shape(episode: EpisodeRecord, score: EpisodeScore, settings: ScoringSettings) -> _Shaped:
    rollout = episode.rollout
    errored = rollout.error is not None or score.error is not None
    if errored:
        return _Shaped(episode, score, 0.0, score.reward, True)
    if rollout.truncation_cause == TruncationCause.PARSE_FAILURE:
        return _Shaped(episode, score, 0.0, settings.failed_parse_reward, False)
    penalty = overlong_penalty(rollout, settings)
    return _Shaped(episode, score, penalty, score.reward + penalty, False)


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
    rewards_G = [m.final_reward for m in members if not m.errored]
    mean = sum(rewards_G) / len(rewards_G) if rewards_G else 0.0
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards_G) / len(rewards_G)) if rewards_G else 0.0
    zero_variance = len(rewards_G) < 2 or max(rewards_G) - min(rewards_G) == 0.0
    return [_record(m, mean, std, len(rewards_G), zero_variance, settings) for m in members]


def _record(
    member: _Shaped, mean: float, std: float, group_size: int, zero_variance: bool,
    settings: ScoringSettings,
) -> ScoreRecord:
    episode, score = member.episode, member.score
    advantage = 0.0
    if not (member.errored or zero_variance):
        advantage = member.final_reward - mean
        if settings.scale_advantages_by_std:
            advantage /= std + STD_EPSILON
    masked = settings.overlong_masking and episode.rollout.truncated
    skipped = settings.dynamic_sampling and zero_variance
    threshold = score.threshold
    passed = not member.errored and (
        member.final_reward >= threshold if threshold is not None else member.final_reward > 0
    )
    return ScoreRecord(
        run_id=episode.run_id, step=episode.step, split=episode.split, task_id=episode.task_id,
        group_id=episode.group_id, episode_id=episode.episode_id, reward=score.reward,
        threshold=threshold, components=dict(score.components), overlong_penalty=member.penalty,
        final_reward=member.final_reward, passed=passed, group_mean=mean, group_std=std,
        group_size=group_size, zero_variance=zero_variance, advantage=advantage,
        trained=not (member.errored or masked or skipped),
        scoring_error=score.error if score.error is not None else episode.rollout.error,
    )


# ---------------------------------------------------------------- the stage


def score_stage(
    config: RunConfig, run_dir: Path, step: int, split: str,
    handle: EnvironmentHandle | None = None,
) -> Path:
    """Score step ``step``'s ``split`` episodes and write ``scores.parquet`` atomically.

    ``handle`` defaults to ``config.env``'s environment; the Python API passes the one it
    built from ``env_factory``. A finished output is returned as is.
    """
    folder = RunFolder(run_dir)
    done = folder.stage_output(step, "scores", split)
    if done is not None:
        return done
    episodes = table_to_episode_records(folder.read_stage(step, "episodes", split))
    if handle is None:
        handle = load_environment_handle(config.env.name, config.env.kwargs)
    env_scores = asyncio.run(score_groups(handle, split, episodes, config.rollout.concurrency))
    records = score_episodes_to_records(episodes, env_scores, ScoringSettings.from_config(config))
    return folder.write_stage(score_records_to_table(records), step, "scores", split)


async def score_groups(
    handle: EnvironmentHandle, split: str, episodes: Sequence[EpisodeRecord], concurrency: int,
) -> list[EpisodeScore]:
    """``handle.score`` once per group, at most ``concurrency`` groups at once; the scores
    come back aligned with ``episodes``."""
    if split not in SPLITS:
        raise ScoringError(f"split must be one of {SPLITS}, got {split!r}")
    items = {item.task_id: item for item in handle.tasks(cast(Split, split))}
    groups: dict[str, list[int]] = {}
    for index, episode in enumerate(episodes):
        groups.setdefault(episode.group_id, []).append(index)
    bound = asyncio.Semaphore(concurrency)

    async def score_group(indices: list[int]) -> list[EpisodeScore]:
        item = _group_item(items, [episodes[i] for i in indices], split)
        async with bound:
            scores = await handle.score(item, [episodes[i].rollout for i in indices])
        if len(scores) != len(indices):
            raise ScoringError(f"the environment gave {len(scores)} scores for {len(indices)} episodes")
        return scores

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
