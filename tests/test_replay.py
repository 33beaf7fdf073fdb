"""``rollflow replay`` on a real stored tiny run: the recorded actions, played again through
the unchanged environment, give the stored transcripts; a changed reply is caught at its
turn, with both texts; refusals are clear."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from rescore_env import make_changeable_run, reply_text

from rollflow.flows.cli import main
from rollflow.storage.derived import DerivedNameError
from rollflow.storage.query import open_run_sql, run_query
from rollflow.storage.runfolder import RunFolder
from rollflow.storage.schemas import table_to_episode_records
from rollflow.ops.replay import replay_run
from rollflow.ops.rescore import RescoreError

ENV = "rescore_env:load_environment"
SAME = {"num_tasks": 4}


@pytest.fixture(scope="module")
def stored_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, prefect_harness: object) -> Path:
    return make_changeable_run(tmp_path_factory.mktemp("replay-run"), tiny_model_dir)


@pytest.fixture
def run_dir(stored_run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(stored_run, tmp_path / stored_run.name))


def replays(run_dir: Path, columns: str) -> list[tuple]:
    con = open_run_sql(run_dir)
    try:
        return run_query(con, f"SELECT {columns} FROM replays ORDER BY episode_id")[1]
    finally:
        con.close()


def reply_index(run_dir: Path, episode_id: str, turn: int) -> int:
    """Where the environment's reply to action ``turn`` sits in the stored transcript."""
    folder = RunFolder(run_dir)
    split, step = episode_id.split("/")[:2]
    episodes = table_to_episode_records(folder.read_stage(int(step), "episodes", split))
    (episode,) = [e for e in episodes if e.episode_id == episode_id]
    assistant = [i for i, m in enumerate(episode.rollout.messages) if m["role"] == "assistant"]
    return assistant[turn - 1] + 1


@pytest.mark.slow  # 4 s in a loaded suite run (docs/testing.md)
def test_the_unchanged_environment_replays_every_episode_exactly(run_dir: Path) -> None:
    summary = replay_run(run_dir, ENV, SAME, name="same")
    rows = replays(run_dir, "matched, first_diff_turn, old_text, new_text, old_ending = new_ending, "
                            "old_turns = new_turns, replay_error")
    assert summary.rows == len(rows) == 8
    assert set(rows) == {(True, None, None, None, True, True, None)}


@pytest.mark.parametrize("turn", [1, 3])
def test_a_changed_reply_is_caught_at_its_turn_with_both_texts(run_dir: Path, turn: int) -> None:
    replay_run(run_dir, ENV, {**SAME, "changed_turn": turn}, name=f"turn{turn}")
    columns = "episode_id, matched, first_diff_turn, first_diff_message, old_text, new_text, old_ending, new_ending"
    rows = replays(run_dir, columns)
    assert len(rows) == 8
    for episode_id, matched, diff_turn, diff_message, old, new, old_ending, new_ending in rows:
        assert (matched, diff_turn) == (False, turn), episode_id
        assert diff_message == reply_index(run_dir, episode_id, turn)
        assert (old, new) == (reply_text(turn, changed=False), reply_text(turn, changed=True))
        assert old_ending == new_ending == "terminated"


def test_replay_refusals_name_the_problem(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(RescoreError, match="not a run folder"):
        replay_run(tmp_path, ENV, SAME)
    with pytest.raises(RescoreError, match="validation tasks lack 1 of the run's 2 task ids"):
        replay_run(run_dir, ENV, {"num_tasks": 1}, where="split = 'validation'")
    replay_run(run_dir, ENV, SAME, name="once")
    with pytest.raises(DerivedNameError, match="already used with other settings"):
        replay_run(run_dir, ENV, {**SAME, "changed_turn": 2}, name="once")
    assert main(["replay", str(run_dir), "--env", ENV, "--kwargs", '{"num_tasks": 4, "changed_turn": 2}']) == 0
    out = capsys.readouterr().out
    assert "0 of 8 episodes matched; the earliest difference is at turn 2" in out
