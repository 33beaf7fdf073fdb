"""The GRPO training flow: validation every ``validation_interval`` steps, and ``num_steps`` GRPO steps.

Every step is ``flows/step.py``'s ``grpo_step``: the step's episodes, then scoring ->
flatten -> [teacher] -> train -> metrics, each stage handed the paths it reads and the path
it writes (the run folder's ``StepPaths``). The teacher stage (``tasks/teacher.py``) runs
only where ``[train]`` names a teacher: on-policy distillation (``objective = "opd"``), or
a GRPO run measuring its distance to one.

Two schedules call it, and differ only in where a step's episodes come from:
- lockstep (the default): the step plays its own (``rollout``), so its rollouts finish
  before its training starts;
- async (``[rollout].max_steps_off_policy`` set): rollout workers (``tasks/collect.py``)
  play groups on the vLLM generator beside the trainer and write each finished group to a
  file; a step admits ``batch_size`` of them (``admit``: drop stale ones, write the step's
  episodes), and the new version is published as soon as it is trained (inline or on a
  thread, ``weight_sync_type``).

The run holds one generator for all its steps (``open_generator``; async:
``open_async_generator``), closed when the run ends or fails. On a Ray cluster
(``[cluster]``, lockstep) the rollout chunks run on its nodes, and the train stage and the
managed vLLM replicas too where ``[cluster]`` places them (``cluster/run_cluster.py``,
opened before the generator and closed after it; ``replica_host``).

Resume is the same call again on the same run folder. A stage whose output exists is
finished and is not run again; a half-written temporary left by a crash is discarded
before anything runs (``flows/runs.py``); training continues from the newest committed
checkpoint with its optimizer and RNG state. An async resume also comes from the files:
the admissions already written and the groups already collected.

Validation runs before every ``validation_interval``-th step (step 0 gives the baseline)
and once more after the last step, on the validation tasks, without training on them.
A finished run ends by printing the first and last validation's paired change and where
the curve is (``ops/run_summary.py``); one that fails or is stopped records how, in one
line, for ``rollflow runs`` (``record_run_end``; the CLI records it too where the flow never
started, e.g. Prefect's server did not).
"""

from __future__ import annotations

import time

from prefect import flow

from rollflow.cluster.ray_replicas import replica_host
from rollflow.cluster.run_cluster import run_cluster
from rollflow.flows.concurrency import one_training_at_a_time
from rollflow.flows.runs import RunHandle, open_run, validation_due
from rollflow.flows.step import admitted_from, grpo_step, rollout_from, validate
from rollflow.generators.async_generator import open_async_generator
from rollflow.generators.cpu_split import async_cpu_split, trainer_threads
from rollflow.generators.run_generator import open_generator
from rollflow.storage.runs import clear_run_end
from rollflow.storage.stage_outputs import finished_output
from rollflow.tasks.collect import Publisher, RolloutWorkers, write_collector_report
from rollflow.tasks.metrics import step_advice, step_outcome
from rollflow.ops.run_summary import learning_summary, record_run_end
from rollflow.tasks.teacher import check_teacher
from rollflow.tasks.tracking import finish_tracking, start_tracking


def report_step(handle: RunHandle, step: int, line: str) -> None:
    """The step's line, and what to try when it had nothing to learn from."""
    handle.report(line)
    advice = step_advice(handle.folder, step)
    if advice is not None:
        handle.report(f"  {advice}")


@flow(name="rollflow-train")
def train_flow(config_path: str | None = None, run_dir: str | None = None) -> str:
    """Train (or resume) one run; returns its run folder.

    ``config_path`` alone starts a new run under ``[storage].runs_dir``; ``run_dir`` alone
    resumes that run with its frozen config; both start a new run in ``run_dir`` (or resume
    it, when it already holds the same config).
    """
    handle = open_run(config_path, run_dir)  # holds the run folder's lock until closed
    try:
        clear_run_end(handle.root)  # how an earlier process ended is history now (storage/runs.py)
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
        try:  # a summary that cannot be made must not fail a finished run
            summary = learning_summary(handle.config, handle.folder)
        except Exception as summary_error:  # noqa: BLE001 - reported; the run itself succeeded
            summary = [f"could not summarise the run's validation: {summary_error}"]
        for line in summary:
            handle.report(line)
        return str(handle.root)
    except BaseException as error:  # a failure or a stop, whoever called the flow (CLI, API, pipeline)
        record_run_end(handle.root, error)  # what `rollflow runs` says of it
        raise
    finally:
        handle.close()


def run_training(handle: RunHandle) -> None:
    check_teacher(handle.config)  # a teacher with another tokenizer is refused before any rollout
    config, last = handle.config, handle.config.train.num_steps
    if handle.next_step() == last:  # trained: at most the last validation is left
        validated = finished_output(handle.folder.step_paths(last, "validation").metrics_json) is not None
        if validation_due(config, last) and not validated:  # else no generator opened
            run_last_validation(handle)
        return
    if config.rollout.max_steps_off_policy is not None:
        run_async_training(handle)
    else:
        run_lockstep_training(handle)


def run_last_validation(handle: RunHandle) -> None:
    """The last validation of a run whose steps are all trained, sampled as its steps' were:
    on the run's cluster, by the replicas ``[cluster]`` places (not a server of the driver's),
    its chunks fanned out over the nodes where a lockstep run's are."""
    config = handle.config
    lockstep = config.rollout.max_steps_off_policy is None
    with run_cluster(config) as (fan_out, _), open_generator(
        config, handle.folder, versions_in_flight=1, host=replica_host(config)
    ) as generator:
        validate(config, handle.root, config.train.num_steps, generator, fan_out if lockstep else None, handle.report)


def run_lockstep_training(handle: RunHandle) -> None:
    config, root, last = handle.config, handle.root, handle.config.train.num_steps
    with run_cluster(config) as (fan_out, trainer), open_generator(
        config, handle.folder, versions_in_flight=1, host=replica_host(config)
    ) as generator:
        for step in range(last):
            if handle.folder.step_finished(step):
                continue
            if validation_due(config, step):
                validate(config, root, step, generator, fan_out, handle.report)
            grpo_step(handle, step, rollout_from(config, generator, fan_out), trainer=trainer)
            seconds = handle.folder.stage_seconds(step)
            report_step(
                handle, step,
                f"step {step} done ({step + 1} of {last}) in {sum(seconds.values()):.1f}s: "
                f"{step_outcome(handle.folder, step)} ("
                + " ".join(f"{k}={v:.1f}s" for k, v in seconds.items()) + ")",
            )
        if validation_due(config, last):
            validate(config, root, last, generator, fan_out, handle.report)


def run_async_training(handle: RunHandle) -> None:
    """Rollout workers collect groups beside the trainer; each step admits, scores,
    flattens, trains and publishes (``tasks/collect.py`` has the rules)."""
    config, root, folder = handle.config, handle.root, handle.folder
    first, last = handle.next_step(), config.train.num_steps
    started = time.perf_counter()
    split = async_cpu_split(config)  # the server's cores and the trainer's, apart (generators/cpu_split.py)
    if split is not None:
        handle.report(f"CPUs: the vLLM server on {list(split[0])}, the trainer's threads {len(split[1])}")
    with (
        run_cluster(config) as (_, trainer),
        open_async_generator(config, folder, first, host=replica_host(config), cpus=split[0] if split else ()) as generator,
        trainer_threads(split and len(split[1])),
    ):
        workers = RolloutWorkers(config, folder, generator, first).start()
        publisher = Publisher(generator, deferred=config.rollout.weight_sync_type != "synchronous")
        try:
            for step in range(first, last):
                if validation_due(config, step):
                    publisher.join()
                    validate(config, root, step, generator, report=handle.report)
                grpo_step(handle, step, admitted_from(config, workers), publish=publisher.publish, trainer=trainer)
                report_step(handle, step, f"step {step} done ({step + 1} of {last}, async): {step_outcome(folder, step)}")
            publisher.join()
            if validation_due(config, last):
                validate(config, root, last, generator, report=handle.report)
        finally:
            workers.stop()
            publisher.join(quiet=True)
            write_collector_report(folder, workers, generator, time.perf_counter() - started)
