"""scripts/cpu_by_kind.py: the kinds of process it tells apart, and a measured command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from repo_script import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "cpu_by_kind.py"


@pytest.mark.parametrize(
    ("command", "parent", "kind"),
    [
        ("/r/.venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model m", "pytest", "vllm-api"),
        ("/r/.venv-vllm/bin/python -c from multiprocessing.spawn import spawn_main", "vllm-api", "vllm-engine"),
        ("/r/.venv/bin/python -m uvicorn --factory prefect.server.api.server:create_app", "rollflow-run", "prefect-server"),
        ("/r/.venv/bin/python -m rollflow.flows.cli train c.toml", "pytest", "rollflow-run"),
        ("/r/.venv/bin/python /r/.venv/bin/rollflow resume runs/x", "other", "rollflow-run"),
        ("/r/.venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --node", "rollflow-run", "ray"),
        ("/r/.venv/bin/python /r/.venv/bin/prefect worker start --pool p", "pytest", "prefect-cli"),
        ("/r/.venv/bin/python -m pytest -n 2", None, "pytest"),
        ('/r/.venv/bin/python -c import sys;exec(eval(sys.stdin.readline()))', "pytest", "pytest"),
        ("/usr/bin/sleep 5", "rollflow-run", "rollflow-run"),
        ("/usr/bin/sleep 5", "other", "other"),
        ("/usr/bin/sleep 5", None, "other"),
    ],
)
def test_each_process_gets_its_kind_from_its_command_or_its_parent(command: str, parent: str | None, kind: str) -> None:
    assert load_script("scripts/cpu_by_kind.py").kind_of(command, parent) == kind


@pytest.mark.slow  # a second or two of sampling
def test_a_measured_command_has_its_cpu_its_status_and_the_machines_share(tmp_path: Path) -> None:
    spin = "import time\nend = time.process_time() + 1.5\nwhile time.process_time() < end: pass\nraise SystemExit(3)"
    out = tmp_path / "cpu.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--json", str(out), "--", sys.executable, "-c", spin],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 3, done.stderr  # the command's own status
    figures = json.loads(out.read_text())
    assert figures["exit_status"] == 3 and figures["wall_s"] >= 1.5
    # the spinning child is seen under its parent's kind (this test's process: pytest)
    assert sum(figures["cpu_s_by_kind"].values()) >= 1.0, figures
    assert 0 < figures["machine_busy_share"] <= 1 and figures["min_available_gib"] > 0
    # a second by second busy share, in time order, the spinning seconds busy
    timeline = figures["busy_timeline"]
    assert len(timeline) >= 2 and [t for t, _ in timeline] == sorted(t for t, _ in timeline)
    assert all(0 <= share <= 1 for _, share in timeline) and max(share for _, share in timeline) > 0.3
    assert "busy_timeline" not in done.stderr and "processes\"" not in done.stderr  # printed figures stay short
    # the spinning process by name, with all its CPU (read after it exited, before it was reaped),
    # and counted among the processes started
    (spinner,) = [p for p in figures["processes"] if "process_time" in p["command"]]
    assert spinner["cpu_s"] >= 1.45 and spinner["kind"] in figures["processes_by_kind"], figures["processes"]
    assert [p["cpu_s"] for p in figures["processes"]] == sorted((p["cpu_s"] for p in figures["processes"]), reverse=True)
