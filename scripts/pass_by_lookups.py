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
"""

from __future__ import annotations

import argparse
import tomllib
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq

from rollflow.envs.tool_use_game.tasks import generate_examples

GAME = "rollflow.envs.tool_use_game:load_environment"


def run_folder_of(pass_folder: Path) -> Path:
    """The run folder (the one holding ``config.toml``) above a pass folder."""
    for folder in (pass_folder, *pass_folder.parents):
        if (folder / "config.toml").is_file():
            return folder
    raise SystemExit(f"{pass_folder}: no config.toml in it or above it (not inside a run folder)")


def facts_needed(run_folder: Path) -> dict[str, int]:
    """Task id -> number of facts the task needs, for the run's game."""
    config = tomllib.loads((run_folder / "config.toml").read_text())
    env = config.get("env", {})
    if env.get("name") != GAME:
        raise SystemExit(f"{run_folder}: [env].name is {env.get('name')!r}, not the tool-use game ({GAME})")
    kwargs = env.get("kwargs", {})
    train, validation = generate_examples(
        kwargs.get("seed", 0), kwargs.get("num_train", 200), kwargs.get("num_validation", 50)
    )
    return {example.id: len(example.metadata["needed_keys"]) for example in (*train, *validation)}


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("passes", nargs="+", type=Path, help="folders holding a scores.parquet")
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


if __name__ == "__main__":
    main()
