"""The online difficulty curriculum (``[rollout].curriculum``, ``tasks/curriculum.py``): a
task's weight from its recent groups' pass rates in the run's stored scores, unseen tasks
at full weight, the floor; the step's seeded weighted draw, the same after a resume; and
the step metrics (the weights' summary, the pass rate per difficulty label). A seeded
scripted policy on ``tests/difficulty_env.py``: no model, no Prefect."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from difficulty_env import SeededPolicy

from rollflow.config.rollout import RolloutConfig
from rollflow.config.run import EnvConfig, RunConfig, TrackingConfig
from rollflow.config.train import TrainConfig
from rollflow.envs.handle import TaskItem
from rollflow.envs.types import TaskExample
from rollflow.generators.policy_io import ActingPolicy
from rollflow.storage.query import open_run_sql, run_query
from rollflow.storage.runfolder import RunFolder
from rollflow.tasks.curriculum import curriculum_weights, task_weight
from rollflow.tasks.metrics import rollout_metrics
from rollflow.tasks.rollout import rollout_stage
from rollflow.tasks.rollout_plan import stage_plan
from rollflow.tasks.schedule import draw_tasks, select_weighted_train_tasks
from rollflow.tasks.scoring import score_stage

FLOOR = 0.1


def config(curriculum: bool = True) -> RunConfig:
    return RunConfig(
        env=EnvConfig(name="difficulty_env:load_environment", kwargs={"mixed": 4, "passing": 4, "failing": 4}),
        rollout=RolloutConfig(batch_size=4, episodes_per_task=2, concurrency=4, curriculum=curriculum,
                              curriculum_floor=FLOOR),
        train=TrainConfig(seed=0),
        tracking=TrackingConfig(enabled=False),
    )


def play_steps(run_dir: Path, steps: int, cfg: RunConfig) -> RunFolder:
    """Steps 0..steps-1 played and scored (no training: the scripted policy does not learn)."""
    folder = RunFolder(run_dir)
    for step in range(steps):
        paths = folder.step_paths(step)
        score_stage(cfg, rollout_stage(cfg, paths.episodes, step, "train", ActingPolicy.fixed(SeededPolicy())), paths.scores)
    return folder


def stored_groups(folder: RunFolder) -> dict[str, list[tuple[int, int]]]:
    """task -> (passes, episodes) of its groups, newest first, read straight from the scores."""
    con = open_run_sql(folder.root)
    _, rows = run_query(con, "SELECT task_id, step, count_if(passed), count(*) FROM scores "
                             "WHERE split = 'train' GROUP BY task_id, step ORDER BY task_id, step DESC")
    con.close()
    found: dict[str, list[tuple[int, int]]] = {}
    for task, _, passes, episodes in rows:
        found.setdefault(task, []).append((passes, episodes))
    return found


def test_a_tasks_weight_follows_its_recent_groups() -> None:
    assert task_weight([], FLOOR) == 1.0  # never played
    assert task_weight([(1, 2)], FLOOR) == 1.0  # mixed
    assert task_weight([(2, 2)], FLOOR) == FLOOR  # all passed
    assert task_weight([(0, 2), (1, 2)], FLOOR) == 0.5  # one uniform of two
    assert task_weight([(0, 2), (2, 2)], FLOOR) == FLOOR  # all failed, then all passed


def test_weights_come_from_the_stored_scores_of_earlier_steps_only(tmp_path: Path) -> None:
    folder = play_steps(tmp_path / "run", 4, config())
    stored = stored_groups(folder)
    weights = curriculum_weights(folder, 4, FLOOR)
    assert set(weights) == set(stored)  # unseen tasks are absent: weight 1
    assert weights == {task: task_weight(groups[:2], FLOOR) for task, groups in stored.items()}
    assert all(weights[t] == FLOOR for t in weights if not t.startswith("mixed"))  # always uniform
    # step 2's weights read steps 0 and 1 only, whatever later steps wrote
    early = {t: g for t, g in stored_groups_before(folder, 2).items()}
    assert curriculum_weights(folder, 2, FLOOR) == {t: task_weight(g[:2], FLOOR) for t, g in early.items()}
    assert curriculum_weights(folder, 0, FLOOR) == {}


def stored_groups_before(folder: RunFolder, step: int) -> dict[str, list[tuple[int, int]]]:
    con = open_run_sql(folder.root)
    _, rows = run_query(con, f"SELECT task_id, step, count_if(passed), count(*) FROM scores WHERE step < {step} "
                             "GROUP BY task_id, step ORDER BY task_id, step DESC")
    con.close()
    found: dict[str, list[tuple[int, int]]] = {}
    for task, _, passes, episodes in rows:
        found.setdefault(task, []).append((passes, episodes))
    return found


def test_the_weighted_draw_is_seeded_without_replacement_and_leans_on_weights() -> None:
    items = [TaskItem(f"t{i}", TaskExample(input=str(i), id=f"t{i}")) for i in range(10)]
    drawn = draw_tasks(items, 4, seed=7)
    assert drawn == draw_tasks(items, 4, seed=7) and len({i.task_id for i in drawn}) == 4
    many = select_weighted_train_tasks(items, 3, 15, 0, {})
    assert len(many) == 15 and len({i.task_id for i in many[:10]}) == 10  # a whole pass, then more
    light = {f"t{i}": 0.001 for i in range(5)}  # t0..t4 nearly never
    picks = [t.task_id for seed in range(50) for t in draw_tasks(items, 3, seed, light)]
    assert sum(p in light for p in picks) < len(picks) / 10


def test_a_resumed_step_draws_the_same_tasks(tmp_path: Path) -> None:
    cfg = config()
    folder = play_steps(tmp_path / "run", 3, cfg)
    tasks = lambda f: [t.task_id for chunk in stage_plan(cfg, 3, "train", f).chunks for t in chunk]  # noqa: E731
    shutil.copytree(tmp_path / "run", tmp_path / "copy")
    assert tasks(folder) == tasks(RunFolder(tmp_path / "copy"))
    # step 2 played again from its parts' absence: the weights from steps 0 and 1 give the same draw
    before = [t.task_id for chunk in stage_plan(cfg, 2, "train", folder).chunks for t in chunk]
    shutil.rmtree(folder.step_dir(2))
    assert [t.task_id for chunk in stage_plan(cfg, 2, "train", folder).chunks for t in chunk] == before
    plain = [t.task_id for chunk in stage_plan(config(curriculum=False), 3, "train", folder).chunks for t in chunk]
    assert plain != tasks(folder)  # the curriculum is not the epoch's slice
    with pytest.raises(ValueError, match="needs its folder"):
        stage_plan(cfg, 3, "train")


def test_the_step_metrics_have_the_weights_and_a_pass_rate_per_difficulty(tmp_path: Path) -> None:
    folder = play_steps(tmp_path / "run", 3, config())
    metrics = rollout_metrics(folder.root, 2, "train")
    weights = curriculum_weights(folder, 2, FLOOR)
    con = open_run_sql(folder.root)
    _, rows = run_query(con, "SELECT DISTINCT task_id FROM scores WHERE step = 2")
    con.close()
    drawn = [weights.get(r[0], 1.0) for r in rows]
    assert metrics["curriculum/drawn_weight_mean"] == pytest.approx(sum(drawn) / len(drawn))
    assert metrics["curriculum/seen_tasks"] == len(weights)
    assert metrics["curriculum/downweighted_ratio"] == pytest.approx(sum(w < 1 for w in weights.values()) / len(weights))
    kinds = {r[0].split("-")[0] for r in rows}
    assert metrics.get("reward/pass_rate/difficulty_pass", 1.0) == 1.0
    assert metrics.get("reward/pass_rate/difficulty_fail", 0.0) == 0.0
    assert {k.rsplit("_", 1)[1] for k in metrics if k.startswith("reward/pass_rate/difficulty_")} == kinds
    plain = play_steps(tmp_path / "plain", 1, config(curriculum=False))
    assert not any(k.startswith("curriculum/") for k in rollout_metrics(plain.root, 0, "train"))


def test_the_bundled_games_tasks_are_labelled_by_the_facts_they_need() -> None:
    from rollflow.envs.tool_use_game.tasks import generate_examples
    from rollflow.tasks.curriculum import difficulty_labels

    train, _ = generate_examples(3, 30, 0)
    labels = difficulty_labels([TaskItem(e.id or "", e) for e in train])
    assert labels == {e.id: str(len(e.metadata["needed_keys"])) for e in train}
    assert set(labels.values()) == {"1", "2", "3"}
