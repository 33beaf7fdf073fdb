"""A real Prefect server for tests: ``prefect server start`` on a free loopback port.

Shared by the deployment and pipeline tests. Everything is a real process on 127.0.0.1
with its own SQLite database under a temporary PREFECT_HOME; every wait is bounded; the
server and any worker are killed (whole process groups) whatever happens.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx
import pytest

REPO = Path(__file__).resolve().parent.parent
PREFECT = str(Path(sys.executable).parent / "prefect")
POOL = "rollflow-process"
FINAL_STATES = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
T = TypeVar("T")


@dataclass(frozen=True)
class PrefectServer:
    api_url: str
    env: dict[str, str]  # what every prefect command of the test runs with
    home: Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def stop_group(process: subprocess.Popen[bytes], grace_s: float = 15.0) -> None:
    """SIGTERM the process group, SIGKILL it after ``grace_s``; children never outlive it."""
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)


@contextmanager
def background(command: Sequence[str], env: dict[str, str] | None, log: Path, cwd: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as sink:
        process = subprocess.Popen(
            list(command), env=env, cwd=cwd, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield process
    finally:
        stop_group(process)


def tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


def wait_for(probe: Callable[[], T | None], timeout_s: float, what: str, log: Path | None = None) -> T:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = probe()
        if value is not None:
            return value
        time.sleep(1.0)
    pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}\n{tail(log) if log else ''}")


def prefect(server: PrefectServer, *args: str, timeout_s: float = 300) -> str:
    done = subprocess.run(
        [PREFECT, *args], env=server.env, cwd=REPO, capture_output=True, text=True, timeout=timeout_s
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"prefect {' '.join(args)} failed ({done.returncode}):\n{output[-4000:]}"
    return output


@contextmanager
def running_prefect_server(home: Path, settings: dict[str, str] | None = None) -> Iterator[PrefectServer]:
    """Start a server with its state under ``home``; stopped when the block ends.
    ``settings``: more environment, for the server and every command of the test."""
    api_url = f"http://127.0.0.1:{free_port()}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(home / "home"),
        "PREFECT_API_URL": api_url,
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home / 'prefect.db'}",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_UI_ENABLED": "false",
        # no nightly runs created behind the test's back: only the one it triggers
        "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "false",
        "PREFECT_CLI_PROMPT": "false",
        "PREFECT_LOGGING_LEVEL": "INFO",
        "MLFLOW_TRACKING_URI": f"sqlite:///{home / 'mlflow.db'}",
        **(settings or {}),
    }
    port = api_url.rsplit(":", 1)[1].split("/")[0]
    command = [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", port]
    log = home / "server.log"
    with background(command, env, log, cwd=home) as process:

        def healthy() -> bool | None:
            if process.poll() is not None:
                pytest.fail(f"prefect server exited with {process.returncode}:\n{tail(log)}")
            with suppress(httpx.HTTPError):
                return httpx.get(f"{api_url}/health", timeout=5).json() is True or None
            return None

        wait_for(healthy, 240, "the Prefect server's /health", log)
        yield PrefectServer(api_url=api_url, env=env, home=home)




# ---------------------------------------------------------------- the suite's one server
# Prefect's temporary server as its test harness runs it (ephemeral, no UI), started once by
# the xdist controller for all its workers (tests/conftest.py): each worker starting its own
# cost ~7 CPU-s to start and ~0.8 CPU-s a minute idle, three times over.
SESSION_URL_ENV = "ROLLFLOW_TEST_PREFECT_URL"  # the controller's server; its workers use it
SESSION_LOG_ENV = "ROLLFLOW_TEST_PREFECT_LOG"


def start_session_server(home: Path) -> subprocess.Popen[bytes]:
    """Start the suite's server with its database and log under ``home``, not waiting for it;
    its URL and log are put in the environment the workers inherit. Tied to this process:
    SIGKILLed with it (``parent_death_signal``), even if it is SIGKILLed itself."""
    from rollflow.flows.prefect_server import TEMPORARY_SERVER_ENV, temporary_server_command
    from rollflow.policy.procs import parent_death_signal

    port = free_port()
    home.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home / 'prefect.db'}",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        **TEMPORARY_SERVER_ENV,
    }
    log = home / "server.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            temporary_server_command(port), env=env, cwd=home, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=parent_death_signal(),
        )  # fmt: skip
    os.environ[SESSION_URL_ENV] = f"http://127.0.0.1:{port}/api"
    os.environ[SESSION_LOG_ENV] = str(log)
    return process


def wait_for_session_server(api_url: str, timeout_s: float = 240) -> None:
    """Wait until the suite's server answers (it starts while the workers collect)."""
    log = os.environ.get(SESSION_LOG_ENV)

    def healthy() -> bool | None:
        with suppress(httpx.HTTPError):
            return httpx.get(f"{api_url}/health", timeout=5).json() is True or None
        return None

    wait_for(healthy, timeout_s, f"the suite's Prefect server at {api_url}", Path(log) if log else None)


def flow_run_state(server: PrefectServer, flow_run_id: str) -> str | None:
    with suppress(httpx.HTTPError):
        return str(httpx.get(f"{server.api_url}/flow_runs/{flow_run_id}", timeout=10).json()["state"]["type"])
    return None


def wait_for_final_state(server: PrefectServer, flow_run_id: str, timeout_s: float, log: Path) -> str:
    def final() -> str | None:
        state = flow_run_state(server, flow_run_id)
        return state if state in FINAL_STATES else None

    return wait_for(final, timeout_s, f"flow run {flow_run_id} to finish", log)
