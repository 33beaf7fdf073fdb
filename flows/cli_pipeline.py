"""``rollflow pipeline`` and ``rollflow registry``: the nightly chain and its champion.

``rollflow pipeline CONFIG [--run-dir DIR]`` runs ``flows/pipeline.py``'s flow from the
shell (the deployment runs the same flow); ``rollflow registry NAME`` lists the registered
versions with their gate numbers, and ``--promote N`` moves the ``champion`` alias by hand
(a rollback is a promote of an older version).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os

from rollflow.flows.cli import Command, UserError, register


def _pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="a TOML config with a [pipeline] section, e.g. configs/pipeline.toml")
    parser.add_argument("--run-dir", help="the pipeline folder (default: runs/pipeline-<flow run>); an existing one resumes")


def run_pipeline(args: argparse.Namespace) -> int:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    if args.config is None and args.run_dir is None:
        raise UserError("give a config to start a pipeline, or --run-dir to continue one")
    from rollflow.envs.runner import EnvironmentLoadError
    from rollflow.flows.pipeline import pipeline_flow
    from rollflow.flows.runs import RunSetupError
    from rollflow.storage.errors import ConfigMismatchError
    from rollflow.config.parsing import ConfigError
    from rollflow.config.run import load_config
    from rollflow.ops.preflight import preflight

    try:
        if args.config is not None:  # before Prefect starts and before a folder is made
            preflight(load_config(args.config))
        from rollflow.flows.prefect_server import serve_prefect_in_own_session

        serve_prefect_in_own_session()  # out of reach of a terminal's Ctrl-C
        result = pipeline_flow(config_path=args.config, run_dir=args.run_dir)
    except (ConfigError, RunSetupError, EnvironmentLoadError, ConfigMismatchError) as exc:
        raise UserError(str(exc)) from exc
    print(json.dumps(result, indent=2))
    return 0


def _registry_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="the registered model ([pipeline].model_name)")
    parser.add_argument("--promote", type=int, metavar="VERSION", help="make VERSION the champion (also a rollback)")
    parser.add_argument("--tracking-uri", help="the MLflow store (default: the project's .rollflow/mlflow.db)")


def run_registry(args: argparse.Namespace) -> int:
    from rollflow.storage.registry import PolicyRegistry, RegistryError

    registry = PolicyRegistry(args.name, args.tracking_uri)
    if args.promote is not None:
        try:
            registry.promote(args.promote)
        except RegistryError as exc:
            raise UserError(str(exc)) from exc
    champion = registry.champion()
    versions = registry.versions()
    if not versions:
        names = registry.model_names()
        close = difflib.get_close_matches(args.name, names, n=3)
        known = (f"; did you mean {' or '.join(map(repr, close))}?" if close
                 else f"; it holds {', '.join(map(repr, names))}" if names else "; it holds no registered model")
        raise UserError(f"no registered versions of {args.name!r} in {registry.tracking_uri}{known}")
    for version in versions:
        mark = "champion" if champion is not None and champion.version == version.version else ""
        tags = version.tags
        print(f"{version.version:>4}  {mark:<8}  gate {tags.get('gate.baseline', '?')} -> {tags.get('gate.candidate', '?')} "
              f"(change {tags.get('gate.change', '?')} +- {tags.get('gate.se', '?')}, p {tags.get('gate.p_value', '?')}, "
              f"promote={tags.get('gate.promote', '?')})  {version.source}")
    return 0


register(Command("pipeline", "the nightly chain: SFT -> GRPO -> gate -> model registry (a Prefect flow)",
                 _pipeline_arguments, run_pipeline))
register(Command("registry", "list a registered policy's versions; --promote N moves the champion",
                 _registry_arguments, run_registry))
