"""Live sessions with MCP servers, owned by one event-loop thread per process (``McpPool``).

Why a thread of our own: the SDK's clients are anyio context managers whose task groups
must be entered and left in one task, while rollflow plays each rollout step in a fresh
``asyncio.run`` loop (``tasks/rollout.py``), scores in other threads and preflights in the
main one. A session opened in one of those loops would die with it. So every session lives
in a task of the pool's loop (``Connection._own``: open, list tools, wait, close, all in
that task), and episodes reach it from whatever loop they run in
(``asyncio.run_coroutine_threadsafe`` + ``asyncio.wrap_future``; cancelling the episode
cancels the call).

A stdio server is started through ``launcher.py`` (``PR_SET_PDEATHSIG``: the kernel kills it
when this process dies, however it dies) and watched by its pid: a server found dead, by a
poll every ``POLL_S`` or by a call that lost its connection, makes that call raise
``McpServerError`` (a ``BrokenToolError``: the episode's error, not the model's feedback),
and the next ``McpPool.shared`` starts a new one. ``McpPool.close_all`` (at exit) stops
every server: stdin closed, then SIGTERM, then SIGKILL, as the SDK does.

Simplified: an HTTP server is not ours to restart; a call that cannot reach it times out
(a tool error) and the next call reconnects only if the session itself ended.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import json
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Coroutine, Iterator, Mapping
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

from jsonschema import Draft202012Validator, validators
from jsonschema.exceptions import SchemaError

try:
    from mcp import ClientSession, McpError, StdioServerParameters, types
except ModuleNotFoundError as missing:  # the optional extra
    raise ModuleNotFoundError(f"rollflow.envs.mcp needs the mcp package ({missing}): pip install 'rollflow[mcp]'") from None
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from rollflow.envs.mcp.servers import McpServer
from rollflow.envs.tools import BrokenToolError

POLL_S = 0.2
STOP_TIMEOUT_S = 10.0
LAUNCHER = str(Path(__file__).resolve().with_name("launcher.py"))
_T = TypeVar("_T")


class McpServerError(BrokenToolError):
    """An MCP server failed us: it would not start, does not speak MCP, listed no or bad
    tools, or died. One line that names the server."""


class McpToolError(Exception):
    """The server answered a call with ``isError``: the model's feedback, like a raising tool."""


@dataclass(frozen=True)
class ListedTool:
    """A tool as the server lists it, schema checked."""

    name: str
    description: str
    input_schema: dict[str, Any]


class Connection:
    """One session with one server, opened, used and closed by the pool's loop."""

    def __init__(self, server: McpServer) -> None:
        self.server = server
        self.tools: tuple[ListedTool, ...] = ()
        self.pid: int | None = None
        self.dead: str | None = None  # why it can no longer be used
        self._session: ClientSession | None = None
        self._stop = asyncio.Event()
        self._bound = asyncio.Semaphore(server.max_concurrent_calls)
        self._stderr: collections.deque[str] = collections.deque(maxlen=40)
        self._task: asyncio.Task[None] | None = None

    async def open(self) -> None:
        """Start (or reach) the server, initialize and list its tools; ``McpServerError``
        naming the server when any of it fails."""
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._own(ready))
        await ready

    async def close(self) -> None:
        self._stop.set()
        if self._task is not None:
            await asyncio.wait({self._task}, timeout=STOP_TIMEOUT_S)

    def alive(self) -> bool:
        if self.dead is None and self.pid is not None and not _running(self.pid):
            self.dead = f"MCP server {self.server.label} (pid {self.pid}) died{self._last_words()}"
        return self.dead is None

    async def call(self, name: str, arguments: dict[str, Any], meta: Mapping[str, Any] | None) -> str:
        """The observation of one call: its text (or structured result), ``McpToolError``
        for an ``isError`` result or a refused call, ``McpServerError`` if the server died."""
        async with self._bound:
            if not self.alive() or self._session is None:
                raise McpServerError(self.dead or f"MCP server {self.server.label} is not open")
            try:
                result = await self._session.call_tool(
                    name, arguments, read_timeout_seconds=timedelta(seconds=self.server.timeout_s),
                    meta=dict(meta) if meta else None,
                )  # fmt: skip
            except McpError as exc:
                if exc.error.code == types.CONNECTION_CLOSED or not self.alive():
                    self.dead = self.dead or f"MCP server {self.server.label} closed the connection{self._last_words()}"
                    raise McpServerError(self.dead) from exc
                raise McpToolError(exc.error.message) from exc
            except Exception as exc:  # a broken stream: the transport is gone
                self.dead = self.dead or f"MCP server {self.server.label} failed: {type(exc).__name__}: {exc}"
                raise McpServerError(self.dead) from exc
        if result.isError:
            raise McpToolError(observation(result) or "the tool reported an error")
        return observation(result)

    async def _own(self, ready: asyncio.Future[None]) -> None:
        """The connection's whole life in one task (the SDK's task groups ask for it)."""
        workdir = tempfile.mkdtemp(prefix="rollflow-mcp-")
        try:
            async with AsyncExitStack() as stack:
                read, write = await self._transport(stack, workdir)
                session = await stack.enter_async_context(
                    ClientSession(read, write, read_timeout_seconds=timedelta(seconds=self.server.startup_timeout_s))
                )
                await session.initialize()
                self.tools = checked_tools(self.server, await _all_tools(session))
                self._session = session
                ready.set_result(None)
                while not self._stop.is_set() and self.alive():
                    try:
                        await asyncio.wait_for(self._stop.wait(), POLL_S)
                    except TimeoutError:
                        pass
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(self._startup_error(exc))
            if not isinstance(exc, Exception):
                raise
        finally:
            self.dead = self.dead or f"MCP server {self.server.label} was stopped"
            self._session = None
            shutil.rmtree(workdir, ignore_errors=True)

    async def _transport(self, stack: AsyncExitStack, workdir: str) -> tuple[Any, Any]:
        if self.server.url is not None:
            client = create_mcp_http_client(headers=dict(self.server.headers) or None)
            await stack.enter_async_context(client)
            read, write, _ = await stack.enter_async_context(streamable_http_client(self.server.url, http_client=client))
            return read, write
        pidfile = os.path.join(workdir, "pid")
        program = sys.executable if self.server.command == "python" else str(self.server.command)
        parameters = StdioServerParameters(
            command=sys.executable,
            args=["-I", LAUNCHER, str(os.getpid()), pidfile, program, *self.server.args],
            env=dict(self.server.env) or None,
            cwd=self.server.cwd,
        )
        errlog = self._stderr_pipe()
        try:
            read, write = await stack.enter_async_context(stdio_client(parameters, errlog=errlog))
        finally:
            errlog.close()  # the server holds its own copy; EOF comes when it exits
        self.pid = await _read_pid(pidfile, self.server.startup_timeout_s)
        return read, write

    def _stderr_pipe(self) -> Any:
        """A file the server writes its stderr to; a thread keeps its last lines (for errors)."""
        read_fd, write_fd = os.pipe()

        def keep_lines() -> None:
            with os.fdopen(read_fd, "r", encoding="utf-8", errors="replace") as lines:
                for line in lines:
                    if line.strip():
                        self._stderr.append(line.rstrip())

        threading.Thread(target=keep_lines, name="mcp-stderr", daemon=True).start()
        return os.fdopen(write_fd, "w")

    def _startup_error(self, exc: BaseException) -> McpServerError:
        if isinstance(exc, McpServerError):
            return exc
        cause = _innermost(exc)
        if isinstance(cause, McpError) and cause.error.code == types.CONNECTION_CLOSED:
            what = "failed to start: it exited before answering"
        elif isinstance(cause, McpError):
            what = f"did not answer as an MCP server: {cause.error.message}"
        else:
            what = f"failed to start: {type(cause).__name__}: {cause}"
        return McpServerError(f"MCP server {self.server.label} {what}".splitlines()[0] + self._last_words())

    def _last_words(self) -> str:
        return f" (its stderr: {self._stderr[-1][:200]})" if self._stderr else ""


def checked_tools(server: McpServer, listed: list[types.Tool]) -> tuple[ListedTool, ...]:
    """The listed tools, once each has a name and a valid JSON Schema of an object."""
    if not listed:
        raise McpServerError(f"MCP server {server.label} lists no tools")
    tools: list[ListedTool] = []
    for tool in listed:
        schema = tool.inputSchema
        validator = validators.validator_for(schema, default=Draft202012Validator)
        try:
            validator.check_schema(schema)
        except SchemaError as exc:
            raise McpServerError(
                f"MCP server {server.label} lists tool {tool.name!r} with an invalid input schema: {exc.message}"
            ) from None
        if schema.get("type") != "object":
            raise McpServerError(
                f"MCP server {server.label} lists tool {tool.name!r} whose input schema is not of type object: "
                f"{json.dumps(schema)[:100]}"
            )
        tools.append(ListedTool(name=tool.name, description=tool.description or "", input_schema=dict(schema)))
    return tuple(tools)


def observation(result: types.CallToolResult) -> str:
    """What the model reads: the text blocks; else the structured result as JSON; other
    blocks (images, resources) named by their kind."""
    texts = [block.text for block in result.content if isinstance(block, types.TextContent)]
    others = [f"[{block.type}]" for block in result.content if not isinstance(block, types.TextContent)]
    if not texts and result.structuredContent is not None:
        texts = [json.dumps(result.structuredContent, ensure_ascii=False, sort_keys=True)]
    return "\n".join(texts + others)


class McpPool:
    """The process's connections and the thread whose event loop owns them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._shared: dict[McpServer, Connection] = {}
        self._own: set[Connection] = set()
        self._recorders: list[dict[McpServer, None]] = []

    @contextmanager
    def recording(self) -> Iterator[dict[McpServer, None]]:
        """The servers this process opens or reuses inside the block, in the order first
        reached (``rollflow env show`` lists the tools of those its environment reached)."""
        reached: dict[McpServer, None] = {}
        self._recorders.append(reached)
        try:
            yield reached
        finally:
            self._recorders.remove(reached)

    def run(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        """Run ``coroutine`` in the pool's loop and wait for it (from code outside that loop)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._started()).result()

    async def arun(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        """Await ``coroutine`` run in the pool's loop, from any other event loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, self._started()))

    async def shared(self, server: McpServer) -> Connection:
        """The process's live connection to ``server`` (opened, or reopened if it died).
        Runs in the pool's loop."""
        self._record(server)
        connection = self._shared.get(server)
        if connection is not None and connection.alive():
            return connection
        if connection is not None:
            del self._shared[server]
            await connection.close()
        connection = Connection(server)
        await connection.open()
        self._shared[server] = connection
        return connection

    async def open_own(self, server: McpServer) -> Connection:
        """A connection for one episode (a server that keeps state); ``close_own`` ends it."""
        self._record(server)
        connection = Connection(server)
        await connection.open()
        self._own.add(connection)
        return connection

    async def close_own(self, connection: Connection) -> None:
        self._own.discard(connection)
        await connection.close()

    def close_all(self) -> None:
        """Stop every server this process started (at exit; also for tests)."""
        if self._loop is not None:
            self.run(self._close_everything())

    async def _close_everything(self) -> None:
        """In the pool's loop, which alone changes the connection tables."""
        connections = [*self._shared.values(), *self._own]
        self._shared.clear()
        self._own.clear()
        await asyncio.gather(*(connection.close() for connection in connections), return_exceptions=True)

    def _record(self, server: McpServer) -> None:
        for reached in self._recorders:
            reached.setdefault(server)

    def pids(self) -> list[int]:
        """The pids of the stdio servers open now (tests check they are gone after)."""
        return [c.pid for c in [*self._shared.values(), *self._own] if c.pid is not None]

    def _started(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="mcp-pool", daemon=True).start()
                self._loop = loop
                atexit.register(self.close_all)
            return self._loop


POOL = McpPool()


async def _all_tools(session: ClientSession) -> list[types.Tool]:
    tools: list[types.Tool] = []
    cursor: str | None = None
    while True:
        page = await session.list_tools(params=types.PaginatedRequestParams(cursor=cursor) if cursor else None)
        tools += page.tools
        cursor = page.nextCursor
        if not cursor:
            return tools


async def _read_pid(pidfile: str, timeout_s: float) -> int | None:
    """The pid the launcher wrote (it writes before ``exec``, so it is there at once)."""
    for _ in range(int(timeout_s / 0.01)):
        try:
            return int(Path(pidfile).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            await asyncio.sleep(0.01)
    return None


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, not yet reaped, is dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8")
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def _innermost(exc: BaseException) -> BaseException:
    """The first leaf of an exception group (anyio wraps a transport's failure in one)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc
