"""The one retry loop for requests to OpenAI-compatible servers (vLLM, a hosted model).

``post_with_retries`` serves the vLLM and OpenAI sessions' completions and the server
teacher's requests. What is retried, for every caller: connection errors, timeouts, and
the statuses in ``RETRIED_STATUS`` (408, 429 and 5xx: a server restarting, overloaded or
timing out behind a proxy). Any other answer, 200 or not, is the caller's to read: a 4xx
is a refusal that the same request would meet again. Attempt ``k`` (from 1) goes to
``urls[(first + k - 1) % len(urls)]``, so a retry moves on to the next replica, and the
body is built per attempt (``body(k)``: each attempt draws from its own seed).

A stop request (SIGTERM, ``rollflow.policy.stopping``) is honoured before every attempt.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from rollflow.policy.stopping import raise_if_stop_requested

RETRIED_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class RetriesExhausted(Exception):
    """Every attempt failed; ``url`` and ``reason`` are the last one's (the caller names it)."""

    def __init__(self, attempts: int, url: str, reason: str) -> None:
        super().__init__(f"all {attempts} attempts failed; last: {url}: {reason}")
        self.attempts = attempts
        self.url = url
        self.reason = reason


@dataclass(frozen=True)
class Posted:
    """The answer that ended the retries: not necessarily a 200."""

    response: httpx.Response
    url: str  # which of ``urls`` answered
    attempt: int  # from 1
    seconds: float  # wall time of this attempt's request


async def post_with_retries(
    client: httpx.AsyncClient,
    urls: Sequence[str],
    body: Callable[[int], Mapping[str, Any]],
    *,
    attempts: int,
    first: int = 0,
    path: str = "",
    headers: Mapping[str, str] | None = None,
    timeout_reason: str | None = None,
    pause_s: float = 0.0,
) -> Posted:
    """POST ``body(attempt)`` to ``url + path`` until an answer is not a retried one.

    ``timeout_reason`` replaces the timeout's own text in the last error (it names the
    setting that timed out); ``pause_s * attempt`` seconds pass before the next attempt.
    Raises ``RetriesExhausted`` after ``attempts`` retried failures.
    """
    assert urls and attempts >= 1, f"{len(urls)} urls, {attempts} attempts"
    url, reason = urls[0], ""
    for attempt in range(1, attempts + 1):
        url = urls[(first + attempt - 1) % len(urls)]
        sent_body = dict(body(attempt))
        raise_if_stop_requested()
        sent = time.perf_counter()
        try:
            response = await client.post(url + path, json=sent_body, headers=headers)
        except httpx.TimeoutException as error:
            reason = timeout_reason or f"{type(error).__name__}: {error}"
        except httpx.TransportError as error:
            reason = f"{type(error).__name__}: {error}"
        else:
            if response.status_code not in RETRIED_STATUS:
                return Posted(response, url, attempt, time.perf_counter() - sent)
            reason = f"HTTP {response.status_code}: {server_error_message(response)}"
        if pause_s and attempt < attempts:
            await asyncio.sleep(pause_s * attempt)
    raise RetriesExhausted(attempts, url, reason)


def server_error_message(response: httpx.Response) -> str:
    """An OpenAI-compatible server's error text (its ``error.message``, else the body), cut to 300 characters."""
    try:
        payload = response.json()
    except ValueError:
        return response.text[:300]
    error = payload.get("error", payload) if isinstance(payload, dict) else payload
    message = error.get("message") if isinstance(error, dict) else None
    return str(message or payload)[:300]
