"""A process-wide stop request, so that ``kill`` (SIGTERM) and Ctrl-C (SIGINT) end a run cleanly and soon.

Python's default SIGTERM ends the process on the spot: no ``finally``, no ``atexit``. Prefect
stops its temporary API server (a child process) from ``atexit``, so a killed run would
leave it running. Python's default SIGINT raises ``KeyboardInterrupt`` in the main thread
only: the rollout, decoding in another thread, went on for another 12-14 s. Raising
``SystemExit`` from a handler instead unwinds the main thread, but work in another thread
(the rollout decodes in ``asyncio.to_thread``) keeps going, and the interpreter waits for
such threads before it runs ``atexit``.

So the handler, the same for both signals, also sets a flag that the long loops read: the
decoding loop checks it every step and between prefill slices (a forward pass runs to its
end), the trainer before every micro-batch, the HTTP clients before every request. They
raise ``StopRequested``, a ``BaseException`` like ``KeyboardInterrupt``: the handlers that
turn failures into data (an episode's ``error``) let it through, so a stopped episode is
never recorded as a failed one and the stage writes nothing for the work it abandons. The
run resumes as after any crash (``rollflow resume``). The exit status says which signal it
was, as a shell does: 143 for SIGTERM, 130 for Ctrl-C.

A terminal's Ctrl-C reaches every process of the foreground process group; the servers a
run starts are kept out of it (their own sessions: policy/vllm_server.py,
flows/prefect_server.py), so they are stopped by the run, in order, not by the keyboard.
"""

from __future__ import annotations

import functools
import signal
import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

_P = ParamSpec("_P")
_R = TypeVar("_R")

SIGTERM_EXIT_CODE = 128 + signal.SIGTERM
SIGINT_EXIT_CODE = 128 + signal.SIGINT
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_SIGNAL_NAMES = {signal.SIGINT: "Ctrl-C (SIGINT)", signal.SIGTERM: "SIGTERM"}

_STOP = threading.Event()
_STOP_SIGNAL: list[int] = []  # the signal of the last request, if one came by signal


class StopRequested(BaseException):  # noqa: N818 (named for what happened, like KeyboardInterrupt)
    """The process was asked to stop; raised at the next point that checks."""


def request_stop(signum: int = signal.SIGTERM) -> None:
    _STOP_SIGNAL[:] = [signum]
    _STOP.set()


def clear_stop() -> None:
    """Forget a stop request (tests; a process that was asked to stop normally exits)."""
    _STOP.clear()
    _STOP_SIGNAL.clear()


def stop_exit_code() -> int:
    """A shell's status for the signal that asked to stop: 130 for Ctrl-C, else 143."""
    return 128 + (_STOP_SIGNAL[0] if _STOP_SIGNAL else signal.SIGTERM)


def raise_if_stop_requested() -> None:
    if _STOP.is_set():
        how = _SIGNAL_NAMES.get(_STOP_SIGNAL[0], "a signal") if _STOP_SIGNAL else "SIGTERM"
        raise StopRequested(f"the run was asked to stop ({how}); `rollflow resume` continues it")


def stops_through(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """``fn`` (a stage, run on the main thread), an error it raises after a stop was
    requested raised as the ``SystemExit`` the signal handler raised.

    A library that checks for signals itself can eat the handler's ``SystemExit`` and raise
    its own error instead: DuckDB's query, interrupted, raises ``RuntimeError: Query
    interrupted``. Inside a stage that would be a failed stage, logged with its traceback,
    and the run's exit status 1, where the user pressed Ctrl-C (status 130, one resume line).
    """

    @functools.wraps(fn)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return fn(*args, **kwargs)
        except Exception as error:
            if _STOP.is_set():
                raise SystemExit(stop_exit_code()) from error
            raise

    return run


def _stop(signum: int, frame: object) -> None:
    request_stop(signum)
    raise SystemExit(128 + signum)


def exit_on_sigterm() -> None:
    """On SIGTERM: set the stop flag for worker threads, and unwind the main thread.

    Only the main thread may install signal handlers; elsewhere this does nothing.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _stop)


def exit_on_stop_signals() -> None:
    """``exit_on_sigterm`` for SIGINT too: Ctrl-C stops a run as ``kill`` does (status 130)."""
    if threading.current_thread() is threading.main_thread():
        for signum in STOP_SIGNALS:
            signal.signal(signum, _stop)
