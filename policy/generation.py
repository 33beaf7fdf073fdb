"""One batched generation call: many contexts in, each one's sampled tokens and logprobs out.

The loop is ours rather than ``model.generate`` because each row needs things generate
does not give: its own token budget (the episode's remaining context), its own random
generator (samples independent of batch composition), the logprobs of the distribution
actually sampled, and a deadline after which its output is discarded.

Mechanics: contexts are left-padded into one (B, T) batch with an attention mask and
explicit position ids; one prefill fills a KV cache, then every step feeds one token per
row. Identical contexts (the members of a GRPO group on their first turn) are prefilled
once and their cache rows copied: on a CPU the prefill is most of a short action's cost.
A finished row (stop token, budget spent or deadline passed) is dropped from the batch
and the cache, so long stragglers do not make every row pay for them.

The prefill runs in slices of rows, each a forward pass over at most
``PREFILL_TOKENS_PER_PASS`` tokens (some rows x the batch's width). Unsliced, a SIGTERM
during a GRPO run here took 42 s to stop it, most of that one prefill pass over a batch
of later turns (64 contexts of ~500 tokens on 2 CPU cores); sliced, a stop waits for one
slice. It is also faster here: 17 s instead of 36 s for that batch at 4096 tokens a pass
(bench/prefill_bench.py), presumably because a smaller pass's activations and attention
scores stay in the CPU's caches. Rows rather than positions: rows are independent, so no
slice re-reads or re-copies a cache that grows by concatenation.

Simplifications, and why:
- One forward pass is never interrupted: stop requests are checked between passes, the
  deadline between decoding steps. A decoding step takes tens of milliseconds here, a
  prefill slice a few seconds.
- Only the last position's logits are computed (``logits_to_keep=1``): full-sequence
  logits for a 16 x 1000 prefill over a 49k vocabulary would be 3 GB.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from rollflow.policy.sampling import draw_tokens, sampling_logprobs
from rollflow.policy.stopping import raise_if_stop_requested

# Tokens (rows x the batch's width) in one prefill forward pass: a pass of 8 rows x 500
# positions takes about 2 s on 2 CPU cores, the longest a stop request waits in a prefill,
# and the whole prefill is fastest about here (bench/prefill_bench.py).
PREFILL_TOKENS_PER_PASS = 4096


@dataclass(frozen=True)
class GenerationRequest:
    context_ids: tuple[int, ...]
    max_new_tokens: int
    seed: int

    def __post_init__(self) -> None:
        if not self.context_ids:
            raise ValueError("a generation request needs at least one context token")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass(frozen=True)
class GenerationOutput:
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    stopped: bool  # the last token is a stop token
    timed_out: bool  # the deadline passed first: the tokens are to be discarded

    def __post_init__(self) -> None:
        assert len(self.token_ids) == len(self.logprobs), "one logprob per sampled token"


@dataclass
class _Row:
    """Mutable progress of one request while the loop runs; never leaves this module."""

    request: GenerationRequest
    generator: torch.Generator
    next_position: int
    token_ids: list[int]
    logprobs: list[float]
    stopped: bool = False
    timed_out: bool = False

    @property
    def finished(self) -> bool:
        spent = len(self.token_ids) >= self.request.max_new_tokens
        return self.stopped or self.timed_out or spent


def generate_batch(
    model: PreTrainedModel,
    requests: Sequence[GenerationRequest],
    *,
    temperature: float,
    top_p: float,
    stop_token_ids: Collection[int],
    pad_token_id: int,
    timeout_s: float | None = None,
) -> list[GenerationOutput]:
    """Sample a continuation for every request in one batched, KV-cached decoding loop."""
    if not requests:
        return []
    raise_if_stop_requested()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    rows = [_new_row(request) for request in requests]
    device = model.device
    with torch.inference_mode():
        cache = DynamicCache()
        cache_keyword = _cache_keyword(model)
        logits_BV, attention_BT = _prefill(model, requests, pad_token_id, cache, cache_keyword)
        live = list(range(len(rows)))  # indices into rows, in batch order
        while True:
            raise_if_stop_requested()  # SIGTERM: drop the batch, within one decoding step
            logprobs_BV = sampling_logprobs(logits_BV, temperature, top_p)
            generators_B = [rows[i].generator for i in live]  # CPU generators: draw on CPU
            tokens_B = draw_tokens(logprobs_BV.cpu(), generators_B).to(device)
            picked_B = logprobs_BV.gather(-1, tokens_B[:, None]).squeeze(-1)
            timed_out = deadline is not None and time.monotonic() > deadline
            for i, token, logprob in zip(live, tokens_B.tolist(), picked_B.tolist(), strict=True):
                _append(rows[i], token, logprob, stop_token_ids, timed_out)
            keep_B = [b for b, i in enumerate(live) if not rows[i].finished]
            if not keep_B:
                break
            if len(keep_B) < len(live):
                keep = torch.tensor(keep_B, device=device)
                cache.batch_select_indices(keep)
                attention_BT = attention_BT[keep]
                tokens_B = tokens_B[keep]
                live = [live[b] for b in keep_B]
            new_B1 = torch.ones(len(live), 1, dtype=torch.long, device=device)
            attention_BT = torch.cat([attention_BT, new_B1], dim=1)
            position_B1 = torch.tensor([[rows[i].next_position] for i in live], device=device)
            for i in live:
                rows[i].next_position += 1
            logits_BV = _last_logits(
                model, tokens_B[:, None], attention_BT, position_B1, cache, cache_keyword
            )
    return [_output(row) for row in rows]


def _new_row(request: GenerationRequest) -> _Row:
    generator = torch.Generator().manual_seed(request.seed)
    return _Row(request, generator, len(request.context_ids), [], [])


def _append(
    row: _Row, token: int, logprob: float, stop_token_ids: Collection[int], timed_out: bool
) -> None:
    if timed_out:
        row.timed_out = True
        return
    row.token_ids.append(token)
    row.logprobs.append(logprob)
    row.stopped = token in stop_token_ids


def _output(row: _Row) -> GenerationOutput:
    if row.timed_out:
        return GenerationOutput((), (), stopped=False, timed_out=True)
    return GenerationOutput(tuple(row.token_ids), tuple(row.logprobs), row.stopped, False)


def _prefill(
    model: PreTrainedModel,
    requests: Sequence[GenerationRequest],
    pad_token_id: int,
    cache: DynamicCache,
    cache_keyword: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fill ``cache`` with every context; returns the next-token logits and the mask.

    Identical contexts (a GRPO group's first turn) are computed once and their cache
    rows copied. The rows go through in slices of at most ``PREFILL_TOKENS_PER_PASS``
    tokens (rows x the batch's width), each into its own cache, with a stop check between
    slices; the slices' caches are then joined, rows in order.
    """
    unique_index: dict[tuple[int, ...], int] = {}
    row_to_unique = [unique_index.setdefault(r.context_ids, len(unique_index)) for r in requests]
    input_ids_UT, attention_UT = _left_padded(list(unique_index), pad_token_id)
    input_ids_UT, attention_UT = input_ids_UT.to(model.device), attention_UT.to(model.device)
    position_UT = (attention_UT.cumsum(dim=-1) - 1).clamp(min=0)
    rows_per_pass = max(1, PREFILL_TOKENS_PER_PASS // input_ids_UT.shape[1])
    if rows_per_pass >= len(unique_index):
        logits_UV = _last_logits(model, input_ids_UT, attention_UT, position_UT, cache, cache_keyword)
    else:
        logits, parts = [], []
        for start in range(0, len(unique_index), rows_per_pass):
            if start:
                raise_if_stop_requested()
            part, end = DynamicCache(), start + rows_per_pass
            logits.append(_last_logits(
                model, input_ids_UT[start:end], attention_UT[start:end], position_UT[start:end], part, cache_keyword
            ))
            parts.append(part)
        for layer_index in range(len(parts[0].layers)):  # one cache, rows in order
            cache.update(torch.cat([part.layers[layer_index].keys for part in parts]),
                         torch.cat([part.layers[layer_index].values for part in parts]), layer_index)
        logits_UV = torch.cat(logits)
    expand_B = torch.tensor(row_to_unique, device=model.device)
    if len(unique_index) < len(requests):
        cache.batch_select_indices(expand_B)
    return logits_UV[expand_B], attention_UT[expand_B]  # (B, V), (B, T)


def _left_padded(
    contexts: Sequence[tuple[int, ...]], pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(context) for context in contexts)
    input_ids_BT = torch.full((len(contexts), width), pad_token_id, dtype=torch.long)
    attention_BT = torch.zeros((len(contexts), width), dtype=torch.long)  # 0 = padding
    for b, context in enumerate(contexts):
        input_ids_BT[b, width - len(context) :] = torch.tensor(context, dtype=torch.long)
        attention_BT[b, width - len(context) :] = 1
    return input_ids_BT, attention_BT


def _last_logits(
    model: PreTrainedModel,
    input_ids_BT: torch.Tensor,
    attention_BT: torch.Tensor,
    position_BT: torch.Tensor,
    cache: DynamicCache,
    cache_keyword: str,
) -> torch.Tensor:
    out = model(
        input_ids=input_ids_BT,
        attention_mask=attention_BT,
        position_ids=position_BT,
        use_cache=True,
        logits_to_keep=1,
        **{cache_keyword: cache},
    )
    return out.logits[:, -1, :]  # (B, V)


def _cache_keyword(model: PreTrainedModel) -> str:
    """``cache`` from transformers 5.2x on, ``past_key_values`` before (now deprecated)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    parameters = inspect.signature(base.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"
