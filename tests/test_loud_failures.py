"""Broken environments fail the run loudly (issue 22): a step whose every episode errored or
overflowed names the cause, tracebacks are kept in the run folder, each step line says how
the step went. One-step tiny runs (2 tasks x 2 episodes, 16 tokens) under Prefect's harness."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

import broken_env
from rollflow.config.run import config_to_toml, load_config
from rollflow.flows.train import train_flow
from rollflow.storage.runfolder import RunFolder
from rollflow.tasks.step_health import ERRORS_JSONL, StepFailedError
from tiny_run import tiny_config_at

pytestmark = pytest.mark.usefixtures("prefect_harness")


def one_step_config(tmp_path: Path, model_dir: Path, broken: str | None, max_model_length: int = 1024) -> Path:
    """configs/tiny.toml for one step, no validation, no tracking; ``broken_env`` when ``broken``."""
    path = tiny_config_at(tmp_path, model_dir)
    config = load_config(path)
    env = config.env if broken is None else replace(config.env, name="broken_env:load_environment",
                                                    kwargs={"broken": broken})
    config = replace(
        config,
        env=env,
        rollout=replace(config.rollout, max_model_length=max_model_length),
        train=replace(config.train, num_steps=1),
        validation=replace(config.validation, validation_interval=0),
        tracking=replace(config.tracking, enabled=False),
    )
    path.write_text(config_to_toml(config))
    return path


def kept_errors(run_dir: Path) -> list[dict]:
    lines = (RunFolder(run_dir).step_dir(0) / ERRORS_JSONL).read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.slow  # 3 s in a loaded suite run (docs/testing.md)
def test_a_scorer_that_always_raises_fails_the_run_naming_it(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = one_step_config(tmp_path, tiny_model_dir, broken="score")
    errors_file = RunFolder(tmp_path / "run").step_dir(0) / ERRORS_JSONL
    with pytest.raises(StepFailedError) as failed:
        train_flow(config_path=str(config), run_dir=str(tmp_path / "run"))
    message = str(failed.value)
    assert message.startswith("step 0: all 4 episodes failed: ValueError: the scorer is broken (in score_episode)")
    assert f"tracebacks in {errors_file}" in message
    kept = kept_errors(tmp_path / "run")
    assert sorted(e["episode_id"] for e in kept) == ["train/0/0/0", "train/0/0/1", "train/0/1/0", "train/0/1/1"]
    assert {e["stage"] for e in kept} == {"scoring"}
    assert all('raise ValueError("the scorer is broken")' in e["traceback"] for e in kept)
    folder = RunFolder(tmp_path / "run")
    assert not folder.is_complete(0, "scores") and folder.is_complete(0, "episodes")  # a resume scores again
    monkeypatch.setattr(broken_env, "REPAIRED", {"score"})
    train_flow(run_dir=str(tmp_path / "run"))
    assert folder.completed_steps() == [0] and kept_errors(tmp_path / "run") == []


@pytest.mark.slow  # 4 s in a loaded suite run (docs/testing.md)
def test_a_step_that_always_raises_fails_the_run_and_a_resume_after_the_fix_replays_it(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = one_step_config(tmp_path, tiny_model_dir, broken="step")
    run_dir = tmp_path / "run"
    with pytest.raises(StepFailedError, match=r"^step 0: all 4 episodes failed: KeyError: 'the step is broken' "
                       r"\(in step_episode\) \(tracebacks in .*errors\.jsonl\); its episodes were discarded"):
        train_flow(config_path=str(config), run_dir=str(run_dir))
    kept = kept_errors(run_dir)
    assert len(kept) == 4 and {e["stage"] for e in kept} == {"rollout"}
    assert all('raise KeyError("the step is broken")' in e["traceback"] for e in kept)
    assert all(e["task_id"].startswith("say-") for e in kept)
    assert not RunFolder(run_dir).is_complete(0, "episodes")

    monkeypatch.setattr(broken_env, "REPAIRED", {"step"})
    train_flow(run_dir=str(run_dir))
    assert RunFolder(run_dir).completed_steps() == [0]
    assert kept_errors(run_dir) == []  # the replayed episodes replaced the failed attempt's lines


def test_a_prompt_longer_than_the_context_fails_the_run_with_its_length(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = one_step_config(tmp_path, tiny_model_dir, broken="long_prompt", max_model_length=100)
    with pytest.raises(StepFailedError, match=r"^step 0: all 4 episodes overflowed the context before their "
                       r"first action: the prompt of task say-\d is \d{3} tokens, \[rollout\]\.max_model_length is 100"):
        train_flow(config_path=str(config), run_dir=str(tmp_path / "run"))


def test_each_step_line_says_reward_pass_rate_errors_and_overflows(
    tiny_model_dir: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    config = one_step_config(tmp_path, tiny_model_dir, broken=None)
    train_flow(config_path=str(config), run_dir=str(tmp_path / "run"))
    lines = [line for line in capfd.readouterr().err.splitlines() if "step 0 done (1 of 1)" in line]
    assert len(lines) == 1, lines
    metrics = json.loads((RunFolder(tmp_path / "run").step_dir(0) / "metrics.json").read_text())
    assert f"reward {metrics['reward/mean']:.3f}" in lines[0]
    assert f"pass {metrics['reward/pass_rate']:.0%}" in lines[0]
    assert "errors 0/4" in lines[0] and "overflows 0/4" in lines[0]


@pytest.mark.slow  # 3 s in a loaded suite run (docs/testing.md)
def test_a_step_that_learns_nothing_says_so_and_each_validation_pass_has_a_line(
    tiny_model_dir: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Every episode scores 0 (``flat_reward``): the step line says no group had reward
    variance and the next line what to try; validation before and after prints its own line."""
    path = one_step_config(tmp_path, tiny_model_dir, broken="flat_reward")
    config = load_config(path)
    path.write_text(config_to_toml(replace(config, validation=replace(config.validation, validation_interval=1))))
    train_flow(config_path=str(path), run_dir=str(tmp_path / "run"))
    err = [line.split("] ", 1)[-1] for line in capfd.readouterr().err.splitlines() if line.startswith("[run] ")]
    [at] = [i for i, line in enumerate(err) if line.startswith("step 0 done (1 of 1)")]
    assert "reward 0.000 pass 0% errors 0/4 overflows 0/4 tool calls 0 groups with reward variance 0/2: nothing to learn (" in err[at]
    assert err[at + 1].startswith("  nothing to learn: in every group all episodes scored alike")
    validations = [line for line in err if line.startswith("validation at step")]
    assert validations == [f"validation at step {s}: reward 0.000 pass 0% errors 0/2 overflows 0/2 tool calls 0" for s in (0, 1)]


# ---------------------------------------------------------------- async: the rollout workers' episodes


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_run import build_vllm_tiny_model

    return build_vllm_tiny_model(tmp_path_factory.mktemp("loud-async-tiny"))


@pytest.mark.slow
def test_an_async_step_that_always_raises_keeps_its_tracebacks_fails_and_a_resume_after_the_fix_replays_it(
    vllm_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Async (a real managed vLLM server): the rollout workers keep each errored episode's
    traceback in its group's file, the admission copies them into the step's errors.jsonl
    under the step's episode ids; the failed step is discarded with its admission, and the
    resume after the fix plays its groups again and trains.

    One server for the failed run and its resume (``lend``: a start fewer, ~8 CPU-s), as a
    test module's runs share one; the resume finds it still serving version 0."""
    from test_async_training import async_config

    from rollflow.generators.async_generator import max_loaded_adapters
    from rollflow.generators.cpu_split import async_cpu_split
    from rollflow.generators.lending import lend
    from rollflow.generators.run_generator import open_generator

    config = async_config(vllm_model_dir, tmp_path, groups_in_flight=2, train={"num_steps": 1})
    config = replace(config, env=replace(config.env, name="broken_env:load_environment", kwargs={"broken": "step"}))
    path = tmp_path / "async.toml"
    path.write_text(config_to_toml(replace(config, storage=replace(config.storage, runs_dir=str(tmp_path / "runs")))))
    run_dir = tmp_path / "run"
    folder = RunFolder(run_dir)
    split = async_cpu_split(config)
    cpus = split[0] if split else ()
    with open_generator(config, None, versions_in_flight=max_loaded_adapters(config), cpus=cpus) as opened, lend(opened):
        _failed_then_fixed(path, run_dir, folder, monkeypatch)
        assert opened.server is not None and opened.server.restarts == 0
        assert not (run_dir / "logs" / "vllm-server.log").exists(), "a run started a server of its own"
    assert not opened.server.running, "the lent server outlived its owner's with"


def _failed_then_fixed(path: Path, run_dir: Path, folder: RunFolder, monkeypatch: pytest.MonkeyPatch) -> None:
    from rollflow.storage.async_groups import consumed_groups, finished_groups, read_admission
    from rollflow.storage.schemas import table_to_episode_records
    from rollflow.tasks.group_errors import group_errors_path

    with pytest.raises(StepFailedError, match=r"^step 0: all 4 episodes failed: KeyError: 'the step is broken' "
                       r"\(in step_episode\) \(tracebacks in .*step=000000/errors\.jsonl\); its episodes were discarded"):
        train_flow(config_path=str(path), run_dir=str(run_dir))
    kept = kept_errors(run_dir)
    assert sorted(e["episode_id"] for e in kept) == ["train/0/0/0", "train/0/0/1", "train/0/1/0", "train/0/1/1"]
    assert {e["stage"] for e in kept} == {"rollout"} and all(e["task_id"].startswith("say-") for e in kept)
    assert all('raise KeyError("the step is broken")' in e["traceback"] for e in kept), kept[0]["traceback"]
    played = finished_groups(folder)
    assert played and all(group_errors_path(folder, i).is_file() for i in played), "each group keeps its own"
    assert read_admission(folder, 0) is None and not consumed_groups(folder), "the failed admission is discarded"
    assert not folder.is_complete(0, "episodes")

    monkeypatch.setattr(broken_env, "REPAIRED", {"step"})
    train_flow(run_dir=str(run_dir))
    assert folder.completed_steps() == [0]
    episodes = table_to_episode_records(folder.read_stage(0, "episodes"))
    assert len(episodes) == 4 and {e.rollout.error for e in episodes} == {None}
    admitted = read_admission(folder, 0)
    assert admitted is not None and not set(admitted.admitted) - set(played), "the same data positions, played again"
    assert kept_errors(run_dir) == []  # the replayed episodes replaced the failed attempt's lines
    assert not any(group_errors_path(folder, i).exists() for i in admitted.admitted)
