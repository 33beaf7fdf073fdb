"""The MLflow UI shows a run's validation episodes as traces, in a real headless browser.

A real ``mlflow server`` on a free loopback port serves the test's SQLite store, with one
validation pass logged as traces (storage/traces.py); Debian's Chromium (installed by
``make browser``, which ``make test`` runs) renders the run's Traces tab, and the rendered page must list every
logged episode and show one's opening question. The server is stopped whatever happens.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prefect_server import background, free_port, tail, wait_for

from test_traces import mlflow_run, validation_pass

from rollflow.storage.traces import TraceSelection, log_validation_traces

pytestmark = pytest.mark.slow

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


MISSING_CHROMIUM = ("Debian's chromium is not installed: run `make browser` (`make test` runs it), "
                    "or apt-get install chromium")


def rendered_dom(url: str, profile: Path) -> str:
    chromium = shutil.which("chromium")
    assert chromium, MISSING_CHROMIUM
    done = subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=30000",
                           "--dump-dom", url], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _shm_folders() -> set[str]:
    """The temporary folders in /dev/shm (``tempfile.mkdtemp`` names)."""
    shm = Path("/dev/shm")
    return {p.name for p in shm.glob("tmp*") if p.is_dir()} if shm.is_dir() else set()


def test_the_runs_traces_tab_lists_the_validation_episodes(tmp_path: Path) -> None:
    uri, _, experiment, run_id = mlflow_run(tmp_path)
    episodes, scores = validation_pass(6)
    pass_dir = tmp_path / "validation" / "step=000005"
    pass_dir.mkdir(parents=True)
    ids = log_validation_traces(uri, experiment, run_id, pass_dir, episodes, scores, TraceSelection(2, 2, 1))
    assert len(ids) == 5

    port = free_port()
    mlflow = str(Path(sys.executable).parent / "mlflow")
    command = [mlflow, "server", "--backend-store-uri", uri, "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    log = tmp_path / "mlflow-server.log"
    # Without its job runner (scorers, prompt optimization: not what the page needs): the
    # runner's queue is a folder MLflow makes in /dev/shm and leaves there, one a test run
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    shm_before = _shm_folders()
    with background(command, env=env, log=log, cwd=tmp_path):

        def healthy() -> bool | None:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200 or None
            except httpx.HTTPError:
                return None

        wait_for(healthy, 300, "mlflow server's /health", log)
        dom = rendered_dom(f"http://127.0.0.1:{port}/#/experiments/{experiment}/runs/{run_id}/traces", tmp_path / "chromium")
    assert "5 of 5" in dom, f"the trace list did not render:\n{dom[-3000:]}\n{tail(log)}"
    assert _shm_folders() - shm_before == set(), "the MLflow server left a folder in /dev/shm"
    best = next(e for e in episodes if e.episode_id == "validation/5/5/0")
    assert best.rollout.messages[1]["content"] in dom  # the episode's opening question is on the page


def test_the_missing_chromium_hint_names_the_make_target_that_installs_it() -> None:
    target = MISSING_CHROMIUM.split("`make ")[1].split("`")[0]
    makefile = (Path(__file__).resolve().parent.parent / "Makefile").read_text()
    recipe = makefile.split(f"\n{target}:", 1)[1].split("\n\n", 1)[0]
    assert "apt-get install" in recipe and "chromium" in recipe, (target, recipe)
