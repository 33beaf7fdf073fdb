"""Prefect's state (its SQLite database, profiles, result storage) for the ``rollflow`` command.

Left alone, Prefect keeps it in ``~/.prefect``: one database shared by every run on the
machine, and a temporary API server that fails at length when ``$HOME`` is missing. The
command instead points ``PREFECT_HOME`` at ``<project>/.rollflow/prefect``, beside the
MLflow store (``<project>`` is the nearest folder above the working directory with a
``pyproject.toml`` or ``.git``, else the working directory: ``storage.tracking.project_root``),
as the Makefile does for the checkout.

Prefect reads its settings when it is first imported, so ``main`` calls this before any
subcommand runs. A user's own ``PREFECT_HOME``, or a Prefect server in ``PREFECT_API_URL``
(deployments, workers), is left as it is; so is a server named by the user's active Prefect
profile (``prefect config set PREFECT_API_URL=...`` writes it to ``~/.prefect/profiles.toml``):
the run then goes to that server and shows in its UI, as a ``prefect`` command would.

Without ``PREFECT_API_URL`` the run is served by Prefect's temporary server, a child of
the command that inherits its environment. Its background services write the same SQLite
file as its API, and a write that finds the file locked logs a long traceback (Prefect
issues #15170, #18934, #19771). The ones rollflow's flows never use are turned off there
(``TEMPORARY_SERVER_DEFAULTS``), each only where the user set neither of its variables:

- ``triggers`` (automations: reactive and proactive triggers and their actions). No
  rollflow flow makes an automation; the proactive sweep writes the database every 5 s.

Left on: the task-run recorder (task runs reach the database through it) and the event
persister (the events a later ``prefect server start`` on this home shows).

The temporary server also gets ``STARTUP_TIMEOUT_S`` (120 s, as the Makefile gives it) to
answer, not Prefect's 20 s: on a loaded 2-core machine the first start in a project, which
creates the database, took longer and failed the run. A user's own setting (environment or
profile) is kept, and a start that still times out is one line naming the setting
(``prefect_start_failure``), not Prefect's ``RuntimeError`` traceback.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

from rollflow.storage.tracking import project_root  # imports MLflow, not Prefect

# setting -> (its default here, the older spelling Prefect also reads)
TEMPORARY_SERVER_DEFAULTS = {
    "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": ("false", "PREFECT_API_SERVICES_TRIGGERS_ENABLED"),
}
STARTUP_TIMEOUT_SETTING = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
STARTUP_TIMEOUT_S = 120
PREFECT_DEFAULT_STARTUP_TIMEOUT_S = 20
# How Prefect 3.9's SubprocessASGIServer.start says the server did not answer in time.
_START_TIMED_OUT = "Timed out while attempting to connect to ephemeral Prefect API server"


def use_project_prefect_home(
    environ: MutableMapping[str, str] | None = None, start: Path | None = None
) -> Path | None:
    """Set and create ``PREFECT_HOME`` unless the user configured Prefect; return the folder set.

    ``environ`` defaults to ``os.environ``, ``start`` to the working directory.
    """
    environ = os.environ if environ is None else environ
    # No network here: Prefect's telemetry would log an error on every run.
    environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    served = bool(environ.get("PREFECT_API_URL")) or profile_api_url(environ) is not None
    if not served:  # the run gets Prefect's temporary server
        for key, (value, older) in TEMPORARY_SERVER_DEFAULTS.items():
            if key not in environ and older not in environ:
                environ[key] = value
        if STARTUP_TIMEOUT_SETTING not in environ and profile_setting(environ, STARTUP_TIMEOUT_SETTING) is None:
            environ[STARTUP_TIMEOUT_SETTING] = str(STARTUP_TIMEOUT_S)
    if environ.get("PREFECT_HOME") or served:
        return None
    home = project_root(start) / ".rollflow" / "prefect"
    home.mkdir(parents=True, exist_ok=True)
    environ["PREFECT_HOME"] = str(home)
    return home


def profile_api_url(environ: MutableMapping[str, str]) -> str | None:
    """The API URL of the user's active Prefect profile in ``~/.prefect/profiles.toml``
    (or ``$PREFECT_PROFILES_PATH``; ``$PREFECT_PROFILE`` picks the profile), if it sets one."""
    url = profile_setting(environ, "PREFECT_API_URL")
    return url if isinstance(url, str) and url else None


def profile_setting(environ: MutableMapping[str, str], key: str) -> object | None:
    """``key`` as the user's active Prefect profile sets it, or None.
    An unreadable file sets nothing: Prefect itself will say what is wrong with it."""
    import tomllib

    home = Path(environ.get("HOME") or Path.home())
    path = Path(environ.get("PREFECT_PROFILES_PATH") or home / ".prefect" / "profiles.toml")
    try:
        profiles = tomllib.loads(path.read_text())
    except (OSError, ValueError):
        return None
    active = environ.get("PREFECT_PROFILE") or profiles.get("active")
    settings = profiles.get("profiles", {}).get(active, {}) if isinstance(active, str) else {}
    return settings.get(key) if isinstance(settings, dict) else None


def prefect_start_failure(error: BaseException) -> str | None:
    """One line for a run whose Prefect temporary server did not answer in time (``error``
    or an exception it was raised from), naming the setting that gives it more; else None."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, RuntimeError) and _START_TIMED_OUT in str(cause):
            seconds = (os.environ.get(STARTUP_TIMEOUT_SETTING) or profile_setting(os.environ, STARTUP_TIMEOUT_SETTING)
                       or PREFECT_DEFAULT_STARTUP_TIMEOUT_S)
            return (
                f"Prefect's temporary API server did not start within {seconds} s; on a busy machine "
                f"raise {STARTUP_TIMEOUT_SETTING}, or set PREFECT_API_URL to a running Prefect server"
            )
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None
