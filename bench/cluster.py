"""Lockstep against async on a two-node local Ray cluster whose nodes have a core each.

The cluster stands in for a generator GPU and a trainer GPU: a head node pinned to core 0
holds the run's vLLM replica (``[cluster].generator_nodes = ["head"]``, a Ray actor), a
worker node pinned to core 1 runs the train stage (``trainer_node = "worker-1"``), each on
its own core only (``pin_cores``: what ``taskset -c`` does). Both runs train
bench/async_overlap.py's config (the bundled tool-use game with its worked example, the
bundled SmolLM2-135M, full weights reloaded in place) through the real flow:

- ``lockstep``: each rollout's chunks are tasks on the nodes, then scoring and flattening
  here, then the train stage on the worker, then the next rollout;
- ``async``: the collector (this process) keeps ``groups_in_flight`` groups playing against
  the head's replica while the worker trains (``max_steps_off_policy = 1``, admission
  control on).

Printed per run, over the steps after the first (the first fills the pipe): steps per hour;
the trainer's idle share (1 - train-stage seconds / window) and the generator's (lockstep:
1 - rollout-stage seconds / window; async: the collector's slot-weighted idle time / wall);
the busy share of each core over the window (``/proc/stat``, sampled every second: core 0 is
the generator's node, core 1 the trainer's; this process and its Prefect server are not
pinned and use both); dropped stale groups. Then the ratio of steps per hour.

    .venv/bin/python bench/cluster.py [--steps 4] [--tiny]
    .venv/bin/python bench/cluster.py --scaling [--tiny]

``--scaling`` measures one rollout stage instead (8 tasks x 4 episodes of the same game,
``concurrency = 8``: 4 chunks of 2 groups) three ways on one managed vLLM server that this
process holds for all three: in this process (chunks one after another), on a local
cluster of the head alone (chunks as Ray tasks, one at a time), and on the head and a
worker (two at a time). Printed: seconds, episodes per minute, the orchestration overhead
per chunk (the head alone against this process), and the two-node speed-up and its
efficiency (speed-up / 2). Each leg plays a fresh run folder after one untimed stage.

``--tiny`` swaps in a 2-layer test model and 2 steps, to check the script itself. Needs two
cores this process may use. No timed assertions: the figures are for the README.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from async_overlap import base_config, generator_idle_and_dropped, print_summary, stage_sum, step_window  # noqa: E402 - the bench beside this one

from rollflow.config.cluster import ClusterConfig  # noqa: E402
from rollflow.config.run import RunConfig, config_to_toml  # noqa: E402
from rollflow.storage.runfolder import RunFolder  # noqa: E402


def on_the_cluster(config: RunConfig) -> RunConfig:
    cluster = ClusterConfig(
        mode="local", num_worker_nodes=1, head_cpus=1, cpus_per_node=1, pin_cores=True,
        memory_gib_per_node=4.0, object_store_mib_per_node=128,
        generator_nodes=("head",), trainer_node="worker-1", trainer_cpus=1,
    )  # fmt: skip
    return replace(config, cluster=cluster)


def variants(config: RunConfig) -> dict[str, RunConfig]:
    async_rollout = replace(config.rollout, max_steps_off_policy=1, groups_in_flight=8)
    return {"lockstep": config, "async": replace(config, rollout=async_rollout)}


class CoreSampler(threading.Thread):
    """``/proc/stat``'s per-core (busy, total) jiffies every second, with the wall time."""

    def __init__(self, cores: tuple[int, ...]) -> None:
        super().__init__(daemon=True)
        self.cores, self.samples, self.done = cores, list[tuple[float, dict[int, tuple[int, int]]]](), threading.Event()

    @staticmethod
    def read() -> dict[int, tuple[int, int]]:
        found = {}
        for line in Path("/proc/stat").read_text().splitlines():
            name, *fields = line.split()
            if name.startswith("cpu") and name != "cpu":
                values = [int(v) for v in fields]
                idle = values[3] + values[4]  # idle + iowait
                found[int(name[3:])] = (sum(values[:8]) - idle, sum(values[:8]))
        return found

    def run(self) -> None:
        while not self.done.is_set():
            self.samples.append((time.time(), self.read()))
            self.done.wait(1.0)

    def busy(self, core: int, start: float, end: float) -> float:
        """The core's busy share between the samples nearest ``start`` and ``end``."""
        inside = [(t, s) for t, s in self.samples if start <= t <= end]
        if len(inside) < 2:
            return float("nan")
        (_, first), (_, last) = inside[0], inside[-1]
        busy, total = last[core][0] - first[core][0], last[core][1] - first[core][1]
        return busy / total if total else float("nan")


def report(name: str, run_dir: Path, steps: int, wall_s: float, cores: CoreSampler) -> dict[str, float | str]:
    folder = RunFolder(run_dir)
    window = step_window(folder, steps)
    later = range(1, steps)
    generator_idle, dropped = generator_idle_and_dropped(name, folder, steps, window)
    end = (folder.step_dir(steps - 1) / "metrics.json").stat().st_mtime
    start = (folder.step_dir(0) / "metrics.json").stat().st_mtime
    nodes = {folder.read_train_result(s).node for s in range(steps)}
    return {
        "run": name, "steps/hour": 3600.0 * (steps - 1) / window, "step window s": window,
        "trainer idle": 1.0 - stage_sum(folder, later, "train") / window, "generator idle": generator_idle,
        "core 0 busy (generator)": cores.busy(0, start, end), "core 1 busy (trainer)": cores.busy(1, start, end),
        "dropped groups": dropped, "trained on": ",".join(sorted(n or "driver" for n in nodes)), "flow wall s": wall_s,
    }  # fmt: skip


def scaling_config(tiny_model: Path | None) -> RunConfig:
    config = base_config(1, tiny_model)
    rollout = replace(config.rollout, batch_size=2 if tiny_model else 8, episodes_per_task=4, concurrency=8)
    return replace(config, rollout=rollout)


def scaling(root: Path, tiny_model: Path | None) -> None:
    """The ``--scaling`` legs (see the module docstring)."""
    from rollflow.cluster.ray_rollout import rollout_cluster
    from rollflow.generators.run_generator import open_generator
    from rollflow.generators.policy_io import acting_policy
    from rollflow.tasks.rollout import rollout_stage
    from rollflow.tasks.rollout_plan import stage_plan

    config = scaling_config(tiny_model)
    chunks = len(stage_plan(config, 0, "train").chunks)
    episodes = config.rollout.batch_size * config.rollout.episodes_per_task
    legs = {
        "this process": ClusterConfig(),
        "head alone": ClusterConfig(mode="local", num_worker_nodes=0, head_cpus=1),
        "head + worker": ClusterConfig(mode="local", num_worker_nodes=1, head_cpus=1, cpus_per_node=1),
    }
    seconds: dict[str, float] = {}
    with open_generator(config, RunFolder(root / "server"), versions_in_flight=1) as generator:
        for name, cluster in legs.items():
            leg = replace(config, cluster=cluster)
            with rollout_cluster(leg) as fan_out:
                for attempt in ("warm-up", "timed"):
                    folder = RunFolder(root / f"{name.replace(' ', '-')}-{attempt}")
                    started = time.perf_counter()
                    rollout_stage(leg, folder.step_paths(0).episodes, 0, "train", acting_policy(leg, generator, None), fan_out)
                    if attempt == "timed":
                        seconds[name] = time.perf_counter() - started
            print(f"{name}: {seconds[name]:.1f} s", file=sys.stderr, flush=True)
    print(f"one rollout stage: {episodes} episodes in {chunks} chunks, load at the end {os.getloadavg()}")
    print("| where | seconds | episodes/minute |")
    print("|---|---|---|")
    for name, value in seconds.items():
        print(f"| {name} | {value:.1f} | {60.0 * episodes / value:.1f} |")
    here, one, two = seconds["this process"], seconds["head alone"], seconds["head + worker"]
    speedup = one / two
    print(f"\norchestration overhead per chunk (head alone - this process): {(one - here) / chunks:+.2f} s")
    print(f"two nodes against one: {speedup:.2f}x, efficiency {speedup / 2:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer test model and 2 steps")
    parser.add_argument("--scaling", action="store_true", help="one rollout stage here, on 1 node and on 2")
    args = parser.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        parser.error("needs two cores: one for each node")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    from prefect.testing.utilities import prefect_test_harness

    from rollflow.flows.train import train_flow
    from rollflow.policy.models import build_tiny_model

    print(f"load average at the start: {os.getloadavg()}", flush=True)
    if args.scaling:
        with tempfile.TemporaryDirectory(prefix="cluster-bench-") as tmp, prefect_test_harness(server_startup_timeout=120):
            scaling(Path(tmp), build_tiny_model(Path(tmp) / "tiny", hidden_size=64, num_heads=2) if args.tiny else None)
        return
    cores = CoreSampler((0, 1))
    cores.start()
    with tempfile.TemporaryDirectory(prefix="cluster-bench-") as tmp, prefect_test_harness(server_startup_timeout=120):
        root = Path(tmp)
        tiny = build_tiny_model(root / "tiny", hidden_size=64, num_heads=2) if args.tiny else None
        steps = 2 if args.tiny else args.steps
        rows = []
        for name, config in variants(on_the_cluster(base_config(steps, tiny))).items():
            path = root / f"{name}.toml"
            path.write_text(config_to_toml(replace(config, storage=replace(config.storage, runs_dir=str(root)))))
            started = time.perf_counter()
            run_dir = Path(train_flow(config_path=str(path), run_dir=str(root / name)))
            rows.append(report(name, run_dir, steps, time.perf_counter() - started, cores))
            print(f"{name}: {rows[-1]}", file=sys.stderr, flush=True)
    cores.done.set()
    print_summary(rows)


if __name__ == "__main__":
    main()
