"""Validation episodes as MLflow traces (storage/traces.py), read back through MLflow's client."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from mlflow import MlflowClient

from rollflow.storage.synthetic import synthetic_episode, synthetic_score
from rollflow.storage.traces import TRACES_FILE, TraceSelection, log_validation_traces, select_episodes


def validation_pass(count: int, step: int = 5) -> tuple[list, list]:
    episodes = [synthetic_episode("run", step, task, 0, split="validation") for task in range(count)]
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


@pytest.mark.slow  # 3 s in a loaded suite run (docs/testing.md)
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


@pytest.mark.slow  # 5 s in a loaded suite run (docs/testing.md)
@pytest.mark.slow  # 3 s in a loaded suite run
def test_two_passes_after_the_same_seed_keep_their_own_traces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run seeds Python's ``random`` (train.seed) before its validation passes; OpenTelemetry
    drew trace ids from that same generator, so two passes reached at the same state got the
    same ids and the later one's traces replaced the earlier one's (seen in the nightly test:
    step 0's validation traces gone, step 1's listed twice)."""
    import random

    monkeypatch.delenv("MLFLOW_TRACE_USE_ISOLATED_RANDOM_ID_GENERATOR", raising=False)
    uri, client, experiment, run_id = mlflow_run(tmp_path)
    logged = []
    for step in (0, 1):
        episodes, scores = validation_pass(2, step=step)
        pass_dir = tmp_path / "validation" / f"step={step:06d}"
        pass_dir.mkdir(parents=True)
        random.seed(0)  # what seed_everything did before each pass
        logged.append(log_validation_traces(uri, experiment, run_id, pass_dir, episodes, scores, TraceSelection(1, 1, 0)))
    assert len(set(logged[0] + logged[1])) == 4, logged
    traces = client.search_traces(locations=[experiment], run_id=run_id)
    assert sorted(t.data.spans[0].name for t in traces) == [
        f"episode validation/{step}/{task}/0" for step in (0, 1) for task in (0, 1)]  # fmt: skip


_LOG_AND_EXIT = """
import sys
from pathlib import Path
import test_traces as t
from rollflow.storage.traces import TraceSelection, log_validation_traces
uri, client, experiment, run_id = t.mlflow_run(Path(sys.argv[1]))
episodes, scores = t.validation_pass(2)
(Path(sys.argv[1]) / "pass").mkdir()
log_validation_traces(uri, experiment, run_id, Path(sys.argv[1]) / "pass", episodes, scores, TraceSelection(1, 1, 0))
"""


@pytest.mark.slow  # a child process, ~5 s
def test_a_process_that_logged_traces_exits_without_a_traceback(tmp_path: Path) -> None:
    """The isolated trace-id generator above, left to interpreter exit, printed "Exception
    ignored in ... __del__" and a traceback at the end of every run that logged traces."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",  # the run's own URI
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", _LOG_AND_EXIT, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr[-3000:]


def test_a_crash_between_logging_and_traces_json_logs_no_trace_twice(tmp_path: Path, monkeypatch) -> None:
    """The process dies after the traces reached MLflow but before ``traces.json`` (here: before
    they were linked to the run, then after); the resume logs no episode a second time."""
    import rollflow.storage.traces as traces_module
    from mlflow import MlflowClient as RealClient

    uri, client, experiment, run_id = mlflow_run(tmp_path)
    selection = TraceSelection(1, 1, 1)

    class Crash(BaseException):
        """Stands in for SIGKILL: nothing after it runs."""

    def crash(*_: object, **__: object) -> None:
        raise Crash

    for step, crash_at in enumerate(("link_traces_to_run", "write_bytes_atomic"), start=5):
        episodes, scores = validation_pass(4, step)
        pass_dir = tmp_path / "validation" / f"step={step:06d}"
        pass_dir.mkdir(parents=True)
        with monkeypatch.context() as patch:
            if crash_at == "link_traces_to_run":
                patch.setattr(RealClient, "link_traces_to_run", crash)
            else:
                patch.setattr(traces_module, "write_bytes_atomic", crash)
            with pytest.raises(Crash):
                log_validation_traces(uri, experiment, run_id, pass_dir, episodes, scores, selection)
        assert not (pass_dir / TRACES_FILE).exists()
        ids = log_validation_traces(uri, experiment, run_id, pass_dir, episodes, scores, selection)
        assert len(ids) == 3 and json.loads((pass_dir / TRACES_FILE).read_text())["trace_ids"] == ids

    logged = client.search_traces(locations=[experiment], max_results=100)
    names = sorted(t.data.spans[0].name for t in logged)
    assert len(names) == 6 and len(set(names)) == 6, names  # 3 episodes a pass, each logged once
    linked = client.search_traces(locations=[experiment], run_id=run_id, max_results=100)
    assert sorted(t.info.trace_id for t in linked) == sorted(t.info.trace_id for t in logged)


@pytest.mark.slow  # 4 s in a loaded suite run (docs/testing.md)
def test_an_episode_that_overflowed_before_acting_is_a_trace_without_turns(tmp_path: Path) -> None:
    """A prompt longer than max_model_length: the transcript holds no assistant message."""
    from rollflow.envs.types import TruncationCause

    uri, client, experiment, run_id = mlflow_run(tmp_path)
    episodes, scores = validation_pass(2)
    opening = tuple(m for m in episodes[0].rollout.messages if m["role"] in ("system", "user"))[:2]
    overflowed = dataclasses.replace(
        episodes[0].rollout, messages=opening, response_text="", turns=0, terminated=False, truncated=True,
        truncation_cause=TruncationCause.CONTEXT_OVERFLOW, error=None, actions=(),
    )
    episodes[0] = dataclasses.replace(episodes[0], rollout=overflowed)
    pass_dir = tmp_path / "pass"
    pass_dir.mkdir()
    ids = log_validation_traces(uri, experiment, run_id, pass_dir, episodes, scores, TraceSelection(1, 1, 0))
    assert len(ids) == 2
    spans = {t.data.spans[0].name: t.data.spans for t in client.search_traces(locations=[experiment], run_id=run_id)}
    root_only = spans["episode validation/5/0/0"]
    assert [s.name for s in root_only] == ["episode validation/5/0/0"]
    assert root_only[0].attributes["ending"] == "context_overflow"
