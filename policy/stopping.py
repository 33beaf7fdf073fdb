"""A process-wide stop request, so that ``kill`` (SIGTERM) and Ctrl-C (SIGINT) end a run cleanly and soon.

Python's default SIGTERM ends the process on the spot: no ``finally``, no ``atexit``. Prefect
stops its temporary API server (a child process) from ``atexit``, so a killed run would
leave it running. Python's default SIGINT raises ``KeyboardInterrupt`` in the main thread
only: the rollout, decoding in another thread, went on for another 12-14 s. Raising
``SystemExit`` from a handler instead unwinds the main thread, but work in another thread
(the rollout decodes in ``asyncio.to_thread``) keeps going, and the interpreter waits for
such threads before it runs ``atexit``.

So the handler, the same for both signals, says at once on stderr that the process is
stopping (one line: the work under way may take a moment to unwind) and also sets a flag
that the long loops read: the decoding loop checks it every step and between prefill slices
(a forward pass runs to its end), the trainer before every micro-batch and optimizer step,
the HTTP clients before every request. They raise ``StopRequested``, a ``BaseException``
like ``KeyboardInterrupt``: the handlers that turn failures into data (an episode's
``error``) let it through, so a stopped episode is never recorded as a failed one and the
stage writes nothing for the work it abandons. The run resumes as after any crash
(``rollflow resume``). The exit status says which signal it was, as a shell does: 143 for
SIGTERM, 130 for Ctrl-C.

Python runs a signal handler in the main thread between two bytecodes only, so one long
call into C++ delays it: a backward pass is one such call (35 s of a 45 s one, measured),
and a stop during the update used to wait for the micro-batch's whole backward.
``stop_points_in_backward`` gives the backward a Python hook per transformer layer, where
the handler runs and the flag is read.

The handler is installed whatever the process inherited: a background job of a
non-interactive shell starts with SIGINT ignored (Python then installs no
``KeyboardInterrupt``), and a run started so must still stop on it.

A terminal's Ctrl-C reaches every process of the foreground process group; the servers a
run starts are kept out of it (their own sessions: policy/vllm_server.py,
flows/prefect_server.py), so they are stopped by the run, in order, not by the keyboard.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, ParamSpec, TypeVar

if TYPE_CHECKING:
    import torch

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


def stop_requested() -> bool:
    """Whether SIGTERM or Ctrl-C asked the process to stop: an error raised since is the stop's."""
    return _STOP.is_set()


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
    if not _STOP.is_set():  # a second Ctrl-C unwinds again but says nothing new
        _say_stopping(signum)
    request_stop(signum)
    raise SystemExit(128 + signum)


def _say_stopping(signum: int) -> None:
    """One line on stderr, at once: the unwinding (a stage's cleanup, the servers' stop) can
    take seconds, and a run that says nothing looks like one that ignored the signal.

    ``os.write``, not ``print``: the handler may interrupt the main thread inside a write to
    ``sys.stderr``, whose buffer refuses a reentrant call.
    """
    how = _SIGNAL_NAMES.get(signum, f"signal {signum}")
    line = f"rollflow: stopping on {how}: the work under way is abandoned, nothing more is written\n"
    try:
        os.write(2, line.encode())
    except OSError:  # stderr closed: the stop goes on, unannounced
        pass


@contextlib.contextmanager
def stop_points_in_backward(model: torch.nn.Module) -> Iterator[None]:
    """For the body: every transformer layer's output (under autograd) gets a gradient hook
    that reads the stop flag, so that a stop takes effect within one layer's backward.

    The hook's being Python is the point: the main thread then runs bytecode inside the
    backward, so a pending signal's handler runs there and its ``SystemExit`` unwinds the
    backward (autograd re-raises it) rather than waiting for the whole pass. A model with no
    transformers layer gets the hook on its own output (a stop point per backward).
    """
    import torch
    from transformers.modeling_layers import GradientCheckpointingLayer

    def check(grad: torch.Tensor) -> None:
        raise_if_stop_requested()

    def hook_output(module: torch.nn.Module, inputs: object, output: object) -> None:
        if not isinstance(output, torch.Tensor):  # a layer's (hidden, ...) or a model's output record
            output = next(iter(output.values() if isinstance(output, Mapping) else output), None)
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(check)

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)] or [model]
    handles = [layer.register_forward_hook(hook_output) for layer in layers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def exit_on_sigterm() -> None:
    """On SIGTERM: set the stop flag for worker threads, and unwind the main thread.

    Only the main thread may install signal handlers; elsewhere this does nothing.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _stop)


def exit_on_stop_signals() -> None:
    """``exit_on_sigterm`` for SIGINT too: Ctrl-C stops a run as ``kill`` does (status 130),
    also where SIGINT was inherited ignored (a background job's)."""
    if threading.current_thread() is threading.main_thread():
        for signum in STOP_SIGNALS:
            signal.signal(signum, _stop)
