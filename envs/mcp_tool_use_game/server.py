"""The tool-use game's tools served over MCP: ``list_fact_keys``, ``lookup``, ``calculator``.

::

    python -m rollflow.envs.mcp_tool_use_game.server              # stdio (what rollflow starts)
    python -m rollflow.envs.mcp_tool_use_game.server --http      # streamable HTTP on 127.0.0.1,
                                                                  # an ephemeral port; prints its URL

The server holds the game's fact tables itself, generated from ``--seed`` like the tasks
(``rollflow.envs.tool_use_game.tasks.generate_examples``), as a real server holds its
data; each call names its task in the request's ``_meta`` (``{"task_id": ...}``, which the
config-only environment sends from the task's ``mcp_meta``), unseen by the model.

It serves the Python game's own tool objects (``rollflow.envs.tool_use_game.tools``): each
is listed with that tool's description and JSON schema, and a call answers with the very
text the tool returns, so a model reads the same tool list and the same results in either
form (configs/mcp_tool_use_game.toml's prompt is token for token the Python game's). Hence
the SDK's low-level ``Server``, not FastMCP: FastMCP lists a schema it derives from a
function's signature (pydantic's, with "title" keys and no ``additionalProperties``). The
SDK checks each call's arguments against the listed schema before the tool runs; an
unknown key or a bad expression is an ``isError`` result, the model's feedback.

Its defaults match ``rollflow.envs.mcp_tool_use_game.tasks``; change both together.
"""

from __future__ import annotations

import argparse
import socket
import sys
from collections.abc import Mapping
from typing import Any

import anyio
from mcp import types
from mcp.server.fastmcp.server import StreamableHTTPASGIApp
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from starlette.applications import Starlette
from starlette.routing import Route

from rollflow.envs.mcp_tool_use_game.tasks import NUM_TRAIN, NUM_VALIDATION, SEED
from rollflow.envs.tool_use_game.tasks import generate_examples
from rollflow.envs.tool_use_game.tools import ListFactKeysTool, LookupTool, game_tools

HTTP_PATH = "/mcp"
READS_FACTS = frozenset({ListFactKeysTool.name, LookupTool.name})  # the calculator needs no task


def build_server(seed: int = SEED, num_train: int = NUM_TRAIN, num_validation: int = NUM_VALIDATION) -> Server:
    """An MCP server of the game's tools over the fact tables of the tasks generated from ``seed``."""
    train, validation = generate_examples(seed, num_train, num_validation)
    facts_by_task = {str(example.id): dict(example.metadata["facts"]) for example in [*train, *validation]}
    server: Server = Server("tool-use-game")
    listed = [
        types.Tool(name=tool.name, description=tool.description, inputSchema=tool.parameters_schema)
        for tool in game_tools({}).values()
    ]

    def facts() -> Mapping[str, int]:
        meta = server.request_context.meta
        task_id = (meta.model_extra or {}).get("task_id") if meta is not None else None
        if task_id not in facts_by_task:
            raise ValueError(f"unknown task {task_id!r}: this server holds the tasks of seed {seed}")
        return facts_by_task[task_id]

    @server.list_tools()
    async def list_tools() -> list[types.Tool]:
        return list(listed)

    @server.call_tool()  # validate_input (the default): the arguments fit the listed schema
    async def call_tool(name: str, arguments: dict[str, Any]) -> list[types.TextContent]:
        tools = game_tools(facts() if name in READS_FACTS else {})
        if name not in tools:
            raise ValueError(f"unknown tool {name!r}")
        return [types.TextContent(type="text", text=tools[name].run(arguments))]

    return server


async def serve_stdio(server: Server) -> None:
    async with stdio_server() as (read_stream, write_stream):
        await server.run(read_stream, write_stream, server.create_initialization_options())


def http_app(server: Server) -> Starlette:
    """The streamable HTTP endpoint at ``HTTP_PATH``, for clients on this machine only (the
    DNS-rebinding check FastMCP sets for a server on 127.0.0.1)."""
    security = TransportSecuritySettings(
        enable_dns_rebinding_protection=True, allowed_hosts=["127.0.0.1:*"], allowed_origins=["http://127.0.0.1:*"]
    )
    sessions = StreamableHTTPSessionManager(app=server, security_settings=security)
    return Starlette(routes=[Route(HTTP_PATH, endpoint=StreamableHTTPASGIApp(sessions))],
                     lifespan=lambda app: sessions.run())  # fmt: skip


def serve_http(server: Server) -> None:
    """Serve streamable HTTP on 127.0.0.1 at a port the kernel picks; print the URL once the
    port listens (uvicorn accepts from the same socket when it has started)."""
    import uvicorn

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)  # before the URL goes out: a client that connects at once waits in the backlog
    print(f"http://127.0.0.1:{listener.getsockname()[1]}{HTTP_PATH}", flush=True)
    config = uvicorn.Config(http_app(server), log_level="warning")
    uvicorn.Server(config).run(sockets=[listener])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--http", action="store_true", help="serve streamable HTTP instead of stdio")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--num-train", type=int, default=NUM_TRAIN)
    parser.add_argument("--num-validation", type=int, default=NUM_VALIDATION)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    server = build_server(args.seed, args.num_train, args.num_validation)
    if args.http:
        serve_http(server)
    else:
        anyio.run(serve_stdio, server)


if __name__ == "__main__":
    main()
