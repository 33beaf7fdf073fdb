"""Exact conversions between the stage records and their Arrow tables, and ``train.json``.

The Arrow schemas, their metadata keys and the optional-column rules live in
``storage/arrow_schemas.py``. A table that does not match its kind's schema is refused
with ``SchemaMismatchError``; records that cannot be stored, with ``ValueError``.

Simplified on purpose:
- ``step_metadata`` must be JSON data: tuples come back as lists; other objects, non-text
  keys and NaN are refused with an error naming the episode rather than stored lossily.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from rollflow.envs.episode import EpisodeRollout
from rollflow.envs.tools import count_tool_messages
from rollflow.envs.types import TruncationCause
from rollflow.storage.arrow_schemas import (
    EPISODE_SCHEMA,
    SAMPLE_SCHEMA,
    SCHEMAS,
    SCORE_SCHEMA,
    TEACHER_SCHEMA,
    TRAIN_RESULT_SCHEMA,
    RecordKind,
    fill_optional_columns,
    schema_difference,
)
from rollflow.storage.errors import SchemaMismatchError
from rollflow.storage.nested import action_to_row, dump_json, message_to_row, row_to_action, row_to_message
from rollflow.storage.records import (
    SCHEMA_VERSION,
    EpisodeRecord,
    SampleRecord,
    ScoreRecord,
    TeacherRecord,
    TrainResult,
)

__all__ = [
    "episode_records_to_table",
    "sample_records_to_table",
    "score_records_to_table",
    "table_to_episode_records",
    "table_to_sample_records",
    "table_to_score_records",
    "table_to_teacher_records",
    "table_to_train_results",
    "teacher_records_to_table",
    "train_result_from_json",
    "train_result_to_json",
    "train_results_to_table",
]


def _check_table(table: pa.Table, kind: RecordKind) -> None:
    problem = schema_difference(table.schema, SCHEMAS[kind])
    if problem is not None:
        raise SchemaMismatchError(None, f"not a {kind.value} table: {problem}")


def _to_table(columns: dict[str, list[Any]], kind: RecordKind) -> pa.Table:
    try:
        return pa.Table.from_pydict(columns, schema=SCHEMAS[kind])
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise ValueError(f"cannot store {kind.value} records: {exc}") from exc


# ---------------------------------------------------------------- episodes

def _episode_row(record: EpisodeRecord) -> dict[str, Any]:
    rollout = record.rollout
    where = f"episode {record.episode_id}"
    cause = rollout.truncation_cause
    tool_calls, tool_errors = count_tool_messages(rollout.messages)
    return {
        "schema_version": SCHEMA_VERSION,
        "run_id": record.run_id,
        "step": record.step,
        "split": record.split,
        "task_id": record.task_id,
        "group_id": record.group_id,
        "episode_id": record.episode_id,
        "index_in_group": record.index_in_group,
        "policy_version": rollout.policy_version,
        "messages": [message_to_row(m, where) for m in rollout.messages],
        "response_text": rollout.response_text,
        "turns": rollout.turns,
        "terminated": rollout.terminated,
        "truncated": rollout.truncated,
        "truncation_cause": None if cause is None else TruncationCause(cause).value,
        "error": rollout.error,
        "env_reward": rollout.env_reward,
        "env_metrics": list(rollout.env_metrics.items()),
        "step_metadata": dump_json([dict(m) for m in rollout.step_metadata], where),
        "actions": [action_to_row(a) for a in rollout.actions],
        "latency_s": rollout.latency_s,
        "sampling_attempts": rollout.sampling_attempts,
        "num_actions": len(rollout.actions),
        "prompt_tokens": sum(len(a.prompt_delta_ids) for a in rollout.final_context_actions),
        "completion_tokens": sum(len(a.token_ids) for a in rollout.actions),
        "context_tokens": rollout.context_tokens,
        "total_tokens": rollout.total_tokens,
        "node": record.node,
        "replica": rollout.replica,
        "tool_calls": tool_calls,
        "tool_errors": tool_errors,
        "env": record.env,
    }


def _rows_to_columns(rows: Sequence[dict[str, Any]], schema: pa.Schema) -> dict[str, list[Any]]:
    return {name: [row[name] for row in rows] for name in schema.names}


def episode_records_to_table(records: Sequence[EpisodeRecord]) -> pa.Table:
    rows = [_episode_row(r) for r in records]
    return _to_table(_rows_to_columns(rows, EPISODE_SCHEMA), RecordKind.EPISODES)


def _row_to_episode(row: Mapping[str, Any]) -> EpisodeRecord:
    cause = row["truncation_cause"]
    rollout = EpisodeRollout(
        messages=tuple(row_to_message(m) for m in row["messages"]),
        response_text=row["response_text"],
        turns=row["turns"],
        terminated=row["terminated"],
        truncated=row["truncated"],
        truncation_cause=None if cause is None else TruncationCause(cause),
        error=row["error"],
        env_reward=row["env_reward"],
        env_metrics=dict(row["env_metrics"]),
        step_metadata=tuple(json.loads(row["step_metadata"])),
        actions=tuple(row_to_action(a) for a in row["actions"]),
        latency_s=row["latency_s"],
        policy_version=row["policy_version"],
        sampling_attempts=row["sampling_attempts"],
        replica=row.get("replica"),
    )
    return EpisodeRecord(
        run_id=row["run_id"],
        step=row["step"],
        split=row["split"],
        task_id=row["task_id"],
        group_id=row["group_id"],
        episode_id=row["episode_id"],
        index_in_group=row["index_in_group"],
        rollout=rollout,
        node=row.get("node"),
        env=row.get("env"),
    )


def table_to_episode_records(table: pa.Table) -> list[EpisodeRecord]:
    table = fill_optional_columns(table, RecordKind.EPISODES)  # a table from before an optional column
    _check_table(table, RecordKind.EPISODES)
    return [_row_to_episode(row) for row in table.to_pylist()]


# ---------------------------------------------------------------- scores, samples, train

_SCORE_FIELDS = [n for n in SCORE_SCHEMA.names if n != "schema_version"]


def score_records_to_table(records: Sequence[ScoreRecord]) -> pa.Table:
    rows = []
    for record in records:
        row = {name: getattr(record, name) for name in _SCORE_FIELDS}
        row["components"] = list(record.components.items())
        rows.append({"schema_version": SCHEMA_VERSION, **row})
    return _to_table(_rows_to_columns(rows, SCORE_SCHEMA), RecordKind.SCORES)


def table_to_score_records(table: pa.Table) -> list[ScoreRecord]:
    table = fill_optional_columns(table, RecordKind.SCORES)  # a table from before an optional column
    _check_table(table, RecordKind.SCORES)
    records = []
    for row in table.to_pylist():
        fields = {name: row[name] for name in _SCORE_FIELDS}
        fields["components"] = dict(row["components"])
        records.append(ScoreRecord(**fields))
    return records


_SAMPLE_FIELDS = ("run_id", "step", "sample_id", "episode_id", "group_id")
_SAMPLE_ARRAYS = ("input_ids", "loss_mask", "advantages", "sampler_logprobs")


def sample_records_to_table(records: Sequence[SampleRecord]) -> pa.Table:
    rows = []
    for record in records:
        row: dict[str, Any] = {"schema_version": SCHEMA_VERSION}
        row.update({name: getattr(record, name) for name in _SAMPLE_FIELDS})
        row.update({name: list(getattr(record, name)) for name in _SAMPLE_ARRAYS})
        row["num_tokens"] = len(record.input_ids)
        row["num_action_tokens"] = sum(record.loss_mask)
        row["env"] = record.env
        rows.append(row)
    return _to_table(_rows_to_columns(rows, SAMPLE_SCHEMA), RecordKind.SAMPLES)


def table_to_sample_records(table: pa.Table) -> list[SampleRecord]:
    table = fill_optional_columns(table, RecordKind.SAMPLES)  # a table from before an optional column
    _check_table(table, RecordKind.SAMPLES)
    return [
        SampleRecord(
            **{name: row[name] for name in _SAMPLE_FIELDS},
            **{name: tuple(row[name]) for name in _SAMPLE_ARRAYS},
            env=row["env"],
        )
        for row in table.to_pylist()
    ]


_TEACHER_FIELDS = [n for n in TEACHER_SCHEMA.names if n != "schema_version"]


def teacher_records_to_table(records: Sequence[TeacherRecord]) -> pa.Table:
    rows = []
    for record in records:
        row: dict[str, Any] = {"schema_version": SCHEMA_VERSION}
        row.update({name: getattr(record, name) for name in _TEACHER_FIELDS})
        row["teacher_logprobs"] = list(record.teacher_logprobs)
        rows.append(row)
    return _to_table(_rows_to_columns(rows, TEACHER_SCHEMA), RecordKind.TEACHER)


def table_to_teacher_records(table: pa.Table) -> list[TeacherRecord]:
    _check_table(table, RecordKind.TEACHER)
    records = []
    for row in table.to_pylist():
        fields = {name: row[name] for name in _TEACHER_FIELDS}
        fields["teacher_logprobs"] = tuple(row["teacher_logprobs"])
        records.append(TeacherRecord(**fields))
    return records


_TRAIN_FIELDS = [n for n in TRAIN_RESULT_SCHEMA.names if n != "schema_version"]
# Added after SCHEMA_VERSION 2 without a bump: a train.json without them reads them as None.
_OPTIONAL_TRAIN_FIELDS = ("mismatch_kl", "is_weight_mean", "corrected_fraction", "node")


def train_result_to_json(result: TrainResult) -> dict[str, Any]:
    """The ``train.json`` object of one step (``timings`` as a JSON object)."""
    data: dict[str, Any] = {"record": RecordKind.TRAIN.value, "schema_version": SCHEMA_VERSION}
    data.update({name: getattr(result, name) for name in _TRAIN_FIELDS})
    data["timings"] = dict(result.timings)
    return data


def train_result_from_json(data: Mapping[str, Any]) -> TrainResult:
    """Inverse of ``train_result_to_json``; ValueError naming what is missing or foreign."""
    if data.get("record") != RecordKind.TRAIN.value:
        raise ValueError(f"not a train result: record is {data.get('record')!r}")
    if data.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(
            f"train result schema version {data.get('schema_version')!r}, "
            f"this rollflow reads {SCHEMA_VERSION}"
        )
    missing = [name for name in _TRAIN_FIELDS if name not in data and name not in _OPTIONAL_TRAIN_FIELDS]
    if missing:
        raise ValueError(f"train result lacks {missing}")
    return TrainResult(**{name: data.get(name) for name in _TRAIN_FIELDS})


def train_results_to_table(results: Sequence[TrainResult]) -> pa.Table:
    rows = [train_result_to_json(r) for r in results]
    for row in rows:
        row["timings"] = list(row["timings"].items())
    return _to_table(_rows_to_columns(rows, TRAIN_RESULT_SCHEMA), RecordKind.TRAIN)


def table_to_train_results(table: pa.Table) -> list[TrainResult]:
    _check_table(table, RecordKind.TRAIN)
    return [
        TrainResult(**{**{n: row[n] for n in _TRAIN_FIELDS}, "timings": dict(row["timings"])})
        for row in table.to_pylist()
    ]
