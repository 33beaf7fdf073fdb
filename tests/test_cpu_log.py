"""The suite's opt-in CPU log (tests/conftest.py) and its report (scripts/test_cpu_report.py).

An inner pytest, with the suite's own conftest and ``ROLLFLOW_TEST_CPU_LOG`` set, runs two
tests: one spins in its own process, one in a child it waits for. Each must be charged to
itself, own CPU and children's apart, and the report must sum them by module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from repo_script import load_script

TESTS = Path(__file__).parent

INNER = '''
import subprocess
import sys
import time


def _spin(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_spins_itself():
    _spin(0.6)


def test_spins_in_a_child():
    subprocess.run([sys.executable, "-c", "import time\\nend = time.process_time() + 0.6\\nwhile time.process_time() < end: pass"], check=True)
'''


@pytest.mark.slow  # an inner pytest, ~4 s
def test_each_test_is_charged_its_own_cpu_and_its_childrens_and_the_report_sums_them(tmp_path: Path) -> None:
    (tmp_path / "test_inner.py").write_text(INNER)
    prefix = tmp_path / "cpu"
    env = {**os.environ, "ROLLFLOW_TEST_CPU_LOG": str(prefix),
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    env.pop("PYTEST_XDIST_WORKER", None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-p", "conftest",
         "--rootdir", str(tmp_path), "--basetemp", str(tmp_path / "inner"), str(tmp_path / "test_inner.py")],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "cpu.main.jsonl").read_text().splitlines()]
    spent = {line["test"].rsplit("::", 1)[-1]: line for line in lines}
    assert set(spent) == {"test_spins_itself", "test_spins_in_a_child"}
    assert spent["test_spins_itself"]["own_cpu_s"] >= 0.5 and spent["test_spins_itself"]["children_cpu_s"] < 0.1
    assert spent["test_spins_in_a_child"]["children_cpu_s"] >= 0.5 and spent["test_spins_in_a_child"]["own_cpu_s"] < 0.3

    report = load_script("scripts/test_cpu_report.py")
    rows = report.read_log(prefix)
    assert all(row.start is not None for row in rows)
    [(module, own, children, _, _)] = report.by_module(rows)
    assert module == "test_inner.py" and own >= 0.5 and children >= 0.5
    text = report.report(rows, top=5)
    assert "| `test_inner.py` |" in text and "test_spins_in_a_child" in text


def test_the_report_names_a_missing_log_and_a_bad_line(tmp_path: Path) -> None:
    report = load_script("scripts/test_cpu_report.py")
    with pytest.raises(SystemExit, match=r"no .*cpu\.\*\.jsonl: run the tests with ROLLFLOW_TEST_CPU_LOG="):
        report.read_log(tmp_path / "cpu")
    (tmp_path / "cpu.gw0.jsonl").write_text('{"test": "t.py::a", "own_cpu_s": 1}\n')
    with pytest.raises(SystemExit, match=r"cpu\.gw0\.jsonl:1: not a CPU log line"):
        report.read_log(tmp_path / "cpu")


def test_idle_cores_are_charged_to_the_tests_running_then() -> None:
    report = load_script("scripts/test_cpu_report.py")
    rows = [report.TestCpu("t.py::sleeps", 0.0, 0.0, 4.0, start=100.0),
            report.TestCpu("u.py::works", 6.0, 0.0, 3.0, start=104.0)]
    # a sample says how busy the machine was over the second before it: idle for 4 s, then busy
    timeline = [(100.0 + t, 0.0 if t <= 4 else 1.0) for t in range(0, 8)]
    report.charge_idle(rows, timeline, cores=2)
    assert rows[0].idle_core_s == pytest.approx(8.0) and rows[1].idle_core_s == pytest.approx(0.0)
    text = report.report(rows, top=5, idle=True)
    assert "| 1 | `t.py::sleeps` | 8 | 0 | 4 |" in text
    with pytest.raises(SystemExit, match="no start times"):
        report.charge_idle([report.TestCpu("old.py::x", 1.0, 0.0, 1.0)], timeline, cores=2)
