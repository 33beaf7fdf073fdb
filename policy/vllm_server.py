"""Start, health-check and stop a vLLM OpenAI-compatible server as a subprocess.

rollflow never imports vLLM: the server runs from its own Python environment, because vLLM
0.32 pins ``transformers < 5.20`` and older setuptools than the project uses. Our code only
speaks HTTP to it (``rollflow.policy.vllm_backend``). Which Python, first match wins:
``$ROLLFLOW_VLLM_PYTHON``; the ``python`` argument (``[rollout].vllm_python``); the repo's
``.venv-vllm/bin/python`` (``make vllm-setup``). A missing one raises ``VLLMServerError``.

The command (``VLLMServerSpec.command``)::

    python -m vllm.entrypoints.openai.api_server --model DIR --served-model-name NAME
        --host 127.0.0.1 --port P --max-model-len N --dtype float32 --enforce-eager
        --logprobs-mode processed_logprobs --generation-config vllm
        --no-enable-chunked-prefill --max-num-batched-tokens max(N, 2048)
        --distributed-executor-backend uni
        [--enable-lora --max-lora-rank R --max-loras K]

- ``vllm serve`` fails in the CPU wheel (it looks up a distribution named ``vllm``), so the
  module is run directly.
- ``--enforce-eager``: a compiled start takes minutes and recompiles every time (torch
  2.13 does not reload its artefact); with LoRA the CPU platform forces eager anyway.
- ``--logprobs-mode processed_logprobs``: logprobs of the distribution sampled from (after
  temperature and top-p), which GRPO's importance ratio needs; vLLM's default is the raw
  model's.
- ``--generation-config vllm``: the model folder's ``generation_config.json`` must not
  slip its own sampling defaults (top_k, repetition penalty) into our requests.
- float32: bfloat16's logprobs are off by about 0.1, and on the CPU it sampled no faster.
- ``--no-enable-chunked-prefill --max-num-batched-tokens max(N, 2048)``: with chunked
  prefill, a seeded request whose prompt is split over engine steps has its generator
  rewound, which torch's CPU generators cannot do: vLLM 0.32's CPU engine dies ("CPU
  Generator does not use offset") on the first prompt that does not fit the step's 2048
  tokens (64 episodes of the bundled game are 36k). Each prompt is prefilled whole instead.
- ``--distributed-executor-backend uni`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the
  model runs in the engine process, not a worker of its own: one fewer process importing
  vLLM starts faster at the same sampling speed and saves its memory
  (``bench/rollout_bench.py``). The worker's OpenMP settings (one thread per bound CPU,
  pinned) go in the environment, as vLLM's multiprocess executor would set them
  (``rollflow.policy.vllm_cpu.worker_openmp_environment``).

Environment: ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache; the server's RSS is about 3 GB
plus this), ``HF_HUB_OFFLINE=1``, with LoRA ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``
(enables ``/v1/load_lora_adapter``); unless already set, ``VLLM_CPU_OMP_THREADS_BIND`` =
the spec's ``cpus``, else every CPU this process may use (vLLM's default binds its worker
to one core), and the OpenMP variables that follow from it.

Lifetime: the server runs in its own session (``start_new_session=True``), so a Ctrl-C in
the terminal reaches only rollflow, which then stops it; its output goes to a log file (the
run folder's ``logs/`` when there is one). ``start`` waits for ``GET /health``; a server
that exits first or is not healthy within ``startup_timeout_s`` is stopped and
``VLLMServerError`` quotes the log's tail and the command. ``stop`` sends SIGTERM to the
whole process group, waits for every member (vLLM's engine process can outlive the API
process) and SIGKILLs what is left after a grace period. ``atexit`` stops every started
server on a normal exit, an uncaught exception, Ctrl-C, and SIGTERM (``start`` installs
``rollflow.policy.stopping.exit_on_sigterm`` while SIGTERM has Python's default action,
which skips ``atexit``). A SIGKILLed rollflow runs no ``atexit``: its watchdog
(``rollflow.policy.procs``) ends the server's group, and a server started from the main
thread also gets the kernel's SIGKILL when rollflow dies (``PR_SET_PDEATHSIG``).

A server that died (``running`` is False, ``exit_status`` says how) is brought back by
``restart(reason)``: what is left of its group is stopped, a line
``rollflow: restarting the vLLM server: REASON`` is appended to its log (or to the new
``log_path`` given), and the same spec starts again on a fresh port (so ``base_url``
changes). Who restarts, and how often, is the caller's business
(``rollflow.tasks.generator.RestartBudget``). Failures that would repeat raise
``VLLMServerError`` with ``deterministic=True`` and the engine's fatal line
(``rollflow.policy.vllm_cpu``): a model whose head size vLLM-cpu's attention has no kernel
for (refused before anything runs), a start whose log shows an engine error, and a
``restart`` of an engine that died before answering any request or of the same error again.

Without a run folder the log is a temporary ``/tmp/rollflow-vllm-*.log``: deleted when a
running server is stopped, else kept and its path printed to stderr (it is the evidence).

Simplifications, and why:
- The port is found by binding port 0 and closing the socket; another process could take
  it in between. The server then fails to start and the error quotes its log.
- One spec, one server: new weights reach it in place (``VLLMPolicy.reload_weights``, the
  folders ``rollflow.policy.vllm_weights`` makes) or as adapters, never by a new spec.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import httpx

from rollflow.policy.procs import group_gone, parent_death_signal, signal_group
from rollflow.policy.stopping import exit_on_sigterm
from rollflow.policy.vllm_cpu import (
    EngineFailure,
    cpu_attention_problem,
    cpu_list,
    engine_failure,
    is_cpu_vllm,
    worker_openmp_environment,
)

PYTHON_ENV = "ROLLFLOW_VLLM_PYTHON"
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
LOG_TAIL_CHARS = 3000
# vLLM's --max-lora-rank accepts only these values.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
CPU_PREFILL_STEP_TOKENS = 2048  # vLLM's default --max-num-batched-tokens for a CPU API server
_POLL_S = 0.5
_KILL_WAIT_S = 10.0


class VLLMServerError(RuntimeError):
    """The server could not be started, did not become healthy, or its Python is missing.

    ``deterministic``: starting it again would fail the same way (a model vLLM's CPU
    attention cannot run, an engine that died of the same error again); a caller that
    retries must not. ``fatal_line``: the engine's own last word from its log, when found.
    """

    def __init__(self, message: str, *, deterministic: bool = False, fatal_line: str | None = None) -> None:
        super().__init__(message)
        self.deterministic = deterministic
        self.fatal_line = fatal_line


@dataclass(frozen=True)
class VLLMServerSpec:
    """Everything that decides which server runs; equal specs can share one server."""

    model_dir: str
    served_model_name: str = "policy"
    max_model_len: int = 2048
    enable_lora: bool = False
    max_lora_rank: int = 16
    max_loras: int = 1
    kvcache_space_gib: int = 2
    python: str | None = None  # None: $ROLLFLOW_VLLM_PYTHON, then the repo's .venv-vllm
    cpus: tuple[int, ...] = ()  # the cores its threads are bound to; empty: every core this process may use
    # The address it listens on: loopback, or a cluster node's own address for a replica that
    # other machines reach (its admin endpoints too: keep such a network closed to others)
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if not (Path(self.model_dir) / "config.json").is_file():
            raise VLLMServerError(f"{self.model_dir} is not a Hugging Face model folder (no config.json)")
        if self.max_model_len < 2 or self.kvcache_space_gib < 1 or self.max_loras < 1:
            raise VLLMServerError(
                f"max_model_len must be >= 2, kvcache_space_gib and max_loras >= 1; got "
                f"{self.max_model_len}, {self.kvcache_space_gib}, {self.max_loras}"
            )
        if self.enable_lora and self.max_lora_rank not in LORA_RANKS:
            raise VLLMServerError(f"max_lora_rank must be one of {LORA_RANKS}; got {self.max_lora_rank}")

    def command(self, python: Path, port: int) -> list[str]:
        args = [
            str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model_dir,
            "--served-model-name", self.served_model_name,
            "--host", self.host,
            "--port", str(port),
            "--max-model-len", str(self.max_model_len),
            "--dtype", "float32",
            "--enforce-eager",
            "--logprobs-mode", "processed_logprobs",
            "--generation-config", "vllm",
            "--no-enable-chunked-prefill",
            "--max-num-batched-tokens", str(max(self.max_model_len, CPU_PREFILL_STEP_TOKENS)),
            "--distributed-executor-backend", "uni",
        ]  # fmt: skip
        if self.enable_lora:
            args += ["--enable-lora", "--max-lora-rank", str(self.max_lora_rank),
                     "--max-loras", str(self.max_loras)]  # fmt: skip
        return args

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        env = dict(base)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kvcache_space_gib)
        env["HF_HUB_OFFLINE"] = "1"
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_list(set(self.cpus) or os.sched_getaffinity(0)))
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        # The model in the engine process (module docstring). "1" in the environment
        # restores the worker process (the CPU platform then turns "uni" into "mp").
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0":
            env.update(worker_openmp_environment(env["VLLM_CPU_OMP_THREADS_BIND"], env))
        # /collective_rpc reload_weights and /reset_prefix_cache: full-weight sync in place
        # (VLLMPolicy.reload_weights). The server listens on loopback unless ``host`` says
        # otherwise (a replica on a cluster node).
        env.setdefault("VLLM_SERVER_DEV_MODE", "1")
        if self.enable_lora:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        return env


def lora_rank_limit(rank: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM accepts that holds an adapter of ``rank``."""
    for limit in LORA_RANKS:
        if limit >= rank:
            return limit
    raise VLLMServerError(f"LoRA rank {rank} is above vLLM's largest --max-lora-rank {LORA_RANKS[-1]}")


def resolve_python(configured: str | None) -> Path:
    """The interpreter that has vLLM (see the module docstring for the order)."""
    from_env = os.environ.get(PYTHON_ENV)
    candidate = Path(from_env or configured or DEFAULT_PYTHON)
    source = f"${PYTHON_ENV}" if from_env else ("[rollout].vllm_python" if configured else "the default")
    if not candidate.is_file():
        raise VLLMServerError(
            f"no vLLM Python at {candidate} ({source}); build the default one with "
            f"`make vllm-setup` (creates {DEFAULT_PYTHON.parent.parent}), or point "
            f"[rollout].vllm_python or ${PYTHON_ENV} at a Python that has vllm installed"
        )
    return candidate


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


class VLLMServer:
    """One managed vLLM server; use as a context manager, or ``start`` / ``stop``."""

    def __init__(
        self, spec: VLLMServerSpec, *, log_path: Path | None = None, startup_timeout_s: float = 600.0
    ) -> None:
        self.spec = spec
        self.python = resolve_python(spec.python)
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
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

    @property
    def base_url(self) -> str:
        """``http://HOST:P/v1`` (``VLLMServerSpec.host``): what the policy's requests go to."""
        if self.port is None:
            raise VLLMServerError("the server has not been started")
        return f"http://{self.spec.host}:{self.port}/v1"

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
        started = time.monotonic()
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                self._command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.spec.environment(os.environ), start_new_session=True,
                preexec_fn=parent_death_signal(),  # SIGKILLed with rollflow (policy/procs.py)
            )  # fmt: skip
        _LIVE.add(self)
        try:
            self._wait_healthy(started)
        except BaseException:
            self._keep_log = True
            self.stop()
            raise
        self.startup_s = time.monotonic() - started
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

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM to the process group, wait for all of it, SIGKILL after ``grace_s``."""
        process, self._process = self._process, None
        _LIVE.discard(self)
        if process is None:
            return
        self._exit_status = process.poll()
        if self._exit_status is not None:
            self._keep_log = True  # it died before we asked
        self._stop_group(process, grace_s)
        if self._exit_status is None:
            self._exit_status = process.poll()
        self._settle_temp_log()

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
        assert self._process is not None
        url = f"http://{self.spec.host}:{self.port}/health"
        while True:
            code = self._process.poll()
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
