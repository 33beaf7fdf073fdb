"""Metrics stage: one dict of slash-namespaced numbers per step, logged once to MLflow.

The episode and reward numbers are the DuckDB queries of ``storage/query.py`` over the
step's Parquet files (one definition each, shared with ``rollflow sql`` users); the
optimisation numbers come from the step's ``train.json``; stage wall times from the flow.
The dict is written to ``metrics.json`` in the step folder last of all, after MLflow has
it: that file existing is what marks a step finished. A replay after a crash logs no
duplicate point (``RunTracker.log_step`` skips steps already logged).

Validation passes get the same episode and reward numbers under ``val/``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

from storage.query import open_run_sql, step_metrics
from storage.records import TrainResult
from storage.runfolder import RunFolder
from tasks.config import RunConfig, flatten_config

METRICS_JSON = "metrics.json"
REWARD_CURVE = "reward_curve.png"

# query name -> logged key
_EPISODE_KEYS = {
    "terminated_ratio": "episodes/terminated_ratio",
    "truncated_ratio": "episodes/truncated_ratio",
    "context_overflow_ratio": "episodes/context_overflow_ratio",
    "max_turns_ratio": "episodes/max_turns_ratio",
    "env_truncated_ratio": "episodes/env_truncated_ratio",
    "parse_failure_ratio": "episodes/parse_failure_ratio",
    "error_ratio": "episodes/error_ratio",
    "turns_mean": "episodes/turns_mean",
    "tokens_mean": "episodes/tokens_mean",
    "num_episodes": "episodes/count",
    "num_groups": "episodes/groups",
    "reward_mean": "reward/mean",
    "reward_std": "reward/std",
    "reward_min": "reward/min",
    "reward_max": "reward/max",
    "pass_rate": "reward/pass_rate",
    "zero_variance_skip_ratio": "reward/zero_variance_skip_ratio",
}


def rollout_metrics(run_dir: Path, step: int, split: str) -> dict[str, float]:
    """The step's episode and reward metrics, under their logged names."""
    con = open_run_sql([run_dir])
    try:
        raw = step_metrics(con, step=step, split=split)
    finally:
        con.close()
    return {_EPISODE_KEYS[name]: value for name, value in raw.items()}


def optim_metrics(result: TrainResult) -> dict[str, float]:
    metrics = {
        "optim/loss": result.loss,
        "optim/clip_fraction": result.clip_fraction,
        "optim/grad_norm": result.grad_norm,
        "optim/learning_rate": result.learning_rate,
        "optim/samples": float(result.num_samples),
        "optim/tokens": float(result.num_tokens),
        "optim/action_tokens": float(result.num_action_tokens),
        "optim/tokens_per_s": result.tokens_per_s,
        "policy/version": float(result.policy_version),
    }
    if result.kl is not None:
        metrics["optim/kl"] = result.kl
    metrics.update({f"time/train_{phase}": seconds for phase, seconds in result.timings.items()})
    return metrics


def metrics_stage(
    config: RunConfig, run_dir: Path, step: int, stage_seconds: Mapping[str, float] | None = None
) -> Path:
    """Gather, log and write the step's metrics; returns the ``metrics.json`` path."""
    folder = RunFolder(run_dir)
    path = folder.step_dir(step) / METRICS_JSON
    if path.exists():
        return path
    metrics = rollout_metrics(run_dir, step, "train")
    metrics.update(optim_metrics(folder.read_train_result(step)))
    metrics.update({f"time/{stage}": seconds for stage, seconds in (stage_seconds or {}).items()})
    _log(config, folder, step, metrics)
    return folder.write_json_atomic(path, _json_safe(metrics))


def validation_metrics_stage(config: RunConfig, run_dir: Path, step: int) -> Path:
    folder = RunFolder(run_dir)
    path = folder.step_dir(step, "validation") / METRICS_JSON
    if path.exists():
        return path
    metrics = {f"val/{key}": value for key, value in rollout_metrics(run_dir, step, "validation").items()}
    _log(config, folder, step, metrics)
    return folder.write_json_atomic(path, _json_safe(metrics))


def start_tracking(config: RunConfig, run_dir: Path) -> str | None:
    """Open (or continue) the run's MLflow run and log its params and frozen config."""
    if not config.tracking.enabled:
        return None
    from storage.tracking import RunTracker

    folder = RunFolder(run_dir)
    tracker = RunTracker.open(folder, experiment=config.tracking.experiment, tracking_uri=config.tracking.tracking_uri)
    tracker.log_params(flatten_config(config))
    tracker.log_artifact(folder.config_path)
    return tracker.mlflow_run_id


def finish_tracking(config: RunConfig, run_dir: Path, succeeded: bool) -> Path | None:
    """Draw the reward curves into the run folder, log them, and close the MLflow run."""
    if not config.tracking.enabled:
        return None
    from storage.errors import NoDataError
    from storage.tracking import RunTracker

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


def _log(config: RunConfig, folder: RunFolder, step: int, metrics: Mapping[str, float]) -> None:
    if not config.tracking.enabled:
        return
    from storage.tracking import RunTracker

    tracker = RunTracker.open(folder, experiment=config.tracking.experiment, tracking_uri=config.tracking.tracking_uri)
    tracker.log_step(step, metrics)


def _json_safe(metrics: Mapping[str, float]) -> dict[str, float | None]:
    return {key: (value if math.isfinite(value) else None) for key, value in sorted(metrics.items())}
