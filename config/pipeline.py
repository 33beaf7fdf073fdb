"""The ``[pipeline]`` section: what ``rollflow pipeline`` runs, and the gate's rule.

The gate itself is a stage (``tasks/gate.py``); its settings are read here, and the warning
about a negative margin is written once, here, for this section and for ``GateSettings``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from rollflow.config.parsing import ConfigError, at_least, check_types, in_range


@dataclass(frozen=True)
class PipelineConfig:
    """``rollflow pipeline``: [sft] warm start (optional) -> GRPO -> gate -> model registry.

    The gate (``rollflow.tasks.gate``) promotes the trained policy to the registered
    model's ``champion`` alias only when its validation gain over the champion (or, with
    none yet, over the policy GRPO started from), paired by task, passes an exact
    one-sided sign-flip test at ``gate_alpha`` (the rate at which an equal policy is
    promoted), on at least ``gate_min_discordant`` changed tasks, with a mean change
    above ``gate_min_gain``.
    """

    sft: bool = False  # warm-start with [sft] on [env]'s transcripts before GRPO
    model_name: str = "rollflow-policy"  # the MLflow registered model
    start_from_champion: bool = False  # GRPO starts from the champion when there is one
    gate_column: str = "passed"  # compared per task: passed (pass rate) or final_reward
    gate_alpha: float = 0.05  # the largest one-sided p that promotes
    gate_min_discordant: int = 5  # the fewest tasks whose value must have changed
    gate_min_gain: float = 0.0  # the mean change must exceed this; < 0 is warned about

    def __post_init__(self) -> None:
        check_types(self, "pipeline")
        if self.gate_column not in ("passed", "final_reward"):
            raise ConfigError(
                f"[pipeline].gate_column must be 'passed' or 'final_reward', got {self.gate_column!r}"
            )
        in_range(self, "pipeline", "gate_alpha", 0.0, 1.0, low_open=True)
        at_least(self, "pipeline", "gate_min_discordant", 0)
        if self.gate_min_gain < 0:
            warnings.warn(negative_margin_warning(self.gate_min_gain), UserWarning, stacklevel=3)
        if not self.model_name.strip():
            raise ConfigError("[pipeline].model_name must not be empty")


def negative_margin_warning(min_gain: float, where: str = "[pipeline].gate_min_gain") -> str:
    """What a negative gate margin means, warned by this section and by ``tasks/gate.py``'s
    ``GateSettings`` (the rule it changes)."""
    return (f"{where} = {min_gain:g} < 0 makes the gate a non-inferiority test: with gate_alpha >= 0.5 it "
            f"promotes a policy up to {-min_gain:g} worse than the champion (below 0.5 the significance "
            "test already asks for a gain, and the margin does nothing)")
