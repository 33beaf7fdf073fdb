"""``rollflow env new`` and ``rollflow env show``: start an environment of your own, and
see the exact prompt it gives the model.

``env new NAME`` writes a starter package (``envs/scaffold.py``) into the working directory,
or into ``--dir``: a folder of the user's own, never rollflow's package folders, where the
same classes could be imported under a second name. It ends by saying which
``[env].name`` loads what it wrote (on stderr: stdout lists the files, one a line).

``env show SPEC`` prints the rendered opening prompt of one task (``ops/prompt_preview.py``)
to stdout, exactly what the policy is given, and one line about it (task, tokens, model,
tools) to stderr. ``--config`` renders it for that config's model, and without a SPEC
shows that config's environment with its ``[env].kwargs``. For an environment whose tools
come from MCP servers it then lists each server's tools on stderr and runs one example call
through them (``envs/mcp/show.py``: ``--call``, else the first tool that needs no
arguments); every server the command started is stopped when it ends, however it ends.

The command registers itself in ``rollflow.flows.cli``'s table when this module is imported;
torch and transformers load only when ``show`` runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from rollflow.flows.cli import Command, UserError, json_object_flag, register

if TYPE_CHECKING:  # the mcp extra is optional
    from rollflow.envs.mcp.servers import McpServer
    from rollflow.envs.mcp.show import ExampleCall


def _env_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="env_command", metavar="ACTION", required=True)
    new = actions.add_parser("new", help="write a runnable starter environment with a test, in a folder of your own")
    new.add_argument("name", help="a Python package name, e.g. my_agent_env")
    style = new.add_mutually_exclusive_group()
    style.add_argument("--multi-turn", dest="style", action="store_const", const="hook",
                       help="hook style: start_episode / step_episode / score_episode (default)")
    style.add_argument("--async", dest="style", action="store_const", const="async",
                       help="async style: Env with reset / step / tool_specs")
    style.add_argument("--single-turn", dest="style", action="store_const", const="single",
                       help="single turn: build_prompt_messages / score_response, one reply per episode")
    new.add_argument("--dir", "--dest", dest="dest", default=".",
                     help="the folder to write the package into (default: the working directory, "
                     "loaded as [env] name = 'NAME:load_environment')")
    show = actions.add_parser("show", help="print the exact prompt the model is given for one task")
    show.add_argument("spec", nargs="?", help="the environment as module:function (default: the --config's [env])")
    show.add_argument("--task", type=int, default=0, metavar="N", help="the task's position in its split (default 0)")
    show.add_argument("--split", choices=("train", "validation"), default="train", help="default: train")
    show.add_argument("--kwargs", metavar="JSON", help="the environment's keyword arguments, a JSON object")
    show.add_argument("--config", help="a run config: its [model]'s chat template (default: the bundled model)")
    show.add_argument("--call", metavar="JSON", help='for tools from MCP servers, the example call to run: '
                      '{"tool": NAME, "arguments": {...}} (default: the first tool that needs no arguments)')


def run_env(args: argparse.Namespace) -> int:
    return run_env_show(args) if args.env_command == "show" else run_env_new(args)


def run_env_new(args: argparse.Namespace) -> int:
    from rollflow.envs.scaffold import starter_spec, write_starter

    try:
        written = write_starter(args.name, Path(args.dest), args.style or "hook")
    except (ValueError, FileExistsError) as exc:
        raise UserError(str(exc)) from exc
    for path in written:
        print(path)
    spec, run_from = starter_spec(args.name, Path(args.dest))
    where = f"; run rollflow from {run_from}" if run_from is not None else ""
    print(f'train it: rollflow train {written[-1]} (its [env] has name = "{spec}"){where}; '
          f"play it: python -m pytest {written[0].parent}; see its prompt: rollflow env show {spec}",
          file=sys.stderr)
    return 0


def run_env_show(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from rollflow.envs.runner import EnvironmentLoadError, load_environment_handle
    from rollflow.policy.models import ModelLoadError
    from rollflow.config.parsing import ConfigError
    from rollflow.config.run import EnvConfig, RunConfig, load_config
    from rollflow.ops.prompt_preview import describe_preview, preview_prompt

    if args.spec is None and args.config is None:
        raise UserError("give the environment (module:function) or a --config whose [env] to show")
    call = _example_call(args.call)
    with _mcp_servers_reached() as reached:
        try:
            config = load_config(args.config) if args.config is not None else RunConfig()
            kwargs = None if args.kwargs is None else json_object_flag(args.kwargs)
            if args.spec is not None and args.spec != config.env.name:
                config = replace(config, env=EnvConfig(name=args.spec, kwargs=kwargs or {}))
            elif kwargs is not None:
                config = replace(config, env=EnvConfig(name=config.env.name, kwargs=kwargs))
            handle = load_environment_handle(config.env.name, config.env.kwargs)
            preview = preview_prompt(config, handle, args.split, args.task)
        except (ConfigError, EnvironmentLoadError, ModelLoadError) as exc:
            raise UserError(str(exc)) from exc
        sys.stdout.write(preview.text)
        model = config.model.path or "the bundled SmolLM2-135M-Instruct"
        print(describe_preview(preview, model), file=sys.stderr)
        if reached:
            meta = handle.tasks(args.split)[args.task].payload.metadata.get("mcp_meta")
            _show_mcp_servers(list(reached), call, meta, f"{args.split} task {args.task}")
        elif call is not None:
            raise UserError(f"--call: {config.env.name} has no tools from MCP servers to call")
    return 0


@contextmanager
def _mcp_servers_reached() -> Iterator[dict[McpServer, None]]:
    """The MCP servers the environment reaches inside the block (none without the mcp extra);
    every MCP server this process started is stopped when the block ends, however it ends."""
    try:
        from rollflow.envs.mcp.connection import POOL
    except ModuleNotFoundError:  # no mcp package: the environment cannot use MCP servers
        yield {}
        return
    try:
        with POOL.recording() as reached:
            yield reached
    finally:
        POOL.close_all()


def _example_call(text: str | None) -> ExampleCall | None:
    """``--call``'s example call, checked before anything starts."""
    if text is None:
        return None
    try:
        from rollflow.envs.mcp import McpConfigError
        from rollflow.envs.mcp.show import example_call_from
    except ModuleNotFoundError as exc:
        raise UserError(f"--call: {exc}") from None
    try:
        return example_call_from(json_object_flag(text, "--call"))
    except McpConfigError as exc:
        raise UserError(str(exc)) from None


def _show_mcp_servers(servers: list[McpServer], call: ExampleCall | None, meta: object, task: str) -> None:
    from rollflow.envs.mcp import McpServerError
    from rollflow.envs.mcp.show import describe_servers

    try:
        lines = describe_servers(servers, call, meta if isinstance(meta, Mapping) else None, task)
    except McpServerError as exc:
        raise UserError(str(exc)) from exc
    print("\n".join(lines), file=sys.stderr)


register(Command("env", "environment tools: `rollflow env new NAME` writes a starter in a folder of your own, "
                 "`rollflow env show SPEC` prints the prompt the model sees", _env_arguments, run_env))
