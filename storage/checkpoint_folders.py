"""A run's checkpoint folders: where each step's version goes, committed whole, found again.

``runs/<run_id>/checkpoints/step=000003/`` is the version step 3's training made. It is
saved into a hidden temporary folder (``new_checkpoint_tmp``), every file fsynced, then
renamed into place (``commit_checkpoint``), so a folder that exists is complete and a crash
leaves only a temporary (``RunFolder.discard_temporaries`` removes it). ``starting_checkpoint``
is what a step samples with and trains from. ``RunFolder`` (``storage/runfolder.py``) has these methods.
"""

from __future__ import annotations

import os
from pathlib import Path

from rollflow.storage.errors import StageExistsError, StorageError
from rollflow.storage.filemodes import give_ordinary_modes
from rollflow.storage.parquet import fsync_dir, temporary_path
from rollflow.storage.step_names import parse_step_dirname, step_dirname


class CheckpointFolders:
    """The checkpoint folders under ``root/checkpoints``."""

    root: Path

    def checkpoint_dir(self, step: int) -> Path:
        return self.root / "checkpoints" / step_dirname(step)

    def new_checkpoint_tmp(self, step: int) -> Path:
        """An empty hidden folder to save checkpoint ``step`` into before committing it."""
        tmp = temporary_path(self.checkpoint_dir(step))
        tmp.mkdir(parents=True)
        return tmp

    def commit_checkpoint(self, tmp_dir: Path, step: int) -> Path:
        """fsync every file of ``tmp_dir`` and rename it to ``checkpoint_dir(step)``."""
        final = self.checkpoint_dir(step)
        if final.exists():
            raise StageExistsError(f"{final}: checkpoint {step} is already committed")
        if not Path(tmp_dir).is_dir():
            raise StorageError(f"{tmp_dir}: not a folder; nothing to commit")
        final.parent.mkdir(parents=True, exist_ok=True)
        give_ordinary_modes(Path(tmp_dir))  # safetensors writes 0600
        _fsync_tree(Path(tmp_dir))
        os.rename(tmp_dir, final)
        fsync_dir(final.parent)
        return final

    def checkpoints(self) -> list[tuple[int, Path]]:
        folder = self.root / "checkpoints"
        if not folder.is_dir():
            return []
        found = ((parse_step_dirname(p.name), p) for p in folder.iterdir() if p.is_dir())
        return sorted((s, p) for s, p in found if s is not None)

    def latest_checkpoint(self) -> tuple[int, Path] | None:
        found = self.checkpoints()
        return found[-1] if found else None

    def checkpoint_before(self, step: int) -> Path | None:
        """The newest committed checkpoint of a step before ``step``: what step ``step``
        trains on from (None: the run's start)."""
        found = [path for s, path in self.checkpoints() if s < step]
        return found[-1] if found else None

    def starting_checkpoint(self, step: int) -> Path | None:
        """The checkpoint training step ``step`` samples with and trains from: step - 1's
        (None at step 0: the run's start). A ``StorageError`` naming the newest one found
        when step - 1's is missing, since acting or training on an older version would
        pass silently for the step's own. Once the step's own checkpoint is committed its
        rollout and training are done, nothing starts from step - 1's any more, and
        retention may have pruned it: then the newest before it, unchecked."""
        previous = self.checkpoint_before(step)
        if step > 0 and previous != self.checkpoint_dir(step - 1) and not self.checkpoint_dir(step).is_dir():
            found = "none" if previous is None else previous.name
            raise StorageError(
                f"{self.root}: step {step} starts from the checkpoint of step {step - 1} "
                f"({self.checkpoint_dir(step - 1)}), but the newest one before it is {found}"
            )
        return previous


def _fsync_tree(folder: Path) -> None:
    for dirpath, _, filenames in os.walk(folder):
        for name in filenames:
            fd = os.open(Path(dirpath) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))
