"""The overhead bench: its plain loop runs exactly the flow's stages, and its report's arithmetic."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from rollflow.storage.query import open_run_sql, run_query
from rollflow.storage.runfolder import RunFolder
from repo_script import load_script
from rollflow.config.run import config_to_toml

def _load_bench() -> ModuleType:
    return load_script("bench/pipeline_overhead.py")


def _episodes(run_dir: Path) -> list[tuple]:
    con = open_run_sql([run_dir])
    _, rows = run_query(con, "SELECT split, step, episode_id, response_text FROM episodes ORDER BY ALL")
    return rows


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_harness")
def test_plain_loop_writes_what_the_flow_writes(tmp_path: Path) -> None:
    """Same stages, same order, same seeds: the two modes must produce the same run."""
    bench = _load_bench()
    config = bench.bench_config(tmp_path, steps=2, bundled=False)
    assert not config.tracking.enabled
    path = tmp_path / "bench.toml"
    path.write_text(config_to_toml(config))
    bench.plain_training(path, tmp_path / "plain")
    bench.time_run("flow", path, tmp_path / "flow")
    plain = RunFolder(tmp_path / "plain")
    for step in (0, 1):
        assert (plain.step_dir(step) / "metrics.json").exists()
        assert plain.read_train_result(step).policy_version == step + 1
    for step in (0, 2):  # validation_interval 2: the baseline and after the last step
        assert (plain.step_dir(step, "validation") / "metrics.json").exists()
    plain_episodes = _episodes(tmp_path / "plain")
    assert len(plain_episodes) == 2 * (2 * 4) + 2 * 4  # 2 steps x 2 groups x 4, 2 validations x 4
    assert plain_episodes == _episodes(tmp_path / "flow")


def test_report_gives_overhead_per_step_and_as_a_share(capsys: pytest.CaptureFixture[str]) -> None:
    bench = _load_bench()
    config = bench.RunConfig()
    timings = [bench.Timing("flow", 12.0), bench.Timing("plain", 10.0),
               bench.Timing("flow", 14.0), bench.Timing("plain", 10.0)]
    bench.report(timings, steps=4, server_s=5.0, config=config)
    out = capsys.readouterr().out
    assert "(2.50 s/step)" in out  # plain: 10 s over 4 steps
    assert "(3.25 s/step)" in out  # flow: median of 12 and 14 = 13 s over 4 steps
    assert "750 ms/step = 30.0% of step time" in out  # (13 - 10) / 4 steps; 3 / 10
