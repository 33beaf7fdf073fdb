"""``rollflow env show`` for an environment whose tools come from MCP servers (flows/cli_env.py,
envs/mcp/show.py): each server's tools and one example call, with the real bundled server
over stdio, and no server left once the command returns, whether it succeeded or failed.

The leak checks run right after the command, before this file's own clean-up fixture
stops whatever is left (which would hide a command that forgot to).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollflow.envs.mcp import POOL, McpServer, McpTool
from rollflow.envs.mcp.show import ExampleCall, first_call_without_arguments, short_parameters
from rollflow.envs.mcp_tool_use_game.tasks import NUM_TRAIN, NUM_VALIDATION, SEED, tasks
from rollflow.envs.tool_use_game.tasks import generate_examples
from rollflow.flows.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_envs_mcp import KWARGS, SPEC, _server_processes, test_server  # noqa: E402


@pytest.fixture(autouse=True)
def _stop_what_is_left() -> Iterator[None]:
    yield
    POOL.close_all()


def show(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    status = main(["env", "show", *argv])
    out, err = capsys.readouterr()
    assert _server_processes() == [], "env show left MCP servers running"
    return status, out, err


def test_it_lists_the_servers_tools_and_runs_a_call_that_needs_no_arguments(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, out, err = show([SPEC, "--kwargs", json.dumps(KWARGS), "--task", "3"], capsys)
    assert status == 0 and out.endswith("<|im_start|>assistant\n")
    task = tasks("train")[3]
    facts = _facts(task["id"])
    lines = err.splitlines()
    start = lines.index("MCP server 'game' (stdio: python -m rollflow.envs.mcp_tool_use_game.server): 3 tools")
    assert lines[start + 1 : start + 4] == [
        "  list_fact_keys() - List the keys of the facts you can look up for this question.",
        "  lookup(key: string) - Look up the value of one fact by its key (see list_fact_keys).",
        "  calculator(expression: string) - Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
    ]
    meta = json.dumps({"task_id": task["id"]})
    assert lines[start + 4 :] == [
        f"example call, with train task 3's mcp_meta {meta}: list_fact_keys({{}})",
        f"  -> {json.dumps(list(facts))}",  # task 3's keys: the call carried its task
    ]


def test_call_names_the_example_call_and_a_tool_error_is_shown_as_the_model_reads_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    task = tasks("validation")[1]
    key = task["needed_keys"][0]
    argv = [SPEC, "--kwargs", json.dumps(KWARGS), "--split", "validation", "--task", "1"]
    status, _, err = show([*argv, "--call", json.dumps({"tool": "lookup", "arguments": {"key": key}})], capsys)
    assert status == 0
    assert err.splitlines()[-2:] == [
        f"example call, with validation task 1's mcp_meta {json.dumps({'task_id': task['id']})}: "
        f'lookup({{"key": "{key}"}})',
        f"  -> {_facts(task['id'])[key]}",
    ]
    status, _, err = show([*argv, "--call", '{"tool": "lookup", "arguments": {"key": "no_such_key"}}'], capsys)
    assert status == 0
    assert err.splitlines()[-1].startswith("  -> tool_error: ") and "no fact named 'no_such_key'" in err
    status, _, err = show([*argv, "--call", '{"tool": "lookup", "arguments": {}}'], capsys)
    assert status == 0 and "tool_error: " in err.splitlines()[-1] and "'key' is a required property" in err


def test_a_server_that_fails_stops_the_ones_already_started(capsys: pytest.CaptureFixture[str]) -> None:
    kwargs = {**KWARGS, "servers": [*KWARGS["servers"], test_server("fails")]}
    status, out, err = show([SPEC, "--kwargs", json.dumps(kwargs)], capsys)
    assert status == 1 and out == "" and len(err.splitlines()) == 1
    assert "MCP server 'fails' failed to start" in err and "cannot open the database" in err


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--call", '{"tool": 3}'], '--call must be {"tool": NAME, "arguments": {...}}, got {"tool": 3}'),
        (["--call", '{"tool": "x", "args": {}}'], "--call must be"),
        (["--call", "[]"], "--call must be a JSON object, got list"),
    ],
)
def test_a_bad_call_is_refused_before_anything_starts(
    argv: list[str], problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, err = show([SPEC, "--kwargs", json.dumps(KWARGS), *argv], capsys)
    assert status == 1 and out == "" and len(err.splitlines()) == 1 and problem in err
    assert POOL.pids() == []  # refused before the environment loaded


def test_call_on_an_environment_without_mcp_servers(capsys: pytest.CaptureFixture[str]) -> None:
    game = "rollflow.envs.tool_use_game:load_environment"
    status, _, err = show([game, "--call", '{"tool": "lookup"}'], capsys)
    assert status == 1
    assert err.splitlines()[-1] == f"rollflow env: --call: {game} has no tools from MCP servers to call"


def test_parameters_in_short_form() -> None:
    schema = {
        "type": "object",
        "properties": {
            "query": {"type": "string"},
            "limit": {"type": "integer", "default": 10},
            "tags": {"type": "array", "items": {"type": "string"}},
            "mode": {"enum": ["fast", "exact"]},
            "since": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "where": {"$ref": "#/$defs/Filter"},
            "anything": {},
        },
        "required": ["query", "mode"],
    }
    assert short_parameters(schema) == (
        'query: string, limit?: integer = 10, tags?: array[string], mode: "fast"|"exact", '
        "since?: string|null, where?: Filter, anything?: any"
    )
    assert short_parameters({"type": "object"}) == ""


def test_the_default_example_call_is_the_first_tool_that_needs_no_arguments() -> None:
    server = McpServer(command="python")

    def tool(name: str, required: list[str]) -> McpTool:
        schema = {"type": "object", "properties": {key: {"type": "string"} for key in required}, "required": required}
        return McpTool(name=name, description="", parameters_schema=schema, server=server)

    listed = [tool("get", ["id"]), tool("status", []), tool("list", [])]
    assert first_call_without_arguments(listed) == ExampleCall("status")
    assert first_call_without_arguments([tool("get", ["id"]), tool("put", ["id", "value"])]) is None


def _facts(task_id: str) -> dict[str, int]:
    train, validation = generate_examples(SEED, NUM_TRAIN, NUM_VALIDATION)
    return next(dict(example.metadata["facts"]) for example in [*train, *validation] if example.id == task_id)
