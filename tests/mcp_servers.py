"""Small MCP servers that misbehave on purpose, for tests/test_envs_mcp.py: ``python tests/mcp_servers.py KIND``.

- ``fails``: exits at once with a message on stderr (a server that fails to start);
- ``not-mcp``: answers every line with text that is not JSON-RPC;
- ``no-tools``: a FastMCP server with no tools;
- ``bad-schema``: lists a tool whose input schema is invalid (``"type": "not-a-type"``);
- ``slow``: a tool ``nap(seconds)`` that sleeps, and ``counter`` that counts its calls (state);
- ``lingering``: ``slow``, but it takes a minute to exit once its stdin closes (where a
  well-behaved stdio server exits at once), so only a signal ends it soon.
"""

from __future__ import annotations

import sys
import time


def not_mcp() -> None:
    for _ in sys.stdin:
        print("hello, I am not an MCP server", flush=True)


def no_tools() -> None:
    from mcp.server.fastmcp import FastMCP

    FastMCP("no-tools", log_level="WARNING").run("stdio")


def bad_schema() -> None:
    import anyio
    from mcp import types
    from mcp.server.lowlevel import Server
    from mcp.server.stdio import stdio_server

    server: Server = Server("bad-schema")

    @server.list_tools()
    async def list_tools() -> list[types.Tool]:
        schema = {"type": "object", "properties": {"x": {"type": "not-a-type"}}}
        return [types.Tool(name="broken", description="a tool with a bad schema", inputSchema=schema)]

    async def main() -> None:
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())

    anyio.run(main)


def slow() -> None:
    import anyio
    from mcp.server.fastmcp import FastMCP

    server = FastMCP("slow", log_level="WARNING")
    calls = [0]

    @server.tool(description="Sleep for some seconds.")
    async def nap(seconds: float) -> str:
        await anyio.sleep(seconds)
        return f"slept {seconds}"

    @server.tool(description="How many times this server's counter was called.")
    def counter() -> int:
        calls[0] += 1
        return calls[0]

    server.run("stdio")


if __name__ == "__main__":
    kind = sys.argv[1]
    if kind == "fails":
        sys.exit("cannot open the database at /nonexistent/db.sqlite")
    {"not-mcp": not_mcp, "no-tools": no_tools, "bad-schema": bad_schema, "slow": slow, "lingering": slow}[kind]()
    if kind == "lingering":
        time.sleep(60)
