"""What the importance ratio and the update need to mean what they say: no dropout in the
loss's forward passes, float32 weights under AdamW, and top_p = 1 when training."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_train import batch, micro_model, stage_samples, tiny_config, train_step, write_samples

from rollflow.config.parsing import ConfigError
from rollflow.config.run import RunConfig, config_to_toml, load_config, parse_config
from rollflow.flows.runs import open_run
from rollflow.generators.checkpoints import latest_checkpoint
from rollflow.generators.models import load_policy_for_training, policy_model_ref, torch_dtype
from rollflow.policy.loss import LossSettings
from rollflow.policy.models import load_causal_lm
from rollflow.storage.runfolder import RunFolder
from rollflow.tasks.grpo_update import UpdateSettings, grpo_update, make_optimizer
from rollflow.tasks.train import adapter_off_reference

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


def moved_fraction(trained: torch.nn.Module, start: torch.nn.Module) -> float:
    """The share of weights (elements) whose value differs from the start's."""
    start_weights = dict(start.named_parameters())
    moved = total = 0
    for name, param in trained.named_parameters():
        moved += int((param.float() != start_weights[name].float()).sum())
        total += param.numel()
    return moved / total


def train_steps(config: RunConfig, run_dir: Path, steps: int) -> torch.nn.Module:
    """``steps`` train stages, each resuming from the checkpoint on disk; the last policy."""
    for step in range(steps):
        write_samples(run_dir, step)
        train_step(config, run_dir, step)
    latest = latest_checkpoint(RunFolder(run_dir))
    assert latest is not None and latest.policy_version == steps
    return load_policy_for_training(config, latest)[0]


@pytest.mark.slow  # 6 s in a loaded suite run (docs/testing.md)
def test_full_weight_training_in_bfloat16_updates_float32_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    """AdamW on bfloat16 weights rounds most updates of lr 2e-5 away; the trainer keeps
    float32 weights, so [model].dtype changes how the policy samples, not how it learns."""
    config = tiny_config(tiny_model_dir, use_lora=False, learning_rate=2e-5)
    low = dataclasses.replace(config, model=dataclasses.replace(config.model, dtype="bfloat16"))
    full = dataclasses.replace(low, model=dataclasses.replace(low.model, dtype="float32"))
    trained = train_steps(low, tmp_path / "bf16", 5)
    start = load_policy_for_training(low, None)[0]
    fraction = moved_fraction(trained, start)
    print(f"bfloat16 full-weight training, 5 steps at lr 2e-5: {fraction:.1%} of weights moved")
    assert fraction > 0.99
    assert {p.dtype for p in trained.parameters()} == {torch.float32}
    expected = dict(train_steps(full, tmp_path / "f32", 5).named_parameters())
    for name, param in trained.named_parameters():
        assert torch.equal(param, expected[name]), name
    # The rollout acts with the checkpoint cast to [model].dtype.
    latest = latest_checkpoint(RunFolder(tmp_path / "bf16"))
    acting, _ = load_causal_lm(policy_model_ref(low, latest), torch_dtype(low))
    assert {p.dtype for p in acting.parameters()} == {torch.bfloat16}


def test_lora_weights_stay_float32_on_a_bfloat16_base(tiny_model_dir: Path) -> None:
    config = tiny_config(tiny_model_dir)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, dtype="bfloat16"))
    model, _ = load_policy_for_training(config, None)
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
    assert dtypes == {torch.float32}


def test_training_refuses_top_p_below_1_and_evaluation_keeps_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The trainer scores tokens under the whole distribution: with a nucleus the ratio
    would start at the nucleus mass, not 1."""
    config = tiny_config(tiny_model_dir)
    config = dataclasses.replace(config, rollout=dataclasses.replace(config.rollout, top_p=0.9))
    path = tmp_path / "top_p.toml"
    path.write_text(config_to_toml(config))
    assert load_config(path).rollout.top_p == 0.9  # rollflow eval reads it as it is
    refusal = r"\[rollout\]\.top_p = 0\.9.*training.*1\.0.*nucleus"
    with pytest.raises(ConfigError, match=refusal):
        open_run(path, tmp_path / "run")  # rollflow train / resume
    write_samples(tmp_path / "api", 0)
    with pytest.raises(ConfigError, match=refusal):
        train_step(config, tmp_path / "api", 0)


def test_bfloat16_forwards_keep_float32_weights_and_correct_the_mismatch() -> None:
    """[train].compute_dtype = "bfloat16": the forwards run under autocast (their logprobs
    move off the float32 sampler's, within bfloat16 rounding), the weights and gradients stay
    float32, and the step's metrics carry the mismatch the correction weighs."""
    def update(settings: UpdateSettings) -> tuple[object, torch.nn.Module]:
        model = micro_model()
        samples = batch(model)  # float32 sampler logprobs, as vLLM samples
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return grpo_update(model, None, optimizer, samples, settings), model

    tis = LossSettings(off_policy_correction="tis")
    exact, exact_model = update(UpdateSettings(loss=tis))
    low, low_model = update(UpdateSettings(loss=tis, autocast_dtype=torch.bfloat16))
    assert exact.mismatch_kl == pytest.approx(0.0, abs=1e-10) and exact.is_weight_mean == pytest.approx(1.0)
    assert 0.0 < low.mismatch_kl < 1e-3  # bfloat16 rounding, not another policy
    assert low.is_weight_mean != 1.0 and low.corrected_fraction == 0.0
    assert {p.dtype for p in low_model.parameters()} == {torch.float32}
    start = micro_model().state_dict()
    for (name, a), b in zip(low_model.named_parameters(), exact_model.parameters(), strict=True):
        step = (b.detach() - start[name]).abs().max()
        assert (a - b).abs().max() <= 0.05 * step + 1e-6, name  # the same update, within rounding


def test_bfloat16_compute_dtype_defaults_to_the_tis_correction() -> None:
    config = parse_config({"train": {"compute_dtype": "bfloat16"}})
    assert config.off_policy_correction == "tis"
    assert UpdateSettings.from_config(config, 0).autocast_dtype == torch.bfloat16
    assert parse_config({}).off_policy_correction == "none"
    explicit = parse_config({"train": {"compute_dtype": "bfloat16", "off_policy_correction": "mask"}})
    assert explicit.off_policy_correction == "mask"
    with pytest.raises(ConfigError, match="compute_dtype"):
        parse_config({"train": {"compute_dtype": "bf16"}})
