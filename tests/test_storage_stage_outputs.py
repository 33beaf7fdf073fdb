"""A step's paths (``StepPaths``), and stage outputs named by their path: located, finished, read, written."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest

from rollflow.flows.step import run_once, run_stage
from rollflow.storage.errors import StageExistsError, StorageError
from rollflow.storage.runfolder import RunFolder
from rollflow.storage.schemas import episode_records_to_table, score_records_to_table, table_to_episode_records
from rollflow.storage.stage_outputs import finished_output, locate_output, read_output, write_output
from rollflow.storage.synthetic import synthetic_episode, synthetic_score


def _episodes(step: int, split: str = "train"):
    return [synthetic_episode("r", step, t, i, split=split) for t in range(2) for i in range(2)]


def test_step_paths_are_the_layout_s_files(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "run-7")
    p = folder.step_paths(3)
    step = tmp_path / "run-7/steps/step=000003"
    assert (p.step, p.split) == (3, "train")
    assert (p.episodes, p.admitted) == (step / "episodes", step / "episodes.parquet")
    assert (p.scores, p.samples, p.teacher) == (step / "scores.parquet", step / "samples.parquet", step / "teacher.parquet")
    assert (p.train_json, p.metrics_json) == (step / "train.json", step / "metrics.json")
    assert p.checkpoint == tmp_path / "run-7/checkpoints/step=000003"
    assert folder.step_paths(10, "validation").scores == tmp_path / "run-7/validation/step=000010/scores.parquet"
    where = locate_output(p.scores)
    assert (where.folder.root, where.step, where.split, where.stage) == (folder.root, 3, "train", "scores")
    assert locate_output(p.episodes).stage == locate_output(p.admitted).stage == "episodes"
    with pytest.raises(ValueError, match="not a stage output"):
        locate_output(tmp_path / "run-7/config.toml")
    with pytest.raises(ValueError, match="validation stages are"):
        locate_output(folder.step_paths(10, "validation").samples)


def test_a_step_is_finished_by_its_metrics_and_trains_on_from_the_checkpoint_before_it(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "run")
    assert folder.checkpoint_before(0) is None and folder.checkpoint_before(5) is None
    for step in (0, 2):
        folder.checkpoint_dir(step).mkdir(parents=True)
    assert folder.checkpoint_before(0) is None
    assert folder.checkpoint_before(1) == folder.checkpoint_before(2) == folder.checkpoint_dir(0)
    assert folder.checkpoint_before(3) == folder.checkpoint_dir(2)
    assert not folder.step_finished(0)
    folder.write_json_atomic(folder.step_paths(0).metrics_json, {})
    assert folder.step_finished(0) and not folder.step_finished(1)


def test_a_step_starts_from_the_checkpoint_of_the_step_before_or_is_refused_by_name(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "run")
    assert folder.starting_checkpoint(0) is None
    with pytest.raises(StorageError, match="step 1 starts from the checkpoint of step 0.*newest one before it is none"):
        folder.starting_checkpoint(1)
    for step in (0, 2):
        folder.checkpoint_dir(step).mkdir(parents=True)
    assert folder.starting_checkpoint(1) == folder.checkpoint_dir(0)
    assert folder.starting_checkpoint(3) == folder.checkpoint_dir(2)
    # step 2 acting or training on step 0's version would pass for step 1's: refused
    folder.checkpoint_dir(2).rmdir()
    with pytest.raises(StorageError, match="newest one before it is step=000000"):
        folder.starting_checkpoint(2)
    # a step whose own checkpoint is committed starts nothing more (retention may have
    # pruned the one before it)
    folder.checkpoint_dir(2).mkdir()
    assert folder.starting_checkpoint(2) == folder.checkpoint_dir(0)


def test_an_output_is_written_once_read_checked_and_either_form_of_episodes_counts(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "run")
    p = folder.step_paths(1)
    episodes = _episodes(1)
    assert finished_output(p.episodes) is None and finished_output(p.admitted) is None
    assert write_output(episode_records_to_table(episodes), p.admitted) == p.admitted
    assert finished_output(p.episodes) == finished_output(p.admitted) == p.admitted
    assert table_to_episode_records(read_output(p.admitted)) == episodes
    with pytest.raises(StageExistsError, match="never rewritten"):
        write_output(episode_records_to_table(episodes), p.admitted)
    with pytest.raises(ValueError, match="a scores stage output must be a scores table"):
        write_output(episode_records_to_table(episodes), p.scores)
    with pytest.raises(ValueError, match="cannot go in the train step=2 folder"):
        write_output(score_records_to_table([synthetic_score(e, 1.0) for e in episodes]), folder.step_paths(2).scores)
    with pytest.raises(ValueError, match="is one file"):
        write_output(episode_records_to_table(_episodes(3)), folder.step_paths(3).episodes)


def test_a_folder_of_parts_is_no_output_until_sealed(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "run")
    p = folder.step_paths(0)
    records = _episodes(0)
    folder.write_stage_part(episode_records_to_table(records[:2]), 0, "episodes", 0)
    assert finished_output(p.episodes) is None
    with pytest.raises(StorageError, match="not complete"):
        read_output(p.episodes)
    folder.seal_stage(0, "episodes")
    assert finished_output(p.admitted) == finished_output(p.episodes) == p.episodes
    assert table_to_episode_records(read_output(p.episodes)) == records[:2]


def test_run_stage_skips_a_finished_output_and_times_only_a_real_run(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "run")
    p = folder.step_paths(0)
    runs: list[Path] = []

    def write(out: Path) -> Path:  # the episodes out stands for, written whole (an admission)
        runs.append(p.admitted)
        return write_output(episode_records_to_table(_episodes(0)), p.admitted)

    assert run_stage(folder, 0, "rollout", write, out=p.episodes) == p.admitted
    recorded = folder.stage_seconds(0)
    assert list(recorded) == ["rollout"] and recorded["rollout"] > 0
    assert run_stage(folder, 0, "rollout", write, out=p.episodes) == p.admitted  # finished: not run again
    assert runs == [p.admitted] and folder.stage_seconds(0) == recorded
    assert run_once(lambda out: folder.write_json_atomic(out, {"n": 1}), out=p.metrics_json) == p.metrics_json
    assert run_once(partial(pytest.fail, "metrics.json exists"), out=p.metrics_json) == p.metrics_json
    assert json.loads(p.metrics_json.read_text()) == {"n": 1}
