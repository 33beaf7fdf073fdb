"""No process outlives its run: a watchdog that ends a run's process tree when the run dies.

A run (``rollflow train``, ``resume``, ``pipeline``, ``eval``, ``sft``) has children that do not
die with it: the managed vLLM server (in a session of its own, so that a Ctrl-C reaches only
rollflow) with its engine process, and Prefect's temporary API server. Their normal stop is
the run's own (``atexit`` in ``policy/vllm_server.py`` and in Prefect), which a SIGKILLed or
OOM-killed run never reaches, so it would leave them all running (~5 GB with vLLM).

``start_watchdog()`` (``rollflow.flows.cli.main`` calls it for those commands) starts this
file as a separate process, in a session of its own, that
1. every ``POLL_S`` reads /proc and records the run's whole descendant tree, each process
   by pid and start time (so a reused pid is never taken for it);
2. learns at once that the run ended: the run holds the only write end of a pipe whose read
   end the watchdog waits on (EOF when the run exits, however it exits), and every poll
   also checks the run's pid and start time (a forked child that kept the write end cannot
   hide a death);
3. then sends SIGTERM to every recorded process still alive, to what they started since, and
   to every member of a process group that a recorded process leads while a recorded member
   is still in it (the vLLM server's group holds its engine process); after ``TERM_GRACE_S``
   SIGKILL to what is left; then it exits.
It signals nothing that was not a descendant of the run: each target is re-identified by
pid and start time and signalled through a pidfd opened before that check, and the run's
own process group (the user's shell pipeline) is never signalled. After a normal exit the
run's children are already stopped and the watchdog finds nothing to do.

``parent_death_signal()`` is a second line of defence for one child: a ``preexec_fn`` that
has the kernel SIGKILL the child when the thread that started it ends
(``PR_SET_PDEATHSIG``). The signal follows the starting *thread*, so it is only given to
children started from the main thread, whose end is the process's end.

``fault_point(name)``: with ``$ROLLFLOW_FAULT_POINT`` = ``name`` the process stops itself
(SIGSTOP) at that point of a run, where a test sees it stopped, records its processes and
SIGKILLs it (``tests/kill_matrix.py``).

Simplified, and why:
- The tree is polled, not traced: a child that starts and is orphaned (re-parented to
  init) within one poll is missed unless it is in a recorded process group. Tracing forks
  (ptrace, cgroups) needs privileges a user's machine may not give; making the run a child
  subreaper would keep orphans in its tree but leave each one a zombie of the run.
- Linux only (/proc, prctl); elsewhere ``start_watchdog`` and ``parent_death_signal`` do
  nothing.

This file runs as the watchdog with ``python -I procs.py`` and must import the standard
library only (it starts in milliseconds and holds no model, whatever the run imported).
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

POLL_S = 0.5
TERM_GRACE_S = 3.0  # vLLM's engine process has been seen to ignore SIGTERM
KILL_WAIT_S = 5.0
EXIT_WAIT_S = 2.0  # the pipe's EOF comes a moment before the run's exit is visible in /proc
FAULT_POINT_ENV = "ROLLFLOW_FAULT_POINT"
FAULT_POINTS = ("checkpoint_write", "train_update", "weight_publish")
_PR_SET_PDEATHSIG = 1
_PROC = Path("/proc")
_WATCHDOG: list[subprocess.Popen[bytes]] = []  # at most one per process


@dataclass(frozen=True)
class Proc:
    """One process as /proc/PID/stat shows it; ``(pid, start)`` names it for good."""

    pid: int
    ppid: int
    pgid: int
    state: str  # "Z": a zombie (ended, not yet reaped)
    start: int  # clock ticks after boot

    @property
    def key(self) -> tuple[int, int]:
        return (self.pid, self.start)


def read_proc(pid: int) -> Proc | None:
    """The process ``pid`` now, or None when there is none."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # after "pid (name)": field 3 of proc(5) is [0]
    return Proc(pid, ppid=int(fields[1]), pgid=int(fields[2]), state=fields[0], start=int(fields[19]))


def process_table() -> dict[int, Proc]:
    """Every process this one can see, zombies included."""
    table = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit() and (proc := read_proc(int(entry.name))) is not None:
            table[proc.pid] = proc
    return table


def descendants(roots: Iterable[int], table: dict[int, Proc]) -> dict[int, Proc]:
    """The live (non-zombie) processes below ``roots`` in ``table``, the roots excluded."""
    children: dict[int, list[Proc]] = {}
    for proc in table.values():
        children.setdefault(proc.ppid, []).append(proc)
    found: dict[int, Proc] = {}
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            if child.pid not in found:
                found[child.pid] = child
                todo.append(child.pid)
    return {pid: proc for pid, proc in found.items() if proc.state != "Z"}


def is_alive(proc: Proc) -> bool:
    """True while ``proc`` (the same pid *and* start time) runs or sleeps, not a zombie."""
    now = read_proc(proc.pid)
    return now is not None and now.start == proc.start and now.state not in ("Z", "X")


def signal_group(group: int, sig: signal.Signals) -> None:
    """``killpg``, quiet when the group is gone already."""
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        pass


def group_gone(leader: subprocess.Popen[bytes], group: int) -> bool:
    """True once ``leader`` is reaped and no live (non-zombie) member of ``group`` is left."""
    leader.poll()  # reap the leader, else it lingers as a zombie member of the group
    if not _PROC.is_dir():  # not Linux: ask the kernel, which also counts zombies
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return True
        return False
    return not any(proc.pgid == group and proc.state != "Z" for proc in process_table().values())


def processes_to_end(recorded: dict[tuple[int, int], Proc], table: dict[int, Proc]) -> dict[int, Proc]:
    """What is left of a dead run in ``table``: see the module docstring, step 3."""
    live = {p.pid: table[p.pid] for p in recorded.values() if p.pid in table and table[p.pid].start == p.start}
    led = {p.pid for p in recorded.values() if p.pgid == p.pid}  # groups a recorded process made
    kept = {p.pgid for pid, p in live.items() if p.pgid in led and recorded[(pid, p.start)].pgid == p.pgid}
    targets = {pid: p for pid, p in live.items() if p.state != "Z"}
    targets |= {p.pid: p for p in table.values() if p.pgid in kept and p.state != "Z"}
    targets |= descendants(list(targets), table)
    targets.pop(os.getpid(), None)
    return targets


# ---------------------------------------------------------------- signalling, by identity


class _Target:
    """A process to end, held by a pidfd (where the kernel has them) so its pid cannot be
    reused under us between the identity check and the signal."""

    def __init__(self, proc: Proc) -> None:
        self.proc = proc
        self.fd: int | None = None
        try:
            self.fd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            pass

    def signal(self, sig: signal.Signals) -> None:
        if not is_alive(self.proc):  # after pidfd_open: the fd names this very process
            return
        try:
            if self.fd is not None:
                signal.pidfd_send_signal(self.fd, sig)
            else:
                os.kill(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)


def end_processes(recorded: dict[tuple[int, int], Proc]) -> list[str]:
    """SIGTERM what is left of the run, SIGKILL it after ``TERM_GRACE_S``; returns what was
    found, as "PID (command name)"."""
    targets: dict[tuple[int, int], _Target] = {}
    found: list[str] = []
    for sig, wait_s in ((signal.SIGTERM, TERM_GRACE_S), (signal.SIGKILL, KILL_WAIT_S)):
        for proc in processes_to_end(recorded, process_table()).values():
            if proc.key not in targets:
                targets[proc.key] = _Target(proc)
                found.append(f"{proc.pid} ({_command_name(proc.pid)})")
                recorded[proc.key] = proc  # what a target started is followed too
        for target in targets.values():
            target.signal(sig)
        _wait_until(lambda: not any(is_alive(t.proc) for t in targets.values()), wait_s)
    for target in targets.values():
        target.close()
    return found


def _wait_until(done: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# ---------------------------------------------------------------- the watchdog process


def watch(run: Proc, death_fd: int | None) -> None:
    """Record ``run``'s descendants until it ends, then end what is left of them."""
    recorded: dict[tuple[int, int], Proc] = {}
    while True:
        if death_fd is not None and select.select([death_fd], [], [], POLL_S)[0] and not os.read(death_fd, 1):
            os.close(death_fd)
            death_fd = None  # EOF: the run exited, or closed its end (then polling goes on)
            _wait_until(lambda: not is_alive(run), EXIT_WAIT_S)
        elif death_fd is None:
            time.sleep(POLL_S)
        table = process_table()
        if not is_alive(run):
            break
        recorded |= {p.key: p for p in descendants([run.pid], table).values() if p.pid != os.getpid()}
    ended = end_processes(recorded)
    if ended:
        print(f"rollflow watchdog: run {run.pid} ended; stopped what it left running: {', '.join(ended)}",
              file=sys.stderr, flush=True)  # fmt: skip


def _command_name(pid: int) -> str:
    try:
        return (_PROC / str(pid) / "comm").read_text().strip()
    except OSError:
        return "gone"


def start_watchdog() -> subprocess.Popen[bytes] | None:
    """Start the watchdog of this process (once; None where there is no /proc)."""
    if _WATCHDOG:
        return _WATCHDOG[0]
    me = read_proc(os.getpid()) if sys.platform.startswith("linux") else None
    if me is None:
        return None
    read_end, write_end = os.pipe()  # not inherited by later children: only this process holds it
    try:
        watchdog = subprocess.Popen(
            [sys.executable, "-I", str(Path(__file__).resolve()), str(me.pid), str(me.start), str(read_end)],
            pass_fds=(read_end,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
    finally:
        os.close(read_end)
    _WATCHDOG.append(watchdog)
    _KEEP_OPEN.append(write_end)
    return watchdog


_KEEP_OPEN: list[int] = []  # the pipe's write end, closed only by this process's exit


def parent_death_signal() -> Callable[[], None] | None:
    """A ``preexec_fn``: the child is SIGKILLed when this process ends (see the module
    docstring); None off Linux or outside the main thread."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def tie_to_parent() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the prctl: nobody would signal
            os._exit(1)

    return tie_to_parent


def fault_point(name: str) -> None:
    """Stop this process here (SIGSTOP) when ``$ROLLFLOW_FAULT_POINT`` is ``name`` (tests)."""
    assert name in FAULT_POINTS, f"unknown fault point {name!r}; known: {FAULT_POINTS}"
    if os.environ.get(FAULT_POINT_ENV) == name:
        os.kill(os.getpid(), signal.SIGSTOP)


if __name__ == "__main__":  # the watchdog: procs.py RUN_PID RUN_START DEATH_FD
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    run_pid, run_start, fd = (int(arg) for arg in sys.argv[1:4])
    watched = read_proc(run_pid)
    if watched is not None and watched.start == run_start:
        watch(watched, fd)
