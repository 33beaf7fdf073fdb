"""Tool calls through the stages (issue 48, items 2, 3 and 5): a broken tool is an episode error
with its traceback, the model's tool errors are counted per episode (``episodes.tool_calls``,
``tool_errors``), per step (``tools/calls``, ``tools/errors``) and in the step and validation
lines, which also say when no group had reward variance. A scripted policy on
``tests/tool_env.py``: no model, no Prefect."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rollflow.config.rollout import RolloutConfig
from rollflow.config.run import EnvConfig, RunConfig, TrackingConfig, ValidationConfig
from rollflow.envs.scripted import ScriptedPolicy
from rollflow.envs.types import Message
from rollflow.generators.policy_io import ActingPolicy
from rollflow.storage.parquet import read_table
from rollflow.storage.query import describe_views, open_run_sql, run_query
from rollflow.storage.runfolder import RunFolder
from rollflow.storage.schemas import episode_records_to_table, table_to_episode_records
from rollflow.storage.step_metrics import step_metrics
from rollflow.storage.synthetic import synthetic_episode
from rollflow.tasks.metrics import rollout_metrics, validation_metrics_stage, validation_outcome
from rollflow.tasks.rollout import rollout_stage
from rollflow.tasks.scoring import score_stage
from rollflow.tasks.step_health import NOTHING_TO_LEARN, read_episode_errors, step_hint, step_summary

UNKNOWN = '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'  # the model's mistake
LOOKUP = '<tool_call>{"name": "lookup", "arguments": {"word": "seven"}}</tool_call>'


def script(messages: Sequence[Message], turn: int) -> str:
    """Task 0: a call to a tool that does not exist, a lookup, then "7" (reward 1).
    Task 1: "7" at once (reward 1, no tool call)."""
    if messages[0]["content"].startswith("task 1"):
        return "7"
    return (UNKNOWN, LOOKUP, "7")[min(turn, 2)]


def config(bug: str) -> RunConfig:
    return RunConfig(
        env=EnvConfig(name="tool_env:load_environment", kwargs={"bug": bug}),
        rollout=RolloutConfig(batch_size=2, episodes_per_task=2, max_turns=4),
        validation=ValidationConfig(episodes_per_task=2),
        tracking=TrackingConfig(enabled=False),
    )


def play(run_dir: Path, bug: str, split: str = "train") -> RunFolder:
    """Step 0's ``split`` episodes played and scored."""
    folder = RunFolder(run_dir)
    paths = folder.step_paths(0, split)
    episodes = rollout_stage(config(bug), paths.episodes, 0, split, ActingPolicy.fixed(ScriptedPolicy(script)))
    score_stage(config(bug), episodes, paths.scores)
    return folder


@pytest.mark.parametrize("bug", ["dict", "schema"])
def test_a_broken_tool_is_an_episode_error_with_its_traceback_not_a_message(tmp_path: Path, bug: str) -> None:
    folder = play(tmp_path / "run", bug)
    con = open_run_sql(folder.root)
    _, rows = run_query(con, "SELECT task_id, error, episode_id FROM episodes ORDER BY episode_id")
    broken = [r for r in rows if r[0] == "lookup-0"]
    assert len(broken) == 2 and all(r[1] is not None and r[1].startswith("BrokenToolError: tool 'lookup'") for r in broken)
    assert all("(a bug in the tool, not in the model's call)" in r[1] and r[1].endswith("(in Env.step)") for r in broken)
    if bug == "dict":
        assert "returned dict, not rollflow.envs.types.ToolResult" in broken[0][1]
    else:
        assert "has an invalid parameters_schema" in broken[0][1]
    assert all(r[1] is None for r in rows if r[0] == "lookup-1")  # the other task never called it
    kept = read_episode_errors(folder.step_dir(0) / "errors.jsonl")
    assert sorted(e.episode_id for e in kept) == [r[2] for r in broken]
    assert all(e.stage == "rollout" and "BrokenToolError" in (e.traceback or "") for e in kept)
    assert "errors 2/4" in step_summary(rollout_metrics(folder.root, 0, "train"))


def test_the_models_tool_errors_are_counted_per_episode_per_step_and_in_the_step_line(tmp_path: Path) -> None:
    folder = play(tmp_path / "run", "none")
    con = open_run_sql(folder.root)
    _, rows = run_query(con, "SELECT task_id, tool_calls, tool_errors FROM episodes ORDER BY task_id")
    assert rows == [("lookup-0", 2, 1), ("lookup-0", 2, 1), ("lookup-1", 0, 0), ("lookup-1", 0, 0)]
    _, [message] = run_query(con, "SELECT m.content FROM (SELECT unnest(messages) AS m FROM episodes) "
                                  "WHERE m.role = 'tool' AND m.content LIKE 'tool_error:%' LIMIT 1")
    assert message[0].startswith("tool_error: unknown tool 'nope'")  # the model's mistake stays its feedback
    metrics = rollout_metrics(folder.root, 0, "train")
    assert (metrics["tools/calls"], metrics["tools/errors"]) == (4.0, 2.0)
    line = step_summary(metrics)
    assert line == ("reward 1.000 pass 100% errors 0/4 overflows 0/4 tool errors 2/4 calls "
                    "groups with reward variance 0/2: nothing to learn")


def test_a_step_where_every_group_scored_alike_says_so_and_what_to_try(tmp_path: Path) -> None:
    folder = play(tmp_path / "run", "none")
    metrics = rollout_metrics(folder.root, 0, "train")
    assert metrics["reward/zero_variance_skip_ratio"] == 1.0
    hint = step_hint(metrics)
    assert hint == NOTHING_TO_LEARN
    assert "rollflow sft" in hint and "partial credit" in hint and "worked example" in hint


def test_the_validation_line_counts_errors_and_tool_errors_and_the_pass_rate_counts_errors_as_failures(
    tmp_path: Path,
) -> None:
    folder = play(tmp_path / "run", "dict", split="validation")
    p = folder.step_paths(0, "validation")
    validation_metrics_stage(config("dict"), folder, p, p.metrics_json)
    metrics = folder.read_json(folder.step_paths(0, "validation").metrics_json)
    # lookup-0's two episodes errored (the broken tool), lookup-1's two passed: 2 of 4, not 2 of 2
    assert metrics["val/reward/pass_rate"] == 0.5
    assert metrics["val/tools/calls"] == 2.0 and metrics["val/tools/errors"] == 2.0  # the unknown tool, twice
    assert validation_outcome(folder, 0) == "reward 1.000 pass 50% errors 2/4 overflows 0/4 tool errors 2/2 calls"


# ---------------------------------------------------------------- the columns, old files included


def test_tool_calls_and_tool_errors_are_counted_from_each_episodes_transcript(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "run")
    base = synthetic_episode(folder.run_id, 0, 0, 0)
    messages = (
        {"role": "user", "content": "tool_error: words of the user are no tool message"},
        {"role": "tool", "content": "tool_error: unknown tool 'x'", "tool_call_id": "call_0", "name": "x"},
        {"role": "tool", "content": "42", "tool_call_id": "call_1", "name": "add"},
        {"role": "assistant", "content": "42"},
    )
    record = dataclasses.replace(base, rollout=dataclasses.replace(base.rollout, messages=messages))
    plain = dataclasses.replace(synthetic_episode(folder.run_id, 0, 1, 0), rollout=dataclasses.replace(
        base.rollout, messages=({"role": "user", "content": "hi"}, {"role": "assistant", "content": "4"})))
    folder.write_stage(episode_records_to_table([record, plain]), 0, "episodes", "train")
    con = open_run_sql(folder.root)
    assert run_query(con, "SELECT tool_calls, tool_errors FROM episodes ORDER BY episode_id")[1] == [(2, 1), (0, 0)]
    assert (step_metrics(con, step=0)["tool_calls"], step_metrics(con, step=0)["tool_errors"]) == (2.0, 1.0)


def written_before_the_tool_columns(table):  # noqa: ANN001, ANN201 - a pyarrow table
    # a file that predates the tool columns predates the newer env column too
    return table.drop_columns(["tool_calls", "tool_errors", "env"]).replace_schema_metadata(table.schema.metadata)


def test_episode_files_from_before_the_tool_columns_still_read(tmp_path: Path) -> None:
    """``tool_calls`` and ``tool_errors`` came after ``replica`` (optional columns): an older
    file reads them as nulls, beside a part that has them, in Python and SQL; a step wholly
    older has NaN tool metrics, which the step line leaves out."""
    folder = RunFolder(tmp_path / "run")
    first, second = (synthetic_episode(folder.run_id, 0, t, 0) for t in range(2))
    out = folder.parts_dir(0, "episodes")
    out.mkdir(parents=True)
    old = written_before_the_tool_columns(episode_records_to_table([first]))
    pq.write_table(old, out / "part-00000.parquet")
    pq.write_table(episode_records_to_table([second]), out / "part-00001.parquet")
    folder.seal_stage(0, "episodes")
    assert len(table_to_episode_records(read_table(out))) == 2
    con = open_run_sql(folder.root)
    calls = sum(m["role"] == "tool" for m in second.rollout.messages)
    assert run_query(con, "SELECT tool_calls FROM episodes ORDER BY episode_id")[1] == [(None,), (calls,)]
    assert ("tool_errors", "INTEGER") in describe_views(con)["episodes"]
    older = RunFolder(tmp_path / "older")
    alone = older.parts_dir(0, "episodes")
    alone.mkdir(parents=True)
    pq.write_table(old, alone / "part-00000.parquet")
    older.seal_stage(0, "episodes")
    con = open_run_sql(older.root)
    assert run_query(con, "SELECT tool_calls, tool_errors FROM episodes")[1] == [(None, None)]
    metrics = step_metrics(con, step=0)
    assert math.isnan(metrics["tool_calls"]) and math.isnan(metrics["tool_errors"])
    line = step_summary({"episodes/count": 1.0, "tools/calls": None, "tools/errors": None})
    assert line == "reward n/a pass n/a errors 0/1 overflows 0/1"
