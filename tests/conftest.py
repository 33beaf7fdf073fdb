"""Shared test set-up: every service a test touches lives in a temporary folder.

Prefect and MLflow would otherwise write under the home directory; here each test session
gets its own PREFECT_HOME and the MLflow store goes wherever a test points it.
"""

from __future__ import annotations

import os
import tempfile

_SESSION_HOME = tempfile.mkdtemp(prefix="rollflow-tests-")
os.environ.setdefault("PREFECT_HOME", os.path.join(_SESSION_HOME, "prefect"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{_SESSION_HOME}/mlflow.db")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
