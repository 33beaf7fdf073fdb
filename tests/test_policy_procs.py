"""The run's watchdog (``rollflow.policy.procs``): no process outlives its run.

Each test starts a real "run" process (a few lines of Python) that starts a child in a
session of its own, as the managed vLLM server is started, then SIGKILLs the run: with the
watchdog the child is gone within seconds, without it the child is orphaned (the control
that shows the set-up really leaves one behind). The slow kill matrix on real runs is
tests/kill_matrix.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollflow.policy.procs import (
    FAULT_POINT_ENV,
    POLL_S,
    TERM_GRACE_S,
    Proc,
    fault_point,
    is_alive,
    processes_to_end,
    read_proc,
)

# The vLLM engine process has been seen to ignore SIGTERM: so does this server, and once
# its parent (the run) is dead it starts one more process in its group, which no poll of
# the run's tree can have seen; that process writes its pid to the file named.
_STUBBORN_SERVER = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
parent = os.getppid()
while os.getppid() == parent:
    time.sleep(0.01)
late = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(60)"
subprocess.Popen([sys.executable, "-c", late, sys.argv[1]])
time.sleep(60)
"""

_RUN = """
import subprocess, sys, time
from rollflow.policy.procs import parent_death_signal, start_watchdog
mode, stubborn, late_pid_file, run_s = sys.argv[1:5]
watchdog = start_watchdog() if mode == "watchdog" else None
tie = parent_death_signal() if mode == "pdeathsig" else None
server = subprocess.Popen([sys.executable, "-c", stubborn, late_pid_file], start_new_session=True, preexec_fn=tie)
print(server.pid, watchdog.pid if watchdog else 0, flush=True)
time.sleep(float(run_s))
"""


class Run:
    """A run process with a server child (and a watchdog, by ``mode``), all three up."""

    def __init__(self, mode: str, tmp_path: Path, run_s: float = 60.0) -> None:
        self.late_pid_file = tmp_path / "late.pid"
        self.process = subprocess.Popen(
            [sys.executable, "-c", _RUN, mode, _STUBBORN_SERVER, str(self.late_pid_file), str(run_s)],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.process.stdout is not None
        server_pid, watchdog_pid = (int(v) for v in self.process.stdout.readline().split())
        server = read_proc(server_pid)
        assert server is not None and server.ppid == self.process.pid
        self.server = server
        self.watchdog = read_proc(watchdog_pid) if watchdog_pid else None
        time.sleep(6 * POLL_S)  # the watchdog has recorded the tree (its start can take a second on a busy machine)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def late_child(self) -> Proc | None:
        deadline = time.monotonic() + 10
        while not self.late_pid_file.exists() or not self.late_pid_file.read_text():
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)
        pid = int(self.late_pid_file.read_text())
        return read_proc(pid) or Proc(pid, ppid=0, pgid=0, state="X", start=0)


def _gone_within(proc: Proc, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while is_alive(proc):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        proc = read_proc(int(entry.name)) if entry.name.isdigit() else None
        if proc is not None and proc.pgid == pgid and proc.state != "Z":
            members.append(proc.pid)
    return members


@pytest.fixture
def cleanup() -> Iterator[list[int]]:
    """Process groups to SIGKILL after the test, whatever it found."""
    groups: list[int] = []
    yield groups
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.slow  # 6 s in a loaded suite run (docs/testing.md)
def test_without_a_watchdog_a_killed_run_orphans_its_server(tmp_path: Path, cleanup: list[int]) -> None:
    run = Run("none", tmp_path)
    cleanup.append(run.server.pgid)
    run.kill()
    late = run.late_child()
    time.sleep(TERM_GRACE_S + 1)
    assert is_alive(run.server), "the control: a child in its own session outlives a SIGKILLed parent"
    assert late is not None and is_alive(late)


@pytest.mark.slow  # 5 s in a loaded suite run (docs/testing.md)
def test_the_watchdog_ends_what_a_killed_run_left_even_a_server_that_ignores_sigterm(
    tmp_path: Path, cleanup: list[int]
) -> None:
    bystander = subprocess.Popen(["sleep", "30"])  # in this test's process group, as is the run
    try:
        _assert_the_watchdog_ends_the_run(tmp_path, cleanup)
        assert bystander.poll() is None, "the watchdog signalled a process that was not the run's"
    finally:
        bystander.kill()


def _assert_the_watchdog_ends_the_run(tmp_path: Path, cleanup: list[int]) -> None:
    run = Run("watchdog", tmp_path)
    cleanup.append(run.server.pgid)
    assert run.watchdog is not None and is_alive(run.watchdog)
    run.kill()
    late = run.late_child()
    assert late is not None, "the server should have started its late child when the run died"
    assert _gone_within(run.server, TERM_GRACE_S + 3), "the watchdog left the run's server running"
    assert _gone_within(late, 3), "the process the server started after the run died was left"
    assert _group_members(run.server.pgid) == [], "a member of the server's process group was left"
    assert _gone_within(run.watchdog, 3), "the watchdog did not exit after its work"


@pytest.mark.slow  # 4 s in a loaded suite run (docs/testing.md)
def test_a_run_that_exits_normally_takes_its_watchdog_and_leftovers_with_it(
    tmp_path: Path, cleanup: list[int]
) -> None:
    # the run lives long enough for the watchdog (started, then polling every POLL_S) to have
    # recorded the server on a busy machine: a child orphaned before its first poll is missed
    # (the limit policy/procs.py states)
    run = Run("watchdog", tmp_path, run_s=6 * POLL_S)
    cleanup.append(run.server.pgid)
    assert run.process.wait(timeout=10) == 0
    assert run.watchdog is not None
    assert _gone_within(run.server, TERM_GRACE_S + 3), "a child left running by a normal exit outlived the run"
    assert _gone_within(run.watchdog, 3), "the watchdog outlived its run"


def test_the_parent_death_signal_ends_a_child_started_from_the_main_thread(
    tmp_path: Path, cleanup: list[int]
) -> None:
    run = Run("pdeathsig", tmp_path)
    cleanup.append(run.server.pgid)
    run.kill()
    assert _gone_within(run.server, 2.0), "PR_SET_PDEATHSIG did not reach the child"


def test_a_reused_pid_is_not_the_recorded_process() -> None:
    recorded = Proc(pid=4242, ppid=1, pgid=4242, state="S", start=100)
    reused = Proc(pid=4242, ppid=7, pgid=4242, state="S", start=999)
    member = Proc(pid=4243, ppid=4242, pgid=4242, state="S", start=1000)
    assert processes_to_end({recorded.key: recorded}, {4242: reused, 4243: member}) == {}
    alive = Proc(pid=4242, ppid=1, pgid=4242, state="S", start=100)
    engine = Proc(pid=4300, ppid=1, pgid=4242, state="S", start=150)  # orphaned, in the recorded group
    stranger = Proc(pid=4400, ppid=1, pgid=4400, state="S", start=150)
    ended = processes_to_end({recorded.key: recorded}, {4242: alive, 4300: engine, 4400: stranger})
    assert set(ended) == {4242, 4300}


def test_a_fault_point_stops_the_process_only_when_named() -> None:
    code = "from rollflow.policy.procs import fault_point; fault_point('weight_publish'); print('passed')"
    passed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                            env={**os.environ, FAULT_POINT_ENV: "checkpoint_write"})  # fmt: skip
    assert passed.stdout.strip() == "passed"
    stopped = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, FAULT_POINT_ENV: "weight_publish"})
    try:
        deadline = time.monotonic() + 30
        while (proc := read_proc(stopped.pid)) is not None and proc.state != "T":
            assert time.monotonic() < deadline and stopped.poll() is None, "it never stopped"
            time.sleep(0.05)
    finally:
        stopped.kill()
        stopped.wait()
    with pytest.raises(AssertionError, match="unknown fault point"):
        fault_point("nowhere")


@pytest.mark.slow  # 4 s in a loaded suite run (docs/testing.md)
def test_the_commands_that_start_work_start_a_watchdog_and_the_others_do_not() -> None:
    code = (
        "import sys\nfrom rollflow.flows.cli import main\nfrom rollflow.policy import procs\n"
        "main(sys.argv[1:])\nprint(len(procs._WATCHDOG))"
    )
    for argv, expected in ((["eval", "--tasks", "0"], "1"), (["runs", "--runs-dir", "/nonexistent"], "0")):
        out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
        assert out.stdout.strip().splitlines()[-1] == expected, (argv, out.stdout, out.stderr[-2000:])


def test_every_heavy_flow_s_process_starts_a_watchdog_whatever_started_it() -> None:
    """A deployment's worker runs the flows without the CLI: they start it themselves."""
    code = (
        "from rollflow.flows.concurrency import one_training_at_a_time\nfrom rollflow.policy import procs\n"
        "with one_training_at_a_time('a flow'):\n    print(len(procs._WATCHDOG))"
    )
    env = {key: value for key, value in os.environ.items() if key != "PREFECT_API_URL"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.stdout.strip() == "1", out.stderr[-2000:]
