"""Shared test set-up: every service a test touches lives in a temporary folder.

Prefect and MLflow would otherwise write under the home directory; here each test session
gets its own PREFECT_HOME and the MLflow store goes wherever a test points it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_SESSION_HOME = tempfile.mkdtemp(prefix="rollflow-tests-")
os.environ["PREFECT_HOME"] = os.path.join(_SESSION_HOME, "prefect")  # never the user's or the Makefile's
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{_SESSION_HOME}/mlflow.db")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# ---------------------------------------------------------------- model fixtures
# Imports are deferred so that test files which never touch a model do not pay for
# importing transformers.


@pytest.fixture(scope="session")
def bundled_tokenizer() -> PreTrainedTokenizerBase:
    """The real SmolLM2 tokenizer and chat template (converted from the GGUF once, cached)."""
    from rollflow.policy.models import ModelRef, load_tokenizer

    return load_tokenizer(ModelRef())


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer, 64-wide random Llama with the real SmolLM2 tokenizer: an HF folder."""
    from rollflow.policy.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


# ---------------------------------------------------------------- Prefect


@pytest.fixture(autouse=True)
def _no_stop_request_leaks() -> Iterator[None]:
    """A test that asks the process to stop (policy.stopping) must not stop the next one."""
    from rollflow.policy.stopping import clear_stop

    yield
    clear_stop()


@pytest.fixture(scope="session")
def prefect_harness() -> object:
    """One temporary Prefect server and database for the whole session (~10 s to start)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture
def tiny_config_path(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """configs/tiny.toml on the session's tiny model (see tests/tiny_run.py)."""
    from tiny_run import tiny_config_at

    return tiny_config_at(tmp_path, tiny_model_dir)


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """A recording server and policy (tests/fake_vllm.py) in place of the real vLLM ones;
    yields the policy every managed generator gets."""
    from fake_vllm import FakePolicy, FakeServer

    from rollflow.generators import vllm_generator

    policy = FakePolicy()
    FakeServer.specs = []
    monkeypatch.setattr(vllm_generator, "VLLMServer", FakeServer)
    monkeypatch.setattr(vllm_generator, "managed_policy", lambda *args: policy)
    yield policy
