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


def _episode(task, expression: str | None, answer: str | None, lookups: list[str] | None = None) -> list[dict]:
    """A transcript of the game: the looked-up facts, one calculator call, the answer."""
    facts = task.metadata["facts"]
    keys = task.metadata["needed_keys"] if lookups is None else lookups
    call = lambda name, arguments: {"name": name, "arguments": arguments}  # noqa: E731
    messages = [
        {"role": "user", "content": task.input, "tool_calls": None},
        {"role": "assistant", "content": "", "tool_calls": [call("lookup", f'{{"key": "{k}"}}') for k in keys]},
        *({"role": "tool", "content": str(facts[k]), "tool_calls": None} for k in keys),
    ]
    if expression is not None:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call("calculator", f'{{"expression": "{expression}"}}')]})
        messages.append({"role": "tool", "content": str(eval(expression)), "tool_calls": None})  # noqa: S307 (test data)
    if answer is not None:
        messages.append({"role": "assistant", "content": answer, "tool_calls": None})
    return messages


def test_each_failed_episode_gets_the_class_of_what_went_wrong() -> None:
    _, validation = generate_examples(0, 200, 50)
    task = next(t for t in validation if t.metadata["formula"] == "{0} - {1}")
    a, b = (task.metadata["facts"][k] for k in task.metadata["needed_keys"])
    distractor = next(v for k, v in task.metadata["facts"].items() if v not in (a, b))
    cases = {
        "wrong operation": (f"{a} + {b}", str(a + b)),  # "how many more" read as a sum
        "value left out": (f"{a} - 7", str(a - 7)),
        "stray number": (f"{a} - {b} - {distractor}", str(a - b - distractor)),
        "answer not the result": (f"{a} - {b}", str(a - b + 1)),
        "no calculation": (None, str(a - b)),
    }
    for expected, (expression, answer) in cases.items():
        assert script.classify(task, 1.0, _episode(task, expression, answer)) == expected, expected
    # the calculator called, but the episode ended on another tool call: no final answer
    no_answer = _episode(task, f"{a} - {b}", None)
    assert script.classify(task, 1.0, no_answer) == "no calculation"
    # a missing lookup comes first, whatever the expression
    assert script.classify(task, 0.5, _episode(task, f"{a} + {b}", "0", lookups=task.metadata["needed_keys"][:1])) == "lookup missing"
