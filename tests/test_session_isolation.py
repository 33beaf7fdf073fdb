"""Each pytest worker keeps its Prefect home and MLflow store to itself (tests/conftest.py).

xdist starts its workers from the controller, which has run the suite's conftest already: a
setting the conftest only defaulted (``os.environ.setdefault``) came to every worker with
the controller's value. The MLflow store did: all workers shared the controller's SQLite
file, two of them migrated it at once on their first runs, and a run failed with "duplicate
column name: step" (seen 2026-12-05 running test_flow_train.py on two workers). Here an inner
pytest on two workers, with the suite's own conftest, records what each worker was given.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

INNER = '''
import json, os
from pathlib import Path

import conftest


def test_records_its_settings():
    out = Path(os.environ["ISOLATION_OUT"]) / (os.environ.get("PYTEST_XDIST_WORKER", "main") + ".json")
    out.write_text(json.dumps({"session": conftest._SESSION_HOME, "mlflow": os.environ["MLFLOW_TRACKING_URI"],
                               "prefect": os.environ["PREFECT_HOME"]}))
'''


@pytest.mark.slow  # an inner pytest on two workers, ~6 s
def test_each_worker_has_its_own_mlflow_store_and_prefect_home(tmp_path: Path) -> None:
    for name in ("test_a.py", "test_b.py"):
        (tmp_path / name).write_text(INNER)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "ISOLATION_OUT": str(out),
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "MLFLOW_TRACKING_URI", "PREFECT_HOME",
                 "ROLLFLOW_TEST_CPU_LOG"):
        env.pop(name, None)  # as a pytest started from a shell has them (and no lines in the suite's CPU log)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest", "-n", "2",
         "--dist", "loadfile", "--rootdir", str(tmp_path), str(tmp_path / "test_a.py"), str(tmp_path / "test_b.py")],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    seen = {path.stem: json.loads(path.read_text()) for path in out.glob("*.json")}
    assert set(seen) == {"gw0", "gw1"}, seen
    for worker in seen.values():
        assert worker["mlflow"] == f"sqlite:///{worker['session']}/mlflow.db", worker
        assert worker["prefect"] == os.path.join(worker["session"], "prefect"), worker
    assert seen["gw0"]["session"] != seen["gw1"]["session"]
