"""MCP servers' tools as rollflow ``Tool`` objects, for an environment of either style.

``mcp_tools(servers)`` starts (or reaches) each server once per process and returns its
tools by name: each has the name, description and JSON-Schema parameters the server lists,
and its ``execute`` routes the call to the server. Hand them to
``rollflow.envs.tools.run_tool_calls`` like any other tools: arguments are checked against
the schema first, the result's text (or its structured result, as JSON) is the tool
message, and an ``isError`` result, a refused call or a call that timed out is a
``tool_error`` the model reads and the step counts. A server that died mid-call raises
``McpServerError`` out of ``run_tool_calls``: the episode ends with that error, and the
next episode gets a restarted server.

``mcp_tools`` suits a hook-style environment, which has no episode boundary to hold on
to: a call made after its server was found dead goes to a restarted one.
``open_mcp_tools(servers)`` is the per-episode form: a server that ``keeps_state`` is
started for the episode and stopped by ``McpToolbox.close``, and the others are the
process's shared ones as they are when the episode starts; a server that dies during the
episode fails the rest of its calls, so the episode ends as an error, and the next episode
opens a restarted one. ``with_meta(tools, meta)`` sends ``meta`` as the ``_meta`` of every call: how
an episode tells a shared server which task it plays, unseen by the model.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollflow.envs.mcp.connection import POOL, Connection, McpServerError
from rollflow.envs.mcp.servers import McpConfigError, McpServer, server_from_config
from rollflow.envs.types import ToolResult, ToolSpec, tool_to_spec

ServerLike = McpServer | Mapping[str, Any]


@dataclass(frozen=True)
class McpTool:
    """One tool of one MCP server; ``connection`` set: the one this episode calls (else the
    process's shared one, restarted if it died)."""

    name: str
    description: str
    parameters_schema: dict[str, Any]
    server: McpServer
    meta: Mapping[str, Any] | None = None
    connection: Connection | None = field(default=None, repr=False, compare=False)

    async def execute(self, arguments: str) -> ToolResult:
        return ToolResult(content=await POOL.arun(_call(self, json.loads(arguments))))


@dataclass
class McpToolbox:
    """An episode's MCP tools; ``close`` stops the servers started for it."""

    tools: dict[str, McpTool]
    own: list[Connection]

    @property
    def specs(self) -> list[ToolSpec]:
        return [tool_to_spec(tool) for tool in self.tools.values()]

    async def close(self) -> None:
        own, self.own = self.own, []
        if own:
            await POOL.arun(_close_own(own))

    async def __aenter__(self) -> McpToolbox:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()


def parse_servers(servers: Sequence[ServerLike]) -> list[McpServer]:
    """``McpServer`` s from records or config tables (``server_from_config``)."""
    if isinstance(servers, str | Mapping) or not isinstance(servers, Sequence) or not servers:
        raise McpConfigError(f"servers must be a non-empty list of server tables, got {servers!r:.100}")
    return [server_from_config(server, f"servers[{index}]") for index, server in enumerate(servers)]


def mcp_tools(servers: Sequence[ServerLike]) -> dict[str, McpTool]:
    """The tools of ``servers`` by name, each server started (or reached) once per process.
    Call it outside any running event loop (in ``load_environment``, say): it waits for the
    servers. ``McpServerError`` names a server that fails; ``McpConfigError`` a bad table."""
    parsed = parse_servers(servers)
    stateful = [server.label for server in parsed if server.keeps_state]
    if stateful:
        raise McpConfigError(f"MCP server {stateful[0]} keeps state: open it per episode with open_mcp_tools")
    connections = POOL.run(_shared_each(parsed))
    return _tools_by_name(connections, bound=False)


async def open_mcp_tools(servers: Sequence[ServerLike]) -> McpToolbox:
    """An episode's tools: its own server for each that ``keeps_state``, the process's
    shared one for the others. Close the toolbox when the episode ends."""
    parsed = parse_servers(servers)
    own: list[Connection] = []
    try:
        connections = [await POOL.arun(_connect(server, own)) for server in parsed]
        return McpToolbox(tools=_tools_by_name(connections, bound=True), own=own)
    except BaseException:
        await McpToolbox(tools={}, own=own).close()
        raise


def with_meta(tools: Mapping[str, McpTool], meta: Mapping[str, Any] | None) -> dict[str, McpTool]:
    """Copies of ``tools`` whose calls carry ``meta`` as the request's ``_meta``."""
    return {name: dataclasses.replace(tool, meta=dict(meta) if meta else None) for name, tool in tools.items()}


def check_servers(servers: Sequence[ServerLike]) -> list[ToolSpec]:
    """Start every server once (a stateful one for the check only) and return the specs of
    all their tools; the first problem raises in one line naming the server."""
    parsed = parse_servers(servers)

    async def check() -> list[Connection]:
        own: list[Connection] = []
        try:
            return [await _connect(server, own) for server in parsed]
        finally:
            await _close_own(own)

    tools = _tools_by_name(POOL.run(check()), bound=False)
    return [tool_to_spec(tool) for tool in tools.values()]


async def _call(tool: McpTool, arguments: dict[str, Any]) -> str:
    """In the pool's loop: the call, on the episode's connection or the shared one."""
    connection = tool.connection or await POOL.shared(tool.server)
    return await connection.call(tool.name, arguments, tool.meta)


async def _close_own(connections: list[Connection]) -> None:
    for connection in connections:
        await POOL.close_own(connection)


async def _connect(server: McpServer, own: list[Connection]) -> Connection:
    if not server.keeps_state:
        return await POOL.shared(server)
    connection = await POOL.open_own(server)
    own.append(connection)
    return connection


async def _shared_each(servers: list[McpServer]) -> list[Connection]:
    return [await POOL.shared(server) for server in servers]


def _tools_by_name(connections: Sequence[Connection], bound: bool) -> dict[str, McpTool]:
    """The tools by name; ``bound``: each calls the connection it was listed on (an episode's),
    else the process's shared connection of its server at call time (a stateful server's
    tools are always bound)."""
    tools: dict[str, McpTool] = {}
    for connection in connections:
        own = connection if bound or connection.server.keeps_state else None
        for listed in connection.tools:
            if listed.name in tools:
                raise McpServerError(
                    f"tool {listed.name!r} is listed by MCP server {tools[listed.name].server.label} "
                    f"and by MCP server {connection.server.label}; tool names must be unique"
                )
            tools[listed.name] = McpTool(
                name=listed.name, description=listed.description, parameters_schema=listed.input_schema,
                server=connection.server, connection=own,
            )  # fmt: skip
    return tools
