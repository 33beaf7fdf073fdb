"""Checks before a run starts: the files it loads, its environment, its prompts' length.

``preflight(config)`` is what ``rollflow train`` / ``resume`` / ``pipeline`` and
``train_multi_turn`` call before Prefect starts and before a run folder is made, so a
mistake costs a second and one line (a ``ConfigError`` naming the setting) instead of a
dead run folder and a page of tracebacks from inside a stage. ``preflight_eval(config)``
is the same for ``rollflow eval`` and the evaluation flow, which play only validation
tasks and may use a served model (``backend = "openai"``) or a nucleus:

- **the rules across sections** a training run needs (``config.checks.check_run_config``:
  no nucleus, no ``openai`` backend, the async settings' rules), which ``open_run``
  applies again to every run it opens;
- **model files**: ``[model].path``, ``[model].gguf_file``, ``[model].adapter`` and the
  teacher's ``[train].teacher_path`` / ``teacher_adapter`` exist and are what the loader
  wants (a relative path is relative to the working directory, which the error names);
- **the environment**: ``[env].name`` imports and ``load_environment(**[env].kwargs)``
  takes those arguments and returns an environment with training tasks; an async-style one
  has a turn limit (``[rollout].max_turns``);
- **the prompt fits**: the first training task's (and, with validation on, the first
  validation task's) opening prompt, rendered with the policy's chat template and tools,
  leaves room for at least one token within ``[rollout].max_model_length``.

Simplified: only the first task of each split is measured (opening one episode per task
for every task could cost as much as a rollout); the check plays that episode with a
probe policy that records the prompt and ends it at once (``context_overflow``), so the
environment's ``start_episode`` / ``Env.reset`` really run, and its close. The
``openai`` backend's tokenizer is the server's, so its prompts are not measured here.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rollflow.config.checks import PreflightError, check_run_config
from rollflow.config.run import RunConfig
from rollflow.envs.handle import EnvironmentHandle
from rollflow.envs.runner import EnvironmentLoadError, load_environment_handle
from rollflow.envs.types import Split
from rollflow.tasks.prompts import prompt_tokens
from rollflow.tasks.schedule import episode_limits


def preflight(config: RunConfig) -> None:
    """Every check above, cheapest first; the first problem raises ``ConfigError`` (a
    ``PreflightError`` for the files, the environment and the prompts)."""
    check_run_config(config)
    check_model_files(config)
    handle = check_environment(config)
    check_prompts_fit(config, handle)


def preflight_eval(config: RunConfig) -> None:
    """The checks an evaluation needs: no training rules; a served model's files are the
    server's; the environment must have validation tasks, and the first one's prompt fit."""
    if config.rollout.backend != "openai":
        check_model_files(config)
    handle = check_environment(config, splits=("validation",))
    check_prompts_fit(config, handle, splits=("validation",))


# ---------------------------------------------------------------- model files


def _relative_note(value: str) -> str:
    return "" if Path(value).is_absolute() else f" (relative to the working directory {Path.cwd()})"


def _must_exist(key: str, value: str | None) -> Path | None:
    if value is None:
        return None
    path = Path(value)
    if not path.exists():
        raise PreflightError(f"{key} = {value!r} does not exist{_relative_note(value)}")
    return path


def check_model_files(config: RunConfig) -> None:
    model = config.model
    folder = _must_exist("[model].path", model.path)
    if model.gguf_file is not None:
        gguf = Path(model.gguf_file) if folder is None else folder / model.gguf_file
        if not gguf.is_file():
            relative_to = (
                f"a name inside [model].path = {model.path!r}" if folder is not None
                else f"relative to the working directory {Path.cwd()}"
            )
            raise PreflightError(
                f"[model].gguf_file = {model.gguf_file!r} does not exist (looked for {gguf.absolute()}: {relative_to})"
            )
    elif folder is not None and not (folder / "config.json").is_file():
        kind = "a file" if folder.is_file() else f"a folder without config.json ({folder.absolute()})"
        raise PreflightError(
            f"[model].path = {model.path!r} is {kind}, not a Hugging Face model folder; "
            "for a GGUF model set [model].gguf_file (the file, or its name inside [model].path)"
        )
    _check_adapter("[model].adapter", model.adapter)
    _must_exist("[train].teacher_path", config.train.teacher_path)
    _check_adapter("[train].teacher_adapter", config.train.teacher_adapter)


def _check_adapter(key: str, value: str | None) -> None:
    adapter = _must_exist(key, value)
    if adapter is not None and not (adapter / "adapter_config.json").is_file():
        raise PreflightError(f"{key} = {value!r} is not a peft adapter folder (no adapter_config.json in it)")


# ---------------------------------------------------------------- the environment


def _about_kwargs(error: EnvironmentLoadError) -> bool:
    """The loader refused its arguments: by its signature, or by a ``TypeError`` about an
    argument raised inside it (a constructor it passes ``**kwargs`` on to)."""
    cause = error.__cause__
    return str(error).startswith("bad arguments") or (isinstance(cause, TypeError) and "argument" in str(cause))


def check_environment(config: RunConfig, splits: Sequence[Split] | None = None) -> EnvironmentHandle:
    """The loaded environment, or one line naming ``[env].name`` / ``[env].kwargs``.

    ``splits`` are the ones to be played (by default training's: train, and validation when
    it is on); the first of them must have tasks.
    """
    env = config.env
    splits = _measured_splits(config) if splits is None else tuple(splits)
    try:
        handle = load_environment_handle(env.name, env.kwargs)
    except EnvironmentLoadError as exc:
        setting = f"[env].kwargs = {dict(env.kwargs)!r}" if _about_kwargs(exc) else "[env].name"
        raise PreflightError(f"{setting}: {exc}".splitlines()[0]) from exc
    if not handle.tasks(splits[0]):
        kind = "training" if splits[0] == "train" else splits[0]
        raise PreflightError(f"[env].name = {env.name!r}: the environment has no {kind} tasks")
    for split in splits:
        episode_limits(config, split, handle.style)  # an async env needs a turn limit
    return handle


def _measured_splits(config: RunConfig) -> tuple[Split, ...]:
    return ("train", "validation") if config.validation.validation_interval > 0 else ("train",)


# ---------------------------------------------------------------- the prompt fits


def check_prompts_fit(
    config: RunConfig, handle: EnvironmentHandle, splits: Sequence[Split] | None = None
) -> None:
    if config.rollout.backend == "openai":
        return
    budget = config.rollout.max_model_length
    for split in _measured_splits(config) if splits is None else splits:
        items = handle.tasks(split)
        if not items:
            continue
        length = prompt_tokens(config, handle, items[0])
        if length >= budget:
            raise PreflightError(
                f"[rollout].max_model_length = {budget} cannot hold the prompt of {split} task "
                f"{items[0].task_id!r}: it is {length} tokens, with no room left for a reply"
            )
