"""Shared-prefix forward: rows of a micro-batch that open with the same tokens compute them once.

A GRPO group's episodes share their whole opening prompt (in the bundled tool-use game ~345
of ~615 tokens: the system prompt with the tools, then the question), and SFT rows of one
environment share its system prompt. The plain forward runs those tokens once per row; here
each prefix runs once, and the rows' suffixes attend to its keys and values:

1. **Prefix pass**: the G distinct prefixes, right-padded to the longest (G, P), run through
   the model with a ``DynamicCache`` and no attention mask (right padding under causal
   attention needs none). The cache then holds every layer's keys and values (G, kv heads,
   P, head dim) **with their graph**: nothing is detached, since the LoRA (or full) weights
   change the prefix's keys and values and the suffixes' loss must reach them.
2. **Suffix pass**: each row's tokens after its prefix (B, S), from column 0 (S: the longest
   suffix, up to the last position any row needs), at positions ``L_b + s`` (RoPE sees the
   true positions), with a cache that holds its prefix's keys and values picked out
   per row (``index_select``, whose backward sums the rows' gradients back into the prefix)
   and a 4D mask: row b sees its prefix's first ``L_b`` keys (not the padding past them) and
   the suffix causally. The model's own cache update concatenates the suffix's keys after
   the prefix's; autograd goes through that ``torch.cat`` and the ``index_select`` into the
   prefix pass, so one ``backward()`` of the loss differentiates both passes.

A row's prefix ends before the first token any row of its group is trained on (position
t - 1 predicts token t, so every logprob the loss reads comes from a suffix position): the
logits, and with them ``token_logprobs``' output layout, are those of the plain forward.
The result equals the plain path within float32 rounding (tests/test_shared_prefix.py).

Simplified, and why:
- One level of sharing: rows are grouped by a key (the GRPO group, or one key for all SFT
  rows) and each group's prefix is its rows' longest common prefix; the system prompt that
  every group shares is not computed once across groups. Packing (``pack_by_prefix``) keeps
  a group in one micro-batch where the budget allows, so the learning config computes the
  system prompt once per group rather than once per episode.
- Not under gradient checkpointing: transformers drops the cache inside a checkpointed layer
  (``GradientCheckpointingLayer``), which would silently cut the suffix off its prefix, so
  ``shared_prefix_logits`` refuses it and the update runs the plain forward instead.
- SDPA and eager attention only (the mask is a 4D tensor; flash and flex need other kinds).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from rollflow.policy.generation import forward_cache_keyword

Item = TypeVar("Item")


@dataclass(frozen=True)
class SharedPrefix:
    """How a right-padded micro-batch's rows share prefixes.

    ``group_B[b]``: the prefix of row b; ``prefix_len_G[g]``: that prefix's length in tokens
    (the first ``prefix_len_G[g]`` tokens of each of its rows, all equal). ``padding_mask``:
    give the prefix pass its right padding's mask (the path before issue 43's causal-only
    forward, kept for bench/update_bench.py); the result is the same.
    """

    group_B: tuple[int, ...]
    prefix_len_G: tuple[int, ...]
    padding_mask: bool = False

    def __post_init__(self) -> None:
        assert self.group_B and sorted(set(self.group_B)) == list(range(len(self.prefix_len_G))), (
            f"every prefix needs a row and every row a prefix: {self.group_B}, {self.prefix_len_G}"
        )

    @property
    def prefix_len_B(self) -> list[int]:
        return [self.prefix_len_G[g] for g in self.group_B]

    def cost(self, lengths_B: Sequence[int]) -> int:
        """At most the token positions the two passes run for rows of ``lengths_B``: the
        prefix pass is (G, longest prefix), the suffix pass (B, S) with S at most the longest
        suffix ``n_b - L_b`` (``shared_prefix_logits``: each row's suffix starts at column 0).
        The packer's budget (``max_tokens_per_microbatch``, a memory bound) holds this."""
        suffix = max(n - p for n, p in zip(lengths_B, self.prefix_len_B, strict=True))
        return len(self.prefix_len_G) * max(self.prefix_len_G) + len(lengths_B) * suffix


def first_trained(loss_mask: Sequence[int]) -> int:
    """The index of the first trained token (token 0 is never one), or the row's length."""
    return next((t for t in range(1, len(loss_mask)) if loss_mask[t]), len(loss_mask))


def prefix_length(rows: Sequence[Sequence[int]], first_trained_rows: Sequence[int]) -> int:
    """The rows' longest common prefix, ending before the first trained token of any of them.

    Positions 0..L-1 (the prefix) predict tokens 1..L, so L stays below every row's first
    trained token: no logprob the loss reads is left in the prefix pass.
    """
    limit = min(first_trained_rows) - 1
    first = rows[0]
    length = 0
    while length < limit and all(len(r) > length and r[length] == first[length] for r in rows):
        length += 1
    return max(length, 0)


def plan_prefixes(
    rows: Sequence[Sequence[int]], first_trained_rows: Sequence[int], keys: Sequence[Hashable]
) -> SharedPrefix:
    """Rows grouped by ``keys`` (in order of first appearance), each group's prefix its
    rows' common opening (``prefix_length``)."""
    index: dict[Hashable, int] = {}
    group_B = tuple(index.setdefault(k, len(index)) for k in keys)
    members: list[list[int]] = [[] for _ in index]
    for b, g in enumerate(group_B):
        members[g].append(b)
    prefix_len_G = tuple(
        prefix_length([rows[b] for b in bs], [first_trained_rows[b] for b in bs]) for bs in members
    )
    return SharedPrefix(group_B, prefix_len_G)


def pack_by_prefix(
    items: Sequence[Item], ids: Callable[[Item], Sequence[int]], mask: Callable[[Item], Sequence[int]],
    key: Callable[[Item], Hashable], max_tokens: int,
) -> list[list[Item]]:
    """Micro-batches that keep each key's items together, within ``max_tokens`` positions.

    A micro-batch's size is ``SharedPrefix.cost`` of the plan its forward will run
    (``plan_prefixes`` of its own rows: the part of a split group may share a longer opening
    than the whole group, which lengthens the prefix pass). Groups go longest suffix first,
    each group's items longest first, filled greedily; a group larger than the budget is
    split, an item larger than it gets a micro-batch of its own.
    """
    groups: dict[Hashable, list[Item]] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    whole = {k: prefix_length([ids(i) for i in g], [first_trained(mask(i)) for i in g]) for k, g in groups.items()}
    ordered = sorted(groups, key=lambda k: max(len(ids(i)) for i in groups[k]) - whole[k], reverse=True)
    batches: list[list[Item]] = []
    current: _Packing[Item] = _Packing()
    for k in ordered:
        for item in sorted(groups[k], key=lambda i: len(ids(i)), reverse=True):
            grown = current.add(item, ids(item), first_trained(mask(item)), k)
            if current.items and grown.cost() > max_tokens:
                batches.append(list(current.items))
                grown = _Packing[Item]().add(item, ids(item), first_trained(mask(item)), k)
            current = grown
    if current.items:
        batches.append(list(current.items))
    return batches


@dataclass(frozen=True)
class _Packing(Generic[Item]):
    """A micro-batch being packed: its items, their (length, key), and per key its first row
    and the prefix length ``plan_prefixes`` would give the key's rows so far."""

    items: tuple[Item, ...] = ()
    rows: tuple[tuple[int, Hashable], ...] = ()
    prefix: tuple[tuple[Hashable, Sequence[int], int], ...] = ()  # (key, first row, prefix length)

    def add(self, item: Item, row: Sequence[int], first_trained_at: int, k: Hashable) -> _Packing[Item]:
        """These items and ``item``: ``prefix_length`` of a key's rows, one row at a time."""
        known = {key: (first, length) for key, first, length in self.prefix}
        first, length = known.get(k, (row, len(row)))
        known[k] = (first, max(0, min(length, _common_length(first, row), first_trained_at - 1)))
        return _Packing((*self.items, item), (*self.rows, (len(row), k)),
                        tuple((key, first, length) for key, (first, length) in known.items()))  # fmt: skip

    def cost(self) -> int:
        """``SharedPrefix.cost`` of these items' plan."""
        length = {key: n for key, _, n in self.prefix}
        suffix = max(n - length[k] for n, k in self.rows)
        return len(length) * max(length.values()) + len(self.rows) * suffix


def _common_length(a: Sequence[int], b: Sequence[int]) -> int:
    return next((t for t, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def gradient_checkpointed(model: PreTrainedModel) -> bool:
    """Whether a forward with gradients would checkpoint some layer (and drop its cache)."""
    return any(
        isinstance(module, GradientCheckpointingLayer) and module.gradient_checkpointing and module.training
        for module in model.modules()
    )


def _refuse_checkpointing(model: PreTrainedModel) -> None:
    if torch.is_grad_enabled() and gradient_checkpointed(model):
        raise ValueError(
            "the shared-prefix forward cannot run under gradient checkpointing: a checkpointed "
            "layer drops the prefix's cache; run the plain forward ([train].shared_prefix = false)"
        )


def _suffix_mask(
    prefix_len_B: torch.Tensor, prefix_width: int, suffix_width: int, model: PreTrainedModel, dtype: torch.dtype
) -> torch.Tensor:
    """(B, 1, S, P + S): row b's queries see its prefix's first L_b keys and the suffix causally.

    Boolean for SDPA (True: attend), additive (0 or the dtype's minimum) for eager attention.
    """
    device = prefix_len_B.device
    prefix_B1SP = (torch.arange(prefix_width, device=device)[None, :] < prefix_len_B[:, None])[:, None, None, :]
    causal_SS = torch.ones(suffix_width, suffix_width, dtype=torch.bool, device=device).tril()
    batch = prefix_len_B.shape[0]
    mask_B1SK = torch.cat(
        [prefix_B1SP.expand(batch, 1, suffix_width, prefix_width), causal_SS.expand(batch, 1, -1, -1)], dim=-1
    )
    implementation = model.config._attn_implementation
    if implementation == "sdpa":
        return mask_B1SK
    if implementation == "eager":
        return torch.zeros(mask_B1SK.shape, dtype=dtype, device=device).masked_fill_(~mask_B1SK, torch.finfo(dtype).min)
    raise ValueError(f"the shared-prefix forward needs sdpa or eager attention, not {implementation!r}")


def _suffix_width(keep_BT: torch.Tensor, prefix_len_B: torch.Tensor) -> int:
    """Columns the suffix pass needs: row b's up to its last kept position (causal attention:
    no later position changes a kept logit), counted from its prefix's end; at least 1."""
    width = keep_BT.shape[1]
    last_kept_B = width - 1 - keep_BT.flip(1).int().argmax(1)
    needed_B = torch.where(keep_BT.any(1), last_kept_B + 1 - prefix_len_B, 0)
    return max(1, int(needed_B.max()))


def shared_prefix_logits(
    model: PreTrainedModel, input_ids_BT: torch.Tensor, plan: SharedPrefix, keep_BT: torch.Tensor
) -> torch.Tensor:
    """The logits (N, V) at ``keep_BT``'s positions, row-major, as the plain forward's
    ``logits_to_keep=keep_BT`` gives them; ``keep_BT`` must be False on every row's prefix.

    ``input_ids_BT``: right-padded rows (B, T). Two passes (module docstring), both with
    their graph when gradients are enabled.
    """
    _refuse_checkpointing(model)
    device = input_ids_BT.device
    batch, width = input_ids_BT.shape
    prefix_len_B = torch.tensor(plan.prefix_len_B, device=device)  # (B,)
    positions_T = torch.arange(width, device=device)
    assert not (keep_BT & (positions_T[None, :] < prefix_len_B[:, None])).any(), "a kept position lies in a prefix"
    prefix_width = max(plan.prefix_len_G)
    if prefix_width == 0:  # nothing shared: the plain forward, without a mask
        return model(input_ids=input_ids_BT, logits_to_keep=keep_BT, use_cache=False).logits
    keyword = forward_cache_keyword(model)
    # 1. the prefixes, each from its first row; tokens past a prefix's end are masked out below
    first_row_G = [plan.group_B.index(g) for g in range(len(plan.prefix_len_G))]
    prefix_ids_GP = input_ids_BT[first_row_G, :prefix_width]
    prefix_cache = DynamicCache()
    prefix_len_G = torch.tensor(plan.prefix_len_G, device=device)
    prefix_mask_GP = (torch.arange(prefix_width, device=device)[None, :] < prefix_len_G[:, None]).long()
    model(input_ids=prefix_ids_GP, attention_mask=prefix_mask_GP if plan.padding_mask else None, use_cache=True,
          logits_to_keep=torch.zeros_like(prefix_ids_GP, dtype=torch.bool), **{keyword: prefix_cache})
    # 2. the suffixes at their true positions, attending to their prefix's keys and values;
    # each starts at column 0, so the pass is as wide as the longest suffix a kept position needs
    suffix_width = _suffix_width(keep_BT, prefix_len_B)
    position_BS = prefix_len_B[:, None] + torch.arange(suffix_width, device=device)[None, :]  # (B, S)
    inside_BS = position_BS < width  # a row with a longer prefix can run past the padded width
    clamped_BS = position_BS.clamp(max=width - 1)
    suffix_ids_BS = input_ids_BT.gather(1, clamped_BS)  # past the row's end: never kept, never read
    keep_BS = keep_BT.gather(1, clamped_BS) & inside_BS
    group_B = torch.tensor(plan.group_B, device=device)
    layers = [
        (layer.keys.index_select(0, group_B), layer.values.index_select(0, group_B))  # (B, kv heads, P, head dim)
        for layer in prefix_cache.layers
    ]
    mask_B1SK = _suffix_mask(prefix_len_B, prefix_width, suffix_width, model, layers[0][0].dtype)
    suffix_cache = DynamicCache(ddp_cache_data=layers)
    return model(
        input_ids=suffix_ids_BS, attention_mask=mask_B1SK, position_ids=position_BS, use_cache=True,
        logits_to_keep=keep_BS, **{keyword: suffix_cache},
    ).logits
