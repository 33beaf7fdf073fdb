"""``write_starter``: the written packages load, play, and pass their own tests."""

from __future__ import annotations

import asyncio
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from rollflow.envs.runner import EpisodeLimits, load_environment_handle
from rollflow.envs.scaffold import write_starter
from rollflow.envs.scripted import constant_policy


@pytest.mark.parametrize(("style", "expected_style"), [("hook", "hook"), ("async", "async")])
def test_the_starter_is_a_loadable_package_named_after_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, style: str, expected_style: str
) -> None:
    name = f"shop_agent_{style}"
    written = write_starter(name, tmp_path, style)  # type: ignore[arg-type]
    assert [p.name for p in written] == ["__init__.py", "environment.py", "test_environment.py"]
    assert all(p.parent == tmp_path / name for p in written)
    source = (tmp_path / name / "environment.py").read_text()
    class_name = "ShopAgentHookEnv" if style == "hook" else "ShopAgentAsyncEnv"
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
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "hooked", "asynced"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 passed" in result.stdout


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("My-Env", "lowercase Python name"),
        ("1env", "lowercase Python name"),
        ("", "lowercase Python name"),
        ("class", "would shadow"),
        ("json", "would shadow"),
        ("envs", "would shadow"),
    ],
)
def test_bad_names_are_refused(tmp_path: Path, name: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
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
