"""The kill matrix's machinery: a real `rollflow train` watched from outside, killed, checked.

The matrix itself is two modules, one per schedule (``test_kill_matrix_lockstep.py``,
``test_kill_matrix_async.py``), so that ``make test``'s two workers run them side by side;
this module is what both use (and ``test_ctrl_c.py``'s ``RunProcess``).

What the matrix checks: a real `rollflow train` on vLLM, SIGKILLed at each kill point, leaves
no process behind, and its resume trains the same episodes as an uninterrupted run.

For lockstep and async collection, one run each on the tiny vLLM model of
tests/tiny_run.py (LoRA, 2 steps of 2 groups of 2 episodes) is killed at one point,
checked, resumed, killed at the next point, and so on; the last resume finishes it:
- ``rollout``: some of the step's episodes are on disk, not all (seen from outside);
- ``train``: the step's samples are written and its checkpoint is not (seen from outside);
- ``train_update``, ``checkpoint_write``, ``weight_publish``: the run stops itself there
  (``$ROLLFLOW_FAULT_POINT``, ``rollflow.policy.procs.fault_point``);
- the generator server SIGKILLed while requests are in flight (the run restarts it in
  lockstep; an async run fails, and is resumed).
Each kill is a SIGKILL of the run's own pid only, as the OOM killer does, with the process
stopped (SIGSTOP) first so that the snapshot of its descendants taken just before the kill
is exact. After it, every process of the run ever seen (by pid and start time) and every
member of their process groups must be gone within seconds: the kernel ends the children
tied to the run (``PR_SET_PDEATHSIG``: the vLLM server, its engine core, Prefect's server)
and the run's watchdog (``rollflow.policy.procs``) what is left. The first run of each
matrix starts Prefect's temporary server, as a plain ``rollflow train`` does, and the check
covers it; the resumes run their flows on the session's server (``shared_prefect_url``),
one start fewer each.

A run stopped (SIGSTOP) by ``kill`` or at a fault point has no watchdog to end it: the
watchdog waits for the run's death, and a stopped run never dies. So every ``RunProcess``
is remembered, and ``end_runs`` (every test's teardown, ``tests/conftest.py``, also when the
test failed or pytest was interrupted) SIGKILLs what is left of each one, stopped or not.

"The same episodes as an uninterrupted run": each step holds its groups' episodes exactly
once (counted in the ``episodes`` view), each group plays the task of its data position
(the seeded draw an uninterrupted run makes), no episode carries an error, and async
trains every collected group at most once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import ClassVar

import pytest

from rollflow.config.run import RunConfig, config_to_toml
from rollflow.policy.procs import FAULT_POINT_ENV, Proc, descendants, is_alive, process_table, read_proc
from rollflow.storage.async_groups import finished_groups
from rollflow.storage.query import open_run_sql, run_query
from rollflow.storage.runfolder import RunFolder

TESTS = Path(__file__).parent
STEPS, GROUPS, GROUP_SIZE = 2, 2, 2
LEFTOVER_WAIT_S = 20.0  # the watchdog's SIGTERM grace, its SIGKILL, and the reaping
RUN_TIMEOUT_S = 300.0
PREFECT_SERVER = b"prefect.server.api.server:create_app"  # the temporary server's command line



def _config(model_dir: Path, tmp_path: Path, lockstep: bool) -> Path:
    """test_async_training's tiny async LoRA run; lockstep: one group per rollout chunk."""
    from test_async_training import async_config

    config: RunConfig = async_config(model_dir, tmp_path, train={"keep_checkpoints": 10})
    rollout = replace(config.rollout, batch_size=GROUPS, episodes_per_task=GROUP_SIZE)
    if lockstep:
        rollout = replace(rollout, max_steps_off_policy=None, concurrency=GROUP_SIZE)
    config = replace(
        config,
        rollout=rollout,
        train=replace(config.train, num_steps=STEPS),
        storage=replace(config.storage, runs_dir=str(tmp_path / "runs")),
    )
    path = tmp_path / "kill-matrix.toml"
    path.write_text(config_to_toml(config))
    return path


# ---------------------------------------------------------------- a run, watched from outside


def _cmdline(pid: int) -> bytes:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes()
    except OSError:
        return b""


def is_vllm_api_server(proc: Proc) -> bool:
    """A vLLM API server, not its engine core: forked from the server, the engine carries the
    server's command line until it renames itself."""
    return _is_api_server(proc.pid) and not _is_api_server(proc.ppid)


def _is_api_server(pid: int) -> bool:
    return b"vllm.entrypoints.openai.api_server" in _cmdline(pid)


def _describe(procs: list[Proc]) -> str:
    lines = []
    for proc in procs:
        command = _cmdline(proc.pid).replace(b"\0", b" ").decode(errors="replace")
        lines.append(f"  {proc.pid} (group {proc.pgid}): {command[:150]}")
    return "\n".join(lines)


class RunProcess:
    """One `rollflow train` / `resume` process, with every process of its tree it was seen with.

    ``command``: what runs ``argv`` (the rollflow command line unless given; tests of this
    machinery give another). ``prefect_url``: a Prefect server for its flows (the
    ``shared_prefect_url`` fixture); without one the run starts its temporary server, a child."""

    started: ClassVar[list[RunProcess]] = []  # every run of this test process not yet ended by end_runs

    def __init__(
        self, argv: list[str], log: Path, fault: str | None = None, command: Sequence[str] | None = None,
        prefect_url: str | None = None,
    ) -> None:  # fmt: skip
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
        env.pop("PREFECT_API_URL", None)
        if prefect_url is not None:
            env["PREFECT_API_URL"] = prefect_url
        env.pop(FAULT_POINT_ENV, None)
        if fault is not None:
            env[FAULT_POINT_ENV] = fault
        self.log = log
        with log.open("w") as stderr:
            self.child = subprocess.Popen(
                [*(command or [sys.executable, "-m", "rollflow.flows.cli"]), *argv], env=env,
                stdout=subprocess.DEVNULL, stderr=stderr, text=True, start_new_session=True,
            )  # fmt: skip
        RunProcess.started.append(self)
        self.seen: dict[tuple[int, int], Proc] = {}
        self.killed_with: list[bytes] = []  # the command lines of its descendants when kill() killed it
        self.look()

    def look(self) -> dict[int, Proc]:
        """The run's process tree now (itself included), added to ``seen``."""
        table = process_table()
        tree = descendants([self.child.pid], table)
        if self.child.pid in table:
            tree[self.child.pid] = table[self.child.pid]
        self.seen |= {p.key: p for p in tree.values()}
        return tree

    def tail(self) -> str:
        return self.log.read_text()[-3000:]

    def wait_until(self, condition: Callable[[], bool], what: str, timeout_s: float = RUN_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert self.child.poll() is None, f"the run ended before {what}:\n{self.tail()}"
            assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s:.0f} s:\n{self.tail()}"
            self.look()
            time.sleep(0.05)

    def stopped_itself(self) -> bool:
        proc = read_proc(self.child.pid)
        return proc is not None and proc.state == "T"

    def vllm_server(self) -> Proc:
        servers = [p for p in self.look().values() if is_vllm_api_server(p)]
        assert len(servers) == 1, f"expected one vLLM API server in the run's tree, found {len(servers)}"
        return servers[0]

    def kill(self) -> None:
        """Stop the run, take its tree, SIGKILL the run's own pid (only it), and check that
        nothing it was seen with is left."""
        os.kill(self.child.pid, signal.SIGSTOP)
        self.wait_until(self.stopped_itself, "the run stopping", timeout_s=10)
        tree = self.look()
        assert any(p.pid != self.child.pid for p in tree.values()), "the run had no children to leave behind"
        self.killed_with = [_cmdline(p.pid) for p in tree.values() if p.pid != self.child.pid]
        os.kill(self.child.pid, signal.SIGKILL)
        self.child.wait(timeout=30)
        # Ended by the kernel (the vLLM server, its engine core and Prefect's temporary server
        # die with the run: PR_SET_PDEATHSIG) or by the run's watchdog (what is not tied, or
        # still dying when it looked: it names what it stopped in the log); either way nothing
        # is left. The watchdog alone is tested in test_policy_procs.py.
        assert_gone(list(self.seen.values()), f"the run killed ({self.log.name})")

    def killed_its_own_prefect_server(self) -> bool:
        """Whether Prefect's temporary server was in the run's tree when ``kill`` killed it."""
        return any(PREFECT_SERVER in command for command in self.killed_with)

    def finish(self) -> int:
        """Wait for the run to end by itself; nothing it was seen with may outlive it."""
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while self.child.poll() is None:
            assert time.monotonic() < deadline, f"the run did not finish:\n{self.tail()}"
            self.look()
            time.sleep(0.1)
        assert_gone(list(self.seen.values()), f"the run ended ({self.log.name})")
        return self.child.returncode


def _left(procs: list[Proc]) -> list[Proc]:
    """What is still alive of ``procs`` and of their process groups (zombies are gone)."""
    groups = {p.pgid for p in procs}
    alive = {p.pid: p for p in procs if is_alive(p)}
    alive |= {p.pid: p for p in process_table().values() if p.pgid in groups and p.state != "Z"}
    alive.pop(os.getpid(), None)
    return list(alive.values())


def assert_gone(procs: list[Proc], when: str) -> None:
    deadline = time.monotonic() + LEFTOVER_WAIT_S
    while (left := _left(procs)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if left:
        found = _describe(left)
        for proc in left:
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        pytest.fail(f"{when}: {len(left)} process(es) of the run outlived it:\n{found}")


def end_runs() -> list[str]:
    """SIGKILL every run started here that is still alive (stopped by ``kill`` or at a fault
    point, or running) and everything of its tree and its process groups that is left; returns
    a line for each process found alive. A SIGKILL ends a stopped process too, so nothing
    waits on a SIGCONT. Every test's teardown (tests/conftest.py) calls it."""
    found: list[str] = []
    while RunProcess.started:
        run = RunProcess.started.pop()
        if run.child.poll() is None:
            with _quiet():
                os.kill(run.child.pid, signal.SIGSTOP)  # no new children between the look and the kill
            run.look()
        left = _left(list(run.seen.values()))
        found += _describe(left).splitlines()
        deadline = time.monotonic() + LEFTOVER_WAIT_S
        while left and time.monotonic() < deadline:
            for proc in left:
                with _quiet():
                    os.kill(proc.pid, signal.SIGKILL)
            if run.child.poll() is None:
                with _quiet(subprocess.TimeoutExpired):
                    run.child.wait(timeout=1)
            time.sleep(0.05)
            left = _left(list(run.seen.values()))
        run.child.poll()
    return found


def _quiet(*more: type[BaseException]) -> contextlib.AbstractContextManager[None]:
    return contextlib.suppress(ProcessLookupError, *more)


# ---------------------------------------------------------------- kill points seen from outside


def rollout_half_done(folder: RunFolder, step: int) -> Callable[[], bool]:
    def seen() -> bool:
        assert not folder.is_complete(step, "episodes"), f"step {step}'s rollout finished before the kill"
        return bool(folder.part_paths(step, "episodes", "train"))

    return seen


def training(folder: RunFolder, step: int) -> Callable[[], bool]:
    def seen() -> bool:
        assert not folder.checkpoint_dir(step).exists(), f"step {step} trained before the kill"
        return "flatten" in folder.stage_seconds(step)

    return seen


def collecting(folder: RunFolder) -> Callable[[], bool]:
    """The workers have finished a group (and go on collecting the next ones)."""
    return lambda: bool(finished_groups(folder))


def kill_the_server_mid_request(run: RunProcess, serving: Callable[[], bool]) -> Proc:
    """SIGKILL the generator's API server once ``serving``; returns it."""
    run.wait_until(serving, "the generator serving requests")
    server = run.vllm_server()
    os.kill(server.pid, signal.SIGKILL)
    return server


# ---------------------------------------------------------------- the episodes trained


def _episode_counts(run_dir: Path) -> list[tuple[int, str, str, int, int, int]]:
    con = open_run_sql([run_dir])
    try:
        _, rows = run_query(con, "SELECT step, group_id, task_id, count(*), count(DISTINCT episode_id), "
                                 "count(error) FROM episodes WHERE split = 'train' GROUP BY ALL ORDER BY ALL")  # fmt: skip
    finally:
        con.close()
    return rows


def _train_tasks(config_path: Path) -> list:
    from rollflow.envs.runner import load_environment_handle
    from rollflow.config.run import load_config

    config = load_config(config_path)
    return load_environment_handle(config.env.name, config.env.kwargs).tasks("train")


def assert_each_group_once(run_dir: Path, task_of: Callable[[int, int], str]) -> None:
    """Every step's groups, each with its task (``task_of(step, k)``) and GROUP_SIZE episodes once."""
    expected = [(s, f"train/{s}/{k}", task_of(s, k), GROUP_SIZE, GROUP_SIZE, 0)
                for s in range(STEPS) for k in range(GROUPS)]  # fmt: skip
    assert sorted(_episode_counts(run_dir)) == sorted(expected)
