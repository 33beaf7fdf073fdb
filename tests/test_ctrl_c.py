"""Ctrl-C on a real `rollflow train`, sent as a terminal sends it: SIGINT to the run's whole
process group, mid-run, on the tiny model (tests/tiny_run.py).

It must stop the run as ``kill`` (SIGTERM) does: exit status 130, one line on how to resume,
no traceback, and nothing the run started left running (its Prefect server included, which
used to get the SIGINT too and die under the engine, leaving it to retry for minutes). The
time from the signal to the exit is printed, not asserted (`pytest -s` shows it).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from kill_matrix import PREFECT_SERVER, RunProcess, _cmdline


def _prefect_servers(run: RunProcess) -> list[int]:
    return [p.pid for p in run.look().values() if PREFECT_SERVER in _cmdline(p.pid)]


@pytest.mark.slow
def test_ctrl_c_stops_the_run_with_status_130_one_resume_line_and_nothing_left(
    tiny_config_path: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "interrupted"
    log = tmp_path / "stderr.txt"
    run = RunProcess(["train", str(tiny_config_path), "--run-dir", str(run_dir)], log)
    try:
        # Mid-run: step 0 is trained and step 1's rollout is under way, Prefect's server up.
        run.wait_until(lambda: (run_dir / "checkpoints" / "step=000000").exists(), "step 0's checkpoint")
        run.wait_until(lambda: bool(_prefect_servers(run)), "Prefect's temporary server in the run's tree")
        signalled = time.monotonic()
        os.killpg(run.child.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        status = run.finish()  # also: nothing the run was seen with outlives it
        took = time.monotonic() - signalled
    finally:
        if run.child.poll() is None:
            os.killpg(run.child.pid, signal.SIGKILL)
            run.child.wait(timeout=60)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\nrollflow train exited {took:.1f} s after Ctrl-C, status {status} (load average {load})")
    text = log.read_text()
    assert status == 130, text[-3000:]
    resume_lines = [line for line in text.splitlines() if "rollflow resume" in line]
    assert len(resume_lines) == 1, text[-3000:]
    assert resume_lines[0].endswith(f"continue with `rollflow resume {run_dir}`"), text[-3000:]
    assert "Traceback" not in text, text[-3000:]


def test_the_own_session_server_runs_prefects_own_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """flows/prefect_server.py repeats Prefect's server command: it must still be Prefect's."""
    import subprocess

    from prefect.server.api.server import SubprocessASGIServer

    from rollflow.flows.prefect_server import own_session_server_class

    OwnSessionServer = own_session_server_class()
    calls: list[dict] = []
    monkeypatch.setattr(subprocess, "Popen", lambda **kwargs: calls.append(kwargs))
    for cls, port in ((SubprocessASGIServer, 1), (OwnSessionServer, 2)):
        server = cls(port)
        try:
            server.port = 8999
            server._run_uvicorn_command()
        finally:
            del SubprocessASGIServer._instances[port]
    prefects, ours = calls
    assert ours.pop("start_new_session") is True
    ours.pop("preexec_fn")
    assert ours == prefects


def test_the_own_session_server_is_prefects_default_and_leaves_a_harness_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect.server.api.server import SubprocessASGIServer

    from rollflow.flows.prefect_server import own_session_server_class, serve_prefect_in_own_session

    from prefect.settings import PREFECT_API_URL, temporary_settings

    monkeypatch.setattr(SubprocessASGIServer, "_instances", {})
    # as `rollflow train` runs: no server configured (the suite's session harness sets one)
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        server = serve_prefect_in_own_session()
        assert isinstance(server, own_session_server_class()) and not server.running
        assert SubprocessASGIServer() is server  # what Prefect's client, events and logs ask for
        assert serve_prefect_in_own_session() is None  # one there already
    monkeypatch.setattr(SubprocessASGIServer, "_instances", {})
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:4200/api"}):
        assert serve_prefect_in_own_session() is None  # a server of the user's, or the test harness
    assert not SubprocessASGIServer._instances


def test_a_run_on_a_configured_server_never_imports_prefects_server() -> None:
    """1.7 CPU-seconds a run on a nightly pipeline's server (or the suite's) does not need."""
    import subprocess
    import sys

    probe = ("import sys\n"
             "from rollflow.flows.prefect_server import serve_prefect_in_own_session\n"
             "from rollflow.flows.train import train_flow\n"
             "assert serve_prefect_in_own_session() is None\n"
             "print(sorted(m for m in sys.modules if m.startswith('prefect.server')))")  # fmt: skip
    env = {**os.environ, "PREFECT_API_URL": "http://127.0.0.1:4200/api"}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout


def test_a_stage_error_after_ctrl_c_is_the_stop_not_a_failed_stage(tmp_path: Path) -> None:
    """Ctrl-C during a stage's DuckDB query (the metrics stage, found in a suite run: status 1
    and a traceback): DuckDB checks for signals itself, eats the handler's SystemExit and
    raises ``RuntimeError: Query interrupted``. After a stop request a stage's error is the
    stop (``stops_through``); before one it is the stage's own."""
    from rollflow.config.run import RunConfig
    from rollflow.flows.step import metrics
    from rollflow.policy.stopping import clear_stop, request_stop
    from rollflow.storage.runfolder import RunFolder

    folder = RunFolder(tmp_path / "not-a-run")
    p = folder.step_paths(0)
    with pytest.raises(Exception) as failed:  # noqa: PT011 - whatever the stage's own error is
        metrics.fn(RunConfig(), folder, p, out=p.metrics_json)
    request_stop(signal.SIGINT)
    try:
        with pytest.raises(SystemExit) as stopped:  # what the handler raised and DuckDB ate
            metrics.fn(RunConfig(), folder, p, out=p.metrics_json)
        assert stopped.value.code == 130
        assert type(stopped.value.__cause__) is type(failed.value)
    finally:
        clear_stop()
