"""Everything against a real ``prefect server start``: prefect.yaml's deployments run by a
worker, and the nightly pipeline, whose retry is resume and which trains one at a time.

One server serves the whole module (a start is ~10 s on 2 cores; this module used to share
it with nobody, and tests/test_deployment.py started a second one). What stays each test's
own: its flow runs (each test follows the ids it triggered), run folders and MLflow stores
(under its tmp_path), and the work pool's queue: the ``server`` fixture checks before and after
every test that no flow run is left waiting or running on the server, which a later test's
``prefect worker start --run-once`` could otherwise pick up (cancelled, and the test fails).

- prefect.yaml: ``prefect work-pool create``, ``prefect deploy --all``, ``prefect
  deployment run`` and ``prefect worker start --run-once``, which runs the flow in a
  subprocess from the checkout (the pull step); MLflow goes to the test's SQLite file.
- The pipeline: a worker runs the deployed pipeline in a subprocess; the test SIGKILLs that
  flow-run process mid-GRPO (the worker then reports the run CRASHED), retries the flow run
  with ``prefect flow-run retry`` and checks that the retried run continued the same folder:
  no step redone, no episode or metric point twice, one registered version. Then two
  pipelines started together against the same server must take turns on the training slot.

Every wait is bounded; the server and the workers are killed (whole process groups)
whatever happens.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import duckdb
import httpx
import psutil
import pytest
import yaml
from prefect_server import (
    FINAL_STATES,
    POOL,
    PREFECT,
    REPO,
    PrefectServer,
    background,
    prefect,
    running_prefect_server,
    tail,
    wait_for,
    wait_for_final_state,
)

from rollflow.config.pipeline import PipelineConfig
from rollflow.config.run import config_to_toml, load_config
from rollflow.storage.registry import PolicyRegistry
from rollflow.storage.runfolder import RunFolder

pytestmark = pytest.mark.slow

DEPLOYMENT = "rollflow-pipeline/nightly-pipeline"
TRAIN_DEPLOYMENT = "rollflow-train/nightly-train"


# The retried pipeline waits for the slot its killed attempt held until the lease expires
# (LEASE_S, 60 s: the least a Prefect server accepts) and the server's repossessor frees it,
# which it looks for every 15 s by default: every second here.
@pytest.fixture(scope="module")
def module_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    with running_prefect_server(tmp_path_factory.mktemp("prefect-server"),
                                {"PREFECT_SERVER_SERVICES_REPOSSESSOR_LOOP_SECONDS": "1"}) as running:
        yield running


def unfinished_flow_runs(server: PrefectServer) -> list[tuple[str, str]]:
    """(id, state) of every flow run on the server not in a final state."""
    body = {"flow_runs": {"state": {"type": {"not_any_": sorted(FINAL_STATES)}}}, "limit": 200}
    response = httpx.post(f"{server.api_url}/flow_runs/filter", json=body, timeout=30)
    response.raise_for_status()
    return [(run["id"], run["state"]["type"]) for run in response.json()]


@pytest.fixture
def server(module_server: PrefectServer) -> Iterator[PrefectServer]:
    """The module's server, with no flow run waiting or running before the test or after it."""
    assert unfinished_flow_runs(module_server) == [], "a flow run of an earlier test is still waiting or running"
    yield module_server
    left = unfinished_flow_runs(module_server)
    for flow_run_id, _ in left:  # so that no later test's worker takes it
        httpx.post(f"{module_server.api_url}/flow_runs/{flow_run_id}/set_state",
                   json={"state": {"type": "CANCELLED"}, "force": True}, timeout=30).raise_for_status()
    assert left == [], f"the test left flow runs waiting or running (cancelled now): {left}"


@pytest.fixture(scope="module")
def deployed(module_server: PrefectServer) -> PrefectServer:
    """prefect.yaml's work pool and its deployments, created once on the module's server by
    the real commands (``prefect work-pool create``, ``prefect deploy --all``): each test that
    runs a deployment triggers its own flow run with its own parameters, so the definitions
    are shared like the server. Once instead of per test: a ``prefect deploy`` imports the
    flows it deploys (docs/testing.md)."""
    prefect(module_server, "work-pool", "create", POOL, "--type", "process", "--overwrite")
    prefect(module_server, "deploy", "--no-prompt", "--all")
    return module_server


def tiny_pipeline(tmp_path: Path, model_dir: Path, name: str, num_steps: int) -> Path:
    from tiny_run import tiny_config_at

    tmp_path.mkdir(parents=True, exist_ok=True)
    base = load_config(tiny_config_at(tmp_path, model_dir))
    config = replace(
        base,
        # the bundled game: the worker's flow-run process cannot import the tests' own modules
        env=replace(base.env, name="rollflow.envs.tool_use_game:load_environment"),
        train=replace(base.train, num_steps=num_steps),
        validation=replace(base.validation, validation_interval=num_steps),
        tracking=replace(base.tracking, tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}"),
        pipeline=PipelineConfig(model_name=f"{name}-policy", gate_min_gain=-10.0, gate_alpha=1.0, gate_min_discordant=0),
    )
    path = tmp_path / f"{name}.toml"
    path.write_text(config_to_toml(config))
    return path


def kill_flow_run_processes(worker: subprocess.Popen[bytes]) -> int:
    """SIGKILL everything the worker started (the flow-run process), not the worker itself."""
    children = psutil.Process(worker.pid).children(recursive=True)
    for child in children:
        child.send_signal(signal.SIGKILL)
    return len(children)


def test_a_killed_pipeline_retried_from_prefect_resumes_its_folder(
    deployed: PrefectServer, server: PrefectServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    config_path = tiny_pipeline(tmp_path, tiny_model_dir, "retry", num_steps=3)
    output = prefect(server, "deployment", "run", DEPLOYMENT, "--param", f"config_path={config_path}")
    match = re.search(r"UUID:\s*([0-9a-f-]{36})", output)
    assert match, output
    flow_run_id = match.group(1)
    runs = tmp_path / "runs"
    worker_command = [PREFECT, "worker", "start", "--pool", POOL, "--run-once"]

    log = tmp_path / "worker-1.log"
    with background(worker_command, server.env, log, cwd=tmp_path) as worker:
        first_step = wait_for(lambda: next(iter(runs.glob("pipeline-*/grpo/steps/step=000000/metrics.json")), None),
                              600, "GRPO's first step", log)
        assert kill_flow_run_processes(worker) > 0
        assert wait_for_final_state(server, flow_run_id, 120, log) == "CRASHED", tail(log)
    [folder] = list(runs.glob("pipeline-*"))
    grpo = folder / "grpo"
    done_before = {p: p.stat().st_mtime for p in (grpo / "steps" / "step=000000").rglob("*") if p.is_file()}
    assert first_step in done_before and not (folder / "pipeline.json").exists()

    prefect(server, "flow-run", "retry", flow_run_id)
    log = tmp_path / "worker-2.log"
    with background(worker_command, server.env, log, cwd=tmp_path):
        assert wait_for_final_state(server, flow_run_id, 900, log) == "COMPLETED", tail(log)

    assert list(runs.glob("pipeline-*")) == [folder]  # the same folder, not a new run
    assert {p: p.stat().st_mtime for p in done_before} == done_before  # step 0 was not redone
    con = duckdb.connect()
    total, distinct = con.execute(
        f"SELECT count(*), count(DISTINCT episode_id) FROM read_parquet('{grpo}/steps/*/episodes/*.parquet')"
    ).fetchone()
    assert total == distinct == 3 * 2 * 2  # steps x tasks x group, each episode once
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = load_tracking_run_id(grpo)
    steps = [m.step for m in client.get_metric_history(run_id, "reward/mean")]
    assert sorted(steps) == [0, 1, 2]  # no point logged twice by the retried run
    registry = PolicyRegistry("retry-policy", f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert [v.version for v in registry.versions()] == [1] and registry.champion().version == 1


def load_tracking_run_id(run_dir: Path) -> str:
    import json

    return str(json.loads((run_dir / "tracking.json").read_text())["mlflow_run_id"])


def test_two_pipelines_started_together_take_turns_on_the_training_slot(
    server: PrefectServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    code = "import sys; from rollflow.flows.pipeline import pipeline_flow; pipeline_flow(config_path=sys.argv[1], run_dir=sys.argv[2])"
    roots = [tmp_path / "night-a", tmp_path / "night-b"]
    processes = []
    for name, root in zip(("a", "b"), roots, strict=True):
        config = tiny_pipeline(tmp_path / name, tiny_model_dir, name, num_steps=1)
        log = (tmp_path / f"{name}.log").open("wb")
        processes.append((subprocess.Popen([sys.executable, "-c", code, str(config), str(root)], env=server.env,
                                           cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True),
                          tmp_path / f"{name}.log"))
    try:
        deadline = time.monotonic() + 900
        for process, log in processes:
            assert process.wait(timeout=max(1.0, deadline - time.monotonic())) == 0, tail(log)
    finally:
        for process, _ in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    # config.toml is frozen before the slot is asked for; grpo/config.toml once it is held;
    # pipeline.json is the last thing written while holding it.
    held = sorted(((root / "grpo" / "config.toml").stat().st_mtime, (root / "pipeline.json").stat().st_mtime, root)
                  for root in roots)
    (first_start, first_end, _), (second_start, _, second) = held
    assert first_end <= second_start, "the two pipelines trained at the same time"
    assert (second / "config.toml").stat().st_mtime < first_end  # the second was waiting, not late
    assert "waiting for the machine's training slot" in tail(tmp_path / "b.log", 200000)


# ---------------------------------------------------------------- prefect.yaml's deployments


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
    deployed: PrefectServer, server: PrefectServer, tiny_model_dir: Path, tmp_path: Path
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

    # prefect.yaml deployed by the module's ``deployed`` fixture (`prefect deploy --all`)
    evaluate = httpx.get(f"{server.api_url}/deployments/name/rollflow-eval/evaluate", timeout=30).json()
    assert evaluate["entrypoint"] == "flows/eval.py:eval_flow" and evaluate["schedules"] == []
    deployment = httpx.get(f"{server.api_url}/deployments/name/{TRAIN_DEPLOYMENT}", timeout=30).json()
    assert deployment["entrypoint"] == "flows/train.py:train_flow"
    assert deployment["parameters"] == {"config_path": "configs/default.toml"}
    assert [s["schedule"]["cron"] for s in deployment["schedules"]] == ["0 2 * * *"]
    [pull] = deployment["pull_steps"]
    assert pull["prefect.deployments.steps.set_working_directory"]["directory"] == str(REPO)

    output = prefect(server, "deployment", "run", TRAIN_DEPLOYMENT, "--param", f"config_path={config_path}")
    match = re.search(r"UUID:\s*([0-9a-f-]{36})", output)
    assert match, f"no flow run id in:\n{output}"
    flow_run = f"{server.api_url}/flow_runs/{match.group(1)}"

    log = tmp_path / "worker.log"
    worker = [PREFECT, "worker", "start", "--pool", POOL, "--run-once"]
    mlflow_db = tmp_path / "mlflow.db"  # the test's own store, not the server's
    with background(worker, {**server.env, "MLFLOW_TRACKING_URI": f"sqlite:///{mlflow_db}"}, log, cwd=tmp_path):
        state = wait_for_final_state(server, match.group(1), 600, log)
    assert state == "COMPLETED", tail(log)
    assert httpx.get(flow_run, timeout=10).json()["parameters"] == {"config_path": str(config_path)}

    [run_dir] = list((tmp_path / "runs").iterdir())
    folder = RunFolder(run_dir)
    assert load_config(folder.config_path) == config
    assert folder.completed_steps() == [0]
    assert (folder.step_dir(0) / "metrics.json").is_file() and folder.is_complete(0, "samples")
    assert folder.checkpoints() and folder.is_complete(1, "scores", "validation")
    assert mlflow_db.is_file()  # MLflow went to the test's store
