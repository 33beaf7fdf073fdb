"""One GRPO update on a batch of samples: packing, log-probabilities, loss, optimizer steps.

``grpo_update`` is the algorithm: it packs samples into micro-batches by a padded-token
budget (right padding; with ``[train].shared_prefix`` a group's episodes together, their
opening prompt computed once: ``tasks/shared_prefix.py``), computes each taken token's
log-probability (no attention mask: right padding under causal attention needs none), hands them to
``rollflow.policy.loss.grpo_loss`` with whole-batch totals (so the summed micro-batch gradients do
not depend on the split), clips the gradient norm and takes one optimizer step.

The log-probabilities come from ``rollflow.tasks.trainer_logprobs`` (``token_logprobs``,
``chosen_logprobs``, ``train_without_dropout``): computed exactly as
the sampler computed its own, so the importance ratio is 1 wherever trainer and sampler agree.

One optimizer step per batch by default; ``[train].minibatches = K`` splits the batch into
K minibatches with a step each (PPO-style: more learning per rolled-out episode, for the
same forward and backward compute). Simplified on purpose: no PPO epochs over the same data,
AdamW with no weight decay and a constant learning rate after an optional linear warm-up
(``warmup_learning_rate``), no sequence packing inside a row.
On CPU with a fixed seed the same inputs give bit-identical weights. ``[train].compute_dtype
= "bfloat16"`` runs the forwards under autocast (``forward_autocast``): about 2x faster.

Off-policy correction (``[train].off_policy_correction``, the formulas in
``rollflow.policy.loss``): async runs train on groups a policy several versions old
sampled, and the PPO clip against that stale sampler alone is what peers found unstable.
``tis`` (the default in async runs and for bfloat16 forwards) takes the PPO ratio against
the trainer's own policy at the start of the step (the proximal policy) and weights each
token by ``min(exp(prox_logp - sampler_logp), off_policy_cap)``; ``mask`` zeroes the tokens
whose ratio leaves ``[1/cap, cap]``; ``none`` (the lockstep default) is the uncorrected
loss. The proximal logprobs cost nothing with one minibatch (the step's forward, detached);
with K > 1 they are one extra no-grad forward over the trained samples before the first
optimizer step, packed as the training forwards are. Every step reports the sampler/trainer
mismatch (k3 of ``prox_logp - sampler_logp``, under ``none`` against the policy at the start
of each optimizer step) over the tokens it forwards: without a KL term a sample whose
advantages are all 0 is not forwarded (``_trained_batches``), so the figure covers only the
groups with reward variance. Under a correction it also reports the mean weight and the
share of tokens truncated or masked.

The train stage (``tasks/train.py``) loads the policy and its KL reference, calls
``grpo_update`` once per step and writes the checkpoint.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from rollflow.config.run import RunConfig
from rollflow.policy.loss import BatchTotals, LossSettings, LossStats, grpo_loss
from rollflow.policy.stopping import raise_if_stop_requested, stop_points_in_backward
from rollflow.storage.records import SampleRecord
from rollflow.tasks.shared_prefix import (
    SharedPrefix,
    first_trained,
    gradient_checkpointed,
    pack_by_prefix,
    plan_prefixes,
)
from rollflow.tasks.trainer_logprobs import forward_autocast, token_logprobs, train_without_dropout

# (input_ids_BT, attention: a mask, None or a SharedPrefix plan, wanted_BT) -> reference
# logprobs of tokens 1..T-1, (B, T-1): the policy's own forward hands its attention on
RefLogprobsFn = Callable[[torch.Tensor, torch.Tensor | SharedPrefix | None, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class UpdateSettings:
    loss: LossSettings = field(default_factory=LossSettings)
    max_tokens_per_microbatch: int = 4096  # padded tokens (rows x longest row) per forward
    max_grad_norm: float = 1.0
    temperature: float = 1.0  # the rollout's sampling temperature
    normaliser: float = 2048.0  # dr_grpo's constant: max_model_length
    pad_token_id: int = 0
    minibatches: int = 1  # optimizer steps per batch
    learning_rate: float = 2e-5  # the warm-up's target (unused without a warm-up)
    lr_warmup_steps: int = 0  # linear warm-up over the run's first N optimizer steps
    # Pass the right padding's attention mask to the model (the path before issue 43). Off:
    # no mask, SDPA's causal kernel; exact, since a real token never attends to a later pad
    # and nothing reads a pad's output (``_model_mask``).
    padding_mask: bool = False
    # Rows of a GRPO group compute their shared opening prompt once (tasks/shared_prefix.py),
    # micro-batches packed so a group travels together; exact within float32 rounding. Off
    # under gradient checkpointing, which drops the prefix's cache.
    shared_prefix: bool = False
    autocast_dtype: torch.dtype | None = None  # bfloat16 forwards ([train].compute_dtype)

    @classmethod
    def from_config(cls, config: RunConfig, pad_token_id: int) -> UpdateSettings:
        train = config.train
        return cls(
            loss=LossSettings(train.loss, train.clip_eps_low, train.clip_eps_high, train.kl_coef,
                              config.off_policy_correction, train.off_policy_cap),
            max_tokens_per_microbatch=train.max_tokens_per_microbatch,
            max_grad_norm=train.max_grad_norm,
            temperature=config.rollout.temperature,
            normaliser=float(config.rollout.max_model_length),
            pad_token_id=pad_token_id,
            minibatches=train.minibatches,
            learning_rate=train.learning_rate,
            lr_warmup_steps=train.lr_warmup_steps,
            shared_prefix=train.shared_prefix and not train.gradient_checkpointing,
            autocast_dtype=torch.bfloat16 if train.compute_dtype == "bfloat16" else None,
        )


@dataclass(frozen=True)
class UpdateStats:
    loss: float
    kl: float | None  # mean k3 KL per action token; None without a reference
    clip_fraction: float
    ratio_mean: float
    grad_norm: float  # before clipping
    num_samples: int
    num_tokens: int
    num_action_tokens: int
    num_microbatches: int
    seconds: float
    mismatch_kl: float | None = None  # mean k3 KL(sampler || trainer at step start) over forwarded tokens; None: none
    is_weight_mean: float | None = None  # mean behaviour weight; None under correction "none"
    corrected_fraction: float | None = None  # share of tokens truncated (tis) or masked (mask)
    learning_rate: float | None = None  # the last optimizer step's (None: no step taken)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else 0.0


# ---------------------------------------------------------------- packing


def pack_microbatches(samples: Sequence[SampleRecord], max_tokens: int) -> list[list[SampleRecord]]:
    """Longest first, greedily, while rows x longest row stays within ``max_tokens``.

    A sample longer than the budget gets a micro-batch of its own. Sorting by length keeps
    padding small; the order does not change the result (the loss is a sum).
    """
    ordered = sorted(samples, key=lambda s: len(s.input_ids), reverse=True)
    batches: list[list[SampleRecord]] = []
    for sample in ordered:
        if batches:
            current = batches[-1]
            longest = len(current[0].input_ids)  # sorted: the first is the longest
            if (len(current) + 1) * longest <= max_tokens:
                current.append(sample)
                continue
        batches.append([sample])
    return batches


def _pad(rows: Sequence[Sequence[float]], width: int, value: float, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([list(r) + [value] * (width - len(r)) for r in rows], dtype=dtype)


def _microbatch_tensors(
    batch: Sequence[SampleRecord], pad_token_id: int, device: torch.device
) -> dict[str, torch.Tensor]:
    width = max(len(s.input_ids) for s in batch)
    tensors = {
        "input_ids": _pad([s.input_ids for s in batch], width, pad_token_id, torch.long),
        "attention_mask": _pad([[1] * len(s.input_ids) for s in batch], width, 0, torch.long),
        "loss_mask": _pad([s.loss_mask for s in batch], width, 0, torch.float32),
        "advantages": _pad([s.advantages for s in batch], width, 0.0, torch.float32),
        "sampler_logprobs": _pad([s.sampler_logprobs for s in batch], width, 0.0, torch.float32),
    }
    return {name: tensor.to(device) for name, tensor in tensors.items()}


def _model_mask(t: Mapping[str, torch.Tensor], settings: UpdateSettings) -> torch.Tensor | None:
    """The attention mask the model is given: None unless ``settings.padding_mask``.

    The rows are right-padded, so under causal attention a real token only ever sees real
    tokens before it and the model can run without a mask (SDPA's ``is_causal`` kernels).
    The pads' own outputs then differ, but nothing reads them: their ``loss_mask`` is 0, so
    their logprobs are never computed (``wanted_BT``) and the loss zeroes them
    (``grpo_loss``'s ``torch.where``).
    """
    return t["attention_mask"] if settings.padding_mask else None


def _attention(
    batch: Sequence[SampleRecord], t: Mapping[str, torch.Tensor], settings: UpdateSettings
) -> torch.Tensor | SharedPrefix | None:
    """What the micro-batch's forwards attend with: each GRPO group's shared prefix
    (``settings.shared_prefix``), else ``_model_mask``."""
    if not settings.shared_prefix:
        return _model_mask(t, settings)
    plan = plan_prefixes([s.input_ids for s in batch], [first_trained(s.loss_mask) for s in batch],
                         [s.group_id for s in batch])
    return dataclasses.replace(plan, padding_mask=settings.padding_mask)


def _has_signal(sample: SampleRecord) -> bool:
    return any(a != 0 for a, m in zip(sample.advantages, sample.loss_mask, strict=True) if m)


def _zero_grads(optimizer: torch.optim.Optimizer) -> None:
    """Zero (not None) gradients: Adam skips a parameter whose grad is None entirely."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = torch.zeros_like(param)


def batch_totals(samples: Sequence[SampleRecord], normaliser: float) -> BatchTotals | None:
    """Whole-batch counts over trainable positions (token 0 has nothing to predict it)."""
    action_counts = [sum(s.loss_mask[1:]) for s in samples]
    if sum(action_counts) == 0:
        return None
    return BatchTotals(
        num_sequences=sum(1 for n in action_counts if n > 0),
        num_action_tokens=sum(action_counts),
        normaliser=normaliser,
    )


def split_minibatches(samples: Sequence[SampleRecord], count: int) -> list[list[SampleRecord]]:
    """``samples`` dealt round-robin into ``count`` minibatches (fewer when there are fewer).

    Samples arrive group by group, so dealing them out gives every minibatch a share of
    every group: its advantages then still compare episodes of one task with each other,
    positive next to negative, rather than one minibatch holding only some tasks.
    """
    count = max(1, min(count, len(samples)))
    return [list(samples[i::count]) for i in range(count)]


def grpo_update(
    model: PreTrainedModel,
    ref_logprobs_fn: RefLogprobsFn | None,
    optimizer: torch.optim.Optimizer,
    samples: Sequence[SampleRecord],
    settings: UpdateSettings,
) -> UpdateStats:
    """``settings.minibatches`` optimizer steps on ``samples``, one per minibatch.

    A minibatch with no action token at all takes no step. With one minibatch (the
    default) this is one step on the whole batch. Later minibatches are scored by a policy
    that earlier ones already moved: the importance ratio against the old policy (the
    sampler, or under an off-policy correction the proximal policy computed here before the
    first step) and its clip are what keep those steps near it, as in PPO.
    """
    start = time.perf_counter()
    num_tokens = sum(len(s.input_ids) for s in samples)
    minibatches = [
        (chunk, totals)
        for chunk in split_minibatches(samples, settings.minibatches)
        if (totals := batch_totals(chunk, settings.normaliser)) is not None
    ]
    if not minibatches:
        return UpdateStats(0.0, None, 0.0, 0.0, 0.0, len(samples), num_tokens, 0, 0,
                           time.perf_counter() - start)
    use_reference = ref_logprobs_fn is not None and settings.loss.kl_coef > 0
    train_without_dropout(model)
    if settings.shared_prefix and gradient_checkpointed(model):  # its layers would drop the prefix
        settings = dataclasses.replace(settings, shared_prefix=False)
    prox: dict[str, torch.Tensor] | None = None
    if settings.loss.off_policy_correction != "none" and len(minibatches) > 1:
        prox = proximal_logprobs(model, [c for c, _ in minibatches], use_reference, settings)
    losses, grad_norms, stats, num_microbatches = [], [], LossStats(), 0
    with stop_points_in_backward(model):  # a stop lands within a layer's backward, not after the pass
        for chunk, totals in minibatches:
            loss, grad_norm, chunk_stats, count = _optimizer_step(
                model, ref_logprobs_fn if use_reference else None, optimizer, chunk, totals, settings, prox
            )
            losses.append(loss)
            grad_norms.append(grad_norm)
            stats = stats + chunk_stats
            num_microbatches += count
    model.eval()
    corrected = settings.loss.off_policy_correction != "none" and stats.action_tokens > 0
    return UpdateStats(
        loss=sum(losses) / len(losses), kl=stats.kl_mean if use_reference else None,
        clip_fraction=stats.clip_fraction, ratio_mean=stats.ratio_mean,
        grad_norm=sum(grad_norms) / len(grad_norms), num_samples=len(samples),
        num_tokens=num_tokens, num_action_tokens=sum(t.num_action_tokens for _, t in minibatches),
        num_microbatches=num_microbatches, seconds=time.perf_counter() - start,
        mismatch_kl=stats.mismatch_kl_mean if stats.action_tokens else None,
        is_weight_mean=stats.is_weight_mean if corrected else None,
        corrected_fraction=stats.corrected_fraction if corrected else None,
        learning_rate=float(optimizer.param_groups[0]["lr"]),
    )


def _trained_batches(
    samples: Sequence[SampleRecord], keep_all: bool, settings: UpdateSettings
) -> list[list[SampleRecord]]:
    """The micro-batches a step forwards: without a KL term (``keep_all`` False) a sample
    whose advantages are all 0 (a zero-variance group) adds exactly 0 to the loss and its
    gradient, so it is left out; the step's totals still count it."""
    trained = samples if keep_all else [s for s in samples if _has_signal(s)]
    if settings.shared_prefix:  # a group's episodes together: they share their opening prompt
        return pack_by_prefix(trained, lambda s: s.input_ids, lambda s: s.loss_mask, lambda s: s.group_id,
                              settings.max_tokens_per_microbatch)
    return pack_microbatches(trained, settings.max_tokens_per_microbatch) if trained else []


def proximal_logprobs(
    model: PreTrainedModel, chunks: Sequence[Sequence[SampleRecord]], keep_all: bool,
    settings: UpdateSettings,
) -> dict[str, torch.Tensor]:
    """The policy's logprobs before any optimizer step, by sample id: (T-1,), 0 on context.

    One no-grad forward over every sample the steps will train, packed exactly as their
    own forwards will be, so the first minibatch's ratio against it starts at 1.
    """
    prox: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for chunk in chunks:
            for batch in _trained_batches(chunk, keep_all, settings):
                raise_if_stop_requested()
                t = _microbatch_tensors(batch, settings.pad_token_id, model.device)
                wanted_BT = t["loss_mask"][:, 1:] > 0
                with forward_autocast(model, settings.autocast_dtype):
                    logprobs_BT = token_logprobs(
                        model, t["input_ids"], _attention(batch, t, settings), settings.temperature, wanted_BT)
                for s, row_T in zip(batch, logprobs_BT, strict=True):
                    if s.sample_id in prox:
                        raise ValueError(f"sample id {s.sample_id!r} appears twice in one training batch")
                    prox[s.sample_id] = row_T[: len(s.input_ids) - 1].clone()
    return prox


def _batch_proximal(
    prox: Mapping[str, torch.Tensor] | None, batch: Sequence[SampleRecord], like_BT: torch.Tensor
) -> torch.Tensor | None:
    """``batch``'s rows of ``prox``, right-padded with 0 to ``like_BT``'s (B, T-1)."""
    if prox is None:
        return None
    out_BT = torch.zeros_like(like_BT)
    for b, s in enumerate(batch):
        row_T = prox[s.sample_id]
        out_BT[b, : row_T.shape[0]] = row_T
    return out_BT


def _optimizer_step(
    model: PreTrainedModel,
    ref_logprobs_fn: RefLogprobsFn | None,
    optimizer: torch.optim.Optimizer,
    samples: Sequence[SampleRecord],
    totals: BatchTotals,
    settings: UpdateSettings,
    prox: Mapping[str, torch.Tensor] | None = None,
) -> tuple[float, float, LossStats, int]:
    """One optimizer step on ``samples``: (loss, grad norm before clipping, stats, micro-batches).

    ``prox``: the step-start policy's logprobs by sample id (None: this step's own forward
    is the proximal policy).
    """
    _zero_grads(optimizer)
    loss_total, stats = 0.0, LossStats()
    # The optimizer steps even when no sample is left to forward (Adam's momentum moves
    # on, as with a zero gradient).
    batches = _trained_batches(samples, ref_logprobs_fn is not None, settings)
    for batch in batches:
        raise_if_stop_requested()  # a stop: abandon the update; nothing of it is written
        t = _microbatch_tensors(batch, settings.pad_token_id, model.device)
        wanted_BT = t["loss_mask"][:, 1:] > 0  # action tokens: the only logprobs the loss reads
        attention = _attention(batch, t, settings)  # None: right padding under causal attention needs no mask
        with forward_autocast(model, settings.autocast_dtype):  # the forwards only: backward follows their dtypes
            logprobs_BT = token_logprobs(model, t["input_ids"], attention, settings.temperature, wanted_BT)
            ref_BT = ref_logprobs_fn(t["input_ids"], attention, wanted_BT) if ref_logprobs_fn else None
        loss, batch_stats = grpo_loss(
            logprobs_BT, t["sampler_logprobs"][:, 1:], t["advantages"][:, 1:],
            t["loss_mask"][:, 1:], totals, settings.loss, ref_BT, _batch_proximal(prox, batch, logprobs_BT),
        )
        loss.backward()  # accumulates: each micro-batch loss is already its share of the total
        loss_total += loss.item()
        stats = stats + batch_stats
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, settings.max_grad_norm)
    if settings.lr_warmup_steps > 0:  # else the optimizer's own rate, untouched
        learning_rate = warmup_learning_rate(
            settings.learning_rate, settings.lr_warmup_steps, optimizer_steps_taken(optimizer)
        )
        for group in optimizer.param_groups:
            group["lr"] = learning_rate
    raise_if_stop_requested()  # between optimizer steps too: an update is abandoned whole, never saved part-done
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_total, float(grad_norm), stats, len(batches)


def warmup_learning_rate(learning_rate: float, warmup_steps: int, steps_taken: int) -> float:
    """The rate of the run's optimizer step number ``steps_taken`` (0-based): linear warm-up."""
    if warmup_steps <= 0 or steps_taken >= warmup_steps:
        return learning_rate
    return learning_rate * (steps_taken + 1) / warmup_steps


def optimizer_steps_taken(optimizer: torch.optim.Optimizer) -> int:
    """Steps this optimizer (restored from the previous checkpoint) has taken in the run."""
    for state in optimizer.state.values():
        if "step" in state:
            return int(state["step"])
    return 0


def make_optimizer(model: PreTrainedModel, learning_rate: float) -> torch.optim.Optimizer:
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ValueError("the model has no trainable parameters")
    return torch.optim.AdamW(trainable, lr=learning_rate, weight_decay=0.0)
