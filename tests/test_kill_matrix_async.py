"""The kill matrix for an async run (``tests/kill_matrix.py`` says what it checks and how)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kill_matrix import (
    GROUPS,
    STEPS,
    RunProcess,
    _config,
    _train_tasks,
    assert_each_group_once,
    collecting,
    kill_the_server_mid_request,
)
from rollflow.storage.async_groups import finished_groups, read_admission
from rollflow.storage.runfolder import RunFolder
from tiny_run import build_vllm_tiny_model


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vllm_tiny_model(tmp_path_factory.mktemp("kill-matrix-tiny"))


@pytest.mark.slow
def test_an_async_run_killed_at_every_point_leaves_nothing_and_resumes_to_the_same_episodes(
    vllm_model_dir: Path, tmp_path: Path, shared_prefect_url: str
) -> None:
    from rollflow.config.run import load_config
    from rollflow.tasks.schedule import select_train_tasks

    config_path = _config(vllm_model_dir, tmp_path, lockstep=False)
    run_dir = tmp_path / "run"
    folder = RunFolder(run_dir)
    resume = ["resume", str(run_dir)]
    # 1: collecting, before step 0 took its groups
    run = RunProcess(["train", str(config_path), "--run-dir", str(run_dir)], tmp_path / "1-rollout.log")
    run.wait_until(collecting(folder), "a group collected")
    run.kill()
    assert run.killed_its_own_prefect_server()  # and it was gone after the kill (kill's check)
    # The resumes' flows run on the session's Prefect server (the first run has shown the
    # temporary one ended with its run; starting one per resume cost ~3 CPU-s each)
    # 2: step 0's train stage, its policy loaded. A fault point, not a condition seen from
    # outside: the first run may have flattened step 0 already (its groups finish together),
    # and the resume could train it before a poll saw the stage start.
    run = RunProcess(resume, tmp_path / "2-train.log", fault="train_update", prefect_url=shared_prefect_url)
    run.wait_until(run.stopped_itself, "the train_update fault point")
    assert not folder.checkpoint_dir(0).exists()
    run.kill()
    assert not run.killed_its_own_prefect_server()
    # 3: step 0's checkpoint half written
    run = RunProcess(resume, tmp_path / "3-checkpoint.log", fault="checkpoint_write", prefect_url=shared_prefect_url)
    run.wait_until(run.stopped_itself, "the checkpoint_write fault point")
    run.kill()
    # 4: version 1 going to the server
    run = RunProcess(resume, tmp_path / "4-publish.log", fault="weight_publish", prefect_url=shared_prefect_url)
    run.wait_until(run.stopped_itself, "the weight_publish fault point")
    run.kill()
    # 5: the server killed mid-request: the run fails (tasks/collect.py), stopping what it started
    run = RunProcess(resume, tmp_path / "5-server.log", prefect_url=shared_prefect_url)
    collected = len(finished_groups(folder))
    kill_the_server_mid_request(run, lambda: len(finished_groups(folder)) > collected)
    if run.finish() != 0:
        # 6: the rest
        run = RunProcess(resume, tmp_path / "6-finish.log", prefect_url=shared_prefect_url)
        assert run.finish() == 0, run.tail()
    config = load_config(config_path)
    items = _train_tasks(config_path)
    admitted = [read_admission(folder, s).admitted for s in range(STEPS)]  # type: ignore[union-attr]
    trained = [index for step in admitted for index in step]
    assert len(trained) == len(set(trained)) == STEPS * GROUPS, f"a group trained twice: {admitted}"
    assert_each_group_once(
        run_dir, lambda s, k: select_train_tasks(items, admitted[s][k], 1, config.train.seed)[0].task_id
    )
