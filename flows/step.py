"""One GRPO training step, as both schedules run it: episodes -> scores -> samples -> [teacher] -> train -> metrics.

``grpo_step`` reads top to bottom: each stage is handed the paths it reads (the outputs of
the stages before it) and the path it writes (from the run folder's ``StepPaths``), and
returns that path for the next. Where the step's episodes come from is the schedule's
choice (``episodes_from``): lockstep plays them (``rollout``), async admits groups that
rollout workers already played (``admit``, ``tasks/collect.py``).

A stage whose output is already finished is not run again (``run_stage``): the file, not
Prefect's database, is the record of what is done, so a resume works with a fresh Prefect
server. A stage that really runs has its wall seconds recorded in the step folder's
``stage_seconds.json``, so a resumed step logs what its finished stages took before the
crash, not the instant a skip takes.

Each stage runs as a thin Prefect task named for its step ("rollout step 3 (train)");
the live objects a task is handed (a policy, the rollout workers) are wrapped in
``quote`` so that Prefect does not walk them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Protocol

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.utilities.annotations import quote

from rollflow.config.run import RunConfig
from rollflow.envs.agent import Policy
from rollflow.flows.runs import RunHandle
from rollflow.generators.generator import Generator
from rollflow.generators.policy_io import ActingPolicy
from rollflow.storage.runfolder import RunFolder, StepPaths, check_timed_stage
from rollflow.storage.stage_outputs import finished_output
from rollflow.tasks.collect import RolloutWorkers, admit_stage
from rollflow.tasks.flatten import flatten_stage
from rollflow.tasks.metrics import metrics_stage, validation_metrics_stage
from rollflow.tasks.rollout import ChunkFanOut, rollout_stage
from rollflow.tasks.scoring import score_stage
from rollflow.tasks.step_health import StepFailedError, discard_episodes
from rollflow.tasks.teacher import teacher_stage
from rollflow.tasks.train import train_stage

# The files are the cache: Prefect must neither hash configs nor persist results.
_STAGE = dict(cache_policy=NO_CACHE, persist_result=False)


@task(name="rollout", task_run_name="rollout step {step} ({split})", **_STAGE)
def rollout(
    config: RunConfig, out: Path, step: int, split: str = "train",
    source: Generator | Policy | ActingPolicy | None = None, fan_out: ChunkFanOut | None = None,
) -> Path:
    return rollout_stage(config, out, step, split, source, fan_out)


@task(name="admit", task_run_name="admit step {step}", **_STAGE)
def admit(config: RunConfig, workers: RolloutWorkers, step: int, out: Path) -> Path:
    return admit_stage(config, workers, step, out)


@task(name="scoring", task_run_name="scoring step {step} ({split})", **_STAGE)
def scoring(config: RunConfig, episodes: Path, out: Path, step: int, split: str = "train") -> Path:
    return score_stage(config, episodes, out)


@task(name="flatten", task_run_name="flatten step {step}", **_STAGE)
def flatten(episodes: Path, scores: Path, out: Path, step: int) -> Path:
    return flatten_stage(episodes, scores, out)


@task(name="teacher", task_run_name="teacher step {step}", **_STAGE)
def teacher_scores(config: RunConfig, samples: Path, out: Path, step: int) -> Path:
    return teacher_stage(config, samples, out)


class RemoteTrainer(Protocol):
    """Runs a train stage elsewhere (``cluster/ray_trainer.py``: a node of a Ray cluster)."""

    def train(
        self, config: RunConfig, samples: Path, teacher: Path | None, previous: Path | None,
        out_checkpoint: Path, out_result: Path, step: int,
    ) -> Path: ...  # fmt: skip


@task(name="train", task_run_name="train step {step}", **_STAGE)
def train(
    config: RunConfig, samples: Path, teacher: Path | None, previous: Path | None,
    out_checkpoint: Path, out_result: Path, step: int, on: RemoteTrainer | None = None,
) -> Path:
    if on is not None:
        return on.train(config, samples, teacher, previous, out_checkpoint, out_result, step)
    return train_stage(config, samples, teacher, previous, out_checkpoint, out_result)


@task(name="metrics", task_run_name="metrics step {step}", **_STAGE)
def metrics(config: RunConfig, run_dir: Path, step: int) -> Path:
    return metrics_stage(config, run_dir, step)


@task(name="validation-metrics", task_run_name="validation metrics step {step}", **_STAGE)
def validation_metrics(config: RunConfig, run_dir: Path, step: int) -> Path:
    return validation_metrics_stage(config, run_dir, step)


def run_once(out: Path, run: Callable[[], Path]) -> Path:
    """The finished output ``out`` stands for, or ``run()``, which writes it."""
    done = finished_output(out)
    return done if done is not None else run()


def run_stage(folder: RunFolder, step: int, name: str, out: Path, run: Callable[[], Path]) -> Path:
    """``run_once`` for a training step's stage ``name``, recording its wall seconds in the
    step's ``stage_seconds.json`` when it really runs (a finished stage's figure stands)."""
    check_timed_stage(name)
    done = finished_output(out)
    if done is not None:
        return done
    started = time.perf_counter()
    path = run()
    folder.record_stage_seconds(step, name, time.perf_counter() - started)
    return path


@contextmanager
def replaying_failed_episodes(folder: RunFolder, p: StepPaths) -> Iterator[None]:
    """Where the scoring stage refuses a step whose episodes failed in the rollout itself
    (``StepFailedError.rollout_failed``), the step discards those episodes (and an async
    step's admission), so that a resume plays them again; the error then says so."""
    try:
        yield
    except StepFailedError as failed:
        if not failed.rollout_failed:
            raise
        discard_episodes(folder, p.step, p.split)
        raise StepFailedError(f"{failed}; its episodes were discarded: `rollflow resume` plays them again") from None


def grpo_step(
    handle: RunHandle, step: int, episodes_from: Callable[[StepPaths], Path],
    publish: Callable[[int, Path], None] | None = None, trainer: RemoteTrainer | None = None,
) -> StepPaths:
    """Run (or finish) training step ``step``; returns its paths.

    ``episodes_from(p)`` writes the step's episodes and returns where (``p.episodes`` or
    ``p.admitted``). ``publish(version, checkpoint)``, where given (async), sends the new
    policy version to the generator as soon as it is trained, before the metrics.
    ``trainer``, where given, runs the train stage (a node of the run's Ray cluster); else
    it runs in this process.
    """
    config, folder = handle.config, handle.folder
    p = folder.step_paths(step)
    stage = partial(run_stage, folder, step)
    episodes = stage("rollout", p.episodes, partial(episodes_from, p))
    with replaying_failed_episodes(folder, p):
        scores = stage("scoring", p.scores, partial(scoring, config, episodes, p.scores, step))
    samples = stage("flatten", p.samples, partial(flatten, episodes, scores, p.samples, step))
    teacher = None
    if config.train.has_teacher:
        teacher = stage("teacher", p.teacher, partial(teacher_scores, config, samples, p.teacher, step))
    previous = folder.checkpoint_before(step)
    stage("train", p.train_json,
          partial(train, config, samples, teacher, previous, p.checkpoint, p.train_json, step, quote(trainer)))  # fmt: skip
    if publish is not None:
        publish(step + 1, p.checkpoint)
    run_once(p.metrics_json, partial(metrics, config, folder.root, step))
    return p


def rollout_from(
    config: RunConfig, source: Generator | Policy | ActingPolicy | None = None, fan_out: ChunkFanOut | None = None
) -> Callable[[StepPaths], Path]:
    """Lockstep's ``episodes_from``: play the step's episodes with ``source``: the run's
    generator (asked for the step's version), a fixed policy, or None (the stage opens one);
    on a Ray cluster's nodes where ``fan_out`` is given (``cluster/ray_rollout.py``)."""
    return lambda p: rollout(config, p.episodes, p.step, p.split, quote(source), quote(fan_out))


def admitted_from(config: RunConfig, workers: RolloutWorkers) -> Callable[[StepPaths], Path]:
    """Async's ``episodes_from``: admit ``batch_size`` finished groups of the rollout workers."""
    return lambda p: admit(config, quote(workers), p.step, p.admitted)
