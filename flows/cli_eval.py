"""``rollflow eval`` and ``rollflow sft``: score a policy, or warm-start one on transcripts.

``eval`` checks its config and flags first (``flows/eval_config.py: check_eval``), as
``train`` does, so a wrong ``--model`` or ``--env`` is one line and leaves no run folder.
As ``train`` does too, it keeps Prefect's log (tracebacks included) in the run folder
(``flows/prefect_log.py``) and ends a failure in one line that names it (every episode
failed, say), and a stop (Ctrl-C) in one line that says how to run it again.

They register themselves in ``rollflow.flows.cli``'s table when this module is imported. Prefect,
torch and the flows are imported only when a command runs, so ``rollflow sql`` stays fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rollflow.flows.cli import Command, UserError, register
from rollflow.policy.stopping import StopRequested, stop_requested


def _user_errors() -> tuple[type[BaseException], ...]:
    from rollflow.envs.runner import EnvironmentLoadError
    from rollflow.flows.runs import RunSetupError
    from rollflow.policy.models import ModelLoadError
    from rollflow.config.parsing import ConfigError
    from rollflow.tasks.sft_rows import SFTDataError
    from rollflow.tasks.step_health import StepFailedError

    return (ConfigError, EnvironmentLoadError, ModelLoadError, SFTDataError, FileNotFoundError, RunSetupError,
            StepFailedError)


def _eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="a run config (TOML); default: the bundled model on the bundled game")
    parser.add_argument("--env", help="the environment as module:function (replaces [env])")
    parser.add_argument("--model", help="a Hugging Face model folder or a .gguf file")
    parser.add_argument("--adapter", help="a LoRA adapter folder on top of the model (e.g. from rollflow sft)")
    parser.add_argument("--base-url", help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--api-model", help="the model name that server expects")
    parser.add_argument("--tools-in-system-prompt", action="store_true",
                        help="(server) describe the tools in the system prompt, not with tools=, as a "
                             "rollflow-trained policy read them (a rollflow export's SERVING.md)")
    parser.add_argument("--tasks", type=int, help="evaluate the first N validation tasks")
    parser.add_argument("--run-dir", help="the run folder (default: <runs_dir>/eval-<config name>-<time>)")


def run_eval(args: argparse.Namespace) -> int:
    """Play, score, write the run folder, then print the report to stdout."""
    if args.tasks is not None and args.tasks < 1:
        raise UserError(f"--tasks must be at least 1; got {args.tasks}")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    try:
        from rollflow.flows.eval_config import EvalOverrides, check_eval

        # A bad config, model path or environment fails here in one line, before Prefect
        # starts and before a run folder is made (the flow checks again, for pipelines).
        config = check_eval(args.config, EvalOverrides(args.env, args.model, args.adapter, args.base_url,
                                                       args.api_model, args.tasks, args.tools_in_system_prompt))
        from rollflow.flows.eval import eval_run_dir
        from rollflow.flows.prefect_server import serve_prefect_in_own_session

        root = eval_run_dir(config, args.config, args.run_dir)
        serve_prefect_in_own_session()  # out of reach of a terminal's Ctrl-C (flows/prefect_server.py)
        _evaluate(args, root)
    except _user_errors() as exc:
        raise UserError(str(exc)) from exc
    sys.stdout.write(_report(root))
    return 0


def _again(root: Path) -> str:
    return f"the same `rollflow eval` with `--run-dir {root}`"


def _evaluate(args: argparse.Namespace, root: Path) -> None:
    """The eval flow into ``root``, with Prefect's log (tracebacks included) in ``root``:
    a failure the user can act on is raised as one line naming that log, a stop as one line
    on how to run the evaluation again."""
    from rollflow.flows.eval import eval_flow
    from rollflow.flows.prefect_log import PREFECT_LOG, prefect_log_in

    log = root / PREFECT_LOG
    try:
        with prefect_log_in(log):  # Prefect's tracebacks go there, not to the console
            eval_flow(
                config_path=args.config, run_dir=str(root), env=args.env, model=args.model,
                adapter=args.adapter, base_url=args.base_url, api_model=args.api_model, num_tasks=args.tasks,
                log_report=False,  # printed by the command, to stdout
                tools_in_system_prompt=args.tools_in_system_prompt,
            )
    except BaseException as exc:  # a failure, Ctrl-C, SIGTERM: the folder keeps what finished
        if stop_requested():
            raise StopRequested(f"stopped; {_again(root)} finishes the evaluation") from exc
        if isinstance(exc, _user_errors()):
            first, *rest = str(exc).split("\n", 1)
            raise UserError("\n".join([f"{first} (Prefect's log, with the traceback: {log})", *rest])) from exc
        raise


def _report(root: Path) -> str:
    """The finished evaluation's report; a stop while its SQL runs is one line that says
    the evaluation is complete and how to print the report."""
    from rollflow.config.run import load_config
    from rollflow.flows.eval import describe_policy, eval_report, format_report

    try:
        return format_report(eval_report(root), describe_policy(load_config(root / "config.toml", frozen=True)))
    except BaseException as exc:
        if stop_requested():
            complete = f"the evaluation is complete: {_again(root)} prints it"
            raise StopRequested(f"stopped before the report; {complete}") from exc
        raise


def _sft_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="a run config (TOML) with an [sft] section")
    parser.add_argument("--run-dir", help="the run folder (default: <runs_dir>/sft-<config name>-<time>)")
    parser.add_argument("--preview", type=int, metavar="N",
                        help="print the first N rows with their trained tokens marked, then exit without training")


def run_sft(args: argparse.Namespace) -> int:
    """Train on the transcripts, then print the losses and how to start GRPO from the result."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    try:
        from rollflow.flows.sft import describe_sft, preview_sft, sft_flow
        from rollflow.config.run import load_config

        if args.preview is not None:
            sys.stdout.write(preview_sft(args.config, max(args.preview, 1)))
            return 0

        from rollflow.flows.prefect_server import serve_prefect_in_own_session

        load_config(args.config)  # a bad config fails in one line, before Prefect starts
        serve_prefect_in_own_session()  # out of reach of a terminal's Ctrl-C
        policy = sft_flow(config_path=args.config, run_dir=args.run_dir)
    except _user_errors() as exc:
        raise UserError(str(exc)) from exc
    sys.stdout.write(describe_sft(Path(policy)))
    return 0


register(Command("eval", "score a policy on the validation tasks without training; prints a report",
                 _eval_arguments, run_eval))
register(Command("sft", "supervised warm-start on expert transcripts; prints the policy folder",
                 _sft_arguments, run_sft))
