"""scripts/degenerate_baselines.py: what constant replies earn, scored as a run scores, on any
environment style (a multi-turn async game, a single-turn task, each member of a mixture)."""

from __future__ import annotations

from pathlib import Path

import pytest
from repo_script import load_script

from rollflow.config.run import config_to_toml, parse_config

baselines = load_script("scripts/degenerate_baselines.py")
REPO = Path(__file__).resolve().parent.parent


def test_a_constant_guess_wins_a_game_only_where_it_is_the_target(capsys: pytest.CaptureFixture[str]) -> None:
    """GuessTheNumber pays partial credit for a close guess: a constant middle guess earns most
    of the mean reward while winning only the games whose number it is."""
    baselines.main([str(REPO / "configs" / "textarena.toml"), "--reply", "[13]"])
    out = capsys.readouterr().out
    assert out.startswith("textarena: 50 validation tasks")
    line = next(x for x in out.splitlines() if "always '[13]'" in x)
    reward, passed = float(line.split("mean reward")[1].split()[0]), float(line.split("pass rate")[1])
    assert passed == 0.1 and reward > 0.7  # 5 of the 50 numbers are 13; closeness pays the rest
    assert "empty reply" in out and "pass rate 0.000" in out


def test_each_member_of_a_mixture_is_scored_apart(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = parse_config({
        "env": {"mixture": [
            {"name": "rollflow.envs.arithmetic_answer:load_environment", "label": "sums",
             "kwargs": {"num_validation": 20, "max_operand": 9, "operand_counts": [2], "operators": "+"}},
            {"name": "varied_reward_env:load_environment", "label": "letters"},
        ]},
        "validation": {"num_tasks": 20},
    })  # fmt: skip
    path = tmp_path / "mixture.toml"
    path.write_text(config_to_toml(config))
    baselines.main([str(path), "--reply", "abc"])
    out = capsys.readouterr().out
    assert "sums: 20 validation tasks" in out and "letters: 2 validation tasks" in out
    common = next(x for x in out.splitlines() if "the most common answer" in x)
    assert float(common.split("pass rate")[1]) > 0  # the commonest sum is right where it is the answer
    letters = out.split("letters:")[1]
    assert "always 'abc'" in letters and "pass rate 1.000" in letters  # all letters: the share is 1
