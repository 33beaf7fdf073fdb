"""Gate stage: is a candidate policy better than the current one on the same validation tasks?

The nightly pipeline promotes a trained policy (moves the registry's ``champion`` alias to
it) only through this gate. Both sides are validation passes (``scores.parquet`` files)
over the same tasks, with the same number of episodes per task; several passes of one
side pool. Per task, each side's mean of the chosen column (``passed`` by default: the
pass rate) is taken, and ``d_i = candidate_i - baseline_i``.

The rule: promote when all three hold:

1. ``p <= alpha``, where ``p`` is the exact one-sided sign-flip p-value of ``sum(d_i)``:
   the share of the ``2^n`` sign assignments of the ``|d_i|`` whose sum is at least the
   observed one. With identical policies each task's two sides are exchangeable, so each
   ``d_i`` is as likely to have either sign and the test promotes at most ``alpha`` of
   such nights, at any task count (``gate_simulation`` measures it);
2. at least ``min_discordant`` tasks changed (``d_i != 0``). Unchanged tasks carry no
   evidence; ``k`` changed tasks can reach at best ``p = 2^-k``, so at ``alpha = 0.05``
   fewer than 5 never pass, and the floor keeps that when ``alpha`` is loosened;
3. the mean change exceeds ``min_gain``, a practical margin on the estimate (a negative
   one is warned about: with ``alpha >= 0.5`` it promotes a worse policy).

So two tasks up and none down (``p = 1/4``) never pass, nor does a gain whose standard
error is zero on a few tasks (SE is reported, never used by the rule). With the shipped
10 tasks x 1 episode the gate sees only large gains; docs/deployments.md has the power.

The exact distribution is built on the lattice the differences live on (pass rates of
``k`` episodes are multiples of ``1/k``); differences that are on no small lattice (a
continuous ``final_reward``) get 20,000 seeded random sign flips instead, with
``p = (1 + hits) / (1 + draws)``, which still promotes identical policies at most
``alpha`` of the time.

Simplified, and why: tasks are weighted equally whatever their episode count (they are
the unit the policies were paired on); a task seen on one side only, or with unequal
episode counts, is an error, never silently dropped or reweighted, since the exactness
of the test rests on the two sides being measured alike. Errored episodes (a non-null
``scoring_error``: the rollout's or the scorer's) are neither passes nor failures, so the
gate refuses to decide on passes that have any, naming how many on each side: dropping
them would unbalance the pairing and could hide a candidate that breaks the
environment; counting them as failures would reward the side that errored less.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from rollflow.config.pipeline import negative_margin_warning

GATE_FILE = "gate.json"
ERROR_COLUMN = "scoring_error"
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


@dataclass(frozen=True)
class GateDecision:
    promote: bool
    change: Change
    p_value: float  # one-sided exact sign-flip p of the gain: what the rule compares with alpha
    settings: GateSettings
    candidate: tuple[str, ...]  # the scores files of each side
    baseline: tuple[str, ...]
    candidate_mean: float  # each side's mean over tasks
    baseline_mean: float

    def summary(self) -> str:
        verdict = "promote" if self.promote else "keep the current policy"
        c, s = self.change, self.settings
        return (f"{s.column}: {self.baseline_mean:.3f} -> {self.candidate_mean:.3f}, change {c.mean:+.3f} "
                f"+- {c.se:.3f} over {c.tasks} tasks ({c.gained} up, {c.lost} down), one-sided p {self.p_value:.3g}; "
                f"rule p <= {s.alpha:g}, >= {s.min_discordant} tasks changed, change > {s.min_gain:g}: {verdict}")


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


def decide(candidate: Sequence[Path], baseline: Sequence[Path], settings: GateSettings) -> GateDecision:
    """Compare the candidate's validation passes with the baseline's under ``settings``."""
    if not candidate or not baseline:
        raise GateError("the gate needs at least one validation pass on each side")
    columns = (settings.column, ERROR_COLUMN)
    after_rows, before_rows = episodes_by_task(candidate, columns), episodes_by_task(baseline, columns)
    check_comparable(after_rows, before_rows, {"candidate": candidate, "baseline": baseline})
    after, before = per_task(after_rows, settings.column), per_task(before_rows, settings.column)
    change, p_value, promote = judge_gain(paired_diffs(before, after), settings)
    return GateDecision(
        promote=promote,
        change=change,
        p_value=p_value,
        settings=settings,
        candidate=tuple(str(p) for p in candidate),
        baseline=tuple(str(p) for p in baseline),
        candidate_mean=statistics.fmean(after.values()),
        baseline_mean=statistics.fmean(before.values()),
    )


def check_comparable(
    candidate: dict[str, list[dict]], baseline: dict[str, list[dict]], sources: dict[str, Sequence[Path]] | None = None
) -> None:
    """Refuse errored episodes (on either side) and tasks with unequal episode counts.

    A validation pass is sealed once written, so a retry (or a resume) reads the same
    errored episodes again: the error names the folders (of ``sources``, each side's
    files) to remove so that the side is measured anew."""
    errored = {side: [row for rows in by_task.values() for row in rows if row[ERROR_COLUMN] is not None]
               for side, by_task in (("candidate", candidate), ("baseline", baseline))}
    if any(errored.values()):
        counts = "; ".join(
            f"{side}: {len(rows)} of {sum(map(len, by_task.values()))} episodes"
            + (f" (e.g. {rows[0]['source']}, task {rows[0]['task_id']}: {rows[0][ERROR_COLUMN]!r})" if rows else "")
            for (side, rows), by_task in zip(errored.items(), (candidate, baseline), strict=True))
        redo = ""
        if sources is not None:
            folders = sorted({str(_pass_folder(Path(p))) for side, rows in errored.items() if rows for p in sources[side]})
            redo = (f"; a retry reads the same sealed pass, so remove {', '.join(folders)} first "
                    "(the run then measures that side again)")
        raise GateError(f"errored validation episodes ({ERROR_COLUMN} set) are neither passes nor failures, and the "
                        f"gate compares only whole passes: {counts}. Fix the cause and evaluate that side again{redo}")
    for task in sorted(set(candidate) & set(baseline)):
        if len(candidate[task]) != len(baseline[task]):
            raise GateError(f"task {task}: {len(candidate[task])} candidate episodes, {len(baseline[task])} baseline; "
                            "the exact test pairs sides measured alike (same episodes per task)")


def _pass_folder(path: Path) -> Path:
    """The folder of the validation pass a stage output belongs to (``.../step=N``)."""
    return path.parent.parent if path.parent.name in ("episodes", "scores") else path.parent


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
    if "p_value" not in data:
        raise GateError(f"{path} was decided by the retired z * SE rule; delete it to gate this night again")
    with warnings.catch_warnings():  # a negative margin was warned about when it was set
        warnings.simplefilter("ignore", UserWarning)
        settings = GateSettings(**data["settings"])
    return GateDecision(
        promote=bool(data["promote"]),
        change=Change(**data["change"]),
        p_value=float(data["p_value"]),
        settings=settings,
        candidate=tuple(data["candidate"]),
        baseline=tuple(data["baseline"]),
        candidate_mean=float(data["candidate_mean"]),
        baseline_mean=float(data["baseline_mean"]),
    )
