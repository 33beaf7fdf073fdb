"""Flattening stage: scored episodes -> training samples, from the exact sampled token ids.

An episode's actions (``rollflow.envs.episode.ActionTokens``) each carry the context tokens appended
before the action (``prompt_delta_ids``) and the sampled tokens (``token_ids``) with their
sampler logprobs. Laid end to end they are exactly the sequence the model saw, so a sample
is their concatenation:

- context tokens: loss mask 0, advantage 0, sampler logprob 0 (never trained);
- action tokens: loss mask 1, the episode's advantage, the sampler's logprob.

Where an action says ``reset`` (the chat template rewrote earlier history, e.g. it dropped
a reasoning model's hidden thoughts) its ``prompt_delta_ids`` is a whole fresh prompt, and a
new sample starts there, so every token still lines up with what was sampled. Sample ids
are ``f"{episode_id}#{index}"``.

Episodes whose score says ``trained=False`` (errored, overlong-masked, a skipped
zero-variance group) give no samples; their rewards already counted in the group baseline
during scoring. The work is linear in the episode's length: each token is appended once.

Simplified on purpose: the context tail after the last action (an overflowing prompt, a
final tool result) is dropped since nothing after it is trained; a sample is never cut to
fit ``max_model_length`` (the runner already kept episodes inside that budget).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rollflow.envs.episode import ActionTokens
from rollflow.storage.records import EpisodeRecord, SampleRecord, ScoreRecord
from rollflow.storage.schemas import (
    sample_records_to_table,
    table_to_episode_records,
    table_to_score_records,
)
from rollflow.storage.stage_outputs import read_output, write_output


class FlattenError(ValueError):
    """An episode's tokens cannot be turned into samples; the message names the episode."""


@dataclass
class _SampleBuilder:
    """Columns of one sample under construction (appended to, never re-concatenated)."""

    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    sampler_logprobs: list[float] = field(default_factory=list)
    trained_length: int = 0  # length up to and including the last action token

    def add_context(self, token_ids: Sequence[int]) -> None:
        self.input_ids.extend(token_ids)
        self.loss_mask.extend([0] * len(token_ids))
        self.advantages.extend([0.0] * len(token_ids))
        self.sampler_logprobs.extend([0.0] * len(token_ids))

    def add_action(self, action: ActionTokens, advantage: float) -> None:
        self.input_ids.extend(action.token_ids)
        self.loss_mask.extend([1] * len(action.token_ids))
        self.advantages.extend([advantage] * len(action.token_ids))
        self.sampler_logprobs.extend(action.logprobs)
        if action.token_ids:
            self.trained_length = len(self.input_ids)


def flatten_episode_to_samples(episode: EpisodeRecord, score: ScoreRecord) -> list[SampleRecord]:
    """The training samples of one scored episode (none when it is not trained)."""
    if score.episode_id != episode.episode_id:
        raise FlattenError(
            f"score of {score.episode_id!r} given for episode {episode.episode_id!r}"
        )
    if not score.trained:
        return []
    builders: list[_SampleBuilder] = []
    for index, action in enumerate(episode.rollout.actions):
        if index == 0 or action.reset:
            builders.append(_SampleBuilder())
        current = builders[-1]
        current.add_context(action.prompt_delta_ids)
        if action.token_ids and len(current.input_ids) == 0:
            raise FlattenError(
                f"episode {episode.episode_id!r}, action {index}: a sample cannot start with "
                "an action token (no context before it to predict it from)"
            )
        current.add_action(action, score.advantage)
    built = [b for b in builders if b.trained_length > 0]
    return [_to_record(episode, i, b) for i, b in enumerate(built)]


def _to_record(episode: EpisodeRecord, index: int, builder: _SampleBuilder) -> SampleRecord:
    end = builder.trained_length  # the context tail after the last action is not trained
    return SampleRecord(
        run_id=episode.run_id,
        step=episode.step,
        sample_id=f"{episode.episode_id}#{index}",
        episode_id=episode.episode_id,
        group_id=episode.group_id,
        input_ids=tuple(builder.input_ids[:end]),
        loss_mask=tuple(builder.loss_mask[:end]),
        advantages=tuple(builder.advantages[:end]),
        sampler_logprobs=tuple(builder.sampler_logprobs[:end]),
        env=episode.env,
    )


def flatten_episodes(
    episodes: Sequence[EpisodeRecord], scores: Sequence[ScoreRecord]
) -> list[SampleRecord]:
    """Samples of every episode, each paired with its score by episode id."""
    by_id = {score.episode_id: score for score in scores}
    if len(by_id) != len(scores):
        raise FlattenError("scores hold the same episode id more than once")
    missing = [e.episode_id for e in episodes if e.episode_id not in by_id]
    if missing:
        raise FlattenError(f"{len(missing)} episodes have no score, e.g. {missing[0]!r}")
    samples: list[SampleRecord] = []
    for episode in episodes:
        samples.extend(flatten_episode_to_samples(episode, by_id[episode.episode_id]))
    return samples


def flatten_stage(episodes: Path, scores: Path, out: Path) -> Path:
    """Flatten a step's scored training episodes into ``out`` (``samples.parquet``).

    Flattening has no settings (what is trained was decided by scoring). A step with
    nothing to train writes an empty table, so the stage still counts as done.
    """
    samples = flatten_episodes(
        table_to_episode_records(read_output(episodes)), table_to_score_records(read_output(scores))
    )
    return write_output(sample_records_to_table(samples), out)
