"""The GRPO training flow: per step, rollout (or admit) -> scoring -> flatten -> [teacher] -> train -> metrics.

The teacher stage (``tasks/teacher.py``) runs only where ``[train]`` names a teacher:
on-policy distillation (``objective = "opd"``), or a GRPO run measuring its distance to one.

The flow body only orchestrates: each stage is a plain function in ``tasks/`` taking
``(config, run_dir, step)`` and returning the path of the file it wrote, wrapped here in a
thin Prefect task so each shows up as a named task run ("rollout step 3", ...).

Resume is the same call again on the same run folder. A stage whose output file exists
is finished and is skipped by the stage itself (the file, not Prefect's database, is the
record of what is done, so a resume works with a fresh Prefect server); a half-written
temporary left by a crash is discarded before anything runs; training continues from the
newest committed checkpoint with its optimizer and RNG state.

Each stage's wall time is recorded in the step folder when the stage really runs
(``tasks/metrics.py``'s ``run_timed``), so a resumed step logs what its skipped stages
took before the crash, not the instant they took to skip.

Validation runs before every ``validation_interval``-th step (step 0 gives the baseline)
and once more after the last step, on the validation tasks, without training on them.

Lockstep is the default: a step's rollouts finish before its training starts. With
``[rollout].max_steps_off_policy`` set, ``run_async_training`` runs instead: rollout
workers (``tasks/collect.py``) play groups on the vLLM generator beside the trainer and
write each finished group to a file; each step's first stage is then "admit" (take
``batch_size`` finished groups, drop stale ones, write the step's episodes) instead of
"rollout", the rest of the step is the same, and the new version is published after the
train stage (inline or on a thread, ``weight_sync_type``). Its resume also comes from the
files: the admissions already written and the groups already collected.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from rollflow.flows.concurrency import one_training_at_a_time
from rollflow.flows.runs import RunHandle, open_run
from rollflow.envs.agent import Policy
from rollflow.tasks.async_generator import open_generator
from rollflow.tasks.collect import Publisher, RolloutWorkers, admit_stage, write_collector_report
from rollflow.tasks.config import RunConfig
from rollflow.tasks.flatten import flatten_stage
from rollflow.tasks.metrics import (
    finish_tracking,
    metrics_stage,
    recorded_stage_seconds,
    run_timed,
    start_tracking,
    step_outcome,
    validation_metrics_stage,
)
from rollflow.tasks.policy_io import ActingPolicy
from rollflow.tasks.rollout import rollout_stage
from rollflow.tasks.scoring import score_stage
from rollflow.tasks.teacher import check_teacher, teacher_stage
from rollflow.tasks.train import train_stage

# The files are the cache: Prefect must neither hash configs nor persist results.
_STAGE = dict(cache_policy=NO_CACHE, persist_result=False)


@task(name="rollout", task_run_name="rollout step {step} ({split})", **_STAGE)
def rollout(
    config: RunConfig, run_dir: Path, step: int, split: str = "train", policy: Policy | ActingPolicy | None = None
) -> Path:
    return rollout_stage(config, run_dir, step, split, policy)


@task(name="admit", task_run_name="admit step {step}", **_STAGE)
def admit(config: RunConfig, run_dir: Path, step: int, workers: RolloutWorkers) -> Path:
    return admit_stage(config, run_dir, step, workers)


@task(name="scoring", task_run_name="scoring step {step} ({split})", **_STAGE)
def scoring(config: RunConfig, run_dir: Path, step: int, split: str = "train") -> Path:
    return score_stage(config, run_dir, step, split)


@task(name="flatten", task_run_name="flatten step {step}", **_STAGE)
def flatten(config: RunConfig, run_dir: Path, step: int) -> Path:
    return flatten_stage(config, run_dir, step)


@task(name="teacher", task_run_name="teacher step {step}", **_STAGE)
def teacher(config: RunConfig, run_dir: Path, step: int) -> Path:
    return teacher_stage(config, run_dir, step)


@task(name="train", task_run_name="train step {step}", **_STAGE)
def train(config: RunConfig, run_dir: Path, step: int) -> Path:
    return train_stage(config, run_dir, step)


@task(name="metrics", task_run_name="metrics step {step}", **_STAGE)
def metrics(config: RunConfig, run_dir: Path, step: int) -> Path:
    return metrics_stage(config, run_dir, step)


@task(name="validation-metrics", task_run_name="validation metrics step {step}", **_STAGE)
def validation_metrics(config: RunConfig, run_dir: Path, step: int) -> Path:
    return validation_metrics_stage(config, run_dir, step)


def validate(config: RunConfig, run_dir: Path, step: int, policy: Policy | ActingPolicy | None = None) -> None:
    """Validation before ``step`` (an async run's policy comes watched: ``pinned_for_validation``)."""
    rollout(config, run_dir, step, "validation", policy)
    scoring(config, run_dir, step, "validation")
    validation_metrics(config, run_dir, step)


def validation_due(config: RunConfig, step: int) -> bool:
    interval = config.validation.validation_interval
    return interval > 0 and (step % interval == 0 or step == config.train.num_steps)


@flow(name="rollflow-train")
def train_flow(config_path: str | None = None, run_dir: str | None = None) -> str:
    """Train (or resume) one run; returns its run folder.

    ``config_path`` alone starts a new run under ``[storage].runs_dir``; ``run_dir`` alone
    resumes that run with its frozen config; both start a new run in ``run_dir`` (or resume
    it, when it already holds the same config).
    """
    handle = open_run(config_path, run_dir)  # holds the run folder's lock until closed
    try:
        handle.report(f"run folder {handle.root}")
        start_tracking(handle.config, handle.root)
        try:
            with one_training_at_a_time(f"train {handle.root.name}"):
                run_training(handle)
        except BaseException:
            try:  # mark the MLflow run FAILED, but never hide why the run failed
                finish_tracking(handle.config, handle.root, succeeded=False)
            except Exception as tracking_error:  # noqa: BLE001 - reported, the original propagates
                handle.report(f"could not close the MLflow run: {tracking_error}")
            raise
        finish_tracking(handle.config, handle.root, succeeded=True)
        return str(handle.root)
    finally:
        handle.close()


def step_stages(config: RunConfig) -> tuple[tuple[str, Callable[..., Path]], ...]:
    """A training step's stages in order; the teacher's only where one is configured (OPD)."""
    scored = (("teacher", teacher),) if config.train.has_teacher else ()
    return (("rollout", rollout), ("scoring", scoring), ("flatten", flatten), *scored, ("train", train))


def run_training(handle: RunHandle) -> None:
    check_teacher(handle.config)  # a teacher with another tokenizer is refused before any rollout
    if handle.config.rollout.max_steps_off_policy is not None:
        run_async_training(handle)
    else:
        run_lockstep_training(handle)


def run_lockstep_training(handle: RunHandle) -> None:
    config, root = handle.config, handle.root
    for step in range(config.train.num_steps):
        if handle.step_finished(step):
            continue
        if validation_due(config, step):
            validate(config, root, step)
        for name, stage in step_stages(config):
            run_timed(handle.folder, step, name, partial(stage, config, root, step))
        metrics(config, root, step)
        seconds = recorded_stage_seconds(handle.folder, step)
        handle.report(
            f"step {step + 1}/{config.train.num_steps} done in {sum(seconds.values()):.1f}s: "
            f"{step_outcome(handle.folder, step)} ("
            + " ".join(f"{k}={v:.1f}s" for k, v in seconds.items()) + ")"
        )
    if validation_due(config, config.train.num_steps):
        validate(config, root, config.train.num_steps)


def run_async_training(handle: RunHandle) -> None:
    """Rollout workers collect groups beside the trainer; each step admits, scores,
    flattens, trains and publishes (``tasks/collect.py`` has the rules)."""
    config, root, folder = handle.config, handle.root, handle.folder
    first = next((s for s in range(config.train.num_steps) if not handle.step_finished(s)), config.train.num_steps)
    if first == config.train.num_steps:  # trained: at most the last validation is left
        if validation_due(config, first):
            validate(config, root, first)  # its stages skip what is done; no workers needed
        return
    started = time.perf_counter()
    with open_generator(config, folder, first) as generator:
        workers = RolloutWorkers(config, folder, generator, first).start()
        publisher = Publisher(generator, deferred=config.rollout.weight_sync_type != "synchronous")
        try:
            for step in range(first, config.train.num_steps):
                if validation_due(config, step):
                    publisher.join()
                    validate(config, root, step, generator.pinned_for_validation(step))
                run_timed(folder, step, "rollout", partial(admit, config, root, step, workers))
                for name, stage in step_stages(config)[1:]:
                    run_timed(folder, step, name, partial(stage, config, root, step))
                publisher.publish(step + 1, folder.checkpoint_dir(step))
                metrics(config, root, step)
                handle.report(f"step {step + 1}/{config.train.num_steps} done (async): {step_outcome(folder, step)}")
            publisher.join()
            if validation_due(config, config.train.num_steps):
                validate(config, root, config.train.num_steps, generator.pinned_for_validation(config.train.num_steps))
        finally:
            workers.stop()
            publisher.join(quiet=True)
            write_collector_report(folder, workers, generator, time.perf_counter() - started)
