"""Flattening: exact tokens, masks, aligned logprobs and advantages, resets, untrained."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from rollflow.envs.episode import ActionTokens, EpisodeRollout
from rollflow.flows.step import run_once
from rollflow.storage.records import EpisodeRecord, ScoreRecord
from rollflow.storage.runfolder import RunFolder
from rollflow.storage.schemas import episode_records_to_table, score_records_to_table, table_to_sample_records
from rollflow.tasks.flatten import FlattenError, flatten_episode_to_samples, flatten_episodes, flatten_stage


def action(prompt: tuple[int, ...], tokens: tuple[int, ...], *, reset: bool = False) -> ActionTokens:
    logprobs = tuple(-0.1 * (i + 1) for i in range(len(tokens)))
    return ActionTokens(prompt, reset, tokens, logprobs, "stop")


def episode(actions: tuple[ActionTokens, ...], episode_id: str = "train/0/0/0") -> EpisodeRecord:
    rollout = EpisodeRollout(
        messages=({"role": "user", "content": "hi"},), response_text="x", turns=len(actions),
        terminated=True, truncated=False, truncation_cause=None, actions=actions,
    )
    return EpisodeRecord("run", 0, "train", "task-0", "train/0/0", episode_id, 0, rollout)


def score(episode_id: str = "train/0/0/0", advantage: float = 0.5, trained: bool = True) -> ScoreRecord:
    return ScoreRecord(
        run_id="run", step=0, split="train", task_id="task-0", group_id="train/0/0",
        episode_id=episode_id, reward=1.0, threshold=None, components={}, overlong_penalty=0.0,
        final_reward=1.0, passed=True, group_mean=0.5, group_std=0.5, group_size=2,
        zero_variance=False, advantage=advantage, trained=trained,
    )


def test_two_turn_episode_becomes_one_aligned_sample() -> None:
    ep = episode((action((1, 2, 3), (10, 11)), action((4, 5), (12,))))
    [sample] = flatten_episode_to_samples(ep, score(advantage=0.5))
    assert sample.sample_id == "train/0/0/0#0"
    assert sample.input_ids == (1, 2, 3, 10, 11, 4, 5, 12)
    assert sample.loss_mask == (0, 0, 0, 1, 1, 0, 0, 1)
    assert sample.advantages == (0.0, 0.0, 0.0, 0.5, 0.5, 0.0, 0.0, 0.5)
    assert sample.sampler_logprobs == pytest.approx((0, 0, 0, -0.1, -0.2, 0, 0, -0.1))
    assert (sample.episode_id, sample.group_id, sample.step) == ("train/0/0/0", "train/0/0", 0)


def test_reset_starts_a_new_sample_with_the_fresh_prompt() -> None:
    ep = episode((
        action((1, 2), (10,)),
        action((3,), (11,)),
        action((1, 2, 9), (12, 13), reset=True),  # the template rewrote history
    ))
    first, second = flatten_episode_to_samples(ep, score(advantage=-1.0))
    assert first.input_ids == (1, 2, 10, 3, 11) and first.loss_mask == (0, 0, 1, 0, 1)
    assert second.sample_id.endswith("#1")
    assert second.input_ids == (1, 2, 9, 12, 13) and second.loss_mask == (0, 0, 0, 1, 1)
    assert second.advantages == (0.0, 0.0, 0.0, -1.0, -1.0)


def test_trailing_context_without_action_is_dropped() -> None:
    # The last action overflowed the context: a prompt delta and no sampled tokens.
    overflow = ActionTokens((7, 8, 9), False, (), (), "context")
    ep = episode((action((1, 2), (10,)), overflow))
    [sample] = flatten_episode_to_samples(ep, score())
    assert sample.input_ids == (1, 2, 10)


def test_untrained_and_tokenless_episodes_give_no_samples() -> None:
    ep = episode((action((1,), (2,)),))
    assert flatten_episode_to_samples(ep, score(trained=False)) == []
    assert flatten_episode_to_samples(episode(()), score()) == []


def test_action_without_context_before_it_is_an_error() -> None:
    ep = episode((action((), (10, 11)),))
    with pytest.raises(FlattenError, match="cannot start with an action token"):
        flatten_episode_to_samples(ep, score())


def test_score_for_another_episode_is_an_error() -> None:
    with pytest.raises(FlattenError, match="given for episode"):
        flatten_episode_to_samples(episode((action((1,), (2,)),)), score(episode_id="other"))


def test_flatten_episodes_pairs_by_id_and_requires_every_score() -> None:
    a = episode((action((1,), (2,)),), "train/0/0/0")
    b = episode((action((3,), (4,)),), "train/0/0/1")
    samples = flatten_episodes([a, b], [score("train/0/0/1", 2.0), score("train/0/0/0", 1.0)])
    assert [(s.episode_id, s.advantages[-1]) for s in samples] == [("train/0/0/0", 1.0), ("train/0/0/1", 2.0)]
    with pytest.raises(FlattenError, match="no score"):
        flatten_episodes([a, b], [score("train/0/0/0")])


def test_long_episode_flattens_every_token_once() -> None:
    actions = tuple(action(tuple(range(5)), (100 + t, 200 + t)) for t in range(64))
    [sample] = flatten_episode_to_samples(episode(actions), score())
    assert len(sample.input_ids) == 64 * 7
    assert sum(sample.loss_mask) == 128
    assert sample.input_ids[-2:] == (163, 263)
    # tokens and logprobs stay aligned: each action's first token has logprob -0.1
    firsts = [lp for tok, lp in zip(sample.input_ids, sample.sampler_logprobs, strict=True) if 100 <= tok < 200]
    assert firsts == pytest.approx([-0.1] * 64)


def test_samples_are_frozen_records() -> None:
    [sample] = flatten_episode_to_samples(episode((action((1,), (2,)),)), score())
    with pytest.raises(dataclasses.FrozenInstanceError):
        sample.step = 3  # type: ignore[misc]


# ---------------------------------------------------------------- the stage


def test_flatten_stage_writes_samples_of_trained_episodes_only(tmp_path: Path) -> None:
    a = episode((action((1, 2), (3, 4)), action((5,), (6,))), "train/0/0/0")
    b = episode((action((1, 2), (7,)),), "train/0/0/1")
    folder = RunFolder(tmp_path)
    folder.write_stage(episode_records_to_table([a, b]), 0, "episodes")
    folder.write_stage(score_records_to_table([score(a.episode_id, 0.25), score(b.episode_id, trained=False)]), 0, "scores")
    p = folder.step_paths(0)
    path = flatten_stage(p.admitted, p.scores, p.samples)
    [sample] = table_to_sample_records(folder.read_stage(0, "samples"))
    assert sample.input_ids == (1, 2, 3, 4, 5, 6) and sample.loss_mask == (0, 0, 1, 1, 0, 1)
    assert sample.advantages == (0.0, 0.0, 0.25, 0.25, 0.0, 0.25)
    assert sample.sampler_logprobs == pytest.approx((0.0, 0.0, -0.1, -0.2, 0.0, -0.1))
    assert run_once(flatten_stage, p.admitted, p.scores, out=p.samples) == path  # finished: returned as is


def test_flatten_stage_with_nothing_to_train_writes_an_empty_table(tmp_path: Path) -> None:
    a = episode((action((1,), (2,)),))
    folder = RunFolder(tmp_path)
    folder.write_stage(episode_records_to_table([a]), 0, "episodes")
    folder.write_stage(score_records_to_table([score(trained=False)]), 0, "scores")
    p = folder.step_paths(0)
    flatten_stage(p.admitted, p.scores, p.samples)
    assert folder.read_stage(0, "samples").num_rows == 0
