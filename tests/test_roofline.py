"""The roofline bench: its FLOP count of a training micro-batch is torch's own, and its
smallest mode runs end to end."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from repo_script import load_script
from torch.utils.flop_counter import FlopCounterMode

from rollflow.config.run import ModelConfig, RunConfig
from rollflow.config.train import TrainConfig
from rollflow.generators.models import load_policy_for_training
from rollflow.policy.models import build_tiny_model
from rollflow.tasks.grpo_update import _microbatch_tensors
from rollflow.tasks.trainer_logprobs import token_logprobs

roofline = load_script("bench/roofline.py")


@pytest.mark.parametrize("use_lora", [True, False])
def test_the_counted_matmul_flops_of_a_micro_batch_are_what_torch_counts(tmp_path: Path, use_lora: bool) -> None:
    path = build_tiny_model(tmp_path / "tiny", hidden_size=64, num_heads=2)
    model, _ = load_policy_for_training(RunConfig(model=ModelConfig(path=str(path)), train=TrainConfig(use_lora=use_lora)), None)
    samples = roofline.synthetic_samples(3, True, model.config.vocab_size)
    t = _microbatch_tensors(samples, 0, model.device)
    wanted_BT = t["loss_mask"][:, 1:] > 0
    counter = FlopCounterMode(display=False)
    with counter:
        token_logprobs(model, t["input_ids"], t["attention_mask"], 1.0, wanted_BT).sum().backward()
    counted = sum(
        flops for op, flops in counter.get_flop_counts()["Global"].items() if "attention" not in str(op)
    )
    shape = roofline.ModelShape.of(model)
    tokens = t["input_ids"].numel()  # the padded micro-batch, as it runs
    assert shape.matmul_train_flops(tokens, int(wanted_BT.sum()), use_lora) == pytest.approx(counted, rel=1e-9)


@pytest.mark.slow
def test_the_quick_roofline_prints_peaks_and_the_step_table(capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    try:
        assert roofline.main(["--quick", "--profile", "--alternatives"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert re.search(r"GEMM peak float32 +1 thread\(s\): +[\d.]+ GFLOP/s", out), out
    assert re.search(r"memory bandwidth: copy [\d.]+ GB/s", out), out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith(("| update", "| forward"))}
    assert set(rows) == {"update, padding included", "update, padding excluded", "forward only, padding included"}
    included, excluded = (float(rows[f"update, padding {k}"].split("|")[2]) for k in ("included", "excluded"))
    assert included >= excluded > 0
    assert len(re.findall(r"ms/step = +[\d.]+ tokens/s; bandwidth bound", out)) == 2  # base and with LoRA
    trainer_line = re.search(r"as the trainer runs it +[\d.]+ s; max \|logprob - trainer's\| (\S+);", out)
    assert trainer_line is not None and float(trainer_line.group(1)) == 0.0, out
    assert len(re.findall(r"^  (?:SDPA|eager|autocast|head's).*(?: s; max |unavailable)", out, re.MULTILINE)) == 4, out
