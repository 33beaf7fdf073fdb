"""The tool-use game over MCP: an MCP server (``server``) serving the game's own tools, and
the tasks and reward (``tasks``) the config-only form ``rollflow.envs.mcp:load_environment``
reads (configs/mcp_tool_use_game.toml)."""
