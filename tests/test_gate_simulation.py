"""The gate's error rates, measured on simulated nights (rollflow.ops.gate_simulation).

Each simulated night draws every validation task's pass probability from a shape, then
both sides' episodes from it (the candidate's raised by a gain), and runs the real gate
rule on the per-task pass rates. Identical policies must be promoted at most ``alpha``
(plus three binomial standard errors); the power table in docs/deployments.md must be
what the simulation measures, within the two measurements' binomial error.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from rollflow.config.run import load_config
from rollflow.ops.gate_simulation import SHAPES, promotion_rate
from rollflow.tasks.gate_rule import GateSettings

REPO = Path(__file__).resolve().parent.parent
NIGHTS = 2000


def shipped_size() -> tuple[int, int]:
    config = load_config(REPO / "configs" / "pipeline.toml")
    return config.validation.num_tasks, config.validation.episodes_per_task


def three_sigma(rate: float, *nights: int) -> float:
    return 3 * math.sqrt(rate * (1 - rate) * sum(1 / n for n in nights))


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("size", ["shipped", (50, 4)])
def test_identical_policies_are_promoted_at_most_alpha(shape: str, size: object) -> None:
    tasks, episodes = shipped_size() if size == "shipped" else size  # type: ignore[misc]
    settings = GateSettings()
    rate = promotion_rate(tasks, episodes, shape, gain=0.0, nights=NIGHTS, seed=1, settings=settings)
    assert rate <= settings.alpha + three_sigma(settings.alpha, NIGHTS), (tasks, episodes, shape, rate)


def documented_power() -> list[tuple[int, int, float, float]]:
    """(tasks, episodes, gain, promoted share) from docs/deployments.md's power table."""
    text = (REPO / "docs" / "deployments.md").read_text()
    rows = re.findall(r"^\| (\d+) tasks x (\d+) episodes? \| \+?([0-9.]+) \| ([0-9.]+)% \|", text, re.MULTILINE)
    return [(int(t), int(e), float(g), float(r) / 100) for t, e, g, r in rows]


def test_the_documented_power_is_what_the_simulation_measures() -> None:
    rows = documented_power()
    tasks, episodes = shipped_size()
    checked = [row for row in rows if row[:2] in ((tasks, episodes), (50, 4))]
    assert len(checked) >= 8, "the docs' power table lost its rows"
    for tasks, episodes, gain, documented in checked:
        rate = promotion_rate(tasks, episodes, "uniform", gain=gain, nights=NIGHTS, seed=2, settings=GateSettings())
        # the docs' figures come from 20,000 nights with another seed
        assert abs(rate - documented) <= three_sigma(max(documented, 0.01), NIGHTS, 20000) + 1e-9, (tasks, gain, rate)
    shipped = [r for t, e, _, r in checked if (t, e) == shipped_size()]
    assert shipped == sorted(shipped) and shipped[-1] > 4 * GateSettings().alpha  # power grows with the gain
    assert [r for t, e, g, r in checked if (t, e, g) == (50, 4, 0.1)][0] > 0.5  # a bigger pass sees +0.1
