"""What tests of tiny runs share: configs/tiny.toml on a tiny model (with varying rewards), and
killing a run started in its own process group."""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import replace
from pathlib import Path

from rollflow.config.run import config_to_toml, load_config

REPO = Path(__file__).resolve().parent.parent


def tiny_config_at(dest: Path, model_dir: Path) -> Path:
    """Write configs/tiny.toml into ``dest`` on ``model_dir`` with an environment whose
    rewards vary (tests/varied_reward_env.py), so every update really changes the weights."""
    config = load_config(REPO / "configs" / "tiny.toml")
    config = replace(
        config,
        model=replace(config.model, path=str(model_dir)),
        env=replace(config.env, name="varied_reward_env:load_environment"),
        storage=replace(config.storage, runs_dir=str(dest / "runs")),
    )
    path = dest / "tiny.toml"
    path.write_text(config_to_toml(config))
    return path


def train_tiny_on(
    model_dir: Path, tmp_path: Path, env_name: str, env_kwargs: dict[str, object], max_turns: int
) -> Path:
    """Two steps of a real `rollflow train` (configs/tiny.toml, untracked) on the tiny model
    and environment ``env_name`` with ``env_kwargs``; returns the run folder."""
    from rollflow.flows.cli import main

    config = load_config(REPO / "configs" / "tiny.toml")
    config = replace(
        config,
        model=replace(config.model, path=str(model_dir)),
        env=replace(config.env, name=env_name, kwargs=env_kwargs),
        rollout=replace(config.rollout, max_turns=max_turns),
        storage=replace(config.storage, runs_dir=str(tmp_path / "runs")),
        tracking=replace(config.tracking, enabled=False),
    )
    path = tmp_path / "two-steps.toml"
    path.write_text(config_to_toml(config))
    run_dir = tmp_path / "run"
    assert main(["train", str(path), "--run-dir", str(run_dir)]) == 0
    return run_dir


def build_vllm_tiny_model(dest: Path) -> Path:
    """A tiny Llama vLLM's CPU attention serves (2 heads of 32) with the real tokenizer, its
    end-of-turn embedding made large so that actions end by ``stop`` often enough to test."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollflow.policy.models import build_tiny_model

    folder = build_tiny_model(dest, hidden_size=64, num_heads=2)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    eos = int(model.config.eos_token_id)
    direction = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model.get_input_embeddings().weight[eos] = direction / direction.norm() * 8.0
    model.save_pretrained(str(folder))  # safetensors: what vLLM loads
    return folder


def kill_group(child: subprocess.Popen[str]) -> None:
    """SIGKILL whatever is left of the child's process group, the child included."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    child.wait(timeout=60)
