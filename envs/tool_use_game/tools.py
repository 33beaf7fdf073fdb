"""The game's three tools over one task's fact table: ``list_fact_keys``, ``lookup``, ``calculator``.

The calculator is the shared one from ``rollflow.envs.arithmetic``.

Each tool has a plain ``run(arguments)`` (used to write expert transcripts without an
event loop) and the async ``execute`` of the ``Tool`` protocol (used in episodes, through
``rollflow.envs.tools.execute_tool_calls``, which validates arguments against the schema first).
A tool is built per episode step from the example's facts: the environment stays stateless.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from rollflow.envs.arithmetic import CalculatorTool
from rollflow.envs.types import ToolResult, ToolSpec, tool_to_spec


class ListFactKeysTool:
    name = "list_fact_keys"
    description = "List the keys of the facts you can look up for this question."
    parameters_schema: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}

    def __init__(self, facts: Mapping[str, int]) -> None:
        self.facts = facts

    def run(self, arguments: Mapping[str, Any]) -> str:
        return json.dumps(list(self.facts))

    async def execute(self, arguments: str) -> ToolResult:
        return ToolResult(content=self.run(json.loads(arguments)))


class LookupTool:
    name = "lookup"
    description = "Look up the value of one fact by its key (see list_fact_keys)."
    parameters_schema: dict[str, Any] = {
        "type": "object",
        "properties": {"key": {"type": "string"}},
        "required": ["key"],
        "additionalProperties": False,
    }

    def __init__(self, facts: Mapping[str, int]) -> None:
        self.facts = facts

    def run(self, arguments: Mapping[str, Any]) -> str:
        key = arguments["key"]
        if key not in self.facts:
            raise ValueError(f"no fact named {key!r}; call list_fact_keys to see the keys")
        return str(self.facts[key])

    async def execute(self, arguments: str) -> ToolResult:
        return ToolResult(content=self.run(json.loads(arguments)))


GameTool = ListFactKeysTool | LookupTool | CalculatorTool


def game_tools(facts: Mapping[str, int]) -> dict[str, GameTool]:
    tools: list[GameTool] = [ListFactKeysTool(facts), LookupTool(facts), CalculatorTool()]
    return {tool.name: tool for tool in tools}


GAME_TOOL_SPECS: tuple[ToolSpec, ...] = tuple(tool_to_spec(tool) for tool in game_tools({}).values())
