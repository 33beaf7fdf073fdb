"""Rollout stage: the current policy plays a group of episodes for each task of a step.

Training step ``s`` draws ``batch_size`` tasks and plays ``episodes_per_task`` episodes of
each (the GRPO group) with policy version ``s`` (the base model at step 0, then the
checkpoint written by training step ``s - 1``). Validation plays every validation task (or
the first ``num_tasks``) ``[validation].episodes_per_task`` times (once by default), one
episode at a time when ``sequential_validation`` is set.

Output: ``episodes`` for the step, written as part files, one per chunk of groups, then
sealed; an errored episode's traceback goes to the step's ``errors.jsonl`` before its
chunk's part is written (``tasks/step_health.py``). A killed rollout keeps its finished parts; the resumed one replays only the
missing chunks. Each chunk samples with a seed derived from (seed, split, step, chunk),
so a replayed chunk is the same chunk.

Simplified, and why:
- Task order: each epoch over the training tasks is a fresh permutation seeded by
  (seed, epoch), and steps take consecutive slices of it, so every task is seen once per
  epoch and a resumed run draws the same tasks (``tasks/schedule.py``, which the async
  collector follows too).
- A chunk holds as many groups as fit in ``concurrency`` episodes: the whole chunk is
  generated as one batch, and a crash loses at most one chunk of work.

Which tasks, in which chunks, is the stage's plan (``tasks/rollout_plan.py``): the epoch's
slice or the curriculum's weighted draw, the backfill rounds after the first, and the
step's ``rollout_plan.json``. This module plays the chunks the plan names.

A generator that dies mid-rollout (vLLM; ``Generator.fault``: the managed
server's process group is gone or ``GET /health`` fails, checked after every chunk):
- the chunk is discarded when any of its episodes carries an error (it may be the dead
  server's "all attempts failed"), never written; a chunk whose episodes all finished is
  written as is (every action came from a live server);
- a managed server is restarted (same spec, the step's adapter reloaded under the same
  version, ``logs/vllm-server.log`` says it restarted and why) and the discarded chunk is
  replayed with its seed: nothing lost, nothing doubled. At most
  ``MAX_GENERATOR_RESTARTS`` (``generators/generator.py``) restarts per stage; one more death fails the stage with
  ``GeneratorError`` naming the server, how it ended and its log's tail;
- an external server (``[rollout].base_urls``) cannot be restarted by us: the stage fails
  with ``GeneratorError`` naming the URL, and a resumed run replays only the missing
  chunks, so no step trains on what a dead server left. A chunk with no errored episode
  is still written (the other replicas served it) and a warning names the silent URL.
The stage does its own replay: Prefect ``retries=`` would restart the whole stage, and the
stage resumes from its parts anyway.

On a Ray cluster (``[cluster]``, lockstep, vLLM; ``cluster/ray_rollout.py``'s ``RayFanOut``
as ``fan_out``) the missing chunks are played on the cluster's nodes instead of one after
another here: each worker recomputes this stage's plan (``rollout_plan.stage_plan``),
plays its chunk with the chunk's seed and writes the part (``play_chunk_to_part``, the same
records, with the node that played them); this process keeps the generator and its restarts.
"""

from __future__ import annotations

import asyncio
import fcntl
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from rollflow.config.run import RunConfig
from rollflow.envs.agent import Policy
from rollflow.envs.episode import EpisodeRollout
from rollflow.envs.handle import EnvironmentHandle, EpisodeLimits, EpisodeScore, TaskItem
from rollflow.envs.runner import play_groups
from rollflow.envs.tracebacks import keeping_tracebacks
from rollflow.envs.types import Split
from rollflow.generators.generator import Generator, RestartBudget
from rollflow.generators.policy_io import ActingPolicy
from rollflow.storage.errors import StageExistsError
from rollflow.storage.parquet import list_parts, part_index, part_path, read_table
from rollflow.storage.records import EpisodeRecord
from rollflow.storage.runfolder import RunFolder
from rollflow.storage.schemas import episode_records_to_table, table_to_episode_records
from rollflow.storage.stage_outputs import locate_output, seal_output, write_output_part
from rollflow.tasks.rollout_plan import Chunk, StagePlan, first_round, play_backfill_rounds, stage_plan, write_plan
from rollflow.tasks.schedule import chunk_seed
from rollflow.tasks.shaping import ScoringSettings, groups_with_variance, score_groups
from rollflow.tasks.step_health import episode_errors, errors_path, keep_episode_errors

PROGRESS_EVERY_S = 15.0


def rollout_stage(
    config: RunConfig, out: Path, step: int, split: str, acting: ActingPolicy, fan_out: ChunkFanOut | None = None,
) -> Path:
    """Play step ``step``'s ``split`` episodes with ``acting`` (the policy version the step
    samples, built by the flow: ``generators/policy_io.acting_policy``) into ``out`` (a
    folder of part files, one per chunk); returns ``out`` sealed. ``fan_out`` (a Ray
    cluster's, ``cluster/ray_rollout.py``) plays the missing chunks on the cluster's nodes
    instead of in this process; None: here, one chunk after another."""
    folder = locate_output(out).folder  # the run whose plan, curriculum and errors.jsonl the step shares
    plan = stage_plan(config, step, split, folder)
    written = {part_index(p) for p in list_parts(out)}
    if fan_out is not None:
        missing = [index for index in range(len(plan.chunks)) if index not in written]
        fan_out.play_chunks(config, folder, step, split, plan, missing, acting, _Restarts().budget)
        backfill = None  # refused on a cluster (config/checks.py, check_task_schedule)
    else:
        player = _ChunkPlayer(config, folder, out, step, split, plan, acting, written)
        player.play(first_round(plan), len(plan.chunks))
        backfill = (play_backfill_rounds(config, plan, step, player)
                    if split == "train" and config.rollout.backfill_rounds > 0 else None)
    write_plan(config, folder, step, split, plan, backfill)
    return seal_output(out)


class _ChunkPlayer:
    """Plays a stage's chunks in this process, one after another, each with its seed; a chunk
    whose part is already written is skipped (a resumed stage replays only what is missing)."""

    def __init__(
        self, config: RunConfig, folder: RunFolder, out: Path, step: int, split: str, plan: StagePlan,
        acting: ActingPolicy, written: set[int | None],
    ) -> None:
        self.config, self.folder, self.out, self.step, self.split, self.plan = config, folder, out, step, split, plan
        self.acting, self.written = acting, written
        self.restarts = _Restarts()
        self.started = time.perf_counter()

    def play(self, chunks: Sequence[Chunk], total: int, what: str = "") -> None:
        """Play ``chunks`` (``total``: how many the label counts, ``what``: which round)."""
        plan, config, folder, step, split = self.plan, self.config, self.folder, self.step, self.split
        for number, chunk in enumerate(chunks, start=1):
            if chunk.index in self.written:
                continue
            label = f"rollout {split} step {step}{what} chunk {number}/{total}"
            while True:  # replayed after a generator restart: same seed, same chunk
                self.acting.reseed(chunk_seed(config, split, step, chunk.index))
                with keeping_tracebacks() as tracebacks:
                    rollouts_GE = asyncio.run(play_with_progress(
                        plan.handle, chunk.items, plan.group_size, self.acting.policy, plan.limits,
                        plan.concurrency, label,
                    ))
                if self.restarts.chunk_is_good(self.acting, rollouts_GE, label):
                    break
            records = _chunk_records(folder.run_id, step, split, chunk.first_group, chunk.items, rollouts_GE)
            _keep_errors(folder, step, split, records, tracebacks)
            write_output_part(episode_records_to_table(records), self.out, chunk.index)
            self.written.add(chunk.index)
            _progress(f"{split} step {step}{what}", number, total, self.started)

    def groups_with_variance(self, chunks: Sequence[Chunk]) -> int:
        """How many of ``chunks``' groups have reward variance, as scoring will decide
        (``tasks/shaping.py``), read back from their part files: the same numbers whether
        this process played them or a process that died did."""
        episodes = [
            record for chunk in chunks
            for record in table_to_episode_records(read_table(part_path(self.out, chunk.index)))
        ]
        scores = asyncio.run(score_groups(self.plan.handle, self.split, episodes, self.config.rollout.concurrency))
        return sum(groups_with_variance(episodes, scores, ScoringSettings.from_config(self.config)).values())


class ChunkFanOut(Protocol):
    """Plays a rollout stage's missing chunks elsewhere (``cluster/ray_rollout.RayFanOut``):
    each chunk's part written, or an error naming the chunk."""

    def play_chunks(
        self, config: RunConfig, folder: RunFolder, step: int, split: str, plan: StagePlan,
        missing: list[int], acting: ActingPolicy, budget: RestartBudget,
    ) -> None: ...


@dataclass(frozen=True)
class ChunkOutcome:
    """What a chunk played away from the driver returns: small, no episode data."""

    index: int
    path: str | None  # its part file; None: not written (errored on a server that stopped answering)
    errored: int
    total: int
    node: str | None
    problem: str | None = None  # why it was not written


def play_chunk_to_part(
    config: RunConfig, folder: RunFolder, step: int, split: str, index: int, policy: Policy,
    node: str | None, server_problem: Callable[[], str | None],
) -> ChunkOutcome:
    """Play chunk ``index`` with ``policy`` (reseeded with the chunk's seed) and write its part
    file, its errored episodes' tracebacks first (``errors.jsonl``, under a lock: chunks on
    several nodes share it). An errored chunk is not written when ``server_problem()`` names
    one (the generator stopped answering: the driver restarts it and replays the chunk). A
    part already there (an attempt on a node that died after writing it) is returned as is."""
    part = part_path(folder.parts_dir(step, "episodes", split), index)
    plan = stage_plan(config, step, split, folder)
    chunk, label = plan.chunks[index], plan.label(split, step, index)
    total = len(chunk) * plan.group_size
    if part.exists():
        return ChunkOutcome(index, str(part), 0, total, node)
    reseed = getattr(policy, "reseed", None)
    if callable(reseed):
        reseed(chunk_seed(config, split, step, index))
    with keeping_tracebacks() as tracebacks:
        rollouts_GE = asyncio.run(
            play_with_progress(plan.handle, chunk, plan.group_size, policy, plan.limits, plan.concurrency, label)
        )
    errored = sum(r.error is not None for rollouts_E in rollouts_GE for r in rollouts_E)
    problem = server_problem() if errored else None
    if problem is not None:
        return ChunkOutcome(index, None, errored, total, node, problem)
    first_group = index * plan.groups_per_chunk
    records = _chunk_records(folder.run_id, step, split, first_group, chunk, rollouts_GE, node)
    with _errors_lock(folder, step, split):
        _keep_errors(folder, step, split, records, tracebacks)
    try:
        folder.write_stage_part(episode_records_to_table(records), step, "episodes", index, split)
    except StageExistsError:
        if not part.exists():  # sealed, or a single file: not a twin attempt's part
            raise
    return ChunkOutcome(index, str(part), errored, total, node)


@contextmanager
def _errors_lock(folder: RunFolder, step: int, split: str) -> Iterator[None]:
    """An exclusive lock on the step's ``errors.jsonl`` (read, changed, rewritten): chunks
    on several nodes of a cluster write it (a shared filesystem needs working ``flock``)."""
    lock = errors_path(folder, step, split).with_name(".errors.jsonl.lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _keep_errors(
    folder: RunFolder, step: int, split: str, records: list[EpisodeRecord], tracebacks: dict[str, str]
) -> None:
    """The chunk's errored episodes, with their tracebacks, in the step's ``errors.jsonl``."""
    failed = [(r, r.rollout.error) for r in records if r.rollout.error is not None]
    errors = episode_errors("rollout", failed, tracebacks)
    keep_episode_errors(folder, step, split, "rollout", [r.episode_id for r in records], errors)


class _Restarts:
    """The stage's generator restarts: after each chunk, the one fault check
    (``RestartBudget.keep``, ``MAX_GENERATOR_RESTARTS`` per stage)."""

    def __init__(self) -> None:
        self.budget = RestartBudget()

    def chunk_is_good(self, acting: ActingPolicy, rollouts_GE: list[list[EpisodeRollout]], label: str) -> bool:
        """True: write the chunk. False: it was discarded and the generator restarted."""
        errored = sum(r.error is not None for rollouts_E in rollouts_GE for r in rollouts_E)
        return self.budget.keep(acting, errored, sum(map(len, rollouts_GE)), label)


class _CountingHandle:
    """The environment handle, counting finished episodes for the progress line."""

    def __init__(self, inner: EnvironmentHandle) -> None:
        self.inner = inner
        self.style = inner.style
        self.finished = 0

    def tasks(self, split: Split) -> list[TaskItem]:
        return self.inner.tasks(split)

    async def play(self, item: TaskItem, policy: Policy, limits: EpisodeLimits) -> EpisodeRollout:
        rollout = await self.inner.play(item, policy, limits)
        self.finished += 1
        return rollout

    async def score(self, item: TaskItem, rollouts: Sequence[EpisodeRollout]) -> list[EpisodeScore]:
        return await self.inner.score(item, rollouts)


async def play_with_progress(
    handle: EnvironmentHandle,
    items: Sequence[TaskItem],
    group_size: int,
    policy: Policy,
    limits: EpisodeLimits,
    concurrency: int,
    label: str,
) -> list[list[EpisodeRollout]]:
    """``play_groups``, printing how many episodes have finished every ``PROGRESS_EVERY_S``."""
    counting = _CountingHandle(handle)
    total, started = len(items) * group_size, time.perf_counter()

    async def report() -> None:
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            elapsed = time.perf_counter() - started
            print(f"  {label}: {counting.finished}/{total} episodes ({elapsed:.0f}s)", file=sys.stderr, flush=True)

    ticker = asyncio.create_task(report())
    try:
        return await play_groups(counting, items, group_size, policy, limits, concurrency)
    finally:
        ticker.cancel()


def _chunk_records(
    run_id: str, step: int, split: str, first_group: int, chunk: Sequence[TaskItem],
    rollouts_GE: Sequence[Sequence[EpisodeRollout]], node: str | None = None,
) -> list[EpisodeRecord]:
    """A chunk's episodes as records, group by group (groups numbered from ``first_group``)."""
    return [
        _record(run_id, step, split, first_group + g, item, e, rollout, node)
        for g, (item, rollouts_E) in enumerate(zip(chunk, rollouts_GE, strict=True))
        for e, rollout in enumerate(rollouts_E)
    ]


def _record(
    run_id: str, step: int, split: str, group: int, item: TaskItem, index: int, rollout: EpisodeRollout,
    node: str | None = None,
) -> EpisodeRecord:
    group_id = f"{split}/{step}/{group}"
    return EpisodeRecord(
        run_id=run_id,
        step=step,
        split=split,
        task_id=item.task_id,
        group_id=group_id,
        episode_id=f"{group_id}/{index}",
        index_in_group=index,
        rollout=rollout,
        node=node,
        env=item.env,  # the plan's items carry their environment's label (tasks/schedule.run_strata)
    )


def _progress(what: str, done: int, total: int, started: float) -> None:
    elapsed = time.perf_counter() - started
    print(
        f"  rollout {what}: chunk {done}/{total} ({elapsed:.1f}s)",
        file=sys.stderr,
        flush=True,
    )
