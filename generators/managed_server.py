"""A managed vLLM server as the generator sees it: what it asks of one, where one may run,
and whether one can sample.

``ManagedServer`` is the face: ``policy/vllm_server.VLLMServer`` in this process, or a
replica's handle on a cluster node (``cluster/ray_replicas.RemoteServer``); a
``ServerHost`` starts a run's servers elsewhere. ``server_fault`` is the one health
check, of a managed server (its process, then ``GET /health``) or of the user's servers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import httpx

from rollflow.generators.generator import GeneratorFault
from rollflow.policy.vllm_spec import VLLMServerSpec

HEALTH_TIMEOUT_S = 10.0


class ManagedServer(Protocol):
    """What the generator asks of a managed server: ``VLLMServer``, or a replica's handle on
    a cluster node (``cluster/ray_replicas.RemoteServer``)."""

    spec: VLLMServerSpec
    log_path: Path | None
    startup_s: float | None
    restarts: int

    @property
    def base_url(self) -> str: ...

    @property
    def running(self) -> bool: ...

    def start(self) -> Any: ...

    def spawn(self) -> Any: ...

    def wait_ready(self) -> Any: ...

    def restart(self, reason: str, *, log_path: Path | None = None) -> Any: ...

    def stop(self) -> None: ...

    def describe_exit(self) -> str: ...

    def log_tail(self) -> str: ...


# Starts the managed servers of ``specs`` (their logs, the startup timeout) somewhere else
ServerHost = Callable[[Sequence[VLLMServerSpec], Sequence["Path | None"], float], Sequence[ManagedServer]]


def server_fault(server: ManagedServer | None, base_urls: Sequence[str]) -> GeneratorFault | None:
    """Why ``server`` (managed) or the user's ``base_urls`` (``server`` None) cannot sample."""
    if server is None:
        for url in base_urls:
            problem = _health_problem(url)
            if problem is not None:
                return GeneratorFault(url, problem, managed=False)
        return None
    url = base_urls[0]
    problem = None if server.running else server.describe_exit()
    problem = problem or _health_problem(url)
    if problem is None:
        return None
    return GeneratorFault(url, problem, managed=True, log_path=server.log_path, log_tail=server.log_tail())


def _health_problem(base_url: str) -> str | None:
    """None when ``GET /health`` answers 200, else what went wrong."""
    url = base_url.removesuffix("/v1") + "/health"
    try:
        response = httpx.get(url, timeout=HEALTH_TIMEOUT_S)
    except httpx.HTTPError as error:
        return f"stopped answering (GET {url}: {type(error).__name__}: {error})"
    if response.status_code != 200:
        return f"is unhealthy (GET {url} answered HTTP {response.status_code})"
    return None
