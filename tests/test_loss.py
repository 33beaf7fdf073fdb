"""The GRPO loss against hand-computed numbers: each aggregation, clipping, KL, masking."""

from __future__ import annotations

import math
import typing

import pytest
import torch

from rollflow.config.train import TrainConfig
from rollflow.policy.loss import AGGREGATIONS, BatchTotals, LossSettings, LossStats, grpo_loss


def _t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


# Two sequences, ratio 1 everywhere: seq 0 has A=+1 on two action tokens, seq 1 A=-0.5 on one.
LOGP = _t([[-1.0, -2.0, -3.0], [-0.5, -0.7, -0.9]])
MASK = _t([[0, 1, 1], [0, 0, 1]])
ADV = _t([[0.0, 1.0, 1.0], [0.0, 0.0, -0.5]])
TOTALS = BatchTotals(num_sequences=2, num_action_tokens=3, normaliser=4.0)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        # per-sequence means -1 and +0.5, then their mean
        ("grpo", (-1.0 + 0.5) / 2),
        # token sum -1.5 over 2 sequences x normaliser 4
        ("dr_grpo", -1.5 / (2 * 4)),
        # token sum -1.5 over 3 action tokens
        ("dapo", -1.5 / 3),
    ],
)
def test_each_aggregation_matches_hand_computed_value(name: str, expected: float) -> None:
    loss, stats = grpo_loss(LOGP, LOGP.clone(), ADV, MASK, TOTALS, LossSettings(name=name))
    assert loss.item() == pytest.approx(expected)
    assert stats.action_tokens == 3 and stats.clipped_tokens == 0
    assert stats.ratio_mean == pytest.approx(1.0)


def test_clipping_both_sides_pessimistic_min() -> None:
    # ratios 1.5, 0.5, 0.5, 1.5 with advantages +1, +1, -1, -1; eps 0.2 low, 0.28 high.
    sampler = torch.zeros(1, 4, dtype=torch.float64)
    logp = torch.log(_t([[1.5, 0.5, 0.5, 1.5]])).requires_grad_(True)
    adv = _t([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4, dtype=torch.float64)
    totals = BatchTotals(num_sequences=1, num_action_tokens=4, normaliser=4.0)
    settings = LossSettings(name="dapo", clip_eps_low=0.2, clip_eps_high=0.28)
    loss, stats = grpo_loss(logp, sampler, adv, mask, totals, settings)
    # token losses: -min(1.5, 1.28) = -1.28 (clipped high), -min(0.5, 0.8) = -0.5,
    #               -min(-0.5, -0.8) = 0.8 (clipped low), -min(-1.5, -1.28) = 1.5
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 0.8 + 1.5) / 4)
    assert stats.clipped_tokens == 2 and stats.clip_fraction == pytest.approx(0.5)
    assert stats.ratio_mean == pytest.approx(1.0)
    loss.backward()
    # d(-ratio * A)/d logp = -ratio * A where unclipped, 0 where the clip is active; / 4 tokens
    expected_grad = [0.0, -0.5 / 4, 0.0, 1.5 / 4]
    assert logp.grad is not None
    assert logp.grad[0].tolist() == pytest.approx(expected_grad)


def test_kl_k3_estimator_and_coefficient() -> None:
    logp = torch.log(_t([[0.5, 0.5]]))
    ref = torch.log(_t([[0.25, 0.5]]))
    mask = _t([[1, 1]])
    totals = BatchTotals(num_sequences=1, num_action_tokens=2, normaliser=2.0)
    settings = LossSettings(name="dapo", kl_coef=0.1)
    loss, stats = grpo_loss(logp, logp.clone(), torch.zeros_like(logp), mask, totals, settings, ref)
    k3 = 0.5 - math.log(0.5) - 1.0  # exp(d) - d - 1 with d = log(0.25 / 0.5); 0 for equal ones
    assert stats.kl_mean == pytest.approx(k3 / 2)
    assert loss.item() == pytest.approx(0.1 * k3 / 2)


def test_kl_needs_reference_logprobs() -> None:
    with pytest.raises(ValueError, match="reference logprobs"):
        grpo_loss(LOGP, LOGP, ADV, MASK, TOTALS, LossSettings(kl_coef=0.1))


def test_masked_tokens_get_zero_gradient_even_with_extreme_values() -> None:
    logp = _t([[-50.0, -1.0, -2.0, 0.0]]).requires_grad_(True)
    # garbage where mask is 0: would overflow exp() if it leaked into the ratio
    sampler = _t([[-900.0, -1.2, -2.0, -800.0]])
    adv = _t([[5.0, 1.0, 1.0, 7.0]])
    mask = _t([[0, 1, 1, 0]])
    totals = BatchTotals(num_sequences=1, num_action_tokens=2, normaliser=4.0)
    for name in AGGREGATIONS:
        logp.grad = None
        loss, _ = grpo_loss(logp, sampler, adv, mask, totals, LossSettings(name=name), logp.detach())
        loss.backward()
        assert torch.isfinite(loss)
        assert logp.grad is not None
        assert logp.grad[0, 0].item() == 0.0 and logp.grad[0, 3].item() == 0.0
        assert logp.grad[0, 1].item() != 0.0 and logp.grad[0, 2].item() != 0.0


@pytest.mark.parametrize("name", list(AGGREGATIONS))
def test_micro_batch_losses_sum_to_the_batch_loss(name: str) -> None:
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(5, 7, generator=gen, dtype=torch.float64)
    sampler = logp + 0.3 * torch.randn(5, 7, generator=gen, dtype=torch.float64)
    adv = torch.randn(5, 1, generator=gen, dtype=torch.float64).expand(5, 7)
    mask = (torch.rand(5, 7, generator=gen) > 0.4).to(torch.float64)
    mask[:, 0] = 1.0
    totals = BatchTotals(num_sequences=5, num_action_tokens=int(mask.sum()), normaliser=7.0)
    settings = LossSettings(name=name)
    whole, whole_stats = grpo_loss(logp, sampler, adv, mask, totals, settings)
    parts = [grpo_loss(logp[s], sampler[s], adv[s], mask[s], totals, settings) for s in (slice(0, 2), slice(2, 5))]
    assert sum(p[0].item() for p in parts) == pytest.approx(whole.item(), rel=1e-12)
    combined = parts[0][1] + parts[1][1]
    assert combined.action_tokens == whole_stats.action_tokens
    assert combined.clipped_tokens == whole_stats.clipped_tokens
    assert combined.ratio_mean == pytest.approx(whole_stats.ratio_mean)


def test_grpo_weighs_sequences_equally_dapo_weighs_tokens_equally() -> None:
    # A long positive sequence (4 tokens, A=+1) and a short negative one (1 token, A=-1).
    logp = torch.zeros(2, 4, dtype=torch.float64)
    mask = _t([[1, 1, 1, 1], [1, 0, 0, 0]])
    adv = _t([[1.0] * 4, [-1.0] * 4])
    totals = BatchTotals(num_sequences=2, num_action_tokens=5, normaliser=4.0)
    grpo, _ = grpo_loss(logp, logp, adv, mask, totals, LossSettings(name="grpo"))
    dapo, _ = grpo_loss(logp, logp, adv, mask, totals, LossSettings(name="dapo"))
    assert grpo.item() == pytest.approx(0.0)  # (-1 + 1) / 2
    assert dapo.item() == pytest.approx(-3 / 5)  # (-4 + 1) / 5


def test_shape_mismatch_and_unknown_loss_are_errors() -> None:
    with pytest.raises(AssertionError, match="mask has shape"):
        grpo_loss(LOGP, LOGP, ADV, MASK[:, :2], TOTALS, LossSettings())
    with pytest.raises(ValueError, match="unknown loss 'ppo'"):
        grpo_loss(LOGP, LOGP, ADV, MASK, TOTALS, LossSettings(name="ppo"))  # type: ignore[arg-type]


def test_stats_add_up_and_empty_stats_are_zero() -> None:
    assert LossStats().clip_fraction == 0.0 and LossStats().ratio_mean == 0.0
    total = LossStats(2, 1, 2.0, 0.2) + LossStats(2, 0, 2.2, 0.0)
    assert (total.action_tokens, total.clipped_tokens) == (4, 1)
    assert total.ratio_mean == pytest.approx(1.05) and total.kl_mean == pytest.approx(0.05)


def test_config_loss_names_match_the_aggregation_table() -> None:
    assert set(typing.get_args(typing.get_type_hints(TrainConfig)["loss"])) == set(AGGREGATIONS)
