"""The run's MLflow lifecycle, from its config: open, log each step, close.

``start_tracking`` opens (or, on resume, continues) the run's MLflow run and logs its
params and frozen config; the metrics stages log each step's numbers (``log_step``) and a
validation pass's episodes as traces (``log_traces``); ``finish_tracking`` draws the
reward curves into the run folder (``REWARD_CURVE``), logs them and closes the run. Each
is a no-op when ``[tracking]`` is off. MLflow itself is driven by
``rollflow.storage.tracking.RunTracker`` (imported on first use, so a run without
tracking never loads MLflow).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from rollflow.config.run import RunConfig, flatten_config
from rollflow.storage.errors import NoDataError
from rollflow.storage.runfolder import RunFolder

REWARD_CURVE = "reward_curve.png"


def start_tracking(config: RunConfig, run_dir: Path) -> str | None:
    """Open (or continue) the run's MLflow run and log its params and frozen config."""
    if not config.tracking.enabled:
        return None
    from rollflow.storage.tracking import RunTracker

    folder = RunFolder(run_dir)
    tracker = RunTracker.open(folder, experiment=config.tracking.experiment, tracking_uri=config.tracking.tracking_uri)
    tracker.log_params(flatten_config(config))
    tracker.log_artifact(folder.config_path)
    return tracker.mlflow_run_id


def finish_tracking(config: RunConfig, run_dir: Path, succeeded: bool) -> Path | None:
    """Draw the reward curves into the run folder, log them, and close the MLflow run."""
    if not config.tracking.enabled:
        return None
    from rollflow.storage.tracking import RunTracker

    folder = RunFolder(run_dir)
    tracker = RunTracker.open(folder, experiment=config.tracking.experiment, tracking_uri=config.tracking.tracking_uri)
    curve: Path | None = None
    for key, name in (("reward/mean", REWARD_CURVE), ("val/reward/mean", "val_" + REWARD_CURVE)):
        try:
            drawn = tracker.log_reward_curve(folder.root / name, key=key)
        except NoDataError:
            continue
        curve = curve or drawn
    tracker.close("FINISHED" if succeeded else "FAILED")
    return curve


def log_step(
    config: RunConfig, folder: RunFolder, step: int, metrics: Mapping[str, float], artifacts: Sequence[Path] = ()
) -> None:
    """Log the step's ``metrics`` (and ``artifacts`` under the validation pass's folder) to its MLflow run."""
    if not config.tracking.enabled:
        return
    from rollflow.storage.tracking import RunTracker

    tracker = RunTracker.open(folder, experiment=config.tracking.experiment, tracking_uri=config.tracking.tracking_uri)
    tracker.log_step(step, metrics)
    for artifact in artifacts:
        tracker.log_artifact(artifact, f"validation/step={step:06d}")


def log_traces(config: RunConfig, folder: RunFolder, step: int) -> None:
    """The pass's best, worst and a sample of episodes as MLflow traces of the run."""
    if not config.tracking.enabled:
        return
    from rollflow.storage.schemas import table_to_episode_records, table_to_score_records
    from rollflow.storage.traces import TraceSelection, log_validation_traces
    from rollflow.storage.tracking import RunTracker

    tracker = RunTracker.open(folder, experiment=config.tracking.experiment, tracking_uri=config.tracking.tracking_uri)
    episodes = table_to_episode_records(folder.read_stage(step, "episodes", "validation"))
    scores = table_to_score_records(folder.read_stage(step, "scores", "validation"))
    ref = tracker.ref
    log_validation_traces(ref.tracking_uri, ref.experiment_id, ref.mlflow_run_id, folder.step_dir(step, "validation"),
                          episodes, scores, TraceSelection(seed=config.train.seed))
