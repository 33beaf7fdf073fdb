"""Where each run under a ``runs/`` folder stands: finished, or stopped at which stage.

Read from the files, and from the run's lock (``storage/runlock.py``): a training run whose
folder a process holds is ``running``. One that is not says how its last process ended, as
that process recorded it on its way out (``RUN_END_FILE``, written by
``ops.run_summary.record_run_end`` from the handler of whatever ended ``rollflow
train``/``resume``): ``interrupted`` (SIGTERM, Ctrl-C) or ``failed`` with the error's first
line in the notes; a run that recorded nothing died without a word (SIGKILL, out of memory,
the machine stopped): ``stopped unexpectedly``. The record is removed when a process starts
training the run again. The planned step count is ``[train] num_steps`` of the run's frozen
``config.toml`` when it has one.

Evaluation (``rollflow eval``) and SFT (``rollflow sft``) folders are runs too, of another
kind: the flows that make them write ``run_kind`` (``eval``, ``sft`` or ``pipeline``) at the top. An
evaluation is complete when its one validation pass has ``metrics.json``; an SFT run when
its policy has ``sft.json``; a pipeline when it has ``pipeline.json``. A folder with no marker is a training run, or an SFT run
when it holds ``sft/`` (folders written before the marker existed).

Simplified: a run is complete when it has that many finished training steps (finished:
``RunFolder.step_finished``, the step's ``metrics.json``, as the flow that resumes it
counts); a validation pass that was still pending does not count against it.
"""

from __future__ import annotations

import json
import os
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rollflow.storage.parquet import write_bytes_atomic
from rollflow.storage.runfolder import SPLIT_DIRS, STAGES, RunFolder
from rollflow.storage.runlock import run_folder_in_use

KIND_FILE = "run_kind"
RUN_KINDS = ("train", "eval", "sft", "pipeline")
SFT_RESULT = Path("sft/policy/sft.json")  # tasks.sft.RESULT_FILE in the SFT flow's policy
PIPELINE_RESULT = "pipeline.json"  # flows.pipeline.PIPELINE_FILE: written last
METRICS_STAGE = "metrics"  # where a step stopped with every stage done but metrics.json
RUN_END_FILE = "run_end.json"  # how the last process that trained the run ended, when it could say
NO_EXIT_NOTE = "it recorded no exit: killed (SIGKILL), out of memory, or the machine stopped"


@dataclass(frozen=True)
class RunEnd:
    """How a process that trained the run ended: ``stopped`` by a signal or ``failed``, and
    why, in one line."""

    how: Literal["stopped", "failed"]
    reason: str


def write_run_end(root: Path | str, end: RunEnd) -> None:
    write_bytes_atomic(json.dumps({"how": end.how, "reason": end.reason}).encode(), Path(root) / RUN_END_FILE)


def read_run_end(root: Path | str) -> RunEnd | None:
    """The recorded end, None where there is none (or it is unreadable: said as none)."""
    try:
        record = json.loads((Path(root) / RUN_END_FILE).read_text())
        how, reason = record["how"], str(record["reason"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return RunEnd(how, reason) if how in ("stopped", "failed") else None


def clear_run_end(root: Path | str) -> None:
    """Forget how an earlier process ended: a new one is training the run."""
    (Path(root) / RUN_END_FILE).unlink(missing_ok=True)


@dataclass(frozen=True)
class RunStatus:
    run_id: str
    path: Path
    num_steps: int | None  # planned, from config.toml; None when it does not say
    finished_steps: int
    last_finished_step: int | None
    next_step: int
    stopped_stage: str  # the first stage of next_step not complete ("metrics": only metrics.json)
    latest_checkpoint: int | None
    temporaries: int  # half-written leftovers a resume would discard
    updated: float  # newest modification time in the folder, seconds since the epoch
    config_problem: str | None = None
    kind: str = "train"  # RUN_KINDS
    running: bool = False  # a process holds the folder's lock
    end: RunEnd | None = None  # how the last process that trained it ended, if it said

    @property
    def complete(self) -> bool:
        if self.kind == "sft":
            return (self.path / SFT_RESULT).exists()
        if self.kind == "pipeline":
            return (self.path / PIPELINE_RESULT).exists()
        if self.kind == "eval":  # its one validation pass, step 0, has written metrics.json
            return (RunFolder(self.path).step_dir(0, "validation") / "metrics.json").exists()
        return self.num_steps is not None and self.finished_steps >= self.num_steps

    def describe(self) -> str:
        if self.kind != "train":
            what = {"eval": "evaluation"}.get(self.kind, self.kind)
            state = "complete" if self.complete else "running" if self.running else "stopped or failed"
            return f"{what} {state}"
        if self.complete:
            return f"complete ({self.finished_steps} steps)" + ("; running its last validation" if self.running else "")
        planned = f" of {self.num_steps}" if self.num_steps is not None else ""
        where = f"step {self.next_step}{planned}, stage {self.stopped_stage}"
        if self.running:
            return f"running: {where}"
        if self.end is None:
            return f"stopped unexpectedly at {where}"
        return f"{'interrupted' if self.end.how == 'stopped' else 'failed'} at {where}"

    @property
    def end_note(self) -> str | None:
        """Why a training run that is neither running nor complete stopped, for the notes."""
        if self.kind != "train" or self.complete or self.running:
            return None
        return NO_EXIT_NOTE if self.end is None else self.end.reason


def _planned_steps(folder: RunFolder) -> tuple[int | None, str | None]:
    if not folder.config_path.exists():
        return None, "no config.toml"
    try:
        train = tomllib.loads(folder.config_path.read_text()).get("train", {})
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        return None, f"config.toml unreadable: {exc}"
    value = train.get("num_steps") if isinstance(train, dict) else None
    return (value, None) if isinstance(value, int) else (None, None)


def _newest_mtime(root: Path) -> float:
    newest = root.stat().st_mtime
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            try:
                newest = max(newest, (Path(dirpath) / name).stat().st_mtime)
            except FileNotFoundError:  # removed while we looked
                continue
    return newest


def mark_run_kind(root: Path | str, kind: str) -> None:
    """Say what made the run folder at ``root`` (a ``RUN_KINDS`` name), for ``run_status``."""
    if kind not in RUN_KINDS:
        raise ValueError(f"run kind must be one of {RUN_KINDS}, got {kind!r}")
    marker = Path(root) / KIND_FILE
    if not (marker.is_file() and marker.read_text().strip() == kind):  # a resume rewrites nothing
        write_bytes_atomic(kind.encode(), marker)


def run_kind(root: Path | str) -> str:
    root = Path(root)
    try:
        kind = (root / KIND_FILE).read_text().strip()
    except FileNotFoundError:
        return "sft" if (root / "sft").is_dir() else "train"
    return kind if kind in RUN_KINDS else "train"


def run_status(root: Path | str) -> RunStatus:
    folder = RunFolder(root)
    done = folder.completed_steps()
    next_step = folder.next_step()
    num_steps, problem = _planned_steps(folder)
    checkpoint = folder.latest_checkpoint()
    return RunStatus(
        run_id=folder.run_id,
        path=folder.root,
        num_steps=num_steps,
        finished_steps=len(done),
        last_finished_step=done[-1] if done else None,
        next_step=next_step,
        stopped_stage=folder.first_incomplete_stage(next_step) or METRICS_STAGE,
        latest_checkpoint=checkpoint[0] if checkpoint else None,
        temporaries=len(folder.temporaries()),
        updated=_newest_mtime(folder.root),
        config_problem=problem,
        kind=run_kind(folder.root),
        running=run_folder_in_use(folder.root),
        end=read_run_end(folder.root),
    )


def resume_summary(root: Path | str) -> str:
    """One line on what a training run folder holds and where a resume continues."""
    s = run_status(root)
    planned = f" of {s.num_steps}" if s.num_steps is not None else ""
    step = s.latest_checkpoint
    checkpoint = "no checkpoint" if step is None else f"the checkpoint of step {step}"
    found = f"found {s.finished_steps}{planned} steps trained, {checkpoint}"
    if s.complete:
        return f"{found}; only validation not yet written is left"
    stage = s.stopped_stage
    order = (*STAGES["train"], METRICS_STAGE)
    kept = order[: order.index(stage)]
    return f"{found}; continuing at step {s.next_step} from its {stage} stage" + (
        f" ({', '.join(kept)} kept)" if kept else "")


def looks_like_run(path: Path) -> bool:
    markers = ["config.toml", KIND_FILE, *SPLIT_DIRS.values(), "checkpoints"]
    return path.is_dir() and any((path / m).exists() for m in markers)


def list_runs(runs_dir: Path | str) -> list[RunStatus]:
    """The status of every run folder directly under ``runs_dir``, by run id."""
    runs_dir = Path(runs_dir)
    if not runs_dir.is_dir():
        return []
    return [run_status(p) for p in sorted(runs_dir.iterdir()) if looks_like_run(p)]


def age_text(updated: float, now: float | None = None) -> str:
    """``updated`` as a short age: ``42s ago``, ``5m ago``, ``3h ago``, ``2d ago``."""
    seconds = max(0.0, (time.time() if now is None else now) - updated)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit} ago"
    return f"{int(seconds)}s ago"
