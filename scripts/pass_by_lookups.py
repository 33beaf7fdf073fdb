"""Pass rate of tool-use game passes split by how many facts each task needs (1, 2 or 3).

A policy's overall pass rate can stand still while it gains on one kind of task and loses
on another: the learning run of 2026-12-02 (docs/results.md, run 3) gained on the tasks
that need two lookups and lost nearly all of the ones that need three. This prints, for
each pass folder (a run's ``validation/step=N``, an eval run's, or a training step's
``steps/step=N``: any folder with a ``scores.parquet``), the pass rate and the episode count
for each number of needed facts.

The tasks are regenerated from the run's ``[env.kwargs]`` (``seed``, ``num_train``,
``num_validation``, the game's defaults otherwise), the same deterministic generation the
run used, and matched to the scores by task id.

    .venv/bin/python scripts/pass_by_lookups.py runs/learn3/grpo/validation/step=*

``--why``: a pass rate says how often a policy fails, not how. Each failed episode (the
pass folder's ``episodes/`` beside its scores) is also put in the first class that fits,
checked against its task's formula and needed facts:

- ``lookup missing``: a needed fact was never looked up (the score's ``lookups`` < 1);
- ``no calculation``: no calculator call, or no final answer after it;
- ``answer not the result``: the final answer is not the last calculator result;
- ``value left out``: a needed fact's value is missing from the last expression;
- ``stray number``: the expression holds a number that is neither a needed value nor a
  constant of the formula (a value miscopied, or a distractor fact's);
- ``wrong operation``: the right numbers, combined otherwise than the formula says
  (``+`` for "how many more", a term twice).
"""

from __future__ import annotations

import argparse
import json
import re
import tomllib
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import duckdb
import pyarrow.parquet as pq

from rollflow.envs.tool_use_game.tasks import TaskExample, generate_examples

GAME = "rollflow.envs.tool_use_game:load_environment"
CLASSES = (
    "lookup missing", "no calculation", "answer not the result", "value left out", "stray number", "wrong operation",
)  # fmt: skip
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def run_folder_of(pass_folder: Path) -> Path:
    """The run folder (the one holding ``config.toml``) above a pass folder."""
    for folder in (pass_folder, *pass_folder.parents):
        if (folder / "config.toml").is_file():
            return folder
    raise SystemExit(f"{pass_folder}: no config.toml in it or above it (not inside a run folder)")


def game_tasks(run_folder: Path) -> dict[str, TaskExample]:
    """Task id -> the task, for the run's game (train and validation)."""
    config = tomllib.loads((run_folder / "config.toml").read_text())
    env = config.get("env", {})
    if env.get("name") != GAME:
        raise SystemExit(f"{run_folder}: [env].name is {env.get('name')!r}, not the tool-use game ({GAME})")
    kwargs = env.get("kwargs", {})
    train, validation = generate_examples(
        kwargs.get("seed", 0), kwargs.get("num_train", 200), kwargs.get("num_validation", 50)
    )
    return {example.id: example for example in (*train, *validation)}


def facts_needed(run_folder: Path) -> dict[str, int]:
    """Task id -> number of facts the task needs, for the run's game."""
    return {task_id: len(task.metadata["needed_keys"]) for task_id, task in game_tasks(run_folder).items()}


def pass_by_lookups(pass_folder: Path, needed: dict[str, int]) -> dict[int, tuple[int, int]]:
    """Needed facts -> (episodes passed, episodes) over the pass's scores."""
    table = pq.read_table(pass_folder / "scores.parquet", columns=["task_id", "passed"]).to_pylist()
    counts: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for row in table:
        if row["task_id"] not in needed:
            raise SystemExit(f"{pass_folder}: task {row['task_id']!r} is not one of the run's game tasks")
        bucket = counts[needed[row["task_id"]]]
        bucket[0] += bool(row["passed"])
        bucket[1] += 1
    return {k: (v[0], v[1]) for k, v in sorted(counts.items())}


def _numbers(text: str) -> list[str]:
    return [str(float(n)) for n in _NUMBER.findall(text)]


def classify(task: TaskExample, lookups_credit: float, messages: list[dict[str, Any]]) -> str:
    """The class of one failed episode (module docstring)."""
    if lookups_credit < 1.0:
        return "lookup missing"
    calls = [c for m in messages if m["role"] == "assistant" for c in (m["tool_calls"] or [])]
    expressions = []
    for call in calls:
        if call["name"] != "calculator":
            continue
        try:
            arguments = json.loads(call["arguments"])
        except json.JSONDecodeError:
            continue
        if isinstance(arguments, dict) and isinstance(arguments.get("expression"), str):
            expressions.append(arguments["expression"])
    last = messages[-1]
    if not expressions or last["role"] != "assistant" or last["tool_calls"]:
        return "no calculation"
    results = [m["content"] or "" for m in messages if m["role"] == "tool"]
    if results and _numbers(last["content"] or "")[-1:] != _numbers(results[-1])[-1:]:
        return "answer not the result"
    used = Counter(_numbers(expressions[-1]))
    needed = Counter(str(float(task.metadata["facts"][k])) for k in task.metadata["needed_keys"])
    if needed - used:
        return "value left out"
    constants = Counter(_numbers(re.sub(r"\{\d+\}", "", task.metadata["formula"])))
    if set(used) - set(needed) - set(constants):
        return "stray number"
    return "wrong operation"


def failures(pass_folder: Path, tasks: dict[str, TaskExample]) -> dict[int, Counter[str]]:
    """Facts needed -> failure class -> episodes, plus ``episodes`` and ``failed`` counts."""
    rows = duckdb.connect().execute(
        "SELECT s.task_id, s.passed, s.components['lookups'], e.messages "
        f"FROM read_parquet('{pass_folder}/scores.parquet') s "
        f"JOIN read_parquet('{pass_folder}/episodes/*.parquet') e USING (episode_id)"
    ).fetchall()
    by: dict[int, Counter[str]] = defaultdict(Counter)
    for task_id, passed, lookups, messages in rows:
        if task_id not in tasks:
            raise SystemExit(f"{pass_folder}: task {task_id!r} is not one of the run's game tasks")
        task = tasks[task_id]
        counts = by[len(task.metadata["needed_keys"])]
        counts["episodes"] += 1
        if not passed:
            counts["failed"] += 1
            counts[classify(task, 1.0 if lookups is None else lookups, messages)] += 1
    return dict(sorted(by.items()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("passes", nargs="+", type=Path, help="folders holding a scores.parquet")
    parser.add_argument("--why", action="store_true", help="also classify each failed episode (docstring)")
    args = parser.parse_args(argv)
    print(f"{'pass':<48} {'1 fact':>13} {'2 facts':>13} {'3 facts':>13} {'all':>13}")
    for folder in args.passes:
        if not (folder / "scores.parquet").is_file():
            raise SystemExit(f"{folder}: no scores.parquet (not a finished pass)")
        counts = pass_by_lookups(folder, facts_needed(run_folder_of(folder)))
        total = (sum(p for p, _ in counts.values()), sum(n for _, n in counts.values()))
        cells = [counts.get(k, (0, 0)) for k in (1, 2, 3)] + [total]
        text = [f"{p / n:.3f} ({n:>3})" if n else "-" for p, n in cells]
        print(f"{str(folder):<48} " + " ".join(f"{t:>13}" for t in text))
        if args.why:
            for facts, classes in failures(folder, game_tasks(run_folder_of(folder))).items():
                shown = ", ".join(f"{name} {classes[name]}" for name in CLASSES if classes[name])
                print(f"  {facts} fact(s), {classes['failed']} of {classes['episodes']} failed: {shown or '-'}")


if __name__ == "__main__":
    main()
