"""prefect.yaml on a real Prefect server: deploy the nightly training, trigger it, let a worker run it.

Everything is a real process on 127.0.0.1: ``prefect server start`` (SQLite under a
temporary PREFECT_HOME), ``prefect work-pool create``, ``prefect deploy``, ``prefect
deployment run`` and ``prefect worker start --run-once``, which runs the flow in a
subprocess from the checkout (the pull step). MLflow goes to a temporary SQLite file.
Every wait is bounded; the server and the worker are killed (whole process groups)
whatever happens.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

import httpx
import pytest
import yaml

from rollflow.storage.runfolder import RunFolder
from rollflow.tasks.config import config_to_toml, load_config

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
PREFECT = str(Path(sys.executable).parent / "prefect")
POOL = "rollflow-process"
DEPLOYMENT = "rollflow-train/nightly-train"
FINAL_STATES = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
T = TypeVar("T")


@dataclass(frozen=True)
class PrefectServer:
    api_url: str
    env: dict[str, str]  # what every prefect command of the test runs with
    home: Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def stop_group(process: subprocess.Popen[bytes], grace_s: float = 15.0) -> None:
    """SIGTERM the process group, SIGKILL it after ``grace_s``; children never outlive it."""
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)


@contextmanager
def background(command: Sequence[str], env: dict[str, str], log: Path, cwd: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as sink:
        process = subprocess.Popen(
            list(command), env=env, cwd=cwd, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield process
    finally:
        stop_group(process)


def tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


def wait_for(probe: Callable[[], T | None], timeout_s: float, what: str, log: Path | None = None) -> T:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = probe()
        if value is not None:
            return value
        time.sleep(1.0)
    pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}\n{tail(log) if log else ''}")


def prefect(server: PrefectServer, *args: str, timeout_s: float = 300) -> str:
    done = subprocess.run(
        [PREFECT, *args], env=server.env, cwd=REPO, capture_output=True, text=True, timeout=timeout_s
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"prefect {' '.join(args)} failed ({done.returncode}):\n{output[-4000:]}"
    return output


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    home = tmp_path_factory.mktemp("prefect-server")
    api_url = f"http://127.0.0.1:{free_port()}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(home / "home"),
        "PREFECT_API_URL": api_url,
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home / 'prefect.db'}",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_UI_ENABLED": "false",
        # no nightly runs created behind the test's back: only the one it triggers
        "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "false",
        "PREFECT_CLI_PROMPT": "false",
        "PREFECT_LOGGING_LEVEL": "INFO",
        "MLFLOW_TRACKING_URI": f"sqlite:///{home / 'mlflow.db'}",
    }
    port = api_url.rsplit(":", 1)[1].split("/")[0]
    command = [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", port]
    log = home / "server.log"
    with background(command, env, log, cwd=home) as process:

        def healthy() -> bool | None:
            if process.poll() is not None:
                pytest.fail(f"prefect server exited with {process.returncode}:\n{tail(log)}")
            with suppress(httpx.HTTPError):
                return httpx.get(f"{api_url}/health", timeout=5).json() is True or None
            return None

        wait_for(healthy, 240, "the Prefect server's /health", log)
        yield PrefectServer(api_url=api_url, env=env, home=home)


def test_prefect_yaml_shares_one_pool_and_differs_only_in_parameters_and_schedules() -> None:
    document = yaml.safe_load((REPO / "prefect.yaml").read_text())
    deployments = {d["name"]: d for d in document["deployments"]}
    train, evaluate = deployments["nightly-train"], deployments["evaluate"]
    assert train["work_pool"] == evaluate["work_pool"] == document["definitions"]["work_pools"]["process_pool"]
    assert train["work_pool"]["name"] == POOL
    assert train["entrypoint"] == "flows/train.py:train_flow" and evaluate["entrypoint"] == "flows/eval.py:eval_flow"
    assert train["schedules"] == [document["definitions"]["schedules"]["nightly"]]
    for deployment in (train, evaluate):
        config = REPO / deployment["parameters"]["config_path"]
        assert load_config(config) is not None  # the named configs exist and are valid
    differing = {k for k in train if train[k] != evaluate.get(k)}
    assert differing <= {"name", "description", "entrypoint", "tags", "parameters", "schedules"}


def test_nightly_training_deployment_runs_on_a_real_server(
    prefect_server: PrefectServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = load_config(REPO / "configs" / "tiny.toml")
    config = replace(
        config,
        model=replace(config.model, path=str(tiny_model_dir)),
        train=replace(config.train, num_steps=1),
        storage=replace(config.storage, runs_dir=str(tmp_path / "runs")),
    )
    config_path = tmp_path / "tiny-nightly.toml"
    config_path.write_text(config_to_toml(config))

    prefect(prefect_server, "work-pool", "create", POOL, "--type", "process")
    prefect(prefect_server, "deploy", "--no-prompt", "--all")
    evaluate = httpx.get(f"{prefect_server.api_url}/deployments/name/rollflow-eval/evaluate", timeout=30).json()
    assert evaluate["entrypoint"] == "flows/eval.py:eval_flow" and evaluate["schedules"] == []
    deployment = httpx.get(f"{prefect_server.api_url}/deployments/name/{DEPLOYMENT}", timeout=30).json()
    assert deployment["entrypoint"] == "flows/train.py:train_flow"
    assert deployment["parameters"] == {"config_path": "configs/default.toml"}
    assert [s["schedule"]["cron"] for s in deployment["schedules"]] == ["0 2 * * *"]
    [pull] = deployment["pull_steps"]
    assert pull["prefect.deployments.steps.set_working_directory"]["directory"] == str(REPO)

    output = prefect(prefect_server, "deployment", "run", DEPLOYMENT, "--param", f"config_path={config_path}")
    match = re.search(r"UUID:\s*([0-9a-f-]{36})", output)
    assert match, f"no flow run id in:\n{output}"
    flow_run = f"{prefect_server.api_url}/flow_runs/{match.group(1)}"

    log = tmp_path / "worker.log"
    worker = [PREFECT, "worker", "start", "--pool", POOL, "--run-once"]
    with background(worker, prefect_server.env, log, cwd=tmp_path):

        def final_state() -> str | None:
            with suppress(httpx.HTTPError):
                state = httpx.get(flow_run, timeout=10).json()["state"]["type"]
                return state if state in FINAL_STATES else None
            return None

        state = wait_for(final_state, 600, "the flow run to finish", log)
    assert state == "COMPLETED", tail(log)
    assert httpx.get(flow_run, timeout=10).json()["parameters"] == {"config_path": str(config_path)}

    [run_dir] = list((tmp_path / "runs").iterdir())
    folder = RunFolder(run_dir)
    assert load_config(folder.config_path) == config
    assert folder.completed_steps() == [0]
    assert (folder.step_dir(0) / "metrics.json").is_file() and folder.is_complete(0, "samples")
    assert folder.checkpoints() and folder.is_complete(1, "scores", "validation")
    assert (prefect_server.home / "mlflow.db").is_file()  # MLflow went to the test's store
