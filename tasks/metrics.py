"""Metrics stage: one dict of slash-namespaced numbers per step, logged once to MLflow
(``tasks/tracking.py``).

The episode and reward numbers are the DuckDB queries of ``storage/query.py`` over the
step's Parquet files (one definition each, shared with ``rollflow sql`` users); the
optimisation numbers come from the step's ``train.json``; stage wall times from the
step's ``stage_seconds.json``. The dict is written to ``metrics.json`` in the step folder
last of all, after MLflow has it: that file existing is what marks a step finished. A
replay after a crash logs no duplicate point (``RunTracker.log_step`` skips steps already
logged).

Stage times are recorded in the run folder as each stage finishes (``flows/step.py``'s
``run_stage``), not measured around the calls of the run that logs them: a resumed step's
stages that had already finished are not run again, and their ``time/...`` must be what
they took when they really ran, not ~0 s. Simplified: a crash between a stage's output landing and its time
being recorded leaves that stage without a figure; its ``time/<stage>`` and ``time/step``
are then left out rather than logged as a false number. A sharded rollout resumed from
its finished parts records the time of the call that finished it, not of the parts an
earlier process wrote.

Validation passes get the same episode and reward numbers under ``val/``, and the text
of their best and worst episodes as an artifact.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path

from rollflow.config.run import RunConfig
from rollflow.storage.async_groups import async_step_metrics
from rollflow.storage.parquet import write_bytes_atomic
from rollflow.storage.query import open_run_sql, run_query
from rollflow.storage.records import TrainResult
from rollflow.storage.runfolder import OPTIONAL_TIMED_STAGES, TIMED_STAGES, RunFolder, StepPaths
from rollflow.storage.step_metrics import env_metrics, step_metrics, task_passes, teacher_metrics
from rollflow.storage.transcript import render_episode
from rollflow.tasks.schedule import rollout_plan_path
from rollflow.tasks.step_health import step_hint, step_summary, validation_summary
from rollflow.tasks.tracking import log_step, log_traces

TRANSCRIPTS_TXT = "transcripts.txt"
SAMPLE_TRANSCRIPTS = 2  # best and worst validation episodes each logged as text

# query name -> logged key
_EPISODE_KEYS = {
    "terminated_ratio": "episodes/terminated_ratio",
    "truncated_ratio": "episodes/truncated_ratio",
    "context_overflow_ratio": "episodes/context_overflow_ratio",
    "max_turns_ratio": "episodes/max_turns_ratio",
    "env_truncated_ratio": "episodes/env_truncated_ratio",
    "parse_failure_ratio": "episodes/parse_failure_ratio",
    "error_ratio": "episodes/error_ratio",
    "turns_mean": "episodes/turns_mean",
    "tokens_mean": "episodes/tokens_mean",
    "num_episodes": "episodes/count",
    "num_groups": "episodes/groups",
    "tool_calls": "tools/calls",
    "tool_errors": "tools/errors",
    "reward_mean": "reward/mean",
    "reward_std": "reward/std",
    "reward_min": "reward/min",
    "reward_max": "reward/max",
    "pass_rate": "reward/pass_rate",
    "zero_variance_skip_ratio": "reward/zero_variance_skip_ratio",
}


def rollout_metrics(run_dir: Path, step: int, split: str) -> dict[str, float]:
    """The step's episode and reward metrics, under their logged names; a mixture's step
    also ``env/<label>/reward``, ``.../pass``, ``.../zero_variance`` and ``.../episodes``
    per environment (one environment: the totals say it all, so none); an agent
    environment's step also ``agent/calls`` and ``agent/resets`` (calls that did not continue
    the episode's sample: the agent rewrote its history, a new sample began)."""
    con = open_run_sql([run_dir])
    try:
        raw = step_metrics(con, step=step, split=split)
        by_env = env_metrics(con, step, split)
        _, agent = run_query(  # an agent environment's calls and history rewrites, as its endpoint
            con,  # records them in each episode's env_metrics (envs/openai_agent_endpoint.py)
            "SELECT sum(env_metrics['agent_calls']), sum(env_metrics['agent_resets']) FROM episodes "
            f"WHERE split = '{split}' AND step = {int(step)}",
        )
        _, rows = run_query(  # left out of the baseline: the rollout or its scorer raised
            con,
            "SELECT count_if(scoring_error IS NOT NULL) / count(*) FROM scores "
            f"WHERE split = '{split}' AND step = {int(step)}",
        )
    finally:
        con.close()
    metrics = {_EPISODE_KEYS[name]: value for name, value in raw.items()}
    metrics["episodes/failed_ratio"] = float(rows[0][0]) if rows and rows[0][0] is not None else 0.0
    if agent and agent[0][0] is not None:
        metrics["agent/calls"], metrics["agent/resets"] = float(agent[0][0]), float(agent[0][1] or 0.0)
    if len(by_env) > 1:  # a mixture's step: each environment's own figures beside the totals
        for label, values in by_env.items():
            metrics.update({f"env/{label}/{name}": value for name, value in values.items()})
    metrics.update(rollout_plan_metrics(RunFolder(run_dir), step, split))
    return metrics


def rollout_plan_metrics(folder: RunFolder, step: int, split: str) -> dict[str, float]:
    """What the step's ``rollout_plan.json`` says (``{}`` for a step written without one):

    - ``rollout/backfill_groups``, ``rollout/backfill_rounds``: the groups the backfill
      added after the first ``batch_size``, and the rounds it took (with backfill on);
    - ``curriculum/...``: the curriculum's weights (``tasks/curriculum.py``'s summary);
    - ``reward/pass_rate/difficulty_<label>``: the pass rate of the step's tasks of each
      difficulty label their metadata carries (the bundled game's: facts to look up),
      over all their episodes, as ``reward/pass_rate``.
    """
    path = rollout_plan_path(folder, step, split)
    if not path.exists():
        return {}
    plan = folder.read_json(path)
    metrics: dict[str, float] = {}
    if "backfill" in plan:
        metrics["rollout/backfill_groups"] = float(plan["backfill"]["groups"])
        metrics["rollout/backfill_rounds"] = float(plan["backfill"]["rounds"])
    metrics.update({key: float(value) for key, value in plan.get("curriculum", {}).items()})
    labels: dict[str, str] = plan.get("difficulty", {})
    if labels:
        con = open_run_sql([folder.root])
        try:
            passes = task_passes(con, step, split)
        finally:
            con.close()
        by_label: dict[str, list[int]] = {}
        for task_id, (passed, episodes) in passes.items():
            if task_id in labels:
                counts = by_label.setdefault(re.sub(r"[^\w.\- ]", "_", labels[task_id]), [0, 0])
                counts[0] += passed
                counts[1] += episodes
        metrics.update({f"reward/pass_rate/difficulty_{label}": p / n for label, (p, n) in sorted(by_label.items()) if n})
    return metrics


def teacher_step_metrics(run_dir: Path, step: int) -> dict[str, float]:
    """``opd/teacher_kl`` where the step has a teacher table (``{}`` otherwise)."""
    con = open_run_sql([run_dir])
    try:
        return teacher_metrics(con, step)
    finally:
        con.close()


def optim_metrics(result: TrainResult) -> dict[str, float]:
    metrics = {
        "optim/loss": result.loss,
        "optim/clip_fraction": result.clip_fraction,
        "optim/grad_norm": result.grad_norm,
        "optim/learning_rate": result.learning_rate,
        "optim/samples": float(result.num_samples),
        "optim/tokens": float(result.num_tokens),
        "optim/action_tokens": float(result.num_action_tokens),
        "optim/tokens_per_s": result.tokens_per_s,
        "policy/version": float(result.policy_version),
    }
    if result.kl is not None:
        metrics["optim/kl"] = result.kl
    off_policy = {  # the mismatch: lockstep runs have one too (bfloat16 forwards, a vLLM sampler)
        "policy/mismatch_kl": result.mismatch_kl,
        "offpolicy/is_weight_mean": result.is_weight_mean,
        "offpolicy/corrected_fraction": result.corrected_fraction,
    }
    metrics.update({key: value for key, value in off_policy.items() if value is not None})
    metrics.update({f"time/train_{phase}": seconds for phase, seconds in result.timings.items()})
    return metrics


def time_metrics(folder: RunFolder, step: int) -> dict[str, float]:
    """``time/<stage>`` per recorded stage, and ``time/step`` once every stage has a figure."""
    seconds = folder.stage_seconds(step)
    metrics = {f"time/{stage}": value for stage, value in seconds.items()}
    if set(TIMED_STAGES) <= set(seconds):
        metrics["time/step"] = sum(seconds[s] for s in TIMED_STAGES + OPTIONAL_TIMED_STAGES if s in seconds)
    return metrics


def metrics_stage(config: RunConfig, folder: RunFolder, p: StepPaths, out: Path) -> Path:
    """Gather, log and write training step ``p.step``'s metrics into ``out`` (its
    ``metrics.json``); returns ``out``.

    Reads the step's episodes, scores and teacher scores through ``folder``'s SQL views
    (``rollflow sql``'s, which span the run), its ``p.train_json``, its stage times and an
    async step's admission; logs to the run's MLflow run (``tasks/tracking.py``)."""
    metrics = rollout_metrics(folder.root, p.step, "train")
    metrics.update(teacher_step_metrics(folder.root, p.step))
    metrics.update(optim_metrics(folder.read_train_json(p.train_json)))
    metrics.update(time_metrics(folder, p.step))
    metrics.update(async_step_metrics(folder, p.step))
    log_step(config, folder, p.step, metrics)
    return folder.write_json_atomic(out, _json_safe(metrics))


def step_outcome(folder: RunFolder, step: int) -> str:
    """The step line's numbers (``tasks/step_health.py``'s ``step_summary``) from its ``metrics.json``."""
    return step_summary(folder.read_json(folder.step_paths(step).metrics_json))


def step_advice(folder: RunFolder, step: int) -> str | None:
    """What to try when the step had nothing to learn from (``step_hint``); None otherwise."""
    return step_hint(folder.read_json(folder.step_paths(step).metrics_json))


def validation_outcome(folder: RunFolder, step: int) -> str:
    """The validation line's numbers (``validation_summary``) from the pass's ``metrics.json``."""
    return validation_summary(folder.read_json(folder.step_paths(step, "validation").metrics_json))


def validation_metrics_stage(config: RunConfig, folder: RunFolder, p: StepPaths, out: Path) -> Path:
    """Log the validation pass ``p`` (its episodes and scores, through ``folder``'s SQL
    views), a few of its transcripts (best and worst) as text and as MLflow traces
    (``storage/traces.py``); writes the numbers into ``out`` (its ``metrics.json``) and
    returns it."""
    metrics = {f"val/{key}": value for key, value in rollout_metrics(folder.root, p.step, p.split).items()}
    transcripts = write_sample_transcripts(folder, p.step)
    log_step(config, folder, p.step, metrics, artifacts=[transcripts])
    log_traces(config, folder, p.step)
    return folder.write_json_atomic(out, _json_safe(metrics))


def write_sample_transcripts(folder: RunFolder, step: int, count: int = SAMPLE_TRANSCRIPTS) -> Path:
    """The ``count`` best- and worst-rewarded validation episodes of ``step``, as text."""
    con = open_run_sql([folder.root])
    try:
        _, rows = run_query(
            con,
            f"SELECT episode_id, final_reward FROM scores WHERE split = 'validation' AND step = {int(step)} "
            "ORDER BY final_reward DESC, episode_id",
        )
    finally:
        con.close()
    chosen = list(dict.fromkeys([r[0] for r in rows[:count]] + [r[0] for r in rows[-count:]]))
    text = "\n\n".join(render_episode(folder.root, episode_id) for episode_id in chosen)
    path = folder.step_dir(step, "validation") / TRANSCRIPTS_TXT
    write_bytes_atomic(text.encode(), path)
    return path


def _json_safe(metrics: Mapping[str, float]) -> dict[str, float | None]:
    return {key: (value if math.isfinite(value) else None) for key, value in sorted(metrics.items())}
