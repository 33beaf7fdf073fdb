"""SQL over run folders: the views, every metric against a hand count, and no writes."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rollflow.envs.episode import ActionTokens, EpisodeRollout
from rollflow.envs.types import TruncationCause
from rollflow.storage.arrow_schemas import VERSION_KEY
from rollflow.storage.errors import CorruptFileError, NoDataError, SchemaVersionError, StorageError
from rollflow.storage.parquet import temporary_path
from rollflow.storage.query import QueryError, ReadOnlyQueryError, describe_views, open_run_sql, run_query
from rollflow.storage.records import SCHEMA_VERSION, EpisodeRecord, ScoreRecord, TrainResult
from rollflow.storage.runfolder import RunFolder
from rollflow.storage.schemas import episode_records_to_table, score_records_to_table
from rollflow.storage.step_metrics import METRIC_NAMES, metrics_by_step, step_metrics
from rollflow.storage.synthetic import synthetic_episode, synthetic_score

MAX_TURNS, OVERFLOW, ENV, PARSE = (
    TruncationCause.MAX_TURNS, TruncationCause.CONTEXT_OVERFLOW, TruncationCause.ENV, TruncationCause.PARSE_FAILURE,
)

# group, index, ending ("term" / a cause / "error"), turns, tokens, final reward, threshold, scoring error
STEP_1 = [
    ("A", 0, "term", 1, 10, 1.0, 1.0, None),
    ("A", 1, "term", 2, 20, 0.0, 1.0, None),
    ("A", 2, MAX_TURNS, 3, 30, -0.5, 1.0, None),
    ("A", 3, "error", 1, 5, 0.0, 1.0, "RuntimeError: boom"),  # errored: scoring copies it
    ("B", 0, OVERFLOW, 2, 40, 0.5, None, None),  # no threshold: passes when > 0
    ("B", 1, PARSE, 1, 8, -0.1, None, None),
    ("B", 2, ENV, 2, 12, 0.0, None, "ValueError: no answer"),  # scoring failed: not counted
    ("C", 0, "term", 1, 6, 1.0, 1.0, None),
    ("C", 1, "term", 1, 4, 1.0, 1.0, None),  # group C: all equal
]
COUNTED_FINAL = [1.0, 0.0, -0.5, 0.5, -0.1, 1.0, 1.0]


def _episode(run: str, step: int, split: str, row: tuple) -> EpisodeRecord:
    group, index, ending, turns, tokens, *_ = row
    cause = ending if isinstance(ending, TruncationCause) else None
    action = ActionTokens(tuple(range(tokens - 2)), False, (1, 2), (-0.5, -0.25), "stop")
    rollout = EpisodeRollout(
        messages=({"role": "user", "content": f"task {group}"}, {"role": "assistant", "content": "ok"}),
        response_text="ok",
        turns=turns,
        terminated=ending == "term",
        truncated=cause is not None,
        truncation_cause=cause,
        error="RuntimeError: boom" if ending == "error" else None,
        actions=(action,),
    )
    group_id = f"{split}/{step}/{group}"
    return EpisodeRecord(run, step, split, f"task-{group}", group_id, f"{group_id}/{index}", index, rollout)


def _score(episode: EpisodeRecord, row: tuple, passed: bool | None) -> ScoreRecord:
    """``passed`` None: as the environment would say if its reward were ``final``."""
    final, threshold, error = row[5], row[6], row[7]
    if passed is None:
        passed = error is None and (final > 0 if threshold is None else final >= threshold)
    score = synthetic_score(episode, final)
    return dataclasses.replace(score, threshold=threshold, scoring_error=error, passed=passed)


def _write_step(
    folder: RunFolder, step: int, rows: list[tuple], split: str = "train", scores: bool = True,
    passed: list[bool] | None = None,
) -> None:
    episodes = [_episode(folder.run_id, step, split, r) for r in rows]
    folder.write_stage(episode_records_to_table(episodes), step, "episodes", split)
    if scores:
        verdicts = passed if passed is not None else [None] * len(rows)
        records = [_score(e, r, p) for e, r, p in zip(episodes, rows, verdicts, strict=True)]
        folder.write_stage(score_records_to_table(records), step, "scores", split)


@pytest.fixture
def run(tmp_path: Path) -> RunFolder:
    folder = RunFolder(tmp_path / "runs" / "run-a")
    folder.write_config("[train]\nnum_steps = 3\n")
    _write_step(folder, 1, STEP_1)
    all_good = [("A", i, "term", 1, 10, 1.0, 1.0, None) for i in range(2)]
    _write_step(folder, 0, all_good)
    _write_step(folder, 10, [("V", 0, PARSE, 4, 100, -1.0, 1.0, None)], split="validation")
    folder.write_train_result(TrainResult("run-a", 0, 1, 0.25, None, 0.1, 2.0, 2, 40, 4, 1e-5, 5.0, {"fwd": 1.0}))
    return folder


def test_every_metric_matches_a_hand_count(run: RunFolder) -> None:
    metrics = step_metrics(open_run_sql(run.root), step=1)
    mean = sum(COUNTED_FINAL) / 7
    expected = {
        "num_episodes": 9.0,
        "num_groups": 3.0,
        "terminated_ratio": 4 / 9,
        "truncated_ratio": 4 / 9,
        "context_overflow_ratio": 1 / 9,
        "max_turns_ratio": 1 / 9,
        "env_truncated_ratio": 1 / 9,
        "parse_failure_ratio": 1 / 9,
        "error_ratio": 1 / 9,
        "turns_mean": 14 / 9,
        "tokens_mean": 135 / 9,
        "reward_mean": mean,
        "reward_std": math.sqrt(sum((r - mean) ** 2 for r in COUNTED_FINAL) / 7),
        "reward_min": -0.5,
        "reward_max": 1.0,
        "pass_rate": 4 / 9,  # A0, B0 (> 0 with no threshold), C0, C1; the two errored ones failed
        "zero_variance_skip_ratio": 1 / 3,  # group C only
        "tool_calls": 0.0,
        "tool_errors": 0.0,
    }
    assert list(metrics) == list(METRIC_NAMES)
    assert metrics == pytest.approx(expected, abs=1e-12)


def test_groups_with_fewer_than_two_counted_are_zero_variance(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "run")
    rows = [
        ("X", 0, "term", 1, 10, 0.5, 1.0, None),
        ("X", 1, "error", 1, 10, 0.0, 1.0, "RuntimeError: boom"),
        ("Y", 0, "error", 1, 10, 0.0, 1.0, "RuntimeError: boom"),
        ("Z", 0, "term", 1, 10, 1.0, 1.0, None),
        ("Z", 1, "term", 1, 10, 0.0, 1.0, None),
    ]
    _write_step(folder, 0, rows)
    metrics = step_metrics(open_run_sql(folder.root), step=0)
    assert metrics["zero_variance_skip_ratio"] == pytest.approx(2 / 3)  # X (one counted), Y (none)
    assert metrics["reward_mean"] == pytest.approx(0.5)  # X0, Z0, Z1
    assert metrics["pass_rate"] == pytest.approx(1 / 5)  # Z0 of all five: errored episodes failed


def test_pass_rate_is_the_scored_verdict_not_the_shaped_reward(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "run")
    rows = [
        ("P", 0, MAX_TURNS, 1, 10, 0.4, 1.0, None),  # passed (env reward 1.0), final 0.4 after the penalty
        ("P", 1, PARSE, 1, 10, 2.0, 1.0, None),  # failed_parse_reward 2.0 is no pass
        ("P", 2, "term", 1, 10, 1.0, 1.0, None),
        ("P", 3, MAX_TURNS, 1, 10, 0.3, 1.0, None),  # passed too
    ]
    _write_step(folder, 0, rows, passed=[True, False, True, True])
    assert step_metrics(open_run_sql(folder.root), step=0)["pass_rate"] == pytest.approx(3 / 4)


def test_the_pass_rate_counts_errored_episodes_as_failures_as_the_closing_summary_does(tmp_path: Path) -> None:
    """One pass rate: ``val/reward/pass_rate`` (this SQL) and the run's closing line
    (``ops/run_summary.py``, per task over the scores file) agree when a pass has errors."""
    from rollflow.tasks.gate_rule import episodes_by_task, per_task

    folder = RunFolder(tmp_path / "run")
    rows = [
        ("V", 0, "term", 1, 10, 1.0, 1.0, None),
        ("V", 1, "error", 1, 10, 0.0, 1.0, "RuntimeError: boom"),
        ("W", 0, "term", 1, 10, 0.0, 1.0, None),
        ("W", 1, "term", 1, 10, 1.0, 1.0, "ValueError: the scorer raised"),
    ]
    _write_step(folder, 0, rows, split="validation")
    sql = step_metrics(open_run_sql(folder.root), step=0, split="validation")["pass_rate"]
    by_task = per_task(episodes_by_task([folder.stage_path(0, "scores", "validation")], ("passed",)), "passed")
    assert sql == pytest.approx(1 / 4) == pytest.approx(sum(by_task.values()) / len(by_task))


def test_tokens_mean_is_the_final_context_length(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "run")
    base = _episode("run", 0, "train", ("T", 0, "term", 4, 10, 1.0, 1.0, None))
    first = ActionTokens(tuple(range(1100)), False, (1,) * 50, (-0.5,) * 50, "stop")
    again = ActionTokens(tuple(range(1100)), True, (1,) * 50, (-0.5,) * 50, "stop")  # re-rendered
    rerendered = dataclasses.replace(base.rollout, actions=(first, again, again, again))
    record = dataclasses.replace(base, rollout=rerendered)
    folder.write_stage(episode_records_to_table([record]), 0, "episodes", "train")
    con = open_run_sql(folder.root)
    assert step_metrics(con, step=0)["tokens_mean"] == 1150.0  # not the 4,600 processed
    sql = "SELECT context_tokens, prompt_tokens, completion_tokens, total_tokens FROM episodes"
    assert run_query(con, sql)[1] == [(1150, 1100, 200, 4600)]


def test_steps_and_splits_are_kept_apart(run: RunFolder) -> None:
    con = open_run_sql(run.root)
    assert step_metrics(con, step=0)["zero_variance_skip_ratio"] == 1.0
    assert step_metrics(con, step=0)["pass_rate"] == 1.0
    latest = step_metrics(con)  # no step: the latest with episodes
    assert latest["num_episodes"] == 9.0
    val = step_metrics(con, split="validation")
    assert (val["num_episodes"], val["parse_failure_ratio"], val["reward_mean"]) == (1.0, 1.0, -1.0)
    assert list(metrics_by_step(con)) == [0, 1]
    assert metrics_by_step(con)[1] == step_metrics(con, step=1)


def test_views_carry_run_step_and_split(run: RunFolder) -> None:
    con = open_run_sql(run.root)
    _, rows = run_query(con, "SELECT run_id, split, step, count(*) FROM episodes GROUP BY ALL ORDER BY ALL")
    assert rows == [("run-a", "train", 0, 2), ("run-a", "train", 1, 9), ("run-a", "validation", 10, 1)]
    _, rows = run_query(con, "SELECT run_id, step, loss, timings['fwd'] FROM steps")
    assert rows == [("run-a", 0, 0.25, 1.0)]
    columns = describe_views(con)
    # every view a query can name is listed (the newcomer's item 14: the derived ones were not)
    assert list(columns)[:5] == ["episodes", "scores", "samples", "teacher", "steps"]
    assert {"admissions", "rescores", "replays", "pass_at_k", "task_pass_at_k"} <= set(columns), set(columns)
    assert ("split", "VARCHAR") in columns["samples"]  # added from the folder
    _, rows = run_query(con, "SELECT count(*) FROM samples")
    assert rows == [(0,)]  # no samples stage anywhere: empty, still queryable


def test_messages_unnest(run: RunFolder) -> None:
    sql = "SELECT m.role, count(*) FROM (SELECT unnest(messages) AS m FROM episodes) GROUP BY 1 ORDER BY 1"
    assert run_query(open_run_sql(run.root), sql)[1] == [("assistant", 12), ("user", 12)]


def test_reward_metrics_are_nan_before_scoring(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "run")
    _write_step(folder, 0, STEP_1, scores=False)
    metrics = step_metrics(open_run_sql(folder.root), step=0)
    assert metrics["num_episodes"] == 9.0
    assert all(math.isnan(metrics[k]) for k in ("reward_mean", "pass_rate", "zero_variance_skip_ratio"))


def test_missing_data_is_a_clear_error(run: RunFolder, tmp_path: Path) -> None:
    with pytest.raises(NoDataError, match="no episodes for train step 7"):
        step_metrics(open_run_sql(run.root), step=7)
    empty = RunFolder(tmp_path / "empty")
    empty.write_config("")
    con = open_run_sql(empty.root)
    assert run_query(con, "SELECT count(*) FROM episodes")[1] == [(0,)]
    with pytest.raises(NoDataError):
        step_metrics(con)


def test_several_runs_and_globs(run: RunFolder, tmp_path: Path) -> None:
    other = RunFolder(tmp_path / "runs" / "run-b")
    _write_step(other, 1, STEP_1[:3])
    con = open_run_sql(str(tmp_path / "runs" / "*"))
    _, rows = run_query(con, "SELECT run_id, count(*) FROM episodes WHERE step = 1 GROUP BY 1 ORDER BY 1")
    assert rows == [("run-a", 9), ("run-b", 3)]
    with pytest.raises(StorageError, match="several runs"):
        step_metrics(con, step=1)
    assert step_metrics(con, step=1, run_id="run-b")["num_episodes"] == 3.0
    con = open_run_sql([run.root, other.root])
    assert run_query(con, "SELECT count(DISTINCT run_id) FROM scores")[1] == [(2,)]
    with pytest.raises(StorageError, match="no run folder matches"):
        open_run_sql(str(tmp_path / "nothing-*"))
    with pytest.raises(StorageError, match="not a run folder"):
        open_run_sql(tmp_path)


def test_parts_in_progress_are_visible_and_temporaries_are_not(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "run")
    records = [synthetic_episode("run", 2, t, 0) for t in range(3)]
    folder.write_stage_part(episode_records_to_table(records[:2]), 2, "episodes", 0)
    temporary_path(folder.parts_dir(2, "episodes") / "part-00001.parquet").write_bytes(b"half")
    temporary_path(folder.stage_path(2, "scores")).write_bytes(b"half")
    con = open_run_sql(folder.root)
    assert run_query(con, "SELECT count(*) FROM episodes")[1] == [(2,)]
    assert run_query(con, "SELECT count(*) FROM scores")[1] == [(0,)]


def test_a_corrupt_file_fails_at_open_naming_it(run: RunFolder) -> None:
    path = run.stage_path(1, "scores")
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CorruptFileError, match="scores.parquet: corrupt file"):
        open_run_sql(run.root)


def test_a_file_of_another_version_fails_at_open(run: RunFolder) -> None:
    scores = run.stage_path(0, "scores")
    table = pq.read_table(scores)
    scores.unlink()
    future = str(SCHEMA_VERSION + 1)
    pq.write_table(table.replace_schema_metadata({**table.schema.metadata, VERSION_KEY: future.encode()}), scores)
    with pytest.raises(SchemaVersionError, match=f"scores.parquet: schema version {future}"):
        open_run_sql(run.root)


def test_a_foreign_train_json_fails_at_open(run: RunFolder) -> None:
    data = run.read_json(run.stage_path(0, "train"))
    run.stage_path(0, "train").unlink()
    run.write_json_atomic(run.stage_path(0, "train"), {**data, "schema_version": SCHEMA_VERSION + 1})
    with pytest.raises(StorageError, match=f"train.json: train result schema version {SCHEMA_VERSION + 1}"):
        open_run_sql(run.root)


WRITES = [
    "INSERT INTO episodes SELECT * FROM episodes",
    "UPDATE episodes SET turns = 0",
    "DELETE FROM scores",
    "COPY episodes TO 'out.parquet'",
    "ATTACH 'other.duckdb' AS other",
    "CREATE TABLE t AS SELECT 1",
    "CREATE VIEW v AS SELECT 1",
    "DROP VIEW episodes",
    "ALTER VIEW episodes RENAME TO e",
    "INSTALL httpfs",
    "LOAD httpfs",
    "PRAGMA threads = 1",
    "SET enable_external_access = true",
    "RESET lock_configuration",
    "EXPORT DATABASE 'dump'",
    "IMPORT DATABASE 'dump'",
    "CALL pragma_version()",
    "CHECKPOINT",
    "EXPLAIN ANALYZE CREATE TABLE t AS SELECT 1",
    "EXPLAIN ANALYZE COPY (SELECT 1) TO 'x.csv'",
]


@pytest.mark.parametrize("sql", WRITES)
def test_writes_are_refused(run: RunFolder, sql: str) -> None:
    con = open_run_sql(run.root)
    with pytest.raises(ReadOnlyQueryError, match="refused"):
        run_query(con, sql)


@pytest.mark.parametrize(
    ("sql", "named"),
    [
        ("INSTALL httpfs", "INSTALL"),  # DuckDB's type for these three is LOAD
        ("force install httpfs", "FORCE INSTALL"),
        ("-- a comment first\n  LOAD httpfs", "LOAD"),
        ("PRAGMA threads = 1", "PRAGMA"),  # DuckDB's type: SET
        ("USE memory", "USE"),  # SET
        ("CHECKPOINT", "CHECKPOINT"),  # CALL
        ("IMPORT DATABASE 'dump'", "IMPORT"),  # PRAGMA
        ("ANALYZE", "ANALYZE"),  # VACUUM
        ("UPDATE EXTENSIONS", "UPDATE"),  # a type the duckdb module has no name for
        ("WITH a AS (SELECT 1) INSERT INTO t SELECT * FROM a", "INSERT"),
    ],
)
def test_a_refusal_names_the_statement_as_written(run: RunFolder, sql: str, named: str) -> None:
    con = open_run_sql(run.root)
    with pytest.raises(ReadOnlyQueryError, match=f"^refused: {named} statements change data"):
        run_query(con, sql)


def test_files_never_change_and_nothing_else_is_readable(run: RunFolder, tmp_path: Path) -> None:
    def fingerprint() -> dict[str, str]:
        files = sorted(p for p in run.root.rglob("*") if p.is_file())
        return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}

    before = fingerprint()
    con = open_run_sql(run.root)
    target = run.stage_path(1, "episodes")
    for sql in WRITES + [f"COPY (SELECT 1 AS x) TO '{target}' (FORMAT parquet)"]:
        with pytest.raises(StorageError):
            run_query(con, sql)
    with pytest.raises(QueryError, match="disabled by configuration"):
        run_query(con, "SELECT * FROM read_csv('/etc/passwd')")
    with pytest.raises(Exception, match="locked"):
        con.execute("SET enable_external_access = true")  # even bypassing run_query
    assert fingerprint() == before
    assert not list(tmp_path.glob("*.csv")) and not Path("out.parquet").exists()


@pytest.mark.parametrize(
    "sql",
    ["SELECT 1", "WITH a AS (SELECT 2) SELECT * FROM a", "FROM episodes LIMIT 1", "DESCRIBE episodes",
     "SHOW TABLES", "SUMMARIZE scores", "EXPLAIN SELECT * FROM episodes", "EXPLAIN ANALYZE SELECT 1", "VALUES (1)"],
)
def test_reads_run(run: RunFolder, sql: str) -> None:
    columns, _ = run_query(open_run_sql(run.root), sql)
    assert columns


def test_bad_sql_is_a_query_error(run: RunFolder) -> None:
    con = open_run_sql(run.root)
    with pytest.raises(QueryError, match="syntax error"):
        run_query(con, "SELEC 1")
    with pytest.raises(QueryError, match="one statement at a time"):
        run_query(con, "SELECT 1; SELECT 2")
    with pytest.raises(QueryError, match="no SQL statement"):
        run_query(con, "  ")
    with pytest.raises(QueryError, match="nope"):
        run_query(con, "SELECT nope FROM episodes")


def _written_before_the_node_column(  # noqa: ANN202 - a pyarrow table
    table, dropped=("node", "replica", "tool_calls", "tool_errors", "env"),  # noqa: ANN001
):
    """``table`` as a rollflow that had no ``episodes.node`` column (nor the later ones) wrote it."""
    return table.drop_columns(list(dropped)).replace_schema_metadata(table.schema.metadata)


def test_episode_files_from_before_the_replica_column_still_read(tmp_path: Path) -> None:
    """``replica`` came after ``node``: a file that has ``node`` but not ``replica`` reads
    with a null replica, in Python and SQL, beside a part that has it."""
    from rollflow.storage.parquet import read_table
    from rollflow.storage.schemas import table_to_episode_records

    folder = RunFolder(tmp_path / "run")
    first, second = (synthetic_episode(folder.run_id, 0, t, 0) for t in range(2))
    second = dataclasses.replace(second, rollout=dataclasses.replace(second.rollout, replica=1))
    out = folder.parts_dir(0, "episodes")
    out.mkdir(parents=True)
    old = _written_before_the_node_column(episode_records_to_table([first]), dropped=("replica", "tool_calls", "tool_errors", "env"))
    pq.write_table(old, out / "part-00000.parquet")
    pq.write_table(episode_records_to_table([second]), out / "part-00001.parquet")
    folder.seal_stage(0, "episodes")
    assert [r.rollout.replica for r in table_to_episode_records(read_table(out))] == [None, 1]
    con = open_run_sql(folder.root)
    assert run_query(con, "SELECT replica FROM episodes ORDER BY episode_id")[1] == [(None,), (1,)]
    assert ("replica", "INTEGER") in describe_views(con)["episodes"]


def test_episode_files_from_before_the_node_column_still_read(tmp_path: Path) -> None:
    """``node`` (where a cluster played an episode) is an optional column: an old run's
    files lack it; they read with nulls, beside new parts that have it, in Python and SQL."""
    from rollflow.storage.parquet import read_table
    from rollflow.storage.schemas import table_to_episode_records

    old_run, mixed_run = RunFolder(tmp_path / "old"), RunFolder(tmp_path / "mixed")
    records = [synthetic_episode(folder.run_id, 0, t, 0) for folder in (old_run, mixed_run) for t in range(2)]
    old_records, mixed_records = records[:2], records[2:]
    placed = dataclasses.replace(mixed_records[1], node="worker-1")
    for folder, parts in ((old_run, [old_records[:1], old_records[1:]]), (mixed_run, [mixed_records[:1], [placed]])):
        out = folder.parts_dir(0, "episodes")
        out.mkdir(parents=True)
        for index, part in enumerate(parts):
            table = episode_records_to_table(part)
            if folder is old_run or index == 0:
                table = _written_before_the_node_column(table)
            pq.write_table(table, out / f"part-{index:05d}.parquet")
        folder.seal_stage(0, "episodes")
    assert "node" not in pq.read_schema(old_run.parts_dir(0, "episodes") / "part-00000.parquet").names

    assert table_to_episode_records(read_table(old_run.parts_dir(0, "episodes"))) == old_records
    assert [r.node for r in table_to_episode_records(read_table(mixed_run.parts_dir(0, "episodes")))] == [None, "worker-1"]
    for folder, nodes in ((old_run, [None, None]), (mixed_run, [None, "worker-1"])):
        con = open_run_sql(folder.root)
        assert run_query(con, "SELECT node FROM episodes ORDER BY episode_id")[1] == [(n,) for n in nodes]
        assert ("node", "VARCHAR") in describe_views(con)["episodes"]
