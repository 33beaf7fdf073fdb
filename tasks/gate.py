"""Gate stage: does a candidate policy beat the current one on the same validation tasks?

The nightly pipeline promotes a trained policy (moves the registry's ``champion`` alias to
it) only through this gate. Both sides are validation passes (``scores.parquet`` files)
over the same tasks; several passes of one side pool. Per task, each side's mean of the
chosen column (``passed`` by default: the pass rate) is taken, and the change is the mean
over tasks of (candidate - baseline) with its standard error paired by task, plus a
sign-flip permutation p-value (the chance of a change at least this large if the two
policies were the same).

The rule: promote when ``change - z * se > min_gain``. The defaults (``z = 1``,
``min_gain = 0``) ask for a gain at least one standard error above zero: a policy that
is merely as good as the champion, within noise, does not replace it, and a real gain of
a few points on 50 tasks x 2 episodes (SE about 0.04-0.05) gets through. Raise ``z`` to
2 for a stricter gate (about 98% one-sided), or ``min_gain`` for a practical margin.

Simplified, and why: tasks are weighted equally whatever their episode count (they are
the unit the policies were paired on); a task seen on one side only is an error, never
silently dropped, since the two passes then measured different things.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import pyarrow.parquet as pq

GATE_FILE = "gate.json"


class GateError(ValueError):
    """The two sides cannot be compared; the message names the files or tasks."""


@dataclass(frozen=True)
class Change:
    mean: float
    se: float
    p_value: float  # two-sided, sign-flip permutation; nan when not drawn
    gained: int  # tasks whose value rose
    lost: int
    tasks: int


@dataclass(frozen=True)
class GateSettings:
    column: str = "passed"  # a scores column: passed (pass rate) or final_reward
    z: float = 1.0  # standard errors the gain must clear
    min_gain: float = 0.0  # ... above this

    def __post_init__(self) -> None:
        if self.column not in ("passed", "final_reward", "reward"):
            raise GateError(f"[gate].column must be passed, final_reward or reward, got {self.column!r}")
        if not (math.isfinite(self.z) and self.z >= 0):
            raise GateError(f"[gate].z must be a finite number >= 0, got {self.z!r}")
        if not math.isfinite(self.min_gain):
            raise GateError(f"[gate].min_gain must be a finite number, got {self.min_gain!r}")


@dataclass(frozen=True)
class GateDecision:
    promote: bool
    change: Change
    settings: GateSettings
    candidate: tuple[str, ...]  # the scores files of each side
    baseline: tuple[str, ...]
    candidate_mean: float  # each side's mean over tasks
    baseline_mean: float

    def summary(self) -> str:
        verdict = "promote" if self.promote else "keep the current policy"
        c, s = self.change, self.settings
        return (f"{s.column}: {self.baseline_mean:.3f} -> {self.candidate_mean:.3f}, change {c.mean:+.3f} "
                f"+- {c.se:.3f} over {c.tasks} tasks (p {c.p_value:.3g}); rule change - {s.z:g} SE > "
                f"{s.min_gain:g}: {verdict}")


def episodes_by_task(scores: Sequence[Path], columns: Sequence[str] = ("passed", "final_reward")) -> dict[str, list[dict]]:
    """Every validation episode's score row in these ``scores.parquet`` files, grouped by task."""
    by_task: dict[str, list[dict]] = {}
    for path in scores:
        if not Path(path).is_file():
            raise GateError(f"{path}: no such scores file")
        table = pq.read_table(path, columns=["task_id", "split", *columns])
        for row in table.to_pylist():
            if row["split"] == "validation":
                by_task.setdefault(row["task_id"], []).append(row)
    return by_task


def per_task(by_task: dict[str, list[dict]], column: str) -> dict[str, float]:
    return {task: statistics.fmean(float(row[column]) for row in rows) for task, rows in by_task.items()}


def paired_change(before: dict[str, float], after: dict[str, float], draws: int = 20000, seed: int = 0) -> Change:
    """The mean per-task change from ``before`` to ``after``, its SE and a permutation p-value.

    Under "no change", each task's difference is as likely to have either sign, so the
    p-value is the share of random sign flips whose mean is at least as far from zero
    (``draws=0``: not computed, nan).
    """
    if set(before) != set(after):
        only = sorted(set(before) ^ set(after))
        raise GateError(f"the two sides validated different tasks (e.g. {only[:3]}); compare passes of one task set")
    diffs = [after[task] - before[task] for task in sorted(before)]
    if len(diffs) < 2:
        raise GateError("need at least two tasks to estimate an error")
    mean = statistics.fmean(diffs)
    se = statistics.stdev(diffs) / math.sqrt(len(diffs))
    rng = random.Random(seed)
    extreme = sum(
        abs(sum(d if rng.random() < 0.5 else -d for d in diffs)) / len(diffs) >= abs(mean) - 1e-12
        for _ in range(draws)
    )
    p_value = (extreme + 1) / (draws + 1) if draws else math.nan
    return Change(mean, se, p_value, sum(d > 0 for d in diffs), sum(d < 0 for d in diffs), len(diffs))


def decide(candidate: Sequence[Path], baseline: Sequence[Path], settings: GateSettings) -> GateDecision:
    """Compare the candidate's validation passes with the baseline's under ``settings``."""
    if not candidate or not baseline:
        raise GateError("the gate needs at least one validation pass on each side")
    after = per_task(episodes_by_task(candidate, (settings.column,)), settings.column)
    before = per_task(episodes_by_task(baseline, (settings.column,)), settings.column)
    change = paired_change(before, after)
    return GateDecision(
        promote=change.mean - settings.z * change.se > settings.min_gain,
        change=change,
        settings=settings,
        candidate=tuple(str(p) for p in candidate),
        baseline=tuple(str(p) for p in baseline),
        candidate_mean=statistics.fmean(after.values()),
        baseline_mean=statistics.fmean(before.values()),
    )


def gate_stage(candidate: Sequence[Path], baseline: Sequence[Path], settings: GateSettings, out_dir: Path) -> Path:
    """Decide and write ``out_dir/gate.json`` atomically; a finished decision is returned as is."""
    out = Path(out_dir) / GATE_FILE
    if out.is_file():
        return out
    decision = decide(candidate, baseline, settings)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial")
    partial.write_text(json.dumps(asdict(decision), indent=2, allow_nan=True))
    partial.replace(out)
    return out


def read_decision(path: Path) -> GateDecision:
    data = json.loads(Path(path).read_text())
    return GateDecision(
        promote=bool(data["promote"]),
        change=Change(**data["change"]),
        settings=GateSettings(**data["settings"]),
        candidate=tuple(data["candidate"]),
        baseline=tuple(data["baseline"]),
        candidate_mean=float(data["candidate_mean"]),
        baseline_mean=float(data["baseline_mean"]),
    )
