"""The GRPO loss on tensors: clipped importance ratio, a table of aggregations, optional KL,
and an off-policy correction for samples a stale policy drew.

For every action token t of sequence b (``mask_BT == 1``)::

    ratio   = exp(logp - old_logp)                          # "old": see the corrections below
    surr    = min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)   # PPO, pessimistic
    kl      = exp(ref_logp - logp) - (ref_logp - logp) - 1  # k3 estimator (Schulman), >= 0
    token_loss = -w * surr + kl_coef * kl                   # w: the behaviour weight, detached

and the token losses become one number by one of the aggregations in ``AGGREGATIONS``:

- ``grpo``: mean over each sequence's action tokens, then mean over sequences (the paper);
- ``dr_grpo``: sum over all action tokens / (sequences * a constant normaliser), Dr. GRPO's
  fix for the length bias of the per-sequence mean;
- ``dapo``: mean over every action token of the batch (DAPO's token-level loss).

Every aggregation divides by **whole-batch** totals (``BatchTotals``) handed in by the
caller, so summing the losses of micro-batches gives exactly the loss of the whole batch:
gradient accumulation does not depend on how the batch was split. The trainer calls
``grpo_loss`` and never knows which aggregation runs.

Off-policy correction (``CORRECTIONS``, ``[train].off_policy_correction``): decoupled PPO
(AReaL) with a behaviour-policy weight (verl's rollout correction, SkyRL's
``off_policy_correction``, TRL's vLLM importance sampling). Three policies meet: the sampler
(``sampler_logp``, the behaviour policy, possibly several versions old in async runs), the
trainer at the start of the step (``prox_logp``, the "proximal" policy) and the trainer now
(``logp``). With ``rho = exp(prox_logp - sampler_logp)``:

- ``none``: old_logp = sampler_logp, w = 1: the loss as it was before corrections existed,
  bit for bit. Right for on-policy (lockstep) data, where the clip only absorbs the
  sampler/trainer numerical gap.
- ``tis``: old_logp = prox_logp and w = min(rho, cap) (truncated importance sampling). The
  clip then bounds how far this step moves from the step-start policy, and the weight
  corrects for the sampler being another policy, truncated so a stale token cannot blow up
  the gradient. PPO clipping alone against a stale sampler is what peers saw grow the
  sampler/trainer KL and collapse.
- ``mask``: old_logp = prox_logp and w = 1 if 1/cap <= rho <= cap else 0 (masked importance
  sampling / rejection: tokens the two policies disagree on too much give no gradient).

The default (``RunConfig.off_policy_correction``) is ``tis`` for async runs and ``none`` in
lockstep; the cap defaults to 2.0, verl's ``rollout_is_threshold``. Every correction reports
the mismatch ``exp(d) - d - 1`` with ``d = prox_logp - sampler_logp`` (k3, an estimate of
KL(sampler || trainer at step start) from tokens the sampler drew, as verl's
``rollout_k3_kl``).

Simplified against the papers, on purpose:
- With one optimizer step per batch the "old" policy of ``none`` is the sampler itself (its
  logprobs travel with the samples), and the proximal policy of ``tis``/``mask`` is the
  first forward's logprobs, detached: no extra pass. Only with several minibatches does the
  trainer compute ``prox_logp`` in a separate no-grad pass (``tasks/grpo_update.py``'s
  ``proximal_logprobs``).
- A masked token stays in the denominators (``BatchTotals`` are counted before any forward,
  so micro-batches add up), as in AReaL; verl and SkyRL drop it from the denominator too.
  The difference is a factor of (1 - masked share) on the loss. The KL term is not
  weighted or masked: it regularises towards the reference whoever sampled the token.
- The weights are per token, not per sequence (verl's and TRL's ``sequence`` modes).
- A "sequence" is a training sample: an episode whose template rewrote history is several.
- The advantage is one number per episode, broadcast to its action tokens.
- KL uses the k3 estimator on the sampled tokens only, as GRPO does, not a full-vocabulary KL.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

LossName = Literal["grpo", "dr_grpo", "dapo"]
OffPolicyCorrection = Literal["none", "tis", "mask"]

# exp() of a log ratio is taken no further than this (e^20 ~ 5e8), as verl and SkyRL bound it:
# a token the sampler drew at a logprob the trainer finds absurd must not overflow a statistic.
_MAX_LOG_RATIO = 20.0


@dataclass(frozen=True)
class LossSettings:
    name: LossName = "grpo"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    kl_coef: float = 0.0
    off_policy_correction: OffPolicyCorrection = "none"
    off_policy_cap: float = 2.0  # tis: the truncation; mask: the band [1/cap, cap]


@dataclass(frozen=True)
class BatchTotals:
    """Whole-batch counts every micro-batch divides by (the same for all of them)."""

    num_sequences: int  # samples with at least one action token
    num_action_tokens: int
    normaliser: float  # dr_grpo's constant: the longest a sample may be (max_model_length)

    def __post_init__(self) -> None:
        assert self.num_sequences > 0 and self.num_action_tokens > 0, (
            f"an empty batch has no loss: {self.num_sequences} sequences, "
            f"{self.num_action_tokens} action tokens"
        )
        assert self.normaliser > 0, f"normaliser must be positive, got {self.normaliser}"


@dataclass(frozen=True)
class LossStats:
    """Sums over action tokens, so the stats of micro-batches add up (``+``)."""

    action_tokens: int = 0
    clipped_tokens: int = 0
    ratio_sum: float = 0.0
    kl_sum: float = 0.0
    mismatch_kl_sum: float = 0.0  # k3 of prox_logp - sampler_logp
    is_weight_sum: float = 0.0  # the behaviour weight w applied (1 under "none")
    corrected_tokens: int = 0  # truncated (tis) or masked (mask)

    def __add__(self, other: LossStats) -> LossStats:
        return LossStats(
            self.action_tokens + other.action_tokens,
            self.clipped_tokens + other.clipped_tokens,
            self.ratio_sum + other.ratio_sum,
            self.kl_sum + other.kl_sum,
            self.mismatch_kl_sum + other.mismatch_kl_sum,
            self.is_weight_sum + other.is_weight_sum,
            self.corrected_tokens + other.corrected_tokens,
        )

    def _mean(self, total: float) -> float:
        return total / self.action_tokens if self.action_tokens else 0.0

    @property
    def clip_fraction(self) -> float:
        return self._mean(self.clipped_tokens)

    @property
    def ratio_mean(self) -> float:
        return self._mean(self.ratio_sum)

    @property
    def kl_mean(self) -> float:
        return self._mean(self.kl_sum)

    @property
    def mismatch_kl_mean(self) -> float:
        return self._mean(self.mismatch_kl_sum)

    @property
    def is_weight_mean(self) -> float:
        return self._mean(self.is_weight_sum)

    @property
    def corrected_fraction(self) -> float:
        return self._mean(self.corrected_tokens)


Aggregation = Callable[[torch.Tensor, torch.Tensor, BatchTotals], torch.Tensor]


def aggregate_grpo(token_loss_BT: torch.Tensor, mask_BT: torch.Tensor, totals: BatchTotals) -> torch.Tensor:
    tokens_B = mask_BT.sum(dim=-1)
    per_sequence_B = (token_loss_BT * mask_BT).sum(dim=-1) / tokens_B.clamp(min=1)
    return per_sequence_B.sum() / totals.num_sequences


def aggregate_dr_grpo(token_loss_BT: torch.Tensor, mask_BT: torch.Tensor, totals: BatchTotals) -> torch.Tensor:
    return (token_loss_BT * mask_BT).sum() / (totals.num_sequences * totals.normaliser)


def aggregate_dapo(token_loss_BT: torch.Tensor, mask_BT: torch.Tensor, totals: BatchTotals) -> torch.Tensor:
    return (token_loss_BT * mask_BT).sum() / totals.num_action_tokens


AGGREGATIONS: dict[str, Aggregation] = {
    "grpo": aggregate_grpo,
    "dr_grpo": aggregate_dr_grpo,
    "dapo": aggregate_dapo,
}


# ---------------------------------------------------------------- off-policy corrections

# (log rho_BT = prox - sampler, 0 off the action tokens; cap) -> (weight_BT or None, corrected_BT)
BehaviourWeight = Callable[[torch.Tensor, float], tuple[torch.Tensor | None, torch.Tensor]]


def no_weight(log_rho_BT: torch.Tensor, cap: float) -> tuple[torch.Tensor | None, torch.Tensor]:
    return None, torch.zeros_like(log_rho_BT, dtype=torch.bool)


def truncated_weight(log_rho_BT: torch.Tensor, cap: float) -> tuple[torch.Tensor | None, torch.Tensor]:
    """w = min(rho, cap), computed as exp(min(log rho, log cap)): no overflow."""
    log_cap = math.log(cap)
    return torch.exp(log_rho_BT.clamp(max=log_cap)), log_rho_BT > log_cap


def masked_weight(log_rho_BT: torch.Tensor, cap: float) -> tuple[torch.Tensor | None, torch.Tensor]:
    """w = 1 where 1/cap <= rho <= cap, else 0 (|log rho| <= log cap)."""
    outside_BT = log_rho_BT.abs() > math.log(cap)
    return (~outside_BT).to(log_rho_BT.dtype), outside_BT


@dataclass(frozen=True)
class Correction:
    weight: BehaviourWeight
    proximal_ratio: bool  # the PPO ratio is taken against prox_logp (else against the sampler)


CORRECTIONS: dict[str, Correction] = {
    "none": Correction(no_weight, proximal_ratio=False),
    "tis": Correction(truncated_weight, proximal_ratio=True),
    "mask": Correction(masked_weight, proximal_ratio=True),
}


def mismatch_k3(log_rho_BT: torch.Tensor) -> torch.Tensor:
    """exp(d) - d - 1 per token, d = prox - sampler: estimates KL(sampler || prox), >= 0."""
    d_BT = log_rho_BT.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.exp(d_BT) - d_BT - 1.0


# ---------------------------------------------------------------- the loss


def grpo_loss(
    logprobs_BT: torch.Tensor,
    sampler_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    totals: BatchTotals,
    settings: LossSettings,
    ref_logprobs_BT: torch.Tensor | None = None,
    prox_logprobs_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """This micro-batch's share of the batch loss (a scalar with a graph) and its stats.

    ``logprobs_BT`` carries the gradient; the others are data. ``mask_BT`` is 1 on the
    sampled action tokens and 0 elsewhere (context, padding): those positions get no
    gradient and no weight. ``ref_logprobs_BT`` is needed exactly when ``kl_coef > 0``.
    ``prox_logprobs_BT`` is the trainer's policy at the start of the optimizer step; None
    means ``logprobs_BT`` is that policy (the step's first forward), used detached.
    """
    shape = logprobs_BT.shape
    for name, t in (("sampler_logprobs", sampler_logprobs_BT), ("advantages", advantages_BT),
                    ("mask", mask_BT), ("prox_logprobs", prox_logprobs_BT)):
        assert t is None or t.shape == shape, f"{name} has shape {tuple(t.shape)}, logprobs {tuple(shape)}"
    _check_settings(settings, ref_logprobs_BT)
    correction = CORRECTIONS[settings.off_policy_correction]
    active_BT = mask_BT > 0
    mask_BT = active_BT.to(logprobs_BT.dtype)
    prox_BT = (logprobs_BT if prox_logprobs_BT is None else prox_logprobs_BT).detach()
    log_rho_BT = torch.where(active_BT, prox_BT - sampler_logprobs_BT, 0.0)  # behaviour, no grad
    old_BT = prox_BT if correction.proximal_ratio else sampler_logprobs_BT
    # Context and padding positions are zeroed before exp: no overflow, no gradient there.
    log_ratio_BT = torch.where(active_BT, logprobs_BT - old_BT, 0.0)
    ratio_BT = torch.exp(log_ratio_BT)
    clipped_BT = ratio_BT.clamp(1.0 - settings.clip_eps_low, 1.0 + settings.clip_eps_high)
    surrogate_BT = torch.minimum(ratio_BT * advantages_BT, clipped_BT * advantages_BT)
    weight_BT, corrected_BT = correction.weight(log_rho_BT, settings.off_policy_cap)
    if weight_BT is not None:
        surrogate_BT = surrogate_BT * weight_BT
    token_loss_BT = -surrogate_BT
    kl_BT = torch.zeros_like(logprobs_BT)
    if ref_logprobs_BT is not None:
        ref_minus_BT = torch.where(active_BT, ref_logprobs_BT - logprobs_BT, 0.0)
        kl_BT = torch.exp(ref_minus_BT) - ref_minus_BT - 1.0
        if settings.kl_coef > 0:
            token_loss_BT = token_loss_BT + settings.kl_coef * kl_BT
    loss = AGGREGATIONS[settings.name](token_loss_BT, mask_BT, totals)
    stats = _stats(ratio_BT, advantages_BT, kl_BT, active_BT, settings)
    return loss, stats + _correction_stats(log_rho_BT, weight_BT, corrected_BT, active_BT)


def _check_settings(settings: LossSettings, ref_logprobs_BT: torch.Tensor | None) -> None:
    if settings.name not in AGGREGATIONS:
        raise ValueError(f"unknown loss {settings.name!r}; known: {', '.join(AGGREGATIONS)}")
    if settings.off_policy_correction not in CORRECTIONS:
        raise ValueError(
            f"unknown off-policy correction {settings.off_policy_correction!r}; known: {', '.join(CORRECTIONS)}"
        )
    if settings.off_policy_cap <= 1.0:
        raise ValueError(f"off_policy_cap must be above 1, got {settings.off_policy_cap}")
    if settings.kl_coef > 0 and ref_logprobs_BT is None:
        raise ValueError("kl_coef > 0 needs the reference logprobs (ref_logprobs_BT)")


def _stats(
    ratio_BT: torch.Tensor, advantages_BT: torch.Tensor, kl_BT: torch.Tensor,
    active_BT: torch.Tensor, settings: LossSettings,
) -> LossStats:
    with torch.no_grad():
        # Clipping is active where the clipped branch wins the min and cuts the gradient.
        high_BT = (ratio_BT > 1.0 + settings.clip_eps_high) & (advantages_BT > 0)
        low_BT = (ratio_BT < 1.0 - settings.clip_eps_low) & (advantages_BT < 0)
        clipped = int(((high_BT | low_BT) & active_BT).sum())
        return LossStats(
            action_tokens=int(active_BT.sum()),
            clipped_tokens=clipped,
            ratio_sum=float(ratio_BT[active_BT].sum()),
            kl_sum=float(kl_BT[active_BT].sum()),
        )


def _correction_stats(
    log_rho_BT: torch.Tensor, weight_BT: torch.Tensor | None, corrected_BT: torch.Tensor,
    active_BT: torch.Tensor,
) -> LossStats:
    """The mismatch and weight sums (``action_tokens`` 0: ``_stats`` counts the tokens)."""
    with torch.no_grad():
        weight_sum = float(weight_BT[active_BT].sum()) if weight_BT is not None else float(active_BT.sum())
        return LossStats(
            mismatch_kl_sum=float(mismatch_k3(log_rho_BT)[active_BT].sum()),
            is_weight_sum=weight_sum,
            corrected_tokens=int((corrected_BT & active_BT).sum()),
        )
