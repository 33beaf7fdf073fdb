"""MLflow tracking: one MLflow run per rollflow run, resumed in place, never a step twice.

MLflow with a sqlite store costs 1-2 s to open; the tests share one store per module.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow import MlflowClient

import rollflow.storage.tracking as tracking_module
from rollflow.storage.errors import NoDataError, StorageError
from rollflow.storage.runfolder import RunFolder
from rollflow.storage.tracking import TRACKING_FILE, RunTracker, artifact_location, default_tracking_uri, project_root


@pytest.fixture(scope="module")
def tracking_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'store' / 'mlflow.db'}"


def test_resume_continues_the_same_mlflow_run(tmp_path: Path, tracking_uri: str) -> None:
    folder = RunFolder(tmp_path / "run-a")
    tracker = RunTracker.open(folder, tracking_uri=tracking_uri)
    tracker.log_params({"train.learning_rate": 1e-5, "rollout.group_size": 8})
    assert tracker.log_step(0, {"reward/mean": 0.25, "episodes/truncated_ratio": 0.5}) == 2
    assert tracker.log_step(1, {"reward/mean": 0.5, "loss": float("nan")}) == 1  # NaN: skipped
    tracker.close("FAILED")  # the crash

    resumed = RunTracker.open(folder.root)  # stored URI and run id: no arguments needed
    assert resumed.mlflow_run_id == tracker.mlflow_run_id
    resumed.log_params({"train.learning_rate": 1e-5})  # same value again: fine
    assert resumed.log_step(1, {"reward/mean": 0.5}) == 0  # step 1 was already logged
    assert resumed.log_step(2, {"reward/mean": 0.75}) == 1
    resumed.close()

    client = MlflowClient(tracking_uri=tracking_uri)
    history = client.get_metric_history(tracker.mlflow_run_id, "reward/mean")
    assert sorted((m.step, m.value) for m in history) == [(0, 0.25), (1, 0.5), (2, 0.75)]
    run = client.get_run(tracker.mlflow_run_id)
    assert run.data.params == {"train.learning_rate": "1e-05", "rollout.group_size": "8"}
    assert run.info.run_name == "run-a" and run.info.status == "FINISHED"
    assert len(client.search_runs([tracker.ref.experiment_id])) == 1


def test_a_changed_param_is_refused(tmp_path: Path, tracking_uri: str) -> None:
    with RunTracker.open(tmp_path / "run-b", tracking_uri=tracking_uri) as tracker:
        tracker.log_params({"seed": 1})
        with pytest.raises(StorageError, match="param 'seed' was logged as '1'"):
            tracker.log_params({"seed": 2})
        with pytest.raises(ValueError, match="MLflow keeps 6000"):
            tracker.log_params({"long": "x" * 6001})


def test_reward_curve_and_artifacts_land_beside_the_store(tmp_path: Path, tracking_uri: str) -> None:
    with RunTracker.open(tmp_path / "run-c", tracking_uri=tracking_uri) as tracker:
        with pytest.raises(NoDataError, match="nothing is logged under 'reward/mean'"):
            tracker.log_reward_curve(tmp_path / "curve.png")
        for step, reward in enumerate([0.1, 0.3, 0.2]):
            tracker.log_step(step, {"reward/mean": reward})
        png = tracker.log_reward_curve(tmp_path / "plots" / "curve.png")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        client = MlflowClient(tracking_uri=tracking_uri)
        assert [a.path for a in client.list_artifacts(tracker.mlflow_run_id, "plots")] == ["plots/curve.png"]
        experiment = client.get_experiment(tracker.ref.experiment_id)
        store_dir = Path(tracking_uri.removeprefix("sqlite:///")).parent
        assert experiment.artifact_location == (store_dir / "mlartifacts" / "rollflow").as_uri()
        with pytest.raises(StorageError, match="no such file"):
            tracker.log_artifact(tmp_path / "missing.txt")


def test_resume_against_another_store_is_refused(tmp_path: Path, tracking_uri: str) -> None:
    folder = RunFolder(tmp_path / "run-d")
    RunTracker.open(folder, tracking_uri=tracking_uri).close()
    assert (folder.root / TRACKING_FILE).exists()
    with pytest.raises(StorageError, match="this run is tracked at"):
        RunTracker.open(folder, tracking_uri=f"sqlite:///{tmp_path}/elsewhere.db")


def test_default_uri_is_under_the_project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    project = tmp_path / "proj"
    (project / "sub").mkdir(parents=True)
    (project / "pyproject.toml").write_text("")
    assert project_root(project / "sub") == project
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert default_tracking_uri(project / "sub") == f"sqlite:///{project}/.rollflow/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracker:5000")
    assert default_tracking_uri(project) == "http://tracker:5000"
    assert artifact_location("http://tracker:5000", "x") is None


class PointCountingClient(MlflowClient):
    """The real client, counting the metric points its queries hand back."""

    points_read: list[int] = []

    def get_metric_history(self, run_id: str, key: str) -> list:  # type: ignore[override]
        history = super().get_metric_history(run_id, key)
        self.points_read.append(len(history))
        return history

    def get_run(self, run_id: str):  # type: ignore[no-untyped-def]  # noqa: ANN201
        run = super().get_run(run_id)
        self.points_read.append(len(run.data.metrics))
        return run


def test_the_duplicate_check_reads_as_much_at_step_30_as_at_step_1(
    tmp_path: Path, tracking_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each step opens the run afresh (as the metrics stage does); what that reads must
    not grow with the steps already logged, or a long run's logging is quadratic."""
    monkeypatch.setattr(tracking_module, "MlflowClient", PointCountingClient)
    folder = RunFolder(tmp_path / "run-e")
    RunTracker.open(folder, tracking_uri=tracking_uri).close()
    metrics = {"reward/mean": 0.5, "optim/loss": 1.0, "time/rollout": 2.0}
    read_per_step = []
    for step in range(30):
        PointCountingClient.points_read.clear()
        tracker = RunTracker.open(folder)
        assert tracker.log_step(step, metrics) == 3
        assert tracker.log_step(step, metrics) == 0  # the replay of a crashed metrics stage
        read_per_step.append(sum(PointCountingClient.points_read))
    assert read_per_step[1:] == [read_per_step[1]] * 29
    resumed = RunTracker.open(folder)
    assert resumed.log_step(12, metrics) == 0 and resumed.log_step(29, {"reward/mean": 0.1}) == 0
    assert resumed.log_step(30, {"reward/mean": 0.6, "new/key": 1.0}) == 2
    assert [s for s, _ in resumed.metric_history("reward/mean")] == list(range(31))
    assert resumed.metric_history("new/key") == [(30, 1.0)]
