"""The async generator's bookkeeping (``generators/async_generator.py``, ``tasks/collect.py``).

No vLLM server: a fake server and policy record what the generator starts, loads, reloads
and holds, where that bookkeeping is the point. The models are real tiny ones where the
point is which weights version 0 is, and the dead server is a real closed port.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rollflow.config.rollout import RolloutConfig
from rollflow.config.run import ModelConfig, RunConfig, ValidationConfig
from rollflow.config.train import TrainConfig
from rollflow.generators.async_generator import AsyncGenerator, open_async_generator
from rollflow.generators.generator import run_adapter_prefix
from rollflow.generators.vllm_generator import VLLMGenerator
from rollflow.policy.vllm_weights import LM_HEAD_SHARD
from rollflow.storage.runfolder import RunFolder
from rollflow.tasks.collect import RolloutWorkers
from fake_vllm import DEAD_URL, FakePolicy, FakeServer

TESTS = Path(__file__).parent
JOIN_S = 5.0  # "does not hang": generous, not a speed claim


def _on_fake_server(
    config: RunConfig, policy: object, version: int = 0, source: Path | None = None, folder: RunFolder | None = None
) -> AsyncGenerator:
    """An async generator on ``policy`` as a managed server's (``FakeServer``) would be."""
    generator = VLLMGenerator(config, folder, policy, FakeServer(None), None, key=())  # type: ignore[arg-type]
    return AsyncGenerator(config, generator, version, source)


def _config(model_dir: Path, *, lora: bool, adapter: str | None = None, **rollout: object) -> RunConfig:
    sys.path.insert(0, str(TESTS))
    return RunConfig(
        model=ModelConfig(path=str(model_dir), adapter=adapter),
        env=replace(RunConfig().env, name="varied_reward_env:load_environment"),
        rollout=RolloutConfig(**{
            "backend": "vllm", "batch_size": 2, "episodes_per_task": 2, "max_turns": 2,
            "max_completion_tokens": 4, "max_sampling_attempts": 2, "max_steps_off_policy": 1, **rollout,
        }),  # type: ignore[arg-type]  # fmt: skip
        train=TrainConfig(use_lora=lora, lora_rank=8, lora_alpha=16.0),
        validation=ValidationConfig(num_tasks=2),
    )


def _random_adapter(model_dir: Path, dest: Path) -> Path:
    """An SFT-like starting adapter that really moves the logprobs (random B)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    torch.manual_seed(3)
    peft = get_peft_model(base, LoraConfig(r=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    peft.save_pretrained(str(dest))
    return dest


def _logprobs(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.arange(5, 40)[None]
    with torch.no_grad():
        return torch.log_softmax(model(ids).logits.float(), dim=-1)


# ---------------------------------------------------------------- B1: version 0 is the trainer's


def test_a_full_weight_run_from_an_adapter_serves_the_merged_start_as_version_0(
    fake_vllm: FakePolicy, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    from rollflow.generators.models import load_policy_for_training

    adapter = _random_adapter(tiny_model_dir, tmp_path / "sft-adapter")
    config = _config(tiny_model_dir, lora=False, adapter=str(adapter), weight_sync_type="pipeline")
    with open_async_generator(config, RunFolder(tmp_path / "run"), 0) as generator:
        assert generator.version == 0
        reloads = [c for c in fake_vllm.calls if c[0] == "reload"]
        assert len(reloads) == 1 and reloads[0][2] == 0, f"version 0's weights never reached the server: {fake_vllm.calls}"
        served = AutoModelForCausalLM.from_pretrained(str(reloads[0][1]), dtype=torch.float32).eval()
        assert (reloads[0][1] / LM_HEAD_SHARD).exists(), "tied: its output layer as its own shard"
    assert not reloads[0][1].exists(), "the merged start outlived its generator"
    trainer, _ = load_policy_for_training(config, None)  # what the importance ratios are taken against
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    assert (_logprobs(served) - _logprobs(trainer.eval())).abs().max() < 1e-5
    assert (_logprobs(served) - _logprobs(base)).abs().max() > 1e-2, "the adapter moves the logprobs"


# ---------------------------------------------------------------- B3: adapters by run, within --max-loras


def test_adapters_are_named_by_run_so_runs_sharing_a_server_keep_their_own(
    fake_vllm: FakePolicy, tmp_path: Path
) -> None:
    config = _config(tmp_path, lora=True, lora_serving="adapter")
    names = []
    for root in (tmp_path / "a" / "run", tmp_path / "b" / "run"):  # two runs, one folder name
        generator = _on_fake_server(config, fake_vllm, 0, tmp_path / "adapter-v0", RunFolder(root))
        names.append(generator.adapter(3))
    assert names[0] == run_adapter_prefix(RunFolder(tmp_path / "a" / "run")) + "-v3"
    assert names[0] != names[1]
    assert all(name.startswith("policy-run-") and name.endswith("-v3") for name in names), names


def test_every_adapter_a_generator_holds_fits_the_servers_max_loras(
    fake_vllm: FakePolicy, monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Slow groups each pin the version they started under; the server must hold them all
    at once (an LRU eviction re-reads an adapter from its folder)."""
    from rollflow.generators import async_generator

    monkeypatch.setattr(async_generator, "fresh_adapter", lambda config, folder: tmp_path / "adapter-v0")
    folder = RunFolder(tmp_path / "run")
    config = _config(tiny_model_dir, lora=True, groups_in_flight=4, weight_sync_type="background_publish", lora_serving="adapter")
    with open_async_generator(config, folder, 0) as generator:
        for version in range(config.groups_in_flight):  # each group outlives the next publication
            assert asyncio.run(generator.start_group()) == version
            generator.publish(version + 1, folder.checkpoint_dir(version))
        held = {c[1] for c in fake_vllm.calls if c[0] == "add"} - {c[1] for c in fake_vllm.calls if c[0] == "remove"}
    assert len(held) == config.groups_in_flight + 1
    assert len(held) <= FakeServer.specs[0].max_loras, f"{len(held)} adapters in use, --max-loras {FakeServer.specs[0].max_loras}"


# ---------------------------------------------------------------- B5: a dead server during validation


def test_async_validation_against_a_dead_server_raises_and_seals_nothing(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from rollflow.generators.generator import GeneratorError, sampling_settings
    from rollflow.policy.models import ModelRef, load_tokenizer
    from rollflow.policy.vllm_backend import VLLMPolicy
    from rollflow.tasks.rollout import rollout_stage

    config = _config(tiny_model_dir, lora=True, lora_serving="adapter")  # the user's servers get adapters
    tokenizer = load_tokenizer(ModelRef(path=str(tiny_model_dir)))
    dead = VLLMPolicy([DEAD_URL], tokenizer, sampling_settings(config), served_model="policy")
    generator = AsyncGenerator(config, VLLMGenerator(config, None, dead, None, tokenizer, key=()), 4, None)
    folder = RunFolder(tmp_path / "run")
    with pytest.raises(GeneratorError, match="127.0.0.1:9"):
        rollout_stage(config, folder.step_paths(4, "validation").episodes, 4, "validation", generator.pinned_for_validation(4))
    assert folder.stage_output(4, "episodes", "validation") is None, "a validation of errors was sealed"
    assert not folder.part_paths(4, "episodes", "validation"), "errored episodes were written"


# ---------------------------------------------------------------- B7: publishing and stopping never hang


def test_an_interrupted_full_weight_publish_opens_the_group_gate_again(fake_vllm: FakePolicy, tmp_path: Path) -> None:
    class Interrupted(Exception):
        pass

    def interrupt(*_: object) -> None:
        raise Interrupted

    generator = _on_fake_server(_config(tmp_path, lora=False), fake_vllm)
    assert asyncio.run(generator.start_group()) == 0  # a running group: the swap waits for it
    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.3)  # SIGTERM / Ctrl-C while the publish waits
    try:
        with pytest.raises(Interrupted):
            generator.publish(1, tmp_path / "checkpoint")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert generator._accept_groups, "new groups could never start again"
    assert not [c for c in fake_vllm.calls if c[0] == "reload"]


def test_a_publish_waiting_for_groups_gives_up_when_the_generator_stops(fake_vllm: FakePolicy, tmp_path: Path) -> None:
    generator = _on_fake_server(_config(tmp_path, lora=False), fake_vllm)
    assert asyncio.run(generator.start_group()) == 0  # never finishes
    publishing = threading.Thread(target=generator.publish, args=(1, tmp_path / "checkpoint"), daemon=True)
    publishing.start()
    time.sleep(0.2)
    generator.stop()
    publishing.join(timeout=JOIN_S)
    assert not publishing.is_alive(), "the publisher still waits for a group on a stopped generator"
    assert not [c for c in fake_vllm.calls if c[0] == "reload"], "a stopping run swapped weights"
    assert asyncio.run(generator.start_group()) is None, "a stopped generator starts no group"


def test_a_stopped_generator_lets_a_request_waiting_behind_the_pause_go(fake_vllm: FakePolicy, tmp_path: Path) -> None:
    generator = _on_fake_server(_config(tmp_path, lora=False, weight_sync_type="pipeline"), fake_vllm)
    generator._accept_requests = False  # a pipeline swap in progress

    async def request_then_stop() -> None:
        waiting = asyncio.ensure_future(generator.enter_request())
        await asyncio.sleep(0.2)
        generator.stop()
        await asyncio.wait_for(waiting, JOIN_S)

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(request_then_stop())


def test_stopping_the_workers_ends_a_collector_blocked_behind_a_closed_gate(fake_vllm: FakePolicy, tmp_path: Path) -> None:
    config = _config(tmp_path, lora=False)
    generator = _on_fake_server(config, fake_vllm)
    generator._accept_groups = False  # a synchronous full-weight publish in progress
    folder = RunFolder(tmp_path / "run")
    folder.root.mkdir(parents=True)
    workers = RolloutWorkers(config, folder, generator, 0).start()
    time.sleep(0.3)  # the collector is now waiting in start_group
    stopping = threading.Thread(target=workers.stop, daemon=True)
    stopping.start()
    stopping.join(timeout=JOIN_S)
    assert not stopping.is_alive() and not workers._thread.is_alive(), "stop() waits on a collector that never stops"
