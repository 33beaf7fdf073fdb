"""What ``rollflow env show`` says about an environment's MCP servers: each server's tools
and one example call through them, so a user sees the servers answer before training.

Which servers: those the environment reached while it loaded and opened the shown task
(``McpPool.recording``), whatever its style and however it names them. Each is opened
again the way an episode opens it (``open_mcp_tools``: the shared server, or one of its
own for a server that keeps state) and its tools are listed as the server lists them,
the parameters in short form: ``lookup(key: string, limit?: integer = 10)``.

Which call: the one ``--call`` gives (``{"tool": ..., "arguments": {...}}``), else the
first listed tool that needs no arguments (a listing or status tool, typically), else
none, said so. Simplified on purpose: arguments made up from a schema would be a guess
that fails for reasons that are not the server's. The call carries the shown task's
``mcp_meta`` as its ``_meta``, as the config-only form's episodes do, and goes through
``run_tool_calls``: what it prints is the very tool message a model would read, a
``tool_error: ...`` included. A server that dies on it raises ``McpServerError``.
"""

from __future__ import annotations

import asyncio
import json
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollflow.envs.mcp.servers import McpConfigError, McpServer
from rollflow.envs.mcp.tools import McpTool, open_mcp_tools, with_meta
from rollflow.envs.protocol import make_tool_call
from rollflow.envs.tools import run_tool_calls

DESCRIPTION_CHARS = 120
RESULT_CHARS = 2000


@dataclass(frozen=True)
class ExampleCall:
    """One call to make: a tool's name and its arguments."""

    tool: str
    arguments: dict[str, Any] = field(default_factory=dict)


def example_call_from(value: Mapping[str, Any], flag: str = "--call") -> ExampleCall:
    """An ``ExampleCall`` from ``{"tool": NAME, "arguments": {...}}``; ``McpConfigError`` naming ``flag``."""
    unknown = sorted(set(value) - {"tool", "arguments"})
    tool, arguments = value.get("tool"), value.get("arguments", {})
    if unknown or not isinstance(tool, str) or not tool or not isinstance(arguments, Mapping):
        raise McpConfigError(
            f'{flag} must be {{"tool": NAME, "arguments": {{...}}}}, got {json.dumps(value, default=str)[:100]}'
        )
    return ExampleCall(tool, dict(arguments))


def describe_servers(
    servers: Sequence[McpServer], call: ExampleCall | None = None, meta: Mapping[str, Any] | None = None,
    meta_from: str = "the task",
) -> list[str]:  # fmt: skip
    """The lines to print: each server and its tools, then the example call and its result.
    Call it outside any running event loop."""
    return asyncio.run(_describe(servers, call, meta, meta_from))


async def _describe(
    servers: Sequence[McpServer], call: ExampleCall | None, meta: Mapping[str, Any] | None, meta_from: str
) -> list[str]:
    async with await open_mcp_tools(servers) as toolbox:
        lines: list[str] = []
        for server in servers:
            listed = [tool for tool in toolbox.tools.values() if tool.server == server]
            lines.append(f"MCP server {server_line(server)}: {len(listed)} tool{'s' * (len(listed) != 1)}")
            lines += [f"  {tool_line(tool)}" for tool in listed]
        chosen = call or first_call_without_arguments(toolbox.tools.values())
        if chosen is None:
            return [*lines, "no example call: every tool needs arguments (give one with --call)"]
        sent = f", with {meta_from}'s mcp_meta {json.dumps(dict(meta), sort_keys=True)}" if meta else ""
        lines.append(f"example call{sent}: {chosen.tool}({json.dumps(chosen.arguments, ensure_ascii=False)})")
        tools = with_meta(toolbox.tools, meta)
        outcome = await run_tool_calls(tools, [make_tool_call(chosen.tool, chosen.arguments)])
        return [*lines, *result_lines(str(outcome.messages[0]["content"]))]


def result_lines(result: str) -> list[str]:
    """The tool message, indented under its call, clipped at ``RESULT_CHARS``."""
    if len(result) > RESULT_CHARS:
        result = f"{result[:RESULT_CHARS]}... ({len(result)} characters)"
    first, *rest = result.splitlines() or [""]
    return [f"  -> {first}", *(f"     {line}" for line in rest)]


def server_line(server: McpServer) -> str:
    """The server's label and its transport; a named one's command line or URL too."""
    transport = "stdio" if server.url is None else "streamable HTTP"
    if not server.name:  # the label is the command line or the URL
        return f"{server.label} ({transport})"
    where = server.url if server.url is not None else shlex.join([server.command or "", *server.args])
    return f"{server.label} ({transport}: {where})"


def tool_line(tool: McpTool) -> str:
    """``name(parameters) - the description's first line``."""
    description = (tool.description.strip().splitlines() or [""])[0]
    if len(description) > DESCRIPTION_CHARS:
        description = description[: DESCRIPTION_CHARS - 3] + "..."
    signature = f"{tool.name}({short_parameters(tool.parameters_schema)})"
    return f"{signature} - {description}" if description else signature


def short_parameters(schema: Mapping[str, Any]) -> str:
    """An object schema's properties as ``name: type``, ``name?: type = default`` when optional."""
    required = set(schema.get("required", []))
    parts = []
    for name, prop in (schema.get("properties") or {}).items():
        prop = prop if isinstance(prop, Mapping) else {}
        if name in required:
            parts.append(f"{name}: {short_type(prop)}")
        else:
            default = f" = {json.dumps(prop['default'])}" if "default" in prop else ""
            parts.append(f"{name}?: {short_type(prop)}{default}")
    return ", ".join(parts)


def short_type(schema: Mapping[str, Any]) -> str:
    """A property's schema in a few characters: ``string``, ``array[integer]``, ``"a"|"b"``, ``string|null``."""
    if "enum" in schema:
        return "|".join(json.dumps(value) for value in schema["enum"])
    if "const" in schema:
        return json.dumps(schema["const"])
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            return "|".join(short_type(part) if isinstance(part, Mapping) else "any" for part in schema[key])
    if isinstance(schema.get("$ref"), str):
        return schema["$ref"].rsplit("/", 1)[-1]
    kind = schema.get("type")
    if isinstance(kind, list):
        return "|".join(str(part) for part in kind)
    if kind == "array" and isinstance(schema.get("items"), Mapping):
        return f"array[{short_type(schema['items'])}]"
    return str(kind) if kind else "any"


def first_call_without_arguments(tools: Iterable[McpTool]) -> ExampleCall | None:
    """The first tool, in listing order, whose schema requires no argument, called with none."""
    for tool in tools:
        if not tool.parameters_schema.get("required"):
            return ExampleCall(tool.name)
    return None
