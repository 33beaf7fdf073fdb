"""The learning figure and table of docs/results.md, from the run folders' own files.

Reads ``validation/step=N/metrics.json`` (what the flows wrote and logged to MLflow as
``val/...``) of the GRPO run, of the baseline evaluation (the untouched model) and,
optionally, of `rollflow eval` passes over the run's checkpoints (``--checkpoint-eval``,
for a run stopped between its validations); plots validation pass rate and mean reward against the
GRPO step with the baseline as a dashed line; and prints a Markdown table. Step 0 of the
GRPO run is its validation before any update: the SFT policy. The table gives each later
pass rate's change from step 0 with a standard error paired by task (every pass plays the
same tasks), so a change can be told from sampling noise.

Nothing is recomputed or chosen here: every point is a validation pass that the pipeline
ran, in step order.

    .venv/bin/python scripts/learning_figure.py --run runs/learn/grpo \
        --baseline runs/learn/baseline --out docs/learn_tool_use_game.png
"""

from __future__ import annotations

import argparse
import json
import tomllib
from dataclasses import dataclass
from pathlib import Path

import matplotlib
from compare_policies import episodes_by_task, paired_change, per_task  # scripts/, beside this one

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PASS, REWARD = "val/reward/pass_rate", "val/reward/mean"


@dataclass(frozen=True)
class ValidationPoint:
    step: int  # GRPO updates behind the policy
    pass_rate: float
    reward_mean: float
    episodes: int
    scores: Path  # the pass's scores.parquet


def validation_points(run_dir: Path) -> list[ValidationPoint]:
    """Every finished validation pass of a run folder, in step order."""
    paths = sorted((run_dir / "validation").glob("step=*/metrics.json"))
    if not paths:
        raise SystemExit(f"{run_dir}: no validation/step=*/metrics.json (has the run validated yet?)")
    points = []
    for path in paths:
        metrics = json.loads(path.read_text())
        step = int(path.parent.name.removeprefix("step="))
        points.append(ValidationPoint(step, metrics[PASS], metrics[REWARD], int(metrics["val/episodes/count"]),
                                      path.parent / "scores.parquet"))
    return points


def checkpoint_eval(spec: str) -> ValidationPoint:
    """``STEPS:FOLDER``: a `rollflow eval` of the checkpoint after STEPS updates, as a point."""
    steps, _, folder = spec.partition(":")
    if not steps.isdigit() or not folder:
        raise SystemExit(f"--checkpoint-eval {spec!r}: expected STEPS:FOLDER, e.g. 16:runs/learn/grpo-after-16-steps")
    point = validation_points(Path(folder))[0]
    return ValidationPoint(int(steps), point.pass_rate, point.reward_mean, point.episodes, point.scores)


def train_batches(run_dir: Path) -> list[tuple[int, float, float]]:
    """(step, pass rate, mean reward) of every finished step's training batch."""
    rows = []
    for path in sorted((run_dir / "steps").glob("step=*/metrics.json")):
        metrics = json.loads(path.read_text())
        step = int(path.parent.name.removeprefix("step="))
        rows.append((step, metrics["reward/pass_rate"], metrics["reward/mean"]))
    return rows


def tasks_per_step(run_dir: Path) -> int:
    """``[rollout].batch_size`` of the run's frozen config (the tasks a training batch holds)."""
    frozen = tomllib.loads((run_dir / "config.toml").read_text())
    return int(frozen.get("rollout", {}).get("batch_size", 0))


def moving_mean(values: list[float], width: int) -> list[float]:
    """Mean of each value and the up to ``width - 1`` before it."""
    windows = [values[max(0, i - width + 1) : i + 1] for i in range(len(values))]
    return [sum(window) / len(window) for window in windows]


def draw(run: list[ValidationPoint], baseline: ValidationPoint, train: list[tuple[int, float, float]],
         out: Path, batch_tasks: int) -> None:
    fig, (ax_pass, ax_reward) = plt.subplots(1, 2, figsize=(10, 3.8), constrained_layout=True)
    steps = [p.step for p in run]
    ax_pass.plot(steps, [p.pass_rate for p in run], "o-", label="validation (step 0 = after SFT)")
    if train:
        train_steps, train_pass = [s for s, _, _ in train], [p for _, p, _ in train]
        ax_pass.plot(train_steps, train_pass, ".", alpha=0.5,
                     label=f"training batch ({batch_tasks} new tasks a step)")
        ax_pass.plot(train_steps, moving_mean(train_pass, 5), "-", alpha=0.7, color="C1",
                     label="training batch, mean of the last 5 steps")
    ax_pass.axhline(baseline.pass_rate, color="grey", linestyle="--", label="untouched model")
    ax_pass.set(xlabel="GRPO step", ylabel="pass rate", title="validation pass rate", ylim=(-0.02, 1.02))
    ax_reward.plot(steps, [p.reward_mean for p in run], "o-", label="validation")
    if train:
        train_reward = [r for _, _, r in train]
        ax_reward.plot(train_steps, train_reward, ".", alpha=0.5, label="training batch")
        ax_reward.plot(train_steps, moving_mean(train_reward, 5), "-", alpha=0.7, color="C1",
                       label="training batch, mean of the last 5 steps")
    ax_reward.axhline(baseline.reward_mean, color="grey", linestyle="--", label="untouched model")
    ax_reward.set(xlabel="GRPO step", ylabel="mean reward", title="mean reward (max 1.0)")
    for ax in (ax_pass, ax_reward):
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def pass_rate_by_task(scores: Path) -> dict[str, float]:
    """Each validation task's share of passed episodes in a pass's ``scores.parquet``."""
    return per_task(episodes_by_task([scores]), "passed")


def table(run: list[ValidationPoint], baseline: ValidationPoint) -> str:
    lines = ["| policy | validation pass rate | change vs step 0 (+- SE, paired by task) | mean reward | episodes |",
             "|---|---|---|---|---|"]
    lines.append(f"| untouched SmolLM2-135M | {baseline.pass_rate:.3f} | | {baseline.reward_mean:.3f} "
                 f"| {baseline.episodes} |")
    for p in run:
        name = "after SFT (GRPO step 0)" if p.step == 0 else f"GRPO after {p.step} steps"
        change = ""
        if p.step != 0:
            paired = paired_change(pass_rate_by_task(run[0].scores), pass_rate_by_task(p.scores), draws=0)
            change = f"{paired.mean:+.3f} +- {paired.se:.3f}"
        lines.append(f"| {name} | {p.pass_rate:.3f} | {change} | {p.reward_mean:.3f} | {p.episodes} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, required=True, help="the GRPO run folder")
    parser.add_argument("--baseline", type=Path, required=True, help="the untouched model's eval folder")
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    parser.add_argument("--checkpoint-eval", action="append", default=[], metavar="STEPS:FOLDER",
                        help="a `rollflow eval` of the run's checkpoint after STEPS updates (a run "
                             "stopped between its validations); repeatable")
    args = parser.parse_args()
    run = validation_points(args.run) + [checkpoint_eval(spec) for spec in args.checkpoint_eval]
    run.sort(key=lambda p: p.step)
    baseline = validation_points(args.baseline)[0]
    draw(run, baseline, train_batches(args.run), args.out, tasks_per_step(args.run))
    print(table(run, baseline))
    print(f"\nfigure: {args.out}")


if __name__ == "__main__":
    main()
