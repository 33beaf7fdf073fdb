"""The bundled tool-use game: generated tasks, tools, reward components, expert, endings."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from rollflow.envs.handle import EpisodeLimits
from rollflow.envs.protocol import describe_tools, make_tool_call, render_tool_calls
from rollflow.envs.runner import EnvironmentLoadError, load_environment_handle, play_groups
from rollflow.envs.scripted import ScriptedPolicy, constant_policy
from rollflow.envs.tool_use_game import (
    WEIGHTS,
    WORKED_EXAMPLE,
    ToolUseGame,
    expert_policy,
    expert_transcript,
    game_task,
    generate_examples,
    load_environment,
    score_game,
)
from rollflow.envs.tools import is_tool_error
from rollflow.envs.types import TaskExample, TruncationCause

SPEC = "rollflow.envs.tool_use_game:load_environment"


def test_generation_is_deterministic_with_unique_questions_across_splits() -> None:
    train, validation = generate_examples(seed=0, num_train=200, num_validation=50)
    again_train, _ = generate_examples(seed=0, num_train=200, num_validation=50)
    other_train, _ = generate_examples(seed=1, num_train=200, num_validation=50)
    assert train == again_train and train != other_train
    questions = [e.input for e in train + validation]
    assert len(questions) == 250 == len(set(questions))
    assert WORKED_EXAMPLE.question not in questions
    assert len({e.id for e in train + validation}) == 250


def test_every_task_needs_one_to_three_lookups_and_its_answer_follows_from_the_facts() -> None:
    train, validation = generate_examples(seed=3, num_train=150, num_validation=0)
    assert validation == []
    lookups = set()
    for example in train:
        task = game_task(example)
        lookups.add(len(task.needed_keys))
        assert 4 <= len(task.facts) <= 6 and set(task.needed_keys) <= set(task.facts)
        values = [task.facts[key] for key in task.needed_keys]
        expression = task.formula.format(*values)
        assert re.fullmatch(r"[\d +*-]+", expression) and any(op in expression for op in "+-*")
        assert task.answer == eval(expression)  # our own generated digits and operators only
        assert task.answer >= 0
    assert lookups == {1, 2, 3}


def test_generation_refuses_bad_counts() -> None:
    with pytest.raises(ValueError, match="num_train must be a non-negative integer"):
        generate_examples(seed=0, num_train=-1, num_validation=0)
    with pytest.raises(EnvironmentLoadError, match="max_turns must be a positive integer"):
        load_environment_handle(SPEC, {"max_turns": 0})


def test_the_expert_plays_every_training_task_perfectly() -> None:
    handle = load_environment_handle(SPEC)
    items = handle.tasks("train")
    assert len(items) == 200 and len(handle.tasks("validation")) == 50
    policy = expert_policy(item.payload for item in items)  # type: ignore[misc]
    groups = asyncio.run(play_groups(handle, items, 1, policy, EpisodeLimits(), concurrency=32))
    scores = [
        score
        for item, group in zip(items, groups, strict=True)
        for score in asyncio.run(handle.score(item, group))
    ]
    assert all(group[0].terminated and group[0].turns == 4 for group in groups)
    assert {(s.reward, s.error) for s in scores} == {(1.0, None)}
    assert all(
        s.components == {"correct": 1.0, "lookups": 1.0, "calculator": 1.0, "tool_call_ok": 1.0}
        for s in scores
    )
    assert policy.opened_tool_specs[0] == tuple(ToolUseGame.tool_specs(handle.env, items[0].payload))  # type: ignore[attr-defined]


def test_sft_completion_is_the_expert_transcript() -> None:
    env = load_environment(num_train=5, num_validation=0)
    example = env.examples("train")[2]
    completion = env.sft_completion(example)
    assert completion == expert_transcript(game_task(example))
    assert [m["role"] for m in completion if m["role"] == "assistant"] == ["assistant"] * 4
    assert completion[-1] == {"role": "assistant", "content": str(example.output)}
    tool_contents = [m["content"] for m in completion if m["role"] == "tool"]
    facts = example.metadata["facts"]
    assert json.loads(tool_contents[0]) == list(facts)
    assert [int(c) for c in tool_contents[1:-1]] == [facts[k] for k in example.metadata["needed_keys"]]
    assert tool_contents[-1] == str(example.output)


def test_the_prompt_carries_one_worked_example_by_default() -> None:
    example = load_environment(num_train=1, num_validation=0).examples("train")[0]
    with_example = load_environment(num_train=1, num_validation=0).start_episode(example, "")
    without = load_environment(num_train=1, num_validation=0, worked_example=False).start_episode(example, "")
    assert [m["role"] for m in without] == ["system", "user"]
    assert with_example[1] == {"role": "user", "content": WORKED_EXAMPLE.question}
    assert with_example[2:-1] == expert_transcript(WORKED_EXAMPLE)
    assert with_example[-1] == {"role": "user", "content": example.input}


def test_tool_specs_name_the_three_tools_for_the_codec() -> None:
    env = load_environment(num_train=1, num_validation=0)
    specs = env.tool_specs(env.examples("train")[0])
    assert [s["function"]["name"] for s in specs] == ["list_fact_keys", "lookup", "calculator"]
    assert "- lookup: Look up the value of one fact" in describe_tools(specs)


def _one_task_handle():
    handle = load_environment_handle(SPEC, {"num_train": 1, "num_validation": 0, "max_turns": 3})
    item = handle.tasks("train")[0]
    return handle, item, game_task(item.payload)  # type: ignore[arg-type]


def test_bad_tool_calls_become_tool_errors_and_the_episode_goes_on() -> None:
    handle, item, task = _one_task_handle()
    calls = [
        make_tool_call("lookup", {"key": "gold_at_moon"}, 0),
        make_tool_call("lookup", {"name": task.needed_keys[0]}, 1),
        make_tool_call("teleport", {}, 2),
        make_tool_call("calculator", {"expression": "__import__('os')"}, 3),
    ]
    policy = ScriptedPolicy(lambda m, turn: render_tool_calls(calls) if turn == 0 else str(task.answer))
    rollout = asyncio.run(handle.play(item, policy, EpisodeLimits()))
    assert rollout.terminated
    tool_messages = [m for m in rollout.messages[-6:] if m["role"] == "tool"]
    assert len(tool_messages) == 4 and all(is_tool_error(m) for m in tool_messages)
    assert "no fact named 'gold_at_moon'" in tool_messages[0]["content"]
    assert "arguments of lookup do not match its schema" in tool_messages[1]["content"]
    assert "unknown tool 'teleport'" in tool_messages[2]["content"]
    assert "Call is not allowed" in tool_messages[3]["content"]
    assert rollout.step_metadata[0] == {
        "action": "tool_calls",
        "tools": ["lookup", "lookup", "teleport", "calculator"],
        "tool_errors": 4,
    }
    [score] = asyncio.run(handle.score(item, [rollout]))
    assert score.components == {"correct": 1.0, "lookups": 0.0, "calculator": 0.0, "tool_call_ok": 0.0}


def test_endings_of_the_game() -> None:
    handle, item, task = _one_task_handle()
    lookup = render_tool_calls([make_tool_call("lookup", {"key": task.needed_keys[0]})])
    policies = {
        "max_turns": constant_policy(lookup),
        "parse_failure": constant_policy('<tool_call>{"name": "lookup", "arguments": "key"}</tool_call>'),
        "terminated": constant_policy(f"The answer is {task.answer}."),
    }
    rollouts = {name: asyncio.run(handle.play(item, p, EpisodeLimits())) for name, p in policies.items()}
    assert (
        rollouts["max_turns"].truncation_cause is TruncationCause.MAX_TURNS
        and rollouts["max_turns"].turns == 3
    )
    assert rollouts["parse_failure"].truncation_cause is TruncationCause.PARSE_FAILURE
    assert rollouts["terminated"].terminated
    scores = asyncio.run(handle.score(item, list(rollouts.values())))
    looked_up_share = 1 / len(task.needed_keys)
    assert scores[0].components == {
        "correct": 0.0,
        "lookups": looked_up_share,
        "calculator": 0.0,
        "tool_call_ok": 1.0,
    }
    assert scores[0].reward == pytest.approx(WEIGHTS["lookups"] * looked_up_share + WEIGHTS["tool_call_ok"])
    assert scores[2].reward == pytest.approx(WEIGHTS["correct"]) and scores[2].threshold == WEIGHTS["correct"]


def test_reward_reads_the_last_number_of_a_final_reply_only() -> None:
    def score(response: str, answer: float = 23) -> float:
        return score_game(["k"], answer, [], response).components["correct"]

    assert score("23") == 1.0
    assert score("I first thought 22, but it is 23.") == 1.0
    assert score("23 or maybe 24") == 0.0
    assert score('<tool_call>{"name": "calculator", "arguments": {"expression": "20+3"}}</tool_call>') == 0.0
    assert score("twenty-three") == 0.0


def test_reward_credits_well_formed_calls_of_the_right_tools() -> None:
    calls = [
        make_tool_call("lookup", {"key": "a"}, 0),
        make_tool_call("lookup", {"key": "zzz"}, 1),
        make_tool_call("calculator", {"expression": "1 +"}, 2),
    ]
    messages = [
        {"role": "assistant", "content": render_tool_calls(calls)},  # no tool_calls key: parsed from text
        {"role": "tool", "content": "tool_error: no fact named 'zzz'", "tool_call_id": "call_1"},
    ]
    result = score_game(["a", "b"], 5, messages, "4")  # type: ignore[arg-type]
    assert result.components == {"correct": 0.0, "lookups": 0.5, "calculator": 0.0, "tool_call_ok": 0.0}
    assert result.score == pytest.approx(0.05)
    good_calculator = [
        {
            "role": "assistant",
            "content": render_tool_calls([make_tool_call("calculator", {"expression": "2+3"})]),
        }
    ]
    assert score_game(["a"], 5, good_calculator, "5").score == pytest.approx(0.85)  # type: ignore[arg-type]
    answered = [*good_calculator, {"role": "tool", "content": "5", "tool_call_id": "call_0"}]
    assert score_game(["a"], 5, answered, "5").score == pytest.approx(0.9)  # type: ignore[arg-type]


def test_protocol_checks_off_sends_unreadable_calls_back_as_a_user_message() -> None:
    class Lenient(ToolUseGame):
        checks_tool_protocol = False

    example = TaskExample(
        input="q", output=1, metadata={"facts": {"a": 1}, "needed_keys": ["a"], "formula": "{0}"}
    )
    result = asyncio.run(Lenient([example], []).step_episode(example, [], "<tool_call>{"))
    assert not result.done and result.messages[0]["role"] == "user"
    assert "could not be read" in result.messages[0]["content"]
