"""The tool-use game over MCP: a FastMCP server (``server``) serving the game's lookups, and
the tasks and reward (``tasks``) the config-only form ``rollflow.envs.mcp:load_environment``
reads (configs/mcp_tool_use_game.toml)."""
