"""The shared-prefix forward and backward (issue 43, part 1): rows that share an opening compute
it once, and the logprobs, the gradient (LoRA and full weights) and whole updates equal the
plain path's within float32 rounding, on the tiny model and on the bundled model's shape (2 of
its 30 layers, random weights)."""

from __future__ import annotations

import copy
import dataclasses
import random
from pathlib import Path

import pytest
import torch
from update_exactness import (
    TOLERANCE,
    policy_of_kind,
    tiny_policy,
    grads_of,
    grouped_samples,
    scaled_max_diff,
    trainable,
)

from rollflow.policy.loss import LossSettings
from rollflow.storage.records import SampleRecord
from rollflow.tasks.grpo_update import UpdateSettings, _microbatch_tensors, grpo_update
from rollflow.tasks.trainer_logprobs import token_logprobs
from rollflow.tasks.sft import completion_nll, pack_rows, sft_update
from rollflow.tasks.sft_rows import SFTRow
from rollflow.tasks.shared_prefix import (
    SharedPrefix,
    first_trained,
    pack_by_prefix,
    plan_prefixes,
    prefix_length,
    shared_prefix_logits,
)
from rollflow.tasks.train import adapter_off_reference, frozen_model_reference

def _plan(samples: list) -> SharedPrefix:
    return plan_prefixes([s.input_ids for s in samples], [first_trained(s.loss_mask) for s in samples],
                         [s.group_id for s in samples])


# ---------------------------------------------------------------- plans and packing


def test_a_prefix_is_the_common_opening_and_ends_before_the_first_trained_token() -> None:
    assert first_trained([1, 0, 0, 1, 1]) == 3 and first_trained([1, 0, 0]) == 3
    rows = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 11], [5, 6, 7, 8, 9]]
    assert prefix_length(rows, [5, 5, 5]) == 4  # they differ at token 4
    assert prefix_length(rows, [5, 3, 5]) == 2  # token 3 is trained in row 1: position 2 predicts it
    plan = plan_prefixes(rows, [5, 3, 5], ["b", "a", "b"])
    assert plan == SharedPrefix(group_B=(0, 1, 0), prefix_len_G=(4, 2))
    assert plan.cost([6, 5, 5]) == 2 * 4 + 3 * 3  # two prefixes of up to 4, three suffixes of up to 3


def test_packing_keeps_a_group_together_within_the_budget() -> None:
    samples = grouped_samples(vocab=100, groups=3, per_group=4, prompt=40)
    plan = _plan(samples)
    assert min(plan.prefix_len_G) >= 39  # the opening, to its last context token
    for budget in (10_000, 300, 150):
        batches = pack_by_prefix(samples, lambda s: s.input_ids, lambda s: s.loss_mask, lambda s: s.group_id, budget)
        assert sorted(s.sample_id for b in batches for s in b) == sorted(s.sample_id for s in samples)
        for batch in batches:
            assert len(batch) == 1 or _plan(batch).cost([len(s.input_ids) for s in batch]) <= budget
        # a group is split only when it alone exceeds the budget
        parts = {g: sum(1 for b in batches if any(s.group_id == g for s in b)) for g in {s.group_id for s in samples}}
        if budget == 10_000:
            assert len(batches) == 1
        if budget == 300:
            assert all(n == 1 for n in parts.values()), parts


def _opening_and_tail(group: str, opening: list[int], tail: int, rng: random.Random) -> SampleRecord:
    """A row of ``group``: its ``opening`` (context), then ``tail`` trained tokens."""
    ids = opening + [rng.randrange(3, 100) for _ in range(tail)]
    mask = [0] * len(opening) + [1] * tail
    return SampleRecord(
        run_id="run", step=0, sample_id=f"{group}{len(ids)}#{rng.random()}", episode_id=group, group_id=group,
        input_ids=tuple(ids), loss_mask=tuple(mask), advantages=tuple(float(m) for m in mask),
        sampler_logprobs=tuple(-4.6 * m for m in mask),
    )


def _prefixes_of_different_lengths() -> list[SampleRecord]:
    """The review's layout (2026-12-07, F4): group a opens with 5 tokens (rows of 20 and 12),
    group b with 60 (rows of 70 and 120)."""
    rng = random.Random(1)
    a, b = [rng.randrange(3, 100) for _ in range(5)], [rng.randrange(3, 100) for _ in range(60)]
    return [_opening_and_tail("a", a, 15, rng), _opening_and_tail("a", a, 7, rng),
            _opening_and_tail("b", b, 10, rng), _opening_and_tail("b", b, 60, rng)]  # fmt: skip


def _positions_run(model: torch.nn.Module, samples: list[SampleRecord]) -> int:
    """Token positions the shared-prefix forward of ``samples`` runs: its passes' inputs."""
    t = _microbatch_tensors(samples, pad_token_id=2, device=model.device)
    keep_BT = torch.zeros_like(t["input_ids"], dtype=torch.bool)
    keep_BT[:, :-1] = t["loss_mask"][:, 1:] > 0
    shapes: list[tuple[int, ...]] = []
    embed = model.get_base_model().model.embed_tokens
    hook = embed.register_forward_hook(lambda m, i, o: shapes.append(tuple(i[0].shape)))
    try:
        with torch.no_grad():
            shared_prefix_logits(model, t["input_ids"], _plan(samples), keep_BT)
    finally:
        hook.remove()
    return sum(rows * width for rows, width in shapes)


def test_a_micro_batch_runs_no_more_positions_than_the_budget(tiny_model_dir: Path) -> None:
    """``max_tokens_per_microbatch`` is a memory bound. Before: groups whose prefixes differ
    in length were packed as G x P + B x longest suffix (362 under a budget of 400) and the
    suffix pass ran B x (T - shortest prefix), 582 positions."""
    model = tiny_policy(tiny_model_dir, use_lora=True)
    samples = _prefixes_of_different_lengths()
    for budget in (400, 250, 150):
        batches = pack_by_prefix(samples, lambda s: s.input_ids, lambda s: s.loss_mask, lambda s: s.group_id, budget)
        assert sorted(s.sample_id for b in batches for s in b) == sorted(s.sample_id for s in samples)
        for batch in batches:
            cost = _plan(batch).cost([len(s.input_ids) for s in batch])
            assert _positions_run(model, batch) <= cost, (budget, [len(s.input_ids) for s in batch])
            assert len(batch) == 1 or cost <= budget, (budget, [len(s.input_ids) for s in batch])


def test_the_packers_cost_is_the_plans_even_for_a_group_split_in_parts() -> None:
    """A part of a split group can share a longer opening than the whole group does (a
    longer prefix pass): the packer costs each micro-batch as its own plan will run it."""
    rng = random.Random(0)
    for _ in range(30):
        samples = []
        for g in range(rng.randint(2, 4)):
            opening = [rng.randrange(3, 100) for _ in range(rng.randint(0, 40))]
            for _ in range(rng.randint(1, 4)):  # rows that share more than the group's opening
                longer = opening + [rng.randrange(3, 6) for _ in range(rng.randint(0, 30))]
                samples.append(_opening_and_tail(f"g{g}", longer, rng.randint(1, 40), rng))
        budget = rng.randint(60, 400)
        for batch in pack_by_prefix(samples, lambda s: s.input_ids, lambda s: s.loss_mask, lambda s: s.group_id, budget):
            cost = _plan(batch).cost([len(s.input_ids) for s in batch])
            assert len(batch) == 1 or cost <= budget, (budget, _plan(batch), [len(s.input_ids) for s in batch])


# ---------------------------------------------------------------- exactness


def _logprobs_and_grads(model: torch.nn.Module, samples: list, attention: object, weights_BT: torch.Tensor):
    t = _microbatch_tensors(samples, pad_token_id=2, device=model.device)
    wanted_BT = t["loss_mask"][:, 1:] > 0
    logprobs_BT = token_logprobs(model, t["input_ids"], attention, 0.7, wanted_BT)
    return logprobs_BT.detach(), grads_of((logprobs_BT * weights_BT).sum(), model), wanted_BT


@pytest.mark.parametrize("kind", ["tiny", "bundled-shape"])
@pytest.mark.parametrize("use_lora", [True, False])
@pytest.mark.slow  # 3 s in a loaded suite run (docs/testing.md)
def test_logprobs_and_gradients_equal_the_plain_forwards(tiny_model_dir: Path, kind: str, use_lora: bool) -> None:
    model = policy_of_kind(kind, use_lora, tiny_model_dir)
    # two groups with openings of different lengths in one micro-batch, rows of different lengths
    samples = grouped_samples(model.config.vocab_size, groups=2, per_group=3, prompt=24, shared_system=8)
    plan = _plan(samples)
    assert plan.group_B == (0, 0, 0, 1, 1, 1) and plan.prefix_len_G[0] < plan.prefix_len_G[1]
    width = max(len(s.input_ids) for s in samples)
    weights_BT = torch.randn(len(samples), width - 1, generator=torch.Generator().manual_seed(1))
    plain, plain_grads, wanted_BT = _logprobs_and_grads(model, samples, None, weights_BT)
    shared, shared_grads, _ = _logprobs_and_grads(model, samples, plan, weights_BT)
    assert float((plain - shared)[wanted_BT].abs().max()) < TOLERANCE
    assert torch.all(shared[~wanted_BT] == 0)
    assert max(float(g.abs().max()) for g in plain_grads) > 1e-3
    # every trainable tensor, the first layer's k and v included: their prefix keys and
    # values reach the loss only through the suffix's attention, so a detached prefix fails here
    assert scaled_max_diff(plain_grads, shared_grads) < TOLERANCE
    # the prefix pass given its padding mask (the bench's "shared-prefix" leg): the same again
    masked, masked_grads, _ = _logprobs_and_grads(model, samples, dataclasses.replace(plan, padding_mask=True), weights_BT)
    assert float((plain - masked)[wanted_BT].abs().max()) < TOLERANCE
    assert scaled_max_diff(plain_grads, masked_grads) < TOLERANCE


def test_each_prefix_runs_once(tiny_model_dir: Path) -> None:
    model = tiny_policy(tiny_model_dir, use_lora=True)
    samples = grouped_samples(model.config.vocab_size, groups=2, per_group=4, prompt=30)
    plan = _plan(samples)
    t = _microbatch_tensors(samples, pad_token_id=2, device=model.device)
    keep_BT = torch.zeros_like(t["input_ids"], dtype=torch.bool)
    keep_BT[:, :-1] = t["loss_mask"][:, 1:] > 0
    shapes: list[tuple[int, ...]] = []
    hook = model.get_base_model().model.embed_tokens.register_forward_hook(lambda m, i, o: shapes.append(tuple(i[0].shape)))
    try:
        with torch.no_grad():
            shared_prefix_logits(model, t["input_ids"], plan, keep_BT)
    finally:
        hook.remove()
    # the suffix pass: each row's suffix from column 0, up to its last kept position
    last_kept_B = [max(i for i, kept in enumerate(row) if kept) for row in keep_BT.tolist()]
    suffix = max(last + 1 - length for last, length in zip(last_kept_B, plan.prefix_len_B, strict=True))
    assert suffix < t["input_ids"].shape[1] - min(plan.prefix_len_G)  # not the widest row past the shortest prefix
    assert shapes == [(2, max(plan.prefix_len_G)), (8, suffix)]


@pytest.mark.parametrize("kind", ["tiny", "bundled-shape"])
@pytest.mark.parametrize("use_lora", [True, False])
@pytest.mark.slow  # 7 s in a loaded suite run (docs/testing.md)
def test_an_update_with_shared_prefixes_equals_the_plain_update(tiny_model_dir: Path, kind: str, use_lora: bool) -> None:
    """The KL reference pass (LoRA: adapter off; full weights: a frozen copy) and two minibatches
    with their proximal pass all run shared-prefix forwards; the weights after the step agree."""
    base = policy_of_kind(kind, use_lora, tiny_model_dir)
    samples = grouped_samples(base.config.vocab_size, groups=3, per_group=4, prompt=20)
    settings = UpdateSettings(
        loss=LossSettings(kl_coef=0.1, off_policy_correction="tis"), max_tokens_per_microbatch=200,
        pad_token_id=2, minibatches=2,
    )
    runs = []
    for shared in (False, True):
        model = copy.deepcopy(base)
        reference = adapter_off_reference(model, 1.0) if use_lora else frozen_model_reference(copy.deepcopy(base), 1.0)
        # SGD at rate 1: the step is the (clipped) gradient itself; Adam's first step,
        # lr x g / |g|, would turn the rounding of a near-zero gradient into a full step
        optimizer = torch.optim.SGD(trainable(model), lr=1.0)
        stats = grpo_update(model, reference, optimizer, samples, dataclasses.replace(settings, shared_prefix=shared))
        runs.append((stats, [p.detach() - p0 for p, p0 in zip(trainable(model), trainable(base), strict=True)]))
    (plain, plain_step), (shared, shared_step) = runs
    for name in ("loss", "kl", "ratio_mean", "grad_norm", "mismatch_kl", "num_action_tokens"):
        assert getattr(shared, name) == pytest.approx(getattr(plain, name), rel=1e-5, abs=1e-7), name
    assert max(float(d.abs().max()) for d in plain_step) > 1e-3  # the step moved them
    assert scaled_max_diff(plain_step, shared_step) < TOLERANCE


def test_eager_attention_gets_an_additive_mask_and_the_same_logprobs(tiny_model_dir: Path) -> None:
    model = tiny_policy(tiny_model_dir, use_lora=True)
    model.set_attn_implementation("eager")
    samples = grouped_samples(model.config.vocab_size, groups=2, per_group=2, prompt=12)
    weights_BT = torch.ones(len(samples), max(len(s.input_ids) for s in samples) - 1)
    plain, plain_grads, wanted_BT = _logprobs_and_grads(model, samples, None, weights_BT)
    shared, shared_grads, _ = _logprobs_and_grads(model, samples, _plan(samples), weights_BT)
    assert float((plain - shared)[wanted_BT].abs().max()) < TOLERANCE
    assert scaled_max_diff(plain_grads, shared_grads) < TOLERANCE


def test_gradient_checkpointing_is_refused_and_the_update_runs_plain(tiny_model_dir: Path) -> None:
    base = tiny_policy(tiny_model_dir, use_lora=True)
    samples = grouped_samples(base.config.vocab_size, groups=2, per_group=2, prompt=12)
    settings = UpdateSettings(pad_token_id=2)
    weights = []
    for shared, checkpointing in ((False, False), (True, True)):
        model = copy.deepcopy(base)
        if checkpointing:
            model.gradient_checkpointing_enable()
            model.enable_input_require_grads()
        optimizer = torch.optim.SGD(trainable(model), lr=1.0)
        grpo_update(model, None, optimizer, samples, dataclasses.replace(settings, shared_prefix=shared))
        weights.append([p.detach().clone() for p in trainable(model)])
        if checkpointing:
            model.train()
            t = _microbatch_tensors(samples, pad_token_id=2, device=model.device)
            keep_BT = torch.zeros_like(t["input_ids"], dtype=torch.bool)
            with pytest.raises(ValueError, match="gradient checkpointing"):
                shared_prefix_logits(model, t["input_ids"], _plan(samples), keep_BT)
    assert scaled_max_diff(*weights) < TOLERANCE


# ---------------------------------------------------------------- SFT


def _sft_rows() -> list[SFTRow]:
    system = tuple(range(300, 340))  # every row's system prompt
    return [
        SFTRow("a", system + tuple(range(5, 20)) + tuple(range(50, 70)), (0,) * 55 + (1,) * 20),
        SFTRow("b", system + tuple(range(105, 112)) + tuple(range(150, 160)), (0,) * 47 + (1,) * 10),
        SFTRow("c", system + tuple(range(205, 230)) + tuple(range(250, 256)), (0,) * 65 + (1,) * 6),
    ]


def test_sft_rows_share_their_system_prompt_with_the_same_loss_and_gradient(tiny_model_dir: Path) -> None:
    model = tiny_policy(tiny_model_dir, use_lora=True)
    rows = _sft_rows()
    plain = completion_nll(model, rows, pad_token_id=2)
    shared = completion_nll(model, rows, pad_token_id=2, shared_prefix=True)
    assert float(shared) == pytest.approx(float(plain), rel=1e-6)
    assert scaled_max_diff(grads_of(plain, model), grads_of(shared, model)) < TOLERANCE
    assert len(pack_rows(rows, 200, shared_prefix=True)) < len(pack_rows(rows, 200))  # 40 + 3 x 35 fits 200
    steps = []
    for shared_prefix in (False, True):
        trained = copy.deepcopy(model)
        optimizer = torch.optim.SGD(trainable(trained), lr=1.0)
        steps.append(sft_update(trained, optimizer, rows, 2, 200, 1.0, shared_prefix=shared_prefix))
        trained.eval()
        steps.append([p.detach().clone() for p in trainable(trained)])
    assert steps[0] == pytest.approx(steps[2], rel=1e-6)
    assert scaled_max_diff(steps[1], steps[3]) < TOLERANCE
