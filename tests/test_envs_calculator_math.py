"""The async calculator_math environment: expert, endings, and a fuzzed calculator tool."""

from __future__ import annotations

import asyncio
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollflow.envs.arithmetic import CalculatorTool, safe_eval
from rollflow.envs.calculator_math import CalculatorMathEnv, expert_policy, generate_tasks, load_environment
from rollflow.envs.handle import EpisodeLimits
from rollflow.envs.protocol import make_tool_call, render_tool_calls
from rollflow.envs.runner import EnvironmentLoadError, handle_from_async, load_environment_handle, play_groups
from rollflow.envs.scripted import ScriptedPolicy, constant_policy
from rollflow.envs.tools import execute_tool_calls
from rollflow.envs.types import Task, TruncationCause

SPEC = "rollflow.envs.calculator_math:load_environment"


def test_the_expert_solves_every_task() -> None:
    handle = load_environment_handle(SPEC)
    assert handle.style == "async"
    items = handle.tasks("train")
    groups = asyncio.run(
        play_groups(handle, items, 2, expert_policy(), EpisodeLimits(max_turns=4), concurrency=32)
    )
    rollouts = [r for group in groups for r in group]
    assert len(rollouts) == 400 and all(r.terminated and r.turns == 2 for r in rollouts)
    scores = [s for item, g in zip(items, groups, strict=True) for s in asyncio.run(handle.score(item, g))]
    assert {s.reward for s in scores} == {1.0}
    assert scores[0].components == {"correct": 1.0, "tool_calls": 1.0, "tool_errors": 0.0}


def test_tasks_are_seeded_integer_questions_split_without_overlap() -> None:
    suite = load_environment(seed=2, num_train=30, num_validation=10)
    assert suite.tasks == load_environment(seed=2, num_train=30, num_validation=10).tasks
    assert {t.id for t in suite.tasks}.isdisjoint({t.id for t in suite.val_tasks})
    for task in list(suite.tasks) + list(suite.val_tasks):
        expression = re.fullmatch(r"What is (.+)\?", task.prompt)
        assert expression is not None and isinstance(task.target, int)
        assert safe_eval(expression.group(1)) == task.target
    assert any("(" in t.prompt for t in generate_tasks(seed=0, count=50))


def _play(policy: ScriptedPolicy, max_turns: int = 5, max_tool_errors: int = 3):
    handle = load_environment_handle(
        SPEC, {"num_train": 1, "num_validation": 0, "max_tool_errors": max_tool_errors}
    )
    item = handle.tasks("train")[0]
    rollout = asyncio.run(handle.play(item, policy, EpisodeLimits(max_turns=max_turns)))
    return rollout, asyncio.run(handle.score(item, [rollout]))[0], item.payload


def test_a_wrong_answer_terminates_with_zero() -> None:
    rollout, score, task = _play(constant_policy("12345678"))
    assert rollout.terminated and rollout.turns == 1
    assert score.reward == 0.0 and score.components["correct"] == 0.0


def test_repeated_tool_errors_truncate_with_cause_env() -> None:
    bad = render_tool_calls([make_tool_call("calculator", {"expression": "2 ^ 3"})])
    rollout, score, _ = _play(constant_policy(bad), max_turns=10, max_tool_errors=2)
    assert rollout.truncation_cause is TruncationCause.ENV and rollout.turns == 2
    assert rollout.messages[3]["content"].startswith(
        "tool_error: calculator failed: ExpressionError: '^' is not a power"
    )
    assert score.components == {"correct": 0.0, "tool_calls": 2.0, "tool_errors": 2.0}


def test_turn_limit_and_parse_failure() -> None:
    call = render_tool_calls([make_tool_call("calculator", {"expression": "1+1"})])
    limited, limited_score, _ = _play(constant_policy(call), max_turns=3)
    assert limited.truncation_cause is TruncationCause.MAX_TURNS and limited.env_reward == 0.0
    assert limited_score.reward == 0.0 and limited_score.components == {}
    broken, _, _ = _play(constant_policy('<tool_call>{"name": "calculator"'))
    assert broken.truncation_cause is TruncationCause.PARSE_FAILURE


def test_step_before_reset_is_an_error_episode() -> None:
    class NoReset(CalculatorMathEnv):
        async def reset(self, task: Task):  # type: ignore[no-untyped-def]
            return []

    handle = handle_from_async(generate_tasks(seed=0, count=1), env_factory=lambda task: NoReset())
    rollout = asyncio.run(
        handle.play(handle.tasks("train")[0], constant_policy("1"), EpisodeLimits(max_turns=1))
    )
    assert rollout.error == "RuntimeError: step() before reset() (in Env.step)"


def test_loader_checks_its_arguments() -> None:
    with pytest.raises(EnvironmentLoadError, match="max_tool_errors must be a positive integer"):
        load_environment_handle(SPEC, {"max_tool_errors": 0})
    with pytest.raises(EnvironmentLoadError, match="num_train must be a positive integer"):
        load_environment_handle(SPEC, {"num_train": 0})


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40) | st.from_regex(r"[0-9+*/%() .-]{1,30}", fullmatch=True))
def test_the_calculator_tool_answers_every_expression_with_a_number_or_a_tool_error(expression: str) -> None:
    [message] = asyncio.run(
        execute_tool_calls(
            {"calculator": CalculatorTool()}, [make_tool_call("calculator", {"expression": expression})]
        )
    )
    content = message["content"]
    assert content.startswith("tool_error: ") or re.fullmatch(r"-?[\d.e+-]+|-?\d+", content), content
