"""The run folder answers what is finished, where to resume, and what a crash left behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rollflow.storage.errors import ConfigMismatchError, SchemaMismatchError, StageExistsError, StorageError
from rollflow.storage.parquet import temporary_path
from rollflow.storage.records import TrainResult
from rollflow.storage.runfolder import RunFolder
from rollflow.storage.runs import age_text, list_runs, mark_run_kind, run_status
from rollflow.storage.schemas import episode_records_to_table, score_records_to_table, table_to_episode_records
from rollflow.storage.synthetic import synthetic_episode, synthetic_score


def _episodes(step: int, split: str = "train"):
    return [synthetic_episode("r", step, t, i, split=split) for t in range(2) for i in range(2)]


def _train_result(step: int) -> TrainResult:
    return TrainResult("r", step, step + 1, 0.5, None, 0.0, 1.0, 4, 100, 20, 1e-5, 10.0, {"backward": 0.5})


def _finish_step(folder: RunFolder, step: int) -> None:
    episodes = _episodes(step)
    folder.write_stage(episode_records_to_table(episodes), step, "episodes")
    folder.write_stage(score_records_to_table([synthetic_score(e, 1.0) for e in episodes]), step, "scores")
    folder.write_train_result(_train_result(step))
    folder.write_json_atomic(folder.step_paths(step).metrics_json, {})  # written last: the step is finished


def test_layout_matches_the_design(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "run-7")
    assert folder.run_id == "run-7"
    assert folder.stage_path(3, "episodes") == tmp_path / "run-7/steps/step=000003/episodes.parquet"
    assert folder.stage_path(3, "train") == tmp_path / "run-7/steps/step=000003/train.json"
    assert folder.parts_dir(3, "episodes") == tmp_path / "run-7/steps/step=000003/episodes"
    assert folder.stage_path(10, "scores", "validation") == tmp_path / "run-7/validation/step=000010/scores.parquet"
    assert folder.checkpoint_dir(3) == tmp_path / "run-7/checkpoints/step=000003"
    with pytest.raises(ValueError, match="validation stages are \\['episodes', 'scores'\\]"):
        folder.stage_path(10, "samples", "validation")
    with pytest.raises(ValueError, match="split must be one of"):
        folder.stage_path(1, "episodes", "test")
    with pytest.raises(ValueError, match="steps count from 0"):
        folder.step_dir(-1)


def test_config_is_frozen(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "run")
    folder.write_config("[train]\nnum_steps = 2\n")
    folder.write_config("[train]\nnum_steps = 2\n")  # the same text again is fine (resume)
    with pytest.raises(ConfigMismatchError, match="frozen"):
        folder.write_config("[train]\nnum_steps = 3\n")
    assert folder.read_config() == "[train]\nnum_steps = 2\n"


def test_progress_follows_finished_stages(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "run")
    assert (folder.completed_steps(), folder.next_step(), folder.first_incomplete_stage(0)) == ([], 0, "episodes")
    _finish_step(folder, 0)
    _finish_step(folder, 1)
    folder.write_stage(episode_records_to_table(_episodes(2)), 2, "episodes")
    assert folder.completed_steps() == [0, 1]
    assert folder.next_step() == 2
    assert folder.first_incomplete_stage(2) == "scores"
    assert folder.is_complete(2, "episodes") and not folder.is_complete(2, "scores")
    assert folder.read_train_result(1) == _train_result(1)


def test_finished_stages_are_never_rewritten(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "run")
    _finish_step(folder, 0)
    with pytest.raises(StageExistsError, match="episodes is already complete"):
        folder.write_stage(episode_records_to_table(_episodes(0)), 0, "episodes")
    with pytest.raises(StageExistsError, match="train is already complete"):
        folder.write_train_result(_train_result(0))


def test_stage_tables_must_belong_to_their_folder(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "run")
    with pytest.raises(ValueError, match="rows for step \\[4\\] cannot go in the train step=3"):
        folder.write_stage(episode_records_to_table(_episodes(4)), 3, "episodes")
    with pytest.raises(ValueError, match="split \\['validation'\\]"):
        folder.write_stage(episode_records_to_table(_episodes(3, "validation")), 3, "episodes")
    with pytest.raises(ValueError, match="must be a scores table, got episodes"):
        folder.write_stage(episode_records_to_table(_episodes(3)), 3, "scores")


def test_sharded_stage_is_complete_once_sealed(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "run")
    records = _episodes(5)
    folder.write_stage_part(episode_records_to_table(records[:2]), 5, "episodes", 0)
    folder.write_stage_part(episode_records_to_table(records[2:]), 5, "episodes", 1)
    assert not folder.is_complete(5, "episodes")
    assert len(folder.part_paths(5, "episodes")) == 2
    with pytest.raises(StorageError, match="episodes is not complete"):
        folder.read_stage(5, "episodes")
    folder.seal_stage(5, "episodes")
    assert folder.stage_output(5, "episodes") == folder.parts_dir(5, "episodes")
    assert table_to_episode_records(folder.read_stage(5, "episodes")) == records
    with pytest.raises(StageExistsError):
        folder.write_stage(episode_records_to_table(records), 5, "episodes")


def test_checkpoint_counts_only_once_renamed(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "run")
    assert folder.latest_checkpoint() is None
    first = folder.new_checkpoint_tmp(1)
    (first / "adapter.safetensors").write_bytes(b"weights")
    folder.commit_checkpoint(first, 1)
    second = folder.new_checkpoint_tmp(2)
    (second / "adapter.safetensors").write_bytes(b"half")  # the crash happens here
    step, path = folder.latest_checkpoint()
    assert (step, path) == (1, folder.checkpoint_dir(1))
    assert (path / "adapter.safetensors").read_bytes() == b"weights"
    with pytest.raises(StageExistsError, match="already committed"):
        folder.commit_checkpoint(folder.new_checkpoint_tmp(1), 1)


def test_discard_temporaries_keeps_everything_finished(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "run")
    _finish_step(folder, 0)
    folder.write_stage_part(episode_records_to_table(_episodes(1)), 1, "episodes", 0)
    half_part = temporary_path(folder.parts_dir(1, "episodes") / "part-00001.parquet")
    half_part.write_bytes(b"half")
    half_scores = temporary_path(folder.stage_path(0, "samples"))
    half_scores.write_bytes(b"half")
    half_checkpoint = folder.new_checkpoint_tmp(1)
    (half_checkpoint / "optimizer.pt").write_bytes(b"half")
    kept_before = sorted(p for p in folder.root.rglob("*") if p.is_file() and ".tmp-" not in str(p))

    removed = folder.discard_temporaries()

    assert sorted(removed) == sorted([half_part, half_scores, half_checkpoint])
    assert not any(p.exists() for p in removed)
    assert sorted(p for p in folder.root.rglob("*") if p.is_file()) == kept_before
    assert len(folder.part_paths(1, "episodes")) == 1, "the complete part survives the resume"
    assert folder.discard_temporaries() == []



def test_discard_temporaries_leaves_rescores_and_replays_to_their_own_command(tmp_path: Path) -> None:
    """A resume of the run may start while a rescore writes; its opener cleans its own folder."""
    folder = RunFolder(tmp_path / "run")
    half_stage = temporary_path(folder.stage_path(0, "samples"))
    half_stage.parent.mkdir(parents=True)
    half_stage.write_bytes(b"half")
    writing = []
    for kind in ("rescores", "replays"):
        chunk = folder.root / kind / "name" / "train" / "step=000000.parquet"
        chunk.parent.mkdir(parents=True)
        writing.append(temporary_path(chunk))
        writing[-1].write_bytes(b"half")

    assert folder.discard_temporaries() == [half_stage]
    assert all(p.exists() for p in writing)

def test_read_train_result_names_a_bad_file(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "run")
    folder.write_json_atomic(folder.stage_path(0, "train"), {"record": "scores"})
    with pytest.raises(SchemaMismatchError, match="train.json: not a train result"):
        folder.read_train_result(0)


def test_run_status_says_where_each_run_stopped(tmp_path: Path) -> None:
    done = RunFolder(tmp_path / "runs/a-done")
    done.write_config("[train]\nnum_steps = 2\n")
    _finish_step(done, 0)
    _finish_step(done, 1)
    stopped = RunFolder(tmp_path / "runs/b-stopped")
    stopped.write_config("[train]\nnum_steps = 5\n")
    _finish_step(stopped, 0)
    stopped.write_stage(episode_records_to_table(_episodes(1)), 1, "episodes")
    temporary_path(stopped.stage_path(1, "scores")).write_bytes(b"half")
    (tmp_path / "runs/not-a-run").mkdir()

    statuses = list_runs(tmp_path / "runs")

    assert [s.run_id for s in statuses] == ["a-done", "b-stopped"]
    assert statuses[0].complete and statuses[0].describe() == "complete (2 steps)"
    b = statuses[1]
    assert not b.complete and (b.last_finished_step, b.next_step, b.stopped_stage) == (0, 1, "scores")
    assert b.describe() == "stopped unexpectedly at step 1 of 5, stage scores"  # it recorded no exit
    assert b.temporaries == 1


def test_run_status_without_a_readable_config(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "run")
    _finish_step(folder, 0)
    assert run_status(folder.root).config_problem == "no config.toml"
    folder.config_path.write_text("[train\n")
    status = run_status(folder.root)
    assert status.num_steps is None and "unreadable" in (status.config_problem or "")
    assert status.describe() == "stopped unexpectedly at step 1, stage episodes"


def test_run_status_of_evaluation_and_sft_folders(tmp_path: Path) -> None:
    # An evaluation is one validation pass and an SFT run has no steps at all: neither
    # is "in progress at step 0" once it has finished.
    evaluation = RunFolder(tmp_path / "runs/eval-a")
    evaluation.write_config("[validation]\nnum_tasks = 2\n")
    mark_run_kind(evaluation.root, "eval")
    sft = RunFolder(tmp_path / "runs/sft-b")
    sft.write_config("[sft]\nepochs = 1\n")
    mark_run_kind(sft.root, "sft")
    old_sft = RunFolder(tmp_path / "runs/sft-c")  # written before the marker existed
    old_sft.write_config("[sft]\nepochs = 1\n")
    (old_sft.root / "sft/policy").mkdir(parents=True)

    before = {s.run_id: s.describe() for s in list_runs(tmp_path / "runs")}
    assert before == {"eval-a": "evaluation stopped or failed",
                      "sft-b": "sft stopped or failed", "sft-c": "sft stopped or failed"}

    evaluation.write_json_atomic("validation/step=000000/metrics.json", {"val/reward": 0.5})
    for folder in (sft, old_sft):
        folder.write_json_atomic("sft/policy/sft.json", {"rows": 1})
    after = {s.run_id: (s.kind, s.complete, s.describe()) for s in list_runs(tmp_path / "runs")}
    assert after == {"eval-a": ("eval", True, "evaluation complete"),
                     "sft-b": ("sft", True, "sft complete"), "sft-c": ("sft", True, "sft complete")}
    with pytest.raises(ValueError, match="run kind"):
        mark_run_kind(evaluation.root, "evaluation")


def test_age_text() -> None:
    assert age_text(100.0, now=142.0) == "42s ago"
    assert age_text(0.0, now=2 * 86400 + 5) == "2d ago"
    assert age_text(os.path.getmtime(__file__)).endswith("ago")


def test_a_relative_run_folder_writes_where_its_paths_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Paths handed out by the folder come back to it: no runs/x/runs/x/ doubling."""
    monkeypatch.chdir(tmp_path)
    folder = RunFolder(Path("runs") / "relative")
    written = folder.write_json_atomic(folder.step_dir(0) / "metrics.json", {"a": 1})
    assert written == tmp_path / "runs" / "relative" / "steps" / "step=000000" / "metrics.json"
    assert written.exists() and not (tmp_path / "runs" / "relative" / "runs").exists()
