"""``rollflow train`` and ``resume``: the subcommands that start training.

They register themselves in ``rollflow.flows.cli``'s table when this module is imported (the
table's loader does that). Prefect is imported only when a flow actually runs, so
``rollflow sql`` stays fast. (``env new`` / ``env show`` are in ``flows/cli_env.py``.)
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from rollflow.flows.cli import Command, UserError, register

if TYPE_CHECKING:
    from rollflow.flows.runs import RunHandle


def _quiet_prefect_defaults() -> None:
    # No network here: Prefect's telemetry would log an error on every run.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def _user_errors() -> tuple[type[BaseException], ...]:
    from rollflow.envs.runner import EnvironmentLoadError
    from rollflow.flows.runs import RunSetupError
    from rollflow.policy.models import ModelLoadError
    from rollflow.config.parsing import ConfigError
    from rollflow.tasks.step_health import StepFailedError

    return (ConfigError, RunSetupError, EnvironmentLoadError, ModelLoadError, FileNotFoundError, StepFailedError)


def _train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="a TOML config, e.g. configs/default.toml")
    parser.add_argument("--run-dir", help="the run folder (default: <runs_dir>/<config name>-<time>)")


def run_train(args: argparse.Namespace) -> int:
    return _run_flow(config_path=args.config, run_dir=args.run_dir)


def _resume_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="the run folder of a stopped or failed run")


def run_resume(args: argparse.Namespace) -> int:
    return _run_flow(config_path=None, run_dir=args.run_dir)


def _run_flow(config_path: str | None, run_dir: str | None) -> int:
    _quiet_prefect_defaults()
    try:
        # A bad config, folder, environment or model path fails here in one clear line,
        # before Prefect starts and before a new run folder is made; the flow then runs
        # on the frozen copy in the (new or existing) run folder.
        handle = _checked_run(config_path, run_dir)
        if config_path is None and handle.nothing_left():  # no Prefect, no generator
            steps = handle.config.train.num_steps
            handle.report(f"complete: its {steps} steps and their last validation are written; nothing to do")
            handle.close()
            print(handle.root)
            return 0
        from rollflow.flows.prefect_log import PREFECT_LOG, prefect_log_in
        from rollflow.flows.prefect_server import serve_prefect_in_own_session
        from rollflow.flows.train import train_flow
        from rollflow.storage.runs import resume_summary

        serve_prefect_in_own_session()  # out of reach of a terminal's Ctrl-C (flows/prefect_server.py)

        if config_path is None or handle.folder.steps("train"):
            handle.report(resume_summary(handle.root))
        log = handle.root / PREFECT_LOG
        try:
            with prefect_log_in(log):  # Prefect's tracebacks go there, not to the console
                folder = train_flow(run_dir=str(handle.root))
        except BaseException as exc:  # a crash, Ctrl-C, SIGTERM: the folder keeps what finished
            from rollflow.ops.run_summary import record_run_end

            record_run_end(handle.root, exc)  # what `rollflow runs` says of it
            handle.report(f"continue with `rollflow resume {handle.root}`")
            if isinstance(exc, _user_errors()):  # the command prints the first line
                first, *rest = str(exc).split("\n", 1)
                raise UserError("\n".join([f"{first} (Prefect's log, with the traceback: {log})", *rest])) from exc
            raise
    except _user_errors() as exc:
        raise UserError(str(exc)) from exc
    print(folder)
    return 0


def _checked_run(config_path: str | None, run_dir: str | None) -> RunHandle:
    """The run to start or resume, once ``preflight`` passed on its config."""
    from rollflow.flows.runs import open_run
    from rollflow.config.run import load_config
    from rollflow.ops.preflight import preflight

    if config_path is None:  # resume: the folder exists already, opening it makes nothing
        handle = open_run(None, run_dir)
        try:
            preflight(handle.config)
        except BaseException:
            handle.close()
            raise
        return handle
    preflight(load_config(config_path))
    return open_run(config_path, run_dir)


register(Command("train", "train a policy with GRPO (a Prefect flow); prints the run folder", _train_arguments, run_train))
register(Command("resume", "continue a stopped or failed run from where it stopped", _resume_arguments, run_resume))
