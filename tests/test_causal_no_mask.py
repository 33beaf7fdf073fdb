"""Right-padded micro-batches run without an attention mask (issue 43, part 2): SDPA takes its
``is_causal`` path, and the logprobs, gradients and updates equal the masked path's within
float32 rounding on the tiny model and on the bundled model's shape (2 of its 30 layers)."""

from __future__ import annotations

import copy
import dataclasses
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
from rollflow.tasks.grpo_update import UpdateSettings, _microbatch_tensors, grpo_update
from rollflow.tasks.trainer_logprobs import token_logprobs
from rollflow.tasks.sft import completion_nll
from rollflow.tasks.sft_rows import SFTRow
from rollflow.tasks.train import adapter_off_reference

@pytest.mark.parametrize("kind", ["tiny", "bundled-shape"])
@pytest.mark.parametrize("use_lora", [True, False])
@pytest.mark.slow  # 10 s in a loaded suite run (docs/testing.md)
def test_logprobs_and_gradients_without_the_mask_equal_the_masked_ones(
    tiny_model_dir: Path, kind: str, use_lora: bool
) -> None:
    model = policy_of_kind(kind, use_lora, tiny_model_dir)
    samples = grouped_samples(model.config.vocab_size, groups=1, per_group=3, prompt=20)
    t = _microbatch_tensors(samples, pad_token_id=2, device=model.device)
    assert (t["attention_mask"] == 0).any(), "the rows must differ in length: padding is the point"
    wanted_BT = t["loss_mask"][:, 1:] > 0
    weights_BT = torch.randn(wanted_BT.shape, generator=torch.Generator().manual_seed(1))
    results = []
    for mask in (t["attention_mask"], None):
        logprobs_BT = token_logprobs(model, t["input_ids"], mask, 0.7, wanted_BT)
        results.append((logprobs_BT.detach(), grads_of((logprobs_BT * weights_BT).sum(), model)))
    (masked, masked_grads), (causal, causal_grads) = results
    assert float((masked - causal)[wanted_BT].abs().max()) < TOLERANCE
    assert torch.all(causal[~wanted_BT] == 0)
    assert max(float(g.abs().max()) for g in masked_grads) > 1e-3  # a gradient worth comparing
    assert scaled_max_diff(masked_grads, causal_grads) < TOLERANCE


def test_without_a_mask_sdpa_runs_its_causal_kernel(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_policy(tiny_model_dir, use_lora=True)
    samples = grouped_samples(model.config.vocab_size, groups=1, per_group=2, prompt=10)
    t = _microbatch_tensors(samples, pad_token_id=2, device=model.device)
    calls: list[tuple[bool, bool]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append((kwargs.get("attn_mask") is None, bool(kwargs.get("is_causal"))))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    with torch.no_grad():
        token_logprobs(model, t["input_ids"], None, 1.0, t["loss_mask"][:, 1:] > 0)
        assert calls and all(call == (True, True) for call in calls), calls
        calls.clear()
        token_logprobs(model, t["input_ids"], t["attention_mask"], 1.0, t["loss_mask"][:, 1:] > 0)
        assert calls and all(call == (False, False) for call in calls), calls


@pytest.mark.parametrize("use_lora", [True, False])
@pytest.mark.slow  # 14 s in a loaded suite run (docs/testing.md)
def test_an_update_without_the_mask_equals_the_masked_update(tiny_model_dir: Path, use_lora: bool) -> None:
    """Two micro-batches, the KL reference pass (LoRA: the adapter switched off) and
    two minibatches with their proximal pass: every forward of the update goes unmasked."""
    base = tiny_policy(tiny_model_dir, use_lora)
    samples = grouped_samples(base.config.vocab_size, groups=2, per_group=3, prompt=16)
    settings = UpdateSettings(
        loss=LossSettings(kl_coef=0.1 if use_lora else 0.0, off_policy_correction="tis"),
        max_tokens_per_microbatch=200, pad_token_id=2, minibatches=2,
    )
    runs = []
    for padding_mask in (True, False):
        model = copy.deepcopy(base)
        reference = adapter_off_reference(model, 1.0) if use_lora else None
        optimizer = torch.optim.SGD(trainable(model), lr=1.0)  # the step is the clipped gradient
        stats = grpo_update(model, reference, optimizer, samples, dataclasses.replace(settings, padding_mask=padding_mask))
        runs.append((stats, [p.detach() - p0 for p, p0 in zip(trainable(model), trainable(base), strict=True)]))
    (masked, masked_step), (causal, causal_step) = runs
    assert masked.num_microbatches == causal.num_microbatches >= 2
    for name in ("loss", "ratio_mean", "grad_norm", "mismatch_kl") + (("kl",) if use_lora else ()):
        assert getattr(causal, name) == pytest.approx(getattr(masked, name), rel=1e-5, abs=1e-7), name
    assert max(float(d.abs().max()) for d in masked_step) > 1e-3  # the step moved them
    assert scaled_max_diff(masked_step, causal_step) < TOLERANCE


def test_sft_loss_without_the_mask_equals_the_masked_loss(tiny_model_dir: Path) -> None:
    model = tiny_policy(tiny_model_dir, use_lora=True)
    rows = [
        SFTRow("a", tuple(range(5, 40)), (0,) * 20 + (1,) * 15),
        SFTRow("b", tuple(range(105, 127)), (0,) * 12 + (1,) * 10),
        SFTRow("c", tuple(range(205, 215)), (0,) * 4 + (1,) * 6),
    ]
    masked = completion_nll(model, rows, pad_token_id=2, padding_mask=True)
    causal = completion_nll(model, rows, pad_token_id=2)
    assert float(causal) == pytest.approx(float(masked), rel=1e-6)
    assert scaled_max_diff(grads_of(masked, model), grads_of(causal, model)) < TOLERANCE
