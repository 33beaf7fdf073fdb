"""A managed vLLM server as the generator sees it: what it asks of one, where one may run,
and whether one can sample.

``ManagedServer`` is the face: ``policy/vllm_server.VLLMServer`` in this process, or a
replica's handle on a cluster node (``cluster/ray_replicas.RemoteServer``); a
``ServerHost`` starts a run's servers elsewhere. ``server_fault`` is the one health
check, of a managed server (its process, then ``GET /health``) or of the user's servers.

Sleep mode, for a server that shares its GPU with the trainer (``VLLMServerSpec.sleep_mode``):
``sleep_server`` (``POST /sleep?level=L``: vLLM frees its KV cache, and at level 2 its
weights too), ``wake_server`` (``POST /wake_up``: the memory is taken back; after level 2
the weights in it are whatever the memory held, until they are reloaded), and
``probe_logprobs``, the served model's logprobs of a fixed token sequence, by which the
generator checks the weights it serves after a wake (``VLLMGenerator.policy_for``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import httpx

from rollflow.generators.generator import GeneratorError, GeneratorFault
from rollflow.policy.vllm_admin import auth_headers
from rollflow.policy.vllm_spec import VLLMServerSpec

HEALTH_TIMEOUT_S = 10.0
# A server killed a moment ago can refuse connections before its process is reaped (a large
# process takes a while to exit): the fault waits this long for the exit it can then name.
EXIT_GRACE_S = 3.0
SLEEP_TIMEOUT_S = 300.0  # a wake of a large model copies its weights back from host memory


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
    if problem is None:
        problem = _health_problem(url)
        if problem is not None and _exited_within(server, EXIT_GRACE_S):
            problem = server.describe_exit()  # "was killed by SIGKILL", not "stopped answering"
    if problem is None:
        return None
    return GeneratorFault(url, problem, managed=True, log_path=server.log_path, log_tail=server.log_tail())


def _exited_within(server: ManagedServer, seconds: float) -> bool:
    """Whether ``server``'s process ends within ``seconds`` (polled every 0.1 s)."""
    deadline = time.monotonic() + seconds
    while server.running:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


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


# ---------------------------------------------------------------- sleep mode


def sleep_server(base_url: str, level: int, *, api_key: str | None = None) -> None:
    """``POST /sleep?level=level``: the server frees its GPU memory (nothing may be sampling)."""
    _dev_post(base_url, "/sleep", {"level": str(level)}, api_key)


def wake_server(base_url: str, *, api_key: str | None = None) -> None:
    """``POST /wake_up``: the server takes its GPU memory back (weights and KV cache)."""
    answer = _dev_post(base_url, "/wake_up", {}, api_key)
    if answer.get("status") != "awake":
        raise GeneratorError(f"{base_url}: POST /wake_up left the server {answer.get('status')!r}, not awake")


def _dev_post(base_url: str, route: str, params: dict[str, str], api_key: str | None) -> dict[str, Any]:
    url = base_url.removesuffix("/v1") + route
    try:
        response = httpx.post(url, params=params, timeout=SLEEP_TIMEOUT_S, headers=auth_headers(api_key))
    except httpx.HTTPError as error:
        raise GeneratorError(f"POST {url} failed: {type(error).__name__}: {error}") from error
    if response.status_code != 200:
        raise GeneratorError(
            f"POST {url} answered HTTP {response.status_code}: {response.text[:300]} (a server started "
            "with --enable-sleep-mode and VLLM_SERVER_DEV_MODE=1? managed servers that share the GPU are)"
        )
    answer = response.json()
    return answer if isinstance(answer, dict) else {}


def probe_logprobs(base_url: str, model: str, token_ids: Sequence[int], *, api_key: str | None = None) -> list[float]:
    """The served ``model``'s logprob of each of ``token_ids`` after the first, given the
    ones before it (``prompt_logprobs`` of a one-token completion)."""
    from rollflow.policy.teacher import TeacherError, parse_prompt_logprobs

    url = base_url.rstrip("/") + "/completions"
    body = {"model": model, "prompt": list(token_ids), "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
    try:
        response = httpx.post(url, json=body, timeout=HEALTH_TIMEOUT_S * 6, headers=auth_headers(api_key))
        response.raise_for_status()
        return parse_prompt_logprobs(response.json(), token_ids, base_url)[1:]
    except (httpx.HTTPError, TeacherError, ValueError) as error:
        raise GeneratorError(f"{url}: the weights' probe failed: {type(error).__name__}: {error}") from error


def weights_problem(before: Sequence[float], after: Sequence[float], tolerance: float) -> str | None:
    """None when the probe's logprobs ``after`` a wake are those of a policy one update
    from ``before``'s: all finite, and on average within ``tolerance`` nats a token of
    them. Weights a level-2 sleep dropped and nothing reloaded hold whatever the memory
    held: their logprobs are not finite, or nats away from any trained model's."""
    if not after or not all(math.isfinite(x) and x <= 0.0 for x in after):
        return f"logprobs {list(after)[:6]} are not finite log-probabilities"
    moved = sum(abs(a - b) for a, b in zip(after, before, strict=True)) / len(after)
    if moved > tolerance:
        return f"the probe's logprobs moved {moved:.2f} nats a token across the update (more than {tolerance})"
    return None
