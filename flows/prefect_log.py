"""Prefect's log of a run, whole, in its run folder; on the console, without run tracebacks.

A stage that raises makes Prefect log the traceback twice, with the task run's "Task run
failed with exception" and the flow run's "Encountered exception during execution": some
80 lines on stderr above the one line ``rollflow train`` ends with. Inside
``prefect_log_in(path)`` (``rollflow train`` and ``resume`` wrap the flow in it):

- every record of Prefect's loggers, tracebacks included, is appended to ``path``
  (``<run>/logs/prefect.log``, ``PREFECT_LOG``), and the command's last line says so;
- Prefect's console handler prints the flow-run and task-run loggers' records without
  their tracebacks: one line each; every other record prints as before;
- and of those, only what the user needs (``ConsoleDigest``). A stage's "Finished in state
  Completed()" is left out (every stage logged one). A failure's cascade (the task run's
  exception, its Failed state, the flow run's exception and Failed state: the same error 4
  times) is held back: if the error then ends the command, the command's own line says it
  (with this log's path), and the cascade stays in the log; if the run logs on instead (the
  flow handled it), the held lines are printed first, so nothing is hidden. Under a stop
  (Ctrl-C, SIGTERM) Prefect's "Crash detected!" lines are left out: the stop is no crash,
  and the command says how it stopped.

Prefect's API handler (what its UI shows) is left alone: it gets every record whole.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rollflow.policy.stopping import stop_requested

PREFECT_LOG = Path("logs") / "prefect.log"
RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")
# How Prefect 3.9's flow and task engines report a failure, a crash, a finished stage.
FAILURE_PREFIXES = (
    "Task run failed with exception", "Encountered exception during execution", "Finished in state Failed",
    "Finished in state Crashed", "Crash detected!",
)
RETRY_MARK = " - Retry "  # "Task run failed with exception: ... - Retry 1/3 will start ...": not a failure yet
CRASH_PREFIXES = ("Crash detected!", "Finished in state Crashed")
STAGE_COMPLETED = "Finished in state Completed"


class WithoutRunTracebacks(logging.Formatter):
    """``inner``'s format, less the traceback of a flow-run or task-run record."""

    def __init__(self, inner: logging.Formatter | None) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        if record.name in RUN_LOGGERS and (record.exc_info or record.exc_text):
            # A copy: the record itself goes on to other handlers whole.
            record = logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None})
        return self.inner.format(record)


class ConsoleDigest(logging.Filter):
    """On a console handler: the run records a user needs (see the module docstring).

    Held records are printed by ``flush`` (the run went on) or dropped by ``discard`` (an
    error ended the block, and the command prints it)."""

    def __init__(self, console: logging.Handler) -> None:
        super().__init__()
        self.console = console
        self.held: list[logging.LogRecord] = []
        self.lock = threading.Lock()  # stages log from worker threads too

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name not in RUN_LOGGERS:
            return True
        message = record.getMessage()
        if message.startswith(FAILURE_PREFIXES) and RETRY_MARK not in message:
            if not (stop_requested() and message.startswith(CRASH_PREFIXES)):
                with self.lock:
                    self.held.append(record)
            return False
        self.flush()  # the run logs on: what failed before was handled, and is shown
        return not (record.name == "prefect.task_runs" and message.startswith(STAGE_COMPLETED))

    def flush(self) -> None:
        with self.lock:
            held, self.held = self.held, []
        for record in held:  # straight to the handler: its filters (this one) passed them already
            self.console.acquire()
            try:
                self.console.emit(record)
            finally:
                self.console.release()

    def discard(self) -> None:
        with self.lock:
            self.held = []


@contextmanager
def prefect_log_in(path: Path) -> Iterator[Path]:
    """Inside, Prefect's records go whole to ``path`` and run tracebacks stay off the console."""
    from prefect.logging.formatters import PrefectFormatter
    from prefect.logging.handlers import PrefectConsoleHandler

    path.parent.mkdir(parents=True, exist_ok=True)
    to_file = logging.FileHandler(path, encoding="utf-8")
    to_file.setFormatter(PrefectFormatter(
        "%(asctime)s | %(levelname)-7s | %(name)s - %(message)s",
        flow_run_fmt="%(asctime)s | %(levelname)-7s | Flow run %(flow_run_name)r - %(message)s",
        task_run_fmt="%(asctime)s | %(levelname)-7s | Task run %(task_run_name)r - %(message)s",
    ))  # fmt: skip
    prefect_logger = logging.getLogger("prefect")
    consoles = [h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)]
    formats = [h.formatter for h in consoles]
    digests = [ConsoleDigest(h) for h in consoles]
    prefect_logger.addHandler(to_file)
    for handler, fmt, digest in zip(consoles, formats, digests, strict=True):
        handler.setFormatter(WithoutRunTracebacks(fmt))
        handler.addFilter(digest)
    try:
        yield path
    except BaseException:  # the command says what ended it, in one line, naming ``path``
        for digest in digests:
            digest.discard()
        raise
    else:
        for digest in digests:
            digest.flush()
    finally:
        for handler, fmt, digest in zip(consoles, formats, digests, strict=True):
            handler.removeFilter(digest)
            handler.setFormatter(fmt)
        prefect_logger.removeHandler(to_file)
        to_file.close()
