"""Validation episodes as MLflow traces, so the MLflow UI shows transcripts beside the curves.

For each validation pass, a few episodes are logged as traces of the run's experiment and
linked to its MLflow run (the run page's Traces tab lists them): the best and the worst
by final reward, and a seeded sample of the rest. One trace per episode:

- the root span, ``episode <id>`` (an AGENT span): the opening messages in, the scored
  response out; its attributes hold the reward, final reward, pass, how the episode ended
  (``ending``: terminated, a truncation cause, or error) and where it sits in the run;
- one LLM span per assistant turn, ``turn <k>``: the messages the environment added since
  the previous turn in, the assistant message (text and parsed tool calls) out;
- under a turn, one TOOL span per tool call, ``tool <name>``: its arguments in, the tool
  message that answered it out.

Idempotent: the logged trace ids go to ``traces.json`` in the pass's folder, and a pass
that has one is not logged again (a resumed run never duplicates traces). Each trace is
tagged with its MLflow run, pass and episode (``rollflow.pass``, ``rollflow.episode``), so
a pass whose process died after logging but before ``traces.json`` finds its traces in
MLflow on resume and logs only the episodes still missing.

Simplified, and why: span times are the logging times, not the episode's (episodes store
their total latency only); a turn's input is what was new, not the whole history, so a
trace stays linear in the episode's length, like the Parquet records.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollflow.storage.parquet import write_bytes_atomic
from rollflow.storage.records import EpisodeRecord, ScoreRecord

TRACES_FILE = "traces.json"
ISOLATED_IDS_ENV = "MLFLOW_TRACE_USE_ISOLATED_RANDOM_ID_GENERATOR"
PASS_TAG = "rollflow.pass"  # "<mlflow run id>:<split folder>/<pass folder>"
EPISODE_TAG = "rollflow.episode"


@dataclass(frozen=True)
class TraceSelection:
    best: int = 3
    worst: int = 3
    sample: int = 4
    seed: int = 0


def select_episodes(scores: Sequence[ScoreRecord], selection: TraceSelection) -> list[str]:
    """Episode ids: the ``best`` and ``worst`` by final reward, then a seeded ``sample``."""
    ranked = sorted(scores, key=lambda s: (-s.final_reward, s.episode_id))
    chosen = [s.episode_id for s in ranked[: selection.best]]
    for score in reversed(ranked[len(chosen):]):
        if len(chosen) >= selection.best + selection.worst:
            break
        chosen.append(score.episode_id)
    rest = sorted(set(s.episode_id for s in scores) - set(chosen))
    chosen += random.Random(selection.seed).sample(rest, min(selection.sample, len(rest)))
    return chosen


def ending(episode: EpisodeRecord) -> str:
    rollout = episode.rollout
    if rollout.error is not None:
        return "error"
    return "terminated" if rollout.terminated else str(rollout.truncation_cause)


def log_validation_traces(
    tracking_uri: str, experiment_id: str, mlflow_run_id: str, pass_dir: Path,
    episodes: Sequence[EpisodeRecord], scores: Sequence[ScoreRecord], selection: TraceSelection = TraceSelection(),
) -> list[str]:
    """Log the selected episodes of one validation pass; their trace ids (cached in ``traces.json``)."""
    marker = Path(pass_dir) / TRACES_FILE
    if marker.is_file():
        return list(json.loads(marker.read_text())["trace_ids"])
    import mlflow
    from mlflow import MlflowClient

    by_id = {e.episode_id: e for e in episodes}
    score_by_id = {s.episode_id: s for s in scores}
    client = MlflowClient(tracking_uri)
    pass_key = f"{mlflow_run_id}:{Path(pass_dir).parent.name}/{Path(pass_dir).name}"
    # None when unset: restoring MLflow's resolved default instead would pin it (and the
    # MLFLOW_TRACKING_URI it exports) to ./mlflow.db, where the pipeline then registered.
    previous = mlflow.get_tracking_uri() if mlflow.is_tracking_uri_set() else None
    # Trace ids from a generator of MLflow's own, not Python's ``random``, which a run seeds
    # (train.seed): two passes reached at the same state drew the same ids, and the later
    # pass's traces replaced the earlier one's. Read when the tracer is set up, so it is
    # set up again (the URI change alone does not when the URI is the same).
    os.environ.setdefault(ISOLATED_IDS_ENV, "true")
    mlflow.set_tracking_uri(tracking_uri)  # the fluent tracing API exports to the global URI
    mlflow.tracing.reset()
    try:
        logged = logged_pass_traces(client, experiment_id, pass_key)  # by an attempt that died
        trace_ids = [
            logged.get(episode_id) or _log_episode(
                mlflow, experiment_id, by_id[episode_id], score_by_id[episode_id],
                {PASS_TAG: pass_key, EPISODE_TAG: episode_id},
            )
            for episode_id in select_episodes(scores, selection) if episode_id in by_id
        ]
        mlflow.flush_trace_async_logging()
        if trace_ids:
            client.link_traces_to_run(trace_ids, mlflow_run_id)
    finally:
        mlflow.set_tracking_uri(previous)
        # Dropped now, while the process runs: MLflow's isolated generator, collected at
        # interpreter exit, prints a traceback ("Exception ignored in ... __del__").
        mlflow.tracing.reset()
    write_bytes_atomic(json.dumps({"trace_ids": trace_ids}).encode(), marker)
    return trace_ids


def logged_pass_traces(client: Any, experiment_id: str, pass_key: str) -> dict[str, str]:
    """Episode id -> trace id of the traces already in MLflow for the pass ``pass_key``."""
    found: dict[str, str] = {}
    token = None
    while True:
        page = client.search_traces(
            locations=[experiment_id], filter_string=f"tags.`{PASS_TAG}` = '{pass_key}'",
            include_spans=False, max_results=100, page_token=token,
        )
        for trace in page:
            found.setdefault(trace.info.tags[EPISODE_TAG], trace.info.trace_id)
        token = page.token
        if not token:
            return found


def _log_episode(
    mlflow: Any, experiment_id: str, episode: EpisodeRecord, score: ScoreRecord, tags: Mapping[str, str]
) -> str:
    from mlflow.entities import SpanType

    rollout = episode.rollout
    messages = list(rollout.messages)
    first_action = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    root = mlflow.start_span_no_context(
        f"episode {episode.episode_id}", span_type=SpanType.AGENT, experiment_id=experiment_id, tags=dict(tags),
        inputs={"task_id": episode.task_id, "messages": messages[:first_action]},
        attributes={
            "episode_id": episode.episode_id, "step": episode.step, "split": episode.split,
            "task_id": episode.task_id, "reward": score.reward, "final_reward": score.final_reward,
            "passed": score.passed, "ending": ending(episode), "turns": rollout.turns,
            "truncation_cause": str(rollout.truncation_cause or ""), "error": rollout.error or "",
            "policy_version": rollout.policy_version,
        },
    )
    try:
        _log_turns(mlflow, root, messages[first_action:])
    finally:
        root.end(outputs={"response": rollout.response_text})
    return str(root.trace_id)


def _log_turns(mlflow: Any, root: Any, messages: Sequence[Mapping[str, Any]]) -> None:
    """One LLM span per assistant message of ``messages`` (which starts at the first one)."""
    from mlflow.entities import SpanType

    actions = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not actions:  # the episode ended before its first action (a prompt that overflowed the context)
        return
    for turn, (start, end) in enumerate(zip(actions, [*actions[1:], len(messages)], strict=True), start=1):
        action, replies = messages[start], list(messages[start + 1 : end])
        before = [] if turn == 1 else list(messages[actions[turn - 2] + 1 : start])
        span = mlflow.start_span_no_context(f"turn {turn}", span_type=SpanType.LLM, parent_span=root,
                                            inputs={"new_messages": before})
        tool_messages = [m for m in replies if m["role"] == "tool"]
        for k, call in enumerate(action.get("tool_calls") or []):
            answer = next((m for m in tool_messages if m.get("tool_call_id") == call.get("id")),
                          tool_messages[k] if k < len(tool_messages) else None)
            function = call.get("function", {})
            tool = mlflow.start_span_no_context(f"tool {function.get('name', '?')}", span_type=SpanType.TOOL,
                                                parent_span=span, inputs={"arguments": function.get("arguments")})
            tool.end(outputs={"content": None if answer is None else answer.get("content")})
        span.end(outputs={"content": action.get("content"), "tool_calls": list(action.get("tool_calls") or [])})
