"""Managed vLLM replicas (``[rollout].num_generator_replicas``): one generator, two servers.

Real servers on the tiny model of tests/test_vllm_backend.py (two heads of 32), opened once
for the module and lent to the rollout stages (``lending.lend``). What is checked:
episodes are dealt to both replicas and each records which one sampled it; a version
published reaches every replica (each one's logprobs equal version 1's peft model); a replica
SIGKILLed mid-stage is restarted alone, given the version the others serve, and the stage's
episodes are all there once.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_vllm_backend import _adapter, _commit_checkpoint, _hf_logprobs, _with_adapter
from test_vllm_restart import _play

from rollflow.config.parsing import ConfigError
from rollflow.config.rollout import RolloutConfig
from rollflow.config.run import EnvConfig, ModelConfig, RunConfig
from rollflow.config.train import TrainConfig
from rollflow.generators.lending import lend
from rollflow.generators.run_generator import open_generator
from rollflow.generators.vllm_generator import VLLMGenerator, replica_log, server_specs
from rollflow.policy.models import build_tiny_model
from rollflow.storage.records import EpisodeRecord
from rollflow.storage.runfolder import RunFolder
from rollflow.storage.schemas import table_to_episode_records

MAX_LEN = 1024
TOLERANCE = 1e-4  # tests/test_vllm_backend.py's: vLLM vs an HF forward pass on the tiny model


def _config(model_dir: Path | str, **rollout: object) -> RunConfig:
    """Two chunks of two groups of two 2-turn episodes (tests/test_vllm_restart.py's shape)."""
    settings: dict[str, object] = dict(
        backend="vllm", max_model_length=MAX_LEN, max_completion_tokens=24, batch_size=4,
        episodes_per_task=2, concurrency=4, max_turns=2, vllm_kvcache_space_gib=1,
        generation_timeout_s=120.0, num_generator_replicas=2,
    )  # fmt: skip
    settings.update(rollout)
    return RunConfig(
        env=EnvConfig(name="varied_reward_env:load_environment"),
        model=ModelConfig(path=str(model_dir)),
        rollout=RolloutConfig(**settings),  # type: ignore[arg-type]
        train=TrainConfig(lora_rank=8, lora_alpha=16.0),
    )


# ---------------------------------------------------------------- the config (no vLLM)


@pytest.mark.parametrize(
    ("rollout", "named"),
    [
        ({"backend": "transformers"}, "needs backend = 'vllm'"),
        ({"base_urls": ("http://127.0.0.1:9/v1",)}, "no base_urls"),
        ({"num_generator_replicas": 0}, "num_generator_replicas"),
    ],
)
def test_replicas_are_refused_where_rollflow_starts_no_servers(rollout: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(named)):
        _config("/nowhere", **rollout)


def test_the_generators_cores_are_dealt_to_the_replicas(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = build_tiny_model(tmp_path / "model", hidden_size=64, num_heads=2)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert [spec.cpus for spec in server_specs(_config(model), versions_in_flight=1)] == [(0, 2), (1, 3)]
    three = server_specs(_config(model, num_generator_replicas=5), versions_in_flight=1)
    assert [spec.cpus for spec in three] == [(0, 1, 2, 3)] * 5  # fewer cores than replicas: shared
    one = server_specs(_config(model, num_generator_replicas=1), versions_in_flight=1)
    assert [spec.cpus for spec in one] == [()]  # one server: every core, as before replicas


_TIED_TO_ITS_PROCESS = """
import sys, time
sys.path.insert(0, sys.argv[1])
from rollflow.generators.vllm_generator import start_together
from rollflow.policy.vllm_server import VLLMServer
from rollflow.policy.vllm_spec import VLLMServerSpec
servers = [VLLMServer(VLLMServerSpec(sys.argv[2]), startup_timeout_s=60.0) for _ in range(2)]
start_together(servers)
print(" ".join(str(server._process.pid) for server in servers), flush=True)
time.sleep(600)
"""


@pytest.mark.slow  # 8 s in a loaded suite run (docs/testing.md)
def test_replicas_started_together_die_with_the_process_that_started_them(tmp_path: Path) -> None:
    """Started at once, yet each tied to its starter's life (``parent_death_signal``, which a
    server spawned from a thread would not get): the starter SIGKILLed, with no watchdog of a
    ``rollflow`` run to clean up, takes both servers with it. Stand-in servers (python's
    http.server on the port given) instead of vLLM."""
    import subprocess
    import sys

    import rollflow
    from test_vllm_server import _alive, _fake_python

    from rollflow.policy.vllm_spec import PYTHON_ENV

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (tmp_path / "health").write_text("ok")
    serve = f'exec {sys.executable} -m http.server --bind 127.0.0.1 "$(echo "$@" | sed "s/.*--port \\([0-9]*\\).*/\\1/")"'
    # TMPDIR: the SIGKILLed starter cannot delete its servers' temporary logs (left in /tmp before)
    env = {**os.environ, PYTHON_ENV: str(_fake_python(tmp_path, serve)), "TMPDIR": str(tmp_path)}
    root = str(Path(rollflow.__file__).resolve().parent.parent)
    starter = subprocess.Popen(
        [sys.executable, "-c", _TIED_TO_ITS_PROCESS, root, str(model)], cwd=tmp_path, env=env,
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert starter.stdout is not None
        pids = [int(pid) for pid in starter.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(pid) for pid in pids), pids
    finally:
        starter.kill()
        starter.wait()
    assert not any(_alive(pid) for pid in pids), "a replica outlived the process that started it"
    assert len(list(tmp_path.glob("rollflow-vllm-*.log"))) == 2  # in the test's folder, not /tmp


# ---------------------------------------------------------------- real servers


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("vllm-replicas-tiny"), hidden_size=64, num_heads=2)


@pytest.fixture(scope="module")
def run_config(model_dir: Path) -> RunConfig:
    return _config(model_dir)


@pytest.fixture(scope="module")
def replicas(run_config: RunConfig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMGenerator]:
    first = RunFolder(tmp_path_factory.mktemp("replicas") / "run")
    with open_generator(run_config, first, versions_in_flight=1) as opened, lend(opened) as lent:
        assert isinstance(lent, VLLMGenerator) and len(lent.servers) == 2
        yield lent
    assert not any(server.running for server in lent.servers), "a replica outlived its generator"


@pytest.fixture(scope="module")
def adapter(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _adapter(model_dir, tmp_path_factory.mktemp("replica-adapter") / "adapter", seed=1)


def _episodes(folder: RunFolder, step: int) -> list[EpisodeRecord]:
    return table_to_episode_records(folder.read_stage(step, "episodes"))


def _assert_version_1(model_dir: Path, adapter: Path, episodes: list[EpisodeRecord]) -> None:
    """Every action's logprobs are version 1's (the adapter), whichever replica sampled it."""
    sampler = _with_adapter(model_dir, adapter)
    for record in episodes:
        assert record.rollout.policy_version == 1, record.episode_id
        context: list[int] = []
        for action in record.rollout.actions:
            context += action.prompt_delta_ids
            expected = _hf_logprobs(sampler, context, action.token_ids, 1.0, 1.0)
            worst = max(abs(a - b) for a, b in zip(action.logprobs, expected, strict=True))
            assert worst < TOLERANCE, f"{record.episode_id} (replica {record.rollout.replica}): {worst:.2e} off"
            context += action.token_ids


@pytest.mark.slow
def test_episodes_are_dealt_to_both_replicas_and_each_serves_the_version_published(
    run_config: RunConfig, replicas: VLLMGenerator, model_dir: Path, adapter: Path, tmp_path: Path,
) -> None:  # fmt: skip
    folder = RunFolder(tmp_path / "run")
    _play(run_config, folder, 0)  # version 0: the base model
    base = _episodes(folder, 0)
    assert {e.rollout.replica for e in base} == {0, 1}, "episodes were not dealt to both replicas"
    _commit_checkpoint(folder, 0, adapter, version=1)  # LoRA merged: reloaded in place on both
    _play(run_config, folder, 1)
    episodes = _episodes(folder, 1)
    assert len({e.episode_id for e in episodes}) == 8 and {e.rollout.error for e in episodes} == {None}
    assert {e.rollout.replica for e in episodes} == {0, 1}
    _assert_version_1(model_dir, adapter, episodes)


class _ReplicaKiller(threading.Thread):
    """SIGKILLs replica ``index``'s process group once it has answered an action of this stage."""

    def __init__(self, generator: VLLMGenerator, index: int) -> None:
        super().__init__(daemon=True)
        self.generator, self.index = generator, index
        self.killed_pid: int | None = None

    def _served(self) -> int:
        url = self.generator.servers[self.index].base_url
        return sum(n for by, n in self.generator.policy.stats.sampled_by.items() if by.base_url == url)

    def run(self) -> None:
        deadline = time.monotonic() + 600  # then give up: the test's assertions say so
        before = self._served()
        while self._served() <= before and time.monotonic() < deadline:
            time.sleep(0.005)
        process = self.generator.servers[self.index]._process
        if process is not None and time.monotonic() < deadline:
            os.killpg(process.pid, signal.SIGKILL)
            self.killed_pid = process.pid


@pytest.mark.slow
def test_a_replica_killed_mid_stage_is_restarted_alone_with_the_version_the_other_serves(
    run_config: RunConfig, replicas: VLLMGenerator, model_dir: Path, adapter: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    folder = RunFolder(tmp_path / "run")
    _commit_checkpoint(folder, 0, adapter, version=1)
    survivor = replicas.servers[0]._process
    assert survivor is not None and survivor.poll() is None
    restarts = [server.restarts for server in replicas.servers]
    killer = _ReplicaKiller(replicas, 1)
    killer.start()
    _play(run_config, folder, 1)
    killer.join(timeout=5)
    assert killer.killed_pid is not None, "the replica was never killed"

    assert replicas.servers[0]._process is survivor and replicas.servers[0].restarts == restarts[0]
    assert replicas.servers[1].restarts == restarts[1] + 1 and replicas.servers[1].running
    assert replicas.servers[1]._process is not None and replicas.servers[1]._process.pid != killer.killed_pid
    err = capsys.readouterr().err
    assert re.search(r"of 4 episodes errored and were not written; restart 1/2", err), err
    assert "vLLM: restarting replica 1: " in err and "restarting replica 0" not in err, err
    log = replica_log(folder.root, 1).read_text()
    assert re.search(r"rollflow: restarting the vLLM server: http://127\.0\.0\.1:\d+/v1 was killed by SIGKILL", log)

    episodes = _episodes(folder, 1)
    assert len(episodes) == 8 and len({e.episode_id for e in episodes}) == 8
    assert {e.rollout.error for e in episodes} == {None}
    _assert_version_1(model_dir, adapter, episodes)  # the restarted replica was given version 1
    # and served some of it: the chunk after the restart is dealt to both replicas again
    assert any(e.rollout.replica == 1 for e in episodes if e.group_id.endswith(("/2", "/3"))), [
        (e.group_id, e.rollout.replica) for e in episodes
    ]


_INTERRUPTED_WHILE_STARTING = """
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # a background job starts with it ignored
sys.path.insert(0, sys.argv[1])
from rollflow.generators.vllm_generator import start_together
from rollflow.policy.vllm_server import VLLMServer
from rollflow.policy.vllm_spec import VLLMServerSpec
servers = [VLLMServer(VLLMServerSpec(sys.argv[2]), startup_timeout_s=600.0) for _ in range(2)]
start_together(servers)
"""


@pytest.mark.slow  # a few seconds: stand-in servers, no vLLM
def test_ctrl_c_while_replicas_start_stops_them_and_returns_at_once(tmp_path: Path) -> None:
    """Ctrl-C while two replicas start (found stuck in a test run: the main thread's
    KeyboardInterrupt waited in the thread pool's exit for both start-up waits, up to their
    10-minute timeout, the servers still starting). Now the starter stops both servers and
    the interrupt ends it. Stand-in servers that never answer ``/health``."""
    import subprocess
    import sys

    import rollflow
    from test_vllm_server import _alive, _fake_python

    from rollflow.policy.vllm_spec import PYTHON_ENV

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    env = {**os.environ, PYTHON_ENV: str(_fake_python(tmp_path, "exec sleep 600")), "TMPDIR": str(tmp_path)}
    root = str(Path(rollflow.__file__).resolve().parent.parent)
    starter = subprocess.Popen(
        [sys.executable, "-c", _INTERRUPTED_WHILE_STARTING, root, str(model)], cwd=tmp_path, env=env,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    servers: list[int] = []
    try:
        assert starter.stderr is not None
        assert "starting 2 managed vLLM replicas" in starter.stderr.readline()
        children = Path(f"/proc/{starter.pid}/task/{starter.pid}/children")
        for _ in range(100):  # both spawned (they are the starter's own children)
            servers = [int(pid) for pid in children.read_text().split()]
            if len(servers) == 2:
                break
            time.sleep(0.1)
        assert len(servers) == 2, servers
        time.sleep(0.5)  # in the wait
        starter.send_signal(signal.SIGINT)
        try:
            starter.wait(timeout=60)  # the stop's own grace is 15 s a server at most
        except subprocess.TimeoutExpired:
            pytest.fail("Ctrl-C while the replicas started did not end the starter within 60 s")
        assert "KeyboardInterrupt" in starter.stderr.read()
        assert not any(_alive(pid) for pid in servers), "a replica outlived the interrupted start"
    finally:
        starter.kill()
        starter.wait()
        for pid in servers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
