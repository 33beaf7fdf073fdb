"""The generator of an async run: one vLLM server holding every policy version in flight.

``tasks/collect.py``'s rollout workers play each group through ``group_policy(version)``,
pinned to the version published when the group started; the trainer publishes each new
version here (``publish``) and the generator swaps it in as its weight-sync type says (see
``tasks/collect.py``'s docstring: LoRA adapters side by side as ``policy-v{N}``, full
weights reloaded in place under a pause). ``open_generator`` starts the managed server (or
connects to the user's ``base_urls``) and stops it afterwards, also on failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from rollflow.envs.agent import Policy, PolicyAction, PolicySession
from rollflow.envs.types import Message, ToolSpec
from rollflow.policy.vllm_backend import VLLMPolicy, adapter_name, discover_served_model
from rollflow.storage.parquet import temporary_path
from rollflow.storage.runfolder import RunFolder
from rollflow.tasks.checkpoints import base_model_ref
from rollflow.tasks.config import RunConfig

POLL_S = 0.05


# ---------------------------------------------------------------- the generator


class _CountingSession:
    """A session that waits while the generator pauses requests, and counts its own."""

    def __init__(self, inner: PolicySession, generator: AsyncGenerator, versions: set[int]) -> None:
        self._inner, self._generator, self._versions = inner, generator, versions

    async def act(self, messages: Sequence[Message]) -> PolicyAction:
        version = await self._generator.enter_request()
        try:
            action = await self._inner.act(messages)
        finally:
            self._generator.leave_request()
        self._versions.add(version)
        return action

    async def close(self) -> None:
        await self._inner.close()


class _GroupPolicy:
    """The policy one group plays with: pinned to its start version (LoRA) or following
    the server's weights (full weights); records the versions that really sampled."""

    def __init__(self, inner: VLLMPolicy, generator: AsyncGenerator) -> None:
        self.inner, self.generator = inner, generator
        self.version = inner.version
        self.versions: set[int] = set()

    def open_session(self, tool_specs: Sequence[ToolSpec]) -> PolicySession:
        return _CountingSession(self.inner.open_session(tool_specs), self.generator, self.versions)


class AsyncGenerator:
    """The vLLM policy, the published version, and the rules for publishing a new one.

    Thread-safe: the trainer (or the publisher thread) publishes, the collector's event
    loop starts groups and requests; one lock guards the counts.
    """

    def __init__(self, config: RunConfig, policy: VLLMPolicy, version: int, model_source: Path) -> None:
        self.config = config
        self.policy = policy
        self.lora = config.train.use_lora
        self.pipeline = config.rollout.weight_sync_type == "pipeline"
        self._lock = threading.Condition()
        self.version = version  # the newest published version
        self._groups: Counter[int] = Counter()  # running groups by start version
        self._requests = 0
        self._accept_groups = True
        self._accept_requests = True
        self._adapters: set[int] = set()
        self.publish_s: list[float] = []
        if self.lora:
            self._load(version, model_source)
        else:
            self.policy.version = version

    # ---- the collector's side (event loop thread)

    async def start_group(self) -> int | None:
        """The version a new group starts under, once starting one is allowed."""
        while True:
            with self._lock:
                if self._accept_groups:
                    self._groups[self.version] += 1
                    return self.version
            await asyncio.sleep(POLL_S)

    def group_policy(self, version: int, seed: int) -> _GroupPolicy:
        adapter = adapter_name(version) if self.lora else None
        return _GroupPolicy(self.policy.pinned(version, adapter=adapter, seed=seed), self)

    def finish_group(self, version: int) -> int:
        """Forget a finished (or abandoned) group; returns the version it finished under."""
        with self._lock:
            self._groups[version] -= 1
            if not self._groups[version]:
                del self._groups[version]
            self._lock.notify_all()
            return self.version

    async def enter_request(self) -> int:
        while True:
            with self._lock:
                if self._accept_requests:
                    self._requests += 1
                    return self.version
            await asyncio.sleep(POLL_S)

    def leave_request(self) -> None:
        with self._lock:
            self._requests -= 1
            self._lock.notify_all()

    # ---- the trainer's side

    def publish(self, version: int, source: Path) -> None:
        """Make ``version`` (its checkpoint at ``source``) the one new groups start under."""
        started = time.perf_counter()
        if self.lora:
            self._load(version, source)
            with self._lock:
                self.version = version
            self.retire_unused()
        elif self.pipeline:  # pause requests: episodes in flight go on under the new weights
            self._swap_paused("_accept_requests", lambda: self._requests == 0, source, version)
        else:  # pause groups: each episode keeps the one version it started under
            self._swap_paused("_accept_groups", lambda: not self._groups, source, version)
        self.publish_s.append(time.perf_counter() - started)

    def _swap_paused(self, gate: str, drained: Callable[[], bool], source: Path, version: int) -> None:
        """Close ``gate`` (an ``_accept_*`` flag), wait until ``drained``, swap the full
        weights in place, then open the gate again (also when the swap fails)."""
        with self._lock:
            setattr(self, gate, False)
            self._lock.wait_for(drained)
        try:
            self.policy.reload_weights(source, version)
            with self._lock:
                self.version = version
        finally:
            with self._lock:
                setattr(self, gate, True)

    def retire_unused(self) -> None:
        """Unload the adapters of old versions no running group uses."""
        if not self.lora:
            return
        with self._lock:
            unused = [v for v in self._adapters if v < self.version and v not in self._groups]
            self._adapters.difference_update(unused)
        for version in unused:
            self.policy.remove_adapter(version)

    def pinned_for_validation(self, version: int) -> Policy:
        """A policy sampling exactly ``version`` (validation before step ``version``)."""
        adapter = adapter_name(version) if self.lora else None
        return self.policy.pinned(version, adapter=adapter, seed=self.config.train.seed)

    def _load(self, version: int, source: Path) -> None:
        self.policy.add_adapter(source, version)
        with self._lock:
            self._adapters.add(version)


# ---------------------------------------------------------------- opening it all


@contextlib.contextmanager
def open_generator(config: RunConfig, folder: RunFolder, first_step: int) -> Iterator[AsyncGenerator]:
    """The vLLM generator of an async run, serving version ``first_step``; stopped after.

    A managed server gets ``--max-loras`` for every version that can be in flight at once
    (``max_steps_off_policy + 2``: the oldest admissible, the newest, one being published).
    """
    from rollflow.policy.models import ModelRef, hf_model_folder, load_tokenizer
    from rollflow.policy.vllm_server import VLLMServer, VLLMServerSpec, lora_rank_limit, untied_serving_folder
    from rollflow.tasks.policy_io import SERVED_MODEL_NAME, VLLM_LOG, managed_policy, sampling_settings, stop_token_ids
    from rollflow.tasks.policy_io import step_checkpoint, stop_vllm_generator

    limit = config.rollout.max_steps_off_policy
    assert limit is not None
    checkpoint = step_checkpoint(folder, first_step)
    base = base_model_ref(config)
    model_dir = hf_model_folder(ModelRef(path=base.path, gguf_file=base.gguf_file))
    if not config.train.use_lora:  # full weights: reloaded in place, so served untied
        model_dir = untied_serving_folder(model_dir)
    if checkpoint is not None:
        source = checkpoint.path
    elif config.train.use_lora:
        source = Path(base.adapter) if base.adapter else fresh_adapter(config, folder)
    else:
        source = model_dir
    stop_vllm_generator()  # a lockstep server this process kept: never two at once
    server = None
    if not config.rollout.base_urls:
        spec = VLLMServerSpec(
            model_dir=str(model_dir),
            served_model_name=config.rollout.api_model or SERVED_MODEL_NAME,
            max_model_len=config.rollout.max_model_length,
            enable_lora=config.train.use_lora,
            max_lora_rank=lora_rank_limit(config.train.lora_rank) if config.train.use_lora else 16,
            max_loras=limit + 2,
            kvcache_space_gib=config.rollout.vllm_kvcache_space_gib,
            python=config.rollout.vllm_python,
        )
        server = VLLMServer(
            spec, log_path=folder.root / VLLM_LOG, startup_timeout_s=config.rollout.vllm_startup_timeout_s
        ).start()
    try:
        tokenizer, settings = load_tokenizer(base), sampling_settings(config)
        if server is not None:
            policy = managed_policy(server, tokenizer, settings)
        else:  # the user's servers, checked as lockstep checks them
            urls = config.rollout.base_urls
            served = config.rollout.api_model or discover_served_model(urls[0])
            policy = VLLMPolicy(urls, tokenizer, settings, served_model=served, stop_token_ids=stop_token_ids(model_dir))
            policy.connect(check_logprobs_mode=True)
        if not config.train.use_lora and checkpoint is not None:  # a resumed full-weight run
            policy.reload_weights(checkpoint.path, first_step)
        yield AsyncGenerator(config, policy, first_step, source)
    finally:
        if server is not None:
            server.stop()


def fresh_adapter(config: RunConfig, folder: RunFolder) -> Path:
    """Version 0 as an adapter: the trainer's own fresh LoRA (seeded, B = 0), saved once."""
    from rollflow.tasks.checkpoints import fresh_lora_policy

    target = folder.root / "async" / "policy-v0"
    if not (target / "adapter_config.json").exists():
        model = fresh_lora_policy(config)
        tmp = temporary_path(target)
        model.save_pretrained(str(tmp))
        tmp.rename(target)
    return target
