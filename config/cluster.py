"""The ``[cluster]`` section: where a run's Ray work runs (``cluster/ray_cluster.py`` acts on it).

- ``mode = "none"`` (the default): no Ray; every stage runs in the run's own process tree,
  as before this section existed.
- ``mode = "local"``: rollflow starts a Ray cluster on this machine for the run and stops
  it after, whatever happened: a head node and ``num_worker_nodes`` worker nodes, each a
  ``ray start`` of its own with its own CPU budget, bound to a loopback address only.
- ``mode = "address"``: an existing cluster's GCS address ``HOST:PORT`` (what ``ray start
  --head`` prints); rollflow only connects to it and never stops it.

The memory settings keep a local cluster small on a machine that also holds a vLLM server
and a trainer: ``object_store_mib_per_node`` caps each node's object store (shared memory;
tasks pass file paths, so little goes through it), ``memory_gib_per_node`` is the memory
Ray may schedule on a node (a logical resource for placement, not an OS limit).

The trainer runs in the run's own process unless ``trainer_node`` or ``trainer_gpus`` places
it on the cluster (``cluster/ray_trainer.py``): ``trainer_node`` names a node rollflow named
("head", "worker-1", ... of a local cluster; on an existing cluster, a node started with the
resource ``rollflow_node_<name>``), ``trainer_gpus`` the GPUs the training task asks for
(any node with them), ``trainer_cpus`` its CPUs and torch threads.

Simplified on purpose: Ray Client addresses (``ray://HOST:10001``) are refused. Through
Ray Client every result and log goes through one proxy connection, which drops long runs
(prefect-ray's own docs and issues say so); run rollflow on a node of the cluster instead
(``ray job submit``, or a shell on the head) and give the head's GCS address.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from rollflow.config.parsing import ConfigError, at_least, check_types, in_range

ClusterMode = Literal["none", "local", "address"]
RAY_MIN_OBJECT_STORE_MIB = 75  # Ray refuses a smaller object store
_GCS_ADDRESS = re.compile(r"[A-Za-z0-9.\-]+:\d{1,5}|\[[0-9A-Fa-f:]+\]:\d{1,5}")


@dataclass(frozen=True)
class ClusterConfig:
    mode: ClusterMode = "none"
    address: str | None = None  # mode "address": the head's GCS address, HOST:PORT
    num_worker_nodes: int = 1  # mode "local": nodes besides the head
    head_cpus: int = 1  # the head's CPU budget (Ray's CPU resource; tasks ask for 1 each)
    cpus_per_node: int = 1  # each worker node's CPU budget
    memory_gib_per_node: float = 2.0  # schedulable memory per node (placement, not a cap)
    object_store_mib_per_node: int = 256  # each node's object store, a hard cap
    # Each local node on cores of its own (as ``taskset -c`` does); needs head_cpus +
    # num_worker_nodes * cpus_per_node cores free to this process.
    pin_cores: bool = False
    startup_timeout_s: float = 120.0  # every node must have joined within this
    # Where the train stage runs: None and 0 GPUs, the run's own process (the default);
    # else a Ray task on the named node, or on any node with trainer_gpus GPUs.
    trainer_node: str | None = None
    trainer_gpus: float = 0.0
    trainer_cpus: int = 1  # the training task's CPUs on the cluster, and its torch threads
    # Where the managed vLLM replicas ([rollout].num_generator_replicas) run: none named and
    # 0 GPUs, started by the run's own process (the default); else each a Ray actor, replica
    # i on generator_nodes[i % len], or on any node with generator_gpus GPUs
    generator_nodes: tuple[str, ...] = ()
    generator_gpus: float = 0.0
    generator_cpus: int = 0  # Ray CPUs each replica's actor holds (0: leaves the node's CPUs to tasks)

    @property
    def serves_generators(self) -> bool:
        """The managed vLLM replicas run as actors on the cluster (a mode other than "none" is checked)."""
        return bool(self.generator_nodes) or self.generator_gpus > 0

    @property
    def trains_on_cluster(self) -> bool:
        """The train stage runs on the cluster (a mode other than "none" is checked)."""
        return self.trainer_node is not None or self.trainer_gpus > 0

    def __post_init__(self) -> None:
        check_types(self, "cluster")
        for key in ("head_cpus", "cpus_per_node"):
            at_least(self, "cluster", key, 1)
        at_least(self, "cluster", "num_worker_nodes", 0)
        at_least(self, "cluster", "object_store_mib_per_node", RAY_MIN_OBJECT_STORE_MIB)
        in_range(self, "cluster", "memory_gib_per_node", 0.0, None, low_open=True)
        in_range(self, "cluster", "startup_timeout_s", 0.0, None, low_open=True)
        at_least(self, "cluster", "trainer_cpus", 1)
        in_range(self, "cluster", "trainer_gpus", 0.0, None)
        at_least(self, "cluster", "generator_cpus", 0)
        in_range(self, "cluster", "generator_gpus", 0.0, None)
        self._check_trainer()
        self._check_generators()
        if self.mode == "address":
            self._check_address()
        elif self.address is not None:
            raise ConfigError(
                f"[cluster].address is for mode = 'address'; got mode = {self.mode!r} "
                "(set mode = 'address' to join that cluster, or drop address)"
            )

    def local_node_cpus(self) -> dict[str, int]:
        """A local cluster's nodes by name, with their CPU budgets."""
        workers = {f"worker-{i}": self.cpus_per_node for i in range(1, self.num_worker_nodes + 1)}
        return {"head": self.head_cpus, **workers}

    def _check_trainer(self) -> None:
        if self.trains_on_cluster and self.mode == "none":
            raise ConfigError(
                "[cluster].trainer_node / trainer_gpus place the trainer on a Ray cluster, and "
                "[cluster].mode is 'none': set mode = 'local' or 'address', or drop them (the trainer "
                "then runs in the run's own process)"
            )
        if self.mode != "local" or self.trainer_node is None:
            return
        nodes = self.local_node_cpus()
        if self.trainer_node not in nodes:
            raise ConfigError(
                f"[cluster].trainer_node {self.trainer_node!r} is not a node of the local cluster; "
                f"its nodes are {sorted(nodes)} (num_worker_nodes = {self.num_worker_nodes})"
            )
        if self.trainer_cpus > nodes[self.trainer_node]:
            raise ConfigError(
                f"[cluster].trainer_cpus = {self.trainer_cpus} is more than node {self.trainer_node!r} has "
                f"({nodes[self.trainer_node]}: head_cpus / cpus_per_node); the training task could never start"
            )
        if self.trainer_gpus > 0:
            raise ConfigError(
                f"[cluster].trainer_gpus = {self.trainer_gpus} on a local cluster: its nodes have no GPUs "
                "(mode = 'local' starts CPU-only nodes); drop trainer_gpus, or join a cluster with GPUs "
                "(mode = 'address')"
            )

    def _check_generators(self) -> None:
        if self.serves_generators and self.mode == "none":
            raise ConfigError(
                "[cluster].generator_nodes / generator_gpus place the vLLM replicas on a Ray cluster, and "
                "[cluster].mode is 'none': set mode = 'local' or 'address', or drop them (the replicas "
                "then run beside the run's own process)"
            )
        if self.mode != "local":
            return
        nodes = self.local_node_cpus()
        unknown = [node for node in self.generator_nodes if node not in nodes]
        if unknown:
            raise ConfigError(
                f"[cluster].generator_nodes {unknown} are not nodes of the local cluster; its nodes are "
                f"{sorted(nodes)} (num_worker_nodes = {self.num_worker_nodes})"
            )
        if self.generator_gpus > 0:
            raise ConfigError(
                f"[cluster].generator_gpus = {self.generator_gpus} on a local cluster: its nodes have no GPUs "
                "(mode = 'local' starts CPU-only nodes); drop generator_gpus, or join a cluster with GPUs "
                "(mode = 'address')"
            )
        for node in self.generator_nodes:
            if self.generator_cpus > nodes[node]:
                raise ConfigError(
                    f"[cluster].generator_cpus = {self.generator_cpus} is more than node {node!r} has "
                    f"({nodes[node]}); the replica's actor could never be placed"
                )

    def _check_address(self) -> None:
        if self.address is None:
            raise ConfigError("[cluster].mode = 'address' needs [cluster].address, the head's HOST:PORT")
        if self.address.startswith("ray://"):
            raise ConfigError(
                f"[cluster].address {self.address!r} is a Ray Client address, which rollflow does not "
                "use (one proxy connection carries every result and drops long runs): run rollflow on "
                "a node of the cluster and give the head's GCS address, HOST:PORT (default port 6379)"
            )
        if _GCS_ADDRESS.fullmatch(self.address) is None:
            raise ConfigError(
                f"[cluster].address must be the head's GCS address HOST:PORT (e.g. '10.0.0.5:6379'); "
                f"got {self.address!r}"
            )
