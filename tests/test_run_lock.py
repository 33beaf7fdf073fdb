"""One process at a time per run folder (storage/runlock.py), with real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from tiny_run import kill_group

from rollflow.config.run import load_config
from rollflow.flows.runs import freeze_config, open_run
from rollflow.storage.runfolder import RunFolder
from rollflow.storage.runlock import RunFolderBusyError

HOLD = """
import sys, time
from rollflow.flows.runs import open_run
open_run(None, sys.argv[1])
print("holding", flush=True)
time.sleep(600)
"""


def rollflow(*args: str, stderr: Path, prefect_url: str | None = None) -> subprocess.Popen[str]:
    """A real ``rollflow`` command in its own process group (with any Prefect server it
    starts, or its flows on ``prefect_url``)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    env.pop("PREFECT_API_URL", None)
    if prefect_url is not None:
        env["PREFECT_API_URL"] = prefect_url
    with stderr.open("w") as log:
        return subprocess.Popen([sys.executable, "-m", "rollflow.flows.cli", *args], env=env,
                                stdout=subprocess.DEVNULL, stderr=log, text=True, start_new_session=True)


def wait_for(child: subprocess.Popen[str], done: object, what: str, within_s: float = 300) -> None:
    deadline = time.monotonic() + within_s
    while not done():  # type: ignore[operator]
        assert child.poll() is None, f"the first process ended before {what}"
        assert time.monotonic() < deadline, f"{what} never happened"
        time.sleep(0.05)


def frozen_run(tmp_path: Path, tiny_config_path: Path, num_steps: int | None = None) -> Path:
    """A run folder with its config frozen and nothing run yet (no lock taken here)."""
    root = tmp_path / "run"
    config = load_config(tiny_config_path)
    if num_steps is not None:
        config = replace(config, train=replace(config.train, num_steps=num_steps))
    freeze_config(RunFolder(root), config)
    return root


def assert_refused_at_once_naming(root: Path, holder: int, tmp_path: Path) -> None:
    started = time.monotonic()
    second = rollflow("resume", str(root), stderr=tmp_path / "second.txt")
    try:
        second.wait(timeout=120)  # the holder holds for minutes: a second that waited for it fails here
    finally:
        kill_group(second)
    seconds = time.monotonic() - started
    message = (tmp_path / "second.txt").read_text()
    assert second.returncode != 0 and f"PID {holder}" in message, message[-2000:]
    # seconds on an idle machine (imports, then the refusal); the bound is for a hang
    assert "Traceback" not in message and seconds < 120, (seconds, message[-2000:])


@pytest.mark.slow  # 6 s in a loaded suite run (docs/testing.md)
def test_a_second_resume_is_refused_at_once_naming_the_holder_and_sigkill_frees_the_folder(
    tiny_config_path: Path, tmp_path: Path
) -> None:
    root = frozen_run(tmp_path, tiny_config_path)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(root)], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "holding\n"
        assert (root / "run.lock").read_text().strip() == str(holder.pid)
        with pytest.raises(RunFolderBusyError, match=f"PID {holder.pid}"):
            open_run(None, root)  # `rollflow resume` refused: the last test, against a real run
    finally:
        kill_group(holder)  # SIGKILL: the kernel drops the flock with the process
    handle = open_run(None, root)
    assert (root / "run.lock").read_text().strip() == str(os.getpid())
    handle.close()


@pytest.mark.slow  # 5 s in a loaded suite run (docs/testing.md)
def test_one_process_may_open_its_run_again(tiny_config_path: Path, tmp_path: Path) -> None:
    """The CLI opens the run, then its flow opens it again in the same process."""
    root = frozen_run(tmp_path, tiny_config_path)
    first, again = open_run(None, root), open_run(None, root)
    assert first.root == again.root == root
    again.close()
    probe = subprocess.run([sys.executable, "-c", HOLD.replace("time.sleep(600)", ""), str(root)],
                           capture_output=True, text=True)
    assert probe.returncode != 0 and f"PID {os.getpid()}" in probe.stderr  # the first holder still has it
    first.close()
    probe = subprocess.run([sys.executable, "-c", HOLD.replace("time.sleep(600)", ""), str(root)],
                           capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr[-2000:]  # the last one out released it


@pytest.mark.slow
def test_two_rollflow_resumes_of_one_folder_the_second_refused_while_the_first_trains(
    tiny_config_path: Path, tmp_path: Path, shared_prefect_url: str
) -> None:
    # more steps than the second's start can outlast (two steps took 4 s; a loaded machine's
    # start of the second took longer): it trains on until it is killed
    root = frozen_run(tmp_path, tiny_config_path, num_steps=1000)
    first = rollflow("resume", str(root), stderr=tmp_path / "first.txt", prefect_url=shared_prefect_url)
    try:
        # the flow is running (on the session's Prefect server, the flow opened the run again): still held
        wait_for(first, lambda: (root / "steps" / "step=000000").exists(), "the first step started")
        assert_refused_at_once_naming(root, first.pid, tmp_path)
        assert first.poll() is None, (tmp_path / "first.txt").read_text()[-2000:]
    finally:
        kill_group(first)
    open_run(None, root).close()  # the kernel released the SIGKILLed holder's lock


def test_a_folder_is_in_use_while_another_process_holds_its_lock_and_free_once_it_is_gone(tmp_path: Path) -> None:
    """What ``rollflow runs`` asks to tell a running run from a stopped one."""
    from rollflow.storage.runlock import acquire_run_folder, release_run_folder, run_folder_in_use

    root = tmp_path / "run"
    assert not run_folder_in_use(root), "no folder, no lock file: nobody runs there"
    hold = "import sys, time; from pathlib import Path; from rollflow.storage.runlock import acquire_run_folder; " \
           "acquire_run_folder(Path(sys.argv[1])); print('holding', flush=True); time.sleep(600)"
    child = subprocess.Popen([sys.executable, "-c", hold, str(root)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "holding"
        assert run_folder_in_use(root)
    finally:
        child.kill()
        child.wait()
    assert not run_folder_in_use(root), "the kernel dropped the dead holder's lock"
    acquire_run_folder(root)  # the probe left it free to take; this process's own hold is no other run
    try:
        assert not run_folder_in_use(root)
    finally:
        release_run_folder(root)
