"""The files of async collection: finished groups and each step's admission.

``tasks/collect.py`` plays groups beside the trainer and writes each finished one here;
the trainer's admission of a step is a file too, so the run folder is the whole state of
a resumable async run::

    async/groups/group-000017.parquet   the group's episodes (episodes schema; step = its start version)
    async/groups/group-000017.json      its stamps, written last: the group is finished
    steps/step=000004/admission.json    which groups step 4 trained and which it dropped

Every file is written atomically (temporary file, then rename), episodes before stamps.
The ``admissions`` SQL view (``storage/views.py``) reads the admission files.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from rollflow.envs.episode import EpisodeRollout
from rollflow.storage.parquet import read_table, write_table_atomic
from rollflow.storage.records import EpisodeRecord
from rollflow.storage.runfolder import RunFolder
from rollflow.storage.schemas import episode_records_to_table, table_to_episode_records
from rollflow.storage.views import ADMISSION_JSON

GROUPS_DIR = Path("async") / "groups"


@dataclass(frozen=True)
class GroupStamp:
    """What ``group-NNNNNN.json`` says of a finished group."""

    index: int  # the data position: the index-th training task of the run
    task_id: str
    start_version: int  # the policy version every episode of the group started under
    finish_version: int  # the version the generator held when the group finished
    started_s: float  # wall clock (time.time())
    finished_s: float
    env: str | None = None  # the environment's label (a mixture member's); absent in older stamps


def group_paths(folder: RunFolder, index: int) -> tuple[Path, Path]:
    base = folder.root / GROUPS_DIR / f"group-{index:06d}"
    return base.with_suffix(".parquet"), base.with_suffix(".json")


def finished_groups(folder: RunFolder) -> dict[int, GroupStamp]:
    """Every group whose stamp exists (the stamp is written after the episodes)."""
    found: dict[int, GroupStamp] = {}
    directory = folder.root / GROUPS_DIR
    if not directory.is_dir():
        return found
    for path in sorted(directory.glob("group-*.json")):
        stamp = GroupStamp(**folder.read_json(path))
        found[stamp.index] = stamp
    return found


def write_group(folder: RunFolder, stamp: GroupStamp, rollouts: Sequence[EpisodeRollout]) -> None:
    episodes_path, stamp_path = group_paths(folder, stamp.index)
    group_id = f"collect/{stamp.index}"
    records = [
        EpisodeRecord(
            run_id=folder.run_id, step=stamp.start_version, split="train", task_id=stamp.task_id,
            group_id=group_id, episode_id=f"{group_id}/{i}", index_in_group=i, rollout=rollout, env=stamp.env,
        )  # fmt: skip
        for i, rollout in enumerate(rollouts)
    ]
    episodes_path.parent.mkdir(parents=True, exist_ok=True)
    write_table_atomic(episode_records_to_table(records), episodes_path)
    folder.write_json_atomic(stamp_path, asdict(stamp))


def read_group(folder: RunFolder, index: int) -> list[EpisodeRecord]:
    return table_to_episode_records(read_table(group_paths(folder, index)[0]))


@dataclass(frozen=True)
class Admission:
    """One training step's choice: the groups it trains and the stale ones it dropped."""

    step: int
    admitted: tuple[int, ...]
    dropped: tuple[int, ...]
    train_wait_s: float


def admission_path(folder: RunFolder, step: int) -> Path:
    return folder.step_dir(step) / ADMISSION_JSON


def read_admission(folder: RunFolder, step: int) -> Admission | None:
    path = admission_path(folder, step)
    if not path.exists():
        return None
    data = folder.read_json(path)
    groups = data["groups"]
    return Admission(
        step=int(data["step"]),
        admitted=tuple(g["group"] for g in groups if g["admitted"]),
        dropped=tuple(g["group"] for g in groups if not g["admitted"]),
        train_wait_s=float(data["train_wait_s"]),
    )


def async_step_metrics(folder: RunFolder, step: int) -> dict[str, float]:
    """``async/*`` of an async step (``{}`` for a lockstep one): read from its admission."""
    path = admission_path(folder, step)
    if not path.exists():
        return {}
    data = folder.read_json(path)
    ages = [g["staleness"] for g in data["groups"] if g["admitted"]]
    return {
        "async/train_wait_s": float(data["train_wait_s"]),
        "async/dropped_stale_groups": float(sum(not g["admitted"] for g in data["groups"])),
        "async/staleness_mean": sum(ages) / len(ages) if ages else 0.0,
        "async/staleness_max": float(max(ages, default=0)),
    }


def write_admission(folder: RunFolder, admission: Admission, stamps: dict[int, GroupStamp]) -> Path:
    """``admission.json``: one row per group the step took or dropped, with its age."""
    rows = []
    for index, admitted in [*((i, True) for i in admission.admitted), *((i, False) for i in admission.dropped)]:
        stamp = stamps[index]
        rows.append({
            "group": index, "task_id": stamp.task_id, "admitted": admitted,
            "trained_group_id": f"train/{admission.step}/{admission.admitted.index(index)}" if admitted else None,
            "start_version": stamp.start_version, "finish_version": stamp.finish_version,
            "staleness": admission.step - stamp.start_version,
            "collect_s": stamp.finished_s - stamp.started_s,
        })  # fmt: skip
    data = {"step": admission.step, "train_wait_s": admission.train_wait_s, "groups": rows}
    return folder.write_json_atomic(admission_path(folder, admission.step), data)


def consumed_groups(folder: RunFolder) -> set[int]:
    """Groups some step already took or dropped: never offered again."""
    taken: set[int] = set()
    for step in folder.steps("train"):
        admission = read_admission(folder, step)
        if admission is not None:
            taken.update(admission.admitted)
            taken.update(admission.dropped)
    return taken


def step_episode_records(folder: RunFolder, admission: Admission) -> list[EpisodeRecord]:
    """The step's episodes: the admitted groups' rows, renamed into the step's groups.

    ``policy_version`` keeps each episode's start version, so ``step - policy_version`` in
    the ``episodes`` view is how stale every trained episode was.
    """
    records = []
    for k, index in enumerate(admission.admitted):
        group_id = f"train/{admission.step}/{k}"
        for record in read_group(folder, index):
            records.append(EpisodeRecord(
                run_id=record.run_id, step=admission.step, split="train", task_id=record.task_id,
                group_id=group_id, episode_id=f"{group_id}/{record.index_in_group}",
                index_in_group=record.index_in_group, rollout=record.rollout, env=record.env,
            ))  # fmt: skip
    return records
