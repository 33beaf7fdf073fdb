"""tasks/step_health.py: which steps fail the run and what their message says; errors.jsonl updates."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from rollflow.envs.types import TruncationCause
from rollflow.storage.records import EpisodeRecord, ScoreRecord
from rollflow.storage.runfolder import RunFolder
from rollflow.storage.synthetic import synthetic_episode, synthetic_score
from rollflow.tasks.step_health import (
    EpisodeError,
    StepFailedError,
    check_step_outcome,
    keep_episode_errors,
    read_episode_errors,
    step_hint,
    step_summary,
    validation_summary,
)

WHERE = Path("run/steps/step=000000/errors.jsonl")


def ended(index: int, how: str) -> tuple[EpisodeRecord, ScoreRecord]:
    """An episode of task ``index`` that ended ``how``: ok, rollout_error, scorer_error or overflow."""
    episode = synthetic_episode("run", 0, index, 0)
    rollout = dataclasses.replace(episode.rollout, terminated=True, truncated=False, truncation_cause=None, error=None)
    if how == "rollout_error":
        rollout = dataclasses.replace(rollout, terminated=False, error="KeyError: 'x' (in step_episode)")
    if how == "overflow":
        rollout = dataclasses.replace(rollout, terminated=False, truncated=True,
                                      truncation_cause=TruncationCause.CONTEXT_OVERFLOW)
    episode = dataclasses.replace(episode, rollout=rollout)
    score = synthetic_score(episode, reward=0.5)
    if how in ("rollout_error", "scorer_error"):
        score = dataclasses.replace(score, scoring_error="ValueError: bad (in score_episode)")
    return episode, score


def check(*hows: str) -> None:
    pairs = [ended(i, how) for i, how in enumerate(hows)]
    check_step_outcome([e for e, _ in pairs], [s for _, s in pairs], WHERE, 100, lambda e: pytest.fail("measured"))


def test_a_step_with_one_usable_episode_passes() -> None:
    check("rollout_error", "scorer_error", "overflow", "ok")


def test_mixed_failures_name_the_commonest_error_and_the_overflows() -> None:
    with pytest.raises(StepFailedError) as failed:
        check("rollout_error", "rollout_error", "scorer_error", "overflow")
    assert str(failed.value) == (
        "step 0: no episode to learn from: 3 of 4 failed (KeyError: 'x' (in step_episode) (2 of them; the other 1: "
        f"1 other errors); tracebacks in {WHERE}), the other 1 overflowed the context "
        "([rollout].max_model_length is 100)"
    )


def test_episodes_that_overflowed_after_acting_name_the_budget_not_the_prompt() -> None:
    with pytest.raises(StepFailedError, match=r"^step 0: all 2 episodes overflowed the context "
                       r"\(\[rollout\]\.max_model_length is 100\)$"):
        check("overflow", "overflow")  # synthetic episodes took 2 turns: no prompt is measured


def test_a_stage_replaces_only_its_own_lines_for_the_episodes_it_covers(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path)
    first = [EpisodeError("rollout", f"train/0/{i}/0", "t", "E: x", "tb") for i in range(3)]
    keep_episode_errors(folder, 0, "train", "rollout", [e.episode_id for e in first], first)
    keep_episode_errors(folder, 0, "train", "scoring", ["train/0/0/0"], [dataclasses.replace(first[0], stage="scoring")])
    path = keep_episode_errors(folder, 0, "train", "rollout", ["train/0/0/0", "train/0/1/0"], [])
    assert path is not None
    assert [(e.stage, e.episode_id) for e in read_episode_errors(path)] == [
        ("rollout", "train/0/2/0"), ("scoring", "train/0/0/0")]
    assert keep_episode_errors(folder, 1, "train", "rollout", ["train/1/0/0"], []) is None  # no file for nothing


def test_the_step_summary_counts_errors_and_overflows() -> None:
    metrics = {"episodes/count": 8.0, "reward/mean": 0.25, "reward/pass_rate": 0.375,
               "episodes/failed_ratio": 0.25, "episodes/context_overflow_ratio": 0.125}
    assert step_summary(metrics) == "reward 0.250 pass 38% errors 2/8 overflows 1/8"
    assert step_summary({"episodes/count": 4.0, "reward/mean": None}) == "reward n/a pass n/a errors 0/4 overflows 0/4"


def test_the_step_summary_counts_tool_errors_and_groups_with_reward_variance() -> None:
    metrics = {"episodes/count": 16.0, "reward/mean": 0.5, "reward/pass_rate": 0.5, "episodes/failed_ratio": 0.0,
               "episodes/context_overflow_ratio": 0.0, "tools/calls": 12.0, "tools/errors": 3.0,
               "episodes/groups": 4.0, "reward/zero_variance_skip_ratio": 0.25}
    assert step_summary(metrics) == ("reward 0.500 pass 50% errors 0/16 overflows 0/16 tool errors 3/12 calls "
                                     "groups with reward variance 3/4")
    assert step_hint(metrics) is None
    no_calls = {**metrics, "tools/calls": 0.0, "tools/errors": 0.0}
    assert " tool calls 0 groups" in step_summary(no_calls)


def test_a_step_whose_groups_all_scored_alike_says_it_learned_nothing_and_what_to_try() -> None:
    metrics = {"episodes/count": 16.0, "reward/mean": 0.0, "reward/pass_rate": 0.0, "episodes/failed_ratio": 0.0,
               "episodes/context_overflow_ratio": 0.0, "tools/calls": 0.0, "tools/errors": 0.0,
               "episodes/groups": 4.0, "reward/zero_variance_skip_ratio": 1.0}
    assert step_summary(metrics).endswith("groups with reward variance 0/4: nothing to learn")
    hint = step_hint(metrics)
    assert hint is not None and hint.startswith("nothing to learn")
    assert all(remedy in hint for remedy in ("rollflow sft", "partial credit", "worked example"))


def test_the_validation_line_reads_the_val_metrics_without_groups() -> None:
    metrics = {"val/episodes/count": 8.0, "val/reward/mean": 0.1, "val/reward/pass_rate": 0.125,
               "val/episodes/failed_ratio": 0.25, "val/episodes/context_overflow_ratio": 0.875,
               "val/tools/calls": 5.0, "val/tools/errors": 5.0, "val/episodes/groups": 8.0,
               "val/reward/zero_variance_skip_ratio": 1.0}
    assert validation_summary(metrics) == "reward 0.100 pass 12% errors 2/8 overflows 7/8 tool errors 5/5 calls"
