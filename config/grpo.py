"""``GRPOConfig``: the reference docs' flat config, mapped onto our sectioned ``RunConfig``.

Users of the reference API write ``GRPOConfig(model=..., batch_size=4, episodes_per_task=8,
max_turns=6, ...)`` and pass it to ``train_multi_turn``; every field keeps the meaning it
has there and lands in one ``[section].key`` of ``RunConfig`` (see ``FIELD_HOMES``), so the
validation and its error messages are the TOML path's.

Simplified on purpose:
- ``model`` is a local path only (an HF folder, or a ``.gguf`` file); nothing is downloaded.
- ``wandb_project`` is accepted and ignored with a warning: rollflow tracks with MLflow.
- Defaults are ours (``RunConfig``'s), not the reference's, where the reference's would not
  train: ``episodes_per_task`` resolves to 4, not 1 (a group of one never trains). Like the
  reference, ``max_turns`` has no default and must be given.
- The environment is not named here: ``train_multi_turn`` takes an ``env_factory``.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollflow.config.parsing import ConfigError
from rollflow.config.rollout import RolloutConfig
from rollflow.config.run import RunConfig, TrackingConfig, StorageConfig, ValidationConfig, parse_config
from rollflow.config.train import TrainConfig
from rollflow.policy.loss import LossName, OffPolicyCorrection

# GRPOConfig field -> (section, key) in RunConfig.
FIELD_HOMES: dict[str, tuple[str, str]] = {
    "batch_size": ("rollout", "batch_size"),
    "episodes_per_task": ("rollout", "episodes_per_task"),
    "max_turns": ("rollout", "max_turns"),
    "max_model_length": ("rollout", "max_model_length"),
    "max_completion_tokens": ("rollout", "max_completion_tokens"),
    "temperature": ("rollout", "temperature"),
    "top_p": ("rollout", "top_p"),
    "max_sampling_attempts": ("rollout", "max_sampling_attempts"),
    "groups_in_flight": ("rollout", "groups_in_flight"),
    "max_steps_off_policy": ("rollout", "max_steps_off_policy"),
    "weight_sync_type": ("rollout", "weight_sync_type"),
    "num_steps": ("train", "num_steps"),
    "learning_rate": ("train", "learning_rate"),
    "lr_warmup_steps": ("train", "lr_warmup_steps"),
    "use_lora": ("train", "use_lora"),
    "lora_rank": ("train", "lora_rank"),
    "loss": ("train", "loss"),
    "clip_eps_low": ("train", "clip_eps_low"),
    "clip_eps_high": ("train", "clip_eps_high"),
    "kl_coef": ("train", "kl_coef"),
    "off_policy_correction": ("train", "off_policy_correction"),
    "off_policy_cap": ("train", "off_policy_cap"),
    "scale_advantages_by_std": ("train", "scale_advantages_by_std"),
    "dynamic_sampling": ("train", "dynamic_sampling"),
    "failed_parse_reward": ("train", "failed_parse_reward"),
    "overlong_masking": ("train", "overlong_masking"),
    "seed": ("train", "seed"),
    "validation_interval": ("validation", "validation_interval"),
    "val_max_turns": ("validation", "val_max_turns"),
    "sequential_validation": ("validation", "sequential_validation"),
    "runs_dir": ("storage", "runs_dir"),
    "experiment": ("tracking", "experiment"),
    "tracking_uri": ("tracking", "tracking_uri"),
}


@dataclass(frozen=True)
class GRPOConfig:
    model: str | None = None  # a local HF folder or .gguf file; None = the bundled SmolLM2
    batch_size: int = RolloutConfig.batch_size
    # None = the other name's value, else RolloutConfig's default (4): two Nones make
    # "both set to different values" detectable.
    episodes_per_task: int | None = None
    group_size: int | None = None  # the single-turn name of episodes_per_task
    num_steps: int = TrainConfig.num_steps
    validation_interval: int = ValidationConfig.validation_interval
    max_turns: int | None = None  # required, as in the reference
    max_model_length: int = RolloutConfig.max_model_length
    max_completion_tokens: int = RolloutConfig.max_completion_tokens
    temperature: float = RolloutConfig.temperature
    top_p: float = RolloutConfig.top_p
    learning_rate: float = TrainConfig.learning_rate
    lr_warmup_steps: int = TrainConfig.lr_warmup_steps
    sequential_validation: bool = ValidationConfig.sequential_validation
    max_sampling_attempts: int = RolloutConfig.max_sampling_attempts
    failed_parse_reward: float = TrainConfig.failed_parse_reward
    overlong_masking: bool = TrainConfig.overlong_masking
    val_max_turns: int | None = None
    max_steps_off_policy: int | None = None
    groups_in_flight: int | None = None
    # "synchronous" | "background_publish" | "pipeline"; the reference's spelling
    # ("WEIGHT_SYNC_TYPE_PIPELINE") is accepted too
    weight_sync_type: str = RolloutConfig.weight_sync_type
    use_lora: bool = TrainConfig.use_lora
    lora_rank: int = TrainConfig.lora_rank
    loss: LossName = TrainConfig.loss
    clip_eps_low: float = TrainConfig.clip_eps_low
    clip_eps_high: float = TrainConfig.clip_eps_high
    kl_coef: float = TrainConfig.kl_coef
    # "none" | "tis" | "mask"; None = "tis" for async runs, "none" in lockstep
    off_policy_correction: OffPolicyCorrection | None = None
    off_policy_cap: float = TrainConfig.off_policy_cap
    scale_advantages_by_std: bool = TrainConfig.scale_advantages_by_std
    dynamic_sampling: bool = TrainConfig.dynamic_sampling
    seed: int = TrainConfig.seed
    runs_dir: str = StorageConfig.runs_dir
    experiment: str = TrackingConfig.experiment
    tracking_uri: str | None = None
    wandb_project: str | None = None  # accepted and ignored: we track with MLflow

    def to_run_config(self) -> RunConfig:
        """The same settings as a validated ``RunConfig`` (raises ``ConfigError``)."""
        if self.max_turns is None:
            raise ConfigError(
                "GRPOConfig.max_turns is required (the assistant actions allowed per episode)"
            )
        both = self.group_size is not None and self.episodes_per_task is not None
        if both and self.group_size != self.episodes_per_task:
            raise ConfigError(
                f"GRPOConfig.group_size = {self.group_size} contradicts episodes_per_task "
                f"= {self.episodes_per_task}: they are the same setting; keep one"
            )
        if self.wandb_project is not None:
            warnings.warn(
                f"GRPOConfig.wandb_project={self.wandb_project!r} is ignored: rollflow tracks "
                "runs with MLflow (set experiment= or [tracking] instead)",
                UserWarning,
                stacklevel=2,
            )
        return parse_config(self._document())

    def _document(self) -> dict[str, dict[str, Any]]:
        document: dict[str, dict[str, Any]] = {"model": _model_table(self.model)}
        for name, (section, key) in FIELD_HOMES.items():
            value = getattr(self, name)
            if name == "weight_sync_type":
                value = str(value).lower().removeprefix("weight_sync_type_")
            if value is not None:
                document.setdefault(section, {})[key] = value
        if self.group_size is not None:
            document.setdefault("rollout", {})["episodes_per_task"] = self.group_size
        return document


def _model_table(model: str | None) -> dict[str, Any]:
    if model is None:
        return {}
    path = Path(model)
    if path.suffix == ".gguf":
        return {"path": str(path.parent), "gguf_file": path.name}
    return {"path": model}


def _check_field_homes() -> None:
    """Every field but the special ones has a home: caught at import, not in a run."""
    special = {"model", "group_size", "wandb_project"}
    names = {f.name for f in dataclasses.fields(GRPOConfig)} - special
    assert names == set(FIELD_HOMES), f"GRPOConfig fields without a home: {names ^ set(FIELD_HOMES)}"


_check_field_homes()
