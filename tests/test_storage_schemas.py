"""Records survive the trip to Arrow exactly, and the flattened columns say what SQL needs."""

from __future__ import annotations

import dataclasses
import math

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollflow.envs.episode import ActionTokens, EpisodeRollout
from rollflow.envs.types import TruncationCause
from rollflow.storage.arrow_schemas import EPISODE_SCHEMA, KIND_KEY, VERSION_KEY
from rollflow.storage.errors import SchemaMismatchError
from rollflow.storage.records import SCHEMA_VERSION, TrainResult
from rollflow.storage.schemas import (
    episode_records_to_table,
    sample_records_to_table,
    score_records_to_table,
    table_to_episode_records,
    table_to_sample_records,
    table_to_score_records,
    table_to_train_results,
    train_result_from_json,
    train_result_to_json,
    train_results_to_table,
)
from rollflow.storage.synthetic import as_float32, synthetic_episode, synthetic_sample, synthetic_score


def _with_rollout(record, **changes):
    return dataclasses.replace(record, rollout=dataclasses.replace(record.rollout, **changes))


def test_every_ending_round_trips_exactly() -> None:
    records = [synthetic_episode("run", 3, t, i) for t in range(8) for i in range(2)]
    endings = {(r.rollout.terminated, r.rollout.truncation_cause, r.rollout.error) for r in records}
    assert len(endings) == 6, "terminated, four truncation causes and error should all appear"
    assert table_to_episode_records(episode_records_to_table(records)) == records


def test_message_keys_keep_absent_apart_from_empty() -> None:
    base = synthetic_episode("run", 0, 0, 0)
    messages = (
        {"role": "assistant", "content": "no calls", "tool_calls": []},
        {"role": "assistant", "content": "absent"},
        {"role": "tool", "content": "", "tool_call_id": "", "name": ""},
        {"role": "user", "content": "héllo ✓", "reasoning": {"steps": [1, 2]}, "weight": 0.5},
    )
    record = _with_rollout(base, messages=messages)
    (back,) = table_to_episode_records(episode_records_to_table([record]))
    assert back.rollout.messages == messages
    assert "tool_calls" not in back.rollout.messages[1]
    assert back.rollout.messages[0]["tool_calls"] == []


def test_messages_and_actions_are_flattened_for_sql() -> None:
    record = synthetic_episode("run", 2, 0, 0)
    row = episode_records_to_table([record]).to_pylist()[0]
    assistant = row["messages"][2]
    assert assistant["tool_calls"] == [
        {"id": "call_0_0", "name": "calculator", "arguments": '{"expression": "0*2"}'}
    ]
    assert row["actions"][0]["prompt_delta_ids"] == list(range(1, 31))
    assert row["actions"][1]["token_ids"] == [21, 22]
    assert (row["num_actions"], row["prompt_tokens"], row["completion_tokens"]) == (2, 35, 6)
    assert row["total_tokens"] == record.rollout.total_tokens == 41
    assert row["context_tokens"] == record.rollout.context_tokens == 41  # no reset: the same
    assert row["schema_version"] == SCHEMA_VERSION
    assert row["step_metadata"] == '[{"tool": "calculator"}, {"final": true}]'
    meta = EPISODE_SCHEMA.metadata
    assert meta[KIND_KEY] == b"episodes" and meta[VERSION_KEY] == str(SCHEMA_VERSION).encode()


def test_token_columns_count_the_final_context_after_a_reset() -> None:
    first = ActionTokens(tuple(range(30)), False, (1, 2, 3, 4), (-0.5,) * 4, "stop")
    rerendered = ActionTokens(tuple(range(40)), True, (5, 6), (-0.5,) * 2, "stop")  # the whole prompt again
    record = _with_rollout(synthetic_episode("run", 0, 0, 0), actions=(first, rerendered))
    row = episode_records_to_table([record]).to_pylist()[0]
    assert (row["context_tokens"], row["prompt_tokens"]) == (42, 40)  # the final context, its unsampled part
    assert (row["completion_tokens"], row["total_tokens"]) == (6, 76)  # every sampled / processed token


def test_logprobs_are_float32() -> None:
    action = ActionTokens((1,), False, (5, 6), (-0.1, -1e-9), "length")
    record = _with_rollout(synthetic_episode("run", 0, 0, 0), actions=(action,))
    (back,) = table_to_episode_records(episode_records_to_table([record]))
    assert back.rollout.actions[0].logprobs == (as_float32(-0.1), as_float32(-1e-9))
    assert back.rollout.actions[0].logprobs[0] != -0.1  # documented rounding, not silent loss


def test_step_metadata_must_be_json_data() -> None:
    base = synthetic_episode("run", 0, 0, 0)
    tuples = _with_rollout(base, step_metadata=({"pair": (1, 2)},))
    (back,) = table_to_episode_records(episode_records_to_table([tuples]))
    assert back.rollout.step_metadata == ({"pair": [1, 2]},)
    for bad in ({"when": object()}, {1: "int key"}, {"x": math.nan}):
        with pytest.raises(ValueError, match="episode train/0/0/0"):
            episode_records_to_table([_with_rollout(base, step_metadata=(bad,))])


def test_malformed_tool_call_is_refused_naming_the_episode() -> None:
    base = synthetic_episode("run", 0, 0, 0)
    call = {"id": "c", "type": "web_search", "function": {"name": "f", "arguments": "{}"}}
    bad = _with_rollout(base, messages=({"role": "assistant", "content": "", "tool_calls": [call]},))
    with pytest.raises(ValueError, match="episode train/0/0/0.*tool call"):
        episode_records_to_table([bad])
    with pytest.raises(ValueError, match="without a role"):
        episode_records_to_table([_with_rollout(base, messages=({"content": "x"},))])


def test_scores_round_trip_with_nulls() -> None:
    episodes = [synthetic_episode("run", 1, 0, i) for i in range(3)]
    scores = [synthetic_score(e, reward=float(i), advantage=i - 1.0) for i, e in enumerate(episodes)]
    scores[1] = dataclasses.replace(scores[1], threshold=None, components={}, scoring_error="KeyError: 'x'")
    assert table_to_score_records(score_records_to_table(scores)) == scores


def test_samples_round_trip_and_count_tokens() -> None:
    episodes = [synthetic_episode("run", 1, 0, i) for i in range(2)]
    samples = [synthetic_sample(e, advantage=1 / 3) for e in episodes]
    table = sample_records_to_table(samples)
    assert table_to_sample_records(table) == samples  # advantages are float64: exact
    assert table.column("num_tokens").to_pylist() == [41, 41]
    assert table.column("num_action_tokens").to_pylist() == [6, 6]


def test_train_results_round_trip_through_json_and_arrow() -> None:
    results = [
        TrainResult("run", 0, 1, 0.25, None, 0.1, 2.0, 8, 900, 300, 1e-5, 40.0, {"forward": 1.5}),
        TrainResult("run", 1, 2, math.inf, 0.01, 0.0, 0.5, 8, 900, 300, 1e-5, 40.0, {}),
    ]
    assert [train_result_from_json(train_result_to_json(r)) for r in results] == results
    assert table_to_train_results(train_results_to_table(results)) == results
    with pytest.raises(ValueError, match="schema version"):
        train_result_from_json({**train_result_to_json(results[0]), "schema_version": 99})
    with pytest.raises(ValueError, match="lacks"):
        train_result_from_json({"record": "train", "schema_version": SCHEMA_VERSION})


def test_a_foreign_table_is_refused_with_what_differs() -> None:
    table = episode_records_to_table([synthetic_episode("run", 0, 0, 0)])
    with pytest.raises(SchemaMismatchError, match="not a scores table.*missing columns"):
        table_to_score_records(table)
    renamed = table.rename_columns([*table.column_names[:-1], "tokens"])
    with pytest.raises(SchemaMismatchError, match="unexpected columns \\['tokens'\\]"):
        table_to_episode_records(renamed)


def test_wrong_types_fail_with_the_record_kind() -> None:
    bad = _with_rollout(synthetic_episode("run", 0, 0, 0), turns="two")
    with pytest.raises(ValueError, match="cannot store episodes records"):
        episode_records_to_table([bad])


def test_empty_inputs_give_empty_tables() -> None:
    table = episode_records_to_table([])
    assert table.num_rows == 0 and table.schema.equals(EPISODE_SCHEMA)
    assert table_to_episode_records(table) == []


# ---------------------------------------------------------------- property: any rollout

_text = st.text(max_size=12)
_token_ids = st.lists(st.integers(0, 2**31 - 1), max_size=6).map(tuple)
_float32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@st.composite
def _actions(draw: st.DrawFn) -> ActionTokens:
    tokens = draw(_token_ids)
    logprobs = tuple(draw(st.lists(_float32, min_size=len(tokens), max_size=len(tokens))))
    finish = draw(st.sampled_from(["stop", "length", "context"]))
    return ActionTokens(draw(_token_ids), draw(st.booleans()), tokens, logprobs, finish)


_calls = st.lists(
    st.builds(
        lambda i, n, a: {"id": i, "type": "function", "function": {"name": n, "arguments": a}},
        _text, _text, _text,
    ),
    max_size=2,
)
_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": _text},
        optional={"tool_calls": _calls, "tool_call_id": _text, "name": _text},
    ),
    max_size=4,
).map(tuple)


@settings(max_examples=60, deadline=None)
@given(
    messages=_messages,
    actions=st.lists(_actions(), max_size=3).map(tuple),
    cause=st.sampled_from([None, *TruncationCause]),
    env_metrics=st.dictionaries(_text, st.floats(allow_nan=False), max_size=3),
)
def test_any_rollout_round_trips(messages, actions, cause, env_metrics) -> None:
    rollout = EpisodeRollout(
        messages=messages,
        response_text="r",
        turns=len(actions),
        terminated=cause is None,
        truncated=cause is not None,
        truncation_cause=cause,
        env_metrics=env_metrics,
        actions=actions,
    )
    record = dataclasses.replace(synthetic_episode("run", 0, 0, 0), rollout=rollout)
    table = episode_records_to_table([record])
    assert isinstance(table, pa.Table)
    assert table_to_episode_records(table) == [record]
