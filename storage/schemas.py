"""Arrow schemas of the stage records, and exact conversions between records and tables.

Every table carries its record kind and ``SCHEMA_VERSION`` twice: in the Parquet
key-value metadata (what readers check before trusting a file) and as a
``schema_version`` column (what a SQL user sees). Episodes are flattened for SQL:

- ``messages`` is a list of structs so ``unnest(messages)`` works; a tool call keeps its
  ``id``, ``name`` and ``arguments`` (its ``type`` is always ``"function"``, so it is not
  stored); message keys outside the chat-message shape go to ``extra_json``.
- ``actions`` keeps each action's exact token ids and sampled logprobs. The context
  before an action is only its *delta*, so storage stays linear in episode length.
- ``step_metadata`` is JSON text (its shape is each environment's own).
- ``node`` is where the episode was played: the Ray node's name when the rollout ran on a
  cluster (``[cluster]``, ``flows/ray_rollout.py``), null without one. It came after
  ``SCHEMA_VERSION`` 2 as an *optional column* (``OPTIONAL_COLUMNS``): files written before
  it lack it and still read, the column filled with nulls (``fill_optional_columns``);
  every new file has it.
- ``num_actions`` and the token counts are derived on write, for SQL only; reading
  ignores them. Where the chat template re-rendered the prompt (an action with ``reset``)
  the context restarts, so the counts are: ``context_tokens``, the length of the final
  context (what a length budget measures); ``prompt_tokens``, the part of it the policy did
  not sample; ``completion_tokens``, every sampled token; ``total_tokens``, every token
  processed (each reset's re-rendered history counted again). Without a reset,
  ``context_tokens = total_tokens = prompt_tokens + completion_tokens``.

Simplified on purpose:
- Logprobs are float32 (what samplers compute in); a float64 logprob is stored rounded to
  the nearest float32, so the round trip is exact for float32 values only. Advantages stay
  float64 (they are one value per episode and compress to almost nothing).
- ``step_metadata`` must be JSON data: tuples come back as lists; other objects, non-text
  keys and NaN are refused with an error naming the episode rather than stored lossily.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from rollflow.envs.episode import EpisodeRollout
from rollflow.envs.types import TruncationCause
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

KIND_KEY = b"rollflow.record"
VERSION_KEY = b"rollflow.schema_version"


class RecordKind(enum.StrEnum):
    EPISODES = "episodes"
    SCORES = "scores"
    SAMPLES = "samples"
    TEACHER = "teacher"  # OPD: the teacher's logprobs of each sample
    TRAIN = "train"  # train.json rows; the `steps` view


TOOL_CALL_TYPE = pa.struct(
    [("id", pa.string()), ("name", pa.string()), ("arguments", pa.string())]
)
MESSAGE_TYPE = pa.struct(
    [
        ("role", pa.string()),
        ("content", pa.string()),
        ("tool_calls", pa.list_(TOOL_CALL_TYPE)),  # null: the key was absent
        ("tool_call_id", pa.string()),
        ("name", pa.string()),
        ("extra_json", pa.string()),  # other message keys, as a JSON object
    ]
)
ACTION_TYPE = pa.struct(
    [
        ("prompt_delta_ids", pa.list_(pa.int32())),
        ("reset", pa.bool_()),
        ("token_ids", pa.list_(pa.int32())),
        ("logprobs", pa.list_(pa.float32())),
        ("finish_reason", pa.string()),
    ]
)
_KEYS = [
    ("schema_version", pa.int32()),
    ("run_id", pa.string()),
    ("step", pa.int64()),
]


def _schema(kind: RecordKind, fields: list[tuple[str, pa.DataType]]) -> pa.Schema:
    metadata = {KIND_KEY: kind.value.encode(), VERSION_KEY: str(SCHEMA_VERSION).encode()}
    return pa.schema(fields, metadata=metadata)


EPISODE_SCHEMA = _schema(
    RecordKind.EPISODES,
    _KEYS
    + [
        ("split", pa.string()),
        ("task_id", pa.string()),
        ("group_id", pa.string()),
        ("episode_id", pa.string()),
        ("index_in_group", pa.int32()),
        ("policy_version", pa.int64()),
        ("messages", pa.list_(MESSAGE_TYPE)),
        ("response_text", pa.string()),
        ("turns", pa.int32()),
        ("terminated", pa.bool_()),
        ("truncated", pa.bool_()),
        ("truncation_cause", pa.string()),
        ("error", pa.string()),
        ("env_reward", pa.float64()),
        ("env_metrics", pa.map_(pa.string(), pa.float64())),
        ("step_metadata", pa.string()),
        ("actions", pa.list_(ACTION_TYPE)),
        ("latency_s", pa.float64()),
        ("sampling_attempts", pa.int32()),
        ("num_actions", pa.int32()),
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
        ("context_tokens", pa.int64()),
        ("total_tokens", pa.int64()),
        ("node", pa.string()),  # optional (OPTIONAL_COLUMNS): null without a cluster
    ],
)
SCORE_SCHEMA = _schema(
    RecordKind.SCORES,
    _KEYS
    + [
        ("split", pa.string()),
        ("task_id", pa.string()),
        ("group_id", pa.string()),
        ("episode_id", pa.string()),
        ("reward", pa.float64()),
        ("threshold", pa.float64()),
        ("components", pa.map_(pa.string(), pa.float64())),
        ("overlong_penalty", pa.float64()),
        ("final_reward", pa.float64()),
        ("passed", pa.bool_()),
        ("group_mean", pa.float64()),
        ("group_std", pa.float64()),
        ("group_size", pa.int32()),
        ("zero_variance", pa.bool_()),
        ("advantage", pa.float64()),
        ("trained", pa.bool_()),
        ("scoring_error", pa.string()),
    ],
)
SAMPLE_SCHEMA = _schema(
    RecordKind.SAMPLES,
    _KEYS
    + [
        ("sample_id", pa.string()),
        ("episode_id", pa.string()),
        ("group_id", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("advantages", pa.list_(pa.float64())),
        ("sampler_logprobs", pa.list_(pa.float32())),
        ("num_tokens", pa.int32()),
        ("num_action_tokens", pa.int32()),
    ],
)
TEACHER_SCHEMA = _schema(
    RecordKind.TEACHER,
    _KEYS
    + [
        ("sample_id", pa.string()),
        ("episode_id", pa.string()),
        ("teacher_logprobs", pa.list_(pa.float32())),
        ("teacher_kl", pa.float64()),
        ("num_action_tokens", pa.int32()),
    ],
)
TRAIN_RESULT_SCHEMA = _schema(
    RecordKind.TRAIN,
    _KEYS
    + [
        ("policy_version", pa.int64()),
        ("loss", pa.float64()),
        ("kl", pa.float64()),
        ("clip_fraction", pa.float64()),
        ("grad_norm", pa.float64()),
        ("num_samples", pa.int64()),
        ("num_tokens", pa.int64()),
        ("num_action_tokens", pa.int64()),
        ("learning_rate", pa.float64()),
        ("tokens_per_s", pa.float64()),
        ("timings", pa.map_(pa.string(), pa.float64())),
        ("mismatch_kl", pa.float64()),
        ("is_weight_mean", pa.float64()),
        ("corrected_fraction", pa.float64()),
        ("node", pa.string()),
    ],
)
SCHEMAS: dict[RecordKind, pa.Schema] = {
    RecordKind.EPISODES: EPISODE_SCHEMA,
    RecordKind.SCORES: SCORE_SCHEMA,
    RecordKind.SAMPLES: SAMPLE_SCHEMA,
    RecordKind.TEACHER: TEACHER_SCHEMA,
    RecordKind.TRAIN: TRAIN_RESULT_SCHEMA,
}


# Columns added after SCHEMA_VERSION 2 without a bump, always last: a file written before
# one lacks it and reads it as nulls; a file that has it must have it with its type.
OPTIONAL_COLUMNS: dict[RecordKind, tuple[str, ...]] = {RecordKind.EPISODES: ("node",)}


def readable_difference(actual: pa.Schema, kind: RecordKind) -> str | None:
    """``schema_difference`` for a file being read: the trailing optional columns of
    ``kind`` may be missing (older files), nothing else may differ."""
    expected = SCHEMAS[kind]
    for name in reversed(OPTIONAL_COLUMNS.get(kind, ())):
        if name not in actual.names and expected.names[-1] == name:
            expected = expected.remove(len(expected.names) - 1)
    return schema_difference(actual, expected)


def fill_optional_columns(table: pa.Table, kind: RecordKind) -> pa.Table:
    """``table`` with the optional columns it lacks appended as nulls, in schema order, and
    ``kind``'s schema metadata (an older file read as a current one)."""
    expected = SCHEMAS[kind]
    missing = [name for name in OPTIONAL_COLUMNS.get(kind, ()) if name not in table.schema.names]
    for name in missing:
        field = expected.field(name)
        table = table.append_column(field, pa.nulls(table.num_rows, type=field.type))
    return table.replace_schema_metadata(expected.metadata) if missing else table


def schema_difference(actual: pa.Schema, expected: pa.Schema) -> str | None:
    """A one-line description of how ``actual`` differs from ``expected``; None if equal."""
    if actual.equals(expected, check_metadata=False):
        return None
    missing = [n for n in expected.names if n not in actual.names]
    extra = [n for n in actual.names if n not in expected.names]
    retyped = [
        f"{f.name} is {f.type}, expected {expected.field(f.name).type}"
        for f in actual
        if f.name in expected.names and not f.type.equals(expected.field(f.name).type)
    ]
    parts = []
    if missing:
        parts.append(f"missing columns {missing}")
    if extra:
        parts.append(f"unexpected columns {extra}")
    parts.extend(retyped)
    return "; ".join(parts) or "columns in another order"


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
    )


def table_to_episode_records(table: pa.Table) -> list[EpisodeRecord]:
    table = fill_optional_columns(table, RecordKind.EPISODES)  # a table read before ``node``
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
        rows.append(row)
    return _to_table(_rows_to_columns(rows, SAMPLE_SCHEMA), RecordKind.SAMPLES)


def table_to_sample_records(table: pa.Table) -> list[SampleRecord]:
    _check_table(table, RecordKind.SAMPLES)
    return [
        SampleRecord(
            **{name: row[name] for name in _SAMPLE_FIELDS},
            **{name: tuple(row[name]) for name in _SAMPLE_ARRAYS},
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
