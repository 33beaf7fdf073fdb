"""One run's folder: where each stage's output lives, what is finished, where to resume.

```
runs/<run_id>/config.toml                          frozen: written once
runs/<run_id>/steps/step=000003/episodes.parquet   or episodes/part-00000.parquet ...
runs/<run_id>/steps/step=000003/scores.parquet
runs/<run_id>/steps/step=000003/samples.parquet
runs/<run_id>/steps/step=000003/train.json         the step's TrainResult
runs/<run_id>/steps/step=000003/stage_seconds.json each stage's wall seconds when it ran
runs/<run_id>/steps/step=000003/metrics.json       written last: the step is finished
runs/<run_id>/checkpoints/step=000003/             renamed into place when complete
runs/<run_id>/validation/step=000010/episodes.parquet, scores.parquet
```

The folder's name is the run id. A stage output that exists is complete: every file is
written under a hidden temporary name and renamed (``storage/parquet.py``); a sharded
output is complete once sealed with ``_complete.json``; a checkpoint folder is written
under a temporary name and renamed whole by ``commit_checkpoint``. So resuming needs no
journal: ``discard_temporaries`` removes what a crash left half-written, and
``step_finished`` / ``first_incomplete_stage`` say where to start again.

``step_paths(step, split)`` names every file of one step (``StepPaths``); the flow hands
those paths to the stages, each reading the paths it is given and writing the one it is
told to (``storage/stage_outputs.py``: ``write_output`` keeps ``write_stage``'s checks,
the right records for the right step, never over a finished output).

Simplified: steps count from 0; a step is trained once its ``train.json`` exists (the
train stage commits its checkpoint first, then writes ``train.json``) and finished once
its ``metrics.json`` does (``step_finished``, the one definition every reader uses). One
process writes a run at a time; ``storage/runlock.py`` holds the folder, nothing here
locks it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from rollflow.storage.arrow_schemas import KIND_KEY, RecordKind
from rollflow.storage.checkpoint_folders import CheckpointFolders
from rollflow.storage.errors import (
    ConfigMismatchError,
    CorruptFileError,
    SchemaMismatchError,
    StageExistsError,
    StorageError,
)
from rollflow.storage.parquet import (
    COMPLETE_MARKER,
    is_temporary,
    list_parts,
    remove_temporaries,
    read_table,
    seal_parts,
    write_bytes_atomic,
    write_part,
    write_table_atomic,
)
from rollflow.storage.records import TrainResult
from rollflow.storage.schemas import train_result_from_json, train_result_to_json
from rollflow.storage.step_names import parse_step_dirname, step_dirname

SPLIT_DIRS = {"train": "steps", "validation": "validation"}
DERIVED_DIRS = ("rescores", "replays")  # outputs other commands derive from the run (storage/derived.py)
STAGES = {"train": ("episodes", "scores", "samples", "train"), "validation": ("episodes", "scores")}
# Stages only some runs have (OPD's teacher scores): allowed, but never what a run waits on.
OPTIONAL_STAGES = {"train": ("teacher",), "validation": ()}
TRAIN_JSON = "train.json"
METRICS_JSON = "metrics.json"  # written last in a step: the step is finished
STAGE_SECONDS_JSON = "stage_seconds.json"  # stage name -> wall seconds of its one real run
# The stages whose wall time a training step records, in order; time/step needs them all.
TIMED_STAGES = ("rollout", "scoring", "flatten", "train")
OPTIONAL_TIMED_STAGES = ("teacher",)  # only where a teacher is configured (OPD)


@dataclass(frozen=True)
class StepPaths:
    """Where each stage of one step reads and writes; paths only, nothing says what exists.

    ``episodes`` is the folder the rollout writes part by part and seals; an async step's
    admission writes the same records as the one file ``admitted``. Either is the step's
    episodes (``stage_outputs.finished_output`` finds the one there is). A validation step has
    only ``episodes``, ``scores`` and ``metrics_json``.
    """

    step: int
    split: str
    episodes: Path  # episodes/part-*.parquet, sealed with _complete.json
    admitted: Path  # episodes.parquet
    scores: Path
    samples: Path
    teacher: Path
    train_json: Path
    metrics_json: Path
    checkpoint: Path  # checkpoints/step=NNNNNN/, the version this step's training makes


class RunFolder(CheckpointFolders):
    """The files of one run under ``root`` (``runs/<run_id>``); its checkpoint folders are
    ``CheckpointFolders``' (``storage/checkpoint_folders.py``)."""

    def __init__(self, root: Path | str) -> None:
        # Absolute, so that a path this folder hands out (``stage_path``, ``step_dir``) can
        # come back to it (``write_json_atomic``) without the relative prefix applied twice.
        self.root = Path(root).absolute()

    def __repr__(self) -> str:
        return f"RunFolder({str(self.root)!r})"

    @property
    def run_id(self) -> str:
        return self.root.resolve().name

    @property
    def config_path(self) -> Path:
        return self.root / "config.toml"

    def exists(self) -> bool:
        return self.root.is_dir()

    # ------------------------------------------------------------ config and JSON

    def write_config(self, text: str) -> Path:
        """Freeze the run's config: a second write must be byte-identical."""
        if self.config_path.exists():
            if self.config_path.read_text() != text:
                raise ConfigMismatchError(
                    f"{self.config_path}: the run's config is frozen and differs from the "
                    "one given; start a new run folder to change it"
                )
            return self.config_path
        return write_bytes_atomic(text.encode(), self.config_path)

    def read_config(self) -> str:
        if not self.config_path.exists():
            raise StorageError(f"{self.config_path}: no config; is {self.root} a run folder?")
        return self.config_path.read_text()

    def write_json_atomic(self, path: Path | str, data: Any) -> Path:
        """Write JSON atomically; a relative ``path`` is inside the run folder.

        NaN and infinities are written as JSON's common extension (``NaN``), which Python
        and DuckDB both read back: a diverged loss is data, not a crash.
        """
        target = self.root / path
        return write_bytes_atomic(json.dumps(data, indent=2).encode(), target)

    def read_json(self, path: Path | str) -> Any:
        target = self.root / path
        try:
            return json.loads(target.read_text())
        except FileNotFoundError:
            raise StorageError(f"{target}: no such file") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise CorruptFileError(target, f"not JSON: {exc}") from exc

    # ------------------------------------------------------------ stage paths

    def split_dir(self, split: str) -> Path:
        if split not in SPLIT_DIRS:
            raise ValueError(f"split must be one of {sorted(SPLIT_DIRS)}, got {split!r}")
        return self.root / SPLIT_DIRS[split]

    def step_dir(self, step: int, split: str = "train") -> Path:
        return self.split_dir(split) / step_dirname(step)

    def step_paths(self, step: int, split: str = "train") -> StepPaths:
        folder = self.step_dir(step, split)
        return StepPaths(
            step=step, split=split, episodes=folder / "episodes", admitted=folder / "episodes.parquet",
            scores=folder / "scores.parquet", samples=folder / "samples.parquet",
            teacher=folder / "teacher.parquet", train_json=folder / TRAIN_JSON,
            metrics_json=folder / METRICS_JSON, checkpoint=self.checkpoint_dir(step),
        )

    def _check_stage(self, stage: str, split: str) -> None:
        allowed = STAGES[split] + OPTIONAL_STAGES[split] if split in STAGES else ()
        if stage not in allowed:
            self.split_dir(split)  # names a bad split first
            raise ValueError(f"{split} stages are {list(allowed)}, got {stage!r}")

    def stage_path(self, step: int, stage: str, split: str = "train") -> Path:
        """The single-file output of a stage: ``episodes.parquet`` ... ``train.json``."""
        self._check_stage(stage, split)
        name = TRAIN_JSON if stage == "train" else f"{stage}.parquet"
        return self.step_dir(step, split) / name

    def parts_dir(self, step: int, stage: str, split: str = "train") -> Path:
        """The folder of a sharded output (``episodes/part-00000.parquet`` ...)."""
        self._check_stage(stage, split)
        if stage == "train":
            raise ValueError("the train stage writes train.json, never part files")
        return self.step_dir(step, split) / stage

    def stage_output(self, step: int, stage: str, split: str = "train") -> Path | None:
        """The complete output of a stage (file or sealed parts folder), or None."""
        single = self.stage_path(step, stage, split)
        sealed = stage != "train" and (self.parts_dir(step, stage, split) / COMPLETE_MARKER).exists()
        if single.exists() and sealed:
            raise StorageError(f"{single.parent}: {stage} is both one file and sealed parts")
        if single.exists():
            return single
        return self.parts_dir(step, stage, split) if sealed else None

    def is_complete(self, step: int, stage: str, split: str = "train") -> bool:
        return self.stage_output(step, stage, split) is not None

    def part_paths(self, step: int, stage: str, split: str = "train") -> list[Path]:
        """The complete parts written so far (a resumed rollout keeps them)."""
        return list_parts(self.parts_dir(step, stage, split))

    # ------------------------------------------------------------ stage writes and reads

    def _refuse_if_complete(self, step: int, stage: str, split: str) -> None:
        if self.is_complete(step, stage, split):
            raise StageExistsError(
                f"{self.step_dir(step, split)}: {stage} is already complete and is never rewritten"
            )

    def write_stage(self, table: pa.Table, step: int, stage: str, split: str = "train") -> Path:
        self._refuse_if_complete(step, stage, split)
        if stage == "train":
            raise ValueError("write the train stage with write_train_result")
        _check_table(table, stage, step, split)
        return write_table_atomic(table, self.stage_path(step, stage, split))

    def write_stage_part(
        self, table: pa.Table, step: int, stage: str, index: int, split: str = "train"
    ) -> Path:
        if self.stage_path(step, stage, split).exists():
            raise StageExistsError(f"{self.stage_path(step, stage, split)} exists: no parts")
        _check_table(table, stage, step, split)
        return write_part(table, self.parts_dir(step, stage, split), index)

    def seal_stage(self, step: int, stage: str, split: str = "train") -> Path:
        """Declare a sharded output complete; parts must be 0..n-1 with none missing."""
        self._refuse_if_complete(step, stage, split)
        folder = self.parts_dir(step, stage, split)
        seal_parts(folder)
        return folder

    def read_stage(self, step: int, stage: str, split: str = "train") -> pa.Table:
        output = self.stage_output(step, stage, split)
        if output is None:
            raise StorageError(f"{self.step_dir(step, split)}: {stage} is not complete")
        return read_table(output, RecordKind(stage))

    def write_train_result(self, result: TrainResult) -> Path:
        self._refuse_if_complete(result.step, "train", "train")
        return self.write_json_atomic(
            self.stage_path(result.step, "train"), train_result_to_json(result)
        )

    def read_train_result(self, step: int) -> TrainResult:
        return self.read_train_json(self.stage_path(step, "train"))

    def read_train_json(self, path: Path) -> TrainResult:
        """The ``TrainResult`` in the ``train.json`` at ``path``."""
        data = self.read_json(path)
        try:
            return train_result_from_json(data)
        except (ValueError, TypeError, AttributeError) as exc:
            raise SchemaMismatchError(path, str(exc)) from exc

    # ------------------------------------------------------------ progress

    def steps(self, split: str = "train") -> list[int]:
        """Every step with a folder (any stage started), ascending."""
        folder = self.split_dir(split)
        if not folder.is_dir():
            return []
        found = (parse_step_dirname(p.name) for p in folder.iterdir() if p.is_dir())
        return sorted(s for s in found if s is not None)

    def step_finished(self, step: int) -> bool:
        """The one meaning of a finished training step: its last file, ``metrics.json``,
        is written. ``completed_steps``, ``next_step``, the flow's resume, checkpoint
        retention and ``rollflow runs`` all ask this."""
        return (self.step_dir(step) / METRICS_JSON).exists()

    def completed_steps(self) -> list[int]:
        """The finished training steps (``step_finished``), ascending."""
        return [s for s in self.steps("train") if self.step_finished(s)]

    def next_step(self) -> int:
        """The first training step not finished: where a resume continues."""
        step = 0
        while self.step_finished(step):
            step += 1
        return step

    # ------------------------------------------------------------ stage times

    def stage_seconds(self, step: int) -> dict[str, float]:
        """The wall seconds each timed stage of ``step`` took when it ran (none: ``{}``)."""
        path = self.step_dir(step) / STAGE_SECONDS_JSON
        if not path.exists():
            return {}
        data = self.read_json(path)
        if not isinstance(data, dict) or not all(isinstance(v, int | float) for v in data.values()):
            raise SchemaMismatchError(path, f"expected stage name -> seconds, got {data!r}")
        return {str(stage): float(seconds) for stage, seconds in data.items()}

    def record_stage_seconds(self, step: int, stage: str, seconds: float) -> Path:
        check_timed_stage(stage)
        return self.write_json_atomic(
            self.step_dir(step) / STAGE_SECONDS_JSON, {**self.stage_seconds(step), stage: seconds}
        )

    def first_incomplete_stage(self, step: int, split: str = "train") -> str | None:
        return next((s for s in STAGES[split] if not self.is_complete(step, s, split)), None)

    # ------------------------------------------------------------ crash leftovers

    def temporaries(self) -> list[Path]:
        """What a crash left half-written: hidden ``.NAME.tmp-*`` files and folders; not in
        ``rescores/`` or ``replays/``, whose own command may be writing them (it discards
        its leftovers under its lock, ``storage/derived.py``)."""
        found: list[Path] = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            if Path(dirpath) == self.root:
                dirnames[:] = [d for d in dirnames if d not in DERIVED_DIRS]
            for name in [*dirnames, *filenames]:
                if is_temporary(Path(name)):
                    found.append(Path(dirpath) / name)
            dirnames[:] = [d for d in dirnames if not is_temporary(Path(d))]
        return sorted(found)

    def discard_temporaries(self) -> list[Path]:
        """Remove every half-written temporary (call on resume, never while writing)."""
        return remove_temporaries(self.temporaries())


def check_timed_stage(stage: str) -> None:
    timed = TIMED_STAGES + OPTIONAL_TIMED_STAGES
    if stage not in timed:
        raise ValueError(f"a training step's stages are {list(timed)}, got {stage!r}")


def _check_table(table: pa.Table, stage: str, step: int, split: str) -> None:
    """A stage table holds ``stage`` records of exactly this step and split (SQL trusts it)."""
    raw = (table.schema.metadata or {}).get(KIND_KEY, b"").decode()
    if raw != stage:
        raise ValueError(f"a {stage} stage output must be a {stage} table, got {raw or 'no'} records")
    for column, expected in (("step", step), ("split", split)):
        if column not in table.schema.names:
            continue
        found = set(pc.unique(table[column]).to_pylist())
        if found - {expected}:
            raise ValueError(
                f"{stage} rows for {column} {sorted(found, key=str)} cannot go in the "
                f"{split} step={step} folder"
            )
