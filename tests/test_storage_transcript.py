"""A stored episode reads as a transcript: who said what, which tools ran, how it ended."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from rollflow.storage.errors import NoDataError
from rollflow.storage.runfolder import RunFolder
from rollflow.storage.schemas import episode_records_to_table, score_records_to_table
from rollflow.storage.synthetic import synthetic_episode, synthetic_score
from rollflow.storage.transcript import render_episode


@pytest.fixture
def run(tmp_path: Path) -> RunFolder:
    folder = RunFolder(tmp_path / "run-a")
    episodes = [synthetic_episode("run-a", 3, t, i) for t in range(2) for i in range(4)]
    folder.write_stage(episode_records_to_table(episodes), 3, "episodes")
    scores = [
        dataclasses.replace(synthetic_score(e, 1.0, advantage=0.75), group_mean=0.25, group_std=0.5, group_size=4)
        for e in episodes[:4]
    ]
    folder.write_stage(score_records_to_table(scores), 3, "scores")
    return folder


def test_transcript_shows_roles_tools_ending_and_score(run: RunFolder) -> None:
    text = render_episode(run.root, "train/3/0/1")
    lines = text.splitlines()
    assert lines[0] == "Episode train/3/0/1"
    assert "step 3 · train · task task-0 · group train/3/0" in lines[1]
    assert "2 turns · 41 tokens (35 context + 6 sampled)" in lines[2]
    assert lines[2].endswith("s · 2 actions, 0 retried"), lines[2]  # before: "2 sampling attempts"
    order = ["[system]", "[user]", "[assistant]", "[tool calculator] (reply to call_0_1)", "[assistant]"]
    labels = [line for line in lines if line.startswith("[")]
    assert labels == order
    assert '  -> calculator({"expression": "0*3"})  id=call_0_1' in lines
    assert "  What is 0 * 3?" in lines
    assert "Ended: terminated by the environment" in lines
    assert "Environment reward: 1; metrics: tool_calls=1" in lines
    assert "Reward: 1 -> final 1 (overlong penalty 0, threshold 1, passed)" in lines
    assert "Advantage: +0.7500 (group mean 0.2500, std 0.5000, over 4; trained)" in lines


def test_truncated_errored_and_unscored_episodes(run: RunFolder) -> None:
    truncated = render_episode(run.root, "train/3/0/3")  # seed 3: max_turns
    assert "Ended: truncated (max_turns)" in truncated
    errored = render_episode(run.root, "train/3/1/0")  # seed 31: error, not scored
    assert "Ended: error (RuntimeError: the environment fell over)" in errored
    assert "Environment reward: none; metrics: none" in errored
    assert "Score: not scored yet" in errored


def test_unknown_episode_names_what_ids_look_like(run: RunFolder) -> None:
    with pytest.raises(NoDataError, match="no episode 'train/9/9/9'; ids look like 'train/3/0/0'"):
        render_episode(run.root, "train/9/9/9")


def test_a_final_reply_cut_at_the_token_limit_is_said_so(tmp_path: Path) -> None:
    """The newcomer's item 15: an answer cut off at max_completion_tokens read as an
    ordinary ending ("terminated by the environment") with nothing about the cut."""
    episode = synthetic_episode("run-c", 0, 0, 0)  # terminated
    actions = episode.rollout.actions
    cut = dataclasses.replace(actions[-1], finish_reason="length")
    episode = dataclasses.replace(episode, rollout=dataclasses.replace(episode.rollout, actions=(*actions[:-1], cut)))
    folder = RunFolder(tmp_path / "run-c")
    folder.write_stage(episode_records_to_table([episode]), 0, "episodes")
    text = render_episode(folder.root, episode.episode_id)
    assert ("Ended: terminated by the environment; its last reply was cut off at "
            "[rollout].max_completion_tokens (finish_reason 'length')") in text.splitlines()
