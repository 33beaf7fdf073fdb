"""One GRPO training step, as both schedules run it: episodes -> scores -> samples -> [teacher] -> train -> metrics.

``grpo_step`` reads top to bottom as plain calls: each stage is handed the paths it reads
(the outputs of the stages before it) and the path it writes (``out=``, from the run
folder's ``StepPaths``), and returns what it wrote for the next. The checkpoint the step
starts from (``previous``) is handed to both the rollout (as the policy version it samples)
and the train stage, which returns the next one. Where the step's episodes come from is the
schedule's choice (``episodes_from``): lockstep plays them (``rollout_from``), async admits
groups that rollout workers already played (``admitted_from``, ``tasks/collect.py``).
``validate`` is the validation pass both schedules (and the evaluation flow) run.

One helper, ``run_stage``, skips a stage whose outputs are already finished and times one
that really runs: the file, not Prefect's database, is the record of what is done, so a
resume works with a fresh Prefect server, and the stage's wall seconds go to the step
folder's ``stage_seconds.json``, so a resumed step logs what its finished stages took
before the crash, not the instant a skip takes (``run_once``: the same, untimed).

Each stage runs as a thin Prefect task named for its step ("rollout step 3 (train)"),
its errors after a Ctrl-C or SIGTERM raised as the stop they are (``stops_through``);
the live objects a task is handed (the acting policy, the rollout workers) are wrapped in
``quote`` so that Prefect does not walk them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.utilities.annotations import quote

from rollflow.config.run import RunConfig
from rollflow.flows.runs import RunHandle, rerun_command
from rollflow.generators.generator import Sampler
from rollflow.generators.policy_io import ActingPolicy, acting_policy
from rollflow.generators.vllm_generator import sleep_for_update
from rollflow.policy.stopping import stops_through
from rollflow.storage.runfolder import RunFolder, StepPaths, check_timed_stage
from rollflow.storage.stage_outputs import finished_output, locate_output
from rollflow.tasks.collect import RolloutWorkers, admit_stage
from rollflow.tasks.flatten import flatten_stage
from rollflow.tasks.metrics import metrics_stage, validation_metrics_stage, validation_outcome
from rollflow.tasks.rollout import ChunkFanOut, rollout_stage
from rollflow.tasks.scoring import score_stage
from rollflow.tasks.step_health import StepFailedError, discard_episodes
from rollflow.tasks.teacher import teacher_stage
from rollflow.tasks.train import train_stage

def _stage(name: str, run_name: str | Callable[..., str]) -> Callable[[Callable[..., Any]], Any]:
    """A stage as a Prefect task named for its step, its errors after a Ctrl-C or SIGTERM
    raised as the stop (``stops_through``). The files are the cache: Prefect must neither
    hash configs nor persist results."""

    def wrap(fn: Callable[..., Any]) -> Any:
        return task(name=name, task_run_name=run_name, cache_policy=NO_CACHE, persist_result=False)(stops_through(fn))

    return wrap


def _run_name(stage: str, path: str = "out", split: bool = False) -> Callable[..., str]:
    """A task run's name from the output it writes: "scoring step 3 (train)"."""

    def name(parameters: dict[str, Any]) -> str:
        where = locate_output(parameters[path])
        return f"{stage} step {where.step}" + (f" ({where.split})" if split else "")

    return name


@_stage("rollout", "rollout step {step} ({split})")
def rollout(
    config: RunConfig, step: int, split: str, acting: ActingPolicy, fan_out: ChunkFanOut | None = None, *, out: Path
) -> Path:
    return rollout_stage(config, out, step, split, acting, fan_out)


@_stage("admit", "admit step {step}")
def admit(config: RunConfig, workers: RolloutWorkers, step: int, *, out: Path) -> Path:
    return admit_stage(config, workers, step, out)


@_stage("scoring", _run_name("scoring", split=True))
def scoring(config: RunConfig, episodes: Path, *, out: Path) -> Path:
    return score_stage(config, episodes, out)


@_stage("flatten", _run_name("flatten"))
def flatten(episodes: Path, scores: Path, *, out: Path) -> Path:
    return flatten_stage(episodes, scores, out)


@_stage("teacher", _run_name("teacher"))
def teacher_scores(config: RunConfig, samples: Path, *, out: Path) -> Path:
    return teacher_stage(config, samples, out)


class RemoteTrainer(Protocol):
    """Runs a train stage elsewhere (``cluster/ray_trainer.py``: a node of a Ray cluster)."""

    def train(
        self, config: RunConfig, samples: Path, teacher: Path | None, previous: Path | None,
        out_checkpoint: Path, out_result: Path, step: int,
    ) -> Path: ...  # fmt: skip


@_stage("train", _run_name("train", path="out_result"))
def train(
    config: RunConfig, samples: Path, teacher: Path | None, previous: Path | None, on: RemoteTrainer | None = None,
    *, out: Path, out_result: Path,
) -> Path:
    """Returns the checkpoint ``out``, committed (``out_result``: its ``train.json``)."""
    if on is not None:
        return on.train(config, samples, teacher, previous, out, out_result, locate_output(out_result).step)
    return train_stage(config, samples, teacher, previous, out, out_result)


@_stage("metrics", "metrics step {p.step}")
def metrics(config: RunConfig, folder: RunFolder, p: StepPaths, *, out: Path) -> Path:
    return metrics_stage(config, folder, p, out)


@_stage("validation-metrics", "validation metrics step {p.step}")
def validation_metrics(config: RunConfig, folder: RunFolder, p: StepPaths, *, out: Path) -> Path:
    return validation_metrics_stage(config, folder, p, out)


def run_once(task: Callable[..., Path], *args: object, out: Path, **outputs: Path) -> Path:
    """``task(*args, out=out, **outputs)``, unless its outputs are finished already (a
    resume): then the finished output ``out`` stands for (``finished_output``)."""
    done = _finished(out, outputs)
    return done if done is not None else task(*args, out=out, **outputs)


def run_stage(
    folder: RunFolder, step: int, name: str, task: Callable[..., Path], *args: object, out: Path, **outputs: Path
) -> Path:
    """``run_once`` for a training step's stage ``name``, recording its wall seconds in the
    step's ``stage_seconds.json`` when it really runs (a finished stage's figure stands)."""
    check_timed_stage(name)
    done = _finished(out, outputs)
    if done is not None:
        return done
    started = time.perf_counter()
    path = task(*args, out=out, **outputs)
    folder.record_stage_seconds(step, name, time.perf_counter() - started)
    return path


def _finished(out: Path, outputs: dict[str, Path]) -> Path | None:
    """``out``'s finished output where every one of a stage's outputs is finished; else None."""
    done = finished_output(out)
    return done if done is not None and all(finished_output(o) is not None for o in outputs.values()) else None


@contextmanager
def replaying_failed_episodes(folder: RunFolder, p: StepPaths) -> Iterator[None]:
    """Where the scoring stage refuses a step whose episodes failed in the rollout itself
    (``StepFailedError.rollout_failed``), the step discards those episodes (and an async
    step's admission), so that running the folder again plays them; the error says with which
    command (``rerun_command``: an evaluation is not resumed by ``rollflow resume``)."""
    try:
        yield
    except StepFailedError as failed:
        if not failed.rollout_failed:
            raise
        discard_episodes(folder, p.step, p.split)
        again = rerun_command(folder.root)  # `rollflow resume`, or for an evaluation `rollflow eval`
        raise StepFailedError(f"{failed}; its episodes were discarded: {again} plays them again") from None


class EpisodesFrom(Protocol):
    """Where a step's episodes come from: the schedule's choice (``rollout_from``, ``admitted_from``)."""

    def __call__(self, step: int, previous: Path | None, *, out: Path) -> Path: ...


def grpo_step(
    handle: RunHandle, step: int, episodes_from: EpisodesFrom,
    publish: Callable[[int, Path], None] | None = None, trainer: RemoteTrainer | None = None,
) -> StepPaths:
    """Run (or finish) training step ``step``; returns its paths.

    ``previous`` is the checkpoint the step samples with and trains from (None: the run's
    start). ``episodes_from`` writes the step's episodes (``p.episodes``, or the one file
    ``p.admitted`` it stands for) and returns where. ``publish(version, checkpoint)``, where
    given (async), sends the new policy version to the generator as soon as it is trained,
    before the metrics. ``trainer``, where given, runs the train stage (a node of the run's
    Ray cluster); else it runs in this process.
    """
    config, folder = handle.config, handle.folder
    p = folder.step_paths(step)
    previous = folder.starting_checkpoint(step)
    episodes = run_stage(folder, step, "rollout", episodes_from, step, previous, out=p.episodes)
    with replaying_failed_episodes(folder, p):
        scores = run_stage(folder, step, "scoring", scoring, config, episodes, out=p.scores)
    samples = run_stage(folder, step, "flatten", flatten, episodes, scores, out=p.samples)
    teacher = None
    if config.train.has_teacher:
        teacher = run_stage(folder, step, "teacher", teacher_scores, config, samples, out=p.teacher)
    checkpoint = run_stage(
        folder, step, "train", train, config, samples, teacher, previous, quote(trainer),
        out=p.checkpoint, out_result=p.train_json,
    )  # fmt: skip
    if publish is not None:
        publish(step + 1, checkpoint)
    run_once(metrics, config, folder, p, out=p.metrics_json)
    return p


def validate(
    config: RunConfig, run_dir: Path, step: int, generator: Sampler,
    fan_out: ChunkFanOut | None = None, report: Callable[[str], None] | None = None,
) -> None:
    """Validation before ``step``, acting with ``generator``'s policy for the checkpoint
    step ``step`` acts with (the run's generator; an async run's pins the version); on a Ray
    cluster where ``fan_out`` is given. ``report`` gets the pass's line (reward, pass rate,
    errors, overflows, tool errors), as a step's."""
    folder = RunFolder(run_dir)
    p = folder.step_paths(step, "validation")
    play = rollout_from(config, generator, fan_out, split="validation")
    episodes = run_once(play, step, folder.starting_checkpoint(step), out=p.episodes)
    with replaying_failed_episodes(folder, p):
        run_once(scoring, config, episodes, out=p.scores)
    run_once(validation_metrics, config, folder, p, out=p.metrics_json)
    if report is not None:
        report(f"validation at step {step}: {validation_outcome(folder, step)}")


def rollout_from(
    config: RunConfig, generator: Sampler, fan_out: ChunkFanOut | None = None, split: str = "train"
) -> EpisodesFrom:
    """Lockstep's ``episodes_from``: play the step's episodes with ``generator``'s policy for
    the step's checkpoint (built only when the episodes are played), on a Ray cluster's
    nodes where ``fan_out`` is given (``cluster/ray_rollout.py``)."""

    def play(step: int, previous: Path | None, *, out: Path) -> Path:
        acting = acting_policy(config, generator, previous)
        episodes = rollout(config, step, split, quote(acting), quote(fan_out), out=out)
        sleep_for_update(generator)  # a server sharing the trainer's GPU frees it (generators/vllm_generator.py)
        return episodes

    return play


def admitted_from(config: RunConfig, workers: RolloutWorkers) -> EpisodesFrom:
    """Async's ``episodes_from``: admit ``batch_size`` finished groups of the rollout workers
    (sampled by the versions the collector held; ``previous`` is the trainer's alone), into
    the one file ``episodes.parquet`` the step's episodes stand for (``StepPaths.admitted``)."""

    def admit_into(step: int, previous: Path | None, *, out: Path) -> Path:
        return admit(config, quote(workers), step, out=workers.folder.step_paths(step).admitted)

    return admit_into
