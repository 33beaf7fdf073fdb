"""A Ray cluster's nodes as rollflow names them, and how work is placed on them.

Every node rollflow starts carries a custom resource ``rollflow_node_<name>`` that names it
(``LocalRayCluster``, ``cluster/ray_cluster.py``); ``ray_nodes`` reads the cluster's nodes
back by those names, ``remote_options_on`` places a task on one (softly: anywhere when it
died) with the retries a node's death earns, ``task_runner`` is prefect-ray's runner on the
cluster, and ``connect`` joins it as a driver. Ray is imported only inside these functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefect_ray import RayTaskRunner

NODE_RESOURCE_PREFIX = "rollflow_node_"
NODE_DEATH_RETRIES = 1  # a task on a node that died runs once more, elsewhere


class ClusterError(RuntimeError):
    """A Ray cluster did not start, or a node is not what was asked for."""


@dataclass(frozen=True)
class RayNode:
    """One node as Ray's GCS reports it."""

    name: str  # "head", "worker-1", ...: the resource rollflow_node_<name> names it
    node_id: str  # Ray's hex node id
    alive: bool
    cpus: float

    @property
    def resource(self) -> str:
        return NODE_RESOURCE_PREFIX + self.name


def ray_nodes(include_dead: bool = False) -> dict[str, RayNode]:
    """The cluster's nodes that rollflow named, by name (this process must be connected).

    A name seen alive and dead (a node killed and restarted) maps to the alive one.
    """
    import ray

    found: dict[str, RayNode] = {}
    for info in ray.nodes():
        resources = info.get("Resources", {})
        names = [key[len(NODE_RESOURCE_PREFIX):] for key in resources if key.startswith(NODE_RESOURCE_PREFIX)]
        if len(names) != 1 or not (info["Alive"] or include_dead):
            continue
        node = RayNode(names[0], info["NodeID"], bool(info["Alive"]), float(resources.get("CPU", 0.0)))
        if names[0] not in found or node.alive:
            found[names[0]] = node
    return found


def remote_options_on(node: RayNode | None = None, *, retries: int = NODE_DEATH_RETRIES) -> dict[str, Any]:
    """Ray options for tasks (``prefect_ray.context.remote_options(**...)``): on ``node`` when
    it is alive, else anywhere (soft affinity), and run ``retries`` more times when the node
    they run on dies. Exceptions inside a task are Prefect's: the task engine returns them as
    a Failed state, so Ray never retries them."""
    options: dict[str, Any] = {"max_retries": retries, "retry_exceptions": False}
    if node is not None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node.node_id, soft=True)
    return options


def task_runner(address: str) -> RayTaskRunner:
    """prefect-ray's task runner on the cluster at ``address`` (joined as a driver, not
    through Ray Client). When this process is connected already, it is reused and not
    disconnected when the flow ends."""
    from prefect_ray import RayTaskRunner

    return RayTaskRunner(address=address, init_kwargs={"logging_level": "WARNING", "log_to_driver": False})


def connect(address: str) -> bool:
    """Join the cluster at ``address`` as a driver; False when this process already was."""
    import ray

    if ray.is_initialized():
        return False
    ray.init(address=address, namespace="rollflow", logging_level="WARNING", log_to_driver=False)
    return True
