"""Loading a verifiers environment as verifiers does, every failure one line naming ``[env].kwargs``.

``load_verifiers_environment(env_id, env_args)`` is ``vf.load_environment(env_id,
**env_args)``: the installed module named ``env_id`` ("-" read as "_", a Hub id's last
part) must define ``load_environment``, and what it returns must be a classic
``MultiTurnEnv`` (or a subclass) whose rubric scores one rollout at a time. The refusals:
verifiers not installed, or a version without the classic API (0.4.0 on); a module that is
missing or has no ``load_environment``; an exception while importing or loading; another
kind of environment; group reward functions.

verifiers' ``Environment.__init__`` installs SIGINT and SIGTERM handlers (to tear down on
Ctrl-C), which would replace rollflow's own and cannot run off the main thread (where a
stage may load the environment): loading swaps that module's ``signal`` for one that
installs nothing, under a lock. Teardown still runs at exit (``atexit``). The adapter that
plays the environment is ``envs/verifiers.py``.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Iterator, Mapping
from types import ModuleType
from typing import Any

EXTRA = "pip install 'rollflow[verifiers]'"
_LOAD_LOCK = threading.Lock()


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300] or '(no message)'}"


def _import_verifiers(env_id: object) -> ModuleType:
    try:
        import verifiers as vf

        vf.Environment  # noqa: B018  (the classic API: absent from 0.4.0)
    except ImportError as exc:
        raise RuntimeError(
            f"[env].kwargs env_id = {env_id!r} needs the verifiers library, which is not installed ({exc}): {EXTRA}"
        ) from None
    except AttributeError:
        raise RuntimeError(
            f"[env].kwargs env_id = {env_id!r}: the installed verifiers {vf.__version__} has no classic "
            f"Environment API (SingleTurnEnv, MultiTurnEnv, ToolEnv); rollflow adapts 0.3.1: {EXTRA}"
        ) from None
    return vf


class _NoSignalHandlers:
    """The ``signal`` module, except that ``signal.signal`` installs nothing."""

    def __init__(self, real: ModuleType) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def signal(self, signalnum: int, handler: Any) -> Any:
        return self._real.getsignal(signalnum)


@contextlib.contextmanager
def _rollflow_keeps_its_signal_handlers() -> Iterator[None]:
    """While verifiers environments are built, their constructor installs no signal handler."""
    environment_module = importlib.import_module("verifiers.legacy.envs.environment")
    with _LOAD_LOCK:
        real = environment_module.signal
        environment_module.signal = _NoSignalHandlers(real)
        try:
            yield
        finally:
            environment_module.signal = real


def load_verifiers_environment(env_id: str, env_args: Mapping[str, Any]) -> Any:
    """``vf.load_environment(env_id, **env_args)``, its failures as one line."""
    vf = _import_verifiers(env_id)
    if not isinstance(env_id, str) or not env_id:
        raise ValueError(f"[env].kwargs env_id must be a verifiers environment's module name, got {env_id!r}")
    if not isinstance(env_args, Mapping):
        raise ValueError(f"[env].kwargs env_args must be a table of arguments, got {type(env_args).__name__}")
    module_name = env_id.replace("-", "_").split("/")[-1]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):
            raise ValueError(
                f"[env].kwargs env_id = {env_id!r}: no module {module_name!r} is installed (a verifiers "
                "environment is its own package: pip install it, or put its module on the path)"
            ) from None
        raise ValueError(f"[env].kwargs env_id = {env_id!r}: importing {module_name!r} failed: {one_line(exc)}") from None
    except Exception as exc:
        raise ValueError(f"[env].kwargs env_id = {env_id!r}: importing {module_name!r} failed: {one_line(exc)}") from None
    if not callable(getattr(module, "load_environment", None)):
        raise ValueError(
            f"[env].kwargs env_id = {env_id!r}: module {module_name!r} has no load_environment, "
            "so it is not a verifiers environment"
        )
    try:
        with _rollflow_keeps_its_signal_handlers():
            environment = vf.load_environment(env_id, **env_args)
    except Exception as exc:
        cause = exc.__cause__ if isinstance(exc, RuntimeError) and exc.__cause__ is not None else exc
        raise ValueError(
            f"[env].kwargs: verifiers environment {env_id!r} failed to load with env_args = "
            f"{dict(env_args)!r:.200}: {one_line(cause)}"
        ) from None
    if not isinstance(environment, vf.MultiTurnEnv):
        raise ValueError(
            f"[env].kwargs env_id = {env_id!r}: load_environment returned a {type(environment).__name__}; "
            "rollflow plays MultiTurnEnv and its subclasses (SingleTurnEnv, ToolEnv)"
        )
    if environment.rubric.has_group_rewards:
        raise ValueError(
            f"[env].kwargs env_id = {env_id!r}: its rubric has group reward functions, which score whole "
            "groups at once; rollflow scores each verifiers rollout on its own (Rubric.score_rollout)"
        )
    return environment
