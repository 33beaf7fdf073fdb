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
from collections.abc import Iterator
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
    # once, not 5 times (Prefect's task and flow runs each said it twice: newcomer F14)
    assert done.stderr.count("all 4 episodes failed") == 1, done.stderr
    assert not [line for line in lines if "Task run" in line and "Completed()" in line], done.stderr  # one per stage
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


# ---------------------------------------------------------------- what reaches the console (newcomer F12, F14)

# What Prefect's engines log, in order, for a task whose exception ends its flow.
FAILURE_CASCADE = (
    ("prefect.task_runs", "Task run failed with exception: StepFailedError('all 4 episodes failed')"),
    ("prefect.task_runs", "Finished in state Failed('Task run encountered an exception StepFailedError: ...')"),
    ("prefect.flow_runs", "Encountered exception during execution: StepFailedError('all 4 episodes failed')"),
    ("prefect.flow_runs", "Finished in state Failed('Flow run encountered an exception: StepFailedError: ...')"),
)


@pytest.fixture
def console() -> Iterator[io.StringIO]:
    """Prefect's console handler on the root logger, writing to the stream yielded."""
    from prefect.logging.handlers import PrefectConsoleHandler

    stream = io.StringIO()
    handler = PrefectConsoleHandler(stream=stream)
    handler.setFormatter(logging.Formatter("%(name)s - %(message)s"))
    logging.getLogger().addHandler(handler)
    try:
        yield stream
    finally:
        logging.getLogger().removeHandler(handler)


def _log(name: str, message: str) -> None:
    record = _record(name, message)
    record.flow_run_name = "fuzzy-carp"  # what Prefect's flow-run logger adds
    logging.getLogger("prefect").handle(record)


def test_a_failure_that_ends_the_command_is_left_to_its_one_line(console: io.StringIO, tmp_path: Path) -> None:
    """The newcomer saw the buggy environment's error 5 times: Prefect's 4, then the command's."""
    with pytest.raises(RuntimeError, match="the flow failed"):
        with prefect_log_in(tmp_path / PREFECT_LOG) as log:
            _log("prefect.flow_runs", "Beginning flow run 'x' for flow 'rollflow-train'")
            for name, message in FAILURE_CASCADE:
                _log(name, message)
            raise RuntimeError("the flow failed")  # what the command then prints in one line
    shown = console.getvalue()
    assert shown == "prefect.flow_runs - Beginning flow run 'x' for flow 'rollflow-train'\n", shown
    kept = log.read_text()
    assert all(message in kept for _, message in FAILURE_CASCADE), kept


def test_a_failure_the_run_goes_on_from_is_shown_before_what_follows(console: io.StringIO, tmp_path: Path) -> None:
    """Nothing is hidden where the flow handled the failure: held until the run logs on."""
    with prefect_log_in(tmp_path / PREFECT_LOG):
        _log(*FAILURE_CASCADE[0])
        _log("prefect.task_runs", "Task run failed with exception: OSError() - Retry 1/3 will start 10 second(s) from now")
        _log("prefect.flow_runs", "validation step 0 done")
        _log(*FAILURE_CASCADE[1])
    lines = console.getvalue().splitlines()
    assert lines == [
        f"prefect.task_runs - {FAILURE_CASCADE[0][1]}",  # in order: a retry is the run going on
        "prefect.task_runs - Task run failed with exception: OSError() - Retry 1/3 will start 10 second(s) from now",
        "prefect.flow_runs - validation step 0 done",
        f"prefect.task_runs - {FAILURE_CASCADE[1][1]}",  # the block ended without an error: shown at its end
    ], lines


def test_stages_finishing_and_a_stop_crashing_them_stay_off_the_console(console: io.StringIO, tmp_path: Path) -> None:
    """Every stage's 'Completed()' line, and Ctrl-C's 'Crash detected!' lines (4 of them on
    the newcomer's console), go to the run folder's log only."""
    import signal

    from rollflow.policy.stopping import clear_stop, request_stop

    crash = "Crash detected! Execution was aborted by Python system exit call."
    with prefect_log_in(tmp_path / PREFECT_LOG) as log:
        _log("prefect.task_runs", "Finished in state Completed()")
        _log("prefect.flow_runs", "Finished in state Completed()")
        request_stop(signal.SIGINT)
        try:
            _log("prefect.task_runs", crash)
            _log("prefect.flow_runs", crash)
        finally:
            clear_stop()
    assert console.getvalue() == "prefect.flow_runs - Finished in state Completed()\n", console.getvalue()
    assert log.read_text().count(crash) == 2 and log.read_text().count("Completed()") == 2
