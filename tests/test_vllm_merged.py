"""LoRA served as merged weights, and an async collection that outlives its server, on a real
vLLM server (the tiny model of tests/tiny_run.py: 2 heads of 32, as vLLM's CPU attention needs).

- Lockstep, ``[rollout].lora_serving = "merged"`` (the default): each version's adapter is
  merged into the base and reloaded in place into one server started without
  ``--enable-lora``; every sampled token's logprob equals the trainer's (the peft model of
  that version, float32) within 1e-4, and only the served version's merged folder is kept.
- Async: the managed server is SIGKILLed while groups are in flight; the collector restarts
  it, discards the groups the death touched and plays their indices again, so every index
  is collected once, with no errored episode (before: the collector failed the run).
One server at a time: each test stops its own.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_async_training import _assert_sampled_by, async_config
from test_vllm_backend import _adapter, _act_all, _commit_checkpoint, _conversations, _with_adapter
from tiny_run import build_vllm_tiny_model
from transformers import AutoModelForCausalLM

from rollflow.generators.policy_io import step_policy
from rollflow.generators.run_generator import open_generator
from rollflow.generators.vllm_generator import SERVING_DIR, VLLM_LOG
from rollflow.policy.vllm_backend import VLLMPolicy
from rollflow.storage.async_groups import finished_groups, read_group
from rollflow.storage.runfolder import RunFolder

pytestmark = pytest.mark.slow

TOLERANCE = 1e-4
TIMEOUT_S = 600.0  # then give up: the assertions say what did not happen


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vllm_tiny_model(tmp_path_factory.mktemp("merged-tiny"))


def test_a_lora_run_served_merged_samples_each_versions_peft_logprobs_on_a_plain_server(
    model_dir: Path, tmp_path: Path
) -> None:
    config = async_config(model_dir, tmp_path)
    config = replace(config, rollout=replace(config.rollout, max_steps_off_policy=None))  # lockstep, LoRA, merged
    assert config.train.use_lora and config.rollout.lora_serving == "merged"
    folder = RunFolder(tmp_path / "run")
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with open_generator(config, folder, versions_in_flight=1) as generator:
        for step in (1, 2):
            adapter = _adapter(model_dir, tmp_path / f"adapter-{step}", seed=step)
            _commit_checkpoint(folder, step - 1, adapter, version=step)
            started = time.perf_counter()
            policy = step_policy(generator, folder, step)
            print(f"version {step}: merged and reloaded in {time.perf_counter() - started:.1f} s", file=sys.__stderr__)
            assert isinstance(policy, VLLMPolicy) and policy.version == step
            assert policy.request_model == "policy", "the served model itself, no adapter"
            actions = _act_all(policy, _conversations())
            trainer = _with_adapter(model_dir, adapter)  # the peft model of that version
            worst = max(_worst(trainer, a) for a in actions)
            moved = max(_worst(base, a) for a in actions)
            print(f"version {step}: worst gap to its peft model {worst:.2e}, to the base {moved:.2f}", file=sys.__stderr__)
            assert worst < TOLERANCE
            assert moved > 100 * TOLERANCE, "the check cannot tell the version from the base model"
            kept = [p.name for p in (folder.root / SERVING_DIR).iterdir() if not p.name.startswith(".")]
            assert kept == [f"policy-v{step}-merged"], "only the served version's merged folder is kept"
        server = generator.server
        assert server is not None and not server.spec.enable_lora
        assert "--enable-lora" not in server._command
        log = (folder.root / VLLM_LOG).read_text()
        assert log.count("Application startup complete") == 1, "the versions moved without a restart"
    assert not server.running and not (folder.root / SERVING_DIR).exists(), "closed: server stopped, cache gone"


def _worst(model: torch.nn.Module, action: object) -> float:
    from test_vllm_backend import _hf_logprobs

    expected = _hf_logprobs(model, action.prompt_delta_ids, action.token_ids, 1.0, 1.0)  # type: ignore[attr-defined]
    return max(abs(a - b) for a, b in zip(action.logprobs, expected, strict=True))  # type: ignore[attr-defined]


def test_an_async_collection_restarts_a_killed_managed_server_and_plays_the_lost_groups_again(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rollflow.generators.async_generator import open_async_generator
    from rollflow.tasks.collect import RolloutWorkers

    config = async_config(model_dir, tmp_path, groups_in_flight=2)  # LoRA merged, version 0: the base
    folder = RunFolder(tmp_path / "run")
    folder.root.mkdir(parents=True)
    wanted = 4  # what admission control lets start before the trainer takes any (limit 1, batch 2)
    with open_async_generator(config, folder, 0) as generator:
        server = generator.generator.server
        assert server is not None and server._process is not None
        workers = RolloutWorkers(config, folder, generator, 0).start()
        killed = threading.Event()

        def kill_mid_group() -> None:
            deadline = time.monotonic() + TIMEOUT_S
            while not finished_groups(folder) and time.monotonic() < deadline:
                time.sleep(0.01)
            served = sum(generator.generator.policy.stats.sampled_by.values())
            while sum(generator.generator.policy.stats.sampled_by.values()) <= served:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.005)
            assert server._process is not None
            os.killpg(server._process.pid, signal.SIGKILL)  # an OOM kill: the whole group
            killed.set()

        killer = threading.Thread(target=kill_mid_group, daemon=True)
        killer.start()
        try:
            deadline = time.monotonic() + TIMEOUT_S
            while len(finished_groups(folder)) < wanted and workers.buffer.error is None:
                assert time.monotonic() < deadline, "the collection stalled"
                time.sleep(0.1)
        finally:
            workers.stop()
        killer.join(timeout=1)
        restarts = generator.restarts
    assert workers.buffer.error is None, f"the collector failed: {workers.buffer.error}"
    assert killed.is_set(), "the killer never fired"
    assert restarts == 1 and server.restarts == 1
    err = capsys.readouterr().err
    assert "episodes errored and were not written; restart 1/2" in err, err[-3000:]
    log = (folder.root / VLLM_LOG).read_text()
    assert "rollflow: restarting the vLLM server: http://127.0.0.1:" in log
    stamps = finished_groups(folder)
    assert sorted(stamps)[:wanted] == list(range(wanted)), f"a lost group was not played again: {sorted(stamps)}"
    records = [r for index in sorted(stamps) for r in read_group(folder, index)]
    assert {r.rollout.error for r in records} == {None}, "a group the death touched was kept"
    assert {r.rollout.policy_version for r in records} == {0}
    _assert_sampled_by(AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval(), records, TOLERANCE)
