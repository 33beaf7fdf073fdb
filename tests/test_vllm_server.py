"""The server manager's lifetime rules, on stand-in "Pythons" (shell scripts; no vLLM).

What is checked here is process handling, not tokens: a server that exits early or never
becomes healthy is reported with its log's tail and its command, and stopping it ends its
whole process group (a child it left behind included). The real server is exercised in
tests/test_vllm_backend.py.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from rollflow.policy.vllm_server import PYTHON_ENV, VLLMServer, VLLMServerError, VLLMServerSpec


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


def test_a_server_never_healthy_times_out_and_its_whole_group_is_stopped(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pid_file = tmp_path / "child.pid"
    # A child that ignores SIGTERM, like a worker slow to exit: only SIGKILL ends it.
    body = f"sh -c 'trap \"\" TERM; echo $$ > {pid_file}; while true; do sleep 1; done' &\necho waiting; sleep 600"
    monkeypatch.setenv(PYTHON_ENV, str(_fake_python(tmp_path, body)))
    server = VLLMServer(VLLMServerSpec(str(model_dir)), startup_timeout_s=3.0)
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
