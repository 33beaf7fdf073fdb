"""Which MCP server to reach, and how: ``McpServer``, one frozen record per server.

A server is either a command rollflow starts and talks to over its stdin and stdout
(``command`` with ``args``, ``env``, ``cwd``: the SDK's stdio transport) or a URL it posts
to (``url`` with ``headers``: streamable HTTP). Two knobs bound what a call may cost:
``timeout_s`` per call and ``max_concurrent_calls`` in flight to the server at once
(episodes share a server, and a small server answers one call at a time anyway).
``keeps_state`` says the server remembers things between calls (a shop's basket, a file
system), so each episode gets a server of its own; otherwise one server serves every
episode of a worker process.

``server_from_config`` reads one ``[env].kwargs.servers`` table; its errors name the table
and the key in one line.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_MAX_CONCURRENT_CALLS = 8
DEFAULT_STARTUP_TIMEOUT_S = 60.0
_NUMBERS = ("timeout_s", "startup_timeout_s")
_KEYS = ("name", "command", "args", "env", "cwd", "url", "headers", *_NUMBERS, "max_concurrent_calls", "keeps_state")


class McpConfigError(ValueError):
    """A server table is wrong; the message names the table and the key."""


@dataclass(frozen=True)
class McpServer:
    """One MCP server: a stdio ``command`` (with ``args``) or a streamable-HTTP ``url``.

    ``env`` and ``headers`` are pairs (a frozen record is hashable: the process-wide pool
    keys its connections by it); ``server_from_config`` builds them from tables.
    """

    command: str | None = None
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()  # added to the SDK's safe default environment
    cwd: str | None = None
    url: str | None = None
    headers: tuple[tuple[str, str], ...] = ()
    name: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S  # one call
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S  # start, initialize, list tools
    max_concurrent_calls: int = DEFAULT_MAX_CONCURRENT_CALLS
    keeps_state: bool = False

    def __post_init__(self) -> None:
        if (self.command is None) == (self.url is None):
            raise McpConfigError(f"an MCP server needs exactly one of command or url, got {self!r:.200}")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise McpConfigError(f"MCP server url {self.url!r} must start with http:// or https://")
        for key in _NUMBERS:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise McpConfigError(f"MCP server {self.label}: {key} must be a positive number, got {value!r}")
        bound = self.max_concurrent_calls
        if isinstance(bound, bool) or not isinstance(bound, int) or bound < 1:
            raise McpConfigError(f"MCP server {self.label}: max_concurrent_calls must be an integer >= 1, got {bound!r}")

    @property
    def label(self) -> str:
        """How errors name the server: its ``name``, else its command line or URL."""
        if self.name:
            return repr(self.name)
        if self.url is not None:
            return repr(self.url)
        return repr(shlex.join([self.command or "", *self.args])[:120])


def server_from_config(table: object, where: str = "servers[0]") -> McpServer:
    """An ``McpServer`` from a config table: ``{ command = ["python", "-m", "x"] }`` (a list:
    the program and its arguments; or a string with ``args``) or ``{ url = "http://..." }``,
    and the optional keys of ``McpServer``."""
    if isinstance(table, McpServer):
        return table
    if not isinstance(table, Mapping):
        raise McpConfigError(
            f"{where} must be a table such as {{ command = [...] }} or {{ url = \"...\" }}, got {table!r:.100}"
        )
    unknown = sorted(set(table) - set(_KEYS))
    if unknown:
        raise McpConfigError(f"{where} has unknown keys {unknown}; known: {', '.join(_KEYS)}")
    plain = ("name", "cwd", "url", *_NUMBERS, "max_concurrent_calls", "keeps_state")
    fields: dict[str, Any] = {key: table[key] for key in plain if key in table}
    command, args = _command(table, where)
    if command is not None:
        fields.update(command=command, args=args)
    fields["env"] = _pairs(table.get("env", {}), f"{where}.env")
    fields["headers"] = _pairs(table.get("headers", {}), f"{where}.headers")
    for key in ("name", "cwd", "url"):
        if key in fields and not isinstance(fields[key], str):
            raise McpConfigError(f"{where}.{key} must be a string, got {fields[key]!r:.100}")
    if not isinstance(fields.get("keeps_state", False), bool):
        raise McpConfigError(f"{where}.keeps_state must be true or false, got {fields['keeps_state']!r}")
    try:
        return McpServer(**fields)
    except McpConfigError as exc:
        raise McpConfigError(f"{where}: {exc}") from exc


def _command(table: Mapping[str, Any], where: str) -> tuple[str | None, tuple[str, ...]]:
    command = table.get("command")
    args = table.get("args", [])
    if not isinstance(args, list | tuple) or not all(isinstance(arg, str) for arg in args):
        raise McpConfigError(f"{where}.args must be a list of strings, got {args!r:.100}")
    if command is None:
        if args:
            raise McpConfigError(f"{where} has args but no command")
        return None, ()
    if isinstance(command, str) and command:
        return command, tuple(args)
    if isinstance(command, list | tuple) and command and all(isinstance(part, str) and part for part in command):
        return command[0], (*command[1:], *args)
    raise McpConfigError(
        f"{where}.command must be a non-empty list of strings (the program, then its arguments), got {command!r:.100}"
    )


def _pairs(table: object, where: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(table, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in table.items()):
        raise McpConfigError(f"{where} must be a table of strings, got {table!r:.100}")
    return tuple(sorted(table.items()))
