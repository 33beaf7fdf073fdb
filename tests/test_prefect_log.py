"""A failing run's stderr is rollflow's message, not Prefect's tracebacks (flows/prefect_log.py).

Prefect logs a failed task's traceback with the task run and again with the flow run; the
command keeps them whole in the run folder's ``logs/prefect.log`` and prints those records
in one line each. The real `rollflow train` in a subprocess on a broken environment, and
the formatter on records, with Prefect's own console handler.
"""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from rollflow.config.run import config_to_toml, load_config
from rollflow.flows.prefect_log import PREFECT_LOG, prefect_log_in
from tiny_run import tiny_config_at

TESTS = Path(__file__).resolve().parent
MAX_STDERR_LINES = 20


@pytest.mark.slow  # 13 s in a loaded suite run (docs/testing.md)
def test_a_failing_train_prints_its_cause_in_a_few_lines_and_keeps_the_traceback_in_the_run_folder(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Before: 77 lines on stderr, two of Prefect's tracebacks of the same failure."""
    config = load_config(tiny_config_at(tmp_path, tiny_model_dir))
    config = replace(
        config,
        env=replace(config.env, name="broken_env:load_environment", kwargs={"broken": "step"}),
        train=replace(config.train, num_steps=1),
        validation=replace(config.validation, validation_interval=0),
        tracking=replace(config.tracking, enabled=False),
    )
    path = tmp_path / "broken.toml"
    path.write_text(config_to_toml(config))
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    env.pop("PREFECT_API_URL", None)
    env["PREFECT_LOGGING_LEVEL"] = "INFO"  # Prefect's default, as a user sees it
    done = subprocess.run(
        [sys.executable, "-m", "rollflow.flows.cli", "train", str(path), "--run-dir", str(run_dir)],
        env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    lines = done.stderr.splitlines()
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert len(lines) <= MAX_STDERR_LINES, f"{len(lines)} lines:\n{done.stderr}"
    log = run_dir / PREFECT_LOG
    last = [line for line in lines if line.startswith("rollflow train: ")]
    assert len(last) == 1, done.stderr
    assert last[0].startswith("rollflow train: step 0: all 4 episodes failed: KeyError: 'the step is broken'")
    assert last[0].endswith(f"(Prefect's log, with the traceback: {log})")
    kept = log.read_text()
    assert kept.count("Traceback (most recent call last)") >= 1
    assert "in score_stage" in kept and "StepFailedError: step 0: all 4 episodes failed" in kept


def _record(name: str, message: str) -> logging.LogRecord:
    try:
        raise ValueError("the stage broke")
    except ValueError:
        record = logging.LogRecord(name, logging.ERROR, __file__, 1, message, None, sys.exc_info())
    record.task_run_name = "scoring step 0 (train)"  # what Prefect's run loggers add
    return record


def test_the_console_loses_only_run_tracebacks_and_gets_its_format_back(tmp_path: Path) -> None:
    """Records go through the ``prefect`` logger (the file) to the root (the console), as a
    task run's do, without the API handler of ``prefect.task_runs`` (no run to send to)."""
    from prefect.logging.handlers import PrefectConsoleHandler

    stream = io.StringIO()
    console = PrefectConsoleHandler(stream=stream)
    own_format = logging.Formatter("%(name)s - %(message)s")
    console.setFormatter(own_format)
    root, prefect_logger = logging.getLogger(), logging.getLogger("prefect")
    root.addHandler(console)
    try:
        with prefect_log_in(tmp_path / PREFECT_LOG) as log:
            prefect_logger.handle(_record("prefect.task_runs", "Task run failed with exception"))
            root.handle(_record("some.library", "a library's own error"))
        shown = stream.getvalue()
        assert "prefect.task_runs - Task run failed with exception\n" in shown
        assert shown.count("Traceback (most recent call last)") == 1, shown
        assert shown.index("a library's own error") < shown.index("Traceback"), "only the library's is shown"
        kept = log.read_text()
        assert "Task run 'scoring step 0 (train)' - Task run failed with exception" in kept
        assert 'raise ValueError("the stage broke")' in kept
        assert console.formatter is own_format
        stream.seek(0)
        stream.truncate(0)
        prefect_logger.handle(_record("prefect.task_runs", "after the block"))
        assert "Traceback (most recent call last)" in stream.getvalue(), "the console's own format is back"
        assert "after the block" not in log.read_text()
    finally:
        root.removeHandler(console)
