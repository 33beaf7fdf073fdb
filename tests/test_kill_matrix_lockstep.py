"""The kill matrix for a lockstep run (``tests/kill_matrix.py`` says what it checks and how)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kill_matrix import (
    GROUPS,
    RunProcess,
    _config,
    _train_tasks,
    assert_each_group_once,
    kill_the_server_mid_request,
    rollout_half_done,
    training,
)
from rollflow.storage.runfolder import RunFolder
from tiny_run import build_vllm_tiny_model


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vllm_tiny_model(tmp_path_factory.mktemp("kill-matrix-tiny"))


@pytest.mark.slow
def test_a_lockstep_run_killed_at_every_point_leaves_nothing_and_resumes_to_the_same_episodes(
    vllm_model_dir: Path, tmp_path: Path, shared_prefect_url: str
) -> None:
    from rollflow.config.run import load_config
    from rollflow.tasks.schedule import select_train_tasks

    config_path = _config(vllm_model_dir, tmp_path, lockstep=True)
    run_dir = tmp_path / "run"
    folder = RunFolder(run_dir)
    resume = ["resume", str(run_dir)]
    # 1: the server killed mid-request (restarted, its chunk replayed), then the run in train
    run = RunProcess(["train", str(config_path), "--run-dir", str(run_dir)], tmp_path / "1-server-train.log")
    kill_the_server_mid_request(run, rollout_half_done(folder, 0))
    run.wait_until(training(folder, 0), "step 0's train stage")
    run.kill()
    assert run.killed_its_own_prefect_server()  # and it was gone after the kill (kill's check)
    # The resumes' flows run on the session's Prefect server (the first run has shown the
    # temporary one ended with its run; starting one per resume cost ~3 CPU-s each)
    # 2: step 1's adapter going to a fresh server
    run = RunProcess(resume, tmp_path / "2-publish.log", fault="weight_publish", prefect_url=shared_prefect_url)
    run.wait_until(run.stopped_itself, "the weight_publish fault point")
    run.kill()
    assert not run.killed_its_own_prefect_server()
    # 3: step 1's rollout, half done
    run = RunProcess(resume, tmp_path / "3-rollout.log", prefect_url=shared_prefect_url)
    run.wait_until(rollout_half_done(folder, 1), "step 1's rollout half done")
    run.kill()
    # 4: step 1's checkpoint half written (the server still up)
    run = RunProcess(resume, tmp_path / "4-checkpoint.log", fault="checkpoint_write", prefect_url=shared_prefect_url)
    run.wait_until(run.stopped_itself, "the checkpoint_write fault point")
    run.kill()
    # 5: the rest
    run = RunProcess(resume, tmp_path / "5-finish.log", prefect_url=shared_prefect_url)
    assert run.finish() == 0, run.tail()
    config = load_config(config_path)
    items = _train_tasks(config_path)
    assert_each_group_once(
        run_dir, lambda s, k: select_train_tasks(items, s, GROUPS, config.train.seed)[k].task_id
    )
    assert "restarting the vLLM server" in (run_dir / "logs" / "vllm-server.log").read_text()
