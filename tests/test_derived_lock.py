"""A rescore or replay name is one process's while it writes (storage/derived.py): a second
command on it is refused before it reads or discards anything, a resume of the run leaves
its half-written files alone, and the lock goes when the command ends, failed or not.
Real processes, no stored run, no model."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollflow.storage.derived import DerivedBusyError, DerivedNameError, DerivedOutput
from rollflow.storage.runfolder import RunFolder
from rollflow.storage.runlock import LOCK_FILE

MANIFEST = {"run_id": "run", "env": "m:f", "kwargs": {}, "where": None}

# process A: opens the name, is half-way through writing a chunk, holds on
WRITER = f"""
import sys, time
from pathlib import Path
from rollflow.storage.derived import DerivedOutput
from rollflow.storage.parquet import temporary_path
from rollflow.storage.runfolder import RunFolder
with DerivedOutput.open(RunFolder(Path(sys.argv[1])), "rescores", "r1", {MANIFEST!r}) as output:
    chunk = output.chunk_path("train", 0)
    chunk.parent.mkdir(parents=True, exist_ok=True)
    half = temporary_path(chunk)
    half.write_bytes(b"half a parquet file")
    print(half, flush=True)
    time.sleep(600)
"""


def _start_writer(root: Path) -> tuple[subprocess.Popen[str], Path]:
    """Process A, and the temporary file it is writing."""
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(root)], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    line = child.stdout.readline().strip()  # "" if it died
    assert line, f"the writer died (exit {child.wait()})"
    return child, Path(line)


def _free(root: Path) -> bool:
    """No open file of this process or another holds the name's lock (flock: per open file)."""
    fd = os.open(root / LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


@pytest.fixture
def run(tmp_path: Path) -> RunFolder:
    folder = RunFolder(tmp_path / "run")
    folder.root.mkdir()
    return folder


def test_a_second_command_and_a_resume_leave_a_writing_rescore_alone(run: RunFolder) -> None:
    child, half = _start_writer(run.root)
    try:
        assert half.exists()

        with pytest.raises(DerivedBusyError, match=f"PID {child.pid}") as refused:
            with DerivedOutput.open(run, "rescores", "r1", MANIFEST):
                pass
        assert len(str(refused.value).splitlines()) == 1
        assert half.exists(), "the refused command discarded nothing"

        assert run.discard_temporaries() == [] and half.exists(), "a resume of the run leaves rescores/ alone"
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()

    with DerivedOutput.open(run, "rescores", "r1", MANIFEST) as output:  # the killed one, resumed
        assert not half.exists(), "its own opener discards what the killed command left"
        assert output.manifest() == MANIFEST


def test_the_name_is_released_however_the_command_ends(run: RunFolder) -> None:
    with DerivedOutput.open(run, "replays", "r2", MANIFEST) as output:
        assert not _free(output.root)
    assert _free(output.root)

    with pytest.raises(RuntimeError, match="a chunk failed"):
        with DerivedOutput.open(run, "replays", "r2", MANIFEST):
            raise RuntimeError("a chunk failed")
    assert _free(output.root)

    with pytest.raises(DerivedNameError, match="other settings"):
        with DerivedOutput.open(run, "replays", "r2", {**MANIFEST, "where": "step = 0"}):
            pass
    assert _free(output.root)
    assert json.loads((output.root / "manifest.json").read_text()) == MANIFEST
