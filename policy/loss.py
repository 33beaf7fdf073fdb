"""The GRPO loss on tensors: clipped importance ratio, a table of aggregations, optional KL.

For every action token t of sequence b (``mask_BT == 1``)::

    ratio   = exp(logp - sampler_logp)                      # the sampler is the "old" policy
    surr    = min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)   # PPO, pessimistic
    kl      = exp(ref_logp - logp) - (ref_logp - logp) - 1  # k3 estimator (Schulman), >= 0
    token_loss = -surr + kl_coef * kl

and the token losses become one number by one of the aggregations in ``AGGREGATIONS``:

- ``grpo``: mean over each sequence's action tokens, then mean over sequences (the paper);
- ``dr_grpo``: sum over all action tokens / (sequences * a constant normaliser), Dr. GRPO's
  fix for the length bias of the per-sequence mean;
- ``dapo``: mean over every action token of the batch (DAPO's token-level loss).

Every aggregation divides by **whole-batch** totals (``BatchTotals``) handed in by the
caller, so summing the losses of micro-batches gives exactly the loss of the whole batch:
gradient accumulation does not depend on how the batch was split. The trainer calls
``grpo_loss`` and never knows which aggregation runs.

Simplified against the papers, on purpose:
- The "old" policy is the sampler itself (its logprobs travel with the samples) and there
  is one optimizer step per batch, so there is no separate old-policy forward pass and the
  ratio is 1 at the start of the step unless the sampler and trainer disagree numerically
  (or the samples are off-policy): the clip guards exactly that gap.
- A "sequence" is a training sample: an episode whose template rewrote history is several.
- The advantage is one number per episode, broadcast to its action tokens.
- KL uses the k3 estimator on the sampled tokens only, as GRPO does, not a full-vocabulary KL.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

LossName = Literal["grpo", "dr_grpo", "dapo"]


@dataclass(frozen=True)
class LossSettings:
    name: LossName = "grpo"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    kl_coef: float = 0.0


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

    def __add__(self, other: LossStats) -> LossStats:
        return LossStats(
            self.action_tokens + other.action_tokens,
            self.clipped_tokens + other.clipped_tokens,
            self.ratio_sum + other.ratio_sum,
            self.kl_sum + other.kl_sum,
        )

    @property
    def clip_fraction(self) -> float:
        return self.clipped_tokens / self.action_tokens if self.action_tokens else 0.0

    @property
    def ratio_mean(self) -> float:
        return self.ratio_sum / self.action_tokens if self.action_tokens else 0.0

    @property
    def kl_mean(self) -> float:
        return self.kl_sum / self.action_tokens if self.action_tokens else 0.0


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


def grpo_loss(
    logprobs_BT: torch.Tensor,
    sampler_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    totals: BatchTotals,
    settings: LossSettings,
    ref_logprobs_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """This micro-batch's share of the batch loss (a scalar with a graph) and its stats.

    ``logprobs_BT`` carries the gradient; the others are data. ``mask_BT`` is 1 on the
    sampled action tokens and 0 elsewhere (context, padding): those positions get no
    gradient and no weight. ``ref_logprobs_BT`` is needed exactly when ``kl_coef > 0``.
    """
    shape = logprobs_BT.shape
    for name, t in (("sampler_logprobs", sampler_logprobs_BT), ("advantages", advantages_BT), ("mask", mask_BT)):
        assert t.shape == shape, f"{name} has shape {tuple(t.shape)}, logprobs {tuple(shape)}"
    if settings.name not in AGGREGATIONS:
        raise ValueError(f"unknown loss {settings.name!r}; known: {', '.join(AGGREGATIONS)}")
    if settings.kl_coef > 0 and ref_logprobs_BT is None:
        raise ValueError("kl_coef > 0 needs the reference logprobs (ref_logprobs_BT)")
    active_BT = mask_BT > 0
    mask_BT = active_BT.to(logprobs_BT.dtype)
    # Context and padding positions are zeroed before exp: no overflow, no gradient there.
    log_ratio_BT = torch.where(active_BT, logprobs_BT - sampler_logprobs_BT, 0.0)
    ratio_BT = torch.exp(log_ratio_BT)
    clipped_BT = ratio_BT.clamp(1.0 - settings.clip_eps_low, 1.0 + settings.clip_eps_high)
    surrogate_BT = torch.minimum(ratio_BT * advantages_BT, clipped_BT * advantages_BT)
    token_loss_BT = -surrogate_BT
    kl_BT = torch.zeros_like(logprobs_BT)
    if ref_logprobs_BT is not None:
        ref_minus_BT = torch.where(active_BT, ref_logprobs_BT - logprobs_BT, 0.0)
        kl_BT = torch.exp(ref_minus_BT) - ref_minus_BT - 1.0
        if settings.kl_coef > 0:
            token_loss_BT = token_loss_BT + settings.kl_coef * kl_BT
    loss = AGGREGATIONS[settings.name](token_loss_BT, mask_BT, totals)
    return loss, _stats(ratio_BT, advantages_BT, kl_BT, active_BT, settings)


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
