"""Type errors name both classes' modules (envs/type_names.py).

In a checkout, ``envs/types.py`` is also importable as ``envs.types`` from the working
directory: a second ``RewardResult``, ``EnvironmentStepResult`` or ``ToolResult`` that is
not rollflow's. The errors used to read "returned RewardResult, not a RewardResult".
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from rollflow import RewardResult, ToolResult
from rollflow.envs.handle import EpisodeLimits, TaskItem
from rollflow.envs.hook_handle import HookEnvironmentHandle
from rollflow.envs.hooks import EnvironmentMultiTurn, score_each
from rollflow.envs.runner import EnvironmentLoadError, handle_for
from rollflow.envs.scripted import constant_policy
from rollflow.envs.type_names import qualified_name, type_mismatch
from rollflow.envs.types import EnvironmentEpisode, EnvironmentStepResult, Message, TaskExample

REPO = Path(__file__).resolve().parent.parent


def second_copy(module_name: str, file: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """``envs/<file>`` imported again under ``module_name``, as the working directory would."""
    spec = importlib.util.spec_from_file_location(module_name, REPO / "envs" / file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, module_name, module)
    spec.loader.exec_module(module)
    return module


def test_a_twin_class_is_named_with_both_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    twin = second_copy("envs.types", "types.py", monkeypatch)
    assert twin.ToolResult is not ToolResult
    text = type_mismatch(twin.ToolResult(content="1"), ToolResult)
    assert text.startswith("envs.types.ToolResult, not rollflow.envs.types.ToolResult")
    assert "a second copy of rollflow's class from module envs.types" in text
    assert "`from rollflow import ToolResult`" in text
    assert type_mismatch({}, ToolResult) == "dict, not rollflow.envs.types.ToolResult"
    assert qualified_name(int) == "int"


class _Twice(EnvironmentMultiTurn):
    """Answers and scores with the classes of ``types``, a module given at construction."""

    def __init__(self, types: ModuleType) -> None:
        self.types = types
        self.dataset = {"train": [{"input": "hi"}], "validation": []}

    def start_episode(self, example: TaskExample, prompt_text: str) -> list[Message]:
        return [{"role": "user", "content": prompt_text}]

    def max_episode_turns(self, example: TaskExample) -> int:
        return 2

    def step_episode(self, example: TaskExample, messages: list[Message], assistant_response: str):  # type: ignore[no-untyped-def]
        return self.types.EnvironmentStepResult(done=True, final_response_text=assistant_response)

    def score_episode(self, example: TaskExample, episode: EnvironmentEpisode):  # type: ignore[no-untyped-def]
        return self.types.RewardResult(score=1.0)


def test_hook_results_of_a_twin_module_name_it(monkeypatch: pytest.MonkeyPatch) -> None:
    twin = second_copy("envs.types", "types.py", monkeypatch)
    env = _Twice(twin)
    item = TaskItem(task_id="t", payload=TaskExample(input="hi"))
    rollout = asyncio.run(HookEnvironmentHandle(env).play(item, constant_policy("x"), EpisodeLimits()))
    assert rollout.error is not None
    assert "step_episode returned envs.types.EnvironmentStepResult, not rollflow.envs.types.EnvironmentStepResult" in rollout.error
    env.types = sys.modules["rollflow.envs.types"]  # the step passes; the score is still the twin's
    assert isinstance(env.step_episode(TaskExample(input="hi"), [], "x"), EnvironmentStepResult)
    env.types = twin
    episode = EnvironmentEpisode(messages=(), response_text="x")
    [outcome] = score_each(env, TaskExample(input="hi"), [episode])
    assert "score_episode returned envs.types.RewardResult, not rollflow.envs.types.RewardResult" in str(outcome)
    assert isinstance(RewardResult(score=1.0), RewardResult)


def test_an_environment_class_of_a_twin_module_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    second_copy("envs.types", "types.py", monkeypatch)
    twin_hooks = second_copy("envs.hooks", "hooks.py", monkeypatch)

    class Mine(twin_hooks.EnvironmentMultiTurn):  # type: ignore[name-defined, misc]
        def start_episode(self, example, prompt_text):  # type: ignore[no-untyped-def]
            return []

        def max_episode_turns(self, example):  # type: ignore[no-untyped-def]
            return 1

        def step_episode(self, example, messages, response):  # type: ignore[no-untyped-def]
            return None

        def score_episode(self, example, episode):  # type: ignore[no-untyped-def]
            return None

    twin_env = Mine()
    with pytest.raises(EnvironmentLoadError) as caught:
        handle_for(twin_env, where="my_env:load_environment")
    assert str(caught.value).startswith(
        "my_env:load_environment returned test_type_names.test_an_environment_class_of_a_twin_module_names_it.<locals>.Mine, not rollflow.envs.hooks.EnvironmentMultiTurn "
        "or rollflow.envs.env.AsyncEnvSuite (it derives from envs.hooks.EnvironmentMultiTurn, a second copy"
    )
    assert "`from rollflow import EnvironmentMultiTurn`" in str(caught.value)
