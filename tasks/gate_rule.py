"""The gate's rule and its statistics, as functions of per-task values (the rule in words
is the gate stage's docstring, ``tasks/gate.py``).

``episodes_by_task`` and ``per_task`` read validation passes' ``scores.parquet`` files into
one value per task; ``paired_change`` is the mean per-task change, its SE and a two-sided
sign-flip p; ``gain_p_value`` is the gate's exact one-sided test; ``judge_gain`` applies
``GateSettings`` to per-task differences. The gate stage decides with them, the lines a
finished run ends with (``ops/run_summary.py``) compare its first and last validation
with them, ``ops/gate_simulation.py`` measures the rule's error rates and
``scripts/compare_policies.py`` compares two policies.
"""

from __future__ import annotations

import math
import random
import statistics
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from rollflow.config.pipeline import negative_margin_warning

MAX_DENOMINATOR = 1000  # the finest lattice tried for the exact distribution
MAX_LATTICE = 1 << 20  # the most lattice points the exact distribution may span
RANDOM_FLIPS = 20000  # sign flips drawn when the differences are on no such lattice


class GateError(ValueError):
    """The two sides cannot be compared; the message names the files or tasks."""


@dataclass(frozen=True)
class Change:
    mean: float
    se: float  # paired by task; reported, not used by the rule
    p_value: float  # two-sided sign-flip p; nan when not computed
    gained: int  # tasks whose value rose
    lost: int
    tasks: int


@dataclass(frozen=True)
class GateSettings:
    column: str = "passed"  # a scores column: passed (pass rate) or final_reward
    alpha: float = 0.05  # the largest one-sided p that promotes: the false-promotion rate
    min_discordant: int = 5  # the fewest tasks that must have changed
    min_gain: float = 0.0  # the mean change must exceed this

    def __post_init__(self) -> None:
        if self.column not in ("passed", "final_reward", "reward"):
            raise GateError(f"[pipeline].gate_column must be passed, final_reward or reward, got {self.column!r}")
        if not (math.isfinite(self.alpha) and 0 < self.alpha <= 1):
            raise GateError(f"[pipeline].gate_alpha must be in (0, 1], got {self.alpha!r}")
        if isinstance(self.min_discordant, bool) or not isinstance(self.min_discordant, int) or self.min_discordant < 0:
            raise GateError(f"[pipeline].gate_min_discordant must be an integer >= 0, got {self.min_discordant!r}")
        if not math.isfinite(self.min_gain):
            raise GateError(f"[pipeline].gate_min_gain must be a finite number, got {self.min_gain!r}")
        if self.min_gain < 0:
            warnings.warn(negative_margin_warning(self.min_gain), UserWarning, stacklevel=3)


def episodes_by_task(scores: Sequence[Path], columns: Sequence[str] = ("passed", "final_reward")) -> dict[str, list[dict]]:
    """Every validation episode's score row in these ``scores.parquet`` files, grouped by task."""
    by_task: dict[str, list[dict]] = {}
    for path in scores:
        if not Path(path).is_file():
            raise GateError(f"{path}: no such scores file")
        missing = sorted({"task_id", "split", *columns} - set(pq.read_schema(path).names))
        if missing:
            raise GateError(f"{path}: not a scores file, it has no column {', '.join(missing)}")
        for row in pq.read_table(path, columns=["task_id", "split", *columns]).to_pylist():
            row["source"] = str(path)
            if row["split"] == "validation":
                by_task.setdefault(row["task_id"], []).append(row)
    return by_task


def per_task(by_task: dict[str, list[dict]], column: str) -> dict[str, float]:
    return {task: statistics.fmean(float(row[column]) for row in rows) for task, rows in by_task.items()}


def paired_diffs(before: dict[str, float], after: dict[str, float]) -> list[float]:
    """``after - before`` per task, in task order; both sides must hold the same tasks."""
    if set(before) != set(after):
        only = sorted(set(before) ^ set(after))
        raise GateError(f"the two sides validated different tasks (e.g. {only[:3]}); compare passes of one task set")
    if len(before) < 2:
        raise GateError("need at least two tasks to estimate an error")
    return [after[task] - before[task] for task in sorted(before)]


def describe_change(diffs_n: Sequence[float], p_value: float) -> Change:
    mean = statistics.fmean(diffs_n)
    se = statistics.stdev(diffs_n) / math.sqrt(len(diffs_n))
    return Change(mean, se, p_value, sum(d > 0 for d in diffs_n), sum(d < 0 for d in diffs_n), len(diffs_n))


def paired_change(before: dict[str, float], after: dict[str, float], draws: int = 20000, seed: int = 0) -> Change:
    """The mean per-task change from ``before`` to ``after``, its SE and a two-sided permutation p.

    Under "no change", each task's difference is as likely to have either sign, so the
    p-value is the share of random sign flips whose mean is at least as far from zero
    (``draws=0``: not computed, nan). The gate's own test is ``gain_p_value``.
    """
    diffs = paired_diffs(before, after)
    mean = statistics.fmean(diffs)
    rng = random.Random(seed)
    extreme = sum(
        abs(sum(d if rng.random() < 0.5 else -d for d in diffs)) / len(diffs) >= abs(mean) - 1e-12
        for _ in range(draws)
    )
    return describe_change(diffs, (extreme + 1) / (draws + 1) if draws else math.nan)


def gain_p_value(diffs_n: Sequence[float], seed: int = 0) -> float:
    """One-sided sign-flip p: P(sum of s_i |d_i| >= sum of d_i) over random signs s_i = +-1.

    Exact when the |d_i| are multiples of a common 1/L (L <= MAX_DENOMINATOR) spanning at
    most MAX_LATTICE points; else RANDOM_FLIPS seeded draws, ``(1 + hits) / (1 + draws)``.
    """
    magnitudes = [abs(d) for d in diffs_n if d != 0]
    if not magnitudes:
        return 1.0
    observed = math.fsum(diffs_n)
    lattice = _lattice(magnitudes)
    if lattice is None:
        return _random_flips_p(np.asarray(magnitudes), observed, seed)
    steps = Counter(round(m * lattice) for m in magnitudes)
    null = np.ones(1)  # null[k]: P(sum of s_i |d_i| = (k - total) / lattice)
    for step, count in steps.items():  # `count` tasks of this step add step * (2j - count), j ~ Binom(count, 1/2)
        kernel = np.zeros(2 * step * count + 1)
        kernel[:: 2 * step] = [math.comb(count, j) / 2**count for j in range(count + 1)]
        null = np.convolve(null, kernel)
    total = sum(step * count for step, count in steps.items())
    first = total + round(observed * lattice)
    return float(min(1.0, null[first:].sum()))


def _lattice(magnitudes: Sequence[float]) -> int | None:
    """The smallest L with every magnitude * L an integer (to 1e-9), if it spans few points."""
    lattice = 1
    for value in set(magnitudes):
        fraction = Fraction(value).limit_denominator(MAX_DENOMINATOR)
        if abs(float(fraction) - value) > 1e-9:
            return None
        lattice = math.lcm(lattice, fraction.denominator)
        if lattice > MAX_DENOMINATOR:
            return None
    if round(sum(magnitudes) * lattice) > MAX_LATTICE:
        return None
    return lattice


def _random_flips_p(magnitudes_n: np.ndarray, observed: float, seed: int) -> float:
    signs_dn = np.random.default_rng(seed).choice([-1.0, 1.0], size=(RANDOM_FLIPS, len(magnitudes_n)))
    hits = int(np.count_nonzero(signs_dn @ magnitudes_n >= observed - 1e-12))
    return (1 + hits) / (1 + RANDOM_FLIPS)


def judge_gain(diffs_n: Sequence[float], settings: GateSettings) -> tuple[Change, float, bool]:
    """The change, its one-sided p and whether the gate promotes on these per-task differences."""
    p_value = gain_p_value(diffs_n)
    change = describe_change(diffs_n, math.nan)
    promote = (p_value <= settings.alpha and change.gained + change.lost >= settings.min_discordant
               and change.mean > settings.min_gain)
    return change, p_value, promote
