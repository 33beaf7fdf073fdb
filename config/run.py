"""One TOML file -> typed, frozen, validated config objects (one per section).

A run is configured by one TOML file with the sections ``[model]``, ``[env]``,
``[rollout]``, ``[train]``, ``[validation]``, ``[storage]``, ``[tracking]``, ``[sft]``
(read only by ``rollflow sft``), ``[pipeline]`` (only by ``rollflow pipeline``) and
``[cluster]``; each becomes a frozen dataclass and ``RunConfig`` holds them all. Every
section validates itself in ``__post_init__``, so an object built from Python is checked
exactly like one parsed from TOML. Bad input raises ``ConfigError`` naming
``[section].key``, the allowed values or type, and the nearest known key when the name
looks like a typo.

The reference docs' field names keep their meaning (``batch_size``, ``episodes_per_task``
alias ``group_size``, ``max_model_length`` alias ``max_context_tokens``, ...). The flat
``GRPOConfig`` of the reference API lives in ``config/grpo.py``.

This file holds ``RunConfig``, the small sections, and the reading and writing of the
file. The large sections have a file each: ``config/rollout.py``, ``config/train.py``,
``config/pipeline.py`` and ``config/cluster.py``. The machinery under them is
``config/parsing.py`` (keys, aliases, retired settings, type checks, ``ConfigError``) and
``config/toml_writer.py`` (the writer); the rules that span sections are
``config/checks.py``'s ``check_run_config``. Import each name from the file that defines it.

Simplified on purpose: no environment-variable interpolation, no config inheritance or
includes, and relative paths are taken relative to the working directory (as a shell
user expects), not to the config file, so the frozen copy in the run folder means the same.
"""
from __future__ import annotations

import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rollflow.config.cluster import ClusterConfig
from rollflow.config.parsing import (
    ConfigError,
    at_least,
    check_types,
    flatten_into,
    in_range,
    parse_sections,
    read_document,
    section_dict,
)
from rollflow.config.pipeline import PipelineConfig
from rollflow.config.rollout import RolloutConfig
from rollflow.config.toml_writer import toml_document
from rollflow.envs.mixture_handle import MIXTURE_SPEC, MixtureMember, default_label, parse_members
from rollflow.config.train import TrainConfig
from rollflow.policy.loss import OffPolicyCorrection

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Compression = Literal["zstd", "snappy", "gzip", "lz4", "brotli", "none"]


# ---------------------------------------------------------------- sections


@dataclass(frozen=True)
class ModelConfig:
    path: str | None = None  # an HF folder or a .gguf file; None = the bundled SmolLM2
    gguf_file: str | None = None  # the GGUF file name inside ``path`` (bundled: its Q4_1 file)
    adapter: str | None = None  # a peft adapter folder to start from
    # float32 is safe on any CPU. bfloat16 is faster where the CPU has bfloat16 units (AMX)
    # and emulated, far slower, elsewhere (bench/dtype_bench.py measures both costs); peft
    # keeps LoRA weights in float32 under it. "auto" picks bfloat16 where the device runs it
    # natively (a CPU with oneDNN's bfloat16 path, a CUDA device that supports it), else
    # float32, in each process that loads the model. float16 is for GPUs.
    dtype: Dtype = "float32"
    # Where this process's models run (the trainer, the transformers sampler, a local
    # teacher): "auto" is the first CUDA device when PyTorch sees one, else the CPU;
    # "cpu", "cuda" or "cuda:N" choose. vLLM servers place themselves.
    device: str = "auto"

    def __post_init__(self) -> None:
        check_types(self, "model")
        if re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is None:
            raise ConfigError(f"[model].device must be 'auto', 'cpu', 'cuda' or 'cuda:N'; got {self.device!r}")


DEFAULT_ENV = "rollflow.envs.tool_use_game:load_environment"  # the bundled game


@dataclass(frozen=True)
class EnvConfig:
    name: str = DEFAULT_ENV
    kwargs: dict[str, Any] = field(default_factory=dict)
    # [[env.mixture]] tables instead of name/kwargs: several environments in one run
    # (envs/mixture.py). Read as name = MIXTURE_SPEC with kwargs.members, the form the run
    # folder's config.toml keeps, so every stage loads a mixture as one environment.
    mixture: list[dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        if self.mixture is not None:
            if self.name != DEFAULT_ENV or self.kwargs:
                raise ConfigError(
                    "[env] holds either name/kwargs (one environment) or [[env.mixture]] tables "
                    "(several), not both: move the environment into a [[env.mixture]] table"
                )
            object.__setattr__(self, "name", MIXTURE_SPEC)
            object.__setattr__(self, "kwargs", {"members": self.mixture})
            object.__setattr__(self, "mixture", None)
        check_types(self, "env")
        module, sep, function = self.name.partition(":")
        if not (sep and module and function.isidentifier()):
            raise ConfigError(
                f"[env].name must be 'module:function' "
                f"(e.g. 'rollflow.envs.tool_use_game:load_environment'), got {self.name!r}"
            )
        object.__setattr__(self, "kwargs", dict(self.kwargs))
        if self.name == MIXTURE_SPEC:
            self._check_mixture()

    def _check_mixture(self) -> None:
        """The members, checked before anything loads; kept in the form ``load_environment`` reads."""
        where = "[env].kwargs.members" if "members" in self.kwargs and len(self.kwargs) == 1 else "[[env.mixture]]"
        extra = sorted(set(self.kwargs) - {"members"})
        if extra:
            raise ConfigError(f"[env].kwargs of a mixture holds only 'members'; got also {', '.join(extra)}")
        try:
            members = parse_members(self.kwargs.get("members"), where)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        object.__setattr__(self, "kwargs", {"members": [m.as_table() for m in members]})

    @property
    def members(self) -> list[MixtureMember]:
        """The environments of the run: a mixture's members, else the one (weight 1)."""
        if self.name == MIXTURE_SPEC:
            return parse_members(self.kwargs["members"])
        return [MixtureMember(self.name, dict(self.kwargs), 1.0, default_label(self.name))]


@dataclass(frozen=True)
class ValidationConfig:
    validation_interval: int = 5  # steps between validations; 0 = never
    val_max_turns: int | None = None  # None reuses [rollout].max_turns (reference), same rules
    sequential_validation: bool = False  # reference default
    num_tasks: int | None = None  # None = every validation task
    # Episodes played per validation task. 1 measures the policy once per task; more make
    # the pass rate a finer, less noisy measure (sampling alone moves a 50-task pass rate
    # by about +-0.09 at 1 episode a task) for proportionally more rollout time.
    episodes_per_task: int = 1

    def __post_init__(self) -> None:
        check_types(self, "validation")
        at_least(self, "validation", "validation_interval", 0)
        at_least(self, "validation", "val_max_turns", 1)
        at_least(self, "validation", "num_tasks", 1)
        at_least(self, "validation", "episodes_per_task", 1)


@dataclass(frozen=True)
class StorageConfig:
    runs_dir: str = "runs"
    compression: Compression = "zstd"  # smaller files than snappy for a little more write time

    def __post_init__(self) -> None:
        check_types(self, "storage")


@dataclass(frozen=True)
class TrackingConfig:
    enabled: bool = True
    tracking_uri: str | None = None  # None = the project-local store; or a server URL
    experiment: str = "rollflow"

    def __post_init__(self) -> None:
        check_types(self, "tracking")


@dataclass(frozen=True)
class SFTConfig:
    """``rollflow sft``: supervised warm-start; LoRA, seed and micro-batch come from [train]."""

    epochs: int = 3  # passes over the rows
    learning_rate: float = 1e-4  # LoRA SFT; full weights want about 1e-5
    batch_size: int = 8  # rows per optimizer step
    max_rows: int | None = None  # None = every row of the source
    # a .jsonl / .parquet file of message lists; None = [env]'s start_episode + sft_completion
    transcripts: str | None = None
    # true: train the target's assistant messages only, its tool and user messages context (as
    # GRPO trains); false: every target token; unset: the source's own (every token for [env]
    # and file rows, as the reference's completion-only loss; the assistant's only for an
    # agent's expert transcripts)
    assistant_only: bool | None = None

    def __post_init__(self) -> None:
        check_types(self, "sft")
        for key in ("epochs", "batch_size", "max_rows"):
            at_least(self, "sft", key, 1)
        in_range(self, "sft", "learning_rate", 0.0, None, low_open=True)


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    @property
    def groups_in_flight(self) -> int:
        return self.rollout.groups_in_flight or self.rollout.batch_size

    @property
    def off_policy_correction(self) -> OffPolicyCorrection:
        """[train].off_policy_correction, else "tis" for async runs and for a bfloat16 trainer
        (whose logprobs are not the float32 sampler's), "none" otherwise."""
        if self.train.off_policy_correction is not None:
            return self.train.off_policy_correction
        stale = self.rollout.max_steps_off_policy is not None
        return "tis" if stale or self.train.compute_dtype != "float32" else "none"

    @property
    def val_max_turns(self) -> int | None:
        """Validation's turn cap: [validation].val_max_turns, else [rollout].max_turns (or None)."""
        return self.validation.val_max_turns or self.rollout.max_turns


SECTIONS: dict[str, type] = dict(typing.get_type_hints(RunConfig))  # "train" -> TrainConfig


# ---------------------------------------------------------------- reading and writing


def load_config(path: str | Path, *, frozen: bool = False) -> RunConfig:
    """Read and validate a TOML config file.

    ``frozen``: the file is a run folder's own ``config.toml``, written by ``config_to_toml``
    of an earlier rollflow; settings since retired (``parsing.RETIRED``) are dropped
    from it, so an old run still resumes, exports and rescores. A user's config naming one
    is refused.
    """
    return parse_config(read_document(Path(path), frozen=frozen))


def parse_config(document: Mapping[str, Any]) -> RunConfig:
    """Validate a mapping shaped like the TOML file (``{"train": {...}, ...}``)."""
    return RunConfig(**parse_sections(document, SECTIONS))


def config_to_toml(config: RunConfig) -> str:
    """The config as TOML that ``parse_config`` reads back to an equal object."""
    return toml_document({name: section_dict(getattr(config, name)) for name in SECTIONS})


def flatten_config(config: RunConfig) -> dict[str, str]:
    """``{"train.learning_rate": "2e-05", ...}``: every value as text, for MLflow params."""
    flat: dict[str, str] = {}
    for name in SECTIONS:
        for key, value in section_dict(getattr(config, name)).items():
            flatten_into(flat, f"{name}.{key}", value)
    return flat
