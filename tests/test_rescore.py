"""``rollflow rescore`` on a real stored tiny run: exactly the expected episodes move, a killed
rescore resumes without doubles, the run's own files stay byte-identical, refusals are clear.

The run is one train_flow on tests/rescore_env.py (a step of 2 tasks x 2 episodes, two
validation passes of 1 episode per task); each test rescores its own copy of it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rescore_env import make_changeable_run

import rollflow.ops.rescore as rescore_module
from rollflow.flows.cli import main
from rollflow.storage.derived import DerivedNameError
from rollflow.storage.runlock import RunFolderBusyError
from rollflow.storage.query import open_run_sql, run_query
from rollflow.ops.replay import replay_run
from rollflow.ops.rescore import RescoreError, rescore_run

ENV = "rescore_env:load_environment"
SAME = {"num_tasks": 4}  # the run's own kwargs

FLIPPED_SQL = """
SELECT s.episode_id
FROM scores s JOIN rescores r USING (run_id, episode_id)
WHERE r.rescore = $name AND s.passed <> r.passed
ORDER BY 1
"""
ZERO_VARIANCE_SQL = """
SELECT s.split, count(DISTINCT s.group_id) FILTER (s.zero_variance) AS before,
       count(DISTINCT r.group_id) FILTER (r.zero_variance) AS after
FROM scores s JOIN rescores r USING (run_id, episode_id)
WHERE r.rescore = $name
GROUP BY s.split ORDER BY s.split
"""


@pytest.fixture(scope="module")
def stored_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, prefect_harness: object) -> Path:
    return make_changeable_run(tmp_path_factory.mktemp("rescore-run"), tiny_model_dir)


@pytest.fixture
def run_dir(stored_run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(stored_run, tmp_path / stored_run.name))


def query(run_dir: Path, sql: str, **params: object) -> list[tuple]:
    con = open_run_sql(run_dir)
    try:
        return con.execute(sql, params).fetchall() if params else run_query(con, sql)[1]
    finally:
        con.close()


def file_hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_a_raised_pass_mark_flips_exactly_the_episodes_between_the_marks(run_dir: Path) -> None:
    rewards = sorted(r for (r,) in query(run_dir, "SELECT reward FROM scores"))
    mark = rewards[len(rewards) // 2]  # the median: some episodes fall below it, some not
    between = f"SELECT episode_id FROM scores WHERE reward >= 0.5 AND reward < {mark} ORDER BY 1"
    expected = [e for (e,) in query(run_dir, between)]  # passed the old mark of 0.5, fail the new
    assert 0 < len(expected) < len(rewards)

    summary = rescore_run(run_dir, ENV, {**SAME, "threshold": mark}, name="mark")

    assert [e for (e,) in query(run_dir, FLIPPED_SQL, name="mark")] == expected
    assert summary.rows == len(rewards) and summary.chunks_written == 3  # train 0, validation 0 and 1
    same = query(run_dir, "SELECT count(*) FROM scores s JOIN rescores r USING (run_id, episode_id) "
                          "WHERE r.reward = s.reward AND r.advantage = s.advantage "
                          "AND r.zero_variance = s.zero_variance AND r.final_reward = s.final_reward")
    assert same == [(len(rewards),)]  # only the pass mark moved: rewards and advantages stay


def test_a_flat_reward_takes_every_groups_variance(run_dir: Path) -> None:
    rescore_run(run_dir, ENV, {**SAME, "flat_reward": 1.0}, name="flat")
    # train: 2 groups of 2 with varying rewards; validation: 4 groups of 1 (zero variance)
    assert query(run_dir, ZERO_VARIANCE_SQL, name="flat") == [("train", 0, 2), ("validation", 4, 4)]
    rows = query(run_dir, "SELECT DISTINCT reward, passed, advantage FROM rescores")
    assert rows == [(1.0, True, 0.0)]
    assert query(run_dir, "SELECT count(*) FROM scores WHERE advantage <> 0") != [(0,)]


def test_a_where_filter_rescores_only_the_episodes_it_keeps(run_dir: Path) -> None:
    summary = rescore_run(run_dir, ENV, SAME, name="val1", where="split = 'validation' AND step = 1")
    assert summary.chunks_written == 1
    assert query(run_dir, "SELECT DISTINCT split, step FROM rescores") == [("validation", 1)]
    assert query(run_dir, "SELECT count(*) FROM rescores") == query(
        run_dir, "SELECT count(*) FROM episodes WHERE split = 'validation' AND step = 1"
    )


def test_a_rescore_killed_after_its_first_file_resumes_without_doubles(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = rescore_module.rescore_table
    calls = []

    def dies_on_the_second_chunk(*args: object) -> object:
        calls.append(args)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed mid-rescore")
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(rescore_module, "rescore_table", dies_on_the_second_chunk)
    with pytest.raises(KeyboardInterrupt):
        rescore_run(run_dir, ENV, {**SAME, "threshold": 0.9}, name="resumed")
    output = run_dir / "rescores" / "resumed"
    first = output / "train" / "step=000000.parquet"
    assert sorted(p.name for p in output.rglob("*.parquet")) == [first.name]
    assert not (output / "_complete.json").exists()
    first_bytes = first.read_bytes()
    (output / "validation").mkdir()
    leftover = output / "validation" / ".step=000000.parquet.tmp-1-abcd"  # a write cut short
    leftover.write_bytes(b"half")
    monkeypatch.setattr(rescore_module, "rescore_table", real)

    summary = rescore_run(run_dir, ENV, {**SAME, "threshold": 0.9}, name="resumed")

    assert (summary.chunks_skipped, summary.chunks_written) == (1, 2)
    assert first.read_bytes() == first_bytes and not leftover.exists()
    counts = query(run_dir, "SELECT count(*), count(DISTINCT episode_id) FROM rescores")
    assert counts == query(run_dir, "SELECT count(*), count(*) FROM episodes")
    marker = json.loads((output / "_complete.json").read_text())
    assert marker == {"chunks": 3, "rows": counts[0][0]}
    with pytest.raises(DerivedNameError, match="already complete"):
        rescore_run(run_dir, ENV, {**SAME, "threshold": 0.9}, name="resumed")


@pytest.mark.slow  # 6 s in a loaded suite run (docs/testing.md)
def test_a_rescore_process_killed_mid_way_resumes_without_doubles(run_dir: Path) -> None:
    kwargs = {**SAME, "threshold": 0.9, "score_delay_s": 1.0}  # each chunk takes about a second
    command = [sys.executable, "-m", "rollflow.flows.cli", "rescore", str(run_dir), "--env", ENV,
               "--kwargs", json.dumps(kwargs), "--name", "killed"]  # fmt: skip
    first = run_dir / "rescores" / "killed" / "train" / "step=000000.parquet"
    child = subprocess.Popen(command, cwd=Path(__file__).parent, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not first.exists() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    child.kill()
    _, stderr = child.communicate()
    assert child.returncode == -signal.SIGKILL, stderr.decode()[-2000:]
    assert first.exists() and not (first.parent.parent / "_complete.json").exists()

    summary = rescore_run(run_dir, ENV, kwargs, name="killed")

    assert summary.chunks_skipped >= 1 and summary.chunks_skipped + summary.chunks_written == 3
    counts = query(run_dir, "SELECT count(*), count(DISTINCT episode_id) FROM rescores")
    assert counts == query(run_dir, "SELECT count(*), count(*) FROM episodes")


@pytest.mark.slow  # 6 s in a loaded suite run (docs/testing.md)
def test_a_second_rescore_of_one_name_is_refused_while_the_first_runs(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # two seconds a chunk: the two chunks left outlast this test's two refusals on a busy machine
    kwargs = {**SAME, "threshold": 0.9, "score_delay_s": 2.0}
    command = [sys.executable, "-m", "rollflow.flows.cli", "rescore", str(run_dir), "--env", ENV,
               "--kwargs", json.dumps(kwargs), "--name", "busy"]  # fmt: skip
    first = run_dir / "rescores" / "busy" / "train" / "step=000000.parquet"
    child = subprocess.Popen(command, cwd=Path(__file__).parent, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not first.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child.poll() is None, "the first rescore ended before it could be raced"
        with pytest.raises(RunFolderBusyError, match=f"PID {child.pid}"):
            rescore_run(run_dir, ENV, kwargs, name="busy")
        capsys.readouterr()
        assert main(command[3:]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"'busy' is being written by another rollflow process (PID {child.pid})" in err
    finally:
        child.kill()
        child.communicate()
    summary = rescore_run(run_dir, ENV, kwargs, name="busy")  # the kernel freed the lock with the process
    assert summary.chunks_skipped >= 1


def test_the_runs_own_files_are_byte_identical_after_a_rescore_and_a_replay(run_dir: Path) -> None:
    before = file_hashes(run_dir)
    rescore_run(run_dir, ENV, {**SAME, "flat_reward": 0.0})
    replay_run(run_dir, ENV, {**SAME, "changed_turn": 1})
    after = file_hashes(run_dir)
    added = sorted(set(after) - set(before))
    assert {k: after[k] for k in before} == before
    assert added and all(p.split("/")[0] in ("rescores", "replays") for p in added)


def test_refusals_name_the_problem(run_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "not-a-run").mkdir()
    with pytest.raises(RescoreError, match="not a run folder"):
        rescore_run(tmp_path / "not-a-run", ENV, SAME)
    with pytest.raises(RescoreError, match=r"train tasks lack 2 of the run's 2 task ids \('say-2', 'say-3'\)"):
        rescore_run(run_dir, ENV, {"num_tasks": 2})  # the run's train tasks are say-2 and say-3
    with pytest.raises(RescoreError, match="--where 'no_such_column = 1'"):
        rescore_run(run_dir, ENV, SAME, where="no_such_column = 1")
    with pytest.raises(DerivedNameError, match="must be letters"):
        rescore_run(run_dir, ENV, SAME, name="../elsewhere")
    rescore_run(run_dir, ENV, SAME, name="taken")
    with pytest.raises(DerivedNameError, match=r"already used with other settings: kwargs"):
        rescore_run(run_dir, ENV, {**SAME, "threshold": 0.7}, name="taken")
    assert not (run_dir / "rescores" / "elsewhere").exists() and not (run_dir.parent / "elsewhere").exists()


def test_the_command_line_rescores_and_refuses_in_one_line(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["rescore", str(run_dir), "--env", ENV, "--kwargs", '{"num_tasks": 4, "threshold": 0.9}', "--name", "cli"]
    assert main(args) == 0
    episodes = len(query(run_dir, "SELECT * FROM episodes"))
    assert f"rescore cli: {episodes} episodes in 3 files" in capsys.readouterr().out
    assert main(args) == 1
    assert "already complete" in capsys.readouterr().err
    assert main(["rescore", str(run_dir), "--env", ENV, "--kwargs", "[1]"]) == 1
    assert "--kwargs must be a JSON object" in capsys.readouterr().err
