"""Compare two policies on the same validation tasks, paired by task, pooling passes.

A validation pass of 50 tasks x 2 episodes measures a pass rate to about +-0.05, too
coarse for the few points a short GRPO run adds. More episodes per task narrow it, and
they need not come from one pass: the GRPO run's own validation of a policy and a
`rollflow eval` of the same policy under another seed are independent samples of it, so
their episodes pool. This script pools any number of passes for each side (``--before``,
``--after``), takes each task's pass rate and mean reward on each side, and prints the
change with its standard error paired by task and a sign-flip permutation p-value (the
chance of a change at least this large if the two policies were the same).

A pass is a folder with a ``scores.parquet``: a run's ``validation/step=N`` or an eval
run folder (its one ``validation/step=000000``). Two passes of one side must sample
differently: a pass's sampling seeds derive from the run's ``[train].seed`` and the step,
so two passes with the same seed and step of one policy are the same episodes, and
pooling them would halve the error bar without measuring anything. That is refused.

    .venv/bin/python scripts/compare_policies.py \
        --before runs/learn/grpo/validation/step=000000 runs/learn/eval-sft-seed1 \
        --after runs/learn/grpo/validation/step=000030 runs/learn/eval-grpo30-seed1
"""

from __future__ import annotations

import argparse
import math
import statistics
import tomllib
from dataclasses import dataclass
from pathlib import Path

from rollflow.tasks.gate_rule import Change, GateError, episodes_by_task, paired_change, per_task

__all__ = ["Change", "episodes_by_task", "paired_change", "per_task"]  # the maths live in the gate stage


@dataclass(frozen=True)
class Pass:
    folder: Path  # holds scores.parquet
    seed: int  # the run's [train].seed
    step: int  # the validation step (0 for an eval)


def find_pass(path: Path) -> Pass:
    """A validation pass from a ``validation/step=N`` folder or an eval run folder."""
    if not (path / "scores.parquet").is_file():
        steps = sorted((path / "validation").glob("step=*/scores.parquet"))
        if len(steps) != 1:
            raise SystemExit(f"{path}: expected a validation/step=N folder, or a run folder with exactly one "
                             f"validation pass; found {len(steps)}")
        path = steps[0].parent
    if not path.name.startswith("step="):
        raise SystemExit(f"{path}: a validation pass folder is named step=N")
    config = path.parent.parent / "config.toml"
    if not config.is_file():
        raise SystemExit(f"{path}: no {config} beside it (which seed did this pass sample with?)")
    seed = int(tomllib.loads(config.read_text()).get("train", {}).get("seed", 0))
    return Pass(path, seed, int(path.name.removeprefix("step=")))


def check_independent(side: str, passes: list[Pass]) -> None:
    seen: dict[tuple[int, int], Path] = {}
    for p in passes:
        key = (p.seed, p.step)
        if key in seen:
            raise SystemExit(f"--{side}: {p.folder} and {seen[key]} both sampled with seed {p.seed} at step "
                             f"{p.step}, so they hold the same episodes; evaluate again with another "
                             f"[train].seed to pool")
        seen[key] = p.folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, nargs="+", required=True, help="passes of the first policy")
    parser.add_argument("--after", type=Path, nargs="+", required=True, help="passes of the second policy")
    args = parser.parse_args()
    sides = {"before": [find_pass(p) for p in args.before], "after": [find_pass(p) for p in args.after]}
    for side, passes in sides.items():
        check_independent(side, passes)
    episodes = {side: episodes_by_task([p.folder / "scores.parquet" for p in passes]) for side, passes in sides.items()}
    print("| policy | passes | tasks | episodes | pass rate | mean reward |")
    print("|---|---|---|---|---|---|")
    for side, by_task in episodes.items():
        rows = [row for task_rows in by_task.values() for row in task_rows]
        print(f"| {side} | {len(sides[side])} | {len(by_task)} | {len(rows)} "
              f"| {statistics.fmean(r['passed'] for r in rows):.3f} "
              f"| {statistics.fmean(r['final_reward'] for r in rows):.3f} |")
    print()
    for label, field in (("pass rate", "passed"), ("mean reward", "final_reward")):
        try:
            change = paired_change(per_task(episodes["before"], field), per_task(episodes["after"], field))
        except GateError as exc:
            raise SystemExit(str(exc)) from None
        ratio = change.mean / change.se if change.se else math.inf
        p_value = f"= {change.p_value:.4f}" if change.p_value >= 0.001 else "< 0.001"  # 20000 draws
        print(f"{label}: {change.mean:+.3f} +- {change.se:.3f} (paired by task; {ratio:.1f} SE), "
              f"permutation p {p_value}; tasks up {change.gained}, down {change.lost}")


if __name__ == "__main__":
    main()
