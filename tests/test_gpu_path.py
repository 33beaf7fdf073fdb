"""The GPU path end to end (issue 63): two GRPO steps of the tiny model on CUDA, with the
transformers engine, and with a managed vLLM server sharing the trainer's GPU (sleep mode)
where the machine has vLLM's CUDA build. Marked ``gpu``: the suite leaves it out
(``-m 'not gpu'``); run it with ``pytest -m gpu tests/test_gpu_path.py`` on a machine with a
GPU. It has not yet run on one (README, "On a GPU")."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tiny_run import tiny_config_at

from rollflow.config.run import config_to_toml, load_config
from rollflow.flows.cli import main
from rollflow.ops.preflight import cuda_vllm_problem
from rollflow.policy.vllm_spec import DEFAULT_PYTHON
from rollflow.storage.runfolder import RunFolder

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.usefixtures("prefect_harness"),
]


def _two_steps_on_cuda(tiny_model_dir: Path, tmp_path: Path, **rollout: object) -> Path:
    """configs/tiny.toml on the GPU (bfloat16 where it has it), two steps; returns the run folder."""
    config = load_config(tiny_config_at(tmp_path, tiny_model_dir))
    config = replace(
        config, model=replace(config.model, device="cuda", dtype="auto"),
        rollout=replace(config.rollout, **rollout), tracking=replace(config.tracking, enabled=False),
    )  # fmt: skip
    path = tmp_path / "gpu.toml"
    path.write_text(config_to_toml(config))
    run_dir = tmp_path / "run"
    assert main(["train", str(path), "--run-dir", str(run_dir)]) == 0
    return run_dir


def _trained_two_steps(run_dir: Path) -> None:
    folder = RunFolder(run_dir)
    for step in (0, 1):
        metrics = json.loads((folder.step_dir(step) / "metrics.json").read_text())
        assert metrics, f"step {step} wrote no metrics"


def test_two_grpo_steps_with_the_transformers_engine_on_cuda(tiny_model_dir: Path, tmp_path: Path) -> None:
    _trained_two_steps(_two_steps_on_cuda(tiny_model_dir, tmp_path))


@pytest.mark.skipif(
    not DEFAULT_PYTHON.is_file() or cuda_vllm_problem(None) is not None,
    reason="needs vLLM's CUDA build in .venv-vllm (make VLLM_PACKAGE=vllm==0.32.0 vllm-setup)",
)
def test_two_grpo_steps_with_a_vllm_server_sharing_the_trainers_gpu(
    tiny_model_dir: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """LoRA merged into the base and reloaded in place: the server sleeps at level 2 during each
    update, is woken, reloaded and probed."""
    run_dir = _two_steps_on_cuda(tiny_model_dir, tmp_path, backend="vllm", gpu_memory_utilization=0.3)
    _trained_two_steps(run_dir)
    err = capfd.readouterr().err
    assert "vLLM: asleep for the update" in err, err[-3000:]
    log = (run_dir / "logs" / "vllm-server.log").read_text()
    assert "enable_sleep_mode" in log or "--enable-sleep-mode" in log
