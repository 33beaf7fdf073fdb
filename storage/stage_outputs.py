"""A stage's output named by its path: where it sits in the run folder, finished or not, read and written.

The flow hands each stage the ``StepPaths`` paths it reads and the one it writes
(``flows/step.py``); these functions give a path back its meaning in the layout
(``storage/runfolder.py``), so a stage needs no run folder, step or split to find its
files, and every write still goes through ``RunFolder.write_stage``'s checks: the records
are the stage's, their step and split are the folder's, and a finished output is never
rewritten.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from rollflow.storage.arrow_schemas import RecordKind
from rollflow.storage.errors import StorageError
from rollflow.storage.parquet import read_table
from rollflow.storage.runfolder import SPLIT_DIRS, TRAIN_JSON, RunFolder
from rollflow.storage.step_names import parse_step_dirname


@dataclass(frozen=True)
class OutputLocation:
    """What a stage output's path names: its run folder, step, split and stage."""

    folder: RunFolder
    step: int
    split: str
    stage: str


def locate_output(path: Path | str) -> OutputLocation:
    """The run folder, step, split and stage of a stage output path (``<run>/steps/step=N/scores.parquet``).

    Raises ``ValueError`` for a path that is no stage output of the layout.
    """
    path = Path(path).absolute()
    step = parse_step_dirname(path.parent.name)
    split = {name: split for split, name in SPLIT_DIRS.items()}.get(path.parent.parent.name)
    if step is None or split is None:
        raise ValueError(f"{path}: not a stage output of a run folder (<run>/steps/step=NNNNNN/...)")
    stage = "train" if path.name == TRAIN_JSON else path.name.removesuffix(".parquet")
    folder = RunFolder(path.parent.parent.parent)
    folder.stage_path(step, stage, split)  # refuses a stage the split does not have
    return OutputLocation(folder, step, split, stage)


def finished_output(path: Path | str) -> Path | None:
    """The finished output ``path`` stands for, or None.

    A stage output is finished as one file or as a sealed folder of parts, whichever of the
    two ``path`` names (``StepPaths.episodes`` and ``.admitted`` stand for each other); any
    other path (``StepPaths.metrics_json``) once it exists.
    """
    try:
        where = locate_output(path)
    except ValueError:
        return Path(path) if Path(path).exists() else None
    return where.folder.stage_output(where.step, where.stage, where.split)


def write_output(table: pa.Table, out: Path) -> Path:
    """Write a stage's one-file output at ``out``, checked as ``RunFolder.write_stage`` checks."""
    where = locate_output(out)
    if where.folder.stage_path(where.step, where.stage, where.split) != Path(out).absolute():
        raise ValueError(f"{out}: a {where.stage} output written whole is one file, {where.stage}.parquet")
    return where.folder.write_stage(table, where.step, where.stage, where.split)


def write_output_part(table: pa.Table, out: Path, index: int) -> Path:
    """Write part ``index`` of a sharded output at ``out`` (its parts folder), checked as
    ``RunFolder.write_stage_part`` checks."""
    where = _parts_folder(out)
    return where.folder.write_stage_part(table, where.step, where.stage, index, where.split)


def seal_output(out: Path) -> Path:
    """Seal the sharded output at ``out`` (its parts 0..n-1 complete); returns ``out``."""
    where = _parts_folder(out)
    return where.folder.seal_stage(where.step, where.stage, where.split)


def _parts_folder(out: Path) -> OutputLocation:
    where = locate_output(out)
    if where.folder.parts_dir(where.step, where.stage, where.split) != Path(out).absolute():
        raise ValueError(f"{out}: a sharded {where.stage} output is a folder of parts, {where.stage}/")
    return where


def read_output(path: Path) -> pa.Table:
    """A finished stage output (one file or a sealed folder of parts), its records checked."""
    where = locate_output(path)
    if finished_output(path) != Path(path).absolute():
        raise StorageError(f"{path}: the {where.stage} output is not complete")
    return read_table(path, RecordKind(where.stage))
