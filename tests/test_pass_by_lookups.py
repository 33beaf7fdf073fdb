"""scripts/pass_by_lookups.py: a game pass's pass rate split by the facts each task needs."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from repo_script import load_script

from rollflow.envs.tool_use_game.tasks import generate_examples

script = load_script("scripts/pass_by_lookups.py")


def game_pass(tmp_path: Path, env_kwargs: str, rows: list[tuple[str, bool]]) -> Path:
    run = tmp_path / "run"
    (run / "validation" / "step=000005").mkdir(parents=True)
    (run / "config.toml").write_text(
        f'[env]\nname = "rollflow.envs.tool_use_game:load_environment"\n[env.kwargs]\n{env_kwargs}\n'
    )
    folder = run / "validation" / "step=000005"
    pq.write_table(pa.table({"task_id": [t for t, _ in rows], "passed": [p for _, p in rows]}),
                   folder / "scores.parquet")
    return folder


def test_counts_passes_by_the_number_of_facts_each_task_needs(tmp_path: Path, capsys) -> None:
    _, validation = generate_examples(3, 20, 30)
    by_count: dict[int, list[str]] = {}
    for example in validation:
        by_count.setdefault(len(example.metadata["needed_keys"]), []).append(example.id)
    one, three = by_count[1][0], by_count[3][0]
    folder = game_pass(tmp_path, "seed = 3\nnum_train = 20\nnum_validation = 30",
                       [(one, True), (one, True), (one, False), (three, False), (three, True)])
    needed = script.facts_needed(script.run_folder_of(folder))
    assert script.pass_by_lookups(folder, needed) == {1: (2, 3), 3: (1, 2)}
    script.main([str(folder)])
    assert "0.667 (  3)" in capsys.readouterr().out


def test_a_task_the_run_did_not_generate_is_an_error_not_a_gap(tmp_path: Path) -> None:
    # Another seed generates other tasks: the ids do not match, and that must not pass silently.
    _, validation = generate_examples(3, 20, 30)
    folder = game_pass(tmp_path, "seed = 4\nnum_train = 20\nnum_validation = 30", [(validation[0].id, True)])
    with pytest.raises(SystemExit, match="is not one of the run's game tasks"):
        script.pass_by_lookups(folder, script.facts_needed(script.run_folder_of(folder)))
