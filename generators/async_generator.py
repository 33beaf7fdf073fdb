"""The versions in flight of an async run, and the gates that pause its generator.

``tasks/collect.py``'s rollout workers play each group through ``group_policy(version)``,
pinned to the version published when the group started; the trainer publishes each new
version here (``publish``) and it reaches the run's vLLM generator
(``rollflow.generators.vllm_generator.VLLMGenerator``) as its weight-sync type says (see
``tasks/collect.py``'s docstring): LoRA adapters side by side as ``policy-<run>-v{N}``
(``[rollout].lora_serving = "adapter"``), or weights reloaded in place under a pause (full
weights, and LoRA merged into the base, the default). ``open_async_generator`` opens the run's
generator with one version in flight per running group plus two (``max_loaded_adapters``)
and closes it afterwards, also on failure.

Version 0 is the trainer's version 0: a LoRA run's start adapter (``[model].adapter``, or
the trainer's fresh one, ``fresh_adapter``), or for weights served in place the base
model, merged with ``[model].adapter`` when there is one. While open, it tells checkpoint
pruning which versions it still reads (``generators/checkpoints.py``'s
``checkpoints_to_keep``): its loaded adapters, the version whose weights the server holds
(a restart reloads them) and a publication in flight.

A server that stops answering is restarted as in lockstep (``RestartBudget``, asked by
each finished group, ``tasks/collect.py``): ``restart`` holds new requests while the
server comes back with every version it held, once however many groups saw the death. The
budget is renewed with each published version (lockstep's is per stage). A version whose
weights are gone cannot be brought back: the restart fails the run rather than serve other
weights under its name.

Stopping (``stop``, from ``RolloutWorkers.stop``): no group starts, a request waiting
behind a pause is cancelled, a publication waiting for groups gives up; the gates are
reopened whatever interrupts a publication.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from rollflow.config.run import RunConfig
from rollflow.envs.agent import PolicyAction, PolicySession
from rollflow.envs.types import Message, ToolSpec
from rollflow.generators.checkpoints import prune_checkpoints, reading_versions
from rollflow.generators.generator import GeneratorFault, RestartBudget
from rollflow.generators.managed_server import ServerHost
from rollflow.generators.policy_io import ActingPolicy, step_checkpoint
from rollflow.generators.run_generator import open_generator as open_run_generator
from rollflow.generators.vllm_generator import VLLMGenerator
from rollflow.policy.vllm_admin import VLLMPolicyError
from rollflow.policy.vllm_backend import VLLMPolicy
from rollflow.storage.parquet import temporary_path
from rollflow.storage.runfolder import RunFolder

POLL_S = 0.05


def max_loaded_adapters(config: RunConfig) -> int:
    """The most versions an async generator holds at once (its server's ``--max-loras``):
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
    """The policy one group plays with: pinned to its start version (adapters) or following
    the server's weights (in place); records the versions that really sampled."""

    def __init__(self, inner: VLLMPolicy, generator: AsyncGenerator) -> None:
        self.inner, self.generator = inner, generator
        self.version = inner.version
        self.versions: set[int] = set()

    def open_session(self, tool_specs: Sequence[ToolSpec]) -> PolicySession:
        return _CountingSession(self.inner.open_session(tool_specs), self.generator, self.versions)


class AsyncGenerator:
    """The run's generator, the published version, and the rules for publishing a new one.

    Thread-safe: the trainer (or the publisher thread) publishes, the collector's event
    loop starts groups and requests; one lock guards the counts.
    """

    def __init__(self, config: RunConfig, generator: VLLMGenerator, version: int, source: Path | None) -> None:
        self.config = config
        self.generator = generator
        self.in_place = generator.in_place  # one version on the server at a time
        self.pipeline = config.rollout.weight_sync_type == "pipeline"
        self._lock = threading.Condition()
        self._restart_lock = threading.Lock()  # a restart, a swap, an unload: one at a time
        self._fault_lock = threading.Lock()  # one fault check at a time
        # MAX_GENERATOR_RESTARTS for each published version's time, whichever replicas die in
        # it: the scope lockstep's budget has (a stage), not the whole run
        self._budget = RestartBudget()
        self.version = version  # the newest published version
        self.restarts = 0  # how often the server was restarted while open
        self._groups: Counter[int] = Counter()  # running groups by start version
        self._requests = 0
        self._accept_groups = True
        self._accept_requests = True
        self._restarting = False
        self._stopping = False
        self._publishing: set[int] = set()  # announced or being published
        self.publish_s: list[float] = []
        generator.publish(version, source)

    def adapter(self, version: int) -> str:
        """The name ``version``'s adapter is served under."""
        return self.generator.adapter(version)

    def versions_read(self) -> set[int]:
        """The versions whose checkpoints this generator may still read: its loaded adapters
        (vLLM re-reads an evicted adapter's folder), the full weights the server holds (a
        restart reloads them) and the ones being published."""
        with self._lock:
            return self.generator.versions_read() | self._publishing

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
        return _GroupPolicy(self.generator.pinned(version, seed), self)

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
                if self._accept_requests and not self._restarting:
                    self._requests += 1
                    return self.version
            await asyncio.sleep(POLL_S)

    def leave_request(self) -> None:
        with self._lock:
            self._requests -= 1
            self._lock.notify_all()

    # ---- faults (any thread)

    def fault(self) -> GeneratorFault | None:
        return self.generator.fault()

    def keep(self, errored: int, total: int, label: str, restarts_before: int) -> bool:
        """After a group: keep it, or discard it (False) because the server died under it
        (``RestartBudget.keep``, which restarts it) or was restarted while it played with
        errored episodes (they may be the dead server's). Blocking: call it off the loop."""
        with self._fault_lock:
            if errored and self.restarts != restarts_before:
                return False
            return self._budget.keep(self, errored, total, label)

    def restart(self, reason: str) -> None:
        """Bring the server back with every version it held, holding new requests
        meanwhile; a no-op when another caller already brought it back."""
        with self._restart_lock:
            if self.generator.fault() is None:
                return
            with self._lock:
                self._restarting = True
            try:
                self.generator.restart(reason, exact=True)  # no later policy_for repairs what it serves
                self.restarts += 1
            finally:
                with self._lock:
                    self._restarting = False
                    self._lock.notify_all()

    # ---- the trainer's side

    def announce(self, version: int) -> None:
        """``version`` is about to be published: its checkpoint is read from now on."""
        with self._lock:
            self._publishing.add(version)

    def publish(self, version: int, source: Path) -> None:
        """Make ``version`` (its checkpoint at ``source``) the one new groups start under."""
        started = time.perf_counter()
        self.announce(version)
        try:
            if not self.in_place:
                with self._restart_lock:
                    self.generator.publish(version, source)
                with self._lock:
                    self.version = version
                self.retire_unused()
            else:
                self.generator.serving_folder(version, source)  # merged before the pause, if merged
                if self.pipeline:  # pause requests: episodes in flight go on under the new weights
                    self._swap_paused("_accept_requests", lambda: self._requests == 0, source, version)
                else:  # pause groups: each episode keeps the one version it started under
                    self._swap_paused("_accept_groups", lambda: not self._groups, source, version)
        finally:
            with self._lock:
                self._publishing.discard(version)
        self._budget = RestartBudget()  # a new version's window (read by keep under _fault_lock)
        self.publish_s.append(time.perf_counter() - started)

    def _swap_paused(self, gate: str, drained: Callable[[], bool], source: Path, version: int) -> None:
        """Close ``gate`` (an ``_accept_*`` flag), wait until ``drained``, swap the weights
        in place, then open the gate again, also when the wait or the swap fails or is
        interrupted (SIGTERM, Ctrl-C). A generator stopped meanwhile swaps nothing."""
        try:
            with self._lock:
                setattr(self, gate, False)
                self._lock.wait_for(lambda: drained() or self._stopping)
                if self._stopping:
                    return
            with self._restart_lock:  # never into a server being restarted
                self.generator.publish(version, source)
            with self._lock:
                self.version = version
        finally:
            with self._lock:
                setattr(self, gate, True)
                self._lock.notify_all()

    def retire_unused(self) -> None:
        """Unload the adapters of old versions no running group uses."""
        if self.in_place:
            return
        with self._lock:  # a copy: the publisher thread adds and removes adapters under _restart_lock
            unused = [v for v in self.generator.adapters.copy() if v < self.version and v not in self._groups]
        for version in unused:
            with self._restart_lock:
                try:
                    self.generator.retire(version)
                except VLLMPolicyError:
                    if self.generator.fault() is None:
                        raise  # else a restart loads only the adapters still held

    def policy_for(self, version: int, checkpoint: Path | None) -> VLLMPolicy:
        """A policy sampling exactly ``version`` (published) with the run's seed."""
        return self.generator.pinned(version, self.config.train.seed)

    def pinned_for_validation(self, version: int) -> ActingPolicy:
        """A policy sampling exactly ``version`` (validation before step ``version``),
        watched: a dead managed server is restarted, an external one fails the stage
        before anything is sealed."""
        return ActingPolicy(self.policy_for(version, None), self, version)


# ---------------------------------------------------------------- opening it all


@contextlib.contextmanager
def open_async_generator(
    config: RunConfig, folder: RunFolder, first_step: int, *, host: ServerHost | None = None,
    cpus: Sequence[int] = (),
) -> Iterator[AsyncGenerator]:  # fmt: skip
    """The generator of an async run, serving version ``first_step``; closed after. ``host``:
    where its managed servers start, ``cpus`` the cores they are bound to (``open_generator``).

    A managed server serving adapters gets ``--max-loras`` for every adapter the generator
    can hold at once (``max_loaded_adapters``), so none is evicted and read again.
    """
    checkpoint = step_checkpoint(folder, first_step)
    in_flight = max_loaded_adapters(config)
    with open_run_generator(config, folder, versions_in_flight=in_flight, host=host, cpus=cpus) as generator:
        assert isinstance(generator, VLLMGenerator), "async collection needs [rollout].backend = 'vllm'"
        source = checkpoint.path if checkpoint is not None else start_source(config, folder, generator)
        async_generator = AsyncGenerator(config, generator, first_step, source)
        with reading_versions(folder, async_generator.versions_read):
            yield async_generator
        prune_checkpoints(folder, config.train.keep_checkpoints)  # what only the generator held


def start_source(config: RunConfig, folder: RunFolder, generator: VLLMGenerator) -> Path | None:
    """What version 0 is served from: the trainer's version 0 (``load_policy_for_training``).

    Adapters: ``[model].adapter`` or the trainer's fresh adapter (vLLM on CPU must never
    batch base and adapter requests). In place: None, the generator's own start (the base
    model, merged with ``[model].adapter`` when there is one)."""
    if generator.in_place:
        return None
    adapter = config.model.adapter
    return Path(adapter) if adapter else fresh_adapter(config, folder)


def fresh_adapter(config: RunConfig, folder: RunFolder) -> Path:
    """Version 0 as an adapter: the trainer's own fresh LoRA (seeded, B = 0), saved once."""
    from rollflow.generators.models import fresh_lora_policy

    target = folder.root / "async" / "policy-v0"
    if not (target / "adapter_config.json").exists():
        model = fresh_lora_policy(config)
        tmp = temporary_path(target)
        model.save_pretrained(str(tmp))
        tmp.rename(target)
    return target
