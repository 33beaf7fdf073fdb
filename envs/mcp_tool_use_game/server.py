"""The tool-use game's tools served over MCP (FastMCP): ``list_fact_keys``, ``lookup``, ``calculator``.

::

    python -m rollflow.envs.mcp_tool_use_game.server              # stdio (what rollflow starts)
    python -m rollflow.envs.mcp_tool_use_game.server --http      # streamable HTTP on 127.0.0.1,
                                                                  # an ephemeral port; prints its URL

The server holds the game's fact tables itself, generated from ``--seed`` like the tasks
(``rollflow.envs.tool_use_game.tasks.generate_examples``), as a real server holds its
data; each call names its task in the request's ``_meta`` (``{"task_id": ...}``, which the
config-only environment sends from the task's ``mcp_meta``), unseen by the model. The tools
answer exactly as the Python game's do (they reuse its tool classes); an unknown key or a
bad expression is an ``isError`` result, the model's feedback.

Its defaults match ``rollflow.envs.mcp_tool_use_game.tasks``; change both together.
"""

from __future__ import annotations

import argparse
import socket
import sys
from collections.abc import Mapping

from mcp.server.fastmcp import Context, FastMCP

from rollflow.envs.arithmetic import CalculatorTool
from rollflow.envs.mcp_tool_use_game.tasks import NUM_TRAIN, NUM_VALIDATION, SEED
from rollflow.envs.tool_use_game.tasks import generate_examples
from rollflow.envs.tool_use_game.tools import ListFactKeysTool, LookupTool


def build_server(seed: int = SEED, num_train: int = NUM_TRAIN, num_validation: int = NUM_VALIDATION) -> FastMCP:
    """A FastMCP server over the fact tables of the game's tasks generated from ``seed``."""
    train, validation = generate_examples(seed, num_train, num_validation)
    facts_by_task = {str(example.id): dict(example.metadata["facts"]) for example in [*train, *validation]}
    server = FastMCP("tool-use-game", log_level="WARNING")

    def facts(context: Context) -> Mapping[str, int]:
        meta = context.request_context.meta
        task_id = (meta.model_extra or {}).get("task_id") if meta is not None else None
        if task_id not in facts_by_task:
            raise ValueError(f"unknown task {task_id!r}: this server holds the tasks of seed {seed}")
        return facts_by_task[task_id]

    @server.tool(description=ListFactKeysTool.description)
    def list_fact_keys(ctx: Context) -> str:
        return ListFactKeysTool(facts(ctx)).run({})

    @server.tool(description=LookupTool.description)
    def lookup(key: str, ctx: Context) -> str:
        return LookupTool(facts(ctx)).run({"key": key})

    @server.tool(description=CalculatorTool.description)
    def calculator(expression: str) -> str:
        return CalculatorTool().run({"expression": expression})

    return server


def serve_http(server: FastMCP) -> None:
    """Serve streamable HTTP on 127.0.0.1 at a port the kernel picks; print the URL once the
    port listens (uvicorn accepts from the same socket when it has started)."""
    import uvicorn

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)  # before the URL goes out: a client that connects at once waits in the backlog
    print(f"http://127.0.0.1:{listener.getsockname()[1]}{server.settings.streamable_http_path}", flush=True)
    config = uvicorn.Config(server.streamable_http_app(), log_level="warning")
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
        server.run("stdio")


if __name__ == "__main__":
    main()
