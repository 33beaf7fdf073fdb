"""The online difficulty curriculum: a training task whose recent groups all passed or all
failed is drawn less often (``[rollout].curriculum``).

GRPO learns nothing from a group whose episodes all pass or all fail: its advantages are
0. A task the policy always solves, or never does, spends a group of episodes a step for
no gradient. So each training task gets a weight from its ``RECENT_GROUPS`` latest groups
in the run's own scores (``storage/step_metrics.py``'s ``RECENT_TASK_GROUPS_SQL`` over the
Parquet of the steps before this one)::

    weight = max(floor, 1 - uniform / seen)

where ``seen`` is how many recent groups it has (at most ``RECENT_GROUPS``) and ``uniform``
how many of them had every episode pass or every episode fail. A task never played keeps
full weight 1, a task with one mixed and one uniform recent group 0.5, a task whose every
recent group was uniform the floor (``[rollout].curriculum_floor``): less likely, never
gone, so a task the policy forgets is seen again. The step's tasks are then a weighted
draw without replacement seeded by (seed, step) (``tasks/schedule.py``'s
``select_weighted_train_tasks``). The weights are recomputed from the files, so a resumed
step draws the same tasks as the run that died.

Simplified, and why: pass/fail is the environment's verdict (``scores.passed``), not the
shaped reward's variance that dynamic sampling reads; a group can have reward variance from
partial credit and still teach nothing about passing, which is what the curriculum is
for. Two recent groups: enough to forgive one unlucky group, few enough to follow a policy
that changes every step. No smoothing across tasks of one difficulty.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rollflow.envs.handle import TaskItem
from rollflow.storage.query import open_run_sql
from rollflow.storage.step_metrics import recent_task_groups
from rollflow.storage.runfolder import RunFolder

RECENT_GROUPS = 2
DIFFICULTY_KEY = "difficulty"  # the task metadata key of a task's difficulty label


def task_weight(recent_groups: Sequence[tuple[int, int]], floor: float) -> float:
    """The weight of a task from its recent groups' (passes, episodes): see the module."""
    if not recent_groups:
        return 1.0
    uniform = sum(passes in (0, episodes) for passes, episodes in recent_groups)
    return max(floor, 1.0 - uniform / len(recent_groups))


def curriculum_weights(folder: RunFolder, step: int, floor: float) -> dict[str, float]:
    """task_id -> weight of every training task played before ``step`` (unseen ones: absent, 1.0)."""
    if step == 0:
        return {}
    con = open_run_sql([folder.root])
    try:
        recent = recent_task_groups(con, before_step=step, recent=RECENT_GROUPS)
    finally:
        con.close()
    return {task_id: task_weight(groups, floor) for task_id, groups in recent.items()}


@dataclass(frozen=True)
class CurriculumSummary:
    """The step metrics of the weights a step drew with."""

    drawn_weight_mean: float  # mean weight of the step's drawn tasks (1.0: as uniform)
    downweighted_ratio: float  # of the tasks seen so far, the share weighted below 1
    seen_tasks: int

    def metrics(self) -> dict[str, float]:
        return {
            "curriculum/drawn_weight_mean": self.drawn_weight_mean,
            "curriculum/downweighted_ratio": self.downweighted_ratio,
            "curriculum/seen_tasks": float(self.seen_tasks),
        }


def summarize(weights: Mapping[str, float], drawn: Sequence[TaskItem]) -> CurriculumSummary:
    drawn_weights = [weights.get(item.task_id, 1.0) for item in drawn]
    seen = len(weights)
    down = sum(w < 1.0 for w in weights.values())
    return CurriculumSummary(
        drawn_weight_mean=sum(drawn_weights) / len(drawn_weights) if drawn_weights else 1.0,
        downweighted_ratio=down / seen if seen else 0.0,
        seen_tasks=seen,
    )


def difficulty_labels(items: Sequence[TaskItem]) -> dict[str, str]:
    """task_id -> its ``difficulty`` metadata as text, for the tasks that carry one (the
    bundled game's: how many facts a task needs looked up)."""
    labels = {}
    for item in items:
        label = item.payload.metadata.get(DIFFICULTY_KEY)
        if label is not None:
            labels[item.task_id] = str(label)
    return labels
