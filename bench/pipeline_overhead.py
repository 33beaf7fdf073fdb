"""What Prefect costs per training step: the flow against the same stages as plain calls.

Runs the same training twice in one process, into two fresh run folders:

- **flow**: ``rollflow.flows.train.train_flow`` (each stage a Prefect task run, the flow run and
  its task runs recorded by Prefect's local server);
- **plain**: the very stage functions of ``tasks/`` (``rollout_stage``, ``score_stage``,
  ``flatten_stage``, ``train_stage``, ``metrics_stage`` and the validation stages) called
  in the flow's order by an ordinary loop, with no Prefect at all.

Both read one config and write identical files (same seeds), so the difference in wall
time is the orchestration: task-run bookkeeping, the flow run, and Prefect's logging.
The temporary Prefect server that a process starts once (about 5 s here, more the very
first time) is timed separately by a warm-up flow and reported on its own line: a
long-lived server or a worker pays it once, not per step.

Overhead = (flow - plain) / plain, over the whole run and per step; each mode runs
``--repeats`` times, alternating, and the median counts (the 2-core machine is noisy).

Simplified, and why: MLflow tracking is off in both modes (it is tracking, not
orchestration, and its sqlite writes would add the same noise to both); the default
model is a tiny random one (``rollflow.policy.models.build_tiny_model``) so the bench runs in
about a minute, which makes the share an *upper bound*: Prefect's cost per step is
roughly constant, and the bundled model's steps are minutes long. ``--bundled`` runs
the default run size (``RunConfig()``'s rollout and train sizes) on SmolLM2-135M.

    .venv/bin/python bench/pipeline_overhead.py [--steps 3] [--repeats 2] [--bundled]
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

# Before Prefect is imported: it reads its settings once. A busy 2-core machine can take
# longer than the default 20 s to start the temporary server.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
if "PREFECT_HOME" not in os.environ:  # a Prefect home of its own, gone when the bench ends
    _PREFECT_HOME = tempfile.mkdtemp(prefix="rollflow-overhead-prefect-")
    os.environ["PREFECT_HOME"] = _PREFECT_HOME
    atexit.register(shutil.rmtree, _PREFECT_HOME, ignore_errors=True)

from prefect import flow  # noqa: E402

from rollflow.config.run import RunConfig, TrackingConfig, config_to_toml  # noqa: E402
from rollflow.flows.runs import open_run  # noqa: E402
from rollflow.flows.runs import validation_due  # noqa: E402
from rollflow.flows.step import run_once, run_stage  # noqa: E402
from rollflow.flows.train import train_flow  # noqa: E402
from rollflow.generators.generator import Generator  # noqa: E402
from rollflow.generators.policy_io import acting_policy  # noqa: E402
from rollflow.generators.run_generator import open_generator  # noqa: E402
from rollflow.policy.models import build_tiny_model  # noqa: E402
from rollflow.storage.runfolder import RunFolder  # noqa: E402
from rollflow.tasks.flatten import flatten_stage  # noqa: E402
from rollflow.tasks.metrics import metrics_stage, validation_metrics_stage  # noqa: E402
from rollflow.tasks.rollout import rollout_stage  # noqa: E402
from rollflow.tasks.scoring import score_stage  # noqa: E402
from rollflow.tasks.train import train_stage  # noqa: E402


@dataclass(frozen=True)
class Timing:
    mode: str  # "flow" or "plain"
    seconds: float  # the whole run: every step and every validation pass


def bench_config(workdir: Path, steps: int, bundled: bool) -> RunConfig:
    """The tiny model on configs/tiny.toml's sizes, or the default run size on SmolLM2."""
    base = RunConfig()
    if bundled:
        config = replace(base, train=replace(base.train, num_steps=steps))
    else:
        model_dir = build_tiny_model(workdir / "tiny-model")
        config = replace(
            base,
            model=replace(base.model, path=str(model_dir)),
            rollout=replace(base.rollout, batch_size=2, episodes_per_task=4, max_turns=2,
                            max_model_length=1024, max_completion_tokens=16, concurrency=8),
            train=replace(base.train, num_steps=steps, lora_rank=4, lora_alpha=8.0,
                          max_tokens_per_microbatch=2048),
            validation=replace(base.validation, validation_interval=2, num_tasks=4),
        )
    return replace(config, tracking=TrackingConfig(enabled=False))


def plain_training(config_path: Path, run_dir: Path) -> None:
    """``rollflow.flows.train.run_training`` without Prefect: the stage functions in the same order."""
    handle = open_run(config_path, run_dir)
    config, folder = handle.config, handle.folder
    with open_generator(config, folder, versions_in_flight=1) as generator:
        for step in range(config.train.num_steps):
            if validation_due(config, step):
                plain_validation(config, folder, step, generator)
            p, previous = folder.step_paths(step), folder.checkpoint_before(step)
            play = partial(rollout_stage, config, p.episodes, step, "train")
            episodes = run_stage(folder, step, "rollout", lambda out: play(acting_policy(config, generator, previous)), out=p.episodes)
            scores = run_stage(folder, step, "scoring", score_stage, config, episodes, out=p.scores)
            samples = run_stage(folder, step, "flatten", flatten_stage, episodes, scores, out=p.samples)
            train = partial(train_stage, config, samples, None, previous)
            run_stage(folder, step, "train", lambda out, out_result: train(out, out_result),
                      out=p.checkpoint, out_result=p.train_json)  # fmt: skip
            run_once(metrics_stage, config, folder, p, out=p.metrics_json)
        if validation_due(config, config.train.num_steps):
            plain_validation(config, folder, config.train.num_steps, generator)


def plain_validation(config: RunConfig, folder: RunFolder, step: int, generator: Generator) -> None:
    p = folder.step_paths(step, "validation")
    play = partial(rollout_stage, config, p.episodes, step, "validation")
    episodes = run_once(lambda out: play(acting_policy(config, generator, folder.checkpoint_before(step))), out=p.episodes)
    run_once(score_stage, config, episodes, out=p.scores)
    run_once(validation_metrics_stage, config, folder, p, out=p.metrics_json)


@flow(name="rollflow-bench-warmup")
def _warmup_flow() -> None:
    """Nothing: calling it starts Prefect's temporary server once for the process."""


def time_run(mode: str, config_path: Path, run_dir: Path) -> Timing:
    started = time.perf_counter()
    if mode == "flow":
        train_flow(config_path=str(config_path), run_dir=str(run_dir))
    else:
        plain_training(config_path, run_dir)
    return Timing(mode, time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="training steps per run")
    parser.add_argument("--repeats", type=int, default=2, help="runs per mode (median counts)")
    parser.add_argument("--bundled", action="store_true", help="SmolLM2-135M at the default run size")
    args = parser.parse_args()
    if args.steps < 1 or args.repeats < 1:
        parser.error("--steps and --repeats must be at least 1")
    workdir = Path(tempfile.mkdtemp(prefix="rollflow-overhead-"))
    config = bench_config(workdir, args.steps, args.bundled)
    config_path = workdir / "bench.toml"
    config_path.write_text(config_to_toml(config))

    started = time.perf_counter()
    _warmup_flow()
    server_s = time.perf_counter() - started
    time_run("plain", config_path, workdir / "warmup-plain")  # loads and caches the model files

    timings: list[Timing] = []
    for repeat in range(args.repeats):
        for mode in ("flow", "plain"):
            timings.append(time_run(mode, config_path, workdir / f"{mode}-{repeat}"))
            print(f"  {mode:<5} run {repeat + 1}: {timings[-1].seconds:7.2f} s", flush=True)
    report(timings, args.steps, server_s, config)


def report(timings: list[Timing], steps: int, server_s: float, config: RunConfig) -> None:
    flow_s = statistics.median(t.seconds for t in timings if t.mode == "flow")
    plain_s = statistics.median(t.seconds for t in timings if t.mode == "plain")
    overhead_s = flow_s - plain_s
    validations = sum(validation_due(config, s) for s in range(steps + 1))
    rollout = config.rollout
    print(f"run size: {steps} steps x {rollout.batch_size} tasks x {rollout.episodes_per_task} "
          f"episodes, {validations} validation passes, model {config.model.path or 'bundled SmolLM2-135M'}")
    print(f"prefect server start (once per process): {server_s:6.2f} s")
    print(f"plain stage calls (median):              {plain_s:6.2f} s  ({plain_s / steps:.2f} s/step)")
    print(f"prefect flow (median):                   {flow_s:6.2f} s  ({flow_s / steps:.2f} s/step)")
    print(f"orchestration overhead:                  {overhead_s / steps * 1000:6.0f} ms/step = "
          f"{overhead_s / plain_s:.1%} of step time")


if __name__ == "__main__":
    main()
