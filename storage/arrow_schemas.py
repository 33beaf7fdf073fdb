"""The Arrow schema of each stage record kind, and how a file's schema may differ from it.

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
  cluster (``[cluster]``, ``cluster/ray_rollout.py``), null without one. It came after
  ``SCHEMA_VERSION`` 2 as an *optional column* (``OPTIONAL_COLUMNS``): files written before
  it lack it and still read, the column filled with nulls (``fill_optional_columns``);
  every new file has it. ``replica`` (optional the same way) is the index of the vLLM server
  that sampled the episode's last action (``[rollout].base_urls`` or the managed replicas),
  null for policies without servers. ``tool_calls`` and ``tool_errors`` (optional the same
  way; null in older files) count the episode's tool messages and those that are
  ``tool_error: ...`` replies, the model's own mistakes (``envs/tools.py``); derived on
  write like the counts below, so ``unnest(messages)`` is not needed to count them.
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
"""

from __future__ import annotations

import enum

import pyarrow as pa

from rollflow.storage.records import SCHEMA_VERSION

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
        ("replica", pa.int32()),  # optional: null for policies without servers
        ("tool_calls", pa.int32()),  # optional: null in files written before it
        ("tool_errors", pa.int32()),  # optional: null in files written before it
        ("env", pa.string()),  # optional: the environment's label (a mixture's member); null before it
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
        ("env", pa.string()),  # optional: the environment's label, as in episodes; null before it
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
        ("env", pa.string()),  # optional: the episode's environment label; null before it
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
OPTIONAL_COLUMNS: dict[RecordKind, tuple[str, ...]] = {
    RecordKind.EPISODES: ("node", "replica", "tool_calls", "tool_errors", "env"),
    RecordKind.SCORES: ("env",),
    RecordKind.SAMPLES: ("env",),
}


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
