"""prefect.yaml on a real Prefect server: deploy the nightly training, trigger it, let a worker run it.

Everything is a real process on 127.0.0.1: ``prefect server start`` (SQLite under a
temporary PREFECT_HOME), ``prefect work-pool create``, ``prefect deploy``, ``prefect
deployment run`` and ``prefect worker start --run-once``, which runs the flow in a
subprocess from the checkout (the pull step). MLflow goes to a temporary SQLite file.
Every wait is bounded; the server and the worker are killed (whole process groups)
whatever happens.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import yaml
from prefect_server import (
    POOL,
    PREFECT,
    REPO,
    PrefectServer,
    background,
    prefect,
    running_prefect_server,
    tail,
    wait_for_final_state,
)

from rollflow.config.run import config_to_toml, load_config
from rollflow.storage.runfolder import RunFolder

pytestmark = pytest.mark.slow

DEPLOYMENT = "rollflow-train/nightly-train"


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    with running_prefect_server(tmp_path_factory.mktemp("prefect-server")) as server:
        yield server


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
        state = wait_for_final_state(prefect_server, match.group(1), 600, log)
    assert state == "COMPLETED", tail(log)
    assert httpx.get(flow_run, timeout=10).json()["parameters"] == {"config_path": str(config_path)}

    [run_dir] = list((tmp_path / "runs").iterdir())
    folder = RunFolder(run_dir)
    assert load_config(folder.config_path) == config
    assert folder.completed_steps() == [0]
    assert (folder.step_dir(0) / "metrics.json").is_file() and folder.is_complete(0, "samples")
    assert folder.checkpoints() and folder.is_complete(1, "scores", "validation")
    assert (prefect_server.home / "mlflow.db").is_file()  # MLflow went to the test's store
