"""The runner plays the bundled environments with the policy; episodes carry exact tokens.

The fast test uses the tiny model (real tokenizer, random weights) so the whole path is
checked on every run; the slow one plays the tool-use game with the default model,
SmolLM2-135M-Instruct, on CPU.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest

from rollflow.envs.episode import EpisodeRollout
from rollflow.envs.handle import EpisodeLimits
from rollflow.envs.runner import load_environment_handle, play_groups
from rollflow.policy.codec import ChatCodec
from rollflow.policy.models import ModelRef
from rollflow.policy.sampling import SamplingSettings
from rollflow.policy.transformers_backend import TransformersPolicy

GAME = "rollflow.envs.tool_use_game:load_environment"


def play_game(
    policy: TransformersPolicy, tasks: int, group_size: int, max_turns: int
) -> list[EpisodeRollout]:
    handle = load_environment_handle(GAME, {"num_train": tasks, "num_validation": 1})
    items = handle.tasks("train")[:tasks]
    limits = EpisodeLimits(max_turns=max_turns)
    groups = asyncio.run(play_groups(handle, items, group_size, policy, limits, concurrency=8))
    return [rollout for group in groups for rollout in group]


def assert_token_exact(rollout: EpisodeRollout, codec: ChatCodec) -> None:
    """Every action's tokens, logprobs and text agree; the transcript holds the sampled text."""
    assert rollout.error is None, rollout.error
    assert rollout.actions and len(rollout.actions) == rollout.turns
    # the opening may hold a worked example: the policy's turns are the last assistant messages
    assistant_texts = [m["content"] for m in rollout.messages if m["role"] == "assistant"]
    sampled_texts = [codec.action_text(action.token_ids) for action in rollout.actions]
    assert assistant_texts[-len(sampled_texts) :] == sampled_texts
    for action in rollout.actions:
        assert len(action.token_ids) == len(action.logprobs) > 0
        assert all(math.isfinite(lp) and lp <= 0 for lp in action.logprobs)
        assert len(action.prompt_delta_ids) > 0
    assert rollout.actions[0].reset is False


def test_the_runner_plays_the_game_with_the_tiny_model(tiny_model_dir: Path) -> None:
    settings = SamplingSettings(max_completion_tokens=16, max_model_length=4096)
    policy = TransformersPolicy.from_ref(ModelRef(path=str(tiny_model_dir)), settings, version=3)
    rollouts = play_game(policy, tasks=2, group_size=2, max_turns=2)
    assert len(rollouts) == 4 and all(r.policy_version == 3 for r in rollouts)
    for rollout in rollouts:
        assert_token_exact(rollout, policy.codec)
    # every action was sampled in a batch, and episodes shared batches (how many depends on
    # when each episode's hooks, run on worker threads, hand over: not asserted exactly)
    assert sum(policy.stats.batch_sizes) == sum(r.turns for r in rollouts)
    assert len(policy.stats.batch_sizes) < sum(r.turns for r in rollouts)


@pytest.mark.slow
def test_the_runner_plays_the_game_with_the_default_model_on_cpu() -> None:
    settings = SamplingSettings(max_completion_tokens=40, max_model_length=2048, temperature=0.7)
    policy = TransformersPolicy.from_ref(ModelRef(), settings)
    rollouts = play_game(policy, tasks=1, group_size=3, max_turns=2)
    assert len(rollouts) == 3
    for rollout in rollouts:
        assert_token_exact(rollout, policy.codec)
    # the prompt told the model about the tools in its system prompt (SmolLM2 ignores tools=)
    first = rollouts[0].actions[0].prompt_delta_ids
    assert "<tool_call>" in policy.tokenizer.decode(list(first))
