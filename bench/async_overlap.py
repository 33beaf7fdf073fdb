"""Lockstep against async (``max_steps_off_policy = 1``), side by side in one run.

Both runs train the bundled tool-use game on the bundled SmolLM2-135M with the same
settings, through the real flow (``train_flow``) on a managed vLLM server, full weights
(on CPU the fast vLLM path: a LoRA adapter makes vLLM ~5x slower here, see
bench/rollout_bench.py; weights reach the server in place, ``reload_weights``):

- ``lockstep``: rollout, then scoring, flatten, train, then the next rollout;
- ``async``: rollout workers keep ``groups_in_flight`` groups playing beside the trainer
  (``weight_sync_type = "synchronous"``, admission control on).

Printed per run, over the steps after the first (the first step of both only fills the
pipe): steps per hour; the trainer's idle share (1 - train-stage seconds / wall); the
generator's idle share (lockstep: 1 - rollout-stage seconds / wall; async: the rollout
workers' slot-weighted idle time / wall); dropped stale groups; and the validation pass
rate and reward after the last step, with their standard errors (paired tasks).

    .venv/bin/python bench/async_overlap.py [--steps 6] [--tiny]

``--tiny`` swaps in a 2-layer test model and 2 steps, to check the script itself.
No timed assertions: the figures are for the README.

Measured 2026-12-01 on the 2-core machine (load 3-5 from other jobs during the lockstep
leg, 8-11 during the async one), 34 min:

    | run      | steps/hour | trainer idle | generator idle | dropped | val pass | flow wall s |
    | lockstep |     50.0   |    0.49      |     0.53       |    0    |   0/16   |    724      |
    | async    |     18.1   |    0.10      |     0.63       |    0    |   0/16   |   1331      |
    async / lockstep steps per hour: 0.36x

The train stage took 177-271 s beside the sampling generator against 9-54 s alone: the
vLLM CPU worker and the trainer oversubscribe the two cores (see the README's "Async
training" for the ceiling and when async pays).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from rollflow.config.rollout import RolloutConfig
from rollflow.config.run import ModelConfig, RunConfig, TrackingConfig, ValidationConfig, config_to_toml
from rollflow.config.train import TrainConfig
from rollflow.storage.query import open_run_sql, run_query
from rollflow.storage.runfolder import RunFolder


def base_config(steps: int, tiny_model: Path | None) -> RunConfig:
    return RunConfig(
        model=ModelConfig(path=str(tiny_model) if tiny_model else None, dtype="float32"),
        env=replace(RunConfig().env, kwargs={"worked_example": True, "max_turns": 6}),
        rollout=RolloutConfig(
            backend="vllm", batch_size=4, episodes_per_task=4, max_turns=6, concurrency=16,
            max_model_length=1024, max_completion_tokens=96, temperature=1.0,
            vllm_kvcache_space_gib=2, generation_timeout_s=900.0,
        ),  # fmt: skip
        train=TrainConfig(
            num_steps=steps, learning_rate=1e-5, use_lora=False, max_tokens_per_microbatch=4096,
            keep_checkpoints=2, seed=0,
        ),  # fmt: skip
        validation=ValidationConfig(validation_interval=steps, num_tasks=16),
        tracking=TrackingConfig(enabled=False),
    )


def variants(config: RunConfig) -> dict[str, RunConfig]:
    async_rollout = replace(config.rollout, max_steps_off_policy=1, groups_in_flight=8)
    return {"lockstep": config, "async": replace(config, rollout=async_rollout)}


def step_window(folder: RunFolder, steps: int) -> float:
    """Seconds from the end of step 0 to the end of the last step (metrics.json times)."""
    first = (folder.step_dir(0) / "metrics.json").stat().st_mtime
    last = (folder.step_dir(steps - 1) / "metrics.json").stat().st_mtime
    return last - first


def stage_sum(folder: RunFolder, steps: range, stage: str) -> float:
    total = 0.0
    for step in steps:
        seconds = json.loads((folder.step_dir(step) / "stage_seconds.json").read_text())
        total += float(seconds.get(stage, 0.0))
    return total


def validation(run_dir: Path, step: int) -> tuple[float, float, float, float, int]:
    con = open_run_sql([run_dir])
    try:
        _, rows = run_query(con, f"SELECT passed::DOUBLE, final_reward FROM scores WHERE split = 'validation' AND step = {step}")
    finally:
        con.close()
    n = len(rows)
    passed, reward = [r[0] for r in rows], [r[1] for r in rows]
    return _mean(passed), _se(passed), _mean(reward), _se(reward), n


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _se(xs: list[float]) -> float:
    if len(xs) < 2:
        return float("nan")
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def generator_idle_and_dropped(name: str, folder: RunFolder, steps: int, window: float) -> tuple[float, float]:
    """The generator's idle share (lockstep: 1 - rollout-stage seconds / window over the steps
    after the first; async: the collector's slot-weighted idle time / wall) and the stale
    groups dropped (async only)."""
    if name != "async":
        return 1.0 - stage_sum(folder, range(1, steps), "rollout") / window, 0.0
    collector = json.loads((folder.root / "async" / "collector.json").read_text())["processes"][-1]
    dropped = sum(
        json.loads((folder.step_dir(s) / "metrics.json").read_text()).get("async/dropped_stale_groups", 0.0)
        for s in range(steps)
    )
    return collector["generator_idle_s"] / collector["wall_s"], dropped


def report(name: str, run_dir: Path, steps: int, wall_s: float) -> dict[str, float | str]:
    folder = RunFolder(run_dir)
    window = step_window(folder, steps)
    later = range(1, steps)
    train_s = stage_sum(folder, later, "train")
    generator_idle, dropped = generator_idle_and_dropped(name, folder, steps, window)
    pass_rate, pass_se, reward, reward_se, n = validation(run_dir, steps)
    return {
        "run": name, "steps/hour": 3600.0 * (steps - 1) / window, "trainer idle": 1.0 - train_s / window,
        "generator idle": generator_idle, "dropped groups": dropped, "val pass": pass_rate, "±": pass_se,
        "val reward": reward, "± ": reward_se, "val episodes": float(n), "flow wall s": wall_s,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer test model and 2 steps")
    args = parser.parse_args()
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    from prefect.testing.utilities import prefect_test_harness

    from rollflow.flows.train import train_flow
    from rollflow.policy.models import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="async-bench-") as tmp, prefect_test_harness(server_startup_timeout=120):
        root = Path(tmp)
        tiny = build_tiny_model(root / "tiny", hidden_size=64, num_heads=2) if args.tiny else None
        steps = 2 if args.tiny else args.steps
        rows = []
        for name, config in variants(base_config(steps, tiny)).items():
            path = root / f"{name}.toml"
            path.write_text(config_to_toml(replace(config, storage=replace(config.storage, runs_dir=str(root)))))
            started = time.perf_counter()
            run_dir = Path(train_flow(config_path=str(path), run_dir=str(root / name)))
            rows.append(report(name, run_dir, steps, time.perf_counter() - started))
            print(f"{name}: {rows[-1]}", file=sys.stderr, flush=True)
    print_summary(rows)


def print_summary(rows: list[dict[str, float | str]]) -> None:
    """The rows as a Markdown table, then async's steps per hour over lockstep's and the load."""
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()) + " |")
    lock, asyn = rows[0], rows[1]
    print(f"\nasync / lockstep steps per hour: {float(asyn['steps/hour']) / float(lock['steps/hour']):.2f}x")
    print(f"load average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
