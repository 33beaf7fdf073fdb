"""Logging validation traces must leave MLflow's process-wide tracking URI as it found it.

Found running ``rollflow pipeline configs/pipeline.toml`` on the bundled model from a shell
with no ``MLFLOW_TRACKING_URI``: after the first validation pass logged its traces, the
pipeline registered its policy in ``./mlflow.db`` (MLflow's own default in the working
directory) instead of the project's ``.rollflow/mlflow.db``, so ``rollflow registry``
and the next night never saw it. The suite missed it because ``tests/conftest.py`` sets
``MLFLOW_TRACKING_URI`` for every test; this test removes it, as a user's shell has none.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import mlflow
import pytest

from rollflow.storage.registry import PolicyRegistry
from rollflow.storage.tracking import default_tracking_uri
from rollflow.storage.traces import TraceSelection, log_validation_traces
from test_traces import mlflow_run, validation_pass


@pytest.fixture
def no_tracking_uri(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """A project folder as the working directory, and no tracking URI set anywhere."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "pyproject.toml").touch()
    monkeypatch.chdir(project)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # restored after the test
    mlflow.set_tracking_uri(None)
    yield project
    mlflow.set_tracking_uri(None)  # MLflow reads the restored environment variable again


@pytest.mark.slow  # 5 s in a loaded suite run (docs/testing.md)
def test_traces_leave_the_default_store_to_the_project(no_tracking_uri: Path, tmp_path: Path) -> None:
    project_store = f"sqlite:///{no_tracking_uri / '.rollflow' / 'mlflow.db'}"
    assert default_tracking_uri() == project_store
    store = tmp_path / "store"
    store.mkdir()
    uri, _, experiment, run_id = mlflow_run(store)
    episodes, scores = validation_pass(3)
    pass_dir = tmp_path / "validation" / "step=000000"
    pass_dir.mkdir(parents=True)

    assert len(log_validation_traces(uri, experiment, run_id, pass_dir, episodes, scores, TraceSelection(1, 1, 1))) == 3

    assert "MLFLOW_TRACKING_URI" not in os.environ
    assert not mlflow.is_tracking_uri_set()
    assert default_tracking_uri() == project_store
    assert PolicyRegistry("tool-use-game").tracking_uri == project_store  # where the pipeline registers
    assert not (no_tracking_uri / "mlflow.db").exists()
