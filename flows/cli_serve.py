"""``rollflow export`` and ``rollflow chat``: take a trained policy out of its run folder.

They register themselves in ``rollflow.flows.cli``'s table when this module is imported.
torch, transformers and peft are imported only when a command runs, so ``rollflow sql``
stays fast.

- ``rollflow export RUN_DIR --out DIR [--step N] [--merged]``: a peft adapter folder (or,
  with ``--merged``, a whole model folder) with the tokenizer and chat template; prints
  what it wrote and the ``vllm serve`` line that serves it (``rollflow.flows.export``).
- ``rollflow chat RUN_DIR [--step N] [--env SPEC] [--base-url URL --api-model NAME]``:
  talk to the policy in the terminal, with the environment's tools run when the model
  calls them (``rollflow.flows.chat``).
"""

from __future__ import annotations

import argparse
import sys

from rollflow.flows.cli import Command, UserError, register


def _user_errors() -> tuple[type[BaseException], ...]:
    from rollflow.envs.runner import EnvironmentLoadError
    from rollflow.flows.export import ExportError
    from rollflow.policy.models import ModelLoadError
    from rollflow.tasks.checkpoints import CheckpointError
    from rollflow.tasks.config import ConfigError

    return (ExportError, CheckpointError, ConfigError, EnvironmentLoadError, ModelLoadError, FileNotFoundError)


def _step(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--step must be a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"--step must be >= 0, got {value}")
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

        result = export_policy(args.run_dir, args.out, step=args.step, merged=args.merged)
    except _user_errors() as exc:
        raise UserError(str(exc)) from exc
    print(f"exported step {result.step} (policy version {result.policy_version}) "
          f"as {_format_text(result.format)} to {result.out}")
    if result.is_adapter:
        print(f"  base model: {result.base_model}")
        print(f"  serve: vllm serve {result.base_model} --enable-lora "
              f"--lora-modules policy={result.out} --max-lora-rank {max(16, result.lora_rank or 0)}")
    else:
        print(f"  serve: vllm serve {result.out}")
    if result.format == "weights" and not args.merged:
        print("  (a full-weight run: the checkpoint's weights were copied, as with --merged)", file=sys.stderr)
    return 0


def _format_text(kind: str) -> str:
    return {"adapter": "a LoRA adapter", "merged": "a merged model", "weights": "a full model"}[kind]


register(Command("export", "write a checkpoint as a LoRA adapter or merged model folder (for vLLM)",
                 _export_arguments, run_export))
