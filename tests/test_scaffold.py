"""``write_starter``: the written packages load, play, and pass their own tests."""

from __future__ import annotations

import ast
import asyncio
import importlib
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from rollflow.config.run import config_to_toml, load_config
from rollflow.envs.handle import EpisodeLimits
from rollflow.envs.runner import load_environment_handle
from rollflow.envs.scaffold import write_starter
from rollflow.envs.scripted import constant_policy
from rollflow.flows.cli import main
from rollflow.storage.query import open_run_sql, run_query
from rollflow.ops.preflight import preflight

# What a written test may import besides ``rollflow`` itself: the runner, its episode limits
# and scripted policies that play the environment (not reference-doc names, so not re-exported).
TEST_HELPERS = {"rollflow.envs.handle", "rollflow.envs.runner", "rollflow.envs.scripted"}


@pytest.mark.parametrize(("style", "expected_style"), [("hook", "hook"), ("async", "async"), ("single", "hook")])
def test_the_starter_is_a_loadable_package_named_after_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, style: str, expected_style: str
) -> None:
    name = f"shop_agent_{style}"
    written = write_starter(name, tmp_path, style)  # type: ignore[arg-type]
    assert [p.name for p in written] == ["__init__.py", "environment.py", "test_environment.py", "train.toml"]
    assert all(p.parent == tmp_path / name for p in written)
    source = (tmp_path / name / "environment.py").read_text()
    class_name = {"hook": "ShopAgentHookEnv", "async": "ShopAgentAsyncEnv", "single": "ShopAgentSingleEnv"}[style]
    assert f"class {class_name}(" in source and "StarterEnv" not in source
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        handle = load_environment_handle(f"{name}:load_environment")
        assert handle.style == expected_style
        item = handle.tasks("train")[0]
        rollout = asyncio.run(handle.play(item, constant_policy("0"), EpisodeLimits(max_turns=2)))
        assert rollout.terminated and rollout.error is None
        tests = importlib.import_module(f"{name}.test_environment")
        for test_name in [n for n in vars(tests) if n.startswith("test_")]:
            getattr(tests, test_name)()  # the starter's own tests pass
    finally:
        for module in [m for m in sys.modules if m == name or m.startswith(f"{name}.")]:
            del sys.modules[module]


def test_the_written_tests_pass_under_pytest(tmp_path: Path) -> None:
    write_starter("hooked", tmp_path, "hook")
    write_starter("asynced", tmp_path, "async")
    write_starter("single", tmp_path, "single")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "hooked", "asynced", "single"],
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"},  # the outer run's options (-q) hide the count
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "6 passed" in result.stdout


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("My-Env", "lowercase Python name"),
        ("1env", "lowercase Python name"),
        ("", "lowercase Python name"),
        ("class", "would shadow"),
        ("json", "would shadow"),
        ("envs", "would shadow"),
        ("rollflow", "would shadow"),
    ],
)
def test_bad_names_are_refused(tmp_path: Path, name: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        write_starter(name, tmp_path, "hook")
    assert list(tmp_path.iterdir()) == []


def installed_subpackages() -> dict[str, Path]:
    """What setup.py installs under ``rollflow.`` (its ``FOLDERS``), each with the folder it
    is imported from: read from setup.py itself, so a package added there is checked here."""
    tree = ast.parse((Path(__file__).parents[1] / "setup.py").read_text(encoding="utf-8"))
    (folders,) = [node.value for node in ast.walk(tree) if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "FOLDERS"]
    names = ast.literal_eval(folders)
    return {name: Path(importlib.import_module(f"rollflow.{name}").__path__[0]) for name in names}


def test_every_installed_subpackage_is_refused_as_a_folder_and_as_a_name(tmp_path: Path) -> None:
    subpackages = installed_subpackages()
    assert "ops" in subpackages  # the package the hand-kept list missed
    for name, folder in subpackages.items():
        with pytest.raises(ValueError, match="inside rollflow's own package folder"):
            write_starter("stray_env", folder, "hook")
        assert not (folder / "stray_env").exists()
        with pytest.raises(ValueError, match="would shadow a Python or rollflow module"):
            write_starter(name, tmp_path, "hook")
    assert list(tmp_path.iterdir()) == []


def test_nothing_is_overwritten_and_the_style_is_checked(tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError, match="already exists"):
        write_starter("taken", tmp_path, "hook")
    with pytest.raises(ValueError, match="unknown starter style 'sync'"):
        write_starter("fresh", tmp_path, "sync")  # type: ignore[arg-type]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_missing_destination_folders_are_created(tmp_path: Path) -> None:
    written = write_starter("nested_env", tmp_path / "a" / "b", "async")
    assert written[0] == tmp_path / "a" / "b" / "nested_env" / "__init__.py"


@pytest.mark.parametrize("style", ["hook", "async", "single"])
def test_the_starter_imports_the_reference_names_from_rollflow_itself(tmp_path: Path, style: str) -> None:
    """What a user copies reads like the reference docs: ``from rollflow import ...``."""
    write_starter("my_env", tmp_path, style)  # type: ignore[arg-type]
    package = tmp_path / "my_env"
    imported = {
        path.name: re.findall(r"^from (rollflow[\w.]*) import", path.read_text(), re.MULTILINE)
        for path in package.glob("*.py")
    }
    assert imported["environment.py"] == ["rollflow"]
    assert imported["__init__.py"] == []
    assert "rollflow" in imported["test_environment.py"]
    assert set(imported["test_environment.py"]) - {"rollflow"} <= TEST_HELPERS


def test_env_new_says_which_spec_loads_what_it_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    assert main(["env", "new", "my_env", "--multi-turn"]) == 0  # the working directory, not envs/
    out, err = capsys.readouterr()
    assert out.splitlines()[0] == str(Path("my_env") / "__init__.py")
    assert 'name = "my_env:load_environment"' in err
    assert "rollflow env show my_env:load_environment" in err
    assert main(["env", "new", "top_env", "--async", "--dest", "."]) == 0
    assert 'name = "top_env:load_environment"' in capsys.readouterr().err
    assert main(["env", "new", "mine_env", "--dir", "my_envs"]) == 0
    assert 'name = "my_envs.mine_env:load_environment"' in capsys.readouterr().err
    assert main(["env", "new", "deep_env", "--dest", str(tmp_path / "work" / "my_envs")]) == 0
    assert 'name = "my_envs.deep_env:load_environment"' in capsys.readouterr().err
    assert main(["env", "new", "far_env", "--dest", str(tmp_path / "elsewhere")]) == 0
    err = capsys.readouterr().err
    assert 'name = "far_env:load_environment"' in err
    assert f"run rollflow from {tmp_path / 'elsewhere'};" in err


def test_env_new_single_turn_writes_a_single_turn_starter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["env", "new", "quiz_env", "--single-turn"]) == 0
    source = (tmp_path / "quiz_env" / "environment.py").read_text()
    assert "class QuizEnvEnv(EnvironmentSingleTurn)" in source


def test_env_new_refuses_rollflow_own_package_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A package beside envs/types.py could import rollflow's classes under a second name."""
    import rollflow.envs

    own = Path(rollflow.envs.__file__).parent
    monkeypatch.chdir(tmp_path)
    for dest in (str(own), str(own / "my_envs"), str(Path(rollflow.__file__).parent)):
        assert main(["env", "new", "stray_env", "--dir", dest]) == 1
        assert "inside rollflow's own package folder" in capsys.readouterr().err
    assert not (own / "stray_env").exists() and not (own / "my_envs").exists()


@pytest.mark.slow  # 10 s in a loaded suite run (docs/testing.md)
def test_a_starter_in_the_working_directory_passes_its_test_and_rollflow_loads_it(tmp_path: Path) -> None:
    """As a user does it: the `rollflow` console script (no working directory on its
    sys.path) writes the starter, pytest plays it, and the written config's [env] loads."""
    rollflow = Path(sys.executable).parent / "rollflow"
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)

    made = run(str(rollflow), "env", "new", "unit_convert")
    assert made.returncode == 0, made.stderr
    assert (tmp_path / "unit_convert" / "environment.py").is_file()
    assert 'name = "unit_convert:load_environment"' in made.stderr
    tested = run(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "unit_convert")
    assert tested.returncode == 0 and "2 passed" in tested.stdout, tested.stdout + tested.stderr
    shown = run(str(rollflow), "env", "show", "--config", str(Path("unit_convert") / "train.toml"))
    assert shown.returncode == 0, shown.stderr
    assert "tools: count_letters" in shown.stderr and '{"name": "count_letters"' in shown.stdout


@pytest.mark.parametrize("style", ["hook", "async", "single"])
def test_the_starter_validates_on_tasks_it_does_not_train_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, style: str
) -> None:
    name = f"held_out_{style}"
    write_starter(name, tmp_path, style)  # type: ignore[arg-type]
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        handle = load_environment_handle(f"{name}:load_environment")
        train_ids = {item.task_id for item in handle.tasks("train")}
        validation_ids = {item.task_id for item in handle.tasks("validation")}
    finally:
        for module in [m for m in sys.modules if m == name or m.startswith(f"{name}.")]:
            del sys.modules[module]
    assert train_ids and validation_ids
    assert not train_ids & validation_ids, f"validated on training tasks {sorted(train_ids & validation_ids)}"


@pytest.mark.parametrize("style", ["hook", "async", "single"])
@pytest.mark.slow  # 4 s in a loaded suite run (docs/testing.md)
def test_env_new_writes_a_config_the_train_flow_runs_on_the_starter(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tiny_model_dir: Path,
    prefect_harness: object,
    style: str,
) -> None:
    """The written config as is, but on the tiny model and one short step."""
    from rollflow.flows.train import train_flow

    name = f"trained_{style}"
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    flag = {"hook": "--multi-turn", "async": "--async", "single": "--single-turn"}[style]
    assert main(["env", "new", name, flag, "--dir", "my_envs"]) == 0
    config_path = Path("my_envs") / name / "train.toml"
    assert str(config_path) in capsys.readouterr().out.splitlines()
    config = load_config(config_path)
    assert config.env.name == f"my_envs.{name}:load_environment"
    preflight(config)  # as written: the bundled model's files, the environment, its prompts fit
    tiny = replace(
        config,
        model=replace(config.model, path=str(tiny_model_dir)),
        rollout=replace(config.rollout, max_completion_tokens=8),
        train=replace(config.train, num_steps=1),
        validation=replace(config.validation, num_tasks=1),
        tracking=replace(config.tracking, enabled=False),
    )
    (tmp_path / "tiny.toml").write_text(config_to_toml(tiny))
    try:
        root = Path(train_flow(config_path=str(tmp_path / "tiny.toml")))
    finally:
        for module in [m for m in sys.modules if m == "my_envs" or m.startswith("my_envs.")]:
            del sys.modules[module]
    assert root.parent == tmp_path / "runs"
    con = open_run_sql([root])
    _, rows = run_query(con, "SELECT split, count(error) FROM episodes GROUP BY split ORDER BY split")
    assert rows == [("train", 0), ("validation", 0)]  # both splits played, no episode errored
    _, [(shared,)] = run_query(
        con,
        "SELECT count(*) FROM episodes v JOIN episodes t USING (task_id)"
        " WHERE v.split = 'validation' AND t.split = 'train'",
    )
    assert shared == 0, "the run validated on tasks it trained on"
