"""``rollflow rescore`` and ``rollflow replay``: a stored run against a changed environment.

Both read the run's files and write only beside them (``RUN_DIR/rescores/NAME``,
``RUN_DIR/replays/NAME``); see ``ops/rescore.py`` and ``ops/replay.py``. Running the
same command again resumes an interrupted one. They register themselves in
``rollflow.flows.cli``'s table when this module is imported; the environment and scoring
code is imported only when a command runs.
"""

from __future__ import annotations

import argparse

from rollflow.flows.cli import Command, UserError, json_object_flag, register


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="the run folder")
    parser.add_argument("--env", required=True, help="the changed environment as module:function")
    parser.add_argument(
        "--kwargs", default="{}", help='its load_environment arguments as a JSON object, e.g. \'{"level": 2}\''
    )
    parser.add_argument("--name", help="the output's name (default: <module>-<hash of env, kwargs, filter>)")
    parser.add_argument("--where", help="an SQL condition over the episodes view (default: every episode)")


def _user_errors() -> tuple[type[BaseException], ...]:
    from rollflow.envs.runner import EnvironmentLoadError
    from rollflow.config.parsing import ConfigError
    from rollflow.ops.rescore import RescoreError

    return (ConfigError, EnvironmentLoadError, RescoreError)


def run_rescore(args: argparse.Namespace) -> int:
    from rollflow.ops.rescore import rescore_run

    try:
        summary = rescore_run(args.run_dir, args.env, json_object_flag(args.kwargs), args.name, args.where)
    except _user_errors() as exc:
        raise UserError(str(exc)) from exc
    resumed = f", {summary.chunks_skipped} kept from an interrupted run" if summary.chunks_skipped else ""
    done = f"{summary.rows} episodes in {summary.chunks_written} files{resumed}"
    print(f"rescore {summary.name}: {done} -> {summary.root}")
    print(f"query: rollflow sql {args.run_dir} \"SELECT * FROM rescores WHERE rescore = '{summary.name}'\"")
    return 0


def run_replay(args: argparse.Namespace) -> int:
    from rollflow.storage.query import open_run_sql, run_query
    from rollflow.ops.replay import replay_run

    try:
        summary = replay_run(args.run_dir, args.env, json_object_flag(args.kwargs), args.name, args.where)
    except _user_errors() as exc:
        raise UserError(str(exc)) from exc
    con = open_run_sql(args.run_dir)
    try:
        _, rows = run_query(
            con, "SELECT count(*), count_if(matched), min(first_diff_turn) FROM replays "
            f"WHERE replay = '{summary.name}'",
        )
    finally:
        con.close()
    total, matched, first = rows[0]
    where = "" if first is None else f"; the earliest difference is at turn {first}"
    resumed = f", {summary.chunks_skipped} files kept from an interrupted run" if summary.chunks_skipped else ""
    print(f"replay {summary.name}: {matched} of {total} episodes matched{where}{resumed} -> {summary.root}")
    unmatched = f"SELECT * FROM replays WHERE replay = '{summary.name}' AND NOT matched"
    print(f"query: rollflow sql {args.run_dir} \"{unmatched}\"")
    return 0


register(Command("rescore", "score a stored run's episodes with a changed environment (no generation)",
                 _arguments, run_rescore))
register(Command("replay", "play a stored run's recorded actions through a changed environment (no model)",
                 _arguments, run_replay))
