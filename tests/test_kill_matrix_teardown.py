"""A run the kill matrix stopped is ended when its test fails or pytest is interrupted.

The kill matrix (``tests/kill_matrix.py``) stops runs with SIGSTOP, itself or at a fault
point; a stopped run is never ended by its watchdog, which waits for it to die. So a test
that failed, or a pytest interrupted by Ctrl-C, while a run was stopped used to leave the run
and its servers stopped for good. Here an inner pytest, with the suite's own conftest, starts
a "run" (a process with a child that stops itself, as a run does at a fault point) through
``RunProcess``, then fails, or is sent SIGINT as a terminal's Ctrl-C sends it; both processes
must be gone when the inner pytest exits, and so must the session folder the suite's
conftest made for Prefect and MLflow (before, every pytest process left one in /tmp).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollflow.policy.procs import is_alive, read_proc

TESTS = Path(__file__).parent

INNER = '''
import os
import sys
import time
from pathlib import Path

from kill_matrix import RunProcess

# a run's stand-in: a child (its server), written down, then a SIGSTOP of itself (a fault point)
RUN = ("import os, signal, subprocess, sys, time; "
       "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
       "open(sys.argv[1] + '.tmp', 'w').write(f'{os.getpid()} {child.pid}'); "
       "os.rename(sys.argv[1] + '.tmp', sys.argv[1]); "
       "os.kill(os.getpid(), signal.SIGSTOP)")


def test_a_run_stopped_then_the_test_ends(tmp_path: Path) -> None:
    pids = Path(os.environ["RUN_PIDS"])
    run = RunProcess([str(pids)], tmp_path / "run.log", command=[sys.executable, "-c", RUN])
    run.wait_until(lambda: pids.exists() and run.stopped_itself(), "the run stopping itself", timeout_s=60)
    run.look()
    Path(os.environ["RUN_STOPPED"]).touch()
    go = Path(os.environ["RUN_GO"])  # the outer test has taken the run's processes down
    for _ in range(600):
        if go.exists():
            break
        time.sleep(0.1)
    if os.environ["ENDING"] == "fails":
        assert False, "the test fails while its run is stopped"
    time.sleep(120)  # until the outer test interrupts this pytest
'''


def _alive(pid: int, start: int) -> bool:
    proc = read_proc(pid)
    return proc is not None and is_alive(proc) and proc.start == start


@pytest.mark.slow  # an inner pytest importing the kill matrix, ~5 s
@pytest.mark.parametrize("ending", ["fails", "interrupted"])
def test_a_stopped_run_and_its_children_are_killed_when_the_test_ends(ending: str, tmp_path: Path) -> None:
    (tmp_path / "test_inner.py").write_text(INNER)
    pids, stopped, go = tmp_path / "pids", tmp_path / "stopped", tmp_path / "go"
    inner_tmp = tmp_path / "tmp"  # the inner pytest's TMPDIR, where its conftest makes its session folder
    inner_tmp.mkdir()
    env = {**os.environ, "RUN_PIDS": str(pids), "RUN_STOPPED": str(stopped), "RUN_GO": str(go), "ENDING": ending,
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]), "TMPDIR": str(inner_tmp)}
    env.pop("ROLLFLOW_TEST_CPU_LOG", None)  # the inner tests' CPU is this test's (its child's), not lines of their own
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-p", "conftest",
               "--rootdir", str(tmp_path), "--basetemp", str(tmp_path / "inner"), str(tmp_path / "test_inner.py")]
    inner = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
    procs: list[tuple[int, int]] = []
    try:
        deadline = time.monotonic() + 120
        while not stopped.exists() and inner.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert stopped.exists(), f"the inner test never stopped its run:\n{inner.communicate(timeout=60)[0]}"
        for pid in map(int, pids.read_text().split()):
            proc = read_proc(pid)
            assert proc is not None, f"process {pid} of the run is gone already"
            procs.append((pid, proc.start))
        assert read_proc(procs[0][0]).state == "T"  # type: ignore[union-attr]  # the run, stopped
        go.touch()
        if ending == "interrupted":
            time.sleep(1.0)  # in its sleep
            os.kill(inner.pid, signal.SIGINT)  # Ctrl-C (the run has its own session: pytest's alone)
        output = inner.communicate(timeout=120)[0]
        assert inner.returncode == (1 if ending == "fails" else 2), output
        left = [pid for pid, start in procs if _alive(pid, start)]
        assert not left, f"the run's processes {left} outlived the inner pytest ({ending}):\n{output}"
        assert not list(inner_tmp.iterdir()), f"the inner pytest left its session folder ({ending}):\n{output}"
    finally:
        for pid, start in procs:
            if _alive(pid, start):
                os.kill(pid, signal.SIGKILL)
        if inner.poll() is None:
            os.killpg(inner.pid, signal.SIGKILL)
            inner.wait(timeout=30)
