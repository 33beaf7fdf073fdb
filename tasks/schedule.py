"""Which tasks a step plays, with which seeds and turn caps: the schedule both the rollout
stage and the async collector follow.

Not a stage: the rollout stage (``tasks/rollout.py``), the async collector
(``tasks/collect.py``), preflight and replay all ask it, so no stage imports another for
these. Every seed is derived from the run's seed and names (``derive_seed``), stable across
processes and machines, so a resumed or re-run step draws the same tasks and samples.
"""

from __future__ import annotations

import hashlib
import math
import random
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from rollflow.config.parsing import ConfigError
from rollflow.config.run import RunConfig
from rollflow.envs.handle import EnvironmentHandle, EpisodeLimits, Style, TaskItem
from rollflow.envs.mixture_handle import Stratum
from rollflow.envs.mixture_handle import strata as env_strata
from rollflow.storage.runfolder import RunFolder


def derive_seed(*parts: object) -> int:
    """A 31-bit seed that depends on every part (stable across processes, unlike hash())."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def select_train_tasks(
    items: Sequence[TaskItem], step: int, batch_size: int, seed: int, salt: tuple[object, ...] = ()
) -> list[TaskItem]:
    """``batch_size`` tasks for ``step``: consecutive slices of per-epoch permutations."""
    return _epoch_span(items, step * batch_size, batch_size, seed, salt)


def _epoch_span(
    items: Sequence[TaskItem], start: int, count: int, seed: int, salt: tuple[object, ...]
) -> list[TaskItem]:
    """Positions ``start .. start+count-1`` of the task stream: epoch after epoch, each a
    permutation seeded by (seed, *salt, "epoch", epoch)."""
    if not items:
        raise ValueError("the environment has no training tasks")
    chosen: list[TaskItem] = []
    for position in range(start, start + count):
        epoch, index = divmod(position, len(items))
        order = list(range(len(items)))
        random.Random(derive_seed(seed, *salt, "epoch", epoch)).shuffle(order)
        chosen.append(items[order[index]])
    return chosen


# ---------------------------------------------------------------- mixtures (envs/mixture_handle.py)


def stratum_counts(weights: Sequence[float], total: int, seed: int) -> list[int]:
    """``total`` groups shared among strata by weight: systematic sampling, so each stratum
    gets the floor or the ceiling of its share ``total * w / sum(w)``, exactly its share
    in expectation, and the counts always sum to ``total``. One uniform draw from ``seed``
    places the ``total`` points ``u, u+1, ...`` on the strata's cumulative shares."""
    if len(weights) == 1:
        return [total]
    u = random.Random(seed).random()
    whole = sum(weights)
    counts, cumulative, before = [], 0.0, 0
    for index, weight in enumerate(weights):
        cumulative = total if index == len(weights) - 1 else cumulative + total * weight / whole
        upto = max(0, math.ceil(cumulative - u))  # points u + k below the cumulative share
        counts.append(upto - before)
        before = upto
    return counts


_POSITIONS: dict[tuple[object, ...], list[list[int]]] = {}  # per draw: each step's positions, step 0 first
_POSITIONS_LOCK = threading.Lock()  # the async collector's thread draws beside the driver's


def stratum_positions(weights: Sequence[float], step: int, batch_size: int, seed: int) -> list[int]:
    """Where each stratum's task stream stands at ``step``: the groups it gave earlier steps
    (so each member walks its own epochs, a resumed step continuing where it stood)."""
    if len(weights) == 1:
        return [step * batch_size]
    key = (tuple(weights), batch_size, seed)
    with _POSITIONS_LOCK:
        done = _POSITIONS.setdefault(key, [[0] * len(weights)])
        while len(done) <= step:
            counts = stratum_counts(weights, batch_size, derive_seed(seed, "mixture", len(done) - 1))
            done.append([p + c for p, c in zip(done[-1], counts, strict=True)])
        return list(done[step])


def draw_step_tasks(
    strata: Sequence[Stratum], step: int, batch_size: int, seed: int,
    curriculum: Mapping[str, float] | None = None,
) -> list[TaskItem]:
    """A training step's ``batch_size`` tasks from the run's environments: each stratum's
    count by weight (``stratum_counts``, seeded by the step), then its tasks from its own
    stream: the next slice of its epochs, or with the curriculum (``curriculum`` the
    weights by task id) a weighted draw among its tasks. One environment takes exactly the
    draw a run without mixtures took (its seeds unsalted)."""
    for stratum in strata:
        if not stratum.items:
            raise ValueError(f"environment {stratum.label!r} has no training tasks")
    weights = [stratum.weight for stratum in strata]
    counts = stratum_counts(weights, batch_size, derive_seed(seed, "mixture", step))
    starts = stratum_positions(weights, step, batch_size, seed)
    chosen: list[TaskItem] = []
    for stratum, count, start in zip(strata, counts, starts, strict=True):
        salt = () if len(strata) == 1 else (stratum.label,)
        if count == 0:
            continue
        if curriculum is not None:
            chosen.extend(select_weighted_train_tasks(stratum.items, step, count, seed, curriculum, salt))
        else:
            chosen.extend(_epoch_span(stratum.items, start, count, seed, salt))
    return chosen


def backfill_step_tasks(
    strata: Sequence[Stratum], drawn: set[str], count: int, seed: int, step: int, round_: int,
    weights: Mapping[str, float] | None = None,
) -> list[TaskItem]:
    """Backfill round ``round_``'s ``count`` tasks: shared among the strata that still have
    tasks not drawn this step, by weight (as the step's own draw), each stratum's drawn by
    ``backfill_tasks``. Fewer, or none, when the step has drawn nearly every task."""
    open_strata = [s for s in strata if any(item.task_id not in drawn for item in s.items)]
    if not open_strata:
        return []
    counts = stratum_counts([s.weight for s in open_strata], count, derive_seed(seed, "mixture-backfill", step, round_))
    chosen: list[TaskItem] = []
    for stratum, share in zip(open_strata, counts, strict=True):
        salt = () if len(strata) == 1 else (stratum.label,)
        chosen.extend(backfill_tasks(stratum.items, drawn, share, seed, step, round_, weights, salt))
    return chosen


def run_strata(config: RunConfig, handle: EnvironmentHandle, split: str) -> list[Stratum]:
    """The run's environments as the draw sees them: a mixture's members, else its one
    environment under its label (``[env]``'s short name)."""
    return env_strata(handle, split, config.env.members[0].label)  # type: ignore[arg-type]


def select_validation_strata(strata: Sequence[Stratum], num_tasks: int | None) -> list[TaskItem]:
    """The validation tasks: each environment's first ``num_tasks`` (all when None)."""
    return [item for stratum in strata for item in select_validation_tasks(stratum.items, num_tasks)]


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
    items: Sequence[TaskItem], step: int, batch_size: int, seed: int, weights: Mapping[str, float],
    salt: tuple[object, ...] = (),
) -> list[TaskItem]:
    """The curriculum's ``batch_size`` tasks for ``step`` (``tasks/curriculum.py``): a weighted
    draw without replacement seeded by (seed, step); a batch larger than the task list
    takes them all, then draws again for the rest (seeded by the pass)."""
    if not items:
        raise ValueError("the environment has no training tasks")
    chosen: list[TaskItem] = []
    while len(chosen) < batch_size:
        seed_of_pass = derive_seed(seed, *salt, "curriculum", step, len(chosen) // len(items))
        chosen.extend(draw_tasks(items, batch_size - len(chosen), seed_of_pass, weights))
    return chosen


def backfill_tasks(
    items: Sequence[TaskItem], drawn: set[str], count: int, seed: int, step: int, round_: int,
    weights: Mapping[str, float] | None = None, salt: tuple[object, ...] = (),
) -> list[TaskItem]:
    """Backfill round ``round_``'s ``count`` tasks of ``step``: a draw seeded by (seed, step,
    round) among the tasks not ``drawn`` yet this step (task ids); fewer, or none, when
    the step has drawn nearly every task."""
    fresh = [item for item in items if item.task_id not in drawn]
    return draw_tasks(fresh, count, derive_seed(seed, *salt, "backfill", step, round_), weights)


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
