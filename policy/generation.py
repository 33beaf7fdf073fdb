"""One batched generation call: many contexts in, each one's sampled tokens and logprobs out.

The loop is ours rather than ``model.generate`` because each row needs things generate
does not give: its own token budget (the episode's remaining context), its own random
generator (samples independent of batch composition), the logprobs of the distribution
actually sampled, a deadline after which its output is discarded, and a KV cache that
outlives the call.

Mechanics: contexts are left-padded into one (B, T) batch with an attention mask and
explicit position ids; one prefill fills a KV cache, then every step feeds one token per
row. Identical contexts (the members of a GRPO group on their first turn) are prefilled
once and their cache rows copied: on a CPU the prefill is most of a short action's cost.
A finished row (stop token, budget spent or deadline passed) is dropped from the batch
and the cache, so long stragglers do not make every row pay for them.

KV reuse across calls: a request may carry a ``CachedPrefix``, the keys and values of
the first tokens of its context (an episode's transcript up to its last action), and
with ``keep_caches`` every finished row hands back its own: the context and every
sampled token but the last, whose keys were never computed. Only the rest of the
context is prefilled. A batch then holds rows whose cached parts differ in length, so
each row is laid out as ``[pad][its cache][pad][its new tokens]``: the cached part
right-aligned in the batch's widest cache, the new tokens right-aligned after it. The
padding in the middle is masked like any other, and positions are given explicitly
(a row's new tokens continue at its cached length), so every row computes what an
unpadded forward pass of its whole context computes, up to float rounding.

The prefill runs in slices of rows, at most ``PREFILL_TOKENS_PER_PASS`` tokens a forward
pass (``policy/prefill.py``, which also lays out the cached parts); this module decodes.

Simplifications, and why:
- One forward pass is never interrupted: stop requests are checked between passes, the
  deadline between decoding steps.
- Only the last position's logits are computed (``logits_to_keep=1``): full-sequence
  logits for a 16 x 1000 prefill over a 49k vocabulary would be 3 GB.
- A cache is stored without padding, one tensor per layer, in the model's dtype: about
  46 KB a token for SmolLM2-135M in float32. Only full-attention caches are supported
  (``DynamicCache`` layers that keep every position); a sliding-window layer is refused.
- Reuse changes float sums, not the maths: a cached key was computed in another pass,
  in another batch shape. Logprobs agree with a full forward pass to ~1e-6 in float32.
  A draw can change only where such a difference crosses a boundary: the drawn token's
  edge in the cumulative distribution, or, with top_p < 1, a near-tie at the nucleus's
  edge that swaps which token is in (on the near-uniform tiny test model, 3 of 12
  actions; none with top_p = 1). A replay computes the same passes: it stays bit-exact.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel

from rollflow.policy.prefill import CachedPrefix, last_logits, prefill
from rollflow.policy.sampling import draw_tokens, sampling_logprobs
from rollflow.policy.stopping import raise_if_stop_requested

@dataclass(frozen=True)
class GenerationRequest:
    context_ids: tuple[int, ...]
    max_new_tokens: int
    seed: int
    prefix: CachedPrefix | None = None  # the keys and values of the context's first tokens

    def __post_init__(self) -> None:
        if not self.context_ids:
            raise ValueError("a generation request needs at least one context token")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.prefix is not None and self.context_ids[: len(self.prefix)] != self.prefix.token_ids:
            raise ValueError(
                f"the cached prefix ({len(self.prefix)} tokens) does not start the context "
                f"({len(self.context_ids)} tokens): it belongs to another transcript"
            )

    @property
    def cached_tokens(self) -> int:
        """Context tokens served from ``prefix``; at least one is always prefilled (its logits)."""
        return 0 if self.prefix is None else min(len(self.prefix), len(self.context_ids) - 1)


@dataclass(frozen=True)
class GenerationOutput:
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    stopped: bool  # the last token is a stop token
    timed_out: bool  # the deadline passed first: the tokens are to be discarded
    prefilled_tokens: int = 0  # context tokens this request ran through the model (not cached)
    # with keep_caches: the context and every sampled token but the last; None if timed out
    cache: CachedPrefix | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        assert len(self.token_ids) == len(self.logprobs), "one logprob per sampled token"


@dataclass(frozen=True)
class BatchReport:
    """What one ``generate_batch`` call computed, for benchmarks and tests."""

    prefill_tokens: int  # distinct context tokens run through the model, padding excluded
    prefill_padded_tokens: int  # positions of the prefill passes, padding included
    prefill_passes: int
    prefill_s: float
    decode_s: float


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
    cache: CachedPrefix | None = None

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
    keep_caches: bool = False,
) -> list[GenerationOutput]:
    """Sample a continuation for every request in one batched, KV-cached decoding loop."""
    return generate_batch_and_report(
        model, requests, temperature=temperature, top_p=top_p, stop_token_ids=stop_token_ids,
        pad_token_id=pad_token_id, timeout_s=timeout_s, keep_caches=keep_caches,
    )[0]


def generate_batch_and_report(
    model: PreTrainedModel,
    requests: Sequence[GenerationRequest],
    *,
    temperature: float,
    top_p: float,
    stop_token_ids: Collection[int],
    pad_token_id: int,
    timeout_s: float | None = None,
    keep_caches: bool = False,
) -> tuple[list[GenerationOutput], BatchReport]:
    """``generate_batch``, and what it computed: prefill tokens, prefill and decode time."""
    if not requests:
        return [], BatchReport(0, 0, 0, 0.0, 0.0)
    raise_if_stop_requested()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    rows = [_new_row(request) for request in requests]
    device = model.device
    started = time.perf_counter()
    with torch.inference_mode():
        cache = DynamicCache()
        cache_keyword = forward_cache_keyword(model)
        logits_BV, attention_BT, count = prefill(model, requests, pad_token_id, cache, cache_keyword)
        prefilled = time.perf_counter()
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
            if keep_caches:
                _keep_finished_caches(rows, live, cache, attention_BT)
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
            logits_BV = last_logits(model, tokens_B[:, None], attention_BT, position_B1, cache, cache_keyword)
    report = BatchReport(count.tokens, count.padded_tokens, count.passes, prefilled - started,
                         time.perf_counter() - prefilled)
    return [_output(row) for row in rows], report


def _new_row(request: GenerationRequest) -> _Row:
    generator = torch.Generator().manual_seed(request.seed)
    return _Row(request, generator, len(request.context_ids), [], [])


def _append(row: _Row, token: int, logprob: float, stop_token_ids: Collection[int], timed_out: bool) -> None:
    if timed_out:
        row.timed_out = True
        return
    row.token_ids.append(token)
    row.logprobs.append(logprob)
    row.stopped = token in stop_token_ids


def _output(row: _Row) -> GenerationOutput:
    prefilled = len(row.request.context_ids) - row.request.cached_tokens
    if row.timed_out:
        return GenerationOutput((), (), stopped=False, timed_out=True, prefilled_tokens=prefilled)
    return GenerationOutput(
        tuple(row.token_ids), tuple(row.logprobs), row.stopped, False, prefilled, row.cache
    )


# ---------------------------------------------------------------- caches that outlive a call


def _keep_finished_caches(
    rows: Sequence[_Row], live: Sequence[int], cache: DynamicCache, attention_BT: torch.Tensor
) -> None:
    """Copy out the cache of every row that just finished, before it leaves the batch."""
    for b, i in enumerate(live):
        row = rows[i]
        if row.finished and not row.timed_out:
            token_ids = row.request.context_ids + tuple(row.token_ids[:-1])  # the last was never fed
            real_T = attention_BT[b].bool()
            keys = tuple(layer.keys[b : b + 1, :, real_T] for layer in cache.layers)
            values = tuple(layer.values[b : b + 1, :, real_T] for layer in cache.layers)
            if any(k.shape[-2] != len(token_ids) for k in keys):
                raise ValueError(
                    "KV reuse needs a cache that keeps every position (no sliding window); "
                    f"got {[type(layer).__name__ for layer in cache.layers][:3]}: set kv_reuse=False"
                )
            row.cache = CachedPrefix(token_ids, keys, values)


def forward_cache_keyword(model: PreTrainedModel) -> str:
    """The keyword ``model``'s forward takes a KV cache by: ``cache`` from transformers 5.2x
    on, ``past_key_values`` before (now deprecated). Every caller that hands a cache asks here."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    parameters = inspect.signature(base.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"
