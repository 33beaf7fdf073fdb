"""What an evaluation runs on: a config, the ``rollflow eval`` flags applied, checked first.

``eval_config`` applies the command-line overrides (``EvalOverrides``) to a config before
the run folder freezes it, so ``config.toml`` says exactly what was evaluated.
``checked_eval_config`` is that config after ``ops.preflight.preflight_eval``: model
files, the environment and its validation tasks, the first prompt's length. The
evaluation flow calls it before it makes a run folder (a pipeline's or a deployment's
evaluation fails in one line, and leaves no empty folder); ``rollflow eval`` calls
``check_eval`` before Prefect even starts, and its errors name the flag the user typed
(``--model``, ``--adapter``, ``--env``) rather than the setting it replaced.

This module imports neither Prefect nor torch, so the command's checks cost only what
they check.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from rollflow.config.parsing import ConfigError
from rollflow.config.run import EnvConfig, ModelConfig, RunConfig, load_config


@dataclass(frozen=True)
class EvalOverrides:
    """What ``rollflow eval`` flags change in the config; None keeps the config's value."""

    env: str | None = None  # "module:function"
    model: str | None = None  # a Hugging Face folder or a .gguf file
    adapter: str | None = None  # a LoRA adapter folder on top of the model
    base_url: str | None = None  # an OpenAI-compatible server (with api_model)
    api_model: str | None = None
    num_tasks: int | None = None  # the first N validation tasks
    tools_in_system_prompt: bool = False  # a server's policy reads the tools in its system prompt


def eval_config(config: RunConfig, overrides: EvalOverrides) -> RunConfig:
    """``config`` with ``overrides`` applied, checked like a config file."""
    if (overrides.base_url is None) != (overrides.api_model is None):
        raise ConfigError("--base-url and --api-model go together: the server and the model it serves")
    if overrides.base_url is not None and (overrides.model or overrides.adapter):
        raise ConfigError("give either a local model (--model/--adapter) or a server (--base-url), not both")
    if overrides.env is not None:
        kwargs = config.env.kwargs if overrides.env == config.env.name else {}
        config = replace(config, env=EnvConfig(name=overrides.env, kwargs=kwargs))
    if overrides.model is not None:
        config = replace(config, model=_model_config(overrides.model, config.model))
    if overrides.adapter is not None:
        config = replace(config, model=replace(config.model, adapter=overrides.adapter))
    if overrides.base_url is not None:
        # The server replaces the run's own (base_urls, replicas): a run's config evaluates as is
        rollout = replace(config.rollout, backend="openai", base_url=overrides.base_url,
                          api_model=overrides.api_model, base_urls=(), num_generator_replicas=1)
        config = replace(config, rollout=rollout)
    if overrides.tools_in_system_prompt:
        if config.rollout.backend != "openai":
            raise ConfigError("--tools-in-system-prompt is for a server (--base-url and --api-model): a local "
                              "model always reads its tools in the system prompt")
        config = replace(config, rollout=replace(config.rollout, tools_in_system_prompt=True))
    if overrides.num_tasks is not None:
        config = replace(config, validation=replace(config.validation, num_tasks=overrides.num_tasks))
    return config


def _model_config(model: str, current: ModelConfig) -> ModelConfig:
    """``--model`` replaces what names the model (its path and GGUF file; the adapter was
    for the old one) and keeps how it runs (``dtype``, ``device``)."""
    path = Path(model)
    if path.suffix == ".gguf":
        return replace(current, path=str(path.parent), gguf_file=path.name, adapter=None)
    return replace(current, path=model, gguf_file=None, adapter=None)


def checked_eval_config(config_path: str | None, overrides: EvalOverrides) -> RunConfig:
    """The config an evaluation runs on (the defaults without ``config_path``), checked by
    ``preflight_eval``; the first problem raises a one-line ``ConfigError``."""
    from rollflow.ops.preflight import preflight_eval

    base = load_config(config_path) if config_path is not None else RunConfig()
    config = eval_config(base, overrides)
    preflight_eval(config)
    return config


# A preflight message starts with the setting it is about; a flag given on the command
# line replaced that setting, so the message names the flag instead.
_FLAG_SETTINGS = (
    ("model", "--model", ("[model].path", "[model].gguf_file")),
    ("adapter", "--adapter", ("[model].adapter",)),
    ("env", "--env", ("[env].name",)),
)


def check_eval(config_path: str | None, overrides: EvalOverrides) -> RunConfig:
    """``checked_eval_config`` for ``rollflow eval``: a path given as a flag that does not
    exist is named as that flag, and so is any setting a flag replaced."""
    for value, flag in ((overrides.model, "--model"), (overrides.adapter, "--adapter")):
        if value is not None and not Path(value).exists():
            where = "" if Path(value).is_absolute() else f" (relative to the working directory {Path.cwd()})"
            raise ConfigError(f"{flag} {value!r}: that path does not exist{where}")
    try:
        return checked_eval_config(config_path, overrides)
    except ConfigError as exc:
        named = _named_by_flag(str(exc), overrides)
        if named == str(exc):
            raise
        raise ConfigError(named) from exc


def _named_by_flag(text: str, overrides: EvalOverrides) -> str:
    for field, flag, settings in _FLAG_SETTINGS:
        if getattr(overrides, field) is None:
            continue
        for setting in settings:
            if text.startswith(setting + " = "):
                return f"{flag} {text[len(setting) + 3:]}"
            if text.startswith(setting + ":"):
                return flag + text[len(setting):]
    return text
