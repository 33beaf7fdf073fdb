"""Stage wall times come from the run folder, so a resumed step logs what its stages really took.

A step killed after its rollout is resumed: the rollout stage is not run again because its
output exists. Its ``time/rollout`` must still be the time the rollout took when it ran.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import replace
from pathlib import Path

import pytest

import rollflow.flows.step as step_module
from rollflow.config.run import config_to_toml, load_config
from rollflow.flows.step import run_stage
from rollflow.flows.train import train_flow
from rollflow.storage.errors import SchemaMismatchError
from rollflow.storage.runfolder import STAGE_SECONDS_JSON, RunFolder
from rollflow.storage.tracking import RunTracker


def recorded_stage_seconds(folder: RunFolder, step: int) -> dict[str, float]:
    return folder.stage_seconds(step)


class KilledInTraining(RuntimeError):
    pass


@pytest.fixture
def one_step_config(tiny_config_path: Path) -> Path:
    config = load_config(tiny_config_path)
    config = replace(
        config,
        train=replace(config.train, num_steps=1),
        validation=replace(config.validation, validation_interval=0),
    )
    tiny_config_path.write_text(config_to_toml(config))
    return tiny_config_path


@pytest.mark.usefixtures("prefect_harness")
def test_a_step_resumed_after_its_rollout_logs_the_rollout_s_real_time(
    one_step_config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    inner_rollout_s: list[float] = []
    real_rollout = step_module.rollout_stage

    def timed_rollout(*args: object) -> Path:
        started = time.perf_counter()
        path = real_rollout(*args)  # type: ignore[arg-type]
        inner_rollout_s.append(time.perf_counter() - started)
        return path

    def killed(*args: object) -> Path:
        raise KilledInTraining("killed in training")

    with monkeypatch.context() as patch:
        patch.setattr(step_module, "rollout_stage", timed_rollout)
        patch.setattr(step_module, "train_stage", killed)
        with pytest.raises(KilledInTraining):
            train_flow(config_path=str(one_step_config), run_dir=str(run_dir))
    folder = RunFolder(run_dir)
    assert folder.is_complete(0, "episodes") and not folder.is_complete(0, "train")
    recorded = recorded_stage_seconds(folder, 0)
    assert set(recorded) == {"rollout", "scoring", "flatten"}  # train never finished

    train_flow(run_dir=str(run_dir))  # the resume: rollout, scoring and flatten are skipped

    metrics = json.loads((folder.step_dir(0) / "metrics.json").read_text())
    [rollout_s] = inner_rollout_s  # the flow's clock encloses the stage call
    assert metrics["time/rollout"] == recorded["rollout"] >= rollout_s > 0
    for stage in ("scoring", "flatten"):
        assert metrics[f"time/{stage}"] == recorded[stage] > 0
    after = recorded_stage_seconds(folder, 0)
    assert {k: after[k] for k in recorded} == recorded  # the skipped stages kept their figures
    assert metrics["time/train"] == after["train"] > 0
    assert metrics["time/step"] == pytest.approx(sum(after.values()))
    logged = RunTracker.open(run_dir).metric_history("time/rollout")
    assert logged == [(0, recorded["rollout"])]


@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.slow  # 3 s in a loaded suite run (docs/testing.md)
def test_a_stage_finished_without_a_recorded_time_logs_no_time(
    one_step_config: Path, tmp_path: Path
) -> None:
    """A crash between a stage's rename and its time record: no figure, never a false 0."""
    run_dir = tmp_path / "run"
    train_flow(config_path=str(one_step_config), run_dir=str(run_dir))
    folder = RunFolder(run_dir)
    times_path = folder.step_dir(0) / STAGE_SECONDS_JSON
    recorded = json.loads(times_path.read_text())
    del recorded["rollout"]
    times_path.write_text(json.dumps(recorded))
    (folder.step_dir(0) / "metrics.json").unlink()  # as if killed before the metrics stage

    train_flow(run_dir=str(run_dir))

    metrics = json.loads((folder.step_dir(0) / "metrics.json").read_text())
    assert "time/rollout" not in metrics and "time/step" not in metrics
    assert metrics["time/train"] == recorded["train"]


def test_a_stage_times_file_that_is_not_stage_to_seconds_is_refused_by_path(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "run")
    assert recorded_stage_seconds(folder, 0) == {}
    path = folder.write_json_atomic(folder.step_dir(0) / STAGE_SECONDS_JSON, {"rollout": "fast"})
    with pytest.raises(SchemaMismatchError, match=re.escape(f"{path}: expected stage name -> seconds")):
        recorded_stage_seconds(folder, 0)
    with pytest.raises(ValueError, match="stages are \\['rollout', 'scoring', 'flatten', 'train', 'teacher'\\], got 'metrics'"):
        run_stage(folder, 0, "metrics", lambda out: out, out=path)
