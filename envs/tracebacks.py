"""The tracebacks behind episode errors, kept for whoever asks while the error is recorded.

An episode's error is data (``EpisodeRollout.error``, ``EpisodeScore.error``: one line,
``"ExceptionType: message (in where)"``), so the exception itself is gone once the episode
comes back. ``describe_error`` (``envs/handle.py``) passes each exception here before it is
reduced to that line; inside ``keeping_tracebacks()`` the formatted traceback is kept
under the line it became, so a stage can write both next to the episode's id.

Outside ``keeping_tracebacks()`` nothing is kept. The store is a context variable: the
asyncio tasks and ``asyncio.to_thread`` workers an episode runs in copy the context, so
every episode of a batch reports to the store of the stage that started the batch.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_KEPT: ContextVar[dict[str, str] | None] = ContextVar("rollflow_kept_tracebacks", default=None)


def keep_traceback(exc: BaseException, error: str) -> None:
    """Keep ``exc``'s formatted traceback under ``error``, the line it was recorded as."""
    kept = _KEPT.get()
    if kept is not None and error not in kept:
        kept[error] = "".join(traceback.format_exception(exc))


@contextmanager
def keeping_tracebacks() -> Iterator[dict[str, str]]:
    """Inside, each recorded episode error's traceback lands in the yielded dict (error -> traceback)."""
    kept: dict[str, str] = {}
    token = _KEPT.set(kept)
    try:
        yield kept
    finally:
        _KEPT.reset(token)
