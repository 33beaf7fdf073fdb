"""``rollflow eval`` checks its config and flags as ``train`` does (flows/eval_config.py):
one line naming the flag, before Prefect starts, and no run folder left behind."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

import rollflow.flows.eval as eval_module
from rollflow.config.parsing import ConfigError
from rollflow.config.run import EnvConfig, load_config
from rollflow.flows.cli import main
from rollflow.flows.eval import eval_flow
from tiny_run import tiny_config_at


@pytest.fixture
def no_flow(monkeypatch: pytest.MonkeyPatch) -> None:
    """The evaluation flow must not run: the checks stop the command first."""

    def refuse(**_: object) -> str:
        raise AssertionError("the eval flow (and Prefect) started before the checks failed")

    monkeypatch.setattr(eval_module, "eval_flow", refuse)


def run_eval(
    argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> tuple[int, list[str]]:
    monkeypatch.chdir(tmp_path)
    status = main(["eval", *argv])
    return status, capsys.readouterr().err.splitlines()


@pytest.mark.usefixtures("no_flow")
def test_a_missing_model_says_the_path_does_not_exist(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tiny_config_at(tmp_path, tiny_model_dir)
    status, err = run_eval(["--config", str(config), "--model", "/nope"], tmp_path, monkeypatch, capsys)
    assert status == 1
    assert err == ["rollflow eval: --model '/nope': that path does not exist"]
    status, err = run_eval(["--config", str(config), "--adapter", "nope"], tmp_path, monkeypatch, capsys)
    assert status == 1 and err[0].startswith("rollflow eval: --adapter 'nope': that path does not exist (relative")
    assert not (tmp_path / "runs").exists()


@pytest.mark.usefixtures("no_flow")
def test_a_model_folder_without_a_model_names_the_flag(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tiny_config_at(tmp_path, tiny_model_dir)
    (tmp_path / "empty").mkdir()
    status, err = run_eval(["--config", str(config), "--model", "empty"], tmp_path, monkeypatch, capsys)
    assert status == 1 and len(err) == 1
    assert err[0].startswith("rollflow eval: --model 'empty' is a folder without config.json")
    assert "ModelRef" not in err[0]
    assert not (tmp_path / "runs").exists()


@pytest.mark.usefixtures("no_flow")
def test_a_wrong_env_names_the_flag_and_leaves_no_run_folder(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tiny_config_at(tmp_path, tiny_model_dir)
    status, err = run_eval(["--config", str(config), "--env", "typo:load_environment"], tmp_path, monkeypatch, capsys)
    assert status == 1
    assert err == ["rollflow eval: --env: no module named 'typo' (environment spec 'typo:load_environment')"]
    assert not (tmp_path / "runs").exists()


@pytest.mark.usefixtures("no_flow")
def test_a_config_setting_is_named_as_the_setting(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tiny_config_at(tmp_path, tiny_model_dir)
    text = config.read_text().replace(str(tiny_model_dir), str(tmp_path / "gone"))
    config.write_text(text)
    status, err = run_eval(["--config", str(config)], tmp_path, monkeypatch, capsys)
    assert status == 1 and err == [f"rollflow eval: [model].path = '{tmp_path / 'gone'}' does not exist"]


def test_an_environment_without_validation_tasks_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    from rollflow.ops.preflight import preflight_eval

    config = load_config(tiny_config_at(tmp_path, tiny_model_dir))
    game = EnvConfig(name="rollflow.envs.tool_use_game:load_environment", kwargs={"num_validation": 0})
    with pytest.raises(ConfigError, match="the environment has no validation tasks"):
        preflight_eval(replace(config, env=game))
    served = replace(config, model=replace(config.model, path=str(tmp_path / "gone")),
                     rollout=replace(config.rollout, backend="openai", base_url="http://127.0.0.1:9/v1",
                                     api_model="m", top_p=0.9))
    preflight_eval(served)  # a served model's files are the server's; eval may sample a nucleus


def test_the_flow_checks_before_it_makes_a_folder(
    tmp_path: Path, prefect_harness: object
) -> None:
    """A pipeline's or a deployment's evaluation goes through the flow, not the command."""
    with pytest.raises(ConfigError, match=r"^\[model\]\.path = .* does not exist"):
        eval_flow(model=str(tmp_path / "missing"), run_dir=str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
