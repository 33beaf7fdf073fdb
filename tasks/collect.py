"""Async collection: rollout workers play groups beside the trainer; the trainer admits them.

With ``[rollout].max_steps_off_policy`` set, a background thread keeps
``groups_in_flight`` GRPO groups playing at once on the vLLM generator, each under the
newest policy version published when it **started**, and writes every finished group to
the run folder::

    async/groups/group-000017.parquet   the group's episodes (episodes schema; step = its start version)
    async/groups/group-000017.json      its stamps, written last: the group is finished
    steps/step=000004/admission.json    which groups step 4 trained and which it dropped

Group ``n`` plays the ``n``-th training task of the run (the lockstep order:
``select_train_tasks`` with one task a step), so the data position is the group index.

The trainer's step ``s`` (it trains version ``s`` into ``s + 1``) takes ``batch_size``
finished groups, oldest start version first. A group's age is ``s - start_version``, the
optimizer steps since its rollout started; a group older than ``max_steps_off_policy``
is dropped as stale when the trainer would take it, counted in the admission file and
``async/dropped_stale_groups``, never in ``zero_variance_skip_ratio``. ``0`` admits only
groups started under the current policy.

Admission control (``[rollout].admission_control``, on by default): a worker does not
start a group that would be stale by the time the trainer can take it. The groups
already started and not yet taken are ahead of it, so it would be taken at step
``s + (ahead // batch_size)``; it starts only if that minus the current version is within
the limit, and waits otherwise. Off, groups start freely and the trainer's drop is the
only guard (the reference's behaviour).

Publication (``weight_sync_type``), after each training step, of version ``s + 1``:

- LoRA: the adapter is loaded beside the others as ``policy-v{s+1}``; a group's every
  request names its start version's adapter, so an episode is sampled by one version
  from first token to last; an adapter is unloaded once no running group uses it.
  Version 0 is served as an adapter too (a fresh one, whose zero B matrices leave the
  base model's outputs unchanged): vLLM on CPU must never batch base and adapter requests.
- Full weights: the server holds one version. ``pipeline`` pauses new requests, lets the
  running ones finish, swaps the weights in place (``VLLMPolicy.reload_weights``) and
  resumes: episodes in flight continue under the new weights, and their group records
  the version it finished under. ``synchronous`` / ``background_publish`` with full
  weights stop starting groups and let the running ones finish first (so each episode
  keeps one version), then swap.
- ``synchronous`` publishes inline (the trainer waits); ``background_publish`` and
  ``pipeline`` hand it to a publisher thread and the trainer goes on at once.

Resume: the files are the state. Groups already named by an admission file are never
taken again; finished groups not yet taken stay in the buffer with their original start
version (so their age is counted honestly); group indices below the highest finished
one that have no file were in flight when the run died and are played again, first. An
admission file is written before the step's episodes, so a step resumed after it trains
exactly the groups it chose.

Simplified, and why: the generator is vLLM only (a generator beside the trainer needs
its own process: the in-process transformers backend would share the trainer's Python
and cores); one event loop thread plays every group; a generator failure fails the run
(finished groups are on disk, the resume replays the rest) rather than restarting here.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from rollflow.envs.agent import Policy, PolicyAction, PolicySession
from rollflow.envs.episode import EpisodeRollout
from rollflow.envs.runner import EnvironmentHandle, TaskItem, load_environment_handle, play_groups
from rollflow.envs.types import Message, ToolSpec
from rollflow.policy.vllm_backend import VLLMPolicy, adapter_name, discover_served_model
from rollflow.storage.parquet import read_table, temporary_path, write_table_atomic
from rollflow.storage.records import EpisodeRecord
from rollflow.storage.runfolder import RunFolder
from rollflow.storage.schemas import episode_records_to_table, table_to_episode_records
from rollflow.tasks.checkpoints import base_model_ref
from rollflow.tasks.config import RunConfig
from rollflow.tasks.rollout import derive_seed, episode_limits, select_train_tasks

GROUPS_DIR = Path("async") / "groups"
ADMISSION_JSON = "admission.json"
POLL_S = 0.05


class CollectionError(RuntimeError):
    """The rollout workers failed (the generator died, an environment could not load...)."""


# ---------------------------------------------------------------- files


@dataclass(frozen=True)
class GroupStamp:
    """What ``group-NNNNNN.json`` says of a finished group."""

    index: int  # the data position: the index-th training task of the run
    task_id: str
    start_version: int  # the policy version every episode of the group started under
    finish_version: int  # the version the generator held when the group finished
    started_s: float  # wall clock (time.time())
    finished_s: float


def group_paths(folder: RunFolder, index: int) -> tuple[Path, Path]:
    base = folder.root / GROUPS_DIR / f"group-{index:06d}"
    return base.with_suffix(".parquet"), base.with_suffix(".json")


def finished_groups(folder: RunFolder) -> dict[int, GroupStamp]:
    """Every group whose stamp exists (the stamp is written after the episodes)."""
    found: dict[int, GroupStamp] = {}
    directory = folder.root / GROUPS_DIR
    if not directory.is_dir():
        return found
    for path in sorted(directory.glob("group-*.json")):
        stamp = GroupStamp(**folder.read_json(path))
        found[stamp.index] = stamp
    return found


def write_group(folder: RunFolder, stamp: GroupStamp, rollouts: Sequence[EpisodeRollout]) -> None:
    episodes_path, stamp_path = group_paths(folder, stamp.index)
    group_id = f"collect/{stamp.index}"
    records = [
        EpisodeRecord(
            run_id=folder.run_id, step=stamp.start_version, split="train", task_id=stamp.task_id,
            group_id=group_id, episode_id=f"{group_id}/{i}", index_in_group=i, rollout=rollout,
        )  # fmt: skip
        for i, rollout in enumerate(rollouts)
    ]
    episodes_path.parent.mkdir(parents=True, exist_ok=True)
    write_table_atomic(episode_records_to_table(records), episodes_path)
    folder.write_json_atomic(stamp_path, asdict(stamp))


def read_group(folder: RunFolder, index: int) -> list[EpisodeRecord]:
    return table_to_episode_records(read_table(group_paths(folder, index)[0]))


@dataclass(frozen=True)
class Admission:
    """One training step's choice: the groups it trains and the stale ones it dropped."""

    step: int
    admitted: tuple[int, ...]
    dropped: tuple[int, ...]
    train_wait_s: float


def admission_path(folder: RunFolder, step: int) -> Path:
    return folder.step_dir(step) / ADMISSION_JSON


def read_admission(folder: RunFolder, step: int) -> Admission | None:
    path = admission_path(folder, step)
    if not path.exists():
        return None
    data = folder.read_json(path)
    groups = data["groups"]
    return Admission(
        step=int(data["step"]),
        admitted=tuple(g["group"] for g in groups if g["admitted"]),
        dropped=tuple(g["group"] for g in groups if not g["admitted"]),
        train_wait_s=float(data["train_wait_s"]),
    )


def write_admission(folder: RunFolder, admission: Admission, stamps: dict[int, GroupStamp]) -> Path:
    """``admission.json``: one row per group the step took or dropped, with its age."""
    rows = []
    for index, admitted in [*((i, True) for i in admission.admitted), *((i, False) for i in admission.dropped)]:
        stamp = stamps[index]
        rows.append({
            "group": index, "task_id": stamp.task_id, "admitted": admitted,
            "trained_group_id": f"train/{admission.step}/{admission.admitted.index(index)}" if admitted else None,
            "start_version": stamp.start_version, "finish_version": stamp.finish_version,
            "staleness": admission.step - stamp.start_version,
            "collect_s": stamp.finished_s - stamp.started_s,
        })  # fmt: skip
    data = {"step": admission.step, "train_wait_s": admission.train_wait_s, "groups": rows}
    return folder.write_json_atomic(admission_path(folder, admission.step), data)


def consumed_groups(folder: RunFolder) -> set[int]:
    """Groups some step already took or dropped: never offered again."""
    taken: set[int] = set()
    for step in folder.steps("train"):
        admission = read_admission(folder, step)
        if admission is not None:
            taken.update(admission.admitted)
            taken.update(admission.dropped)
    return taken


def step_episode_records(folder: RunFolder, admission: Admission) -> list[EpisodeRecord]:
    """The step's episodes: the admitted groups' rows, renamed into the step's groups.

    ``policy_version`` keeps each episode's start version, so ``step - policy_version`` in
    the ``episodes`` view is how stale every trained episode was.
    """
    records = []
    for k, index in enumerate(admission.admitted):
        group_id = f"train/{admission.step}/{k}"
        for record in read_group(folder, index):
            records.append(EpisodeRecord(
                run_id=record.run_id, step=admission.step, split="train", task_id=record.task_id,
                group_id=group_id, episode_id=f"{group_id}/{record.index_in_group}",
                index_in_group=record.index_in_group, rollout=record.rollout,
            ))  # fmt: skip
    return records


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


# ---------------------------------------------------------------- the workers


@dataclass
class _Buffer:
    """What the trainer and the workers share (under ``RolloutWorkers.lock``)."""

    finished: dict[int, GroupStamp]  # finished, not yet taken or dropped
    replay: list[int]  # indices in flight when a previous process died: played first
    next_index: int
    started: int = 0  # groups started by this process, not yet finished
    trainer_step: int = 0  # the step the trainer takes groups for next
    error: BaseException | None = None


class RolloutWorkers:
    """The collector thread: ``groups_in_flight`` groups at once, each to a file."""

    def __init__(self, config: RunConfig, folder: RunFolder, generator: AsyncGenerator, first_step: int) -> None:
        self.config, self.folder, self.generator = config, folder, generator
        self.handle: EnvironmentHandle = load_environment_handle(config.env.name, config.env.kwargs)
        self.items: list[TaskItem] = self.handle.tasks("train")
        self.limits = episode_limits(config, "train", self.handle.style)
        taken = consumed_groups(folder)
        done = finished_groups(folder)
        highest = max([*taken, *done, -1])
        self.lock = threading.Condition()
        self.buffer = _Buffer(
            finished={i: s for i, s in done.items() if i not in taken},
            replay=[i for i in range(highest + 1) if i not in taken and i not in done],
            next_index=highest + 1,
            trainer_step=first_step,
        )
        self.stamps = done  # every finished group's stamp, taken ones included
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rollflow-rollout-workers", daemon=True)
        self.idle_s = 0.0  # seconds with fewer than groups_in_flight groups running

    # ---- the trainer's side

    def start(self) -> RolloutWorkers:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=120)

    def take(self, step: int) -> Admission:
        """Wait until ``batch_size`` groups are admissible at ``step``; drop the stale ones."""
        config, limit = self.config, self.config.rollout.max_steps_off_policy
        assert limit is not None
        started = time.perf_counter()
        stale: list[int] = []
        with self.lock:
            self.buffer.trainer_step = step
            self.lock.notify_all()
            while True:
                if self.buffer.error is not None:
                    raise CollectionError(f"the rollout workers failed: {self.buffer.error}") from self.buffer.error
                # Stale at this step is stale for good: out of the buffer at once, so that
                # admission control does not count them as work ahead of a new group.
                for index in sorted(i for i, s in self.buffer.finished.items() if step - s.start_version > limit):
                    del self.buffer.finished[index]
                    stale.append(index)
                fresh = sorted(self.buffer.finished, key=lambda i: (self.buffer.finished[i].start_version, i))
                if len(fresh) >= config.rollout.batch_size:
                    break
                self.lock.notify_all()
                self.lock.wait(timeout=1.0)
            admitted = tuple(fresh[: config.rollout.batch_size])
            for index in admitted:
                del self.buffer.finished[index]
            self.buffer.trainer_step = step + 1  # what is left waits for the next step
            self.lock.notify_all()
        return Admission(step, admitted, tuple(sorted(stale)), time.perf_counter() - started)

    # ---- the collector thread

    def _run(self) -> None:
        try:
            asyncio.run(self._collect())
        except BaseException as error:  # noqa: BLE001 - handed to the trainer, which raises it
            with self.lock:
                self.buffer.error = error
                self.lock.notify_all()

    async def _collect(self) -> None:
        running: set[asyncio.Task[None]] = set()
        slots = self.config.groups_in_flight
        last = time.perf_counter()
        while not self._stop.is_set():
            for task in [t for t in running if t.done()]:
                running.discard(task)
                task.result()  # a failed group fails the collector
            now = time.perf_counter()
            if len(running) < slots:
                self.idle_s += (now - last) * (slots - len(running)) / slots
            last = now
            if len(running) < slots and self._may_start():
                index = self._next_index()
                version = await self.generator.start_group()
                running.add(asyncio.create_task(self._play(index, version)))
                continue
            await asyncio.sleep(POLL_S)
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)

    def _may_start(self) -> bool:
        """Admission control: a new group would be taken at step
        ``trainer_step + ahead // batch_size``; start it only if it is not stale by then."""
        if not self.config.rollout.admission_control:
            return True
        limit = self.config.rollout.max_steps_off_policy
        assert limit is not None
        with self.lock:
            step = self.buffer.trainer_step
            waiting = sum(step - s.start_version <= limit for s in self.buffer.finished.values())
            ahead = waiting + self.buffer.started  # stale ones will be dropped, not trained
            taken_at = step + ahead // self.config.rollout.batch_size
        return taken_at - self.generator.version <= limit

    def _next_index(self) -> int:
        with self.lock:
            self.buffer.started += 1
            if self.buffer.replay:
                return self.buffer.replay.pop(0)
            index, self.buffer.next_index = self.buffer.next_index, self.buffer.next_index + 1
            return index

    async def _play(self, index: int, version: int) -> None:
        config = self.config
        item = select_train_tasks(self.items, index, 1, config.train.seed)[0]
        policy = self.generator.group_policy(version, derive_seed(config.train.seed, "async", index))
        started = time.time()
        finished_under = version
        try:
            groups = await play_groups(
                self.handle, [item], config.rollout.episodes_per_task, policy, self.limits,
                config.rollout.episodes_per_task,
            )  # fmt: skip
        finally:
            finished_under = self.generator.finish_group(version)
            self.generator.retire_unused()
        broken = [r.error for r in groups[0] if r.error and "VLLMPolicyError" in r.error]
        if broken:  # the generator failed, not the episode: never keep such a group
            raise CollectionError(f"group {index}: the generator failed: {broken[0]}")
        stamp = GroupStamp(
            index=index, task_id=item.task_id, start_version=version,
            finish_version=max([finished_under, *policy.versions]) if not config.train.use_lora else version,
            started_s=started, finished_s=time.time(),
        )  # fmt: skip
        write_group(self.folder, stamp, groups[0])
        with self.lock:
            self.buffer.started -= 1
            self.buffer.finished[index] = stamp
            self.stamps[index] = stamp
            self.lock.notify_all()
        print(f"  collected group {index} (v{version}, task {item.task_id})", file=sys.stderr, flush=True)


class Publisher:
    """Publishes new versions inline (``synchronous``) or on a thread of its own."""

    def __init__(self, generator: AsyncGenerator, deferred: bool) -> None:
        self.generator, self.deferred = generator, deferred
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def publish(self, version: int, source: Path) -> None:
        self.join()
        if not self.deferred:
            self.generator.publish(version, source)
            return
        self._thread = threading.Thread(target=self._publish, args=(version, source), daemon=True)
        self._thread.start()

    def _publish(self, version: int, source: Path) -> None:
        try:
            self.generator.publish(version, source)
        except BaseException as error:  # noqa: BLE001 - raised on the trainer's next publish/join
            self._error = error

    def join(self, *, quiet: bool = False) -> None:
        """Wait for a deferred publication; raise its error unless ``quiet`` (unwinding)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None and not quiet:
            error, self._error = self._error, None
            raise CollectionError(f"publishing a new policy version failed: {error}") from error


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


# ---------------------------------------------------------------- the trainer's stages


def admit_stage(config: RunConfig, run_dir: Path, step: int, workers: RolloutWorkers) -> Path:
    """Step ``step``'s episodes: the groups it admits (chosen once, recorded first)."""
    folder = RunFolder(run_dir)
    done = folder.stage_output(step, "episodes")
    if done is not None:
        return done
    admission = read_admission(folder, step)
    if admission is None:
        admission = workers.take(step)
        write_admission(folder, admission, workers.stamps)
    return folder.write_stage(episode_records_to_table(step_episode_records(folder, admission)), step, "episodes")


def async_step_metrics(folder: RunFolder, step: int) -> dict[str, float]:
    """``async/*`` of an async step (``{}`` for a lockstep one): read from its admission."""
    path = admission_path(folder, step)
    if not path.exists():
        return {}
    data = folder.read_json(path)
    ages = [g["staleness"] for g in data["groups"] if g["admitted"]]
    return {
        "async/train_wait_s": float(data["train_wait_s"]),
        "async/dropped_stale_groups": float(sum(not g["admitted"] for g in data["groups"])),
        "async/staleness_mean": sum(ages) / len(ages) if ages else 0.0,
        "async/staleness_max": float(max(ages, default=0)),
    }


COLLECTOR_JSON = Path("async") / "collector.json"


def write_collector_report(folder: RunFolder, workers: RolloutWorkers, generator: AsyncGenerator, wall_s: float) -> None:
    """How busy the generator side was in this process (the benchmark reads it)."""
    path = folder.root / COLLECTOR_JSON
    earlier = folder.read_json(path) if path.exists() else {"processes": []}
    earlier["processes"].append({
        "wall_s": wall_s, "generator_idle_s": workers.idle_s,
        "publish_s": generator.publish_s, "groups_finished": len(workers.stamps),
    })  # fmt: skip
    folder.write_json_atomic(path, earlier)
