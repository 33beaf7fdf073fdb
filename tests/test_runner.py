"""Loading environments by spec, concurrent groups, and stable task ids."""

from __future__ import annotations

import asyncio
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from rollflow.envs.agent import PolicyAction
from rollflow.envs.env import AsyncEnvSuite
from rollflow.envs.handle import EpisodeLimits, task_id_for
from rollflow.envs.runner import (
    EnvironmentLoadError,
    handle_for,
    handle_from_async,
    load_environment_handle,
    play_groups,
)
from rollflow.envs.types import Message, Task, TaskExample, ToolSpec

MODULE = textwrap.dedent(
    """
    from rollflow.envs.hooks import EnvironmentMultiTurn
    from rollflow.envs.types import EnvironmentStepResult, RewardResult


    class Say(EnvironmentMultiTurn):
        def __init__(self, word="done", size=3):
            self.word = word
            self.dataset = [{"input": f"task {i}", "id": f"t{i}"} for i in range(size)]

        def start_episode(self, example, prompt_text):
            if prompt_text == "task 1" and self.word == "fail-one":
                raise RuntimeError("only task 1 breaks")
            return [{"role": "user", "content": prompt_text}]

        def max_episode_turns(self, example):
            return 2

        def step_episode(self, example, messages, assistant_response):
            return EnvironmentStepResult(done=self.word in assistant_response)

        def score_episode(self, example, episode):
            return RewardResult(score=1.0)


    def load_environment(word="done", size=3):
        return Say(word=word, size=size)


    def load_nothing():
        return 42


    def load_raising(size):
        raise ValueError(f"size must be positive, got {size}")

    not_a_function = 3
    """
)


@pytest.fixture
def env_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "say_env_for_tests.py").write_text(MODULE)
    (tmp_path / "broken_env_for_tests.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "say_env_for_tests"


def test_a_spec_loads_a_hook_handle_with_kwargs(env_module: str) -> None:
    handle = load_environment_handle(f"{env_module}:load_environment", {"size": 5})
    assert handle.style == "hook"
    assert [item.task_id for item in handle.tasks("train")] == ["t0", "t1", "t2", "t3", "t4"]


@pytest.mark.parametrize(
    ("spec", "kwargs", "problem"),
    [
        ("say_env_for_tests", None, "must be 'module:function'"),
        ("a:b:c", None, "must be 'module:function'"),
        ("say_env_for_tests:", None, "must be 'module:function'"),
        ("say_env_for_tests:load-env", None, "not a Python name"),
        ("no_such_module_xyz:load_environment", None, "no module named 'no_such_module_xyz'"),
        ("broken_env_for_tests:load_environment", None, "importing 'broken_env_for_tests' failed"),
        (
            "say_env_for_tests:load_env",
            None,
            "has no 'load_env'; it has load_environment, load_nothing, load_raising",
        ),
        ("say_env_for_tests:not_a_function", None, "is a int, not a function"),
        ("say_env_for_tests:load_nothing", None, "returned int, not rollflow.envs.hooks.EnvironmentMultiTurn or rollflow.envs.env.AsyncEnvSuite"),
        ("say_env_for_tests:load_environment", {"colour": "red"}, "unexpected keyword argument 'colour'"),
        ("say_env_for_tests:load_raising", None, "missing a required argument: 'size'"),
        ("say_env_for_tests:load_raising", {"size": -1}, "raised ValueError: size must be positive, got -1"),
    ],
)
def test_bad_specs_name_the_problem(
    env_module: str, spec: str, kwargs: dict[str, object] | None, problem: str
) -> None:
    with pytest.raises(EnvironmentLoadError) as caught:
        load_environment_handle(spec, kwargs)
    assert problem in str(caught.value)


def test_handle_for_accepts_both_styles_only() -> None:
    suite = AsyncEnvSuite(tasks=[Task("p")], val_tasks=[], env_factory=lambda task: None)  # type: ignore[arg-type, return-value]
    assert handle_for(suite).style == "async"
    with pytest.raises(EnvironmentLoadError, match="returned dict, not"):
        handle_for({})


class CountingPolicy:
    """Says "done" after ``delay_s``; records how many sessions act at the same time."""

    version = 3

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.acting = 0
        self.most_acting = 0

    def open_session(self, tool_specs: Sequence[ToolSpec]) -> CountingPolicy._Session:
        return CountingPolicy._Session(self)

    class _Session:
        def __init__(self, policy: CountingPolicy) -> None:
            self.policy = policy

        async def act(self, messages: Sequence[Message]) -> PolicyAction:
            self.policy.acting += 1
            self.policy.most_acting = max(self.policy.most_acting, self.policy.acting)
            await asyncio.sleep(self.policy.delay_s)
            self.policy.acting -= 1
            return PolicyAction(text=f"done: {messages[-1]['content']}")

        async def close(self) -> None:
            return None


def test_play_groups_bounds_concurrency_and_keeps_order(env_module: str) -> None:
    handle = load_environment_handle(f"{env_module}:load_environment", {"size": 4})
    items = handle.tasks("train")
    # each action long enough that four sessions are in it together on a busy machine too
    policy = CountingPolicy(delay_s=0.2)
    started = time.perf_counter()
    groups = asyncio.run(
        play_groups(handle, items, group_size=3, policy=policy, limits=EpisodeLimits(), concurrency=4)
    )
    elapsed = time.perf_counter() - started
    assert policy.most_acting == 4
    # 12 episodes of one action each, four at a time: about 3 rounds (0.6 s), not 12 (2.4 s)
    assert elapsed < 6 * 0.2
    assert [len(group) for group in groups] == [3, 3, 3, 3]
    assert [[r.response_text for r in group] for group in groups] == [
        [f"done: task {i}"] * 3 for i in range(4)
    ]
    assert all(r.terminated and r.policy_version == 3 for group in groups for r in group)


def test_one_failing_task_does_not_stop_the_others(env_module: str) -> None:
    handle = load_environment_handle(f"{env_module}:load_environment", {"word": "fail-one"})
    groups = asyncio.run(
        play_groups(handle, handle.tasks("train"), 2, CountingPolicy(0.0), EpisodeLimits(), concurrency=8)
    )
    assert [[r.error is None for r in group] for group in groups] == [
        [True, True],
        [False, False],
        [True, True],
    ]
    assert all(r.truncated for r in groups[0])  # "fail-one" is never said: max_turns


def test_play_groups_refuses_bad_arguments(env_module: str) -> None:
    handle = load_environment_handle(f"{env_module}:load_environment")
    items = handle.tasks("train")
    policy = CountingPolicy(0.0)
    with pytest.raises(ValueError, match="group_size"):
        asyncio.run(play_groups(handle, items, 0, policy, EpisodeLimits(), 1))
    with pytest.raises(ValueError, match="concurrency"):
        asyncio.run(play_groups(handle, items, 1, policy, EpisodeLimits(), 0))
    async_handle = handle_from_async([Task("p")], env_factory=lambda task: None)  # type: ignore[arg-type, return-value]
    with pytest.raises(ValueError, match="need a turn limit"):
        asyncio.run(play_groups(async_handle, async_handle.tasks("train"), 1, policy, EpisodeLimits(), 1))
    with pytest.raises(ValueError, match="max_turns must be a positive integer"):
        EpisodeLimits(max_turns=0)


def test_handle_from_async_validates_on_the_training_tasks_by_default() -> None:
    handle = handle_from_async([Task("p", id="x")], env_factory=lambda task: None)  # type: ignore[arg-type, return-value]
    assert [i.task_id for i in handle.tasks("validation")] == ["x"]


def test_task_ids_are_content_hashes_stable_across_processes() -> None:
    # Fixed values: a change here would orphan every stored run's task ids.
    assert task_id_for(TaskExample(input="What is 2+2?", output=4)) == "34b4326c2c4d7021"
    assert task_id_for(Task(prompt="What is 2+2?", target=4)) == "e590d16fbec9848c"
    assert task_id_for(TaskExample(input="x", id="mine")) == "mine"
    assert task_id_for(TaskExample(input="x", metadata={"a": 1})) != task_id_for(TaskExample(input="x"))
