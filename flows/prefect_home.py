"""Prefect's state (its SQLite database, profiles, result storage) for the ``rollflow`` command.

Left alone, Prefect keeps it in ``~/.prefect``: one database shared by every run on the
machine, and a temporary API server that fails at length when ``$HOME`` is missing. The
command instead points ``PREFECT_HOME`` at ``<project>/.rollflow/prefect``, beside the
MLflow store (``<project>`` is the nearest folder above the working directory with a
``pyproject.toml`` or ``.git``, else the working directory: ``storage.tracking.project_root``),
as the Makefile does for the checkout.

Prefect reads its settings when it is first imported, so ``main`` calls this before any
subcommand runs. A user's own ``PREFECT_HOME``, or a Prefect server in ``PREFECT_API_URL``
(deployments, workers), is left as it is.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

from rollflow.storage.tracking import project_root  # imports MLflow, not Prefect


def use_project_prefect_home(
    environ: MutableMapping[str, str] | None = None, start: Path | None = None
) -> Path | None:
    """Set and create ``PREFECT_HOME`` unless the user configured Prefect; return the folder set.

    ``environ`` defaults to ``os.environ``, ``start`` to the working directory.
    """
    environ = os.environ if environ is None else environ
    # No network here: Prefect's telemetry would log an error on every run.
    environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    if environ.get("PREFECT_HOME") or environ.get("PREFECT_API_URL"):
        return None
    home = project_root(start) / ".rollflow" / "prefect"
    home.mkdir(parents=True, exist_ok=True)
    environ["PREFECT_HOME"] = str(home)
    return home
