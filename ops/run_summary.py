"""What a finished training run learned, in the lines ``rollflow train`` ends with.

The first and the last validation pass of the run, compared paired by task (each task's
pass rate after minus before; the same statistics as the pipeline's gate,
``tasks/gate.py``), with a two-sided sign-flip p that says whether the change clears the
noise of the validation itself; then where to see the whole curve.

A run that does not finish gets its one line too, in the folder for ``rollflow runs``
(``record_run_end``): stopped by which signal, or failed with which error.
"""

from __future__ import annotations

import shlex
import signal
import statistics
from collections.abc import Sequence
from pathlib import Path

from rollflow.config.run import RunConfig
from rollflow.policy.stopping import StopRequested, raise_if_stop_requested, stop_exit_code
from rollflow.storage.runfolder import RunFolder
from rollflow.storage.runs import RunEnd, write_run_end
from rollflow.tasks.gate_rule import GateError, episodes_by_task, paired_change, per_task
from rollflow.tasks.tracking import REWARD_CURVE

REASON_CHARS = 200  # of an error's first line, in the run's exit record
NOISE_P = 0.05  # a two-sided p below this: the change is beyond the validation's own noise
CURVE_SQL = ("SELECT step, avg(passed::INT) AS pass_rate, count(*) AS episodes FROM scores "
             "WHERE split = 'validation' GROUP BY step ORDER BY step")


def validation_change(folder: RunFolder, labels: Sequence[str] = ()) -> list[str]:
    """The first and last scored validation passes' pass rates and their paired change, one
    line; with a mixture's ``labels``, a line more for each member (its tasks, ids
    ``<label>/...``). Nothing when the run has fewer than two passes, or they validated
    different tasks."""
    scored = [(step, path) for step in folder.steps("validation")
              if (path := folder.stage_output(step, "scores", "validation")) is not None]
    if len(scored) < 2:
        return []
    (first, first_scores), (last, last_scores) = scored[0], scored[-1]
    before, after = (per_task(episodes_by_task([path], ("passed",)), "passed") for path in (first_scores, last_scores))
    lines = []
    for label in ("", *labels):
        own_before = {t: v for t, v in before.items() if t.startswith(f"{label}/")} if label else before
        own_after = {t: v for t, v in after.items() if t.startswith(f"{label}/")} if label else after
        try:
            change = paired_change(own_before, own_after)
        except GateError:  # different task sets, or a single task: no paired error to give
            continue
        verdict = "beyond" if change.p_value < NOISE_P else "within"
        lines.append(
            f"{'  ' + label + ': ' if label else ''}validation pass rate {statistics.fmean(own_before.values()):.3f} "
            f"at step {first} -> {statistics.fmean(own_after.values()):.3f} at step {last}: {change.mean:+.3f} +- "
            f"{change.se:.3f} paired over {change.tasks} tasks ({change.gained} up, {change.lost} down), two-sided p "
            f"{change.p_value:.2g}, {verdict} the validation's noise"
        )
    return lines


def learning_summary(config: RunConfig, folder: RunFolder) -> list[str]:
    """The lines a finished run ends with: what validation says it learned, where the curve is."""
    members = config.env.members
    lines = validation_change(folder, [m.label for m in members] if len(members) > 1 else ())
    lines.append(f"the curve: rollflow sql {shlex.quote(str(folder.root))} \"{CURVE_SQL}\"")
    drawn = [folder.root / name for name in (REWARD_CURVE, "val_" + REWARD_CURVE) if (folder.root / name).is_file()]
    if drawn:
        lines.append("  drawn: " + ", ".join(map(str, drawn)))
    if config.tracking.enabled:
        from rollflow.storage.tracking import read_ref

        ref = read_ref(folder)  # where this run's MLflow run really is
        if ref is not None:
            lines.append(
                f"  in MLflow (experiment {config.tracking.experiment!r}, run {ref.mlflow_run_id}): "
                f"mlflow ui --backend-store-uri {shlex.quote(ref.tracking_uri)}"
            )
    return lines


def record_run_end(root: Path, error: BaseException) -> None:
    """Write why the run in ``root`` ended with ``error`` (``storage.runs.RunEnd``): a stop
    where a signal asked for one (whatever error the stop caused on its way out), else a
    failure with the error's first line. Never raises: the run's own error goes on."""
    try:
        raise_if_stop_requested()
    except StopRequested:
        error = KeyboardInterrupt() if stop_exit_code() == 128 + signal.SIGINT else StopRequested()
    if isinstance(error, KeyboardInterrupt | StopRequested):
        how = "Ctrl-C (SIGINT)" if isinstance(error, KeyboardInterrupt) else "SIGTERM"
        end = RunEnd("stopped", f"stopped by {how}; `rollflow resume` continues it")
    else:
        first = (str(error).strip().splitlines() or [""])[0]
        reason = f"{type(error).__name__}: {first}" if first else type(error).__name__
        end = RunEnd("failed", reason[:REASON_CHARS])
    try:
        write_run_end(root, end)
    except OSError:
        pass  # a full disk must not hide why the run ended
