"""Async collection: rollout workers play groups beside the trainer; the trainer admits them.

With ``[rollout].max_steps_off_policy`` set, a background thread keeps
``groups_in_flight`` GRPO groups playing at once on the vLLM generator, each under the
newest policy version published when it **started**, and writes every finished group to
the run folder::

    async/groups/group-000017.parquet   the group's episodes (episodes schema; step = its start version)
    async/groups/group-000017.json      its stamps, written last: the group is finished
    async/groups/group-000017.errors.jsonl  its errored episodes' tracebacks (where one errored)
    steps/step=000004/admission.json    which groups step 4 trained and which it dropped

(read and written by ``rollflow.storage.async_groups``).

Group ``n`` plays the ``n``-th training task of the run (the lockstep order:
``draw_step_tasks`` with one task a step), so the data position is the group index.

The trainer's step ``s`` (it trains version ``s`` into ``s + 1``) takes ``batch_size``
finished groups, oldest start version first. A group's age is ``s - start_version``, the
optimizer steps since its rollout started; a group older than ``max_steps_off_policy``
is dropped as stale when the trainer would take it, counted in the admission file and
``async/dropped_stale_groups``, never in ``zero_variance_skip_ratio``. ``0`` admits only
groups started under the current policy. A group still playing that step ``s`` must take
(at ``s + 1`` it would be stale) is waited for rather than passed over for a younger
group that finished first.

Admission control (``[rollout].admission_control``, on by default): a worker does not
start a group that would be stale by the time the trainer can take it. The groups
already started and not yet taken are ahead of it, so it would be taken at step
``s + (ahead // batch_size)``; it starts only if that minus the current version is within
the limit, and waits otherwise. Off, groups start freely and the trainer's drop is the
only guard (the reference's behaviour).

Publication (``weight_sync_type``), after each training step, of version ``s + 1``:

- LoRA: the adapter is loaded (once, not in place) beside the others as
  ``policy-<run>-v{s+1}``; a group's every request names its start version's adapter, so
  an episode is sampled by one version from first token to last; an adapter is unloaded
  once no running group uses it, and its checkpoint is kept until then. A managed server
  holds every adapter that can be loaded at once (``groups_in_flight + 2``).
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
exactly the groups it chose, and admission control counts the buffer from the step after.

Errored episodes: a group's tracebacks are kept in its own file, written with it, as the
rollout stage's are (``tasks/step_health.py``); the admission copies the admitted groups'
lines into the step's ``errors.jsonl`` under the step's episode ids, where the scoring
stage's message points. A step whose every episode failed in the rollout fails the run
and its admission is discarded with its episodes; the resume then plays again every
finished group not yet taken whose every episode errored (``replay_failed_groups``), so a
fixed environment replays the step, and a still broken one fails it again.

Simplified, and why: the generator is vLLM only (a generator beside the trainer needs
its own process: the in-process transformers backend would share the trainer's Python
and cores); one event loop thread plays every group.

A generator that dies: after each group the generator's one fault check
(``AsyncGenerator.keep``, lockstep's ``RestartBudget``) restarts a managed server and
discards the group, whose index is played again first, from its seed, under the version
then published; a group with errored episodes that played across a restart is discarded
the same way. An external server, or one more death than ``MAX_GENERATOR_RESTARTS``,
fails the run (finished groups are on disk, the resume replays the rest).
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from rollflow.config.run import RunConfig
from rollflow.envs.handle import EnvironmentHandle
from rollflow.envs.runner import load_environment_handle, play_groups
from rollflow.envs.tracebacks import keeping_tracebacks
from rollflow.generators.async_generator import POLL_S, AsyncGenerator
from rollflow.storage.async_groups import (
    Admission,
    GroupStamp,
    consumed_groups,
    finished_groups,
    read_admission,
    step_episode_records,
    write_admission,
    write_group,
)
from rollflow.storage.runfolder import RunFolder
from rollflow.storage.schemas import episode_records_to_table
from rollflow.storage.stage_outputs import write_output
from rollflow.tasks.group_errors import keep_admitted_errors, keep_group_errors, replay_failed_groups
from rollflow.tasks.schedule import derive_seed, draw_step_tasks, episode_limits, run_strata


STOP_JOIN_S = 30.0  # the collector stops within a poll once cancelled; this is the backstop


class CollectionError(RuntimeError):
    """The rollout workers failed (the generator died, an environment could not load...)."""


# ---------------------------------------------------------------- the workers


@dataclass
class _Buffer:
    """What the trainer and the workers share (under ``RolloutWorkers.lock``)."""

    finished: dict[int, GroupStamp]  # finished, not yet taken or dropped
    replay: list[int]  # indices in flight when a previous process died: played first
    next_index: int
    running: dict[int, int] = field(default_factory=dict)  # index -> start version: started here, not finished
    trainer_step: int = 0  # the step the trainer takes groups for next
    error: BaseException | None = None


class RolloutWorkers:
    """The collector thread: ``groups_in_flight`` groups at once, each to a file."""

    def __init__(self, config: RunConfig, folder: RunFolder, generator: AsyncGenerator, first_step: int) -> None:
        self.config, self.folder, self.generator = config, folder, generator
        self.handle: EnvironmentHandle = load_environment_handle(config.env.name, config.env.kwargs)
        self.strata = run_strata(config, self.handle, "train")  # its items carry their environment's label
        self.limits = episode_limits(config, "train", self.handle.style)
        taken = consumed_groups(folder)
        replay_failed_groups(folder, [i for i in finished_groups(folder) if i not in taken])
        done = finished_groups(folder)
        highest = max([*taken, *done, -1])
        # A step resumed after its admission file trains the groups it chose: the buffer
        # waits for the step after it (else admission control counts the buffered groups
        # one step early and starts groups that are stale when they are taken).
        trainer_step = first_step
        while read_admission(folder, trainer_step) is not None:
            trainer_step += 1
        self.lock = threading.Condition()
        self.buffer = _Buffer(
            finished={i: s for i, s in done.items() if i not in taken},
            replay=[i for i in range(highest + 1) if i not in taken and i not in done],
            next_index=highest + 1,
            trainer_step=trainer_step,
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
        """Stop the collector: no new group, running ones cancelled (a cancelled group is
        never written; a resume plays it again), also one waiting behind a closed gate."""
        self._stop.set()
        self.generator.stop()
        self._thread.join(timeout=STOP_JOIN_S)
        if self._thread.is_alive():
            print(f"  rollout workers: the collector did not stop within {STOP_JOIN_S:.0f} s "
                  "(an environment call blocking its event loop?)", file=sys.stderr, flush=True)  # fmt: skip

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
                if len(fresh) >= config.rollout.batch_size and not self._due_behind(step, fresh):
                    break
                self.lock.notify_all()
                self.lock.wait(timeout=1.0)
            admitted = tuple(fresh[: config.rollout.batch_size])
            for index in admitted:
                del self.buffer.finished[index]
            self.buffer.trainer_step = step + 1  # what is left waits for the next step
            self.lock.notify_all()
        return Admission(step, admitted, tuple(sorted(stale)), time.perf_counter() - started)

    def _due_behind(self, step: int, fresh: list[int]) -> bool:
        """Whether a group still playing must be taken at ``step`` (one step later it is
        stale) and a younger finished group would take its place: the trainer waits for it.
        Admission control started it counting on this step; a younger group that finished
        first took its place and it was dropped one step later (the killed-run test, suite
        run of 2026-12-05 22:29). Called under the lock."""
        limit = self.config.rollout.max_steps_off_policy
        assert limit is not None
        newest = max(self.buffer.finished[i].start_version for i in fresh[: self.config.rollout.batch_size])
        return any(step - version == limit and version < newest for version in self.buffer.running.values())

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
                if not task.cancelled():  # cancelled: the generator is stopping
                    task.result()  # a failed group fails the collector
            now = time.perf_counter()
            if len(running) < slots:
                self.idle_s += (now - last) * (slots - len(running)) / slots
            last = now
            if len(running) < slots and self._may_start():
                version = await self.generator.start_group()
                if version is None:  # stopped
                    break
                index = self._next_index(version)
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
            ahead = waiting + len(self.buffer.running)  # stale ones will be dropped, not trained
            taken_at = step + ahead // self.config.rollout.batch_size
        return taken_at - self.generator.version <= limit

    def _next_index(self, version: int) -> int:
        with self.lock:
            if self.buffer.replay:
                index = self.buffer.replay.pop(0)
            else:
                index, self.buffer.next_index = self.buffer.next_index, self.buffer.next_index + 1
            self.buffer.running[index] = version
            return index

    async def _play(self, index: int, version: int) -> None:
        config = self.config
        item = draw_step_tasks(self.strata, index, 1, config.train.seed)[0]
        policy = self.generator.group_policy(version, derive_seed(config.train.seed, "async", index))
        started = time.time()
        finished_under = version
        restarts = self.generator.restarts
        try:
            with keeping_tracebacks() as tracebacks:
                groups = await play_groups(
                    self.handle, [item], config.rollout.episodes_per_task, policy, self.limits,
                    config.rollout.episodes_per_task,
                )  # fmt: skip
        finally:
            finished_under = self.generator.finish_group(version)
            self.generator.retire_unused()
        errored = sum(r.error is not None for r in groups[0])
        if not await asyncio.to_thread(self.generator.keep, errored, len(groups[0]), f"group {index}", restarts):
            with self.lock:  # the generator was restarted: the group is played again, first
                del self.buffer.running[index]
                self.buffer.replay.insert(0, index)
                self.lock.notify_all()  # a trainer waiting for it (``_due_behind``) looks again
            return
        stamp = GroupStamp(
            index=index, task_id=item.task_id, start_version=version,
            finish_version=max([finished_under, *policy.versions]) if self.generator.in_place else version,
            started_s=started, finished_s=time.time(), env=item.env,
        )  # fmt: skip
        keep_group_errors(self.folder, index, item.task_id, groups[0], tracebacks)
        write_group(self.folder, stamp, groups[0])
        with self.lock:
            del self.buffer.running[index]
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
        self.generator.announce(version)  # its checkpoint is kept from now on, thread or not
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


# ---------------------------------------------------------------- the trainer's stages


def admit_stage(config: RunConfig, workers: RolloutWorkers, step: int, out: Path) -> Path:
    """Step ``step``'s episodes into ``out`` (its ``episodes.parquet``): the groups it admits
    (chosen once, the admission recorded first)."""
    folder = workers.folder
    admission = read_admission(folder, step)
    if admission is None:
        admission = workers.take(step)
        write_admission(folder, admission, workers.stamps)
    records = step_episode_records(folder, admission)
    keep_admitted_errors(folder, admission, records)
    return write_output(episode_records_to_table(records), out)


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
