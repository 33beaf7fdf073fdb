"""The nightly pipeline against a real ``prefect server start``: retry is resume, one training at a time.

A worker runs the deployed pipeline in a subprocess; the test SIGKILLs that flow-run
process mid-GRPO (the worker then reports the run CRASHED), retries the flow run with
``prefect flow-run retry`` and checks that the retried run continued the same folder: no
step redone, no episode or metric point twice, one registered version. Then two pipelines
started together against the same server must take turns on the training slot.
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
import psutil
import pytest
from prefect_server import (
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

pytestmark = pytest.mark.slow

DEPLOYMENT = "rollflow-pipeline/nightly-pipeline"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    with running_prefect_server(tmp_path_factory.mktemp("prefect-pipeline")) as running:
        yield running


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
    server: PrefectServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    config_path = tiny_pipeline(tmp_path, tiny_model_dir, "retry", num_steps=3)
    prefect(server, "work-pool", "create", POOL, "--type", "process", "--overwrite")
    prefect(server, "deploy", "--no-prompt", "--name", "nightly-pipeline")
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
