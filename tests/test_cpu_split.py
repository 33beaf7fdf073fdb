"""Async on the CPU: the managed vLLM server's cores and the trainer's threads, apart
(``generators/cpu_split.py``); what reaches the server's environment, and where nothing is split."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rollflow.config.rollout import RolloutConfig
from rollflow.config.run import ModelConfig, RunConfig
from rollflow.generators import cpu_split
from rollflow.generators.cpu_split import async_cpu_split, trainer_threads
from rollflow.generators.vllm_generator import server_spec
from rollflow.policy.vllm_spec import VLLMServerSpec


def _async(model_dir: Path, **rollout: object) -> RunConfig:
    return RunConfig(
        model=ModelConfig(path=str(model_dir)),
        rollout=RolloutConfig(**{"backend": "vllm", "max_steps_off_policy": 1, **rollout}),  # type: ignore[arg-type]
    )


@pytest.fixture
def cores(monkeypatch: pytest.MonkeyPatch) -> list[set[int]]:
    """The cores this process may use, as the test says."""
    allowed = [{0, 1}]
    monkeypatch.setattr(cpu_split.os, "sched_getaffinity", lambda pid: allowed[0])
    return allowed


def test_an_async_run_on_two_cores_gives_the_server_one_and_the_trainer_the_other(
    cores: list[set[int]], tiny_model_dir: Path
) -> None:
    config = _async(tiny_model_dir)
    assert async_cpu_split(config) == ((0,), (1,))
    cores[0] = set(range(16))
    assert async_cpu_split(config) == (tuple(range(8)), tuple(range(8, 16)))
    cores[0] = {2, 5, 7}  # whatever this process may use, in order: the server gets the first half
    assert async_cpu_split(config) == ((2,), (5, 7))


def test_nothing_is_split_where_the_two_never_share_the_cores(cores: list[set[int]], tiny_model_dir: Path) -> None:
    config = _async(tiny_model_dir)
    assert async_cpu_split(replace(config, rollout=replace(config.rollout, max_steps_off_policy=None))) is None
    assert async_cpu_split(replace(config, rollout=replace(config.rollout, split_cpus=False))) is None
    external = replace(config, rollout=replace(config.rollout, base_urls=("http://127.0.0.1:9/v1",)))
    assert async_cpu_split(external) is None, "the user's servers are not on our cores"
    cores[0] = {0}
    assert async_cpu_split(config) is None


def test_the_managed_server_of_an_async_run_is_bound_to_the_cores_its_schedule_passes(
    cores: list[set[int]], tiny_model_dir: Path
) -> None:
    config = _async(tiny_model_dir)
    split = async_cpu_split(config)
    assert split is not None
    spec = server_spec(config, versions_in_flight=3, cpus=split[0])
    assert spec.cpus == (0,)
    env = spec.environment({})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0" and env["OMP_NUM_THREADS"] == "1"
    assert spec.environment({"VLLM_CPU_OMP_THREADS_BIND": "1"})["VLLM_CPU_OMP_THREADS_BIND"] == "1", "the user's wins"


def test_a_server_opened_outside_the_async_schedule_gets_every_core_even_for_an_async_config(
    cores: list[set[int]], tiny_model_dir: Path
) -> None:
    """The review's R5: a resumed run's last validation, an evaluation or the pipeline's
    champion check open a server for an async config with no trainer beside it; before,
    it was bound to half the cores."""
    assert server_spec(_async(tiny_model_dir), versions_in_flight=1).cpus == ()
    assert server_spec(_async(tiny_model_dir, max_steps_off_policy=None), versions_in_flight=1).cpus == ()


def test_the_async_opener_binds_its_server_to_the_cores_it_is_given(
    fake_vllm: object, cores: list[set[int]], tiny_model_dir: Path, tmp_path: Path
) -> None:
    from fake_vllm import FakeServer

    from rollflow.generators.async_generator import open_async_generator
    from rollflow.storage.runfolder import RunFolder

    config = _async(tiny_model_dir, weight_sync_type="pipeline")
    with open_async_generator(config, RunFolder(tmp_path / "run"), 0, cpus=(0,)):
        assert [spec.cpus for spec in FakeServer.specs] == [(0,)]


def test_replicas_on_a_cluster_node_deal_that_nodes_cores_among_them(tiny_model_dir: Path) -> None:
    """The review's R5: two replicas placed on one node both bound every core of it."""
    from rollflow.cluster.ray_replicas import node_share
    from rollflow.config.run import parse_config

    def placed(nodes: list[str], replicas: int, mode: str = "address") -> RunConfig:
        cluster = {"mode": "local", "num_worker_nodes": 1} if mode == "local" else {"mode": "address", "address": "10.0.0.5:6379"}
        return parse_config({"cluster": {**cluster, "generator_nodes": nodes},
                             "rollout": {"backend": "vllm", "num_generator_replicas": replicas}})  # fmt: skip

    assert [node_share(placed(["head"], 2), i) for i in range(2)] == [(0, 2), (1, 2)]
    assert [node_share(placed(["head", "worker-1"], 4), i) for i in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert [node_share(placed(["head", "worker-1"], 2), i) for i in range(2)] == [(0, 1), (0, 1)]
    # a local cluster's nodes are this machine: every replica shares its cores
    assert [node_share(placed(["head", "worker-1"], 2, "local"), i) for i in range(2)] == [(0, 2), (1, 2)]
    assert cpu_split.deal_cores((0, 1, 2, 3), 1, 2) == (1, 3)
    assert cpu_split.deal_cores((0, 1), 1, 3) == (0, 1), "fewer cores than replicas: they share"


def test_a_replica_actor_binds_its_share_of_its_nodes_cores(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rollflow.cluster import ray_replicas

    monkeypatch.setattr(ray_replicas.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    python = sys.executable  # never started: any Python stands in for vLLM's (make test-fast builds none)
    spec = VLLMServerSpec(str(tiny_model_dir), python=python, api_key="k")  # a node's address needs one
    assert ray_replicas.ReplicaHost(spec, None, 1.0, (1, 2)).server.spec.cpus == (1, 3)
    assert ray_replicas.ReplicaHost(spec, None, 1.0).server.spec.cpus == (), "alone on its node: every core"
    given = VLLMServerSpec(str(tiny_model_dir), cpus=(4, 5, 6, 7), python=python, api_key="k")  # a local cluster's: the split's cores
    assert ray_replicas.ReplicaHost(given, None, 1.0, (0, 2)).server.spec.cpus == (4, 6)


def test_a_spec_without_cores_binds_every_core_this_process_may_use(tiny_model_dir: Path) -> None:
    import os

    from rollflow.policy.vllm_cpu import cpu_list

    env = VLLMServerSpec(str(tiny_model_dir)).environment({})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == cpu_list(os.sched_getaffinity(0))


def test_the_trainers_threads_are_set_while_open_and_restored_after() -> None:
    before = torch.get_num_threads()
    with trainer_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), trainer_threads(1):
        raise RuntimeError("a stage fell over")
    assert torch.get_num_threads() == before
    with trainer_threads(None):
        assert torch.get_num_threads() == before
