"""The generator of an async run: one vLLM server holding every policy version in flight.

``tasks/collect.py``'s rollout workers play each group through ``group_policy(version)``,
pinned to the version published when the group started; the trainer publishes each new
version here (``publish``) and the generator swaps it in as its weight-sync type says (see
``tasks/collect.py``'s docstring: LoRA adapters side by side as ``policy-<run>-v{N}``, full
weights reloaded in place under a pause). ``open_generator`` starts the managed server (or
connects to the user's ``base_urls``) and stops it afterwards, also on failure.

Version 0 is the trainer's version 0: a LoRA run's start adapter (``[model].adapter``, or
the trainer's fresh one), or for full weights the base model, merged with
``[model].adapter`` when there is one (``merged_start``). While open, the generator tells
checkpoint pruning which versions it still reads (``tasks/checkpoints.py``'s
``checkpoints_to_keep``): its loaded adapters and a publication in flight.

Stopping (``stop``, from ``RolloutWorkers.stop``): no group starts, a request waiting
behind a pause is cancelled, a publication waiting for groups gives up; the gates are
reopened whatever interrupts a publication.

Simplified, and why: a server that stops answering fails the run (a validation raises
``GeneratorError`` rather than sealing errored episodes); it is not restarted in-process,
since the rollout workers' groups in flight share it; the resume starts a fresh one.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rollflow.envs.agent import PolicyAction, PolicySession
from rollflow.envs.types import Message, ToolSpec
from rollflow.policy.procs import fault_point
from rollflow.policy.vllm_backend import VLLMPolicy, adapter_name, discover_served_model
from rollflow.storage.parquet import temporary_path
from rollflow.storage.runfolder import RunFolder
from rollflow.tasks.checkpoints import base_model_ref, prune_checkpoints, reading_versions
from rollflow.tasks.config import RunConfig
from rollflow.tasks.policy_io import ActingPolicy, GeneratorError, GeneratorFault, run_adapter_prefix, server_fault

if TYPE_CHECKING:
    from rollflow.policy.vllm_server import VLLMServer

POLL_S = 0.05
NOT_RESTARTED = (
    "an async run's generator is not restarted mid-run (the rollout workers' groups share "
    "it): resume the run; finished groups and validation chunks are kept"
)


def max_loaded_adapters(config: RunConfig) -> int:
    """The most LoRA adapters an async generator holds at once (its server's ``--max-loras``):
    one per running group, which pins its start version until it finishes however many
    versions ago that was, plus the published version and the one being published."""
    return config.groups_in_flight + 2


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

    def __init__(
        self, config: RunConfig, policy: VLLMPolicy, version: int, model_source: Path, *,
        adapter_prefix: str = "policy", server: VLLMServer | None = None,
    ) -> None:  # fmt: skip
        self.config = config
        self.policy = policy
        self.server = server  # None: the user's base_urls
        self.adapter_prefix = adapter_prefix  # the run's adapter names (run_adapter_prefix)
        self.lora = config.train.use_lora
        self.pipeline = config.rollout.weight_sync_type == "pipeline"
        self._lock = threading.Condition()
        self.version = version  # the newest published version
        self._groups: Counter[int] = Counter()  # running groups by start version
        self._requests = 0
        self._accept_groups = True
        self._accept_requests = True
        self._stopping = False
        self._adapters: set[int] = set()  # loaded on the server
        self._publishing: set[int] = set()  # announced or being published
        self.publish_s: list[float] = []
        if self.lora:
            self._load(version, model_source)
        else:
            self.policy.version = version

    def adapter(self, version: int) -> str:
        """The name ``version``'s adapter is served under."""
        return adapter_name(self.adapter_prefix, version)

    def versions_read(self) -> set[int]:
        """The versions whose checkpoints this generator may still read: its loaded adapters
        (vLLM re-reads an evicted adapter's folder) and the ones being published."""
        with self._lock:
            return self._adapters | self._publishing

    def stop(self) -> None:
        """The run is stopping: start no group, cancel requests waiting behind a pause,
        give up a publication still waiting for groups."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()

    # ---- the collector's side (event loop thread)

    async def start_group(self) -> int | None:
        """The version a new group starts under, once starting one is allowed; None once
        the generator stops."""
        while True:
            with self._lock:
                if self._stopping:
                    return None
                if self._accept_groups:
                    self._groups[self.version] += 1
                    return self.version
            await asyncio.sleep(POLL_S)

    def group_policy(self, version: int, seed: int) -> _GroupPolicy:
        adapter = self.adapter(version) if self.lora else None
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
        """The version a request samples, once requests may go; a stopped generator cancels
        the group (never an episode error: a cancelled group is not written)."""
        while True:
            with self._lock:
                if self._stopping:
                    raise asyncio.CancelledError
                if self._accept_requests:
                    self._requests += 1
                    return self.version
            await asyncio.sleep(POLL_S)

    def leave_request(self) -> None:
        with self._lock:
            self._requests -= 1
            self._lock.notify_all()

    # ---- the trainer's side

    def announce(self, version: int) -> None:
        """``version`` is about to be published: its checkpoint is read from now on."""
        with self._lock:
            self._publishing.add(version)

    def publish(self, version: int, source: Path) -> None:
        """Make ``version`` (its checkpoint at ``source``) the one new groups start under."""
        fault_point("weight_publish")  # tests: a kill while a new version goes to the server
        started = time.perf_counter()
        self.announce(version)
        try:
            if self.lora:
                self._load(version, source)
                with self._lock:
                    self.version = version
                self.retire_unused()
            elif self.pipeline:  # pause requests: episodes in flight go on under the new weights
                self._swap_paused("_accept_requests", lambda: self._requests == 0, source, version)
            else:  # pause groups: each episode keeps the one version it started under
                self._swap_paused("_accept_groups", lambda: not self._groups, source, version)
        finally:
            with self._lock:
                self._publishing.discard(version)
        self.publish_s.append(time.perf_counter() - started)

    def _swap_paused(self, gate: str, drained: Callable[[], bool], source: Path, version: int) -> None:
        """Close ``gate`` (an ``_accept_*`` flag), wait until ``drained``, swap the full
        weights in place, then open the gate again, also when the wait or the swap fails or
        is interrupted (SIGTERM, Ctrl-C). A generator stopped meanwhile swaps nothing."""
        try:
            with self._lock:
                setattr(self, gate, False)
                self._lock.wait_for(lambda: drained() or self._stopping)
                if self._stopping:
                    return
            self.policy.reload_weights(source, version)
            with self._lock:
                self.version = version
        finally:
            with self._lock:
                setattr(self, gate, True)
                self._lock.notify_all()

    def retire_unused(self) -> None:
        """Unload the adapters of old versions no running group uses."""
        if not self.lora:
            return
        with self._lock:
            unused = [v for v in self._adapters if v < self.version and v not in self._groups]
            self._adapters.difference_update(unused)
        for version in unused:
            self.policy.remove_adapter(self.adapter(version))

    def pinned_for_validation(self, version: int) -> ActingPolicy:
        """A policy sampling exactly ``version`` (validation before step ``version``),
        watched: a server that stops answering fails the stage before anything is sealed."""
        adapter = self.adapter(version) if self.lora else None
        pinned = self.policy.pinned(version, adapter=adapter, seed=self.config.train.seed)
        return ActingPolicy(pinned, _ServerWatch(self.server, self.policy.base_urls))

    def _load(self, version: int, source: Path) -> None:
        self.policy.add_adapter(source, self.adapter(version))
        with self._lock:
            self._adapters.add(version)
            held, limit = len(self._adapters), max_loaded_adapters(self.config)
        assert held <= limit, f"{held} adapters loaded, above --max-loras {limit} (max_loaded_adapters)"


class _ServerWatch:
    """The async generator's servers, watched by a validation stage (``GeneratorWatch``)."""

    def __init__(self, server: VLLMServer | None, base_urls: Sequence[str]) -> None:
        self.server, self.base_urls = server, tuple(base_urls)

    def fault(self) -> GeneratorFault | None:
        return server_fault(self.server, self.base_urls)

    def restart(self, fault: GeneratorFault) -> VLLMPolicy:
        raise GeneratorError(f"{fault.describe()}; {NOT_RESTARTED}")


# ---------------------------------------------------------------- opening it all


@contextlib.contextmanager
def open_generator(config: RunConfig, folder: RunFolder, first_step: int) -> Iterator[AsyncGenerator]:
    """The vLLM generator of an async run, serving version ``first_step``; stopped after.

    A managed server gets ``--max-loras`` for every adapter the generator can hold at once
    (``max_loaded_adapters``), so no adapter is evicted and read from its folder again.
    """
    from rollflow.policy.models import ModelRef, hf_model_folder, load_tokenizer
    from rollflow.policy.vllm_server import VLLMServer, VLLMServerSpec, lora_rank_limit, untied_serving_folder
    from rollflow.tasks.policy_io import SERVED_MODEL_NAME, VLLM_LOG, managed_policy, sampling_settings, stop_token_ids
    from rollflow.tasks.policy_io import step_checkpoint, stop_vllm_generator

    checkpoint = step_checkpoint(folder, first_step)
    base = base_model_ref(config)
    model_dir = hf_model_folder(ModelRef(path=base.path, gguf_file=base.gguf_file))
    if not config.train.use_lora:  # full weights: reloaded in place, so served untied
        model_dir = untied_serving_folder(model_dir)
    source = checkpoint.path if checkpoint is not None else start_source(config, folder, model_dir)
    stop_vllm_generator()  # a lockstep server this process kept: never two at once
    server = None
    if not config.rollout.base_urls:
        spec = VLLMServerSpec(
            model_dir=str(model_dir),
            served_model_name=config.rollout.api_model or SERVED_MODEL_NAME,
            max_model_len=config.rollout.max_model_length,
            enable_lora=config.train.use_lora,
            max_lora_rank=lora_rank_limit(config.train.lora_rank) if config.train.use_lora else 16,
            max_loras=max_loaded_adapters(config),
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
        if not config.train.use_lora and source != model_dir:  # a checkpoint, or a merged start
            policy.reload_weights(source, first_step)
        generator = AsyncGenerator(
            config, policy, first_step, source, adapter_prefix=run_adapter_prefix(folder), server=server
        )
        with reading_versions(folder, generator.versions_read):
            yield generator
        prune_checkpoints(folder, config.train.keep_checkpoints)  # what only the generator held
    finally:
        if server is not None:
            server.stop()


def start_source(config: RunConfig, folder: RunFolder, model_dir: Path) -> Path:
    """What version 0 is served from: the trainer's version 0 (``load_policy_for_training``)."""
    adapter = config.model.adapter
    if config.train.use_lora:
        return Path(adapter) if adapter else fresh_adapter(config, folder)
    return merged_start(config, folder) if adapter else model_dir


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


def merged_start(config: RunConfig, folder: RunFolder) -> Path:
    """Version 0 of a full-weight run from ``[model].adapter``, as the trainer builds it
    (base + adapter, merged), saved once as a folder vLLM reloads in place: a tied output
    layer as its own shard, as full-weight checkpoints carry it."""
    from rollflow.policy.vllm_server import write_lm_head_shard
    from rollflow.tasks.checkpoints import load_policy_for_training

    target = folder.root / "async" / "policy-v0-merged"
    if not target.is_dir():  # renamed into place whole
        model, tokenizer = load_policy_for_training(config, None)
        tmp = temporary_path(target)
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        if getattr(model.config, "tie_word_embeddings", False):
            write_lm_head_shard(tmp, model.get_input_embeddings().weight)
        tmp.rename(target)
    return target
