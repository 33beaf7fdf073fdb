"""Benchmark: write a synthetic run of N episodes, then time the per-step metric queries.

    .venv/bin/python bench/storage_bench.py                       # 1,000,000 episodes
    .venv/bin/python bench/storage_bench.py --episodes 20000 --steps 10

Episodes are the ``rollflow.storage.synthetic`` tool-use transcripts (5 messages, one tool call,
2 actions) made less compressible: random token ids and float32 logprobs (``--tokens``
context tokens per episode) and a user message of random words, so file sizes are not
flattered by identical rows. They are written step by step through ``RunFolder``
exactly as the rollout and scoring stages write them: records -> Arrow table -> atomic
zstd Parquet. The write time includes building the Python records and converting them,
reported apart.

The metric timings are for the SQL the pipeline runs (``rollflow.storage.query``): one step's
metrics (what the pipeline logs after each step), and every step at once over the whole
run (what a dashboard would ask), each the median of several runs on a warm connection.

Simplified: one run, every episode the same size; real transcripts are longer, which
grows the files and the write time but barely the metric queries (they read a few
narrow columns, never the messages).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from rollflow.envs.episode import ActionTokens
from rollflow.storage.query import open_run_sql, run_query
from rollflow.storage.runfolder import RunFolder
from rollflow.storage.records import EpisodeRecord
from rollflow.storage.schemas import episode_records_to_table, score_records_to_table
from rollflow.storage.step_metrics import metrics_by_step, step_metrics
from rollflow.storage.synthetic import synthetic_episode, synthetic_score


def _median_seconds(action: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


_WORDS = "the of tool call result answer lookup value key sum total number list fact".split()


def _randomize(record: EpisodeRecord, rng: np.random.Generator, tokens: int) -> EpisodeRecord:
    """Random token ids, logprobs and user text: rows that do not compress to nothing."""
    rollout = record.rollout
    actions = []
    for action in rollout.actions:
        sampled = len(action.token_ids) * 4
        logprobs = (-rng.exponential(0.5, sampled)).astype(np.float32)
        actions.append(
            ActionTokens(
                prompt_delta_ids=tuple(rng.integers(0, 49152, tokens // 2).tolist()),
                reset=action.reset,
                token_ids=tuple(rng.integers(0, 49152, sampled).tolist()),
                logprobs=tuple(logprobs.tolist()),
                finish_reason=action.finish_reason,
            )
        )
    question = " ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), 40))
    messages = (rollout.messages[0], {"role": "user", "content": question}, *rollout.messages[2:])
    new_rollout = dataclasses.replace(rollout, actions=tuple(actions), messages=messages)
    return dataclasses.replace(record, rollout=new_rollout)


def write_run(
    folder: RunFolder, episodes: int, steps: int, group_size: int, tokens: int
) -> dict[str, float]:
    """Write ``steps`` steps of episodes and scores; returns seconds spent per phase."""
    per_step = episodes // steps
    timings = {"build": 0.0, "convert": 0.0, "write": 0.0}
    rng = np.random.default_rng(0)
    for step in range(steps):
        start = time.perf_counter()
        records = [
            _randomize(synthetic_episode(folder.run_id, step, i // group_size, i % group_size), rng, tokens)
            for i in range(per_step)
        ]
        scores = [synthetic_score(r, float((r.index_in_group + step) % 2)) for r in records]
        built = time.perf_counter()
        episode_table = episode_records_to_table(records)
        score_table = score_records_to_table(scores)
        converted = time.perf_counter()
        folder.write_stage(episode_table, step, "episodes")
        folder.write_stage(score_table, step, "scores")
        written = time.perf_counter()
        timings["build"] += built - start
        timings["convert"] += converted - built
        timings["write"] += written - converted
        print(f"\r  step {step + 1}/{steps} written", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return timings


def _size(folder: RunFolder, stage: str) -> int:
    return sum(p.stat().st_size for p in folder.root.glob(f"steps/*/{stage}.parquet"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=1_000_000)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64, help="context tokens per episode")
    parser.add_argument("--out", type=Path, default=None, help="keep the run here (default: a temp dir, removed)")
    parser.add_argument("--reuse", action="store_true", help="time the queries on the run already in --out")
    args = parser.parse_args(argv)
    if args.episodes % args.steps:
        parser.error("--episodes must be a multiple of --steps")

    if args.reuse and args.out is None:
        parser.error("--reuse needs --out (the folder of an earlier run)")
    base = args.out or Path(tempfile.mkdtemp(prefix="rollflow-bench-"))
    folder = RunFolder(base / "bench-run")
    try:
        if not args.reuse:
            _write_and_report(folder, args)
        _time_queries(folder, args)
        return 0
    finally:
        if args.out is None:
            shutil.rmtree(base, ignore_errors=True)


def _write_and_report(folder: RunFolder, args: argparse.Namespace) -> None:
    print(f"writing {args.episodes:,} episodes in {args.steps} steps to {folder.root}")
    start = time.perf_counter()
    timings = write_run(folder, args.episodes, args.steps, args.group_size, args.tokens)
    total = time.perf_counter() - start
    episodes_mb, scores_mb = _size(folder, "episodes") / 1e6, _size(folder, "scores") / 1e6
    print(f"write total        {total:8.1f} s  ({args.episodes / total:,.0f} episodes/s)")
    for phase, seconds in timings.items():
        print(f"  {phase:<16} {seconds:8.1f} s")
    print(f"episodes.parquet   {episodes_mb:8.1f} MB  ({episodes_mb * 1e6 / args.episodes:,.0f} B/episode)")
    print(f"scores.parquet     {scores_mb:8.1f} MB")


def _time_queries(folder: RunFolder, args: argparse.Namespace) -> None:
    start = time.perf_counter()
    con = open_run_sql(folder.root)
    print(f"open_run_sql       {(time.perf_counter() - start) * 1000:8.1f} ms  (checks every footer)")
    _, [(episodes, steps)] = run_query(con, "SELECT count(*), count(DISTINCT step) FROM episodes")
    middle = steps // 2
    start = time.perf_counter()
    step_metrics(con, step=middle)
    cold = time.perf_counter() - start
    one = _median_seconds(lambda: step_metrics(con, step=middle), repeats=5)
    every = _median_seconds(lambda: metrics_by_step(con), repeats=3)
    causes = _median_seconds(
        lambda: run_query(con, "SELECT truncation_cause, count(*) FROM episodes GROUP BY 1"), repeats=3
    )
    print(f"step_metrics       {one * 1000:8.1f} ms  (one step of {episodes // steps:,} episodes; "
          f"first call {cold * 1000:.0f} ms)")
    print(f"metrics_by_step    {every * 1000:8.1f} ms  (all {steps} steps, {episodes:,} episodes)")
    print(f"GROUP BY cause     {causes * 1000:8.1f} ms  (ad-hoc query over every episode)")


if __name__ == "__main__":
    sys.exit(main())
