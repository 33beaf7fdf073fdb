"""The gate's false-promotion rate and power, measured on simulated nights.

A simulated night: every validation task gets a pass probability ``p_i`` drawn from a
shape (``uniform``: U(0, 1); ``bimodal``: 0.1 or 0.9, half each; ``flat``: 0.3 for all),
the baseline plays ``episodes`` Bernoulli(``p_i``) episodes per task and the candidate
``episodes`` Bernoulli(``min(1, p_i + gain)``) ones. The real gate rule
(``rollflow.tasks.gate_rule.judge_gain``) then decides on the per-task pass rates. ``gain = 0``
is two identical policies: the share promoted is the false-promotion rate.

Simplified, and why: the gain is additive on every task, capped at 1 (so the true mean
gain is a little less than ``gain`` where ``p_i`` is near 1); tasks and episodes are
independent. Real policies differ unevenly across tasks, which a sign-flip test sees as
fewer tasks changed: read the power as an upper bound.

    .venv/bin/python -m rollflow.ops.gate_simulation   # the table in docs/deployments.md
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from rollflow.tasks.gate_rule import GateSettings, judge_gain

SHAPES: dict[str, Callable[[np.random.Generator, int, int], np.ndarray]] = {
    "uniform": lambda rng, nights, tasks: rng.uniform(0.0, 1.0, (nights, tasks)),
    "bimodal": lambda rng, nights, tasks: rng.choice([0.1, 0.9], (nights, tasks)),
    "flat": lambda rng, nights, tasks: np.full((nights, tasks), 0.3),
}
GAINS = (0.0, 0.1, 0.2, 0.3, 0.5)
SIZES = ((10, 1), (10, 4), (50, 1), (50, 4))  # (tasks, episodes per task); 10 x 1 is configs/pipeline.toml


def promotion_rate(tasks: int, episodes: int, shape: str, gain: float, nights: int, seed: int,
                   settings: GateSettings) -> float:
    """The share of ``nights`` simulated nights on which the gate promotes the candidate."""
    rng = np.random.default_rng(seed)
    p_baseline_NT = SHAPES[shape](rng, nights, tasks)
    p_candidate_NT = np.minimum(1.0, p_baseline_NT + gain)
    baseline_NT = rng.binomial(episodes, p_baseline_NT) / episodes  # per-task pass rates
    candidate_NT = rng.binomial(episodes, p_candidate_NT) / episodes
    diffs_NT = candidate_NT - baseline_NT
    promoted = sum(judge_gain(night_T.tolist(), settings)[2] for night_T in diffs_NT)
    return promoted / nights


def power_table(nights: int = 20000, seed: int = 0, settings: GateSettings | None = None) -> str:
    """Markdown: the promoted share per validation size and gain (``uniform`` shape)."""
    settings = settings or GateSettings()
    lines = ["| validation | gain | promoted |", "|---|---|---|"]
    for tasks, episodes in SIZES:
        for gain in GAINS:
            rate = promotion_rate(tasks, episodes, "uniform", gain, nights, seed, settings)
            noun = "episode" if episodes == 1 else "episodes"
            lines.append(f"| {tasks} tasks x {episodes} {noun} | +{gain:.1f} | {100 * rate:.1f}% |")
    return "\n".join(lines)


def false_promotion_table(nights: int = 20000, seed: int = 0, settings: GateSettings | None = None) -> str:
    """Markdown: the share of identical-policy nights promoted, per size and shape."""
    settings = settings or GateSettings()
    error = 3 * math.sqrt(settings.alpha * (1 - settings.alpha) / nights)
    lines = [f"| validation | {' | '.join(sorted(SHAPES))} |", "|---|" + "---|" * len(SHAPES)]
    for tasks, episodes in SIZES:
        rates = [promotion_rate(tasks, episodes, shape, 0.0, nights, seed, settings) for shape in sorted(SHAPES)]
        lines.append(f"| {tasks} x {episodes} | " + " | ".join(f"{100 * r:.2f}%" for r in rates) + " |")
    lines.append(f"\n(alpha {settings.alpha:g}; 3 binomial SE over {nights} nights: {100 * error:.2f} points)")
    return "\n".join(lines)


if __name__ == "__main__":
    print("Identical policies, share of nights promoted:\n")
    print(false_promotion_table())
    print("\nA candidate better by `gain` on every task (p_i ~ U(0, 1)), share of nights promoted:\n")
    print(power_table())
