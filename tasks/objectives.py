"""Objectives: the per-token advantage the training loss pushes on.

``OBJECTIVES`` maps ``[train].objective`` to one: ``grpo`` keeps the episode's
group-relative advantage that flatten broadcast to its action tokens; ``opd`` (on-policy
distillation, tinker-cookbook's recipe) replaces it with ``kl_penalty_coef *
(teacher_logp - sampler_logp)`` per action token, the negative reverse-KL estimate from
the teacher stage's ``teacher.parquet``: tokens the teacher likes more than the student
did are pushed up. ``opd_discount > 0`` sums each token's later signal within its action,
discounted; ``opd_reward_coef`` mixes the GRPO advantage back in. The loss and the
trainer (``rollflow.tasks.train``) do not know which objective ran.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from rollflow.config.run import RunConfig
from rollflow.storage.records import SampleRecord, TeacherRecord
from rollflow.storage.schemas import table_to_teacher_records
from rollflow.storage.stage_outputs import read_output


@dataclass(frozen=True)
class ObjectiveSettings:
    kl_penalty_coef: float = 1.0
    discount: float = 0.0  # 0: each token its own signal
    reward_coef: float = 0.0  # weight of the GRPO advantage mixed into OPD's

    @classmethod
    def from_config(cls, config: RunConfig) -> ObjectiveSettings:
        train = config.train
        return cls(train.kl_penalty_coef, train.opd_discount, train.opd_reward_coef)


def opd_token_advantages(
    loss_mask_T: Sequence[int], sampler_T: Sequence[float], teacher_T: Sequence[float],
    grpo_T: Sequence[float], settings: ObjectiveSettings,
) -> tuple[float, ...]:
    """OPD's advantage of every token: 0 on context (mask 0, never trained).

    signal_t = kl_penalty_coef * (teacher_t - sampler_t) on action tokens; with a discount
    g, A_t = sum over later tokens k of the same action (a run of mask 1) of g^(k-t)
    signal_k; then + reward_coef * the GRPO advantage.
    """
    out_T = [0.0] * len(loss_mask_T)
    running = 0.0
    for t in reversed(range(len(loss_mask_T))):
        if not loss_mask_T[t]:
            running = 0.0  # a context token ends the action before it
            continue
        signal = settings.kl_penalty_coef * (teacher_T[t] - sampler_T[t])
        running = signal + settings.discount * running
        out_T[t] = running + settings.reward_coef * grpo_T[t]
    return tuple(out_T)


def grpo_advantages(
    samples: Sequence[SampleRecord], teacher: Mapping[str, TeacherRecord], settings: ObjectiveSettings
) -> list[SampleRecord]:
    """GRPO: the advantages flatten wrote (the episode's, on its action tokens)."""
    return list(samples)


def opd_advantages(
    samples: Sequence[SampleRecord], teacher: Mapping[str, TeacherRecord], settings: ObjectiveSettings
) -> list[SampleRecord]:
    """On-policy distillation: each sample's advantages from the teacher's logprobs."""
    missing = [s.sample_id for s in samples if s.sample_id not in teacher]
    if missing:
        raise ValueError(f"{len(missing)} samples have no teacher logprobs (first: {missing[0]!r})")
    return [
        replace(s, advantages=opd_token_advantages(
            s.loss_mask, s.sampler_logprobs, teacher[s.sample_id].teacher_logprobs, s.advantages, settings))
        for s in samples
    ]


@dataclass(frozen=True)
class Objective:
    advantages: Callable[[Sequence[SampleRecord], Mapping[str, TeacherRecord], ObjectiveSettings], list[SampleRecord]]
    needs_teacher: bool  # reads the step's teacher.parquet


OBJECTIVES: dict[str, Objective] = {
    "grpo": Objective(grpo_advantages, needs_teacher=False),
    "opd": Objective(opd_advantages, needs_teacher=True),
}


def objective_samples(
    config: RunConfig, samples: Sequence[SampleRecord], teacher: Path | None
) -> list[SampleRecord]:
    """``samples`` with the per-token advantages of ``[train].objective``; ``teacher`` is the
    step's ``teacher.parquet`` (None: no teacher configured)."""
    objective = OBJECTIVES[config.train.objective]
    by_id: dict[str, TeacherRecord] = {}
    if objective.needs_teacher and samples:
        if teacher is None:
            raise ValueError(f"[train].objective = {config.train.objective!r} needs the step's teacher scores")
        by_id = {r.sample_id: r for r in table_to_teacher_records(read_output(teacher))}
    return objective.advantages(samples, by_id, ObjectiveSettings.from_config(config))
