"""``rollflow export`` and ``rollflow chat``: take a trained policy out of its run folder.

They register themselves in ``rollflow.flows.cli``'s table when this module is imported.
torch, transformers and peft are imported only when a command runs, so ``rollflow sql``
stays fast.

- ``rollflow export RUN_DIR --out DIR [--step N] [--merged]``: a peft adapter folder (or,
  with ``--merged``, a whole model folder) with the tokenizer and chat template; prints
  what it wrote, the line that starts a vLLM server on it and the model name to ask that
  server for (``rollflow.flows.export``).
- ``rollflow chat RUN_DIR [--step N] [--env SPEC [--kwargs JSON]]``: talk to the policy
  in the terminal, with the environment's tools run when the model calls them
  (``rollflow.flows.chat``). ``rollflow chat --base-url URL --api-model NAME --env SPEC``
  talks to a server instead, no run folder needed (a RUN_DIR given still names the
  environment and the sampling settings).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rollflow.flows.cli import Command, UserError, json_object_flag, register


def _user_errors() -> tuple[type[BaseException], ...]:
    from rollflow.envs.runner import EnvironmentLoadError
    from rollflow.flows.export import ExportError
    from rollflow.generators.checkpoints import CheckpointError
    from rollflow.policy.models import ModelLoadError
    from rollflow.config.parsing import ConfigError

    return (ExportError, CheckpointError, ConfigError, EnvironmentLoadError, ModelLoadError, FileNotFoundError)


def _step(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--step must be a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"--step must be >= 0, got {value}")
    return value


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--temperature must be a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"--temperature must be >= 0 (0 = greedy), got {value}")
    return value


# ---------------------------------------------------------------- export


def _export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="the run folder")
    parser.add_argument("--out", required=True, help="the folder to write (must not exist, or be empty)")
    parser.add_argument("--step", type=_step, help="the checkpoint of training step N (default: the newest)")
    parser.add_argument("--merged", action="store_true",
                        help="fold the LoRA adapter into the base weights: a whole model folder")


def run_export(args: argparse.Namespace) -> int:
    try:
        from rollflow.flows.export import export_policy
        from rollflow.flows.export_serving import SERVED_BASE, SERVING_FILE

        result = export_policy(args.run_dir, args.out, step=args.step, merged=args.merged)
    except _user_errors() as exc:
        raise UserError(str(exc)) from exc
    print(f"exported step {result.step} (policy version {result.policy_version}) "
          f"as {_format_text(result.format)} to {result.out}")
    if result.is_adapter:
        print(f"  base model: {result.base_model}")
    print(f"  serve: {result.serve}")
    base = f" (\"{SERVED_BASE}\" is the base model alone, untrained)" if result.is_adapter else ""
    print(f"  the trained policy is served as model \"{result.served_model}\"{base}")
    guide = Path(result.out) / SERVING_FILE
    if guide.is_file():
        print(f"  {guide} says how to serve it as it was trained")  # its tools, whatever their format
    if result.format == "weights" and not args.merged:
        print("  (a full-weight run: the checkpoint's weights were copied, as with --merged)", file=sys.stderr)
    return 0


def _format_text(kind: str) -> str:
    return {"adapter": "a LoRA adapter", "merged": "a merged model", "weights": "a full model"}[kind]


register(Command("export", "write a checkpoint as a LoRA adapter or merged model folder (for vLLM)",
                 _export_arguments, run_export))


# ---------------------------------------------------------------- chat


def _chat_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", nargs="?",
                        help="the run folder (its config names the model and environment); "
                             "optional with --base-url, where --env names the environment")
    parser.add_argument("--step", type=_step, help="the checkpoint of training step N (default: the newest)")
    parser.add_argument("--env", help="the environment as module:function (default: the run's [env]; 'none': no env)")
    parser.add_argument("--kwargs", metavar="JSON",
                        help="the environment's keyword arguments, a JSON object (default: the run's "
                             "[env].kwargs when --env is the run's environment, else none)")
    parser.add_argument("--base-url", help="an OpenAI-compatible server instead, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--api-model", help="the model name that server expects")
    parser.add_argument("--tools-in-system-prompt", action="store_true",
                        help="(server) describe the tools in the system prompt, for templates that ignore them")
    parser.add_argument("--temperature", type=_temperature, help="sampling temperature (default: the run's; 0 = greedy)")


def run_chat(args: argparse.Namespace) -> int:
    """Load the policy and the environment, then hand the terminal to the chat loop."""
    import asyncio

    try:
        from rollflow.flows.chat import chat_env_config, chat_environment, chat_loop, chat_policy

        policy = chat_policy(args.run_dir, args.step, base_url=args.base_url, api_model=args.api_model,
                             temperature=args.temperature, tools_in_system_prompt=args.tools_in_system_prompt)
        kwargs = None if args.kwargs is None else json_object_flag(args.kwargs)
        environment = chat_environment(*chat_env_config(args.run_dir, args.env, kwargs))
    except _user_errors() as exc:
        raise UserError(str(exc)) from exc
    print(f"chatting with {policy.description}")
    for line in environment.describe():
        print(line)
    print("commands: /reset starts over, /exit (or Ctrl-D) ends", flush=True)
    try:
        asyncio.run(chat_loop(policy.policy, environment, input, _write))
    except KeyboardInterrupt:
        print()
    return 0


def _write(text: str) -> None:
    print(text, flush=True)


register(Command("chat", "talk to a run's policy in the terminal, running its environment's tools",
                 _chat_arguments, run_chat))
