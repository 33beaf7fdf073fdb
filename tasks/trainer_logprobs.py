"""The trainer's log-probability of each taken token, computed as the sampler computed its own.

``token_logprobs`` runs the model and takes ``log_softmax(logits / temperature)`` at each taken
token, at the rollout's sampling temperature, so the importance ratio is 1 wherever trainer and
sampler agree; given the wanted positions, the vocabulary projection runs only there. Given a
``SharedPrefix`` plan instead of a mask, rows that share an opening compute it once
(``rollflow.tasks.shared_prefix``), with the same result within float32 rounding.
``chosen_logprobs`` is that log-softmax and its gradient, a few rows of logits at a time.
``forward_autocast`` runs them in bfloat16 where ``[train].compute_dtype`` asks.
``train_without_dropout`` puts the model in eval mode for those forward passes (no dropout: the
sampler has none either). ``top_p`` < 1 samples from a truncated distribution the trainer does
not rebuild, so a training run refuses it (``check_training_sampling``).
"""

from __future__ import annotations

import torch
from torch.autograd.function import FunctionCtx
from transformers import PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from rollflow.tasks.shared_prefix import SharedPrefix, shared_prefix_logits


def forward_autocast(model: PreTrainedModel, dtype: torch.dtype | None) -> torch.autocast:
    """Autocast to ``dtype`` on the model's device (``[train].compute_dtype``), for the
    forward passes only; None: a disabled context, the model runs as loaded. The weights,
    peft's float32 LoRA factors and the optimizer's state are untouched, and
    ``chosen_logprobs`` upcasts the logits, so the log-softmax and the loss stay float32."""
    return torch.autocast(model.device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)


def token_logprobs(
    model: PreTrainedModel, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor | SharedPrefix | None,
    temperature: float, wanted_BT: torch.Tensor | None = None,
) -> torch.Tensor:
    """log p(token t | tokens < t) for t = 1..T-1 under ``log_softmax(logits / temperature)``.

    ``attention_mask_BT`` None: causal attention alone (SDPA's ``is_causal`` path), exact
    for right-padded rows at every real position; a pad's entry is then not that of the
    masked forward, so the caller must not read it (``wanted_BT`` False there). A
    ``SharedPrefix`` plan (right-padded rows, ``wanted_BT`` given and False on every row's
    prefix): the prefixes run once each (``shared_prefix_logits``).

    ``wanted_BT`` (bool, (B, T-1)) names the tokens whose logprob is needed (the action
    tokens); the vocabulary projection then runs only at the positions predicting them, and
    every other entry is 0. On an episode whose context is ten times its actions, that
    skips most of the (T, 49k) float logits (400 MB per 2k tokens) and their softmax.
    The log-softmax itself is ``chosen_logprobs``: float32 arithmetic, float32 result.
    """
    targets_BT = input_ids_BT[:, 1:]
    if isinstance(attention_mask_BT, SharedPrefix):
        assert wanted_BT is not None, "the shared-prefix forward computes the wanted positions only"
    if wanted_BT is None:
        logits_BTV = model(input_ids=input_ids_BT, attention_mask=attention_mask_BT, use_cache=False).logits
        logits_NV = logits_BTV[:, :-1].reshape(-1, logits_BTV.shape[-1])  # position t-1 predicts token t
        return chosen_logprobs(logits_NV, targets_BT.reshape(-1), temperature).view(targets_BT.shape)  # (B, T-1)
    keep_BT = torch.zeros_like(input_ids_BT, dtype=torch.bool)
    keep_BT[:, :-1] = wanted_BT  # position t-1 predicts token t
    if isinstance(attention_mask_BT, SharedPrefix):
        logits_NV = shared_prefix_logits(model, input_ids_BT, attention_mask_BT, keep_BT)
    else:
        logits_NV = model(
            input_ids=input_ids_BT, attention_mask=attention_mask_BT, logits_to_keep=keep_BT, use_cache=False
        ).logits  # (N, V): one row per wanted token, row-major
    picked_N = chosen_logprobs(logits_NV, targets_BT[wanted_BT], temperature)
    logprobs_BT = torch.zeros(targets_BT.shape, dtype=picked_N.dtype, device=picked_N.device)
    return logprobs_BT.masked_scatter(wanted_BT, picked_N)


_HEAD_CHUNK_BYTES = 1 << 20  # float32 rows of logits handled at once: about a core's L2


def chosen_logprobs(logits_NV: torch.Tensor, targets_N: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log_softmax(logits_NV.float() / temperature)[n, targets_N[n]]``, float32, (N,).

    The same float32 arithmetic as ``x = logits.float() / temperature; x.gather(target) -
    logsumexp(x)`` and its autograd (``tests/test_train.py`` holds it to that), but a few rows
    at a time (``_ChosenLogprob``): no float32 (N, V) copy of bfloat16 logits is made, kept
    for the backward or differentiated through, and the gradient comes back in the logits'
    own dtype, as the ``.float()`` cast's backward would round it.
    """
    if logits_NV.requires_grad and torch.is_grad_enabled():
        return _ChosenLogprob.apply(logits_NV, targets_N, temperature)
    with torch.no_grad():
        return _chosen_logprobs_forward(logits_NV, targets_N, temperature)[0]


def _row_chunks(logits_NV: torch.Tensor) -> range:
    rows = max(1, _HEAD_CHUNK_BYTES // (4 * max(1, logits_NV.shape[-1])))
    return range(0, logits_NV.shape[0], rows)


def _chosen_logprobs_forward(
    logits_NV: torch.Tensor, targets_N: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs_N, logsumexp_N), both float32."""
    lse_N = torch.empty(logits_NV.shape[0], dtype=torch.float32, device=logits_NV.device)
    chunks = _row_chunks(logits_NV)
    for start in chunks:
        rows = slice(start, start + chunks.step)
        lse_N[rows] = torch.logsumexp(logits_NV[rows].float() / temperature, dim=-1)
    picked_N = logits_NV.gather(-1, targets_N.unsqueeze(-1)).squeeze(-1).float() / temperature
    return picked_N - lse_N, lse_N


class _ChosenLogprob(torch.autograd.Function):
    """``chosen_logprobs`` with its gradient ``(onehot(target) - softmax(x)) * g / temperature``
    computed row chunk by row chunk, in the order autograd of the plain expression sums it."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, logits_NV: torch.Tensor, targets_N: torch.Tensor, temperature: float
    ) -> torch.Tensor:
        logprobs_N, lse_N = _chosen_logprobs_forward(logits_NV, targets_N, temperature)
        ctx.save_for_backward(logits_NV, targets_N, lse_N)
        ctx.temperature = temperature
        return logprobs_N

    @staticmethod
    def backward(ctx: FunctionCtx, grad_N: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits_NV, targets_N, lse_N = ctx.saved_tensors
        grad_N = grad_N.float()
        grad_NV = torch.empty_like(logits_NV)
        chunks = _row_chunks(logits_NV)
        for start in chunks:
            rows = slice(start, start + chunks.step)
            g_n1 = grad_N[rows].unsqueeze(-1)
            # logsumexp's backward: -g * exp(x - lse); the gather's: g at the target; then / temperature
            x_nV = logits_NV[rows].float() / ctx.temperature
            part_nV = x_nV.sub_(lse_N[rows].unsqueeze(-1)).exp_().mul_(-g_n1)
            part_nV.scatter_add_(-1, targets_N[rows].unsqueeze(-1), g_n1)
            grad_NV[rows] = part_nV.div_(ctx.temperature)
        return grad_NV, None, None


def train_without_dropout(model: PreTrainedModel) -> None:
    """Eval mode for the loss's forward passes, except for gradient checkpointing.

    Dropout (attention, LoRA) would make the trainer's logprobs a random draw: the ratio
    against the sampler (which never drops out) would start away from 1 and the KL
    against the reference away from 0. Layers under gradient checkpointing keep their
    training flag (set on them alone, not their children), since transformers only
    checkpoints a layer that is training; nothing in the layer itself reads the flag.
    """
    model.eval()
    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer) and module.gradient_checkpointing:
            module.training = True
