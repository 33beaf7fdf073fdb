"""The sampled distribution: temperature, top-p, greedy, per-request generators, settings."""

from __future__ import annotations

import math

import pytest
import torch

from rollflow.policy.sampling import (
    EpisodeSeeds,
    SamplingSettings,
    draw_tokens,
    request_seed,
    sampling_logprobs,
)


def test_plain_sampling_is_the_model_distribution() -> None:
    logits_BV = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(sampling_logprobs(logits_BV, 1.0, 1.0), torch.log_softmax(logits_BV, -1))
    assert torch.allclose(
        sampling_logprobs(logits_BV, 0.5, 1.0), torch.log_softmax(logits_BV / 0.5, -1)
    )


def test_top_p_keeps_the_smallest_nucleus_and_renormalises() -> None:
    probs_V = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logprobs_V = sampling_logprobs(probs_V.log()[None], 1.0, 0.8)[0]
    # 0.5 + 0.3 reaches 0.8: the rest can never be drawn
    expected_V = torch.tensor([0.0, 0.5 / 0.8, 0.0, 0.3 / 0.8])
    assert torch.allclose(logprobs_V.exp(), expected_V, atol=1e-6)
    assert math.isinf(logprobs_V[0].item()) and math.isinf(logprobs_V[2].item())
    # a tiny top_p still keeps the most likely token
    assert torch.allclose(sampling_logprobs(probs_V.log()[None], 1.0, 1e-6)[0].exp()[1], torch.tensor(1.0))


def test_temperature_zero_is_greedy_with_logprob_zero() -> None:
    logits_BV = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 0.0]])
    logprobs_BV = sampling_logprobs(logits_BV, 0.0, 1.0)
    assert logprobs_BV[0, 1] == 0 and logprobs_BV[1, 0] == 0
    assert torch.isinf(logprobs_BV).sum() == 4
    tokens_B = draw_tokens(logprobs_BV, [torch.Generator().manual_seed(s) for s in (1, 2)])
    assert tokens_B.tolist() == [1, 0]


def test_draws_follow_the_sampled_distribution_and_never_leave_the_nucleus() -> None:
    probs_V = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logprobs_BV = sampling_logprobs(probs_V.log()[None], 1.0, 0.8).expand(4000, -1)
    generator = torch.Generator().manual_seed(7)
    tokens_B = draw_tokens(logprobs_BV, [generator] * 4000)
    counts_V = torch.bincount(tokens_B, minlength=4).float() / 4000
    assert counts_V[0] == 0 and counts_V[2] == 0
    assert abs(counts_V[1].item() - 0.625) < 0.03


def test_each_row_draws_from_its_own_generator() -> None:
    logprobs_BV = torch.log_softmax(torch.zeros(2, 1000), -1)
    alone = draw_tokens(logprobs_BV[:1], [torch.Generator().manual_seed(5)])
    paired = draw_tokens(logprobs_BV, [torch.Generator().manual_seed(9), torch.Generator().manual_seed(5)])
    assert paired[1] == alone[0]


def test_episode_identity_is_the_opening_and_its_occurrence() -> None:
    seeds = EpisodeSeeds()
    assert [seeds.identity("task A")[1] for _ in range(3)] == [0, 1, 2]
    assert seeds.identity("task B")[1] == 0
    assert seeds.identity("task A")[0] != seeds.identity("task B")[0]
    seeds.reset()
    assert seeds.identity("task A") == EpisodeSeeds().identity("task A")


def test_request_seeds_are_stable_and_distinct() -> None:
    assert request_seed(0, 1, 2, 1) == request_seed(0, 1, 2, 1)
    seeds = {request_seed(0, session, turn, 1) for session in range(20) for turn in range(5)}
    assert len(seeds) == 100
    assert request_seed(1, 1, 2, 1) != request_seed(0, 1, 2, 1)
    assert 0 <= request_seed(123, 4) < 2**63


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("max_completion_tokens", 0),
        ("max_model_length", 1),
        ("generation_timeout_s", 0.0),
        ("max_sampling_attempts", 0),
    ],
)
def test_invalid_settings_name_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingSettings(**{field: value})
