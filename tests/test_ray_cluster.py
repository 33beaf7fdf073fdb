"""A real local Ray cluster (cluster/ray_cluster.py) under a Prefect flow with prefect-ray's RayTaskRunner.

One cluster for the module: a head and one worker node, one CPU each. The tests place
tasks on each node, kill the worker node in the middle of a chunk and check that the chunk
is redone once on the head (its part file written once, no Prefect task run doubled), and
that no process of the cluster is left afterwards, whatever the tests did (the fixture's
teardown checks /proc itself).

The flows and tasks are module-level so that Ray's workers import them from this file
(the nodes get this folder on PYTHONPATH) instead of pickling them by value.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("prefect_ray")

from prefect import flow, task
from rollflow.cluster.ray_cluster import MARK_ENV, LocalRayCluster
from rollflow.cluster.ray_nodes import ClusterError, remote_options_on, task_runner
from rollflow.storage.parquet import write_bytes_atomic

TESTS = Path(__file__).resolve().parent


def cluster_processes(mark: str) -> list[int]:
    """Live processes whose environment carries ``MARK_ENV=mark``, read from /proc directly."""
    needle = f"{MARK_ENV}={mark}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and needle in (entry / "environ").read_bytes().split(b"\0"):
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found.append(int(entry.name))
        except OSError:
            pass
    return found


def session_of(pid: int) -> int | None:
    try:
        return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[3])
    except OSError:
        return None


@contextmanager
def two_node_cluster(import_paths: list[str]) -> Iterator[LocalRayCluster]:
    """A head and one worker node, one CPU each, small object stores, with ``import_paths``
    on their PYTHONPATH; stopped at the end, and no process of it may outlive the stop."""
    started = time.monotonic()
    local = LocalRayCluster(
        num_worker_nodes=1, head_cpus=1, cpus_per_node=1,
        memory_bytes_per_node=2**30, object_store_bytes_per_node=100 * 2**20,
        env={"PYTHONPATH": os.pathsep.join(filter(None, import_paths))},
    )  # fmt: skip
    try:
        local.start()
        print(f"cluster up in {time.monotonic() - started:.1f} s")
        yield local
    finally:
        mark = str(local.temp_dir)
        stopping = time.monotonic()
        local.stop()
        print(f"cluster stopped in {time.monotonic() - stopping:.1f} s")
        assert cluster_processes(mark) == [], "Ray processes of the cluster outlived stop()"


@pytest.fixture(scope="module")
def cluster(prefect_harness: object) -> Iterator[LocalRayCluster]:
    with two_node_cluster([str(TESTS), os.environ.get("PYTHONPATH", "")]) as local:
        yield local


# ---------------------------------------------------------------- what runs on the nodes


@task
def where_am_i(label: str) -> dict[str, str]:
    import ray

    return {"label": label, "node_id": ray.get_runtime_context().get_node_id(), "pid": str(os.getpid())}


@flow
def placed_on_each_node(node_ids: dict[str, str], resources: dict[str, str]) -> list[dict[str, str]]:
    from prefect_ray.context import remote_options
    from rollflow.cluster.ray_nodes import RayNode

    futures = []
    for name, node_id in node_ids.items():
        with remote_options(**remote_options_on(RayNode(name, node_id, True, 1.0))):
            futures.append(where_am_i.submit(f"affinity:{name}"))
        with remote_options(resources={resources[name]: 1}):  # the node's own resource: a hard placement
            futures.append(where_am_i.submit(f"resource:{name}"))
    return [future.result() for future in futures]


@task
def rollout_chunk(index: int, folder: str, hold_s: float) -> str:
    """A stand-in for a chunk of rollouts: records each attempt, holds (until released, when
    ``hold_s`` > 0), then writes its part file atomically at a path fixed by its index and
    returns the path. A redone chunk rewrites the same file; a finished one is not redone."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    part = Path(folder) / f"part-{index:05d}.json"
    attempts = Path(folder) / "attempts"
    attempts.mkdir(exist_ok=True)
    (attempts / f"{index}-{node_id}-{os.getpid()}").touch()
    if part.exists():
        return str(part)
    deadline = time.monotonic() + hold_s
    while time.monotonic() < deadline and not (Path(folder) / "release").exists():
        time.sleep(0.1)
    write_bytes_atomic(json.dumps({"index": index, "node_id": node_id}).encode(), part)
    return str(part)


@flow
def chunks_over_nodes(node_ids: dict[str, str], folder: str, first_on: str) -> dict[str, object]:
    from prefect.runtime import flow_run
    from prefect_ray.context import remote_options
    from rollflow.cluster.ray_nodes import RayNode

    futures = []
    for index in range(3):
        name = first_on if index == 0 else "head"
        with remote_options(**remote_options_on(RayNode(name, node_ids[name], True, 1.0))):
            futures.append(rollout_chunk.submit(index, folder, 120.0 if index == 0 else 0.0))
    return {"flow_run_id": str(flow_run.id), "parts": [future.result() for future in futures]}


# ---------------------------------------------------------------- tests


@pytest.mark.slow  # 7 s in a loaded suite run (docs/testing.md)
def test_the_cluster_has_a_head_and_a_worker_with_their_own_cpus(cluster: LocalRayCluster) -> None:
    nodes = cluster.nodes()
    assert sorted(nodes) == ["head", "worker-1"]
    assert [nodes[name].cpus for name in ("head", "worker-1")] == [1.0, 1.0]
    assert len({node.node_id for node in nodes.values()}) == 2
    assert cluster.address.startswith("127.0.0.2:")
    assert cluster_processes(str(cluster.temp_dir)), "the mark must be on the cluster's processes"


def test_prefect_tasks_run_on_the_node_they_are_placed_on(cluster: LocalRayCluster) -> None:
    nodes = cluster.nodes()
    node_ids = {name: node.node_id for name, node in nodes.items()}
    with_runner = placed_on_each_node.with_options(task_runner=task_runner(cluster.address))
    results = with_runner(node_ids, {name: node.resource for name, node in nodes.items()})
    ran_on = {row["label"]: row["node_id"] for row in results}
    assert ran_on == {f"{how}:{name}": node_ids[name] for name in node_ids for how in ("affinity", "resource")}
    assert all(int(row["pid"]) != os.getpid() for row in results), "tasks must run in Ray workers"


@pytest.mark.slow  # 4 s in a loaded suite run (docs/testing.md)
def test_a_chunk_on_a_killed_node_is_redone_once_on_the_head(cluster: LocalRayCluster, tmp_path: Path) -> None:
    import ray
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    nodes = cluster.nodes()
    node_ids = {name: node.node_id for name, node in nodes.items()}
    worker_id, head_id = node_ids["worker-1"], node_ids["head"]
    attempts = tmp_path / "attempts"
    killed: list[float] = []

    def kill_the_worker_mid_chunk() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any(p.name.startswith(f"0-{worker_id}") for p in attempts.glob("*")):
            time.sleep(0.1)
        cluster.kill_node("worker-1")
        killed.append(time.monotonic())
        (tmp_path / "release").touch()  # the redone attempt finishes at once

    killer = threading.Thread(target=kill_the_worker_mid_chunk, daemon=True)
    killer.start()
    with_runner = chunks_over_nodes.with_options(task_runner=task_runner(cluster.address))
    result = with_runner(node_ids, str(tmp_path), "worker-1")
    killer.join(timeout=130)
    finished = time.monotonic()
    assert killed, "the worker node was never killed"
    print(f"chunk 0 redone {finished - killed[0]:.1f} s after the kill")

    parts = [Path(p) for p in result["parts"]]  # type: ignore[union-attr]
    assert [p.name for p in parts] == ["part-00000.json", "part-00001.json", "part-00002.json"]
    assert sorted(p.name for p in tmp_path.glob("part-*")) == [p.name for p in parts], "a part lost or doubled"
    written = [json.loads(p.read_text()) for p in parts]
    assert [row["index"] for row in written] == [0, 1, 2]
    assert written[0]["node_id"] == head_id, "chunk 0 must be redone on the surviving node"
    by_chunk: dict[str, list[str]] = {}
    for marker in attempts.iterdir():
        index, node_id, _ = marker.name.split("-")
        by_chunk.setdefault(index, []).append(node_id)
    assert sorted(by_chunk["0"]) == sorted([worker_id, head_id]), "chunk 0: one attempt killed, one redone"
    assert by_chunk["1"] == [head_id] and by_chunk["2"] == [head_id]
    assert "worker-1" not in cluster.nodes()
    worker_session = cluster._nodes["worker-1"].pid
    assert [p for p in cluster.processes().values() if session_of(p.pid) == worker_session] == []
    assert not any(n["NodeID"] == worker_id and n["Alive"] for n in ray.nodes())

    with get_client(sync_client=True) as client:
        flow_filter = FlowRunFilter(id=FlowRunFilterId(any_=[result["flow_run_id"]]))
        runs = client.read_task_runs(flow_run_filter=flow_filter)
    assert sorted(run.name.split("-")[0] for run in runs) == ["rollout_chunk"] * 3, "no task run doubled"
    assert {run.state_type.value for run in runs} == {"COMPLETED"}


def test_kill_node_refuses_the_head(cluster: LocalRayCluster) -> None:
    with pytest.raises(ValueError, match="worker node"):
        cluster.kill_node("head")


@pytest.mark.slow  # 3 s in a loaded suite run (docs/testing.md)
def test_pin_cores_refuses_more_cores_than_this_process_has() -> None:
    too_many = len(os.sched_getaffinity(0)) + 1
    with pytest.raises(ClusterError, match=f"pin_cores needs {too_many + 1} cores"):
        LocalRayCluster(num_worker_nodes=too_many, pin_cores=True)
