"""``rollflow runs`` tells a run that is going from one that was stopped, failed or died
(storage/runs.py's status, the exit record ops/run_summary.py writes, the run lock)."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_storage_runfolder import _episodes, _finish_step

from rollflow.flows.cli import main
from rollflow.ops.run_summary import record_run_end
from rollflow.policy.stopping import clear_stop, request_stop
from rollflow.storage.runfolder import RunFolder
from rollflow.storage.runs import list_runs
from rollflow.storage.schemas import episode_records_to_table

HOLD_LOCK = """
import sys, time
from pathlib import Path
from rollflow.storage.runlock import acquire_run_folder
acquire_run_folder(Path(sys.argv[1]))
print("holding", flush=True)
time.sleep(600)
"""


def _stopped_in_step_1(root: Path) -> Path:
    """A 3-step run with step 0 finished and step 1's episodes written."""
    folder = RunFolder(root)
    folder.write_config("[train]\nnum_steps = 3\n")
    _finish_step(folder, 0)
    folder.write_stage(episode_records_to_table(_episodes(1)), 1, "episodes")
    return root


@pytest.fixture
def holder() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes that hold run locks (killed after the test)."""
    held: list[subprocess.Popen[str]] = []
    yield held
    for process in held:
        process.kill()
        process.wait()


def test_runs_tells_running_interrupted_failed_and_crashed_runs_apart(
    tmp_path: Path, holder: list[subprocess.Popen[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    """Newcomer F9: before, all four read "in progress or failed at step 1 of 3, stage
    scores", and the notes column was empty though the failure's reason was known."""
    runs = tmp_path / "runs"
    roots = {name: _stopped_in_step_1(runs / name) for name in ("crashed", "failed", "interrupted", "running")}
    record_run_end(roots["failed"], RuntimeError("the environment raised KeyError: 'board'\nTraceback ..."))
    request_stop(signal.SIGTERM)
    try:
        record_run_end(roots["interrupted"], SystemExit(143))  # what the signal handler raises
    finally:
        clear_stop()
    going = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(roots["running"])], stdout=subprocess.PIPE, text=True)
    holder.append(going)
    assert going.stdout is not None and going.stdout.readline().strip() == "holding"

    where = "step 1 of 3, stage scores"
    listed = {s.run_id: (s.describe(), s.end_note) for s in list_runs(runs)}
    assert listed == {
        "crashed": (f"stopped unexpectedly at {where}", "it recorded no exit: killed (SIGKILL), out of memory, or the machine stopped"),
        "failed": (f"failed at {where}", "RuntimeError: the environment raised KeyError: 'board'"),
        "interrupted": (f"interrupted at {where}", "stopped by SIGTERM; `rollflow resume` continues it"),
        "running": (f"running: {where}", None),
    }  # fmt: skip
    assert main(["runs", "--runs-dir", str(runs)]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[2:-1]}
    assert rows["failed"].rstrip().endswith("RuntimeError: the environment raised KeyError: 'board'")
    assert "running: step 1 of 3" in rows["running"]
