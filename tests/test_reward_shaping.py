"""Reward shaping: one pure function of (ending, environment reward, context length, settings)
and its table of rules, row by row; how an episode's ending is read; the default buffer."""

from __future__ import annotations

import pytest

from rollflow.config.run import parse_config
from rollflow.envs.episode import ActionTokens, EpisodeRollout
from rollflow.envs.handle import EpisodeScore
from rollflow.envs.types import TruncationCause
from rollflow.tasks.shaping import (
    SHAPING_RULES,
    Ending,
    ScoringError,
    ScoringSettings,
    ShapedReward,
    ending_of,
    env_passed,
    shape_reward,
)

SETTINGS = ScoringSettings(failed_parse_reward=-0.1, max_model_length=2048, overlong_buffer_tokens=512)


def test_the_table_has_one_row_per_ending() -> None:
    assert set(SHAPING_RULES) == set(Ending)
    assert [e.value for e in Ending] == [
        "terminated", "env", "max_turns", "context_overflow", "parse_failure", "error",
    ]


@pytest.mark.parametrize(
    ("ending", "env_reward", "context", "expected"),
    [
        (Ending.TERMINATED, 0.7, 2040, ShapedReward(0.7, 0.0, True)),  # long, but no penalty
        (Ending.ENV, 0.3, 2040, ShapedReward(0.3, 0.0, True)),
        (Ending.MAX_TURNS, 0.7, 1500, ShapedReward(0.7, 0.0, True)),  # below L_max - B = 1536
        (Ending.MAX_TURNS, 0.7, 1792, ShapedReward(0.2, -0.5, True)),  # halfway up the ramp
        (Ending.MAX_TURNS, 0.7, 4000, ShapedReward(-0.3, -1.0, True)),  # capped at -f
        (Ending.CONTEXT_OVERFLOW, 0.7, 10, ShapedReward(-0.3, -1.0, True)),  # the budget was spent
        (Ending.PARSE_FAILURE, 0.9, 2040, ShapedReward(-0.1, 0.0, True)),  # the env's reward ignored
        (Ending.ERROR, 0.9, 2040, ShapedReward(0.0, 0.0, False)),  # left out of the baseline
    ],
)
def test_each_row_shapes_as_documented(
    ending: Ending, env_reward: float, context: int, expected: ShapedReward
) -> None:
    shaped = shape_reward(ending, env_reward, context, SETTINGS)
    assert shaped.counted == expected.counted
    assert (shaped.final_reward, shaped.overlong_penalty) == pytest.approx(
        (expected.final_reward, expected.overlong_penalty)
    )


def test_overlong_penalty_factor_scales_it() -> None:
    settings = ScoringSettings(max_model_length=1000, overlong_penalty_factor=0.25)
    assert shape_reward(Ending.CONTEXT_OVERFLOW, 0.0, 0, settings).overlong_penalty == pytest.approx(-0.25)


def test_default_buffer_is_a_fifth_of_the_budget() -> None:
    settings = ScoringSettings.from_config(parse_config({"rollout": {"max_model_length": 4096}}))
    assert settings.buffer_tokens == 4096 // 5
    assert shape_reward(Ending.MAX_TURNS, 0.05, 3276, settings).overlong_penalty == 0.0
    assert shape_reward(Ending.MAX_TURNS, 0.05, 4096 - 100, settings).overlong_penalty == pytest.approx(
        -(4096 - 100 - (4096 - 819)) / 819
    )


def test_a_buffer_wider_than_the_budget_ramps_over_the_budget() -> None:
    settings = ScoringSettings(max_model_length=1000, overlong_buffer_tokens=5000)
    assert settings.buffer_tokens == 1000
    assert shape_reward(Ending.MAX_TURNS, 0.0, 250, settings).overlong_penalty == pytest.approx(-0.25)


@pytest.mark.parametrize(("field", "value"), [("max_model_length", 0), ("overlong_buffer_tokens", 0)])
def test_bad_settings_name_the_field(field: str, value: int) -> None:
    with pytest.raises(ScoringError, match=field):
        ScoringSettings(**{field: value})


def _rollout(cause: TruncationCause | None = None, error: str | None = None) -> EpisodeRollout:
    return EpisodeRollout(
        messages=(), response_text="", turns=1, terminated=cause is None and error is None,
        truncated=cause is not None, truncation_cause=cause, error=error,
    )


SCORED = EpisodeScore(reward=1.0, threshold=1.0)
SCORER_FAILED = EpisodeScore(reward=0.0, threshold=None, error="JSONDecodeError: Expecting value")


@pytest.mark.parametrize(
    ("rollout", "score", "ending"),
    [
        (_rollout(), SCORED, Ending.TERMINATED),
        (_rollout(TruncationCause.ENV), SCORED, Ending.ENV),
        (_rollout(TruncationCause.MAX_TURNS), SCORED, Ending.MAX_TURNS),
        (_rollout(TruncationCause.CONTEXT_OVERFLOW), SCORED, Ending.CONTEXT_OVERFLOW),
        (_rollout(TruncationCause.PARSE_FAILURE), SCORED, Ending.PARSE_FAILURE),
        (_rollout(TruncationCause.PARSE_FAILURE), SCORER_FAILED, Ending.PARSE_FAILURE),  # whatever it said
        (_rollout(), SCORER_FAILED, Ending.ERROR),
        (_rollout(TruncationCause.MAX_TURNS), SCORER_FAILED, Ending.ERROR),
        (_rollout(error="RuntimeError: boom"), SCORED, Ending.ERROR),
    ],
)
def test_ending_of(rollout: EpisodeRollout, score: EpisodeScore, ending: Ending) -> None:
    assert ending_of(rollout, score) == ending


@pytest.mark.parametrize(
    ("ending", "reward", "threshold", "passed"),
    [
        (Ending.MAX_TURNS, 1.0, 1.0, True),  # whatever its overlong penalty
        (Ending.CONTEXT_OVERFLOW, 0.9, 1.0, False),
        (Ending.TERMINATED, 0.1, None, True),  # no threshold: > 0
        (Ending.TERMINATED, 0.0, None, False),
        (Ending.PARSE_FAILURE, 1.0, 1.0, False),  # never
        (Ending.ERROR, 1.0, 1.0, False),  # never
    ],
)
def test_env_passed(ending: Ending, reward: float, threshold: float | None, passed: bool) -> None:
    assert env_passed(ending, EpisodeScore(reward=reward, threshold=threshold)) is passed


def test_context_tokens_restart_at_each_reset() -> None:
    def action(delta: int, sampled: int, reset: bool) -> ActionTokens:
        return ActionTokens(tuple(range(delta)), reset, (5,) * sampled, (-1.0,) * sampled, "stop")

    rollout = EpisodeRollout(
        messages=(), response_text="", turns=4, terminated=True, truncated=False, truncation_cause=None,
        actions=(action(100, 10, False), action(20, 10, False), action(130, 5, True), action(8, 3, False)),
    )
    assert rollout.context_tokens == 130 + 5 + 8 + 3
    assert rollout.total_tokens == 100 + 10 + 20 + 10 + 130 + 5 + 8 + 3
    assert rollout.final_context_actions == rollout.actions[2:]
    assert _rollout().context_tokens == 0  # tokenless (scripted)
