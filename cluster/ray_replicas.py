"""The run's managed vLLM replicas as long-lived Ray actors on the nodes ``[cluster]`` names.

With ``[cluster].generator_nodes`` or ``[cluster].generator_gpus`` (lockstep runs on a
cluster), each of the ``[rollout].num_generator_replicas`` managed servers is started by an
actor (``ReplicaHost``) on its node instead of by the run's process: replica i on
``generator_nodes[i % n]`` (hard placement, through the node's ``rollflow_node_<name>``
resource), with ``generator_gpus`` GPUs (Ray sets the actor's ``CUDA_VISIBLE_DEVICES``, which
the server inherits) and ``generator_cpus`` CPUs of Ray's accounting. The server listens on
its node's address, so the driver and every node reach it. Replicas that share cores deal
them among them (``deal_cores``: each binds every n-th of the cores given in the spec, else
of those its actor may use), as replicas started on one machine do: those placed on one
node of a remote cluster, and all of a local cluster's (its nodes are this machine); a
replica replaced onto another node keeps the share it had. Its log is the run folder's
``logs/vllm-server[-i].log`` (a shared filesystem), and it reads the base model, the merged
versions and the adapters at the run's paths.

The driver holds one ``RemoteServer`` per replica: the face of ``VLLMServer`` that
``VLLMGenerator`` uses (``start``, ``running``, ``describe_exit``, ``restart``, ``stop``,
``log_tail``), each call a small actor call. Everything else is the one generator's, as on
one machine: sessions dealt over the replicas' URLs, each version published to all before
it is sampled, health checked after each chunk, a dead one restarted alone.

Faults: a server that died while its actor lives is restarted by the actor (same node). An
actor that died (its node killed, or the actor process) is replaced: a new actor on the
same node if it is alive, else on any live node that has the resources it asks for (a
replica is never left unplaced for want of its named node); the log says where.

The actors are the run's: the generator stops them (and their servers) when it closes,
and Ray ends an actor whose driver exits; a server started by an actor dies with the
actor's thread (``parent_death_signal``), its engine core dies with the server
(``policy/vllm_fork_start.py``), and a local cluster's ``stop()`` ends every process that
carries its mark.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollflow.config.run import RunConfig
from rollflow.generators.cpu_split import deal_cores
from rollflow.policy.vllm_server import VLLMServer
from rollflow.policy.vllm_spec import VLLMServerSpec

CALL_TIMEOUT_S = 30.0  # an actor call other than a start
STOP_TIMEOUT_S = 30.0


@dataclasses.dataclass(frozen=True)
class ReplicaState:
    """What the driver knows of a replica after each actor call."""

    base_url: str
    running: bool
    exit: str  # VLLMServer.describe_exit()
    startup_s: float | None
    node: str
    log_path: str


class ReplicaHost:
    """The actor: one ``VLLMServer`` on this node (decorated by ``ray.remote`` at placement)."""

    def __init__(
        self, spec: VLLMServerSpec, log_path: str | None, startup_timeout_s: float, share: tuple[int, int] = (0, 1)
    ) -> None:  # fmt: skip
        import ray

        cores = spec.cpus or tuple(sorted(os.sched_getaffinity(0)))
        spec = dataclasses.replace(
            spec, host=ray.util.get_node_ip_address(), cpus=deal_cores(cores, *share) if share[1] > 1 else spec.cpus
        )  # fmt: skip
        self.server = VLLMServer(spec, log_path=Path(log_path) if log_path else None, startup_timeout_s=startup_timeout_s)

    def start(self) -> ReplicaState:
        self.server.start()
        return self.state()

    def restart(self, reason: str, log_path: str | None) -> ReplicaState:
        self.server.restart(reason, log_path=Path(log_path) if log_path else None)
        return self.state()

    def state(self) -> ReplicaState:
        from rollflow.cluster.ray_rollout import this_node

        server = self.server
        return ReplicaState(
            base_url=server.base_url if server.port is not None else "",
            running=server.running, exit=server.describe_exit(), startup_s=server.startup_s,
            node=this_node(), log_path=str(server.log_path or ""),
        )  # fmt: skip

    def log_tail(self) -> str:
        return self.server.log_tail()

    def stop(self) -> None:
        self.server.stop()


class RemoteServer:
    """The driver's handle on replica ``index``'s actor (see the module docstring)."""

    def __init__(
        self, config: RunConfig, spec: VLLMServerSpec, index: int, log_path: Path | None, startup_timeout_s: float
    ) -> None:  # fmt: skip
        cluster = config.cluster
        self.spec, self.index, self.log_path, self.startup_timeout_s = spec, index, log_path, startup_timeout_s
        self.node = cluster.generator_nodes[index % len(cluster.generator_nodes)] if cluster.generator_nodes else None
        self.gpus, self.cpus = cluster.generator_gpus, cluster.generator_cpus
        self.share = node_share(config, index)
        self.restarts = 0
        self.startup_s: float | None = None
        self._actor: Any = None
        self._starting: Any = None  # the actor's start call while it runs
        self._wanted = ""  # where it was asked to go, for errors
        self._state: ReplicaState | None = None
        self._lost: str | None = None  # why the actor is gone, once a call found it dead

    # ---- the face of VLLMServer

    @property
    def base_url(self) -> str:
        if self._state is None or not self._state.base_url:
            raise RuntimeError(f"replica {self.index} has not been started")
        return self._state.base_url

    @property
    def running(self) -> bool:
        state = self._call("state")
        return state is not None and state.running

    def describe_exit(self) -> str:
        if self._lost is not None:
            return f"lost its Ray actor ({self._lost})"
        return self._state.exit if self._state is not None else "was never started"

    def start(self) -> RemoteServer:
        return self.spawn().wait_ready()

    def spawn(self) -> RemoteServer:
        """Place the actor and ask it to start its server (not waiting)."""
        self._spawn(self.node)
        return self

    def wait_ready(self) -> RemoteServer:
        """Wait until the actor's server serves (``RuntimeError`` naming the placement if not)."""
        self._await()
        return self

    def restart(self, reason: str, *, log_path: Path | None = None) -> RemoteServer:
        """The actor restarts its server; an actor that is gone is replaced (module docstring)."""
        import ray

        if log_path is not None:
            self.log_path = log_path
        state = self._call("restart", reason, self._log_arg(), timeout=self.startup_timeout_s + CALL_TIMEOUT_S)
        if state is None:  # the actor (its node) is gone: a new one
            try:
                ray.kill(self._actor, no_restart=True)
            except Exception:  # noqa: BLE001 - an actor already gone
                pass
            self._note(f"rollflow: replacing replica {self.index}'s Ray actor ({self._lost}): {reason}")
            self._spawn(self.node if self._node_alive(self.node) else None)
            self._await()
        self.restarts += 1
        return self

    def stop(self, grace_s: float = STOP_TIMEOUT_S) -> None:
        import ray

        actor, self._actor = self._actor, None
        if actor is None or not ray.is_initialized():
            return
        try:
            ray.get(actor.stop.remote(), timeout=grace_s)
        except Exception:  # noqa: BLE001 - an actor already gone (its server went with it) or stuck
            pass
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass

    def log_tail(self) -> str:
        if self.log_path is not None and self.log_path.is_file():
            return VLLMServer.read_tail(self.log_path)
        tail = self._call("log_tail")
        return tail if isinstance(tail, str) else "(no log)"

    # ---- placement

    def _spawn(self, node: str | None) -> None:
        import ray

        from rollflow.cluster.ray_nodes import NODE_RESOURCE_PREFIX

        resources = {NODE_RESOURCE_PREFIX + node: 0.001} if node is not None else {}
        host = ray.remote(ReplicaHost).options(  # type: ignore[attr-defined]
            num_cpus=self.cpus, num_gpus=self.gpus, resources=resources, max_restarts=0, max_task_retries=0,
        )  # fmt: skip
        self._actor = host.remote(self.spec, self._log_arg(), self.startup_timeout_s, self.share)
        self._starting = self._actor.start.remote()
        self._wanted = f"node {node!r}" if node is not None else "any node"
        self._lost = None

    def _await(self) -> None:
        import ray

        wanted = self._wanted
        try:
            self._state = ray.get(self._starting, timeout=self.startup_timeout_s + CALL_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            self.stop()
            raise RuntimeError(
                f"replica {self.index} was not serving within {self.startup_timeout_s:.0f} s of being placed on "
                f"{wanted} ({self.gpus} GPUs, {self.cpus} CPUs): no node can hold it, or its server is slow "
                "to start ([rollout].vllm_startup_timeout_s)"
            ) from None
        except ray.exceptions.RayTaskError as error:  # the server failed to start: its own error
            self.stop()
            raise error.as_instanceof_cause() from None
        self.startup_s = self._state.startup_s
        print(f"  vLLM: replica {self.index} serving on node {self._state.node} at {self._state.base_url}",
              file=sys.stderr, flush=True)  # fmt: skip

    def _call(self, method: str, *args: object, timeout: float = CALL_TIMEOUT_S) -> Any:
        """The actor's ``method``; None when the actor is gone (``_lost`` says why)."""
        import ray

        if self._actor is None:
            return None
        try:
            result = ray.get(getattr(self._actor, method).remote(*args), timeout=timeout)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as error:
            self._lost = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            return None
        if isinstance(result, ReplicaState):
            self._state = result
            self.startup_s = result.startup_s
        return result

    def _log_arg(self) -> str | None:
        return str(self.log_path) if self.log_path is not None else None

    def _note(self, line: str) -> None:
        print(f"  vLLM: {line.removeprefix('rollflow: ')}", file=sys.stderr, flush=True)
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with self.log_path.open("a", encoding="utf-8") as log:
                log.write(f"\n{line}\n")

    @staticmethod
    def _node_alive(node: str | None) -> bool:
        from rollflow.cluster.ray_nodes import ray_nodes

        return node is not None and node in ray_nodes()


def node_share(config: RunConfig, index: int) -> tuple[int, int]:
    """(replica ``index``'s place among the replicas that share its cores, how many share
    them): on a local cluster every node is this machine, so all the replicas; on a remote
    one those ``generator_nodes`` puts on its node; (0, 1) where no node is named (each
    goes where its GPUs are)."""
    nodes = config.cluster.generator_nodes
    if config.cluster.mode == "local":
        return index, config.rollout.num_generator_replicas
    if not nodes:
        return 0, 1
    node_of = [nodes[i % len(nodes)] for i in range(config.rollout.num_generator_replicas)]
    mates = [i for i, node in enumerate(node_of) if node == node_of[index]]
    return mates.index(index), len(mates)


def replica_host(config: RunConfig):  # noqa: ANN201 - a ServerHost (generators/managed_server.py) or None
    """What starts the run's managed replicas on the cluster; None where ``[cluster]`` places none."""
    if not config.cluster.serves_generators:
        return None

    def host(specs: Sequence[VLLMServerSpec], logs: Sequence[Path | None], startup_timeout_s: float) -> list[RemoteServer]:
        return [RemoteServer(config, spec, i, log, startup_timeout_s) for i, (spec, log) in enumerate(zip(specs, logs, strict=True))]

    return host
