"""The train stage placed on a Ray cluster: a node of its own (a GPU, or cores the generator does not use).

With ``[cluster].trainer_node`` or ``[cluster].trainer_gpus`` set (lockstep runs on a
cluster), the step's train stage runs ``tasks/train.py``'s ``train_stage`` as one Prefect
task (``train_on_node``) on the cluster, submitted through prefect-ray like the rollout
chunks (``cluster/ray_rollout.py``). Everything else of the step stays where the run runs.

- Placement is hard: the task asks for the named node's own resource
  (``rollflow_node_<name>``) and/or ``trainer_gpus`` GPUs, with ``trainer_cpus`` CPUs; its
  torch threads are set to ``trainer_cpus``. Each training task gets a fresh Ray worker
  process that exits when it is done (``max_calls = 1``): the model, the optimizer and any
  GPU memory go with it instead of staying in a pooled worker beside the next rollouts.
- What travels is paths: the samples, the teacher scores, the previous checkpoint and the
  two outputs, all in the run folder, which every node must see at the same path. The
  checkpoint is committed there by the node (atomic rename, as on one machine); the
  driver's generator loads it from there for the next step, as it would any checkpoint.
- ``train.json`` records the node that trained (``TrainResult.node``).
- Retention stays in the driver: the node commits and never prunes; the driver prunes once
  the task returns. Only the driver knows which checkpoints its async generator still reads
  (``generators/checkpoints.py``'s ``reading_versions``); a pruning node would see no reader
  and delete a version still being served or published.

Faults: a node that dies while it trains takes nothing committed with it (the checkpoint is
renamed into place whole, ``train.json`` after it). Ray runs the task once more where its
resources still exist (``NODE_DEATH_RETRIES``: another node with the GPUs it asks for). Where
no live node can hold it (the named node is gone), the driver, which checks every
``POLL_S`` while it waits, cancels the task and fails the stage with ``TrainerLostError``
naming the node; the resumed run keeps every finished stage and trains only this step
again (a half-written temporary of the checkpoint is discarded first, as for any crash).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from rollflow.config.run import RunConfig
from rollflow.generators.checkpoints import prune_checkpoints
from rollflow.generators.cpu_split import trainer_threads
from rollflow.storage.stage_outputs import locate_output
from rollflow.tasks.train import train_stage

POLL_S = 1.0  # how often the driver checks that some live node can still hold the task


class TrainerLostError(RuntimeError):
    """The train stage placed on the cluster cannot finish: its node is gone."""


@task(name="train-on-node", task_run_name="train step {step} on the cluster", cache_policy=NO_CACHE, persist_result=False)
def train_on_node(
    config: RunConfig, samples: str, teacher: str | None, previous: str | None,
    out_checkpoint: str, out_result: str, step: int,
) -> str:  # fmt: skip
    """On a Ray worker of the trainer's node: ``train_stage`` on the run folder's paths,
    without pruning (the driver prunes: ``RayTrainer.train``)."""
    from rollflow.cluster.ray_rollout import this_node

    with trainer_threads(config.cluster.trainer_cpus):
        path = train_stage(
            config, Path(samples), None if teacher is None else Path(teacher),
            None if previous is None else Path(previous), Path(out_checkpoint), Path(out_result),
            node=this_node(), prune=False,
        )  # fmt: skip
    return str(path)


@dataclass(frozen=True)
class RayTrainer:
    """Runs train stages on the cluster at ``address`` where ``[cluster]`` places them."""

    address: str

    def train(
        self, config: RunConfig, samples: Path, teacher: Path | None, previous: Path | None,
        out_checkpoint: Path, out_result: Path, step: int,
    ) -> Path:  # fmt: skip
        import ray
        from prefect_ray.context import remote_options

        from rollflow.cluster import ray_nodes
        from rollflow.cluster.ray_rollout import stage_task_runner

        where = placement(config)
        started = time.perf_counter()
        with stage_task_runner(self.address) as runner:
            with remote_options(**ray_options(config, retries=ray_nodes.NODE_DEATH_RETRIES)):
                future = runner.submit(train_on_node, {
                    "config": config, "samples": _abs(samples), "teacher": _abs(teacher),
                    "previous": _abs(previous), "out_checkpoint": _abs(out_checkpoint),
                    "out_result": _abs(out_result), "step": step,
                })  # fmt: skip
            ref = future.wrapped_future
            try:
                while not ray.wait([ref], timeout=POLL_S)[0]:
                    problem = unplaceable(config)
                    if problem is not None:
                        raise TrainerLostError(
                            f"train step {step} on {where} was lost: {problem}. What it committed is kept: "
                            "start the node again (or place the trainer elsewhere in [cluster]) and resume "
                            "the run; the finished stages are not run again"
                        )
                result = future.result()
            except BaseException:  # lost, failed or interrupted: nothing of it keeps running
                ray.cancel(ref, force=True)
                raise
        print(f"  train step {step}: on {where} ({time.perf_counter() - started:.1f}s)", file=sys.stderr, flush=True)
        prune_checkpoints(locate_output(out_result).folder, config.train.keep_checkpoints)  # here: the readers are here
        return Path(result)


def _abs(path: Path | None) -> str | None:
    return None if path is None else str(Path(path).absolute())


def placement(config: RunConfig) -> str:
    """Where ``[cluster]`` puts the trainer, in words."""
    c = config.cluster
    parts = ([f"node {c.trainer_node!r}"] if c.trainer_node is not None else []) + (
        [f"{c.trainer_gpus:g} GPU(s)"] if c.trainer_gpus > 0 else []
    )
    return " with ".join(parts) + f", {c.trainer_cpus} CPU(s)"


def trainer_resources(config: RunConfig) -> dict[str, float]:
    """The Ray resources the training task asks for: its CPUs, its GPUs, and a small share of
    the named node's own resource (which the node has 1 of)."""
    from rollflow.cluster.ray_nodes import NODE_RESOURCE_PREFIX

    c = config.cluster
    wanted = {"CPU": float(c.trainer_cpus)}
    if c.trainer_gpus > 0:
        wanted["GPU"] = c.trainer_gpus
    if c.trainer_node is not None:
        wanted[NODE_RESOURCE_PREFIX + c.trainer_node] = 0.001
    return wanted


def ray_options(config: RunConfig, *, retries: int) -> dict[str, Any]:
    """``ray.remote`` options of the training task: its resources, a fresh worker each time."""
    custom = trainer_resources(config)
    options: dict[str, Any] = {
        "num_cpus": custom.pop("CPU"), "max_calls": 1, "max_retries": retries, "retry_exceptions": False,
    }  # fmt: skip
    if "GPU" in custom:
        options["num_gpus"] = custom.pop("GPU")
    if custom:
        options["resources"] = custom
    return options


def unplaceable(config: RunConfig) -> str | None:
    """Why no live node of the cluster can run the training task (None: one can)."""
    import ray

    from rollflow.cluster.ray_nodes import NODE_RESOURCE_PREFIX

    wanted = trainer_resources(config)
    alive = [info.get("Resources", {}) for info in ray.nodes() if info["Alive"]]
    if any(all(total.get(k, 0.0) >= v for k, v in wanted.items()) for total in alive):
        return None
    node = config.cluster.trainer_node
    if node is not None and not any(NODE_RESOURCE_PREFIX + node in total for total in alive):
        return f"the trainer's node {node!r} is not alive (it died, or left the cluster)"
    asked = ", ".join(f"{k} {v:g}" for k, v in sorted(wanted.items()))
    return f"no live node has the resources the trainer asks for ({asked})"


def cluster_trainer(config: RunConfig, address: str) -> RayTrainer | None:
    """The run's trainer on the cluster at ``address``, where ``[cluster]`` places it there;
    None: the train stage runs in this process."""
    return RayTrainer(address) if config.cluster.trains_on_cluster else None
