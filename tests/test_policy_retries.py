"""The one retry loop (``policy/retries.py``) against canned local HTTP servers (127.0.0.1 only).

Each server answers from its own queue of statuses (200 once the queue is empty) and
records the bodies it was sent, so the tests check which answers are retried, where each
attempt goes and what it carries.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from json_server import json_server

from rollflow.policy.retries import RETRIED_STATUS, Posted, RetriesExhausted, post_with_retries
from rollflow.policy.stopping import StopRequested, request_stop


@dataclass
class Canned:
    statuses: list[int] = field(default_factory=list)
    delay_s: float = 0.0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    url: str = ""


@pytest.fixture
def servers() -> Iterator[list[Canned]]:
    """Two canned servers: replicas of one model."""
    canned = [Canned(), Canned()]

    def answering(server: Canned):  # noqa: ANN202 - a json_server.Answer
        def answer(path: str, headers: Mapping[str, str], body: dict[str, Any]) -> tuple[int, Any, float]:
            server.bodies.append(body)
            status = server.statuses.pop(0) if server.statuses else 200
            return status, {"ok": True} if status == 200 else {"error": {"message": f"said {status}"}}, server.delay_s

        return answer

    with ExitStack() as stack:
        for server in canned:
            server.url = stack.enter_context(json_server(answering(server)))
        yield canned


def post(urls: list[str], attempts: int, **options: Any) -> Posted:
    def body(attempt: int) -> Mapping[str, Any]:
        return {"seed": 100 + attempt}

    async def run() -> Posted:
        async with httpx.AsyncClient(timeout=options.pop("timeout_s", 10.0)) as client:
            return await post_with_retries(client, urls, body, attempts=attempts, **options)

    return asyncio.run(run())


@pytest.mark.parametrize("status", sorted(RETRIED_STATUS))
def test_5xx_408_and_429_are_retried_each_attempt_with_its_own_body(servers: list[Canned], status: int) -> None:
    server = servers[0]
    server.statuses = [status, status]
    posted = post([server.url], attempts=3)
    assert (posted.response.status_code, posted.attempt, posted.url) == (200, 3, server.url)
    assert server.bodies == [{"seed": 101}, {"seed": 102}, {"seed": 103}]


@pytest.mark.parametrize("status", [400, 401, 404, 422])
def test_other_4xx_are_answers_returned_at_once(servers: list[Canned], status: int) -> None:
    server = servers[0]
    server.statuses = [status]
    posted = post([server.url], attempts=3)
    assert (posted.response.status_code, posted.attempt) == (status, 1)
    assert len(server.bodies) == 1


def test_a_retry_moves_on_to_the_next_replica_from_the_first_given(servers: list[Canned]) -> None:
    servers[1].statuses = [503]
    servers[0].statuses = [502]
    posted = post([s.url for s in servers], attempts=3, first=1, path="/v1/completions")
    assert (posted.url, posted.attempt) == (servers[1].url, 3)  # 1, 0, then 1 again
    assert [b["seed"] for b in servers[1].bodies] == [101, 103]
    assert [b["seed"] for b in servers[0].bodies] == [102]


def test_exhausted_retries_name_the_last_url_and_reason(servers: list[Canned]) -> None:
    servers[0].statuses = [500, 503]
    with pytest.raises(RetriesExhausted) as failed:
        post([servers[0].url], attempts=2)
    assert (failed.value.attempts, failed.value.url, failed.value.reason) == (2, servers[0].url, "HTTP 503: said 503")


def test_connection_errors_are_retried_on_the_next_replica(servers: list[Canned]) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}"
    posted = post([dead, servers[0].url], attempts=2)
    assert (posted.url, posted.attempt) == (servers[0].url, 2)
    with pytest.raises(RetriesExhausted, match=r"all 2 attempts failed; last: .*ConnectError"):
        post([dead], attempts=2)


def test_a_timeout_is_retried_and_reported_with_the_callers_reason(servers: list[Canned]) -> None:
    servers[0].delay_s = 3.0
    started = time.perf_counter()
    with pytest.raises(RetriesExhausted) as failed:
        post([servers[0].url], attempts=2, timeout_s=0.2, timeout_reason="no answer within generation_timeout_s=0.2")
    assert failed.value.reason == "no answer within generation_timeout_s=0.2"
    assert len(servers[0].bodies) == 2
    assert time.perf_counter() - started < 2.9  # neither attempt waited for the slow answer (3 s)


def test_a_pause_grows_with_the_attempt_and_none_follows_the_last(servers: list[Canned]) -> None:
    servers[0].statuses = [503, 503, 503]
    started = time.perf_counter()
    with pytest.raises(RetriesExhausted):
        post([servers[0].url], attempts=3, pause_s=0.5)
    # 0.5 after the first, 1.0 after the second, none after the third (which would make 3.0)
    assert 1.5 <= time.perf_counter() - started < 2.9


def test_a_stop_request_is_honoured_before_any_request(servers: list[Canned]) -> None:
    request_stop()
    with pytest.raises(StopRequested):
        post([servers[0].url], attempts=3)
    assert servers[0].bodies == []
