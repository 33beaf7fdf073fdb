"""A Ray cluster for a run: a local one that rollflow starts and always stops, or an existing one.

Prefect reaches it through prefect-ray's ``RayTaskRunner`` (``task_runner``): each task
submitted in the flow becomes a stateless Ray remote function that runs Prefect's task
engine on some node and returns the task's final Prefect state. No actors, and tasks pass
file paths, never data: every node must see the run folder (a shared filesystem).

``LocalRayCluster`` is a real multi-node cluster on one machine: a head node and
``num_worker_nodes`` worker nodes, each its own ``ray start --block`` process with its own
CPU budget and a custom resource ``rollflow_node_<name>`` that names it. Each node is
- one session of its own (``start_new_session``): the ``ray start`` process leads it, and
  its GCS server, raylet, agents and Ray workers stay in it (Ray workers get a process group
  of their own, but never a new session), so ``kill_node`` SIGKILLs every process of that
  session at once: a node death as Ray sees a crashed machine;
- marked: every process of the cluster inherits ``ROLLFLOW_RAY_CLUSTER=<its temp dir>`` in
  its environment, which also finds a process that left the session (a task that started
  its own server in a new session);
- tied to the run: the run's watchdog (``policy/procs.py``, started here when the run has
  none) ends the node groups when the run is SIGKILLed, and each ``ray start`` is
  SIGKILLed by the kernel when the thread that started it ends (``parent_death_signal``);
- optionally pinned to cores of its own (``pin_cores``: ``sched_setaffinity`` in the
  child, what ``taskset -c`` does), inherited by everything the node starts.

``stop()`` (also ``__exit__``, also after a failed start) disconnects this process, ends
every process in the nodes' sessions or carrying the mark (SIGTERM, SIGKILL after
``procs.TERM_GRACE_S``), reaps the ``ray start`` processes and removes the temp dir.

Addresses: every node advertises ``NODE_IP`` (127.0.0.2), a loopback address. Ray turns
127.0.0.1 into the machine's network address on Linux (``resolve_ip_for_localhost``) and
refuses it for multi-node clusters, so another address of the loopback network is used.
Ray still *listens* on every interface for some of its servers (gRPC ports, measured with
``ss``); on an untrusted network a firewall must keep those ports closed.

``ExistingRayCluster`` joins a cluster by its GCS address and never stops it.

Simplified, and why:
- The head runs with fast node-death detection (GCS health checks every second, dead
  after 3 misses, instead of Ray's 3 s and 5): its nodes are local processes, so a missed
  check is a death, not a slow network; a killed node's tasks are retried seconds later.
- Ray's dashboard UI is not started; the cluster is for the run, read through Prefect's UI.
- Node logs live in the temp dir and go with it at ``stop()``; a failed start quotes the
  tail of the node's log in its error.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from rollflow.cluster.ray_nodes import NODE_RESOURCE_PREFIX, ClusterError, RayNode, connect, ray_nodes
from rollflow.policy import procs

if TYPE_CHECKING:
    from rollflow.config.cluster import ClusterConfig

NODE_IP = "127.0.0.2"
MARK_ENV = "ROLLFLOW_RAY_CLUSTER"
HEAD = "head"
STOP_WAIT_S = 10.0
_FAST_NODE_DEATH = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}


# ---------------------------------------------------------------- an existing cluster


class ExistingRayCluster:
    """A cluster someone else runs: joined by its GCS address, never stopped."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._connected = False

    def start(self) -> ExistingRayCluster:
        self._connected = connect(self.address)
        return self

    def nodes(self) -> dict[str, RayNode]:
        return ray_nodes()

    def stop(self) -> list[str]:
        """Disconnect this process (when it connected); the cluster runs on."""
        if self._connected:
            import ray

            ray.shutdown()
            self._connected = False
        return []

    def __enter__(self) -> ExistingRayCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def open_cluster(
    config: ClusterConfig, env: dict[str, str] | None = None
) -> LocalRayCluster | ExistingRayCluster | None:
    """The cluster ``[cluster]`` names, not yet started (use it as a context manager);
    None for mode "none". ``env``: more environment for a local cluster's nodes."""
    if config.mode == "none":
        return None
    if config.mode == "address":
        assert config.address is not None  # ClusterConfig checks it
        return ExistingRayCluster(config.address)
    return LocalRayCluster(
        num_worker_nodes=config.num_worker_nodes,
        head_cpus=config.head_cpus,
        cpus_per_node=config.cpus_per_node,
        memory_bytes_per_node=int(config.memory_gib_per_node * 2**30),
        object_store_bytes_per_node=config.object_store_mib_per_node * 2**20,
        pin_cores=config.pin_cores,
        startup_timeout_s=config.startup_timeout_s,
        env=env,
    )


# ---------------------------------------------------------------- a local cluster


@dataclass(frozen=True)
class _NodeSpec:
    name: str
    cpus: int
    cores: tuple[int, ...] | None


class LocalRayCluster:
    """A head and ``num_worker_nodes`` worker nodes on this machine (see the module docstring)."""

    def __init__(
        self,
        num_worker_nodes: int = 1,
        *,
        head_cpus: int = 1,
        cpus_per_node: int = 1,
        memory_bytes_per_node: int = 2 * 2**30,
        object_store_bytes_per_node: int = 256 * 2**20,
        pin_cores: bool = False,
        startup_timeout_s: float = 120.0,
        env: dict[str, str] | None = None,  # more environment for every node (e.g. PYTHONPATH)
    ) -> None:
        self.specs = [_NodeSpec(HEAD, head_cpus, None)] + [
            _NodeSpec(f"worker-{i}", cpus_per_node, None) for i in range(1, num_worker_nodes + 1)
        ]
        if pin_cores:
            self.specs = _pinned(self.specs)
        self.memory_bytes = memory_bytes_per_node
        self.object_store_bytes = object_store_bytes_per_node
        self.startup_timeout_s = startup_timeout_s
        self.extra_env = dict(env or {})
        self.address = ""
        self.temp_dir: Path | None = None
        self._nodes: dict[str, subprocess.Popen[bytes]] = {}
        self._connected = False

    # -------------------------------------------------------------- start

    def start(self) -> LocalRayCluster:
        procs.start_watchdog()  # a SIGKILLed run still ends its nodes
        self.temp_dir = Path(tempfile.mkdtemp(prefix="rf-ray-", dir="/tmp"))  # short: Ray's socket paths
        try:
            port = _free_port()
            self.address = f"{NODE_IP}:{port}"
            head = self.specs[0]
            self._launch(head, ["--head", f"--port={port}", "--include-dashboard=false",
                                f"--dashboard-port={_free_port()}", f"--ray-client-server-port={_free_port()}",
                                f"--temp-dir={self.temp_dir}"])  # fmt: skip
            self._wait_for({HEAD})
            self._connected = connect(self.address)
            for spec in self.specs[1:]:
                self._launch(spec, [f"--address={self.address}"])
            self._wait_for({spec.name for spec in self.specs})
        except BaseException:
            self.stop()
            raise
        return self

    def _launch(self, spec: _NodeSpec, role_args: list[str]) -> None:
        assert self.temp_dir is not None
        command = [
            str(Path(sys.executable).parent / "ray"), "start", *role_args, "--block",
            f"--node-ip-address={NODE_IP}", f"--num-cpus={spec.cpus}",
            f"--resources={json.dumps({NODE_RESOURCE_PREFIX + spec.name: 1})}",
            f"--memory={self.memory_bytes}", f"--object-store-memory={self.object_store_bytes}",
            f"--dashboard-agent-listen-port={_free_port()}", "--disable-usage-stats",
        ]  # fmt: skip
        env = {**os.environ, **self.extra_env, **_FAST_NODE_DEATH, MARK_ENV: str(self.temp_dir),
               "RAY_USAGE_STATS_ENABLED": "0"}  # fmt: skip
        log = (self.temp_dir / f"{spec.name}.log").open("wb")
        with log:
            self._nodes[spec.name] = subprocess.Popen(
                command, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=_node_preexec(spec.cores),
            )  # fmt: skip

    def _wait_for(self, names: set[str]) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            for name, process in self._nodes.items():
                if process.poll() is not None:
                    raise ClusterError(f"Ray node {name!r} exited with {process.returncode}:\n{self._log_tail(name)}")
            if self._connected and names <= set(ray_nodes()):
                return
            if not self._connected and _accepts(self.address):
                return  # the head's GCS is up; the nodes are read once connected
            if time.monotonic() > deadline:
                missing = sorted(names - (set(ray_nodes()) if self._connected else set()))
                raise ClusterError(
                    f"Ray nodes {missing} did not join within {self.startup_timeout_s:.0f} s "
                    f"([cluster].startup_timeout_s):\n{self._log_tail(missing[0] if missing else HEAD)}"
                )
            time.sleep(0.2)

    def _log_tail(self, name: str, lines: int = 15) -> str:
        assert self.temp_dir is not None
        try:
            return "\n".join((self.temp_dir / f"{name}.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    # -------------------------------------------------------------- while it runs

    def nodes(self) -> dict[str, RayNode]:
        """The live nodes by name ("head", "worker-1", ...)."""
        return ray_nodes()

    def kill_node(self, name: str, *, wait_dead_s: float = 30.0) -> None:
        """SIGKILL every process of worker node ``name`` at once (a machine's death, as Ray
        sees it), then wait until Ray reports the node dead."""
        if name == HEAD or name not in self._nodes:
            raise ValueError(f"kill_node takes a worker node ({sorted(set(self._nodes) - {HEAD})}); got {name!r}")
        process = self._nodes[name]
        members = [proc for proc in procs.process_table().values() if _session(proc.pid) == process.pid]
        for proc in members:
            target = procs._Target(proc)  # by identity: a reused pid is never hit
            target.signal(signal.SIGKILL)
            target.close()
        process.wait(timeout=STOP_WAIT_S)
        procs._wait_until(lambda: not any(procs.is_alive(proc) for proc in members), STOP_WAIT_S)
        if not procs._wait_until(lambda: name not in ray_nodes(), wait_dead_s):
            raise ClusterError(f"Ray still reports node {name!r} alive {wait_dead_s:.0f} s after its processes died")

    def restart_node(self, name: str) -> None:
        """Start worker node ``name`` again after ``kill_node`` (a machine back from a crash):
        same CPU budget and resource name, a new Ray node id."""
        specs = {spec.name: spec for spec in self.specs[1:]}
        if name not in specs or name in ray_nodes():
            raise ValueError(f"restart_node takes a dead worker node ({sorted(specs)}); got {name!r}")
        self._launch(specs[name], [f"--address={self.address}"])
        self._wait_for({name})

    def processes(self) -> dict[int, procs.Proc]:
        """Every live process of this cluster: in a node's session, or carrying its mark."""
        sessions = {process.pid for process in self._nodes.values()}
        mark = f"{MARK_ENV}={self.temp_dir}".encode()
        found = {}
        for proc in procs.process_table().values():
            if proc.state == "Z" or proc.pid == os.getpid():
                continue
            if _session(proc.pid) in sessions or (self.temp_dir is not None and _has_mark(proc.pid, mark)):
                found[proc.pid] = proc
        return found

    # -------------------------------------------------------------- stop

    def stop(self) -> list[str]:
        """End every process of the cluster; returns what had to be ended, as "PID (name)".
        Safe to call more than once and after a failed start."""
        if self._connected:
            import ray

            ray.shutdown()
            self._connected = False
        ended = procs.end_processes({proc.key: proc for proc in self.processes().values()})
        for process in self._nodes.values():
            procs.signal_group(process.pid, signal.SIGKILL)  # a member that sits outside /proc's view
            try:
                process.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                pass
        left = self.processes()
        if left:
            raise ClusterError(f"Ray processes outlived stop(): {sorted(left)}")
        self._nodes.clear()
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
        return ended

    def __enter__(self) -> LocalRayCluster:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


# ---------------------------------------------------------------- helpers


def _pinned(specs: list[_NodeSpec]) -> list[_NodeSpec]:
    """Give each node ``cpus`` cores of its own, in order, from the cores this process may use."""
    cores = sorted(os.sched_getaffinity(0))
    needed = sum(spec.cpus for spec in specs)
    if needed > len(cores):
        raise ClusterError(
            f"pin_cores needs {needed} cores (head_cpus + num_worker_nodes * cpus_per_node); "
            f"this process may use {len(cores)}: {cores}"
        )
    pinned, start = [], 0
    for spec in specs:
        pinned.append(_NodeSpec(spec.name, spec.cpus, tuple(cores[start:start + spec.cpus])))
        start += spec.cpus
    return pinned


def _node_preexec(cores: tuple[int, ...] | None) -> Callable[[], None]:
    tie = procs.parent_death_signal()

    def in_child() -> None:
        if cores is not None:
            os.sched_setaffinity(0, cores)
        if tie is not None:
            tie()

    return in_child


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((NODE_IP, 0))
        return int(probe.getsockname()[1])


def _accepts(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=0.5):
            return True
    except OSError:
        return False


def _session(pid: int) -> int | None:
    try:
        return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[3])
    except (OSError, IndexError, ValueError):
        return None


def _has_mark(pid: int, mark: bytes) -> bool:
    try:
        return mark in (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return False
