"""The async generator when servers die and replicas share the work (the third review's
R1, R2, R6 and R7): what a restart may serve, how long its budget lasts, which replica
samples each episode, and the adapters dict shared by two threads.

No vLLM server: the fake server and policy (tests/fake_vllm.py) record restarts and
reloads; the replicas' URLs are never contacted (dealing happens when a session opens).
"""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import pytest

from rollflow.generators.async_generator import AsyncGenerator
from rollflow.generators.generator import GeneratorError, sampling_settings
from rollflow.generators.vllm_generator import VLLMGenerator
from rollflow.policy.models import ModelRef, load_tokenizer
from rollflow.policy.vllm_backend import VLLMPolicy
from rollflow.policy.vllm_spec import VLLMServerSpec
from rollflow.storage.runfolder import RunFolder
from fake_vllm import FakePolicy, FakeServer
from test_async_generator import _config


def _generator(config, policy, tiny_model_dir: Path, folder: RunFolder | None = None) -> VLLMGenerator:  # noqa: ANN001
    server = FakeServer(VLLMServerSpec(str(tiny_model_dir)))
    return VLLMGenerator(config, folder, policy, server, None, key=())  # type: ignore[arg-type]


def _kill(generator: AsyncGenerator) -> None:
    generator.generator.servers[0].running = False


# ---------------------------------------------------------------- R1: no base model under a version's name


def test_an_async_restart_whose_held_weights_were_pruned_fails_rather_than_serve_the_base_model(
    fake_vllm: FakePolicy, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Before: the restarted server came back on its spec's own (base) weights while the
    generator still called them version 1, and every group sampled them as version 1."""
    config = _config(tiny_model_dir, lora=False, weight_sync_type="pipeline")
    folder = RunFolder(tmp_path / "run")
    checkpoint = folder.checkpoint_dir(0)  # version 1, full weights: reloaded from its checkpoint
    shutil.copytree(tiny_model_dir, checkpoint)
    generator = AsyncGenerator(config, _generator(config, fake_vllm, tiny_model_dir, folder), 1, checkpoint)
    assert fake_vllm.calls[-1] == ("reload", checkpoint, 1)
    shutil.rmtree(checkpoint)  # pruned by a process that did not know the generator reads it
    _kill(generator)
    with pytest.raises(GeneratorError, match=r"version 1's weights \(.*step=0.*\) are gone"):
        generator.restart("the server was killed by the test")
    assert fake_vllm.calls[-1] == ("reload", checkpoint, 1), "other weights were loaded under version 1's name"
    assert generator.generator.servers[0].restarts == 0, "a server was restarted to serve the wrong weights"


def test_an_async_restart_with_its_weights_on_disk_reloads_them(
    fake_vllm: FakePolicy, tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = _config(tiny_model_dir, lora=False, weight_sync_type="pipeline")
    folder = RunFolder(tmp_path / "run")
    checkpoint = folder.checkpoint_dir(0)
    shutil.copytree(tiny_model_dir, checkpoint)
    generator = AsyncGenerator(config, _generator(config, fake_vllm, tiny_model_dir, folder), 1, checkpoint)
    _kill(generator)
    generator.restart("the server was killed by the test")
    assert fake_vllm.calls[-1] == ("reload", checkpoint, 1) and generator.restarts == 1


# ---------------------------------------------------------------- R6: a budget per version, as lockstep's per stage


def test_the_restart_budget_of_an_async_run_is_renewed_by_each_published_version(
    fake_vllm: FakePolicy, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Before: two restarts for the whole run, shared by every replica: the third death,
    however far apart, failed the run."""
    config = _config(tiny_model_dir, lora=False, weight_sync_type="pipeline")
    folder = RunFolder(tmp_path / "run")
    generator = AsyncGenerator(config, _generator(config, fake_vllm, tiny_model_dir, folder), 0, None)
    for version in range(1, 4):  # a death in each version's window: each one is restarted
        _kill(generator)
        assert not generator.keep(1, 4, f"group of version {version - 1}", generator.restarts)
        checkpoint = folder.checkpoint_dir(version - 1)
        shutil.copytree(tiny_model_dir, checkpoint)
        generator.publish(version, checkpoint)
    assert generator.restarts == 3
    for _ in range(2):  # within one window: the lockstep limit holds
        _kill(generator)
        generator.keep(1, 4, "a group", generator.restarts)
    _kill(generator)
    with pytest.raises(GeneratorError, match="after 2 restarts"):
        generator.keep(1, 4, "a group", generator.restarts)


# ---------------------------------------------------------------- R7: the adapters dict of two threads


class _PublishedMeanwhile(dict):
    """An adapters dict into which the publisher thread inserts a version while it is read:
    the interleaving the GIL allows between two bytecodes of a loop over it."""

    def __iter__(self):  # noqa: ANN204
        keys = dict.__iter__(self)
        yield next(keys)
        self[max(dict.keys(self)) + 1] = Path("published-meanwhile")
        yield from keys


def test_retiring_unused_adapters_reads_a_copy_of_what_the_publisher_changes(
    fake_vllm: FakePolicy, tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = _config(tiny_model_dir, lora=True, lora_serving="adapter")
    generator = AsyncGenerator(config, _generator(config, fake_vllm, tiny_model_dir), 0, None)
    generator.generator.adapters = _PublishedMeanwhile({0: tmp_path / "v0", 1: tmp_path / "v1"})
    generator.version = 2
    generator.retire_unused()  # before: RuntimeError, dictionary changed size during iteration


# ---------------------------------------------------------------- R2: replicas dealt evenly in both schedules


def test_async_groups_deal_their_episodes_over_every_replica_even_with_more_replicas_than_episodes(
    tiny_model_dir: Path,
) -> None:
    """Before: each group's pinned view dealt from replica 0, so 3 replicas of 2-episode
    groups got {0: 12, 1: 12, 2: 0}."""
    config = _config(tiny_model_dir, lora=False, weight_sync_type="pipeline", num_generator_replicas=3)
    tokenizer = load_tokenizer(ModelRef(path=str(tiny_model_dir)))
    urls = [f"http://127.0.0.1:{port}/v1" for port in (9, 10, 11)]  # never contacted
    policy = VLLMPolicy(urls, tokenizer, sampling_settings(config), served_model="policy")
    generator = AsyncGenerator(config, VLLMGenerator(config, None, policy, None, tokenizer, key=()), 0, None)
    async_dealt: Counter[int] = Counter()
    for group in range(12):  # 12 groups of episodes_per_task = 2 episodes
        view = generator.group_policy(0, seed=group)
        for _ in range(config.rollout.episodes_per_task):
            async_dealt[view.open_session(())._inner._first_server] += 1
    assert dict(async_dealt) == {0: 8, 1: 8, 2: 8}
    lockstep = VLLMPolicy(urls, tokenizer, sampling_settings(config), served_model="policy")
    assert Counter(lockstep.open_session(())._first_server for _ in range(24)) == async_dealt
