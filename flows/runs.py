"""Starting and resuming a run folder: the one place a flow learns which run it drives.

A new run freezes its config as ``config.toml`` in a fresh folder; resuming reads that
frozen copy back, so a resumed run can never silently train with other settings. Either
way, whatever a killed process left half-written is discarded before any stage runs.

Giving a config again for an existing folder is allowed when it means the same run: the
two are compared as parsed configs, not as text, so a setting that rollflow added since
the folder was made (frozen copies lack it; it takes its default) is no mismatch.

**One process at a time per run folder.** ``open_run`` takes the folder's lock
(``rollflow.storage.runlock``) before it discards anything or freezes a config, and holds it
until the handle is closed (``train_flow`` closes it as it returns) or the process ends.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rollflow.config.checks import check_run_config
from rollflow.config.parsing import ConfigError
from rollflow.config.run import RunConfig, config_to_toml, flatten_config, load_config
from rollflow.storage.errors import ConfigMismatchError
from rollflow.storage.runfolder import METRICS_JSON, RunFolder
from rollflow.storage.runlock import acquire_run_folder, release_run_folder
from rollflow.storage.runs import KIND_FILE, run_kind



class RunSetupError(ValueError):
    """The run cannot start: no config, no such run folder, an unsupported setting."""


@dataclass(frozen=True)
class RunHandle:
    config: RunConfig
    folder: RunFolder

    @property
    def root(self) -> Path:
        return self.folder.root

    def next_step(self) -> int:
        """The first step not finished (``RunFolder.next_step``), ``num_steps`` when every step is."""
        return min(self.folder.next_step(), self.config.train.num_steps)

    def nothing_left(self) -> bool:
        """Every step trained and the last validation (where one is due) written."""
        last = self.config.train.num_steps
        if self.next_step() < last:
            return False
        validated = (self.folder.step_dir(last, "validation") / METRICS_JSON).exists()
        return validated or not validation_due(self.config, last)

    def report(self, message: str) -> None:
        print(f"[{self.folder.run_id}] {message}", file=sys.stderr, flush=True)

    def close(self) -> None:
        """Let go of the run folder's lock (taken by ``open_run``)."""
        release_run_folder(self.root)


def new_run_dir(config: RunConfig, config_path: Path) -> Path:
    """``<runs_dir>/<config name>-<time>``, suffixed when that folder is already taken."""
    base = Path(config.storage.runs_dir) / f"{config_path.stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    candidate, n = base, 1
    while candidate.exists():
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


def open_run(config_path: str | Path | None, run_dir: str | Path | None) -> RunHandle:
    """Create the run (``config_path``) or reopen it (``run_dir`` alone); see train_flow."""
    if config_path is None and run_dir is None:
        raise RunSetupError("give a config file to start a run, or a run folder to resume one")
    if config_path is not None:
        config = load_config(config_path)
        root = Path(run_dir) if run_dir is not None else new_run_dir(config, Path(config_path))
        folder = RunFolder(root)
        refuse_other_kinds(root)
        acquire_run_folder(root)
    else:
        folder = RunFolder(Path(str(run_dir)))
        if not folder.config_path.exists():
            raise RunSetupError(f"{folder.root}: not a run folder (no config.toml to resume from)")
        refuse_other_kinds(folder.root)
        acquire_run_folder(folder.root)
    try:
        if config_path is not None:
            freeze_config(folder, config)
        else:
            config = load_config(folder.config_path, frozen=True)
        check_run_config(config)
    except BaseException:
        release_run_folder(folder.root)
        raise
    handle = RunHandle(config=config, folder=folder)
    discarded = folder.discard_temporaries()
    if discarded:
        handle.report(f"discarded {len(discarded)} half-written file(s) from an interrupted run")
    return handle


_KIND_NAMES = {"eval": "an evaluation", "sft": "an SFT run", "pipeline": "a pipeline"}


def refuse_other_kinds(root: Path) -> None:
    """A ``RunSetupError`` where ``root`` was made by another command (``run_kind``: an
    evaluation, SFT, a pipeline): training there would mix GRPO steps into its tables."""
    kind = run_kind(root) if root.is_dir() else "train"
    if kind != "train":
        raise RunSetupError(
            f"{root} is {_KIND_NAMES[kind]}, not a training run (`rollflow resume` and `rollflow train` "
            f"continue training runs only); to run it again: {rerun_command(root)}"
        )


def rerun_command(root: Path) -> str:
    """The command that runs the folder's work again, by what made it (``run_kind``); a
    folder inside a pipeline's is rerun by the pipeline (it registers the result)."""
    parent = root.parent
    if (parent / KIND_FILE).is_file() and run_kind(parent) == "pipeline":
        return f"`rollflow pipeline --run-dir {parent}`"
    kind = run_kind(root)
    if kind == "train":
        return f"`rollflow resume {root}`"
    if kind == "pipeline":
        return f"`rollflow pipeline --run-dir {root}`"
    return f"the same `rollflow {kind}` with `--run-dir {root}`"


def freeze_config(folder: RunFolder, config: RunConfig) -> None:
    """Write ``config.toml``, or check that the one already frozen there means ``config``.

    Raises ``ConfigMismatchError`` naming the settings that differ.
    """
    if not folder.config_path.exists():
        folder.write_config(config_to_toml(config))
        return
    try:
        frozen = load_config(folder.config_path, frozen=True)
    except ConfigError as exc:
        raise ConfigMismatchError(
            f"{folder.config_path}: the run's frozen config does not read with this rollflow "
            f"({exc}); start a new run folder"
        ) from None
    if frozen == config:
        return
    given, kept = flatten_config(config), flatten_config(frozen)
    changed = sorted(k for k in given.keys() | kept.keys() if given.get(k) != kept.get(k))
    shown = ", ".join(f"{k} ({kept.get(k, '-')} frozen, {given.get(k, '-')} given)" for k in changed[:5])
    more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
    raise ConfigMismatchError(
        f"{folder.config_path}: the run's config is frozen and differs from the one given in "
        f"{shown}{more}; start a new run folder to change it"
    )


def validation_due(config: RunConfig, step: int) -> bool:
    """Whether a validation pass runs before ``step`` (``num_steps``: after the last one)."""
    interval = config.validation.validation_interval
    return interval > 0 and (step % interval == 0 or step == config.train.num_steps)
