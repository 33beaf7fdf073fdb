"""One stored episode as a transcript a person can read (``rollflow show``).

The episode is found through the same read-only views as ``rollflow sql``, so what the
transcript shows is what a query would return: every message with its role, tool calls
as ``-> name(arguments)``, tool results under the tool's name, then how the episode
ended, the environment's own reward and metrics, and the score and advantage once the
scoring stage has run.

Simplified: token ids and logprobs are summarised as counts; query the ``actions``
column for the tokens themselves.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rollflow.storage.errors import NoDataError
from rollflow.storage.query import open_run_sql

_EPISODE_SQL = """
SELECT e.*, s.reward, s.final_reward, s.threshold, s.passed, s.advantage, s.group_mean,
       s.group_std, s.group_size, s.trained, s.overlong_penalty, s.scoring_error,
       s.components, s.episode_id IS NOT NULL AS scored
FROM episodes AS e
LEFT JOIN scores AS s USING (run_id, split, step, episode_id)
WHERE e.episode_id = $episode_id
"""


def _fetch_episode(run_dir: Path, episode_id: str) -> dict[str, Any]:
    con = open_run_sql(run_dir)
    try:
        result = con.execute(_EPISODE_SQL, {"episode_id": episode_id})
        names = [d[0] for d in result.description or []]
        rows = result.fetchall()
        if not rows:
            example = con.execute("SELECT min(episode_id) FROM episodes").fetchone()
            hint = f"; ids look like {example[0]!r}" if example and example[0] else "; it has no episodes"
            raise NoDataError(f"{run_dir}: no episode {episode_id!r}{hint}")
        return dict(zip(names, rows[0], strict=True))
    finally:
        con.close()


def _header(e: Mapping[str, Any]) -> list[str]:
    context, prompt = e["context_tokens"], e["prompt_tokens"]  # the final context, its unsampled part
    tokens = f"{context} tokens ({prompt} context + {context - prompt} sampled"
    if e["total_tokens"] != context:  # the chat template re-rendered the prompt
        tokens += f"; {e['completion_tokens']} sampled in all, {e['total_tokens']} processed"
    return [
        f"Episode {e['episode_id']}",
        f"run {e['run_id']} · step {e['step']} · {e['split']} · task {e['task_id']} · "
        f"group {e['group_id']}",
        f"policy version {e['policy_version']} · {e['turns']} turns · "
        f"{tokens}) · "
        f"{e['latency_s']:.2f} s · {_requests(e)}",
    ]


def _message_lines(message: Mapping[str, Any]) -> list[str]:
    role = message["role"]
    label = f"[{role} {message['name']}]" if message["name"] else f"[{role}]"
    if message["tool_call_id"]:
        label += f" (reply to {message['tool_call_id']})"
    lines = ["", label]
    if message["content"]:
        lines.extend(f"  {line}" for line in message["content"].splitlines())
    for call in message["tool_calls"] or []:
        lines.append(f"  -> {call['name']}({call['arguments']})  id={call['id']}")
    if message["extra_json"]:
        lines.append(f"  (other fields: {message['extra_json']})")
    return lines


def _requests(e: Mapping[str, Any]) -> str:
    """How many actions were sampled and how many requests were tried again."""
    actions, attempts = len(e["actions"] or ()), e["sampling_attempts"]
    retried = attempts - actions
    return f"{actions} actions, {retried} retried" if retried >= 0 else f"{attempts} sampling attempts"


def _ending(e: Mapping[str, Any]) -> str:
    if e["error"] is not None:
        return f"Ended: error ({e['error']})"
    if e["truncated"]:
        return f"Ended: truncated ({e['truncation_cause']})"
    ended = "Ended: terminated by the environment"
    actions = e["actions"] or ()
    if actions and actions[-1]["finish_reason"] == "length":  # the environment judged a cut reply
        ended += "; its last reply was cut off at [rollout].max_completion_tokens (finish_reason 'length')"
    return ended


def _format_map(values: Mapping[str, float] | None) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in (values or {}).items()) or "none"


def _score_lines(e: Mapping[str, Any]) -> list[str]:
    if not e["scored"]:
        return ["Score: not scored yet"]
    if e["scoring_error"] is not None:
        return [f"Score: scoring failed ({e['scoring_error']})"]
    verdict = "passed" if e["passed"] else "failed"
    threshold = "none" if e["threshold"] is None else f"{e['threshold']:g}"
    return [
        f"Reward: {e['reward']:g} -> final {e['final_reward']:g} "
        f"(overlong penalty {e['overlong_penalty']:g}, threshold {threshold}, {verdict})",
        f"Components: {_format_map(e['components'])}",
        f"Advantage: {e['advantage']:+.4f} (group mean {e['group_mean']:.4f}, "
        f"std {e['group_std']:.4f}, over {e['group_size']}; "
        f"{'trained' if e['trained'] else 'not trained'})",
    ]


def render_episode(run_dir: Path | str, episode_id: str) -> str:
    """A readable transcript of ``episode_id`` in the run at ``run_dir``."""
    e = _fetch_episode(Path(run_dir), episode_id)
    lines = _header(e)
    for message in e["messages"]:
        lines.extend(_message_lines(message))
    lines.append("")
    lines.append(_ending(e))
    env_reward = "none" if e["env_reward"] is None else f"{e['env_reward']:g}"
    lines.append(f"Environment reward: {env_reward}; metrics: {_format_map(e['env_metrics'])}")
    steps = json.loads(e["step_metadata"])
    if steps:
        lines.append(f"Step metadata: {json.dumps(steps, ensure_ascii=False)}")
    lines.extend(_score_lines(e))
    return "\n".join(lines) + "\n"
