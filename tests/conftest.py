"""Shared test set-up: every service a test touches lives in a temporary folder.

Prefect and MLflow would otherwise write under the home directory; here each test session
gets its own PREFECT_HOME and the MLflow store goes wherever a test points it.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_SESSION_HOME = tempfile.mkdtemp(prefix="rollflow-tests-")
# Removed when this process exits, passed, failed or interrupted (each xdist worker has its
# own). Registered before any server's atexit stop, so it runs after them: atexit is LIFO.
atexit.register(shutil.rmtree, _SESSION_HOME, ignore_errors=True)
# Set, not defaulted: xdist workers start with the controller's environment, and a defaulted
# store was the controller's, shared by every worker (two migrating it at once failed a run
# with "duplicate column name: step"; tests/test_session_isolation.py).
os.environ["PREFECT_HOME"] = os.path.join(_SESSION_HOME, "prefect")  # never the user's or the Makefile's
os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{_SESSION_HOME}/mlflow.db"
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# With several xdist workers on the machine's cores (``make test``: three on two), each worker
# and everything it starts computes on one OpenMP thread: torch in the worker, the runs it
# starts (they inherit OMP_NUM_THREADS, so a run resumed in a subprocess sums in the same
# order as the uninterrupted run it is compared with in the worker, bit for bit), and their
# vLLM servers (rollflow.policy.vllm_cpu.worker_openmp_environment keeps a set
# OMP_NUM_THREADS). Two threads a process oversubscribe the cores, and OpenMP's spinning
# threads then burn CPU waiting for each other: test_shared_prefix.py spent 93 CPU-s in its
# worker in the suite run of 2026-12-05 18:41, and 13 with one thread beside another worker in
# a probe of 19:14 (docs/testing.md). `make test TEST_WORKERS=1` keeps torch's own default.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ["OMP_NUM_THREADS"] = "1"  # torch reads it when first imported, which is after this


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


@pytest.fixture(autouse=True)
def _no_run_left_stopped() -> Iterator[None]:
    """A real run a test started through tests/kill_matrix.py (the kill matrix, Ctrl-C) is
    SIGKILLed with its whole tree when the test ends, also when it failed or pytest was
    interrupted (Ctrl-C tears the fixtures down too): a run stopped at a fault point would
    otherwise stay stopped, its servers up, for good. Free for the tests that start none."""
    yield
    kill_matrix = sys.modules.get("kill_matrix")
    if kill_matrix is not None:
        kill_matrix.end_runs()


_SESSION_SERVER: list[object] = []  # the controller's server process, when it started one


def pytest_configure(config: pytest.Config) -> None:
    """The xdist controller starts the suite's one Prefect server for all its workers (not
    waiting for it: it starts while they collect). A pytest run inside a test of the suite
    inherits the URL and starts none; a run without workers uses Prefect's own harness."""
    from prefect_server import SESSION_URL_ENV, start_session_server

    workers = config.getoption("numprocesses", default=None)
    if hasattr(config, "workerinput") or os.environ.get(SESSION_URL_ENV) or not isinstance(workers, int) or workers < 2:
        return
    _SESSION_SERVER.append(start_session_server(Path(_SESSION_HOME) / "session-prefect"))


def pytest_unconfigure(config: pytest.Config) -> None:
    from prefect_server import SESSION_URL_ENV, stop_group

    while _SESSION_SERVER:
        stop_group(_SESSION_SERVER.pop())  # type: ignore[arg-type]
        os.environ.pop(SESSION_URL_ENV, None)


@pytest.fixture(scope="session")
def prefect_harness() -> Iterator[None]:
    """One Prefect server and database for the whole session: the controller's, shared by
    every worker (``pytest_configure``), else Prefect's test harness (~7 CPU-s to start)."""
    from prefect_server import SESSION_URL_ENV

    url = os.environ.get(SESSION_URL_ENV)
    if not url:
        from prefect.testing.utilities import prefect_test_harness

        with prefect_test_harness(server_startup_timeout=120):
            yield
        return
    from prefect.context import _temporary_global_settings_context, get_settings_context
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from prefect_server import wait_for_session_server

    wait_for_session_server(url)
    with temporary_settings(updates={PREFECT_API_URL: url}):
        # as Prefect's harness does, also for contexts copied before (its issue 15818)
        with _temporary_global_settings_context(get_settings_context()):
            _many_training_slots()  # before this worker's first flow, whatever the other workers did
            yield
            _drain_prefect_workers()


def _drain_prefect_workers() -> None:
    """Send this worker's queued logs and events before it exits (Prefect's harness does)."""
    import inspect

    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.utilities.asyncutils import run_coro_as_sync

    async def drain() -> None:
        try:
            result = APILogWorker.instance().drain()
            if inspect.isawaitable(result):
                await result
        except RuntimeError:
            pass  # never started
        result = EventsWorker.drain_all()
        if inspect.isawaitable(result):
            await result

    run_coro_as_sync(drain())


SHARED_SERVER_SLOTS = 100


@pytest.fixture(scope="session")
def shared_prefect_url(prefect_harness: object) -> str:
    """The session's Prefect server, for `rollflow` subprocesses that would otherwise each
    start a temporary one (~3 CPU-s a start, docs/testing.md: the suite is CPU-bound). Its training limit gets
    many slots: a run a test SIGKILLs keeps its slot's lease for ``LEASE_S`` (60 s), which would
    hold the next run. The tests of the slot itself (test_pipeline_server.py) and of the
    temporary server's end (each kill matrix's first run, test_flow_train.py's SIGTERM,
    test_ctrl_c.py, test_prefect_home.py) keep theirs."""
    from prefect.settings import PREFECT_API_URL

    _many_training_slots()
    url = PREFECT_API_URL.value()
    assert url, "the Prefect harness set no API URL"
    return str(url)


def _many_training_slots() -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitUpdate

    from rollflow.flows.concurrency import TRAINING_LIMIT, ensure_training_limit

    ensure_training_limit(SHARED_SERVER_SLOTS)
    with get_client(sync_client=True) as client:  # one made with 1 slot by an earlier flow
        client.update_global_concurrency_limit(TRAINING_LIMIT, GlobalConcurrencyLimitUpdate(limit=SHARED_SERVER_SLOTS))


@pytest.fixture
def tiny_config_path(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """configs/tiny.toml on the session's tiny model (see tests/tiny_run.py)."""
    from tiny_run import tiny_config_at

    return tiny_config_at(tmp_path, tiny_model_dir)


@pytest.fixture
def own_tmpdir(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """This test's own TMPDIR (for it and what it starts), so that what is left in it is
    seen. Short, under the system's temp directory: a vLLM server's sockets go there and an
    AF_UNIX path has at most 107 bytes (pytest's tmp_path is too deep)."""
    tmp_path_factory.getbasetemp()  # pytest's own base folder first: it is made in TMPDIR once
    folder = Path(tempfile.mkdtemp(prefix="rollflow-t-"))
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


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


# ---------------------------------------------------------------- order

# The modules that take longest (docs/testing.md, "Time by module", the two-worker run of
# 2026-12-05), longest first. `make test` runs the suite on three workers (`pytest -n 3 --dist
# loadfile --no-loadscope-reorder`): a module runs whole on one worker, so that its
# module-scoped servers start once, and the workers take modules in collection order (xdist
# would otherwise order them by their number of tests, which put the two kill-matrix
# modules, one long test each, last, the other workers idle for part of them). Longest first lets the
# hundred short modules fill in around them at the end (longest-processing-time-first
# scheduling). A plain `pytest` run is unaffected except for the order of the modules.
HEAVIEST_MODULES = (
    "test_ray_rollout.py",
    "test_kill_matrix_async.py",
    "test_pipeline_server.py",
    "test_kill_matrix_lockstep.py",
    "test_flow_train.py",
    "test_async_training.py",
    "test_vllm_restart.py",
    "test_shared_prefix.py",
    "test_vllm_bundled.py",
    "test_update_bench.py",
    "test_vllm_backend.py",
    "test_vllm_replicas.py",
    "test_vllm_merged.py",
    "test_loud_failures.py",
    "test_vllm_server.py",
    "test_opd.py",
    "test_export.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: index for index, name in enumerate(HEAVIEST_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


# ---------------------------------------------------------------- CPU by test (opt-in)
# The suite is CPU-bound on two cores (docs/testing.md), so its wall time follows the CPU
# its tests spend, not their durations. With ROLLFLOW_TEST_CPU_LOG=PREFIX each worker appends
# a line per test to PREFIX.<worker>.jsonl: the CPU seconds of the worker itself (the test's
# in-process work, exact) and of the child processes reaped during the test (approximate: a
# child is charged to the test that reaps it, which for a child nobody waited for is the
# test that next starts a subprocess, and a child adopted by init is not counted at all).
# `scripts/test_cpu_report.py PREFIX` sums them by module.
_CPU_LOG = os.environ.get("ROLLFLOW_TEST_CPU_LOG")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if not _CPU_LOG:
        yield
        return
    import json
    import resource
    import time

    def children() -> float:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    own, reaped, wall, start = time.process_time(), children(), time.monotonic(), time.time()
    yield
    line = {
        "test": item.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
        "own_cpu_s": round(time.process_time() - own, 2), "children_cpu_s": round(children() - reaped, 2),
        "wall_s": round(time.monotonic() - wall, 2), "start": round(start, 2),
    }  # fmt: skip
    with open(f"{_CPU_LOG}.{line['worker']}.jsonl", "a", encoding="utf-8") as log:
        log.write(json.dumps(line) + "\n")
