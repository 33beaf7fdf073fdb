"""MLflow tracking for one rollflow run; the only module that imports MLflow.

One rollflow run is one MLflow run. Its id is kept in the run folder
(``tracking.json``: tracking URI, experiment id, MLflow run id), so resuming a run folder
continues the same MLflow run rather than starting a second one.

Where things go, first match wins: the ``tracking_uri`` argument (the config's
``[tracking]``), the URI stored in ``tracking.json`` on resume, ``MLFLOW_TRACKING_URI``,
else ``sqlite:///<project>/.rollflow/mlflow.db`` where ``<project>`` is the nearest
folder above the working directory with a ``pyproject.toml`` or ``.git`` (else the
working directory). For a ``sqlite:`` store the experiment's artifact location is set
explicitly to ``mlartifacts/`` beside the database (MLflow would otherwise write
``./mlruns`` wherever the process happens to run).

Resume safety: ``log_params`` skips values already logged and refuses a changed one;
``log_step`` skips a metric at or before the last step it was logged at, so re-running a
finished step after a crash never draws a second point. Steps are logged in increasing
order, so "at or before the last logged step" is exactly "already logged", and the last
step of every key comes with the one ``get_run`` that resuming makes anyway (MLflow keeps
each key's latest point, the one with the highest step): opening the run and checking a
step cost the same at step 3 and at step 3000, where reading each key's whole history
would make a long run's logging quadratic.

Simplified: a crash between creating the MLflow run and writing ``tracking.json`` leaves
an orphan MLflow run and the resume starts another; non-finite metric values are not
logged (they are still in the run's files for SQL).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import TypeVar
from urllib.parse import urlparse

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, Run
from mlflow.exceptions import MlflowException

from rollflow.storage.errors import NoDataError, StorageError
from rollflow.storage.runfolder import RunFolder

TRACKING_FILE = "tracking.json"
MAX_PARAM_LENGTH = 6000  # MLflow's limit on one param value
_PARAMS_PER_BATCH = 100
_METRICS_PER_BATCH = 1000
T = TypeVar("T")


@dataclass(frozen=True)
class TrackingRef:
    tracking_uri: str
    experiment_id: str
    mlflow_run_id: str


def project_root(start: Path | None = None) -> Path:
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "pyproject.toml").exists() or (folder / ".git").exists():
            return folder
    return here


def default_tracking_uri(start: Path | None = None) -> str:
    from_env = os.environ.get("MLFLOW_TRACKING_URI")
    if from_env:
        return from_env
    return f"sqlite:///{project_root(start) / '.rollflow' / 'mlflow.db'}"


def artifact_location(tracking_uri: str, experiment: str) -> str | None:
    """``mlartifacts/<experiment>`` beside a sqlite database; None lets a server decide."""
    parsed = urlparse(tracking_uri)
    if parsed.scheme != "sqlite":
        return None
    db_path = Path(tracking_uri.removeprefix("sqlite:///")).resolve()  # 4 slashes: absolute
    return (db_path.parent / "mlartifacts" / experiment).as_uri()


def _prepare_sqlite(tracking_uri: str) -> None:
    if tracking_uri.startswith("sqlite:///"):
        Path(tracking_uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)


def _chunks(items: Sequence[T], size: int) -> list[Sequence[T]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


class RunTracker:
    """Log one rollflow run to MLflow. Build with ``RunTracker.open(run_dir)``."""

    def __init__(
        self, folder: RunFolder, client: MlflowClient, ref: TrackingRef, last_steps: Mapping[str, int] | None = None
    ) -> None:
        self.folder = folder
        self.ref = ref
        self._client = client
        self._last_steps = dict(last_steps or {})  # metric key -> last step logged

    @classmethod
    def open(
        cls,
        run_dir: Path | str | RunFolder,
        *,
        experiment: str = "rollflow",
        tracking_uri: str | None = None,
    ) -> RunTracker:
        """Continue the run folder's MLflow run, or create one and record it there."""
        folder = run_dir if isinstance(run_dir, RunFolder) else RunFolder(run_dir)
        stored = read_ref(folder)
        if stored is not None:
            if tracking_uri is not None and tracking_uri != stored.tracking_uri:
                raise StorageError(
                    f"{folder.root / TRACKING_FILE}: this run is tracked at "
                    f"{stored.tracking_uri}, not {tracking_uri}; resume with the same "
                    "tracking URI (or delete the file to start a new MLflow run)"
                )
            return cls._resume(folder, stored)
        uri = tracking_uri or default_tracking_uri()
        _prepare_sqlite(uri)
        client = MlflowClient(tracking_uri=uri)
        found = client.get_experiment_by_name(experiment)
        experiment_id = (
            found.experiment_id
            if found is not None
            else client.create_experiment(experiment, artifact_location=artifact_location(uri, experiment))
        )
        run = client.create_run(
            experiment_id,
            run_name=folder.run_id,
            tags={"rollflow.run_dir": str(folder.root.resolve())},
        )
        ref = TrackingRef(uri, experiment_id, run.info.run_id)
        folder.write_json_atomic(TRACKING_FILE, asdict(ref))
        return cls(folder, client, ref)

    @classmethod
    def _resume(cls, folder: RunFolder, ref: TrackingRef) -> RunTracker:
        _prepare_sqlite(ref.tracking_uri)
        client = MlflowClient(tracking_uri=ref.tracking_uri)
        try:
            run = client.get_run(ref.mlflow_run_id)
        except MlflowException as exc:
            raise StorageError(
                f"{folder.root / TRACKING_FILE}: MLflow run {ref.mlflow_run_id} is not in "
                f"{ref.tracking_uri} ({exc.message})"
            ) from exc
        client.update_run(ref.mlflow_run_id, status="RUNNING")
        return cls(folder, client, ref, _last_steps(run))

    @property
    def mlflow_run_id(self) -> str:
        return self.ref.mlflow_run_id

    def log_params(self, params: Mapping[str, object]) -> None:
        """Log a flat dict once; re-logging the same values is a no-op, a change an error."""
        existing = self._client.get_run(self.mlflow_run_id).data.params
        new: list[Param] = []
        for key, raw in params.items():
            value = str(raw)
            if len(value) > MAX_PARAM_LENGTH:
                raise ValueError(f"param {key!r} is {len(value)} characters; MLflow keeps {MAX_PARAM_LENGTH}")
            if key in existing and existing[key] != value:
                raise StorageError(
                    f"param {key!r} was logged as {existing[key]!r} for this run; "
                    f"refusing to change it to {value!r}"
                )
            if key not in existing:
                new.append(Param(key, value))
        for chunk in _chunks(new, _PARAMS_PER_BATCH):
            self._client.log_batch(self.mlflow_run_id, params=chunk, synchronous=True)

    def _already_logged(self, key: str, step: int) -> bool:
        return step <= self._last_steps.get(key, -1)

    def log_step(self, step: int, metrics: Mapping[str, float]) -> int:
        """Log one step's metrics; returns how many points were new (0 on a replay)."""
        timestamp = int(time.time() * 1000)
        points = [
            Metric(key, float(value), timestamp, step)
            for key, value in metrics.items()
            if math.isfinite(float(value)) and not self._already_logged(key, step)
        ]
        for chunk in _chunks(points, _METRICS_PER_BATCH):
            self._client.log_batch(self.mlflow_run_id, metrics=chunk, synchronous=True)
        for point in points:
            self._last_steps[point.key] = step
        return len(points)

    def metric_history(self, key: str) -> list[tuple[int, float]]:
        history = self._client.get_metric_history(self.mlflow_run_id, key)
        return sorted((m.step, m.value) for m in history)

    def log_artifact(self, path: Path | str, artifact_path: str | None = None) -> None:
        if not Path(path).exists():
            raise StorageError(f"{path}: no such file to log as an artifact")
        self._client.log_artifact(self.mlflow_run_id, str(path), artifact_path)

    def log_reward_curve(self, png_path: Path | str, key: str = "reward/mean") -> Path:
        """Plot ``key`` against step into ``png_path`` and log it under ``plots/``."""
        points = self.metric_history(key)
        if not points:
            raise NoDataError(f"nothing is logged under {key!r} yet; no curve to draw")
        figure = Figure(figsize=(6, 3.5))
        FigureCanvasAgg(figure)
        axes = figure.subplots()
        axes.plot([s for s, _ in points], [v for _, v in points], marker="o")
        axes.set_xlabel("step")
        axes.set_ylabel(key)
        axes.set_title(f"{self.folder.run_id}: {key}")
        axes.grid(alpha=0.3)
        path = Path(png_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, dpi=100, bbox_inches="tight")
        self.log_artifact(path, "plots")
        return path

    def close(self, status: str = "FINISHED") -> None:
        self._client.set_terminated(self.mlflow_run_id, status=status)

    def __enter__(self) -> RunTracker:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close("FAILED" if exc_type is not None else "FINISHED")


def _last_steps(run: Run) -> dict[str, int]:
    """Each metric key's last logged step: the step of MLflow's latest point of that key."""
    return {metric.key: int(metric.step) for metric in run.data.to_proto().metrics}


def read_ref(folder: RunFolder) -> TrackingRef | None:
    if not (folder.root / TRACKING_FILE).exists():
        return None
    data = folder.read_json(TRACKING_FILE)
    try:
        return TrackingRef(**{k: str(data[k]) for k in ("tracking_uri", "experiment_id", "mlflow_run_id")})
    except (KeyError, TypeError) as exc:
        raise StorageError(f"{folder.root / TRACKING_FILE}: not a tracking record ({exc})") from exc
