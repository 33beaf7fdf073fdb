"""The [cluster] section (config/cluster.py): defaults, round trip, and clear errors."""

from __future__ import annotations

import tomllib

import pytest

from rollflow.config.parsing import ConfigError
from rollflow.config.run import config_to_toml, parse_config


def test_no_cluster_is_the_default_and_a_local_one_round_trips_through_toml() -> None:
    assert parse_config({}).cluster.mode == "none"
    config = parse_config({"cluster": {"mode": "local", "num_worker_nodes": 2, "pin_cores": True}})
    assert parse_config(tomllib.loads(config_to_toml(config))) == config
    assert not config.cluster.trains_on_cluster, "the trainer stays in the run's process unless placed"
    placed = parse_config({"cluster": {"mode": "local", "num_worker_nodes": 2, "trainer_node": "worker-2", "cpus_per_node": 2,
                                       "trainer_cpus": 2}})  # fmt: skip
    assert placed.cluster.trains_on_cluster
    assert parse_config(tomllib.loads(config_to_toml(placed))) == placed
    gpus = parse_config({"cluster": {"mode": "address", "address": "10.0.0.5:6379", "trainer_gpus": 1}})
    assert gpus.cluster.trains_on_cluster and gpus.cluster.trainer_gpus == 1.0


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"mode": "locale"}, r"\[cluster\].mode must be one of 'none', 'local', 'address'"),
        ({"num_worker_node": 1}, r"did you mean 'num_worker_nodes'"),
        ({"mode": "address"}, r"needs \[cluster\].address"),
        ({"mode": "address", "address": "ray://head:10001"}, r"Ray Client address"),
        ({"mode": "address", "address": "head"}, r"HOST:PORT"),
        ({"address": "head:6379"}, r"\[cluster\].address is for mode = 'address'"),
        ({"object_store_mib_per_node": 10}, r"object_store_mib_per_node must be at least 75"),
        ({"cpus_per_node": 0}, r"cpus_per_node must be at least 1"),
        ({"memory_gib_per_node": 0}, r"memory_gib_per_node must be in \(0.0"),
        ({"trainer_node": "worker-1"}, r"place the trainer on a Ray cluster, and \[cluster\].mode is 'none'"),
        ({"trainer_gpus": 1}, r"place the trainer on a Ray cluster, and \[cluster\].mode is 'none'"),
        ({"mode": "local", "trainer_node": "worker-2"}, r"'worker-2' is not a node of the local cluster; "
         r"its nodes are \['head', 'worker-1'\]"),
        ({"mode": "local", "trainer_node": "worker-1", "trainer_cpus": 2}, r"trainer_cpus = 2 is more than node 'worker-1' has \(1"),
        ({"mode": "local", "trainer_node": "head", "trainer_gpus": 1}, r"trainer_gpus = 1.0 on a local cluster: its nodes have no GPUs"),
        ({"generator_nodes": ["head"]}, r"place the vLLM replicas on a Ray cluster, and \[cluster\].mode is 'none'"),
        ({"mode": "local", "generator_nodes": ["head", "worker-3"]}, r"generator_nodes \['worker-3'\] are not nodes of the local"),
        ({"mode": "local", "generator_gpus": 1}, r"generator_gpus = 1.0 on a local cluster: its nodes have no GPUs"),
        ({"mode": "local", "generator_nodes": ["worker-1"], "generator_cpus": 2}, r"generator_cpus = 2 is more than node 'worker-1'"),
        ({"mode": "local", "generator_nodes": "head"}, r"generator_nodes"),
        ({"trainer_cpus": 0}, r"trainer_cpus must be at least 1"),
    ],
)
def test_a_wrong_cluster_setting_names_itself(table: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"cluster": table})


@pytest.mark.parametrize(
    ("rollout", "message"),
    [
        ({"backend": "transformers"}, r"\[rollout\].backend = 'transformers' is not supported: on a cluster"),
        ({"backend": "vllm", "max_steps_off_policy": 1}, r"async collection .* places nothing on the cluster"),
    ],
)
def test_a_training_run_refuses_what_a_cluster_does_not_run(rollout: dict[str, object], message: str) -> None:
    """Before: [cluster] was read and nothing acted on it, so these ran on one machine silently."""
    from rollflow.config.checks import check_run_config

    for mode in ({"mode": "local"}, {"mode": "address", "address": "10.0.0.5:6379"}):
        with pytest.raises(ConfigError, match=message):
            check_run_config(parse_config({"cluster": mode, "rollout": rollout}))
    check_run_config(parse_config({"rollout": rollout}))  # without a cluster: fine
    check_run_config(parse_config({"cluster": {"mode": "local"}, "rollout": {"backend": "vllm"}}))


def test_replicas_placed_on_the_cluster_must_be_rollflows_and_one_per_named_node_at_least() -> None:
    from rollflow.config.checks import check_run_config

    placed = {"mode": "local", "num_worker_nodes": 1, "generator_nodes": ["head", "worker-1"]}
    config = parse_config({"cluster": placed, "rollout": {"backend": "vllm", "num_generator_replicas": 2}})
    check_run_config(config)
    assert config.cluster.serves_generators and parse_config(tomllib.loads(config_to_toml(config))) == config
    with pytest.raises(ConfigError, match=r"names 2 nodes for 1 replica\(s\)"):
        check_run_config(parse_config({"cluster": placed, "rollout": {"backend": "vllm"}}))
    with pytest.raises(ConfigError, match=r"\[rollout\].base_urls names servers of your own: drop one"):
        check_run_config(parse_config({"cluster": {**placed, "generator_nodes": ["head"]},
                                       "rollout": {"backend": "vllm", "base_urls": ["http://10.0.0.9:8000/v1"]}}))  # fmt: skip


def test_an_async_run_on_a_cluster_places_its_trainer_or_its_replicas_there(monkeypatch: pytest.MonkeyPatch) -> None:
    """A local cluster's nodes share this machine's cores, so the split stands there (the
    review's R5: before, the driver's server bound every core while the worker trained); a
    side on a remote cluster's node has that node's cores: nothing to split here."""
    from rollflow.generators import cpu_split
    from rollflow.config.checks import check_run_config

    monkeypatch.setattr(cpu_split.os, "sched_getaffinity", lambda pid: {0, 1})
    rollout = {"backend": "vllm", "max_steps_off_policy": 1}
    for placed in ({"trainer_node": "worker-1"}, {"generator_nodes": ["head"]}):
        config = parse_config({"cluster": {"mode": "local", **placed}, "rollout": rollout})
        check_run_config(config)
        assert cpu_split.async_cpu_split(config) == ((0,), (1,))
    for placed in ({"trainer_gpus": 1}, {"generator_gpus": 1}):
        remote = parse_config({"cluster": {"mode": "address", "address": "10.0.0.1:6379", **placed}, "rollout": rollout})
        assert cpu_split.async_cpu_split(remote) is None
