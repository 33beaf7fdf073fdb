"""The off-policy correction of the GRPO loss (none / tis / mask), its statistics, its
config keys and where they land (train.json, the steps view, the logged metrics)."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from test_train import batch, micro_model, on_policy, sample

from rollflow.config.parsing import ConfigError
from rollflow.config.run import parse_config
from rollflow.policy.loss import AGGREGATIONS, BatchTotals, LossSettings, grpo_loss
from rollflow.storage.query import open_run_sql
from rollflow.storage.records import TrainResult
from rollflow.storage.runfolder import RunFolder
from rollflow.storage.schemas import train_result_from_json, train_result_to_json
from rollflow.tasks.grpo_update import UpdateSettings, grpo_update
from rollflow.tasks.metrics import optim_metrics


def _t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def uncorrected_loss(
    logprobs_BT: torch.Tensor, sampler_BT: torch.Tensor, advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor, totals: BatchTotals, settings: LossSettings, ref_BT: torch.Tensor | None,
) -> torch.Tensor:
    """A copy of grpo_loss's formula before off-policy corrections existed."""
    active_BT = mask_BT > 0
    mask_BT = active_BT.to(logprobs_BT.dtype)
    log_ratio_BT = torch.where(active_BT, logprobs_BT - sampler_BT, 0.0)
    ratio_BT = torch.exp(log_ratio_BT)
    clipped_BT = ratio_BT.clamp(1.0 - settings.clip_eps_low, 1.0 + settings.clip_eps_high)
    token_loss_BT = -torch.minimum(ratio_BT * advantages_BT, clipped_BT * advantages_BT)
    if ref_BT is not None:
        ref_minus_BT = torch.where(active_BT, ref_BT - logprobs_BT, 0.0)
        kl_BT = torch.exp(ref_minus_BT) - ref_minus_BT - 1.0
        if settings.kl_coef > 0:
            token_loss_BT = token_loss_BT + settings.kl_coef * kl_BT
    return AGGREGATIONS[settings.name](token_loss_BT, mask_BT, totals)


# ---------------------------------------------------------------- "none": today's loss


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("kl_coef", [0.0, 0.3])
def test_none_is_bit_identical_to_the_uncorrected_loss(name: str, kl_coef: float) -> None:
    generator = torch.Generator().manual_seed(7)
    shape = (5, 11)
    logprobs = (-torch.rand(shape, generator=generator) * 3).requires_grad_(True)
    sampler = logprobs.detach() + 0.4 * torch.randn(shape, generator=generator)  # ratios well past the clip
    advantages = torch.randn(shape, generator=generator)
    mask = (torch.rand(shape, generator=generator) > 0.3).float()
    ref = -torch.rand(shape, generator=generator) * 3
    totals = BatchTotals(5, int(mask.sum()), 16.0)
    settings = LossSettings(name=name, kl_coef=kl_coef, off_policy_correction="none")

    loss, _ = grpo_loss(logprobs, sampler, advantages, mask, totals, settings, ref)
    (grad,) = torch.autograd.grad(loss, logprobs)
    old = uncorrected_loss(logprobs, sampler, advantages, mask, totals, settings, ref)
    (old_grad,) = torch.autograd.grad(old, logprobs)
    assert torch.equal(loss, old) and torch.equal(grad, old_grad)
    # A proximal policy handed in changes nothing under "none" either (only the statistics).
    prox = logprobs.detach() - 0.2
    again, _ = grpo_loss(logprobs, sampler, advantages, mask, totals, settings, ref, prox)
    assert torch.equal(again, old)


# ---------------------------------------------------------------- tis and mask by hand

# One sequence, five tokens: context, then actions with rho = prox / sampler of
# 4 (trainer far likelier: above the cap), 0.25 (sampler far likelier: below 1/cap), 1.5, 1.
PROX = torch.log(_t([[0.5, 0.8, 0.1, 0.3, 0.4]]))
SAMPLER = torch.log(_t([[0.01, 0.2, 0.4, 0.2, 0.4]]))  # the context entry is garbage: never read
MASK = _t([[0, 1, 1, 1, 1]])
ADV = _t([[0.0, 1.0, 1.0, 1.0, 1.0]])
TOTALS = BatchTotals(num_sequences=1, num_action_tokens=4, normaliser=8.0)


@pytest.mark.parametrize(
    ("correction", "weights", "corrected"),
    [
        ("tis", [2.0, 0.25, 1.5, 1.0], 1),  # 4 truncated to the cap 2; nothing raised from below
        ("mask", [0.0, 0.0, 1.0, 1.0], 2),  # 4 > 2 and 0.25 < 1/2 leave the band [0.5, 2]
    ],
)
def test_behaviour_weights_on_hand_built_tokens(correction: str, weights: list[float], corrected: int) -> None:
    # The step's first forward: logp is the proximal policy (prox None), so every ratio is 1.
    logprobs = PROX.clone().requires_grad_(True)
    settings = LossSettings(name="dapo", off_policy_correction=correction, off_policy_cap=2.0)
    loss, stats = grpo_loss(logprobs, SAMPLER, ADV, MASK, TOTALS, settings)
    assert loss.item() == pytest.approx(-sum(weights) / 4)  # -w * ratio(1) * A(1), over 4 tokens
    assert stats.ratio_mean == 1.0 and stats.clipped_tokens == 0
    assert stats.is_weight_mean == pytest.approx(sum(weights) / 4)
    assert stats.corrected_tokens == corrected and stats.corrected_fraction == corrected / 4
    loss.backward()
    assert logprobs.grad is not None
    # d(-w * exp(logp - sg(logp)) * A)/d logp = -w * A, / 4 tokens; context 0
    assert logprobs.grad[0].tolist() == pytest.approx([0.0] + [-w / 4 for w in weights])
    if correction == "mask":
        assert logprobs.grad[0, 1].item() == 0.0 and logprobs.grad[0, 2].item() == 0.0  # exactly


def test_proximal_ratio_is_clipped_against_the_step_start_policy_not_the_sampler() -> None:
    # Trainer now vs step start: 1.1 (inside the clip); vs the sampler: 1.1 * 1.5 = 1.65 (outside).
    prox = torch.log(_t([[0.3]]))
    sampler = torch.log(_t([[0.2]]))
    logprobs = (prox + math.log(1.1)).requires_grad_(True)
    one = (_t([[1.0]]), _t([[1.0]]), BatchTotals(1, 1, 1.0))
    tis = LossSettings(name="dapo", off_policy_correction="tis", off_policy_cap=2.0)
    loss, stats = grpo_loss(logprobs, sampler, one[1], one[0], one[2], tis, None, prox)
    assert loss.item() == pytest.approx(-1.5 * 1.1)  # w = rho = 1.5, ratio 1.1 unclipped
    assert stats.ratio_mean == pytest.approx(1.1) and stats.clipped_tokens == 0
    none = dataclasses.replace(tis, off_policy_correction="none")
    loss, stats = grpo_loss(logprobs, sampler, one[1], one[0], one[2], none, None, prox)
    assert loss.item() == pytest.approx(-1.28)  # clipped at 1 + eps_high
    assert stats.ratio_mean == pytest.approx(1.65) and stats.clipped_tokens == 1


def test_an_absurd_sampler_logprob_does_not_overflow_the_weight_or_the_statistics() -> None:
    prox = _t([[-0.1, -0.1]])
    sampler = _t([[-900.0, -0.1]])  # rho = e^900
    settings = LossSettings(name="dapo", off_policy_correction="tis")
    loss, stats = grpo_loss(prox.clone(), sampler, _t([[1.0, 1.0]]), _t([[1, 1]]), BatchTotals(1, 2, 1.0), settings)
    assert loss.item() == pytest.approx(-(2.0 + 1.0) / 2)
    assert math.isfinite(stats.mismatch_kl_sum) and stats.mismatch_kl_sum > 1e8


# ---------------------------------------------------------------- mismatch KL


@pytest.mark.parametrize("correction", ["none", "tis", "mask"])
def test_mismatch_kl_is_zero_when_sampler_and_trainer_agree(correction: str) -> None:
    settings = LossSettings(name="grpo", off_policy_correction=correction)
    loss, stats = grpo_loss(PROX.clone(), PROX.clone(), ADV, MASK, TOTALS, settings)
    assert stats.mismatch_kl_sum == 0.0 and stats.mismatch_kl_mean == 0.0
    assert stats.is_weight_mean == 1.0 and stats.corrected_tokens == 0


@pytest.mark.parametrize("correction", ["none", "tis", "mask"])
def test_mismatch_kl_matches_a_hand_computation(correction: str) -> None:
    settings = LossSettings(name="grpo", off_policy_correction=correction)
    _, stats = grpo_loss(PROX.clone(), SAMPLER, ADV, MASK, TOTALS, settings)
    # k3 = rho - log(rho) - 1 for rho = 4, 0.25, 1.5, 1 (the context token does not count)
    k3 = [rho - math.log(rho) - 1.0 for rho in (4.0, 0.25, 1.5, 1.0)]
    assert stats.mismatch_kl_mean == pytest.approx(sum(k3) / 4)
    assert stats.action_tokens == 4


def test_statistics_of_micro_batches_add_up() -> None:
    settings = LossSettings(name="dapo", off_policy_correction="mask")
    _, whole = grpo_loss(PROX.clone(), SAMPLER, ADV, MASK, TOTALS, settings)
    left = [slice(0, 3), slice(3, 5)]
    parts = [grpo_loss(PROX[:, s].clone(), SAMPLER[:, s], ADV[:, s], MASK[:, s], TOTALS, settings)[1]
             for s in left]
    summed = parts[0] + parts[1]
    assert summed.action_tokens == whole.action_tokens == 4
    assert summed.corrected_tokens == whole.corrected_tokens == 2
    assert summed.mismatch_kl_sum == pytest.approx(whole.mismatch_kl_sum)
    assert summed.is_weight_sum == whole.is_weight_sum == 2.0


def test_cap_and_name_are_checked_by_the_loss_too() -> None:
    with pytest.raises(ValueError, match="off_policy_cap"):
        grpo_loss(PROX, SAMPLER, ADV, MASK, TOTALS, LossSettings(off_policy_correction="tis", off_policy_cap=1.0))
    unknown: Any = "clip"  # what an untyped caller could pass
    with pytest.raises(ValueError, match="unknown off-policy correction 'clip'"):
        grpo_loss(PROX, SAMPLER, ADV, MASK, TOTALS, LossSettings(off_policy_correction=unknown))


# ---------------------------------------------------------------- through the trainer


def count_forwards(model: torch.nn.Module) -> list[int]:
    calls = [0]
    model.register_forward_pre_hook(lambda module, args: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_minibatches_take_the_ratio_and_weight_against_the_step_start_policy() -> None:
    """On-policy samples, two minibatches: the second one's trainer has moved, but under
    tis its proximal policy is the step start, which sampled the batch: mismatch ~0 and
    weight 1. Under "none" the second minibatch measures against the moved policy."""
    base = micro_model()
    samples = batch(base)
    results = {}
    for correction in ("tis", "none"):
        model = copy.deepcopy(base)
        forwards = count_forwards(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        settings = UpdateSettings(loss=LossSettings(off_policy_correction=correction), normaliser=16.0, minibatches=2)
        results[correction] = (grpo_update(model, None, optimizer, samples, settings), forwards[0])
    tis, tis_forwards = results["tis"]
    none, none_forwards = results["none"]
    assert tis.num_microbatches == none.num_microbatches == 2
    assert (tis_forwards, none_forwards) == (4, 2)  # one no-grad proximal pass per micro-batch
    assert tis.mismatch_kl is not None and tis.mismatch_kl < 1e-10
    assert tis.is_weight_mean == pytest.approx(1.0, abs=1e-6) and tis.corrected_fraction == 0.0
    assert none.mismatch_kl is not None and none.mismatch_kl > 1e-4  # the moved policy's gap
    assert none.is_weight_mean is None and none.corrected_fraction is None
    assert tis.ratio_mean != pytest.approx(1.0, abs=1e-6)  # the second step did move


@pytest.mark.slow  # 3 s in a loaded suite run (docs/testing.md)
def test_one_minibatch_needs_no_extra_pass_and_matches_none_on_policy() -> None:
    base = micro_model()
    samples = batch(base)
    weights = {}
    for correction in ("tis", "mask", "none"):
        model = copy.deepcopy(base)
        forwards = count_forwards(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        settings = UpdateSettings(loss=LossSettings(off_policy_correction=correction), normaliser=16.0)
        stats = grpo_update(model, None, optimizer, samples, settings)
        assert forwards[0] == stats.num_microbatches == 1
        assert stats.mismatch_kl is not None and stats.mismatch_kl < 1e-10  # the sampler is this model
        weights[correction] = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert torch.allclose(weights["tis"], weights["none"], atol=1e-6)
    assert torch.allclose(weights["mask"], weights["none"], atol=1e-6)


def test_stale_tokens_are_masked_through_the_trainer() -> None:
    """A sample whose sampler logprobs are far above the trainer's gets no gradient under mask."""
    base = micro_model()
    fresh = on_policy(base, sample("f#0", [1, 5, 6, 7], [0, 1, 1, 1], 1.0))
    stale = dataclasses.replace(
        on_policy(base, sample("s#0", [1, 8, 9, 10], [0, 1, 1, 1], 1.0)),
        sampler_logprobs=(0.0, -0.01, -0.01, -0.01),  # the sampler was sure of every token
    )
    alone = copy.deepcopy(base)
    grpo_update(alone, None, torch.optim.SGD(alone.parameters(), lr=0.5), [fresh],
                UpdateSettings(loss=LossSettings(name="dr_grpo", off_policy_correction="mask"), normaliser=16.0))
    both = copy.deepcopy(base)
    stats = grpo_update(both, None, torch.optim.SGD(both.parameters(), lr=0.5), [fresh, stale],
                        UpdateSettings(loss=LossSettings(name="dr_grpo", off_policy_correction="mask"), normaliser=16.0))
    assert stats.corrected_fraction == 0.5 and stats.is_weight_mean == 0.5
    assert stats.mismatch_kl is not None and stats.mismatch_kl > 1.0
    # dr_grpo divides by sequences x normaliser: 2 sequences here, 1 alone, so the masked
    # sample halves the fresh one's step and adds nothing of its own.
    for (name, p_alone), p_both in zip(alone.named_parameters(), both.parameters(), strict=True):
        p_base = dict(base.named_parameters())[name]
        assert torch.allclose(p_both - p_base, (p_alone - p_base) / 2, atol=1e-7), name


# ---------------------------------------------------------------- config


def test_default_correction_is_tis_when_async_and_none_in_lockstep() -> None:
    assert parse_config({}).off_policy_correction == "none"
    assert parse_config({"rollout": {"max_steps_off_policy": 1}}).off_policy_correction == "tis"
    assert parse_config({"rollout": {"max_steps_off_policy": 0}}).off_policy_correction == "tis"
    chosen = parse_config({"rollout": {"max_steps_off_policy": 2}, "train": {"off_policy_correction": "none"}})
    assert chosen.off_policy_correction == "none"
    assert parse_config({"train": {"off_policy_correction": "mask"}}).off_policy_correction == "mask"
    config = parse_config({"rollout": {"max_steps_off_policy": 1}, "train": {"off_policy_cap": 3}})
    loss = UpdateSettings.from_config(config, pad_token_id=0).loss
    assert (loss.off_policy_correction, loss.off_policy_cap) == ("tis", 3.0)
    assert UpdateSettings.from_config(parse_config({}), pad_token_id=0).loss.off_policy_correction == "none"


def test_unknown_correction_and_a_cap_not_above_one_are_config_errors() -> None:
    allowed = r"\[train\]\.off_policy_correction must be one of 'none', 'tis', 'mask'; got 'clip'"
    with pytest.raises(ConfigError, match=allowed):
        parse_config({"train": {"off_policy_correction": "clip"}})
    for cap in (1.0, 0.5, -2):
        with pytest.raises(ConfigError, match=r"\[train\]\.off_policy_cap must be in \(1\.0, inf\)"):
            parse_config({"train": {"off_policy_cap": cap}})
    with pytest.raises(ConfigError, match=r"\[train\]\.off_policy_cap must be a number"):
        parse_config({"train": {"off_policy_cap": "2"}})


# ---------------------------------------------------------------- train.json, the steps view, metrics


def result(**extra: float | None) -> TrainResult:
    return TrainResult("run-a", 0, 1, 0.25, None, 0.1, 2.0, 2, 40, 4, 1e-5, 5.0, {"fwd": 1.0}, **extra)


def test_an_old_train_json_without_the_off_policy_fields_still_reads(tmp_path: Path) -> None:
    old = train_result_to_json(result())
    for key in ("mismatch_kl", "is_weight_mean", "corrected_fraction"):
        del old[key]
    assert train_result_from_json(old) == result()  # the new fields None
    folder = RunFolder(tmp_path / "run-a")
    folder.write_config("[train]\nnum_steps = 1\n")
    folder.stage_path(0, "train").parent.mkdir(parents=True)
    folder.stage_path(0, "train").write_text(json.dumps(old))
    assert folder.read_train_result(0).mismatch_kl is None
    sql = "SELECT loss, mismatch_kl, corrected_fraction FROM steps"
    row = open_run_sql(folder.root).execute(sql).fetchall()
    assert row == [(0.25, None, None)]


def test_off_policy_fields_round_trip_and_reach_the_steps_view(tmp_path: Path) -> None:
    full = result(mismatch_kl=0.003, is_weight_mean=0.97, corrected_fraction=0.02)
    assert train_result_from_json(json.loads(json.dumps(train_result_to_json(full)))) == full
    folder = RunFolder(tmp_path / "run-a")
    folder.write_config("[train]\nnum_steps = 1\n")
    folder.write_train_result(full)
    row = open_run_sql(folder.root).execute(
        "SELECT mismatch_kl, is_weight_mean, corrected_fraction FROM steps").fetchall()
    assert row == [(0.003, 0.97, 0.02)]


def test_optim_metrics_log_the_off_policy_figures_and_skip_none() -> None:
    """The sampler/trainer mismatch is measured in lockstep runs too (review 2026-12-07,
    note 4): its key names the policy, not the async schedule."""
    metrics = optim_metrics(result(mismatch_kl=0.003, is_weight_mean=0.97, corrected_fraction=0.02))
    assert metrics["policy/mismatch_kl"] == 0.003
    assert metrics["offpolicy/is_weight_mean"] == 0.97
    assert metrics["offpolicy/corrected_fraction"] == 0.02
    lockstep = optim_metrics(result(mismatch_kl=1e-6))
    assert lockstep["policy/mismatch_kl"] == 1e-6
    assert not any(k.startswith(("async/", "offpolicy/")) for k in lockstep)
    assert not any(k.startswith(("async/", "offpolicy/", "policy/mismatch")) for k in optim_metrics(result()))
