"""One TOML file -> typed, frozen, validated config objects (one per section).

A run is configured by one TOML file with the sections ``[model]``, ``[env]``,
``[rollout]``, ``[train]``, ``[validation]``, ``[storage]``, ``[tracking]``, ``[sft]``
(read only by ``rollflow sft``) and ``[pipeline]`` (only by ``rollflow pipeline``); each
becomes a frozen dataclass and ``RunConfig`` holds them all. Every section validates itself
in ``__post_init__``, so an object built from Python is checked exactly like one parsed
from TOML. Bad input raises ``ConfigError`` naming ``[section].key``, the allowed values or
type, and the nearest known key when the name looks like a typo.

The reference docs' field names keep their meaning (``batch_size``, ``episodes_per_task``
alias ``group_size``, ``max_model_length`` alias ``max_context_tokens``, ...). The flat
``GRPOConfig`` of the reference API lives in ``config/grpo.py``.

This file is the list of settings. The machinery under it is ``config/parsing.py``
(keys, aliases, retired settings, type checks) and ``config/toml_writer.py`` (the writer);
the rules that span sections are ``config/checks.py``'s ``check_run_config``.
Every name of all three imports from here.

Simplified on purpose: no environment-variable interpolation, no config inheritance or
includes, and relative paths are taken relative to the working directory (as a shell
user expects), not to the config file, so the frozen copy in the run folder means the same.
"""

from __future__ import annotations

import re
import typing
import warnings
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
from rollflow.config.toml_writer import toml_document
from rollflow.policy.loss import LossName, OffPolicyCorrection

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Backend = Literal["transformers", "vllm", "openai"]
Objective = Literal["grpo", "opd"]  # tasks/objectives.py's OBJECTIVES
WeightSyncType = Literal["synchronous", "background_publish", "pipeline"]  # tasks/collect.py
LoraServing = Literal["merged", "adapter"]  # generators/generator.py
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


@dataclass(frozen=True)
class EnvConfig:
    name: str = "rollflow.envs.tool_use_game:load_environment"  # the bundled game
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_types(self, "env")
        module, sep, function = self.name.partition(":")
        if not (sep and module and function.isidentifier()):
            raise ConfigError(
                f"[env].name must be 'module:function' "
                f"(e.g. 'rollflow.envs.tool_use_game:load_environment'), got {self.name!r}"
            )
        object.__setattr__(self, "kwargs", dict(self.kwargs))


@dataclass(frozen=True)
class RolloutConfig:
    batch_size: int = 4  # tasks per step
    # 1 never trains (no group to compare against): 4 gives a usable baseline on CPU.
    episodes_per_task: int = 4
    # A cap on the assistant actions of an episode. None (the default): a hook-style
    # environment plays its own max_episode_turns, as in the reference; set, it caps that
    # budget (never raises it). An async-style environment has no budget of its own, so
    # there it is required, as in the reference.
    max_turns: int | None = None
    max_model_length: int = 2048  # context budget of a whole episode, in tokens
    max_completion_tokens: int = 256  # per assistant action, not per episode
    temperature: float = 1.0  # GRPO samples the policy as it is: the ratio assumes it
    top_p: float = 1.0
    max_sampling_attempts: int = 2  # a timed-out generation is retried once
    generation_timeout_s: float = 600.0
    concurrency: int = 8  # episodes played at once
    # "transformers": in-process; "vllm": vLLM servers, managed or external (policy/vllm_backend.py);
    # "openai": a chat-completions server, for evaluation only (it never receives new weights)
    backend: Backend = "transformers"
    base_url: str | None = None  # the OpenAI-compatible server (backend "openai")
    api_model: str | None = None  # the model name that server expects (vllm: its served name)
    base_urls: tuple[str, ...] = ()  # backend "vllm": external servers; empty = rollflow starts one
    vllm_python: str | None = None  # the Python that has vLLM; None = .venv-vllm ($ROLLFLOW_VLLM_PYTHON wins)
    vllm_kvcache_space_gib: int = 2  # a managed server's KV cache (its RSS is ~3 GB more)
    vllm_startup_timeout_s: float = 600.0  # a managed server must be healthy within this
    # Managed vLLM servers of the run (backend "vllm", no base_urls), each its own process with
    # its share of the generator's cores; episodes are dealt across them, every version is
    # published to all, a dead one is restarted alone (generators/vllm_generator.py)
    num_generator_replicas: int = 1
    groups_in_flight: int | None = None  # None resolves to batch_size (reference)
    max_steps_off_policy: int | None = None  # None = lockstep (reference); see tasks/collect.py
    # How a new version reaches the generator: "synchronous" inline; "background_publish"
    # on a thread (the trainer goes on); "pipeline" too, and episodes in flight continue
    # under the new weights (weights swapped in place: full weights or LoRA merged). The
    # deferred two need max_steps_off_policy.
    weight_sync_type: WeightSyncType = "synchronous"
    # Async: never start a group that would be stale when the trainer can take it (off:
    # groups start freely and stale ones are only dropped, the reference's behaviour)
    admission_control: bool = True
    # How a LoRA version reaches a managed vLLM server: "merged" into the base and reloaded
    # in place (the base model's speed), or "adapter" (vLLM's LoRA kernels: many adapters on
    # one server, large models); the user's base_urls always get adapters. generators/generator.py
    lora_serving: LoraServing = "merged"
    # Async with a managed vLLM server on the CPU: the server's threads bound to the first half
    # of the cores, the trainer's threads as many as the other half, so that the two do not
    # oversubscribe them (generators/cpu_split.py); false: both use every core
    split_cpus: bool = True
    # Dynamic sampling that refills the batch (DAPO's): after the step's batch_size tasks,
    # up to this many more rounds draw fresh tasks while fewer than batch_size groups have
    # reward variance (tasks/rollout.py); 0: none, zero-variance groups are only skipped.
    # Needs [train].dynamic_sampling = true and lockstep on one machine.
    backfill_rounds: int = 0
    # Draw tasks whose recent groups all passed or all failed less often (tasks/curriculum.py),
    # down to curriculum_floor times an unseen or mixed task's chance; false: each epoch a
    # uniform permutation of the tasks.
    curriculum: bool = False
    curriculum_floor: float = 0.1

    def __post_init__(self) -> None:
        check_types(self, "rollout")
        at_least(self, "rollout", "backfill_rounds", 0)
        in_range(self, "rollout", "curriculum_floor", 0.0, 1.0, low_open=True)
        for key in ("batch_size", "episodes_per_task", "max_turns", "max_model_length",
                    "max_completion_tokens", "max_sampling_attempts", "concurrency"):
            at_least(self, "rollout", key, 1)
        at_least(self, "rollout", "groups_in_flight", 1)
        at_least(self, "rollout", "max_steps_off_policy", 0)
        in_range(self, "rollout", "temperature", 0.0, None, low_open=True)
        in_range(self, "rollout", "top_p", 0.0, 1.0, low_open=True)
        in_range(self, "rollout", "generation_timeout_s", 0.0, None, low_open=True)
        if self.max_completion_tokens >= self.max_model_length:
            raise ConfigError(
                f"[rollout].max_completion_tokens ({self.max_completion_tokens}) must be "
                f"below [rollout].max_model_length ({self.max_model_length}): the context "
                "must also hold the prompt"
            )
        if self.backend == "openai" and not (self.base_url and self.api_model):
            raise ConfigError(
                "[rollout].backend = 'openai' needs [rollout].base_url and [rollout].api_model"
            )
        at_least(self, "rollout", "vllm_kvcache_space_gib", 1)
        in_range(self, "rollout", "vllm_startup_timeout_s", 0.0, None, low_open=True)
        for url in self.base_urls:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"[rollout].base_urls entries must start with http:// or https://; got {url!r}")
        if self.base_urls and self.backend != "vllm":
            raise ConfigError("[rollout].base_urls is for backend = 'vllm' (backend 'openai' takes base_url)")
        at_least(self, "rollout", "num_generator_replicas", 1)
        if self.num_generator_replicas > 1 and (self.backend != "vllm" or self.base_urls):
            raise ConfigError(
                f"[rollout].num_generator_replicas = {self.num_generator_replicas} starts managed vLLM "
                "servers: it needs backend = 'vllm' and no base_urls (your own servers are listed "
                "in base_urls, as many as you run)"
            )


@dataclass(frozen=True)
class TrainConfig:
    num_steps: int = 10  # a CPU run that finishes in minutes
    learning_rate: float = 2e-5  # the reference example's value; constant after any warm-up
    # Linear warm-up over the run's first N optimizer steps (step k uses
    # learning_rate * (k + 1) / N), then constant; 0: constant from the first step. Adam's
    # first steps move every parameter by about the learning rate whatever the gradient's
    # size, so a warm-up keeps the first noisy batches from undoing a fragile warm start.
    lr_warmup_steps: int = 0
    use_lora: bool = True  # reference default; full weights double the CPU memory
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0  # rollflow sft only: GRPO's loss runs without dropout
    lora_target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    loss: LossName = "grpo"  # the paper's sequence-mean; "dapo" / "dr_grpo" reduce length bias
    clip_eps_low: float = 0.2  # PPO's value
    clip_eps_high: float = 0.28  # DAPO's clip-higher: keeps exploration alive
    kl_coef: float = 0.0  # DAPO and Dr. GRPO drop the KL term; > 0 costs a reference pass
    max_tokens_per_microbatch: int = 4096  # padded tokens per forward pass (memory bound)
    max_grad_norm: float = 1.0
    # Optimizer steps per training step: the batch is dealt into this many minibatches
    # (each a share of every group), one step each, PPO-style. The same forward and
    # backward compute as 1; later steps lean on the ratio clip to stay near the sampler.
    minibatches: int = 1
    # Stale (async) samples: "tis" weights each token's surrogate by the truncated ratio
    # min(exp(prox_logp - sampler_logp), off_policy_cap) and clips against the trainer's
    # step-start policy; "mask" drops tokens whose ratio leaves [1/cap, cap]; "none" is the
    # uncorrected loss. None: "tis" when [rollout].max_steps_off_policy is set, else "none"
    # (RunConfig.off_policy_correction). 2.0 is verl's rollout_is_threshold.
    off_policy_correction: OffPolicyCorrection | None = None
    off_policy_cap: float = 2.0
    scale_advantages_by_std: bool = True  # GRPO as published; Dr. GRPO sets False
    dynamic_sampling: bool = False  # True: zero-variance groups are not trained
    failed_parse_reward: float = -0.1  # reference default
    overlong_masking: bool = False  # reference default: truncated episodes still train
    # The soft overlong penalty (tasks/scoring.py has the formula): DAPO's factor of 1.0;
    # None = max_model_length // 5, about DAPO's buffer: only episodes near the budget pay.
    overlong_penalty_factor: float = 1.0
    overlong_buffer_tokens: int | None = None
    seed: int = 0
    gradient_checkpointing: bool = False
    # The episodes of a GRPO group (and SFT rows) compute their shared opening prompt once
    # per micro-batch, forward and backward (tasks/shared_prefix.py); exact within float32
    # rounding. Ignored under gradient_checkpointing.
    shared_prefix: bool = False
    keep_checkpoints: int = 2  # the newest N policy versions stay on disk (resume needs 1)
    # "grpo": the environment's group-relative advantage. "opd": on-policy distillation, the
    # per-token reverse-KL signal kl_penalty_coef * (teacher_logp - sampler_logp) from a
    # teacher scoring the student's own episodes (tasks/teacher.py). A teacher named under
    # "grpo" is scored too (teacher.parquet, opd/teacher_kl) but only measured, not trained on.
    objective: Objective = "grpo"
    teacher_path: str | None = None  # an HF folder or a .gguf file; None = the bundled model
    teacher_adapter: str | None = None  # a peft adapter folder on teacher_path
    teacher_base_url: str | None = None  # or a vLLM server (prompt_logprobs of /v1/completions)
    teacher_api_model: str | None = None  # the model name that server serves
    kl_penalty_coef: float = 1.0  # weight of the reverse-KL signal (tinker-cookbook's name)
    opd_discount: float = 0.0  # 0: per-token; else the discounted sum of later tokens' signal in the action
    opd_reward_coef: float = 0.0  # weight of the environment's GRPO advantage mixed in

    @property
    def has_teacher(self) -> bool:
        return any(v is not None for v in (self.teacher_path, self.teacher_adapter, self.teacher_base_url))

    def __post_init__(self) -> None:
        check_types(self, "train")
        self._check_teacher()
        for key in ("num_steps", "lora_rank", "max_tokens_per_microbatch", "minibatches",
                    "keep_checkpoints", "overlong_buffer_tokens"):
            at_least(self, "train", key, 1)
        at_least(self, "train", "seed", 0)
        at_least(self, "train", "lr_warmup_steps", 0)
        in_range(self, "train", "learning_rate", 0.0, None, low_open=True)
        in_range(self, "train", "lora_alpha", 0.0, None, low_open=True)
        in_range(self, "train", "lora_dropout", 0.0, 1.0)
        in_range(self, "train", "clip_eps_low", 0.0, 1.0)
        in_range(self, "train", "clip_eps_high", 0.0, None)
        in_range(self, "train", "kl_coef", 0.0, None)
        in_range(self, "train", "max_grad_norm", 0.0, None, low_open=True)
        in_range(self, "train", "overlong_penalty_factor", 0.0, None)
        in_range(self, "train", "off_policy_cap", 1.0, None, low_open=True)
        if not self.lora_target_modules:
            raise ConfigError("[train].lora_target_modules must name at least one module")

    def _check_teacher(self) -> None:
        in_range(self, "train", "kl_penalty_coef", 0.0, None)
        in_range(self, "train", "opd_discount", 0.0, 1.0)
        in_range(self, "train", "opd_reward_coef", 0.0, None)
        if self.objective == "opd" and not self.has_teacher:
            raise ConfigError(
                "[train].objective = 'opd' needs a teacher: [train].teacher_path and/or "
                "teacher_adapter (a local model), or teacher_base_url + teacher_api_model (vLLM)"
            )
        if self.teacher_base_url is not None:
            if self.teacher_path is not None or self.teacher_adapter is not None:
                raise ConfigError(
                    "[train].teacher_base_url names a server teacher; leave teacher_path and "
                    "teacher_adapter unset (they name a local one)"
                )
            if self.teacher_api_model is None:
                raise ConfigError("[train].teacher_base_url needs [train].teacher_api_model")
            if not self.teacher_base_url.startswith(("http://", "https://")):
                raise ConfigError(
                    f"[train].teacher_base_url must start with http:// or https://; got {self.teacher_base_url!r}"
                )
        if self.objective == "opd" and self.dynamic_sampling:
            raise ConfigError(
                "[train].dynamic_sampling drops zero-variance groups, and OPD's groups of one "
                "always are: its signal is the teacher's, not the reward's variance; set it false"
            )


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

    def __post_init__(self) -> None:
        check_types(self, "sft")
        for key in ("epochs", "batch_size", "max_rows"):
            at_least(self, "sft", key, 1)
        in_range(self, "sft", "learning_rate", 0.0, None, low_open=True)


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
    cluster: ClusterConfig = field(default_factory=ClusterConfig)  # config/cluster.py

    @property
    def groups_in_flight(self) -> int:
        return self.rollout.groups_in_flight or self.rollout.batch_size

    @property
    def off_policy_correction(self) -> OffPolicyCorrection:
        """[train].off_policy_correction, else "tis" for async runs and "none" in lockstep."""
        if self.train.off_policy_correction is not None:
            return self.train.off_policy_correction
        return "tis" if self.rollout.max_steps_off_policy is not None else "none"

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
