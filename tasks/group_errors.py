"""An async run's errored episodes, from the group that played them to the step that admits it.

A rollout worker keeps each finished group's errored episodes with their tracebacks in the
group's own file (``keep_group_errors``, before its episodes); the admit stage copies the
admitted groups' into the step's ``errors.jsonl`` under the step's episode ids
(``keep_admitted_errors``); finished groups no step took whose every episode errored are
played again on a resume (``replay_failed_groups``), so a fixed environment never trains
on them. The collector (``tasks/collect.py``) calls all three.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from rollflow.envs.episode import EpisodeRollout
from rollflow.storage.async_groups import Admission, group_paths, read_group
from rollflow.storage.records import EpisodeRecord
from rollflow.storage.runfolder import RunFolder
from rollflow.tasks.step_health import EpisodeError, keep_episode_errors, read_episode_errors, write_episode_errors


def group_errors_path(folder: RunFolder, index: int) -> Path:
    return group_paths(folder, index)[0].with_suffix(".errors.jsonl")


def keep_group_errors(
    folder: RunFolder, index: int, task_id: str, rollouts: Sequence[EpisodeRollout], tracebacks: dict[str, str]
) -> None:
    """The group's errored episodes with their tracebacks, in its own file (before its episodes)."""
    errors = [
        EpisodeError("rollout", f"collect/{index}/{i}", task_id, r.error, tracebacks.get(r.error))
        for i, r in enumerate(rollouts) if r.error is not None
    ]  # fmt: skip
    write_episode_errors(group_errors_path(folder, index), errors)


def keep_admitted_errors(folder: RunFolder, admission: Admission, records: Sequence[EpisodeRecord]) -> None:
    """The admitted groups' errors in the step's ``errors.jsonl``, under the step's episode ids."""
    errors = []
    for k, index in enumerate(admission.admitted):
        for error in read_episode_errors(group_errors_path(folder, index)):
            in_group = error.episode_id.rsplit("/", 1)[1]
            errors.append(replace(error, episode_id=f"train/{admission.step}/{k}/{in_group}"))
    keep_episode_errors(folder, admission.step, "train", "rollout", [r.episode_id for r in records], errors)


def replay_failed_groups(folder: RunFolder, waiting: Sequence[int]) -> None:
    """Finished groups no step took whose every episode errored in the rollout are played
    again (their files removed, stamp first): a step that admitted them failed the run, or
    would, and a resume after the environment's fix must not train on them."""
    failed = []
    for index in waiting:
        records = read_group(folder, index)
        if records and all(r.rollout.error is not None for r in records):
            episodes, stamp = group_paths(folder, index)
            for path in (stamp, episodes, group_errors_path(folder, index)):
                path.unlink(missing_ok=True)
            failed.append(index)
    if failed:
        print(f"  rollout workers: playing again {len(failed)} finished group(s) whose every episode errored: "
              f"{failed}", file=sys.stderr, flush=True)  # fmt: skip
