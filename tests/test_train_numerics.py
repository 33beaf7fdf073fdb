"""What the importance ratio and the update need to mean what they say: no dropout in the
loss's forward passes, float32 weights under AdamW, and top_p = 1 when training."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_train import batch, micro_model, stage_samples, tiny_config

from rollflow.policy.loss import LossSettings
from rollflow.tasks.checkpoints import load_policy_for_training
from rollflow.tasks.train import UpdateSettings, adapter_off_reference, grpo_update, make_optimizer

DROPOUT = 0.5


def test_dropout_is_off_in_the_loss_so_the_ratio_starts_at_1() -> None:
    model = micro_model(attention_dropout=DROPOUT)
    samples = batch(model)  # sampler logprobs from the model in eval mode, as a sampler has it
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights never move
    first = grpo_update(model, None, optimizer, samples, UpdateSettings())
    second = grpo_update(model, None, optimizer, samples, UpdateSettings())
    assert first.ratio_mean == pytest.approx(1.0, abs=1e-6) and first.clip_fraction == 0.0
    assert (first.loss, first.ratio_mean) == (second.loss, second.ratio_mean)


def test_dropout_is_off_in_the_lora_reference_pass() -> None:
    lora = LoraConfig(r=4, lora_alpha=8.0, lora_dropout=DROPOUT, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(micro_model(attention_dropout=DROPOUT), lora).eval()  # B = 0: policy == reference
    samples = batch(model)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    settings = UpdateSettings(loss=LossSettings(kl_coef=0.5))
    stats = grpo_update(model, adapter_off_reference(model, 1.0), optimizer, samples, settings)
    assert stats.kl == pytest.approx(0.0, abs=1e-7)
    assert stats.ratio_mean == pytest.approx(1.0, abs=1e-6)


def test_lora_dropout_does_not_move_the_ratio() -> None:
    lora = LoraConfig(r=4, lora_alpha=8.0, lora_dropout=DROPOUT, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(micro_model(), lora).eval()  # the sampler's mode
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.5)  # the adapter (and its dropout) matters
    samples = batch(model)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    stats = grpo_update(model, None, optimizer, samples, UpdateSettings())
    assert stats.ratio_mean == pytest.approx(1.0, abs=1e-6) and stats.clip_fraction == 0.0


@pytest.mark.parametrize("use_lora", [True, False])
def test_gradient_checkpointing_still_recomputes_without_dropout(tiny_model_dir: Path, use_lora: bool) -> None:
    config = tiny_config(tiny_model_dir, gradient_checkpointing=True, use_lora=use_lora)
    model, tokenizer = load_policy_for_training(config, None)
    attention = next(m for n, m in model.named_modules() if n.endswith("layers.0.self_attn"))
    calls: list[bool] = []
    attention.register_forward_hook(lambda module, args, output: calls.append(module.training))
    optimizer = make_optimizer(model, config.train.learning_rate)
    stats = grpo_update(model, None, optimizer, stage_samples(0), UpdateSettings.from_config(config, 0))
    assert stats.num_microbatches == 1
    assert calls == [False, False]  # the forward, then its recomputation in backward; no dropout
    assert not model.training
