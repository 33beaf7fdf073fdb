"""The evaluation flow: play the validation tasks with any policy, score them, report.

``eval_flow`` scores a model without training it: the local model (a Hugging Face
folder, a GGUF file, the bundled SmolLM2, optionally with a LoRA adapter) or a model
behind an OpenAI-compatible server (a vLLM server, a hosted model). It is a training
run's validation pass on its own: the same rollout and scoring stages with
``split="validation"``, writing the same Parquet tables into a run folder
(``validation/step=000000/episodes``, ``scores.parquet``, ``metrics.json``), so
``rollflow sql`` and ``rollflow show`` work on it and its numbers are comparable with a
training run's ``val/`` curves.

The report's numbers come from ``rollflow.storage.step_metrics.step_metrics``, the very SQL the training
flow logs; the worst episodes (errored first, then by final reward) are listed by id for
``rollflow show``.
pass@k (k up to the episodes per task) and avg@k come from the ``pass_at_k`` view
(``storage/pass_at_k.py``), so any run's step reads the same way in ``rollflow sql``; the
report names the environment, and the library and dataset or game for the adapters
(``describe_environment``).

Command-line overrides (``EvalOverrides``, ``flows/eval_config.py``) are applied to the
config before the run folder freezes it, so ``config.toml`` says exactly what was
evaluated, and the result is checked (``ops.preflight.preflight_eval``) before the run
folder is made: a missing model or a wrong environment is one line, with no empty folder.

Simplified, and why:
- One pass over the validation tasks (``[validation].num_tasks`` or ``--tasks``),
  ``[validation].episodes_per_task`` episodes each (1 by default), sampled at
  ``[rollout].temperature`` like training's validation: the numbers then mean the same
  thing as ``val/`` in a training run. (Greedy decoding is not offered:
  ``[rollout].temperature`` must be > 0 because training samples with it.)
- ``--env`` names another environment with no keyword arguments unless it is the
  config's own environment (whose ``[env.kwargs]`` are kept): arguments of one
  environment rarely fit another.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from prefect import flow, get_run_logger

from rollflow.config.run import RunConfig
from rollflow.flows.concurrency import one_training_at_a_time
from rollflow.flows.eval_config import EvalOverrides, checked_eval_config
from rollflow.flows.runs import freeze_config
from rollflow.flows.step import validate
from rollflow.generators.run_generator import open_generator
from rollflow.policy.stopping import raise_if_stop_requested
from rollflow.storage.pass_at_k import env_pass_at_k, overall_pass_at_k
from rollflow.storage.query import open_run_sql
from rollflow.storage.stage_outputs import finished_output
from rollflow.storage.step_metrics import env_metrics, step_metrics
from rollflow.storage.runfolder import RunFolder
from rollflow.storage.runs import mark_run_kind
from rollflow.tasks.tracking import finish_tracking, start_tracking

__all__ = ["eval_flow", "eval_report", "eval_run_dir", "format_report", "open_eval_run"]

EVAL_STEP = 0  # an evaluation is one validation pass, stored as step 0
WORST_EPISODES = 5

_WORST_SQL = """
SELECT e.episode_id, e.task_id, s.final_reward,
       CASE WHEN e.error IS NOT NULL THEN 'error'
            WHEN s.scoring_error IS NOT NULL THEN 'scoring error'
            WHEN e.terminated THEN 'terminated'
            ELSE e.truncation_cause END AS ending,
       e.turns, e.context_tokens
FROM episodes AS e
JOIN scores AS s USING (run_id, split, step, episode_id)
WHERE e.split = 'validation' AND e.step = $step
ORDER BY (e.error IS NOT NULL OR s.scoring_error IS NOT NULL) DESC, s.final_reward, e.episode_id
LIMIT $limit
"""


def eval_run_dir(config: RunConfig, config_path: str | None, run_dir: str | Path | None) -> Path:
    """``run_dir``, else a new ``<runs_dir>/eval-<config name>-<time>`` (``eval-<time>``
    without a config): ``rollflow eval`` knows the folder before the flow runs, for its log."""
    if run_dir is not None:
        return Path(run_dir)
    name = f"eval-{Path(config_path).stem}" if config_path is not None else "eval"
    return Path(config.storage.runs_dir) / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def open_eval_run(config: RunConfig, run_dir: str | Path | None, name: str = "eval") -> RunFolder:
    """A fresh run folder under ``[storage].runs_dir`` (or ``run_dir``) with the config frozen.

    Giving the folder of an unfinished evaluation with the same config resumes it.
    """
    stamp = time.strftime("%Y%m%d-%H%M%S")
    root = Path(run_dir) if run_dir is not None else Path(config.storage.runs_dir) / f"{name}-{stamp}"
    folder = RunFolder(root)
    freeze_config(folder, config)
    mark_run_kind(folder.root, "eval")
    folder.discard_temporaries()
    return folder


@flow(name="rollflow-eval")
def eval_flow(
    config_path: str | None = None,
    run_dir: str | None = None,
    env: str | None = None,
    model: str | None = None,
    adapter: str | None = None,
    base_url: str | None = None,
    api_model: str | None = None,
    num_tasks: int | None = None,
    log_report: bool = True,
    tools_in_system_prompt: bool = False,
) -> str:
    """Evaluate one policy on the validation tasks; returns the run folder.

    Without ``config_path`` the defaults are evaluated: the bundled SmolLM2 on the bundled
    tool-use game. ``log_report`` logs the report (a deployment's log shows it); ``rollflow
    eval`` turns it off and prints the report to stdout instead, once. The other arguments
    are ``EvalOverrides``.
    """
    overrides = EvalOverrides(env, model, adapter, base_url, api_model, num_tasks, tools_in_system_prompt)
    config = checked_eval_config(config_path, overrides)  # before the run folder is made
    folder = open_eval_run(config, eval_run_dir(config, config_path, run_dir))
    start_tracking(config, folder.root)
    succeeded = False
    try:
        evaluated = finished_output(folder.step_paths(EVAL_STEP, "validation").metrics_json) is not None
        if not evaluated:  # else what is done is not run again, and no generator (server) opened
            with one_training_at_a_time(f"eval {folder.root.name}"), open_generator(
                config, folder, versions_in_flight=1
            ) as generator:
                validate(config, folder.root, EVAL_STEP, generator)
        succeeded = True
    finally:
        finish_tracking(config, folder.root, succeeded)
    if log_report:
        get_run_logger().info("\n%s", format_report(eval_report(folder.root), describe_policy(config)))
    return str(folder.root)


# ---------------------------------------------------------------- the report


@dataclass(frozen=True)
class WorstEpisode:
    episode_id: str
    task_id: str
    final_reward: float
    ending: str
    turns: int
    tokens: int


@dataclass(frozen=True)
class EvalReport:
    run_dir: Path
    metrics: Mapping[str, float]  # storage.step_metrics.METRIC_NAMES
    worst: tuple[WorstEpisode, ...]
    pass_at_k: tuple[Mapping[str, float], ...] = ()  # storage.pass_at_k.overall_pass_at_k, by k
    environment: str | None = None  # describe_environment of the frozen config
    # a mixture's members: label -> (storage.step_metrics.env_metrics' figures, pass@k by k)
    by_env: Mapping[str, tuple[Mapping[str, float], tuple[Mapping[str, float], ...]]] = field(default_factory=dict)


def eval_report(run_dir: str | Path, worst: int = WORST_EPISODES) -> EvalReport:
    """The evaluation's metrics (training's SQL) and its ``worst`` lowest-scored episodes."""
    con = open_run_sql(run_dir)
    try:
        metrics = step_metrics(con, step=EVAL_STEP, split="validation")
        rows = con.execute(_WORST_SQL, {"step": EVAL_STEP, "limit": worst}).fetchall()
        by_k = tuple(overall_pass_at_k(con, "validation", EVAL_STEP))
        by_env = {label: (figures, tuple(env_pass_at_k(con, "validation", EVAL_STEP, label)))
                  for label, figures in env_metrics(con, EVAL_STEP, "validation").items()}  # fmt: skip
    finally:
        con.close()
    # Outside a stage nothing turns a Ctrl-C that DuckDB ate into the stop (stops_through),
    # and a caller's `except Exception` would swallow its "Query interrupted".
    raise_if_stop_requested()
    episodes = tuple(
        WorstEpisode(str(e), str(t), float(r), str(ending), int(turns), int(tokens or 0))
        for e, t, r, ending, turns, tokens in rows
    )
    by_env = by_env if len(by_env) > 1 else {}  # one environment: the totals are its figures
    return EvalReport(Path(run_dir), metrics, episodes, by_k, _frozen_environment(Path(run_dir)), by_env)


# The adapters of other libraries' environments, and the keyword naming what they play.
_LIBRARIES = {
    "rollflow.envs.reasoning_gym": ("reasoning-gym dataset", "dataset"),
    "rollflow.envs.textarena": ("TextArena game", "game"),
    "rollflow.envs.verifiers": ("verifiers environment", "env_id"),
}


def describe_environment(name: str, kwargs: Mapping[str, object]) -> str:
    """``[env].name``, with the library and what it plays when it is one of the adapters."""
    library = _LIBRARIES.get(name.split(":", 1)[0])
    if library is None or library[1] not in kwargs:
        return name
    return f"{library[0]} {kwargs[library[1]]} ({name})"


def _frozen_environment(run_dir: Path) -> str | None:
    from rollflow.config.run import load_config

    try:
        config = load_config(RunFolder(run_dir).config_path)
    except Exception:  # an unreadable config must not hide the numbers
        return None
    return describe_environment(config.env.name, config.env.kwargs)


def describe_policy(config: RunConfig) -> str:
    if config.rollout.backend == "openai":
        return f"{config.rollout.api_model} at {config.rollout.base_url}"
    model = config.model
    if model.path is None and model.gguf_file is None:
        text = "bundled SmolLM2-135M-Instruct"
    else:
        text = str(Path(model.path or "") / (model.gguf_file or ""))
    return text + (f" + adapter {model.adapter}" if model.adapter else "")


def _number(value: float, digits: int = 3) -> str:
    return "n/a" if math.isnan(value) else f"{value:.{digits}f}"


def format_report(report: EvalReport, policy: str | None = None) -> str:
    m = report.metrics
    lines = [
        f"evaluation {report.run_dir}",
        *([f"  policy        {policy}"] if policy else []),
        *([f"  environment   {report.environment}"] if report.environment else []),
        f"  episodes      {int(m['num_episodes'])} (validation tasks x [validation].episodes_per_task)",
        f"  pass rate     {_number(m['pass_rate'])}",
        f"  reward        mean {_number(m['reward_mean'])}  std {_number(m['reward_std'])}  "
        f"min {_number(m['reward_min'])}  max {_number(m['reward_max'])}",
        f"  ended         terminated {_number(m['terminated_ratio'])}  truncated {_number(m['truncated_ratio'])}  "
        f"errors {_number(m['error_ratio'])}",
        f"  truncations   max_turns {_number(m['max_turns_ratio'])}  context_overflow "
        f"{_number(m['context_overflow_ratio'])}  parse_failure {_number(m['parse_failure_ratio'])}  "
        f"env {_number(m['env_truncated_ratio'])}",
        f"  per episode   turns {_number(m['turns_mean'], 2)}  tokens {_number(m['tokens_mean'], 1)}",
    ]
    lines.extend(_pass_at_k_lines(report))
    for label, (figures, by_k) in report.by_env.items():
        at_k = "  ".join(f"@{int(r['k'])} {_number(r['pass_at_k'])}" for r in by_k)
        lines.append(
            f"  env {label}: pass rate {_number(figures['pass'])}  reward {_number(figures['reward'])}  "
            f"episodes {int(figures['episodes'])}" + (f"  pass@k {at_k}" if at_k else "")
        )
    if report.worst:
        lines.append(f"  worst episodes (rollflow show {report.run_dir} EPISODE_ID):")
        width = max(len(w.episode_id) for w in report.worst)
        for w in report.worst:
            lines.append(
                f"    {w.episode_id.ljust(width)}  reward {w.final_reward:+.3f}  {w.ending:<16}  "
                f"turns {w.turns}  tokens {w.tokens}  task {w.task_id}"
            )
    return "\n".join(lines) + "\n"


def _pass_at_k_lines(report: EvalReport) -> list[str]:
    """pass@k for each k up to the episodes per task (tasks with fewer are left out of a k),
    and avg@k, the mean pass rate per task: one value for every k."""
    if not report.pass_at_k:
        return []
    figures = "  ".join(f"@{int(r['k'])} {_number(r['pass_at_k'])}" for r in report.pass_at_k)
    first = report.pass_at_k[0]
    return [
        f"  pass@k        {figures}  (tasks {int(first['tasks'])}; unbiased, from the episodes per task)",
        f"  avg@k         {_number(first['avg_at_k'])}  (mean pass rate per task, any k; per task: "
        f"rollflow sql {report.run_dir} \"SELECT * FROM task_pass_at_k\")",
    ]
