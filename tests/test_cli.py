"""The ``rollflow`` entry point's contract for stops (flows/cli.py ``main``), on a real process.

A stop is a stop in every command but ``chat``: Ctrl-C exits 130 with one line, whatever
error it caused on the way out. DuckDB checks for signals itself while a query runs; its
"Query interrupted" used to reach the user as a traceback and status 1 (review F6).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollflow.config.run import RunConfig
from rollflow.flows.runs import freeze_config
from rollflow.storage.runfolder import RunFolder

# A hash join DuckDB runs for a minute or more here, checking for signals between its tasks.
LONG_QUERY = "SELECT count(*) FROM range(300000000) a JOIN range(300000000) b ON a.range = b.range"
# `python -m rollflow.flows.cli`, saying when its imports (seconds on a busy machine) are done.
ROLLFLOW = (
    "import sys\n"
    "from rollflow.flows.cli import build_parser, main\n"
    "build_parser()  # the subcommands' modules\n"
    "print('imported', flush=True)\n"
    "sys.exit(main())\n"
)


@pytest.mark.slow  # ~15 s: the command's imports, then a second of its query
def test_ctrl_c_during_a_long_sql_query_exits_130_with_one_line(tmp_path: Path) -> None:
    root = tmp_path / "run"
    freeze_config(RunFolder(root), RunConfig())
    err = tmp_path / "stderr.txt"
    with err.open("w") as stderr:
        child = subprocess.Popen(
            [sys.executable, "-c", ROLLFLOW, "sql", str(root), LONG_QUERY],
            stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal's job starts
        )  # fmt: skip
    try:
        assert child.stdout is not None and child.stdout.readline() == "imported\n", err.read_text()[-3000:]
        time.sleep(3)  # main: the handlers, the run folder's views, then the query
        assert child.poll() is None, err.read_text()[-3000:]
        signalled = time.monotonic()
        os.killpg(child.pid, signal.SIGINT)
        status = child.wait(timeout=120)
        took = time.monotonic() - signalled
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait(timeout=60)
    text = err.read_text()
    assert status == 130, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    ours = [line for line in text.splitlines() if line.startswith("rollflow sql:")]
    assert ours == ["rollflow sql: stopped by SIGINT"], text[-3000:]
    assert took < 30, f"the query ran on for {took:.0f} s after Ctrl-C"
