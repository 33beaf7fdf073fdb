"""The rollout stage's plan: which tasks a step plays, in which chunks, and what it records.

``stage_plan`` deals the step's tasks into chunks of as many groups as fit in
``concurrency`` episodes, the same on the driver and on a cluster's worker (which
recomputes it, so only a chunk's index travels). The rollout stage (``tasks/rollout.py``)
plays the chunks; the decisions are here. Two options change which tasks a training step
plays (both lockstep only, ``config/checks.py``):
- ``[rollout].curriculum``: the step's tasks are a weighted draw instead of the epoch's
  slice, a task whose recent groups all passed or all failed weighing less
  (``tasks/curriculum.py``; the weights are recomputed from the run's scores on resume).
- ``[rollout].backfill_rounds``: after the step's ``batch_size`` groups (played exactly as
  without it), rounds of fresh tasks while fewer than ``batch_size`` groups have reward
  variance (``play_backfill_rounds``), their chunks numbered on from the first round's,
  each with its own seed, into the same episodes folder. The decision is scoring's own
  (``tasks/shaping.py``), on the environment's scores of the episodes read back from disk.
Either way the step's ``rollout_plan.json`` (``write_plan``) records what the metrics
report of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from rollflow.config.run import RunConfig
from rollflow.envs.handle import EnvironmentHandle, EpisodeLimits, TaskItem
from rollflow.envs.runner import load_environment_handle
from rollflow.storage.runfolder import RunFolder
from rollflow.tasks.curriculum import curriculum_weights, difficulty_labels, summarize
from rollflow.tasks.schedule import (
    backfill_step_tasks,
    draw_step_tasks,
    episode_limits,
    rollout_plan_path,
    run_strata,
    select_validation_strata,
)


@dataclass(frozen=True)
class StagePlan:
    """What a rollout stage plays: the same on the driver and on a cluster's worker, which
    recomputes it from the config (so nothing but the chunk's index travels)."""

    handle: EnvironmentHandle
    chunks: list[list[TaskItem]]
    group_size: int
    concurrency: int
    groups_per_chunk: int
    limits: EpisodeLimits
    weights: dict[str, float] = field(default_factory=dict)  # the curriculum's; {}: uniform

    def label(self, split: str, step: int, index: int) -> str:
        return f"rollout {split} step {step} chunk {index + 1}/{len(self.chunks)}"


def stage_plan(config: RunConfig, step: int, split: str, folder: RunFolder | None = None) -> StagePlan:
    """The step's first round of chunks (the whole step without backfill). The curriculum
    (``tasks/curriculum.py``) weighs the draw by the run's earlier steps, read in ``folder``."""
    handle = load_environment_handle(config.env.name, config.env.kwargs)
    weights: dict[str, float] = {}
    if split == "train":
        train_strata = run_strata(config, handle, "train")
        batch_size, seed = config.rollout.batch_size, config.train.seed
        if config.rollout.curriculum:
            if folder is None:
                raise ValueError("[rollout].curriculum reads the run's earlier steps: stage_plan needs its folder")
            weights = curriculum_weights(folder, step, config.rollout.curriculum_floor)
        items = draw_step_tasks(train_strata, step, batch_size, seed, weights if config.rollout.curriculum else None)
        group_size, concurrency = config.rollout.episodes_per_task, config.rollout.concurrency
    else:
        items = select_validation_strata(run_strata(config, handle, "validation"), config.validation.num_tasks)
        group_size = config.validation.episodes_per_task  # a repeated measure, not a baseline
        concurrency = 1 if config.validation.sequential_validation else config.rollout.concurrency
    limits = episode_limits(config, split, handle.style)
    groups_per_chunk = max(1, concurrency // group_size)
    chunks = [items[i : i + groups_per_chunk] for i in range(0, len(items), groups_per_chunk)]
    return StagePlan(handle, chunks, group_size, concurrency, groups_per_chunk, limits, weights)


@dataclass(frozen=True)
class Chunk:
    """One generation batch of a step's groups, and its part file."""

    index: int  # its part file, and its seed (``chunk_seed``)
    first_group: int  # its groups are numbered from here
    items: list[TaskItem]


def first_round(plan: StagePlan) -> list[Chunk]:
    """The step's first round: the plan's chunks, groups numbered on from chunk to chunk."""
    return [Chunk(i, i * plan.groups_per_chunk, chunk) for i, chunk in enumerate(plan.chunks)]


class RoundPlayer(Protocol):
    """Plays chunks into the step's episodes (the rollout stage's player), and reads back
    how many of their groups have reward variance."""

    def play(self, chunks: Sequence[Chunk], total: int, what: str = "") -> None: ...

    def groups_with_variance(self, chunks: Sequence[Chunk]) -> int: ...


@dataclass(frozen=True)
class BackfillOutcome:
    rounds: int  # backfill rounds played after the first
    groups: int  # groups they added
    varied: int  # groups of the whole step with reward variance
    items: list[TaskItem]  # the tasks they drew, in play order


def play_backfill_rounds(config: RunConfig, plan: StagePlan, step: int, player: RoundPlayer) -> BackfillOutcome:
    """DAPO's dynamic sampling with refill, after the step's first round (its ``batch_size``
    groups, played as without backfill): while fewer than ``batch_size`` groups have
    reward variance and rounds remain, draw tasks not yet drawn this step
    (``backfill_tasks``: seeded by (seed, step, round), weighted by the curriculum when
    on), as many as ``backfill_draw`` sizes from what is missing and the step's rate so
    far, and play them as further chunks with their own indices and seeds.

    Every decision is recomputed from the part files, so a stage resumed after a kill
    takes the same rounds and replays only the missing chunks. A round that overshoots
    (more groups with variance than missing) keeps them all on disk; scoring trains the
    first ``batch_size`` of them in play order (``ScoringSettings.max_trained_groups``).
    When the rounds, or the tasks not yet drawn, run out first, the step trains the
    groups with variance it has."""
    batch_size = config.rollout.batch_size
    chunks = first_round(plan)
    varied = player.groups_with_variance(chunks)
    drawn = {item.task_id for chunk in chunks for item in chunk.items}
    train_strata = run_strata(config, plan.handle, "train")
    next_index, next_group = len(chunks), sum(len(c.items) for c in chunks)
    rounds, added = 0, []
    for round_ in range(1, config.rollout.backfill_rounds + 1):
        missing = batch_size - varied
        if missing <= 0:
            break
        count = backfill_draw(missing, varied, next_group, plan.groups_per_chunk)
        fresh = backfill_step_tasks(train_strata, drawn, count, config.train.seed, step, round_, plan.weights)
        if not fresh:
            break
        per_chunk = plan.groups_per_chunk
        extra = [
            Chunk(next_index + n, next_group + n * per_chunk, fresh[n * per_chunk : (n + 1) * per_chunk])
            for n in range(-(-len(fresh) // per_chunk))
        ]
        player.play(extra, len(extra), f" backfill round {round_}")
        varied += player.groups_with_variance(extra)
        drawn.update(item.task_id for item in fresh)
        added.extend(fresh)
        next_index, next_group, rounds = next_index + len(extra), next_group + len(fresh), round_
    return BackfillOutcome(rounds, len(added), varied, added)


def backfill_draw(missing: int, varied: int, played: int, per_chunk: int) -> int:
    """How many tasks a backfill round draws to find ``missing`` groups with variance: as
    many as the step's rate so far (``varied`` of the ``played`` groups) says it takes,
    ``missing * played / varied`` rounded up, and never more than ``missing`` rounded up to
    whole chunks of ``per_chunk`` groups (all of that when nothing has varied yet). A
    round drawn short is made up by the next; one drawn to whole chunks would play a
    chunk of groups (e.g. 12 for 1 missing) to fill a step that lacks one or two."""
    whole = -(-missing // per_chunk) * per_chunk
    if varied <= 0:
        return whole
    return min(whole, -(-missing * played // varied))


def write_plan(
    config: RunConfig, folder: RunFolder, step: int, split: str, plan: StagePlan, backfill: BackfillOutcome | None
) -> None:
    """The step's ``rollout_plan.json`` (``tasks/schedule.py``): what the metrics report
    of the backfill and the curriculum, and the difficulty label of each task it played."""
    drawn = [item for chunk in plan.chunks for item in chunk]
    data: dict[str, object] = {"difficulty": difficulty_labels(drawn + (backfill.items if backfill else []))}
    if backfill is not None:
        data["backfill"] = {"rounds": backfill.rounds, "groups": backfill.groups, "varied_groups": backfill.varied}
    if split == "train" and config.rollout.curriculum:
        data["curriculum"] = summarize(plan.weights, drawn).metrics()
    folder.write_json_atomic(rollout_plan_path(folder, step, split), data)
