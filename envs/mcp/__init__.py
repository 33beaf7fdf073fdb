"""Tools from MCP servers: any Model Context Protocol server's tools in an environment.

- ``mcp_tools(servers)`` / ``open_mcp_tools(servers)``: the servers' tools as rollflow
  ``Tool`` objects for an environment of either style (``tools``);
- ``load_environment(servers, tasks, reward, ...)``: the config-only form, a server and two
  functions and no environment class (``environment``);
- ``McpServer``: a stdio command or a streamable-HTTP URL (``servers``);
- the sessions live in one event-loop thread per process, and a stdio server dies with the
  process that started it (``connection``, ``launcher``);
- ``rollflow env show`` lists the tools of the servers an environment reached and runs one
  example call through them (``show``).

Needs the ``mcp`` package (``pip install rollflow[mcp]``).
"""

from rollflow.envs.mcp.connection import POOL, McpServerError, McpToolError
from rollflow.envs.mcp.environment import McpTaskEnv, load_environment
from rollflow.envs.mcp.servers import McpConfigError, McpServer, server_from_config
from rollflow.envs.mcp.tools import McpTool, McpToolbox, check_servers, mcp_tools, open_mcp_tools, with_meta

__all__ = [
    "POOL",
    "McpConfigError",
    "McpServer",
    "McpServerError",
    "McpTaskEnv",
    "McpTool",
    "McpToolError",
    "McpToolbox",
    "check_servers",
    "load_environment",
    "mcp_tools",
    "open_mcp_tools",
    "server_from_config",
    "with_meta",
]
