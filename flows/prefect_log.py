"""Prefect's log of a run, whole, in its run folder; on the console, without run tracebacks.

A stage that raises makes Prefect log the traceback twice, with the task run's "Task run
failed with exception" and the flow run's "Encountered exception during execution": some
80 lines on stderr above the one line ``rollflow train`` ends with. Inside
``prefect_log_in(path)`` (``rollflow train`` and ``resume`` wrap the flow in it):

- every record of Prefect's loggers, tracebacks included, is appended to ``path``
  (``<run>/logs/prefect.log``, ``PREFECT_LOG``), and the command's last line says so;
- Prefect's console handler prints the flow-run and task-run loggers' records without
  their tracebacks: one line each; every other record prints as before.

Prefect's API handler (what its UI shows) is left alone: it gets every record whole.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PREFECT_LOG = Path("logs") / "prefect.log"
RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")


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
    prefect_logger.addHandler(to_file)
    for handler, fmt in zip(consoles, formats, strict=True):
        handler.setFormatter(WithoutRunTracebacks(fmt))
    try:
        yield path
    finally:
        for handler, fmt in zip(consoles, formats, strict=True):
            handler.setFormatter(fmt)
        prefect_logger.removeHandler(to_file)
        to_file.close()
