"""The KL reference is the starting policy (version 0), also when training starts from an
SFT LoRA adapter ([model].adapter): not the base model underneath it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_train import tiny_config, train_step, write_samples

from rollflow.config.run import RunConfig
from rollflow.generators.checkpoints import latest_checkpoint
from rollflow.generators.models import load_policy_for_training
from rollflow.policy.models import ModelRef, load_causal_lm
from rollflow.storage.runfolder import RunFolder
from rollflow.tasks.train import kl_reference
from rollflow.tasks.trainer_logprobs import token_logprobs

IDS_BT = torch.tensor([[1, 17, 300, 301, 302, 2, 40, 41, 42]])
WANTED_BT = torch.tensor([[False, True, True, True, False, False, True, True]])


def sft_adapter(model_dir: Path, dest: Path) -> Path:
    """A LoRA adapter as ``rollflow sft`` leaves one: rank 4, and B != 0 so it matters."""
    base, _ = load_causal_lm(ModelRef(path=str(model_dir)))
    torch.manual_seed(11)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8.0, target_modules=["q_proj", "v_proj"],
                                            task_type="CAUSAL_LM"))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.3)
    model.save_pretrained(str(dest))
    return dest


def warm_start_config(model_dir: Path, adapter: Path) -> RunConfig:
    """tests/test_train.py's tiny config, started from ``adapter``, with a KL term."""
    config = tiny_config(model_dir, kl_coef=0.5)
    return dataclasses.replace(config, model=dataclasses.replace(config.model, adapter=str(adapter)))


def logprobs_of(ref: ModelRef) -> torch.Tensor:
    """A forward pass of the policy ``ref`` names, loaded afresh, by hand."""
    model, _ = load_causal_lm(ref)
    with torch.no_grad():
        return token_logprobs(model, IDS_BT, torch.ones_like(IDS_BT), 1.0, WANTED_BT)


@pytest.fixture
def start_adapter(tiny_model_dir: Path, tmp_path: Path) -> Path:
    return sft_adapter(tiny_model_dir, tmp_path / "sft-policy")


def test_the_reference_is_the_starting_adapter_not_the_base(
    tiny_model_dir: Path, start_adapter: Path
) -> None:
    config = warm_start_config(tiny_model_dir, start_adapter)
    model, _ = load_policy_for_training(config, None)
    reference = kl_reference(config, model)
    assert reference is not None
    start = logprobs_of(ModelRef(path=str(tiny_model_dir), adapter=str(start_adapter)))
    base = logprobs_of(ModelRef(path=str(tiny_model_dir)))
    assert not torch.allclose(start[WANTED_BT], base[WANTED_BT], atol=1e-3)  # the adapter matters
    got = reference(IDS_BT, torch.ones_like(IDS_BT), WANTED_BT)
    assert torch.allclose(got, start, atol=1e-6)
    # The reference pass leaves the trainable adapter active and trainable.
    with torch.no_grad():
        policy = token_logprobs(model, IDS_BT, torch.ones_like(IDS_BT), 1.0, WANTED_BT)
    assert torch.allclose(policy, start, atol=1e-6)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and ".default." in n for n in trainable), trainable[:3]


def test_kl_is_zero_at_the_first_update_and_the_reference_stays_the_start(
    tiny_model_dir: Path, start_adapter: Path, tmp_path: Path
) -> None:
    config = warm_start_config(tiny_model_dir, start_adapter)
    run_dir = tmp_path / "run"
    for step in (0, 1):
        write_samples(run_dir, step)
        train_step(config, run_dir, step)
    folder = RunFolder(run_dir)
    first, second = folder.read_train_result(0), folder.read_train_result(1)
    assert first.kl == pytest.approx(0.0, abs=1e-7)  # policy version 0 == the reference
    assert second.kl is not None and second.kl > 1e-6  # version 1 moved away from it
    # Resumed from the checkpoint, the reference is still the starting adapter.
    latest = latest_checkpoint(folder)
    assert latest is not None
    model, _ = load_policy_for_training(config, latest)
    reference = kl_reference(config, model)
    assert reference is not None
    start = logprobs_of(ModelRef(path=str(tiny_model_dir), adapter=str(start_adapter)))
    assert torch.allclose(reference(IDS_BT, torch.ones_like(IDS_BT), WANTED_BT), start, atol=1e-6)
    # The checkpoint holds the trained adapter only; the frozen reference is not saved.
    assert sorted(p.name for p in latest.path.iterdir() if p.is_dir()) == []
    acting = logprobs_of(ModelRef(path=str(tiny_model_dir), adapter=str(latest.path)))
    assert not torch.allclose(acting, start, atol=1e-4)


def test_full_weight_training_from_an_adapter_starts_at_kl_0(
    tiny_model_dir: Path, start_adapter: Path, tmp_path: Path
) -> None:
    """Full weights fold the starting adapter into the weights; the reference is the same
    starting policy, loaded as base + adapter."""
    config = warm_start_config(tiny_model_dir, start_adapter)
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, use_lora=False))
    model, _ = load_policy_for_training(config, None)
    reference = kl_reference(config, model)
    assert reference is not None
    start = logprobs_of(ModelRef(path=str(tiny_model_dir), adapter=str(start_adapter)))
    assert torch.allclose(reference(IDS_BT, torch.ones_like(IDS_BT), WANTED_BT), start, atol=1e-6)
    write_samples(tmp_path, 0)
    train_step(config, tmp_path, 0)
    assert RunFolder(tmp_path).read_train_result(0).kl == pytest.approx(0.0, abs=1e-6)
