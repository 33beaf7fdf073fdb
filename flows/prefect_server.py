"""Prefect's temporary API server, started in a session of its own so that Ctrl-C stops the run, not it.

Without ``PREFECT_API_URL`` a flow is served by Prefect's temporary server, a uvicorn child
process that Prefect 3.9 starts (``prefect.server.api.server.SubprocessASGIServer``) in the
run's own process group. A terminal's Ctrl-C sends SIGINT to that whole group, so the
server died at once while the run was still unwinding; the flow engine, reporting the
crash, then retried the dead server for minutes and exited 1 with tracebacks (issue 48).

``serve_prefect_in_own_session()`` registers, before a flow runs, a ``SubprocessASGIServer``
(``OwnSessionServer``, from ``own_session_server_class()``) that differs in one thing: its
process starts in a new session (as the managed vLLM server does, policy/vllm_server.py).
It is registered as Prefect's default instance (``SubprocessASGIServer._instances[None]``,
the key Prefect's own test harness uses to substitute its server), so every part of Prefect
that wants the temporary server (the client, the events and log workers) gets this one,
started when first needed as before.

Its stop is unchanged: Prefect's ``atexit`` on a normal exit, an exception, SIGTERM or
Ctrl-C (policy/stopping.py turns both into ``SystemExit``). A SIGKILLed run runs no
``atexit``: its watchdog (policy/procs.py) ends the run's descendants, this server
included, and a server started from the main thread also gets the kernel's SIGKILL when the
run dies (``parent_death_signal``).

Nothing is registered when ``PREFECT_API_URL`` names a server (no temporary server then),
or when a default instance exists already (Prefect's test harness, an earlier call).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import prefect
from prefect.settings import PREFECT_API_URL, get_current_settings

from rollflow.policy.procs import parent_death_signal

if TYPE_CHECKING:
    from prefect.server.api.server import SubprocessASGIServer


# What Prefect 3.9's SubprocessASGIServer._run_uvicorn_command runs, and the environment it
# adds (tests/test_ctrl_c.py checks they still match Prefect's).
TEMPORARY_SERVER_ENV = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}


def temporary_server_command(port: int) -> list[str]:
    return [
        sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent),
        "--factory", "prefect.server.api.server:create_app", "--host", "127.0.0.1",
        "--port", str(port), "--log-level", "error", "--lifespan", "on",
    ]  # fmt: skip


@functools.cache
def own_session_server_class() -> type[SubprocessASGIServer]:
    """``OwnSessionServer``, defined on first need: Prefect's server package takes 1.7
    CPU-seconds to import, which a run on a configured server (a nightly pipeline's, the
    test suite's) never needs."""
    from prefect.server.api.server import SubprocessASGIServer

    class OwnSessionServer(SubprocessASGIServer):
        """Prefect's temporary server, its process in a session (and process group) of its own."""

        def _run_uvicorn_command(self) -> subprocess.Popen[Any]:
            # Prefect's command and environment; only the session is new.
            settings = get_current_settings().to_environment_variables(exclude_unset=True)
            return subprocess.Popen(
                args=temporary_server_command(self.port),
                env={**os.environ, **TEMPORARY_SERVER_ENV, **settings},
                start_new_session=True,  # the terminal's Ctrl-C goes to the run's group only
                preexec_fn=parent_death_signal(),  # SIGKILLed with the run, when started from the main thread
            )

    return OwnSessionServer


def serve_prefect_in_own_session() -> SubprocessASGIServer | None:
    """Make Prefect's temporary server an ``OwnSessionServer`` (not started yet); return it,
    or None where nothing was registered (see the module docstring)."""
    if PREFECT_API_URL.value():
        return None  # a configured server: no temporary one, and no import of Prefect's server
    server_class = own_session_server_class()
    if server_class._instances.get(None) is not None:
        return None
    server = server_class()  # Prefect's __new__ files it under its port, None: the default
    assert server_class._instances.get(None) is server
    return server
