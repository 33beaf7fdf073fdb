"""The ``rollflow`` command line: one small function per subcommand, in a table.

Each subcommand is a ``Command``: its name, a one-line help, a function that adds its
arguments to an ``argparse`` parser, and a function that runs it and returns the exit
status. ``register`` adds one to ``COMMANDS``; ``main`` builds the parser from the table,
so adding ``train``, ``resume``, ``eval``, ``sft`` or ``env`` (with its own ``new``
sub-parser) is one ``register(Command(...))`` each.

Errors a user can fix (a bad path, bad SQL, a refused write, a missing episode) print one
line to stderr and exit 1; argparse's usage errors exit 2; anything else is a bug and
keeps its traceback.

A stop is a stop in every command but ``chat`` (which ends on Ctrl-C): SIGTERM or Ctrl-C exits
with the shell's status (143, 130) and one line. That holds for whatever error the stop
caused on its way out: DuckDB, interrupted by the signal, eats the handler's ``SystemExit``
and raises ``RuntimeError: Query interrupted``, which arrives here as any other error would.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import json
import math
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb

from rollflow.flows.prefect_home import prefect_start_failure, use_project_prefect_home
from rollflow.policy.procs import start_watchdog
from rollflow.policy.stopping import (
    StopRequested, exit_on_sigterm, exit_on_stop_signals, stop_exit_code, stop_requested,
)
from rollflow.storage.errors import StorageError
from rollflow.storage.query import describe_views, open_run_sql, run_query
from rollflow.storage.runs import age_text, list_runs
from rollflow.storage.transcript import render_episode


class UserError(Exception):
    """A problem the user can fix; printed as one line, no traceback."""


def json_object_flag(text: str, flag: str = "--kwargs") -> dict[str, object]:
    """``text``, a flag's JSON object (an environment's kwargs), or a ``UserError`` naming the flag."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise UserError(f"{flag} is not JSON ({text!r}): {exc}") from None
    if not isinstance(value, dict):
        raise UserError(f"{flag} must be a JSON object, got {type(value).__name__}: {text!r}")
    return value


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {}


def register(command: Command) -> Command:
    if command.name in COMMANDS:
        raise ValueError(f"rollflow subcommand {command.name!r} is registered twice")
    COMMANDS[command.name] = command
    return command


# ---------------------------------------------------------------- output formatting

_MAX_CELL = 80


def _cell_text(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, list | dict | tuple):
        return json.dumps(value, ensure_ascii=False, default=str)
    return str(value)


def _clip(text: str) -> str:
    text = text.replace("\n", "\\n")
    return text if len(text) <= _MAX_CELL else text[: _MAX_CELL - 1] + "…"


def format_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Aligned text: numbers to the right, long or multi-line cells clipped."""
    cells = [[_clip(_cell_text(v)) for v in row] for row in rows]
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]
    numeric = [
        bool(rows) and all(isinstance(r[i], int | float) or r[i] is None for r in rows)
        for i in range(len(columns))
    ]

    def line(values: Sequence[str]) -> str:
        parts = [
            v.rjust(w) if num else v.ljust(w)
            for v, w, num in zip(values, widths, numeric, strict=True)
        ]
        return "  ".join(parts).rstrip()

    out = [line(list(columns)), "  ".join("-" * w for w in widths)]
    out.extend(line(r) for r in cells)
    out.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(out) + "\n"


def _json_value(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list | tuple):
        return [_json_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    return value


def _csv_value(value: Any) -> Any:
    """NULL is an empty field; nested values are JSON text; the rest as Python writes them."""
    if value is None:
        return ""
    return _cell_text(value) if isinstance(value, list | dict | tuple) else value


def write_csv(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    writer = csv.writer(sys.stdout, lineterminator="\n")
    writer.writerow(columns)
    writer.writerows([_csv_value(v) for v in row] for row in rows)


def write_json(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    records = [{c: _json_value(v) for c, v in zip(columns, row, strict=True)} for row in rows]
    json.dump(records, sys.stdout, ensure_ascii=False, default=str, indent=1)
    sys.stdout.write("\n")


# ---------------------------------------------------------------- sql, show, runs


def _sql_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a run folder, or a quoted glob of them ('runs/*')")
    parser.add_argument("query", nargs="?", help="one read-only SQL statement; omit to list views")
    parser.add_argument("--format", choices=("table", "csv", "json"), default="table")


def _list_views(con: duckdb.DuckDBPyConnection) -> None:
    for view, columns in describe_views(con).items():
        counted = con.execute(f"SELECT count(*) FROM {view}").fetchone()
        print(f"{view} ({counted[0] if counted else 0} rows)")
        width = max(len(name) for name, _ in columns)
        for name, kind in columns:
            print(f"  {name.ljust(width)}  {kind}")
        print()


def run_sql(args: argparse.Namespace) -> int:
    con = open_run_sql(args.run_dir)
    try:
        if args.query is None:
            _list_views(con)
            return 0
        columns, rows = run_query(con, args.query)
    finally:
        con.close()
    if args.format == "csv":
        write_csv(columns, rows)
    elif args.format == "json":
        write_json(columns, rows)
    else:
        sys.stdout.write(format_table(columns, rows))
    return 0


def _show_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="the run folder")
    parser.add_argument("episode_id", help="e.g. train/3/0/1 (see: rollflow sql RUN_DIR)")


def run_show(args: argparse.Namespace) -> int:
    sys.stdout.write(render_episode(args.run_dir, args.episode_id))
    return 0


def _runs_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs-dir", default="runs", help="the folder holding run folders")


def run_runs(args: argparse.Namespace) -> int:
    if not Path(args.runs_dir).is_dir():
        raise UserError(f"{args.runs_dir}: no such folder (pass --runs-dir)")
    statuses = list_runs(args.runs_dir)
    if not statuses:
        print(f"no runs in {args.runs_dir}")
        return 0
    columns = ["run", "status", "last finished step", "checkpoint", "updated", "notes"]
    rows = []
    for s in statuses:
        notes = [s.config_problem] if s.config_problem else []
        if s.temporaries:
            notes.append(f"{s.temporaries} half-written file(s) to discard on resume")
        notes += [s.end_note] if s.end_note else []  # why it stopped, as it recorded (storage/runs.py)
        finished, checkpoint = s.last_finished_step, s.latest_checkpoint
        rows.append(
            [s.run_id, s.describe(), "-" if finished is None else str(finished),
             "-" if checkpoint is None else str(checkpoint), age_text(s.updated), "; ".join(notes)]
        )
    sys.stdout.write(format_table(columns, rows))
    return 0


register(Command("sql", "query a run's episodes, scores, samples and steps (read-only)", _sql_arguments, run_sql))
register(Command("show", "print one episode as a readable transcript", _show_arguments, run_show))
register(Command("runs", "list runs with their status and last finished step", _runs_arguments, run_runs))


# ---------------------------------------------------------------- entry point


# Subcommands kept in their own modules; each registers itself when imported.
COMMAND_MODULES = (
    "rollflow.flows.cli_train", "rollflow.flows.cli_eval", "rollflow.flows.cli_serve", "rollflow.flows.cli_pipeline",
    "rollflow.flows.cli_rescore", "rollflow.flows.cli_env",
)


# Commands that start servers (vLLM, Prefect's): a watchdog ends them if the run is killed.
WATCHED_COMMANDS = frozenset({"train", "resume", "pipeline", "eval", "sft"})
# Commands that end on Ctrl-C as on a KeyboardInterrupt (`chat`: the conversation ends); the
# others stop on it as on SIGTERM (policy/stopping.py), with the shell's status 130.
KEYBOARD_COMMANDS = frozenset({"chat"})
# Commands that run Prefect flows: their Prefect state goes to the project, not ~/.prefect.
PREFECT_COMMANDS = frozenset({"train", "resume", "pipeline", "eval", "sft"})


def _give_prefect_a_home() -> None:
    """Before Prefect's first import (it reads its settings then): flows/prefect_home.py."""
    try:
        use_project_prefect_home()
    except OSError as exc:
        raise UserError(f"cannot create Prefect's home folder ({exc}); set PREFECT_HOME to a writable one") from exc


def stopped_line(command: str) -> str:
    """What a command stopped by a signal ends with, where it has nothing better to say."""
    return f"rollflow {command}: stopped by {signal.Signals(stop_exit_code() - 128).name}"


def build_parser() -> argparse.ArgumentParser:
    for module in COMMAND_MODULES:
        importlib.import_module(module)
    parser = argparse.ArgumentParser(
        prog="rollflow", description="Multi-turn GRPO for tool-use agents over Parquet run folders."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS.values():
        command.add_arguments(sub.add_parser(command.name, help=command.help, description=command.help))
    return parser


def main(argv: list[str] | None = None) -> int:
    exit_on_sigterm()  # `kill`: stop at the next decoding step, then run the exit handlers
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if args.command not in KEYBOARD_COMMANDS:
        exit_on_stop_signals()  # Ctrl-C too
    if args.command in WATCHED_COMMANDS:
        start_watchdog()  # SIGKILL or OOM skips atexit: it stops what the run started (policy/procs.py)
    try:
        if args.command in PREFECT_COMMANDS:
            _give_prefect_a_home()
        return COMMANDS[args.command].run(args)
    except StopRequested as stop:  # raised in a stage's thread, after SIGTERM or Ctrl-C
        print(f"rollflow {args.command}: {stop}", file=sys.stderr)
        return stop_exit_code()
    except Exception as exc:
        status = _one_line_status(args.command, exc)
        if status is None:
            raise  # a bug: its traceback
        return status


def _one_line_status(command: str, exc: Exception) -> int | None:
    """The exit status of a command that raised ``exc``, once its one line is on stderr;
    None where ``exc`` is a bug, to be raised with its traceback."""
    if stop_requested():  # whatever the stop made fail on its way out is the stop
        print(stopped_line(command), file=sys.stderr)
        return stop_exit_code()
    if isinstance(exc, BrokenPipeError):  # `rollflow sql ... | head`
        sys.stderr.close()
        return 0
    start_failure = prefect_start_failure(exc)
    if isinstance(exc, UserError | StorageError) or start_failure is not None:
        print(f"rollflow {command}: {start_failure or exc}".splitlines()[0], file=sys.stderr)
        return 1
    return None

if __name__ == "__main__":
    # `python -m rollflow.flows.cli`: subcommand modules register into flows.cli, not __main__.
    from rollflow.flows.cli import main as registered_main

    sys.exit(registered_main())
