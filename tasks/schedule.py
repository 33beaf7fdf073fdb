"""Which tasks a step plays, with which seeds and turn caps: the schedule both the rollout
stage and the async collector follow.

Not a stage: the rollout stage (``tasks/rollout.py``), the async collector
(``tasks/collect.py``), preflight and replay all ask it, so no stage imports another for
these. Every seed is derived from the run's seed and names (``derive_seed``), stable across
processes and machines, so a resumed or re-run step draws the same tasks and samples.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping, Sequence
from pathlib import Path

from rollflow.config.parsing import ConfigError
from rollflow.config.run import RunConfig
from rollflow.envs.handle import EpisodeLimits, Style, TaskItem
from rollflow.storage.runfolder import RunFolder


def derive_seed(*parts: object) -> int:
    """A 31-bit seed that depends on every part (stable across processes, unlike hash())."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def select_train_tasks(items: Sequence[TaskItem], step: int, batch_size: int, seed: int) -> list[TaskItem]:
    """``batch_size`` tasks for ``step``: consecutive slices of per-epoch permutations."""
    if not items:
        raise ValueError("the environment has no training tasks")
    chosen: list[TaskItem] = []
    for position in range(step * batch_size, (step + 1) * batch_size):
        epoch, index = divmod(position, len(items))
        order = list(range(len(items)))
        random.Random(derive_seed(seed, "epoch", epoch)).shuffle(order)
        chosen.append(items[order[index]])
    return chosen


def draw_tasks(
    items: Sequence[TaskItem], count: int, seed: int, weights: Mapping[str, float] | None = None
) -> list[TaskItem]:
    """``count`` distinct tasks of ``items`` (all of them when fewer), a seeded draw without
    replacement: each task's key is ``u ** (1 / w)`` with ``u`` uniform from ``seed`` and
    ``w`` its weight (``weights[task_id]``, 1.0 when absent), and the largest keys win
    (Efraimidis and Spirakis' weighted sampling); equal weights make it uniform."""
    rng = random.Random(seed)
    keys = [rng.random() ** (1.0 / (weights or {}).get(item.task_id, 1.0)) for item in items]
    order = sorted(range(len(items)), key=lambda i: (-keys[i], i))
    return [items[i] for i in order[:count]]


def select_weighted_train_tasks(
    items: Sequence[TaskItem], step: int, batch_size: int, seed: int, weights: Mapping[str, float]
) -> list[TaskItem]:
    """The curriculum's ``batch_size`` tasks for ``step`` (``tasks/curriculum.py``): a weighted
    draw without replacement seeded by (seed, step); a batch larger than the task list
    takes them all, then draws again for the rest (seeded by the pass)."""
    if not items:
        raise ValueError("the environment has no training tasks")
    chosen: list[TaskItem] = []
    while len(chosen) < batch_size:
        seed_of_pass = derive_seed(seed, "curriculum", step, len(chosen) // len(items))
        chosen.extend(draw_tasks(items, batch_size - len(chosen), seed_of_pass, weights))
    return chosen


def backfill_tasks(
    items: Sequence[TaskItem], drawn: set[str], count: int, seed: int, step: int, round_: int,
    weights: Mapping[str, float] | None = None,
) -> list[TaskItem]:
    """Backfill round ``round_``'s ``count`` tasks of ``step``: a draw seeded by (seed, step,
    round) among the tasks not ``drawn`` yet this step (task ids); fewer, or none, when
    the step has drawn nearly every task."""
    fresh = [item for item in items if item.task_id not in drawn]
    return draw_tasks(fresh, count, derive_seed(seed, "backfill", step, round_), weights)


def select_validation_tasks(items: Sequence[TaskItem], num_tasks: int | None) -> list[TaskItem]:
    return list(items if num_tasks is None else items[:num_tasks])


def episode_limits(config: RunConfig, split: str, style: Style) -> EpisodeLimits:
    """The turn cap of ``split``'s episodes (a ``ConfigError`` when an async env has none).

    Unset, a hook environment plays its own ``max_episode_turns``; set, the cap bounds it.
    An async environment has no budget of its own, so it needs the cap, as in the reference.
    """
    max_turns = config.rollout.max_turns if split == "train" else config.val_max_turns
    if max_turns is None and style == "async":
        key = "[rollout].max_turns"
        if split != "train":
            key = f"[validation].val_max_turns or {key}"
        raise ConfigError(
            f"{config.env.name} is an async-style environment, which has no turn limit of its own: "
            f"set {key} (the assistant actions allowed per episode)"
        )
    return EpisodeLimits(max_turns=max_turns)


def chunk_seed(config: RunConfig, split: str, step: int, index: int) -> int:
    """Chunk ``index``'s sampling seed; a backfill round's chunks continue the indices."""
    return derive_seed(config.train.seed, split, step, index)


ROLLOUT_PLAN_JSON = "rollout_plan.json"


def rollout_plan_path(folder: RunFolder, step: int, split: str) -> Path:
    """What the rollout stage chose for ``split`` step ``step`` beyond its episodes (backfill
    rounds, the curriculum's weights, the tasks' difficulty labels), written before it
    seals the episodes, read by the metrics stage."""
    return folder.step_dir(step, split) / ROLLOUT_PLAN_JSON
