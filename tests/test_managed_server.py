"""Why a managed server cannot sample (generators/managed_server.py ``server_fault``): a
server killed a moment ago refuses connections before its process is reaped, and the fault
must still name the kill, not "stopped answering" (CI, 2026-12-07: a vLLM server SIGKILLed
mid-rollout was reported by its failed health check while its 5 GB process was exiting)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading

from rollflow.generators.managed_server import server_fault


class _DyingServer:
    """A real process standing in for the server; only what ``server_fault`` reads."""

    def __init__(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def describe_exit(self) -> str:
        status = self.process.poll()
        if status is None:
            return "is running"
        return f"was killed by {signal.Signals(-status).name} (exit status {status})" if status < 0 else f"exited with status {status}"

    def log_tail(self) -> str:
        return ""

    log_path = None


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_server_that_dies_just_after_its_health_check_failed_is_reported_as_killed() -> None:
    server = _DyingServer()
    try:
        # the health check fails at once (nothing listens); the process dies 0.5 s later
        threading.Timer(0.5, server.process.kill).start()
        fault = server_fault(server, [f"http://127.0.0.1:{_closed_port()}/v1"])  # type: ignore[arg-type]
        assert fault is not None and fault.reason.startswith("was killed by SIGKILL"), fault
    finally:
        server.process.kill()
        server.process.wait()


def test_a_live_server_that_does_not_answer_is_reported_as_not_answering() -> None:
    server = _DyingServer()
    try:
        fault = server_fault(server, [f"http://127.0.0.1:{_closed_port()}/v1"])  # type: ignore[arg-type]
        assert fault is not None and fault.reason.startswith("stopped answering"), fault
        assert server.running
    finally:
        server.process.kill()
        server.process.wait()
