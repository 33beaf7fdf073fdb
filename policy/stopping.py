"""A process-wide stop request, so that ``kill`` (SIGTERM) ends a run cleanly and soon.

Python's default SIGTERM ends the process on the spot: no ``finally``, no ``atexit``. Prefect
stops its temporary API server (a child process) from ``atexit``, so a killed run would
leave it running. Raising ``SystemExit`` from a handler instead unwinds the main thread, but
work in another thread (the rollout decodes in ``asyncio.to_thread``) keeps going, and the
interpreter waits for such threads before it runs ``atexit``.

So the handler also sets a flag that the long loops read: the decoding loop checks it every
step and between prefill slices (a forward pass runs to its end), the trainer before every
micro-batch, the HTTP clients before every request. They raise ``StopRequested``, a
``BaseException`` like ``KeyboardInterrupt``: the handlers that turn failures into data (an
episode's ``error``) let it through, so a stopped episode is never recorded as a failed one
and the stage writes nothing for the work it abandons. The run resumes as after any crash
(``rollflow resume``).
"""

from __future__ import annotations

import signal
import threading

SIGTERM_EXIT_CODE = 128 + signal.SIGTERM

_STOP = threading.Event()


class StopRequested(BaseException):  # noqa: N818 (named for what happened, like KeyboardInterrupt)
    """The process was asked to stop; raised at the next point that checks."""


def request_stop() -> None:
    _STOP.set()


def clear_stop() -> None:
    """Forget a stop request (tests; a process that was asked to stop normally exits)."""
    _STOP.clear()


def raise_if_stop_requested() -> None:
    if _STOP.is_set():
        raise StopRequested("the run was asked to stop (SIGTERM); `rollflow resume` continues it")


def exit_on_sigterm() -> None:
    """On SIGTERM: set the stop flag for worker threads, and unwind the main thread.

    Only the main thread may install signal handlers; elsewhere this does nothing.
    """

    def _stop(signum: int, frame: object) -> None:
        request_stop()
        raise SystemExit(SIGTERM_EXIT_CODE)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _stop)
