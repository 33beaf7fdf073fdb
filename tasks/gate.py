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
   such nights, at any task count (``ops/gate_simulation.py`` measures it);
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
``alpha`` of the time. The statistics and the rule are functions of per-task values in
``tasks/gate_rule.py``; this module is the stage: the two sides read, checked and decided.

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
import statistics
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from rollflow.tasks.gate_rule import Change, GateError, GateSettings, episodes_by_task, judge_gain, paired_diffs, per_task

GATE_FILE = "gate.json"
ERROR_COLUMN = "scoring_error"


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
