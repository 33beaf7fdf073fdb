"""What a tool call costs over MCP: the tool-use game's Python tool against the same tool
behind the bundled MCP server, over stdio and over streamable HTTP, side by side in one run.

Three legs, each the same call on the same task (``--tool``: ``lookup`` of one of train
task 0's facts, or ``calculator``):

- ``python``: the game's own tool objects (``rollflow.envs.tool_use_game.tools.game_tools``
  over the task's facts), called in process;
- ``mcp-stdio``: the bundled server (``envs/mcp_tool_use_game/server.py``) started by
  rollflow as a stdio subprocess (``rollflow.envs.mcp.mcp_tools``), the task named in the
  call's ``_meta`` as the config-only form's episodes name it;
- ``mcp-http``: the same server started with ``--http`` (streamable HTTP on 127.0.0.1),
  reached by its URL.

Every call goes through ``rollflow.envs.tools.run_tool_calls``, the path an episode's tool
calls take (the JSON-Schema check of the arguments, then the call), so a figure is what an
episode pays per call, and the legs differ only in where the tool runs; each leg's answer
is checked against the Python tool's. Per leg: ``--warmup`` untimed calls, then ``--calls``
calls one at a time (each timed alone), then ``--calls`` calls by ``--concurrency`` callers
at once (each call timed from its start to its answer; calls/s is calls over the wall
time of the batch; the Python tool never yields, so its callers take turns). Printed: the servers' start-up (start, initialize, list tools), then
one table, a row per leg and concurrency: median and p90 ms per call, and calls/s.

Simplified: one process for all legs (the MCP client runs in rollflow's pool thread, as
in a run), the legs one after the other and not interleaved, and one task; on a busy
machine the order shows in the figures, so read them with the load average printed
beside them. No timed assertions: the figures are for the README.

    .venv/bin/python bench/mcp_bench.py [--calls 200] [--warmup 20] [--concurrency 8] [--tool lookup]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from rollflow.envs.mcp import POOL, mcp_tools, with_meta
from rollflow.envs.mcp_tool_use_game.tasks import NUM_TRAIN, NUM_VALIDATION, SEED
from rollflow.envs.protocol import make_tool_call
from rollflow.envs.tool_use_game.tasks import generate_examples
from rollflow.envs.tool_use_game.tools import game_tools
from rollflow.envs.tools import run_tool_calls
from rollflow.envs.types import Tool

SERVER = [sys.executable, "-m", "rollflow.envs.mcp_tool_use_game.server"]


@dataclass(frozen=True)
class Call:
    """The call every leg makes, and the answer the Python tool gave to it."""

    name: str
    arguments: dict[str, Any]
    expected: str = ""


@dataclass(frozen=True)
class Row:
    leg: str
    concurrency: int
    latencies_ms: tuple[float, ...]  # one per call
    wall_s: float  # the whole batch

    @property
    def median_ms(self) -> float:
        return statistics.median(self.latencies_ms)

    @property
    def p90_ms(self) -> float:
        return statistics.quantiles(self.latencies_ms, n=10, method="inclusive")[8]

    @property
    def calls_per_s(self) -> float:
        return len(self.latencies_ms) / self.wall_s


async def timed_call(tools: Mapping[str, Tool], call: Call) -> tuple[float, str]:
    """(milliseconds, the tool message) of one call as an episode makes it."""
    start = time.perf_counter()
    outcome = await run_tool_calls(tools, [make_tool_call(call.name, call.arguments)])
    return (time.perf_counter() - start) * 1000, str(outcome.messages[0]["content"])


async def measure(leg: str, tools: Mapping[str, Tool], call: Call, calls: int, concurrency: int) -> Row:
    """``calls`` calls by ``concurrency`` callers at once, each answer checked."""
    pending = iter(range(calls))
    latencies: list[float] = []

    async def caller() -> None:
        for _ in pending:  # the callers share one iterator: ``calls`` calls in all
            milliseconds, answer = await timed_call(tools, call)
            if answer != call.expected:
                raise AssertionError(f"{leg} answered {answer!r}, the Python tool {call.expected!r}")
            latencies.append(milliseconds)

    start = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    return Row(leg, concurrency, tuple(latencies), time.perf_counter() - start)


async def bench_leg(leg: str, tools: Mapping[str, Tool], call: Call, args: argparse.Namespace) -> list[Row]:
    """The leg's warm-up, then its calls one at a time, then ``--concurrency`` at once."""
    for _ in range(args.warmup):
        await timed_call(tools, call)
    return [await measure(leg, tools, call, args.calls, level) for level in (1, args.concurrency)]


@contextmanager
def http_server() -> Iterator[tuple[str, float]]:
    """The bundled server on streamable HTTP: its URL and the seconds until it printed it
    (it prints once it listens); stopped, its whole session, at the end. Its stderr is kept
    in a file and shown only if it fails to start (the SDK logs a closed stream as an error
    each time a client ends its session)."""
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as stderr:
        server = subprocess.Popen(
            [*SERVER, "--http"], stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True
        )
        try:
            assert server.stdout is not None
            url = server.stdout.readline().strip()
            if not url.startswith("http://"):
                stderr.seek(0)
                raise RuntimeError(f"the MCP server with --http printed {url!r}, not its URL: {stderr.read()[-500:]}")
            yield url, time.perf_counter() - start
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()


def started(servers: list[dict[str, Any]], meta: Mapping[str, Any]) -> tuple[dict[str, Tool], float]:
    """The servers' tools, carrying ``meta``, and the seconds it took to start and list them."""
    start = time.perf_counter()
    tools = mcp_tools(servers)
    return dict(with_meta(tools, meta)), time.perf_counter() - start


def the_call(tool: str) -> tuple[dict[str, int], str, Call]:
    """(train task 0's facts, its id, the call to make)."""
    train, _ = generate_examples(SEED, NUM_TRAIN, NUM_VALIDATION)
    task = train[0]
    facts = dict(task.metadata["facts"])
    if tool == "lookup":
        return facts, str(task.id), Call("lookup", {"key": task.metadata["needed_keys"][0]})
    return facts, str(task.id), Call("calculator", {"expression": "(17 + 25) * 3 - 4 // 2"})


def print_table(rows: list[Row]) -> None:
    print("| leg | concurrency | calls | median ms | p90 ms | calls/s |")
    print("|---|---|---|---|---|---|")
    for row in sorted(rows, key=lambda row: row.concurrency):
        print(
            f"| {row.leg} | {row.concurrency} | {len(row.latencies_ms)} | {row.median_ms:.3f} | {row.p90_ms:.3f} "
            f"| {row.calls_per_s:.0f} |"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="timed calls per leg and concurrency (default 200)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed calls per leg first (default 20)")
    parser.add_argument("--concurrency", type=int, default=8, help="callers at once in the second row set (default 8)")
    parser.add_argument("--tool", choices=("lookup", "calculator"), default="lookup")
    args = parser.parse_args(argv)
    if args.calls < 2 or args.warmup < 0 or args.concurrency < 1:
        parser.error("--calls must be at least 2 (a p90 needs two), --warmup at least 0, --concurrency at least 1")
    facts, task_id, call = the_call(args.tool)
    meta = {"task_id": task_id}
    python_tools: dict[str, Tool] = dict(game_tools(facts))
    call = replace(call, expected=asyncio.run(timed_call(python_tools, call))[1])
    print(f"{call.name}({json.dumps(call.arguments)}) on train task 0 answers {call.expected!r} in every leg; "
          f"load average {os.getloadavg()[0]:.2f} at the start")
    with http_server() as (url, up_s):
        try:  # the sessions end before the HTTP server stops (else its client fails to say goodbye)
            stdio_tools, stdio_s = started([{"name": "stdio", "command": SERVER}], meta)
            http_tools, http_s = started([{"name": "http", "url": url}], meta)
            print(f"mcp-stdio: started, initialized and listed in {stdio_s:.2f} s; "
                  f"mcp-http: listening after {up_s:.2f} s, initialized and listed in {http_s:.2f} s")
            rows: list[Row] = []
            for leg, tools in (("python", python_tools), ("mcp-stdio", stdio_tools), ("mcp-http", http_tools)):
                rows += asyncio.run(bench_leg(leg, tools, call, args))
        finally:
            POOL.close_all()
    print_table(rows)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
