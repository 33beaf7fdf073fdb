"""Async on the CPU: the managed vLLM server's cores and the trainer's threads, apart
(``tasks/cpu_split.py``); what reaches the server's environment, and where nothing is split."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rollflow.policy.vllm_server import VLLMServerSpec
from rollflow.tasks import cpu_split
from rollflow.tasks.config import ModelConfig, RolloutConfig, RunConfig
from rollflow.tasks.cpu_split import async_cpu_split, trainer_threads
from rollflow.tasks.vllm_generator import server_spec


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


def test_the_managed_server_of_an_async_run_is_bound_to_its_cores(cores: list[set[int]], tiny_model_dir: Path) -> None:
    spec = server_spec(_async(tiny_model_dir), versions_in_flight=3)
    assert spec.cpus == (0,)
    env = spec.environment({})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0" and env["OMP_NUM_THREADS"] == "1"
    assert spec.environment({"VLLM_CPU_OMP_THREADS_BIND": "1"})["VLLM_CPU_OMP_THREADS_BIND"] == "1", "the user's wins"
    lockstep = _async(tiny_model_dir, max_steps_off_policy=None)
    assert server_spec(lockstep, versions_in_flight=1).cpus == ()


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
