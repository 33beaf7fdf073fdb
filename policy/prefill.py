"""The prefill of one generation call: every context's uncached tokens through the model,
into the KV cache the decoding loop (``policy/generation.py``) continues from.

Identical contexts (the members of a GRPO group on their first turn) are prefilled once
and their cache rows copied. A context may start with a ``CachedPrefix`` (its keys and
values from an earlier call); only the rest is run, each row laid out as ``[pad][its
cache][pad][its new tokens]``: the cached part right-aligned in the widest cache, the new
tokens right-aligned after it, positions given explicitly.

The prefill runs in slices of rows, longest first (by tokens to prefill), each a forward
pass over at most ``PREFILL_TOKENS_PER_PASS`` tokens (its rows x its widest row), and no
row in a slice is less than half as wide as the slice: a fresh 500-token episode does not
make 30-token deltas pay for its width. A stop request waits for one slice, not the whole
prefill, and on a CPU the slices cost less in all than one pass over every row
(bench/prefill_bench.py measures both). The slices' caches are left-padded to one width
and joined.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import DynamicCache, PreTrainedModel

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


class PrefillRequest(Protocol):
    """What the prefill reads of a request (``generation.GenerationRequest``)."""

    @property
    def context_ids(self) -> tuple[int, ...]: ...
    @property
    def prefix(self) -> CachedPrefix | None: ...
    @property
    def cached_tokens(self) -> int: ...


@dataclass(frozen=True)
class PrefillCount:
    tokens: int  # distinct context tokens run through the model, padding excluded
    padded_tokens: int  # positions of the passes, padding included
    passes: int


@dataclass(frozen=True)
class _PrefillRow:
    """One distinct context to prefill: ``cached`` tokens from its prefix, then the rest."""

    context_ids: tuple[int, ...]
    prefix: CachedPrefix | None
    cached: int

    @property
    def new_ids(self) -> tuple[int, ...]:
        return self.context_ids[self.cached :]


def prefill(
    model: PreTrainedModel,
    requests: Sequence[PrefillRequest],
    pad_token_id: int,
    cache: DynamicCache,
    cache_keyword: str,
) -> tuple[torch.Tensor, torch.Tensor, PrefillCount]:
    """Fill ``cache`` with every context; returns the next-token logits, the mask, and what
    the passes computed.

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
    count = PrefillCount(
        tokens=sum(len(row.new_ids) for row in prefill_rows),
        padded_tokens=sum(len(members) * len(prefill_rows[members[0]].new_ids) for members in slices),
        passes=len(slices),
    )
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
    logits_RV = last_logits(model, input_ids_RN, attention_RT, position_RN, cache, cache_keyword)
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


def last_logits(
    model: PreTrainedModel,
    input_ids_BT: torch.Tensor,
    attention_BT: torch.Tensor,
    position_BT: torch.Tensor,
    cache: DynamicCache,
    cache_keyword: str,
) -> torch.Tensor:
    """The next-token logits of every row (its last position); ``cache`` gains the new keys and values."""
    out = model(
        input_ids=input_ids_BT,
        attention_mask=attention_BT,
        position_ids=position_BT,
        use_cache=True,
        logits_to_keep=1,
        **{cache_keyword: cache},
    )
    return out.logits[:, -1, :]  # (B, V)
