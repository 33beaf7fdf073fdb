"""Dynamic sampling that backfills (``[rollout].backfill_rounds``, ``tasks/rollout_plan.py``'s
``play_backfill_rounds``): a step's first round is the plain step, further rounds of fresh tasks fill
the batch with groups that have reward variance (the scoring stage's own decision, from
``tasks/shaping.py``), an overshoot is scored but not trained, the rounds limit holds, a
killed rollout replays only its missing chunks to the same episodes, and the step metrics
say how many groups and rounds it took. A seeded scripted policy on ``tests/difficulty_env.py``
(the task chooses whether its group varies): no model, no Prefect."""

from __future__ import annotations

from pathlib import Path

import pytest
from difficulty_env import SeededPolicy

from rollflow.config.checks import check_run_config
from rollflow.config.cluster import ClusterConfig
from rollflow.config.parsing import ConfigError
from rollflow.config.rollout import RolloutConfig
from rollflow.config.run import EnvConfig, RunConfig, TrackingConfig
from rollflow.config.train import TrainConfig
from rollflow.generators.policy_io import ActingPolicy
from rollflow.storage.parquet import COMPLETE_MARKER, part_path
from rollflow.storage.query import open_run_sql, run_query
from rollflow.storage.runfolder import RunFolder
from rollflow.tasks.metrics import rollout_metrics
from rollflow.tasks.rollout import rollout_stage
from rollflow.tasks.rollout_plan import backfill_draw
from rollflow.tasks.schedule import chunk_seed
from rollflow.tasks.scoring import score_stage

BATCH = 4


def config(rounds: int, *, seed: int = 0, mixed: int = 4, passing: int = 6, failing: int = 6) -> RunConfig:
    """Groups of 2, two groups a chunk (concurrency 4)."""
    return RunConfig(
        env=EnvConfig(name="difficulty_env:load_environment",
                      kwargs={"mixed": mixed, "passing": passing, "failing": failing}),
        rollout=RolloutConfig(batch_size=BATCH, episodes_per_task=2, concurrency=4, backfill_rounds=rounds),
        train=TrainConfig(dynamic_sampling=True, seed=seed),
        tracking=TrackingConfig(enabled=False),
    )


def play(run_dir: Path, cfg: RunConfig, policy: SeededPolicy | None = None) -> RunFolder:
    """Step 0 played and scored."""
    folder = RunFolder(run_dir)
    paths = folder.step_paths(0)
    episodes = rollout_stage(cfg, paths.episodes, 0, "train", ActingPolicy.fixed(policy or SeededPolicy()))
    score_stage(cfg, episodes, paths.scores)
    return folder


def groups(folder: RunFolder) -> list[tuple[int, str, bool, bool, tuple[str, ...]]]:
    """(group number, task, has variance, trained, answers) per group, in play order."""
    con = open_run_sql(folder.root)
    _, rows = run_query(con, """
        SELECT s.group_id, s.task_id, bool_or(NOT s.zero_variance), bool_or(s.trained),
               list(e.response_text ORDER BY e.index_in_group)
        FROM scores s JOIN episodes e USING (episode_id) GROUP BY s.group_id, s.task_id""")
    con.close()
    return sorted((int(g.rsplit("/", 1)[1]), t, v, tr, tuple(a)) for g, t, v, tr, a in rows)


def test_round_zero_is_the_plain_step_and_the_batch_fills_with_varied_groups(tmp_path: Path) -> None:
    plain = groups(play(tmp_path / "plain", config(0)))
    backfilled = groups(play(tmp_path / "backfilled", config(5)))
    assert len(plain) == BATCH
    assert sum(varied for _, _, varied, _, _ in plain) < BATCH  # else there is nothing to backfill
    assert backfilled[:BATCH] == plain  # same tasks, same seeds, same answers
    assert sum(trained for _, _, _, trained, _ in backfilled) == BATCH
    assert all(trained == varied for _, _, varied, trained, _ in backfilled)
    assert len({task for _, task, _, _, _ in backfilled}) == len(backfilled)  # never a task twice a step
    metrics = rollout_metrics(tmp_path / "backfilled", 0, "train")
    assert metrics["rollout/backfill_groups"] == len(backfilled) - BATCH
    assert metrics["rollout/backfill_rounds"] >= 1
    assert metrics["episodes/groups"] == len(backfilled)
    assert "rollout/backfill_groups" not in rollout_metrics(tmp_path / "plain", 0, "train")


def test_an_overshoot_is_scored_but_only_the_first_batch_size_varied_groups_train(tmp_path: Path) -> None:
    # seed 1: one group missing after the first round, and the round's whole chunk of two
    # fresh tasks both vary
    found = groups(play(tmp_path / "run", config(3, seed=1, mixed=6, passing=3, failing=3)))
    varied = [number for number, _, v, _, _ in found if v]
    assert len(varied) == BATCH + 1
    assert [number for number, _, _, trained, _ in found if trained] == varied[:BATCH]


def test_a_round_draws_what_is_missing_at_the_steps_rate_not_a_whole_chunk(tmp_path: Path) -> None:
    # four groups a chunk (concurrency 8); seed 3 puts the one task that never varies in
    # the first round, so one group is missing: at 3 of 4 groups varied, a round of two
    # tasks is expected to find it, where a whole chunk would play four
    cfg = RunConfig(
        env=EnvConfig(name="difficulty_env:load_environment", kwargs={"mixed": 7, "passing": 1, "failing": 0}),
        rollout=RolloutConfig(batch_size=BATCH, episodes_per_task=2, concurrency=8, backfill_rounds=2),
        train=TrainConfig(dynamic_sampling=True, seed=3),
        tracking=TrackingConfig(enabled=False),
    )
    found = groups(play(tmp_path / "run", cfg))
    assert [varied for _, _, varied, _, _ in found[:BATCH]].count(False) == 1
    assert len(found) == BATCH + 2
    metrics = rollout_metrics(tmp_path / "run", 0, "train")
    assert (metrics["rollout/backfill_rounds"], metrics["rollout/backfill_groups"]) == (1, 2)


@pytest.mark.parametrize(
    ("missing", "varied", "played", "per_chunk", "drawn"),
    [
        (1, 7, 8, 12, 2),  # 7 of 8 varied: 8/7 rounded up, not a chunk of 12
        (3, 5, 8, 12, 5),  # 4.8 rounded up
        (2, 6, 8, 12, 3),
        (8, 0, 8, 12, 12),  # nothing varied yet: the whole chunk
        (5, 1, 8, 4, 8),  # 40 expected, capped at two whole chunks
        (1, 4, 4, 2, 1),  # every group varied so far: just the one
    ],
)
def test_the_backfill_draw_size(missing: int, varied: int, played: int, per_chunk: int, drawn: int) -> None:
    assert backfill_draw(missing, varied, played, per_chunk) == drawn


def test_the_rounds_limit_is_honoured_when_no_task_varies(tmp_path: Path) -> None:
    folder = play(tmp_path / "run", config(2, mixed=0, passing=8, failing=8))
    found = groups(folder)
    # each round draws the 4 missing groups (two whole chunks) and finds no variance
    assert len(found) == BATCH + 2 * BATCH
    assert len({task for _, task, _, _, _ in found}) == len(found)  # each round draws fresh tasks
    assert not any(trained for _, _, _, trained, _ in found)
    metrics = rollout_metrics(folder.root, 0, "train")
    assert (metrics["rollout/backfill_rounds"], metrics["rollout/backfill_groups"]) == (2, 2 * BATCH)
    assert metrics["reward/zero_variance_skip_ratio"] == 1.0


def test_the_backfill_stops_when_every_task_was_drawn(tmp_path: Path) -> None:
    found = groups(play(tmp_path / "run", config(10, mixed=0, passing=3, failing=3)))
    assert sorted(task for _, task, _, _, _ in found) == [f"{k}-{n}" for k in ("fail", "pass") for n in range(3)]
    assert rollout_metrics(tmp_path / "run", 0, "train")["rollout/backfill_rounds"] == 1


class Killed(BaseException):
    """Stands for the process dying between two chunks."""


class DyingPolicy(SeededPolicy):
    def __init__(self, chunks: int) -> None:
        super().__init__()
        self.chunks = chunks

    def reseed(self, seed: int) -> None:
        if len(self.seeds) == self.chunks:
            raise Killed
        super().reseed(seed)


@pytest.mark.parametrize("killed_after", [1, 3])  # in the first round; in a backfill round
def test_a_killed_rollout_replays_only_its_missing_chunks_to_the_same_episodes(
    tmp_path: Path, killed_after: int
) -> None:
    cfg = config(5)
    whole = groups(play(tmp_path / "whole", cfg))
    chunks = len(list(RunFolder(tmp_path / "whole").part_paths(0, "episodes")))
    assert chunks > killed_after + 1  # the kill leaves chunks to replay
    folder = RunFolder(tmp_path / "killed")
    with pytest.raises(Killed):
        rollout_stage(cfg, folder.step_paths(0).episodes, 0, "train", ActingPolicy.fixed(DyingPolicy(killed_after)))
    assert len(folder.part_paths(0, "episodes")) == killed_after
    resumed = SeededPolicy()
    play(tmp_path / "killed", cfg, resumed)
    assert resumed.seeds == [chunk_seed(cfg, "train", 0, i) for i in range(killed_after, chunks)]
    assert groups(folder) == whole


def test_a_lost_last_part_is_played_again_the_same(tmp_path: Path) -> None:
    cfg = config(5)
    folder = play(tmp_path / "run", cfg)
    before = groups(folder)
    parts = folder.parts_dir(0, "episodes")
    last = len(folder.part_paths(0, "episodes")) - 1
    part_path(parts, last).unlink()
    (parts / COMPLETE_MARKER).unlink()
    folder.step_paths(0).scores.unlink()
    replay = SeededPolicy()
    play(tmp_path / "run", cfg, replay)
    assert replay.seeds == [chunk_seed(cfg, "train", 0, last)]
    assert groups(folder) == before


@pytest.mark.parametrize(
    ("rollout", "train", "cluster", "message"),
    [
        ({"backfill_rounds": 2}, {"dynamic_sampling": False}, {}, "set \\[train\\].dynamic_sampling = true"),
        ({"backfill_rounds": 2, "max_steps_off_policy": 1, "backend": "vllm"}, {"dynamic_sampling": True}, {},
         "async collection"),
        ({"curriculum": True, "max_steps_off_policy": 1, "backend": "vllm"}, {}, {}, "curriculum choose"),
        ({"backfill_rounds": 2, "backend": "vllm"}, {"dynamic_sampling": True}, {"mode": "local"},
         "nodes play the chunks of the step's first round only"),
    ],
)
def test_settings_the_backfill_cannot_serve_are_refused(
    rollout: dict[str, object], train: dict[str, object], cluster: dict[str, object], message: str
) -> None:
    cfg = RunConfig(rollout=RolloutConfig(**rollout), train=TrainConfig(**train), cluster=ClusterConfig(**cluster))
    with pytest.raises(ConfigError, match=message):
        check_run_config(cfg)


def test_backfill_rounds_and_the_floor_are_range_checked() -> None:
    with pytest.raises(ConfigError, match="backfill_rounds"):
        RolloutConfig(backfill_rounds=-1)
    with pytest.raises(ConfigError, match="curriculum_floor"):
        RolloutConfig(curriculum_floor=0.0)
