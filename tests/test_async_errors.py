"""Async runs keep errored episodes' tracebacks and replay all-failed groups (tasks/collect.py).

The files alone, no server: a group's own ``errors.jsonl`` written with it, the admission
copying the admitted groups' lines into the step's ``errors.jsonl`` under the step's
episode ids, and a resume playing again the finished groups whose every episode errored.
The real run is tests/test_loud_failures.py's async test.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from rollflow.config.rollout import RolloutConfig
from rollflow.config.run import RunConfig
from rollflow.envs.episode import EpisodeRollout
from rollflow.storage.async_groups import (
    Admission,
    GroupStamp,
    finished_groups,
    group_paths,
    step_episode_records,
    write_group,
)
from rollflow.storage.runfolder import RunFolder
from rollflow.tasks.collect import RolloutWorkers
from rollflow.tasks.group_errors import group_errors_path, keep_admitted_errors, keep_group_errors
from rollflow.tasks.step_health import errors_path, read_episode_errors

TESTS = Path(__file__).parent
BROKEN = "KeyError: 'the step is broken' (in step_episode)"
TRACEBACKS = {BROKEN: 'Traceback (most recent call last):\n  raise KeyError("the step is broken")\n'}


def _rollout(error: str | None) -> EpisodeRollout:
    return EpisodeRollout(
        messages=(), response_text="", turns=1, terminated=error is None, truncated=False,
        truncation_cause=None, error=error,
    )  # fmt: skip


def _played(folder: RunFolder, index: int, errors: list[str | None]) -> None:
    """Group ``index`` as the rollout workers write it: its errors file, then the group."""
    rollouts = [_rollout(e) for e in errors]
    keep_group_errors(folder, index, f"t{index}", rollouts, TRACEBACKS)
    write_group(folder, GroupStamp(index, f"t{index}", 0, 0, 0.0, 1.0), rollouts)


def test_the_admission_copies_its_groups_tracebacks_under_the_steps_episode_ids(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "run")
    _played(folder, 4, [BROKEN, None])
    _played(folder, 7, [BROKEN, BROKEN])
    _played(folder, 9, [None, None])
    assert not group_errors_path(folder, 9).exists(), "a group with no error has no errors file"
    assert [e.episode_id for e in read_episode_errors(group_errors_path(folder, 4))] == ["collect/4/0"]
    admission = Admission(step=3, admitted=(7, 4, 9), dropped=(), train_wait_s=0.0)
    keep_admitted_errors(folder, admission, step_episode_records(folder, admission))
    kept = read_episode_errors(errors_path(folder, 3, "train"))
    assert [(e.episode_id, e.task_id, e.stage) for e in kept] == [
        ("train/3/0/0", "t7", "rollout"), ("train/3/0/1", "t7", "rollout"), ("train/3/1/0", "t4", "rollout"),
    ]  # fmt: skip
    assert all(e.error == BROKEN and 'raise KeyError("the step is broken")' in (e.traceback or "") for e in kept)
    # Admitted again (a resumed step): its lines are replaced, not doubled.
    keep_admitted_errors(folder, admission, step_episode_records(folder, admission))
    assert read_episode_errors(errors_path(folder, 3, "train")) == kept


def test_a_resume_plays_again_the_finished_groups_whose_every_episode_errored(tmp_path: Path) -> None:
    sys.path.insert(0, str(TESTS))
    folder = RunFolder(tmp_path / "run")
    _played(folder, 0, [BROKEN, BROKEN])
    _played(folder, 1, [BROKEN, None])  # one episode to learn from: kept
    _played(folder, 2, [BROKEN, BROKEN])
    config = RunConfig(
        env=replace(RunConfig().env, name="varied_reward_env:load_environment"),
        rollout=RolloutConfig(backend="vllm", batch_size=2, episodes_per_task=2, max_turns=2, max_steps_off_policy=1),
    )
    workers = RolloutWorkers(config, folder, generator=None, first_step=0)  # type: ignore[arg-type]
    assert set(workers.buffer.finished) == {1}
    assert workers.buffer.replay == [0] and workers.buffer.next_index == 2, "0 first, then 2 and on"
    assert set(finished_groups(folder)) == {1}
    for index in (0, 2):
        assert not any(p.exists() for p in (*group_paths(folder, index), group_errors_path(folder, index)))
    assert group_errors_path(folder, 1).exists()
