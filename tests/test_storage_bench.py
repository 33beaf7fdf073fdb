"""The storage benchmark runs end to end on a tiny run and reports every figure."""

from __future__ import annotations

from pathlib import Path

import pytest

from repo_script import load_script
from rollflow.storage.runfolder import RunFolder

def _load_bench():
    return load_script("bench/storage_bench.py")


def test_bench_writes_a_run_and_times_the_queries(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = _load_bench()
    assert bench.main(["--episodes", "48", "--steps", "3", "--group-size", "4", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for label in ("write total", "episodes.parquet", "scores.parquet", "step_metrics", "metrics_by_step"):
        assert label in out
    folder = RunFolder(tmp_path / "bench-run")
    assert folder.steps() == [0, 1, 2]
    assert folder.read_stage(1, "episodes").num_rows == 16
    assert folder.is_complete(2, "scores")


def test_bench_refuses_uneven_steps() -> None:
    with pytest.raises(SystemExit):
        _load_bench().main(["--episodes", "10", "--steps", "3"])
