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

The prefill runs in slices of rows, longest first (by tokens to prefill), each a forward
pass over at most ``PREFILL_TOKENS_PER_PASS`` tokens (its rows x its widest row), and no
row in a slice is less than half as wide as the slice: a fresh 500-token episode does not
make 30-token deltas pay for its width. A stop request waits for one slice, not the whole
prefill, and on a CPU the slices cost less in all than one pass over every row
(bench/prefill_bench.py measures both). The slices' caches are left-padded to one width
and joined.

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
from dataclasses import dataclass, field, replace

import torch
from transformers import DynamicCache, PreTrainedModel

from rollflow.policy.sampling import draw_tokens, sampling_logprobs
from rollflow.policy.stopping import raise_if_stop_requested

# Tokens (rows x the batch's width) in one prefill forward pass: the longest a stop request
# waits in a prefill; the whole prefill is about fastest here (bench/prefill_bench.py).
PREFILL_TOKENS_PER_PASS = 4096


@dataclass(frozen=True, eq=False)
class CachedPrefix:
    """The KV cache of ``token_ids``, one row, no padding: per layer (1, heads, L, head_dim)."""

    token_ids: tuple[int, ...]
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]

    def __post_init__(self) -> None:
        assert len(self.keys) == len(self.values), "one key and one value tensor per layer"
        for keys, values in zip(self.keys, self.values, strict=True):
            assert keys.shape[-2] == values.shape[-2] == len(self.token_ids), (
                f"a cache of {keys.shape[-2]} positions for {len(self.token_ids)} tokens"
            )

    def __len__(self) -> int:
        return len(self.token_ids)


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


@dataclass(frozen=True)
class _PrefillRow:
    """One distinct context to prefill: ``cached`` tokens from its prefix, then the rest."""

    context_ids: tuple[int, ...]
    prefix: CachedPrefix | None
    cached: int

    @property
    def new_ids(self) -> tuple[int, ...]:
        return self.context_ids[self.cached :]


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
        cache_keyword = _cache_keyword(model)
        logits_BV, attention_BT, prefill = _prefill(model, requests, pad_token_id, cache, cache_keyword)
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
            logits_BV = _last_logits(model, tokens_B[:, None], attention_BT, position_B1, cache, cache_keyword)
    report = replace(prefill, prefill_s=prefilled - started, decode_s=time.perf_counter() - prefilled)
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


# ---------------------------------------------------------------- prefill


def _prefill(
    model: PreTrainedModel,
    requests: Sequence[GenerationRequest],
    pad_token_id: int,
    cache: DynamicCache,
    cache_keyword: str,
) -> tuple[torch.Tensor, torch.Tensor, BatchReport]:
    """Fill ``cache`` with every context; returns the next-token logits, the mask, and the
    report's prefill counts (its times are the caller's to fill in).

    Identical contexts (a GRPO group's first turn) are computed once and their cache rows
    copied. The rows go through in slices (see the module note), each into its own cache,
    with a stop check between slices; the slices' caches are then joined, rows in order.
    """
    unique_index: dict[tuple[tuple[int, ...], int], int] = {}
    prefill_rows: list[_PrefillRow] = []
    row_to_unique = []
    for request in requests:
        key = (request.context_ids, request.cached_tokens)
        if key not in unique_index:
            unique_index[key] = len(prefill_rows)
            prefill_rows.append(_PrefillRow(request.context_ids, request.prefix, request.cached_tokens))
        row_to_unique.append(unique_index[key])
    slices = _slices(prefill_rows)
    parts = [cache] if len(slices) == 1 else [DynamicCache() for _ in slices]
    logits, masks = [], []
    for number, (members, part) in enumerate(zip(slices, parts, strict=True)):
        if number:
            raise_if_stop_requested()
        logits_RV, mask_RT = _prefill_slice(
            model, [prefill_rows[u] for u in members], pad_token_id, part, cache_keyword
        )
        logits.append(logits_RV)
        masks.append(mask_RT)
    attention_UT = masks[0] if len(slices) == 1 else _join(parts, masks, cache)
    position_of = {u: p for p, u in enumerate(u for members in slices for u in members)}
    index_B = [position_of[u] for u in row_to_unique]
    expand_B = torch.tensor(index_B, device=model.device)
    if index_B != list(range(len(prefill_rows))):
        cache.batch_select_indices(expand_B)
    count = BatchReport(
        prefill_tokens=sum(len(row.new_ids) for row in prefill_rows),
        prefill_padded_tokens=sum(len(members) * len(prefill_rows[members[0]].new_ids) for members in slices),
        prefill_passes=len(slices), prefill_s=0.0, decode_s=0.0,
    )  # fmt: skip
    return torch.cat(logits)[expand_B], attention_UT[expand_B], count  # (B, V), (B, T)


def _slices(rows: Sequence[_PrefillRow]) -> list[list[int]]:
    """Indices into ``rows``, longest first, cut into the prefill's forward passes.

    A slice ends where one more row would pass ``PREFILL_TOKENS_PER_PASS`` (rows x the
    slice's width, its first row's) or is less than half as wide as the slice.
    """
    order = sorted(range(len(rows)), key=lambda u: (-len(rows[u].new_ids), u))
    slices: list[list[int]] = []
    for u in order:
        tokens = len(rows[u].new_ids)
        if slices:
            width = len(rows[slices[-1][0]].new_ids)
            if (len(slices[-1]) + 1) * width <= PREFILL_TOKENS_PER_PASS and 2 * tokens >= width:
                slices[-1].append(u)
                continue
        slices.append([u])
    return slices


def _prefill_slice(
    model: PreTrainedModel,
    rows: Sequence[_PrefillRow],
    pad_token_id: int,
    cache: DynamicCache,
    cache_keyword: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward pass over ``rows``' new tokens after their cached parts: (R, V), (R, C + N)."""
    device = model.device
    cached_mask_RC = _load_prefixes(rows, cache, device)
    input_ids_RN, new_mask_RN = _left_padded([row.new_ids for row in rows], pad_token_id)
    input_ids_RN, new_mask_RN = input_ids_RN.to(device), new_mask_RN.to(device)
    cached_R1 = torch.tensor([[row.cached] for row in rows], device=device)
    position_RN = cached_R1 + (new_mask_RN.cumsum(dim=-1) - 1).clamp(min=0)
    attention_RT = torch.cat([cached_mask_RC, new_mask_RN], dim=1)
    logits_RV = _last_logits(model, input_ids_RN, attention_RT, position_RN, cache, cache_keyword)
    return logits_RV, attention_RT


def _load_prefixes(rows: Sequence[_PrefillRow], cache: DynamicCache, device: torch.device) -> torch.Tensor:
    """Put every row's cached part, right-aligned, into the empty ``cache``; returns its (R, C) mask."""
    width = max(row.cached for row in rows)
    mask_RC = torch.zeros((len(rows), width), dtype=torch.long, device=device)
    cached = [(r, row.cached, row.prefix) for r, row in enumerate(rows) if row.prefix and row.cached]
    if not cached:
        return mask_RC
    for r, length, _ in cached:
        mask_RC[r, width - length :] = 1
    for layer_index, (keys, values) in enumerate(zip(cached[0][2].keys, cached[0][2].values, strict=True)):
        keys_RHCD = keys.new_zeros((len(rows), keys.shape[1], width, keys.shape[3]))  # 0 = padding
        values_RHCD = values.new_zeros((len(rows), values.shape[1], width, values.shape[3]))
        for r, length, prefix in cached:
            keys_RHCD[r, :, width - length :] = prefix.keys[layer_index][0, :, :length]
            values_RHCD[r, :, width - length :] = prefix.values[layer_index][0, :, :length]
        cache.update(keys_RHCD, values_RHCD, layer_index)
    return mask_RC


def _join(parts: Sequence[DynamicCache], masks: Sequence[torch.Tensor], cache: DynamicCache) -> torch.Tensor:
    """The slices' caches into ``cache``, each left-padded to the widest; returns the joined mask."""
    width = max(mask.shape[1] for mask in masks)

    def padded(tensor: torch.Tensor, dim: int) -> torch.Tensor:
        missing = width - tensor.shape[dim]
        if missing == 0:
            return tensor
        shape = list(tensor.shape)
        shape[dim] = missing
        return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)

    for layer_index in range(len(parts[0].layers)):  # one cache, rows in order
        cache.update(torch.cat([padded(part.layers[layer_index].keys, 2) for part in parts]),
                     torch.cat([padded(part.layers[layer_index].values, 2) for part in parts]), layer_index)
    return torch.cat([padded(mask, 1) for mask in masks])


def _left_padded(contexts: Sequence[tuple[int, ...]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
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
