"""The guess_number starter game: binary search solves it; every ending is scored."""

from __future__ import annotations

import asyncio
import math

import pytest

from rollflow.envs.guess_number import HIGHER, LOWER, binary_search_policy, load_environment
from rollflow.envs.handle import EpisodeLimits
from rollflow.envs.runner import EnvironmentLoadError, load_environment_handle, play_groups
from rollflow.envs.scripted import ScriptedPolicy, constant_policy
from rollflow.envs.types import TruncationCause

SPEC = "rollflow.envs.guess_number:load_environment"


def test_binary_search_solves_every_task_within_log2_guesses() -> None:
    handle = load_environment_handle(SPEC)
    items = handle.tasks("train")
    groups = asyncio.run(
        play_groups(handle, items, 1, binary_search_policy(), EpisodeLimits(), concurrency=16)
    )
    rollouts = [group[0] for group in groups]
    assert len(rollouts) == 200 and all(r.terminated for r in rollouts)
    assert max(r.turns for r in rollouts) <= math.ceil(math.log2(100))
    scores = [s for item, g in zip(items, groups, strict=True) for s in asyncio.run(handle.score(item, g))]
    assert all(s.components["solved"] == 1.0 and s.reward >= 0.5 for s in scores)
    for rollout, score in zip(rollouts, scores, strict=True):
        assert score.components["guesses"] == rollout.turns
        assert score.reward == pytest.approx(0.5 + 0.5 * (1 - (rollout.turns - 1) / 8))


def test_replies_say_higher_or_lower_and_prompt_again_on_no_number() -> None:
    env = load_environment(num_train=1, num_validation=0)
    example = env.examples("train")[0]
    secret = int(example.output)
    below = env.step_episode(example, [], str(secret - 1))
    above = env.step_episode(example, [], f"maybe {secret + 1}")
    nothing = env.step_episode(example, [], "hmm")
    hit = env.step_episode(example, [], f"Is it {secret}?")
    assert below.messages[0]["content"] == HIGHER and not below.done
    assert above.messages[0]["content"] == LOWER
    assert "one whole number between 1 and 100" in nothing.messages[0]["content"]
    assert hit.done and hit.final_response_text == str(secret) and hit.metadata == {"guess": secret}


def test_a_first_guess_hit_scores_one_and_running_out_scores_zero() -> None:
    handle = load_environment_handle(SPEC, {"num_train": 1, "num_validation": 0, "max_turns": 3})
    item = handle.tasks("train")[0]
    secret = int(item.payload.output)  # type: ignore[union-attr]
    wrong = str(secret + 1 if secret < 100 else secret - 1)
    rollouts = [
        asyncio.run(handle.play(item, constant_policy(str(secret)), EpisodeLimits())),
        asyncio.run(handle.play(item, constant_policy(wrong), EpisodeLimits())),
        asyncio.run(
            handle.play(item, constant_policy("<tool_call>"), EpisodeLimits())
        ),  # free text, not a parse failure
    ]
    assert rollouts[0].terminated and rollouts[0].turns == 1
    assert [r.truncation_cause for r in rollouts[1:]] == [TruncationCause.MAX_TURNS] * 2
    scores = asyncio.run(handle.score(item, rollouts))
    assert scores[0].reward == 1.0 and scores[0].components["efficiency"] == 1.0
    assert [s.reward for s in scores[1:]] == [0.0, 0.0]
    assert scores[1].components == {"solved": 0.0, "guesses": 3.0, "efficiency": 0.0}


def test_a_raising_policy_is_an_error_episode() -> None:
    handle = load_environment_handle(SPEC, {"num_train": 1, "num_validation": 0})
    rollout = asyncio.run(
        handle.play(handle.tasks("train")[0], ScriptedPolicy(lambda m, t: {}[t]), EpisodeLimits())
    )  # type: ignore[arg-type, return-value]
    assert rollout.error == "KeyError: 0 (in PolicySession.act)"


def test_generation_is_seeded_and_arguments_are_checked() -> None:
    first = load_environment(seed=5).examples("validation")
    assert first == load_environment(seed=5).examples("validation") and len(first) == 50
    assert all(1 <= int(e.output) <= 100 for e in first)
    with pytest.raises(EnvironmentLoadError, match="low < high"):
        load_environment_handle(SPEC, {"low": 5, "high": 5})
    with pytest.raises(EnvironmentLoadError, match="num_validation must be"):
        load_environment_handle(SPEC, {"num_validation": -2})
