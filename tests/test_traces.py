"""Validation episodes as MLflow traces (storage/traces.py), read back through MLflow's client."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from mlflow import MlflowClient

from rollflow.storage.synthetic import synthetic_episode, synthetic_score
from rollflow.storage.traces import TRACES_FILE, TraceSelection, log_validation_traces, select_episodes


def validation_pass(count: int) -> tuple[list, list]:
    episodes = [synthetic_episode("run", 5, task, 0, split="validation") for task in range(count)]
    scores = [dataclasses.replace(synthetic_score(e, reward=task / 10), final_reward=task / 10, passed=task > 7)
              for task, e in enumerate(episodes)]
    return episodes, scores


def mlflow_run(tmp_path: Path) -> tuple[str, MlflowClient, str, str]:
    """A SQLite MLflow store in ``tmp_path`` with one experiment and one run in it."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("traces", artifact_location=(tmp_path / "artifacts").as_uri())
    return uri, client, experiment, client.create_run(experiment).info.run_id


def test_selection_takes_the_best_the_worst_and_a_seeded_sample() -> None:
    _, scores = validation_pass(12)
    chosen = select_episodes(scores, TraceSelection(best=2, worst=2, sample=3, seed=1))
    assert chosen[:2] == ["validation/5/11/0", "validation/5/10/0"]  # highest final reward first
    assert chosen[2:4] == ["validation/5/0/0", "validation/5/1/0"]  # then the lowest
    assert len(set(chosen)) == 7 and chosen == select_episodes(scores, TraceSelection(2, 2, 3, seed=1))
    assert select_episodes(scores[:3], TraceSelection(best=2, worst=2, sample=3)) == [
        "validation/5/2/0", "validation/5/1/0", "validation/5/0/0"]  # fewer episodes than asked: each once


def test_each_episode_is_a_trace_with_a_span_per_turn_and_tool_call(tmp_path: Path) -> None:
    uri, client, experiment, run_id = mlflow_run(tmp_path)
    episodes, scores = validation_pass(4)
    pass_dir = tmp_path / "validation" / "step=000005"
    pass_dir.mkdir(parents=True)

    ids = log_validation_traces(uri, experiment, run_id, pass_dir, episodes, scores, TraceSelection(1, 1, 1))
    assert len(ids) == 3
    traces = client.search_traces(locations=[experiment], run_id=run_id)
    assert sorted(t.info.trace_id for t in traces) == sorted(ids)
    best = next(t for t in traces if t.data.spans[0].name == "episode validation/5/3/0")
    spans = {s.name: s for s in best.data.spans}
    assert set(spans) == {"episode validation/5/3/0", "turn 1", "turn 2", "tool calculator"}
    root = spans["episode validation/5/3/0"]
    assert root.attributes["final_reward"] == 0.3 and root.attributes["task_id"] == "task-3"
    assert root.attributes["ending"] == "env"  # synthetic task 3 is truncated by its environment
    worst = next(t for t in traces if t.data.spans[0].name == "episode validation/5/0/0")
    assert worst.data.spans[0].attributes["ending"] == "terminated"
    tool = spans["tool calculator"]
    assert tool.parent_id == spans["turn 1"].span_id and spans["turn 1"].parent_id == root.span_id
    assert tool.inputs == {"arguments": '{"expression": "3*2"}'} and tool.outputs == {"content": "6"}
    assert spans["turn 2"].outputs["content"] == "6"
    assert spans["turn 2"].inputs == {"new_messages": [episodes[3].rollout.messages[3]]}  # the tool's answer

    again = log_validation_traces(uri, experiment, run_id, pass_dir, episodes, scores, TraceSelection(1, 1, 1))
    assert again == ids and json.loads((pass_dir / TRACES_FILE).read_text())["trace_ids"] == ids
    assert len(client.search_traces(locations=[experiment], run_id=run_id)) == 3  # a resume adds none
