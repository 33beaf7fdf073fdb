"""``rollflow sql``, ``show`` and ``runs``: readable output, script formats, one-line errors."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rollflow.flows.cli import COMMANDS, Command, build_parser, format_table, main, register
from rollflow.storage.records import TrainResult
from rollflow.storage.runfolder import RunFolder
from rollflow.storage.schemas import episode_records_to_table, score_records_to_table
from rollflow.storage.synthetic import synthetic_episode, synthetic_score


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    for name, steps in (("run-a", 2), ("run-b", 1)):
        folder = RunFolder(tmp_path / "runs" / name)
        folder.write_config("[train]\nnum_steps = 4\n")
        for step in range(steps):
            episodes = [synthetic_episode(name, step, t, i) for t in range(2) for i in range(2)]
            folder.write_stage(episode_records_to_table(episodes), step, "episodes")
            folder.write_stage(score_records_to_table([synthetic_score(e, 1.0) for e in episodes]), step, "scores")
    return tmp_path / "runs"


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_sql_prints_an_aligned_table(runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sql = "SELECT step, count(*) AS n, avg(latency_s) AS latency FROM episodes GROUP BY step ORDER BY step"
    code, out, err = _run(capsys, "sql", str(runs / "run-a"), sql)
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        "step  n  latency",
        "----  -  -------",
        "   0  4     0.26",
        "   1  4     0.26",
        "(2 rows)",
    ]


def test_sql_csv_and_json_for_scripts(runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sql = "SELECT episode_id, error, env_metrics FROM episodes WHERE step = 0 ORDER BY episode_id LIMIT 3"
    code, out, _ = _run(capsys, "sql", str(runs / "run-a"), sql, "--format", "csv")
    rows = list(csv.reader(io.StringIO(out)))
    assert code == 0 and rows[0] == ["episode_id", "error", "env_metrics"]
    assert rows[1] == ["train/0/0/0", "", '{"tool_calls": 1.0}']
    assert rows[3][1] == "RuntimeError: the environment fell over" and len(rows) == 4
    code, out, _ = _run(capsys, "sql", str(runs / "run-a"), sql, "--format", "json")
    records = json.loads(out)
    assert records[0] == {"episode_id": "train/0/0/0", "error": None, "env_metrics": {"tool_calls": 1.0}}


def test_sql_over_a_glob_of_runs(runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sql = "SELECT run_id, count(*) AS n FROM scores GROUP BY 1 ORDER BY 1"
    code, out, _ = _run(capsys, "sql", str(runs / "*"), sql, "--format", "csv")
    assert out.splitlines() == ["run_id,n", "run-a,8", "run-b,4"]


def test_sql_without_a_query_lists_views(runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "sql", str(runs / "run-a"))
    assert code == 0
    assert "episodes (8 rows)" in out and "scores (8 rows)" in out
    assert "samples (0 rows)" in out and "steps (0 rows)" in out
    assert any(line.split() == ["truncation_cause", "VARCHAR"] for line in out.splitlines())


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["sql", "{runs}/run-a", "DELETE FROM episodes"], "refused: DELETE statements"),
        (["sql", "{runs}/run-a", "COPY episodes TO 'x.csv'"], "refused: COPY statements"),
        (["sql", "{runs}/missing", "SELECT 1"], "no such run folder"),
        (["sql", "{runs}/run-a", "SELECT nope FROM episodes"], 'column "nope" not found'),
        (["show", "{runs}/run-a", "train/9/9/9"], "no episode 'train/9/9/9'"),
        (["runs", "--runs-dir", "{runs}/none"], "no such folder"),
    ],
)
def test_user_errors_are_one_line_on_stderr(
    runs: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, out, err = _run(capsys, *[a.format(runs=runs) for a in argv])
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"rollflow {argv[0]}: ")
    assert message in err and "Traceback" not in err


def test_show_prints_the_transcript(runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "show", str(runs / "run-a"), "train/1/0/1")
    assert code == 0
    assert out.startswith("Episode train/1/0/1\n")
    assert "[tool calculator] (reply to call_0_1)" in out and "Ended: terminated" in out


def test_runs_lists_status_and_last_step(runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = TrainResult("run-a", 0, 1, 0.1, None, 0.0, 1.0, 4, 100, 10, 1e-5, 5.0, {})
    folder = RunFolder(runs / "run-a")
    folder.write_train_result(result)
    folder.write_json_atomic(folder.step_paths(0).metrics_json, {})  # written last: step 0 is finished
    code, out, _ = _run(capsys, "runs", "--runs-dir", str(runs))
    lines = out.splitlines()
    assert code == 0 and lines[0].split()[:2] == ["run", "status"]
    assert "run-a  stopped unexpectedly at step 1 of 4, stage samples" in lines[2]  # no exit recorded
    assert "run-b  stopped unexpectedly at step 0 of 4, stage samples" in lines[3]
    assert lines[2].split("stage samples")[1].split()[0] == "0"  # last finished step of run-a
    assert lines[2].rstrip().endswith("out of memory, or the machine stopped")  # the notes say why
    assert lines[-1] == "(2 rows)"


def test_format_table_aligns_and_clips() -> None:
    text = format_table(["name", "x"], [["a", 1.5], ["long\nline" + "z" * 100, None]])
    lines = text.splitlines()
    assert lines[2].endswith(" 1.5") and lines[3].endswith("NULL")
    assert "long\\nline" in lines[3] and "…" in lines[3] and len(lines[3]) < 100
    assert format_table(["x"], []).splitlines()[-1] == "(0 rows)"


def test_subcommands_come_from_the_registry() -> None:
    assert {"sql", "show", "runs"} <= set(COMMANDS)
    with pytest.raises(ValueError, match="registered twice"):
        register(Command("sql", "again", lambda p: None, lambda a: 0))
    args = build_parser().parse_args(["sql", "runs/x", "SELECT 1", "--format", "json"])
    assert (args.command, args.query, args.format) == ("sql", "SELECT 1", "json")


def test_console_script_entry_point(runs: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "rollflow.flows.cli", "sql", str(runs / "run-b"), "SELECT count(*) AS n FROM episodes"],
        capture_output=True, text=True, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[2].strip() == "4"
