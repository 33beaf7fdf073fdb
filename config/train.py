"""The ``[train]`` section: the optimizer, LoRA, the loss and its variants, the objective and its teacher.

Its fields and their defaults, each with why. The section checks its own combinations
(an OPD objective needs a teacher, a server teacher is named once); what spans sections
(sampling settings a training run cannot learn from, the off-policy correction's
default) is ``config/checks.py``'s and ``RunConfig``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rollflow.config.parsing import ConfigError, at_least, check_types, in_range
from rollflow.policy.loss import LossName, OffPolicyCorrection

Objective = Literal["grpo", "opd"]  # tasks/objectives.py's OBJECTIVES
ComputeDtype = Literal["float32", "bfloat16"]


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
    # uncorrected loss. None: "tis" when [rollout].max_steps_off_policy is set or
    # compute_dtype is bfloat16, else "none" (RunConfig.off_policy_correction). 2.0 is verl's rollout_is_threshold.
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
    # The GRPO update's forward passes (the policy's, the proximal and KL reference passes)
    # under bfloat16 autocast: weights, optimizer state and the log-softmax stay float32.
    # About 2x faster on a CPU with native bfloat16 (docs/performance.md), but the
    # trainer's logprobs then differ from the float32 sampler's (mean |diff| ~0.03 on the
    # learning config), so it comes with an off-policy correction ("tis" unless
    # off_policy_correction says otherwise) and the mismatch in every step's metrics.
    compute_dtype: ComputeDtype = "float32"
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
