"""Teacher stage (on-policy distillation): a teacher scores the student's own sampled tokens.

After flatten, for every sample of the step, the teacher's logprob of each sampled action
token given the same context (one forward pass of the teacher over the sample's
``input_ids``; ``rollflow.policy.teacher``) goes into ``teacher.parquet``: one
``TeacherRecord`` per sample, aligned to ``input_ids`` (0 on context), with ``teacher_kl``,
the mean over the sample's action tokens of ``sampler_logprob - teacher_logprob``: the
per-token reverse-KL estimate of tinker-cookbook's on-policy distillation, whose
negative (times ``kl_penalty_coef``) the trainer uses as the advantage under
``[train].objective = "opd"`` (``tasks/objectives.py``'s ``OBJECTIVES``).

The stage runs whenever a teacher is configured; under ``objective = "grpo"`` it only
measures how far the student is from the teacher (``opd/teacher_kl``), which is what lets
a GRPO run be compared with an OPD run from the same start.

Student and teacher must share token ids: ``check_teacher`` compares their tokenizers
(``check_same_tokenizer``) and the flow calls it before the first rollout, so a mismatch
is refused in seconds, naming both models, not after a step of rollouts.

The table is written atomically, never over a finished one. Simplified: the teacher is loaded for each step's stage
(seconds for a small model next to a step's rollout) rather than kept alive between steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rollflow.config.parsing import ConfigError
from rollflow.config.run import RunConfig
from rollflow.generators.models import base_model_ref, torch_device, torch_dtype
from rollflow.policy.stopping import raise_if_stop_requested
from rollflow.policy.teacher import (
    LocalTeacher,
    ServerTeacher,
    Teacher,
    check_same_tokenizer,
    check_server_temperature,
    describe_ref,
    local_fingerprint,
    model_ref_for,
)
from rollflow.storage.records import SampleRecord, TeacherRecord
from rollflow.storage.schemas import table_to_sample_records, teacher_records_to_table
from rollflow.storage.stage_outputs import read_output, write_output


def load_teacher(config: RunConfig) -> LocalTeacher | ServerTeacher:
    """The configured teacher, its tokenizer checked against the student's."""
    train = config.train
    if not train.has_teacher:
        raise ConfigError("no teacher configured: set [train].teacher_path, teacher_adapter or teacher_base_url")
    teacher: LocalTeacher | ServerTeacher
    if train.teacher_base_url is not None:
        assert train.teacher_api_model is not None  # TrainConfig checks it
        teacher = ServerTeacher(train.teacher_base_url, train.teacher_api_model)
        check_server_temperature(config.rollout.temperature, teacher.name)
    else:
        ref = model_ref_for(train.teacher_path, train.teacher_adapter)
        teacher = LocalTeacher(ref, config.rollout.temperature, torch_dtype(config), torch_device(config))
    _check_tokenizer(config, teacher)
    return teacher


def check_teacher(config: RunConfig) -> None:
    """Refuse a teacher whose tokenizer differs from the student's, before any rollout."""
    if not config.train.has_teacher:
        return
    train = config.train
    if train.teacher_base_url is not None:
        assert train.teacher_api_model is not None
        server = ServerTeacher(train.teacher_base_url, train.teacher_api_model)
        check_server_temperature(config.rollout.temperature, server.name)
        _check_tokenizer(config, server)
        return
    ref = model_ref_for(train.teacher_path, train.teacher_adapter)
    student = base_model_ref(config)
    check_same_tokenizer(local_fingerprint(student), local_fingerprint(ref), describe_ref(student), describe_ref(ref))


def _check_tokenizer(config: RunConfig, teacher: LocalTeacher | ServerTeacher) -> None:
    student = base_model_ref(config)
    check_same_tokenizer(local_fingerprint(student), teacher.fingerprint(), describe_ref(student), teacher.name)


def teacher_record(teacher: Teacher, sample: SampleRecord) -> TeacherRecord:
    """The teacher's logprobs of ``sample``'s action tokens and its mean reverse KL."""
    wanted_T = [m == 1 for m in sample.loss_mask]  # action tokens only; context stays 0
    teacher_T = teacher.token_logprobs(sample.input_ids, wanted_T)
    assert len(teacher_T) == len(sample.input_ids), (
        f"sample {sample.sample_id}: {len(sample.input_ids)} tokens but {len(teacher_T)} teacher logprobs"
    )
    gaps = [s - t for s, t, w in zip(sample.sampler_logprobs, teacher_T, wanted_T, strict=True) if w]
    return TeacherRecord(
        run_id=sample.run_id, step=sample.step, sample_id=sample.sample_id, episode_id=sample.episode_id,
        teacher_logprobs=tuple(teacher_T), teacher_kl=sum(gaps) / len(gaps) if gaps else 0.0,
        num_action_tokens=len(gaps),
    )


def score_samples(teacher: Teacher, samples: Sequence[SampleRecord]) -> list[TeacherRecord]:
    records = []
    for sample in samples:
        raise_if_stop_requested()  # SIGTERM: abandon the stage; nothing of it is written
        records.append(teacher_record(teacher, sample))
    return records


def teacher_stage(config: RunConfig, samples: Path, out: Path) -> Path:
    """Score a step's ``samples`` with the teacher into ``out`` (``teacher.parquet``)."""
    records = table_to_sample_records(read_output(samples))
    scored = score_samples(load_teacher(config), records) if records else []
    return write_output(teacher_records_to_table(scored), out)
