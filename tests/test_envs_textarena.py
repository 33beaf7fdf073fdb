"""The TextArena adapter (envs/textarena.py) with the real library: games played through
rollflow's runner end with the reward the library itself gives the same moves; splits
never share a seed; episodes played together draw the same cards as each played alone; an
unknown game or one that cannot start offline is one line."""

from __future__ import annotations

import asyncio
import random
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

textarena = pytest.importorskip("textarena", reason="the textarena extra is not installed")

from rollflow.envs.handle import EpisodeLimits  # noqa: E402
from rollflow.envs.runner import EnvironmentLoadError, load_environment_handle, play_groups  # noqa: E402
from rollflow.envs.scripted import ScriptedPolicy  # noqa: E402
from rollflow.envs.textarena import make_game  # noqa: E402
from rollflow.envs.types import Message  # noqa: E402
from rollflow.storage.query import open_run_sql, run_query  # noqa: E402
from rollflow.tasks.shaping import ending_of, env_passed  # noqa: E402
from tiny_run import train_tiny_on  # noqa: E402

SPEC = "rollflow.envs.textarena:load_environment"
GAME = "GuessTheNumber-v0"


def binary_search(messages: Sequence[Message], turn: int) -> str:
    low, high = 1, 20
    guesses = [int(re.search(r"\[(\d+)\]", m["content"]).group(1)) for m in messages if m["role"] == "assistant"]
    hints = [m["content"] for m in messages if m["role"] == "user"][1:]
    for guess, hint in zip(guesses, hints, strict=False):
        low, high = (guess + 1, high) if "higher" in hint else (low, guess - 1) if "lower" in hint else (low, high)
    return f"I think it is [{(low + high) // 2}]."


def stubborn(messages: Sequence[Message], turn: int) -> str:
    return "[7]"  # a repeated guess is an invalid move; past the allowance the game ends


def library_reward(seed: int, actions: Sequence[str]) -> float:
    """The library's own reward for these moves, from a game driven without rollflow."""
    game = make_game(GAME, {})
    game.reset(num_players=1, seed=seed)
    for action in actions:
        done, _ = game.step(action)
        if done:
            break
    rewards, _ = game.close()
    return float(rewards[0])


@pytest.mark.parametrize("script", [binary_search, stubborn])
def test_rewards_are_the_librarys_for_the_same_moves(script) -> None:  # type: ignore[no-untyped-def]
    handle = load_environment_handle(SPEC, {"game": GAME, "num_train": 6, "num_validation": 2, "seed": 10})
    items = handle.tasks("train")
    losses = False
    groups = asyncio.run(play_groups(handle, items, 1, ScriptedPolicy(script), EpisodeLimits(max_turns=12), concurrency=6))
    for item, (rollout,) in zip(items, groups, strict=True):
        assert rollout.error is None and rollout.terminated
        actions = [m["content"] for m in rollout.messages if m["role"] == "assistant"]
        (score,) = asyncio.run(handle.score(item, [rollout]))
        expected = library_reward(item.payload.metadata["seed"], actions)  # type: ignore[union-attr]
        assert score.reward == expected
        if script is binary_search:
            assert expected == 1.0 and score.components["won"] == 1.0 and rollout.turns <= 5
        elif expected < 1.0:  # (a game whose number is 7 is won at once)
            assert rollout.turns == 3 and score.components["won"] == 0.0 and score.components["invalid_move"] == 1.0
            assert "[7]" not in rollout.messages[2]["content"]  # the game's echo of the move is left out
            losses = True
    assert script is binary_search or losses


def blackjack_moves(messages: Sequence[Message], turn: int) -> str:
    return ("[Hit]", "[Hit]", "[Stand]")[min(turn, 2)]  # each move deals a card in the game's step()


def blackjack_transcripts(concurrency: int) -> list[list[Message]]:
    handle = load_environment_handle(SPEC, {"game": "Blackjack-v0", "num_train": 2, "num_validation": 0, "seed": 7})
    policy = ScriptedPolicy(blackjack_moves, delay_s=0.001)  # every episode waits, so in flight they take turns
    groups = asyncio.run(play_groups(handle, handle.tasks("train"), 3, policy, EpisodeLimits(max_turns=6), concurrency))
    return [rollout.messages for group in groups for rollout in group]


def test_episodes_played_together_draw_as_each_played_alone() -> None:
    alone = blackjack_transcripts(concurrency=1)
    together = blackjack_transcripts(concurrency=6)
    assert together == alone
    assert alone[0] == alone[1] == alone[2] and alone[3] == alone[4] == alone[5] and alone[0] != alone[3]


def test_an_episode_leaves_the_process_random_alone() -> None:
    random.seed(123)
    expected = [random.random() for _ in range(3)]
    random.seed(123)
    first = random.random()
    blackjack_transcripts(concurrency=2)
    assert [first, random.random(), random.random()] == expected


@pytest.mark.parametrize("game", ["Countdown-v0", "Cryptarithm-v0"])
def test_a_game_lost_to_invalid_moves_has_a_number_for_its_reward(game: str) -> None:
    """These two pass set_invalid_move's arguments swapped (0.7.4): the reason text arrives
    as the reward, which failed every episode the model lost to bad moves."""
    handle = load_environment_handle(SPEC, {"game": game, "num_train": 1, "num_validation": 0, "seed": 3})
    [item] = handle.tasks("train")
    [[rollout]] = asyncio.run(play_groups(handle, [item], 1, ScriptedPolicy(lambda m, t: "no move"),
                                          EpisodeLimits(max_turns=6), concurrency=1))
    assert rollout.error is None and rollout.terminated
    (score,) = asyncio.run(handle.score(item, [rollout]))
    assert 0.0 <= score.reward < 1.0 and score.components["invalid_move"] == 1.0
    reason = rollout.step_metadata[-1]["reason"]
    assert reason.startswith("Invalid Move: ") and "format" in reason


def two_close_guesses(messages: Sequence[Message], turn: int) -> str:
    return ("[10]", "[11]")[min(turn, 1)]


def close_then_right(messages: Sequence[Message], turn: int) -> str:
    return ("[10]", "[19]")[min(turn, 1)]  # seed 10's number


@pytest.mark.parametrize(("pass_kwargs", "passed"), [({}, False), ({"pass_threshold": 0.5}, True)])
def test_passed_means_won_unless_told_otherwise(pass_kwargs: dict, passed: bool) -> None:
    """GuessTheNumber pays a lost game how close its last guess was (here 1 - 8/19, the
    number being 19): that is not a pass, unless ``pass_threshold`` says it is."""
    kwargs = {"game": GAME, "max_turns": 2, "num_train": 1, "num_validation": 0, "seed": 10, **pass_kwargs}
    handle = load_environment_handle(SPEC, kwargs)
    [item] = handle.tasks("train")
    [[lost]] = asyncio.run(play_groups(handle, [item], 1, ScriptedPolicy(two_close_guesses),
                                       EpisodeLimits(max_turns=4), concurrency=1))
    [[won]] = asyncio.run(play_groups(handle, [item], 1, ScriptedPolicy(close_then_right), EpisodeLimits(max_turns=4), concurrency=1))
    lost_score, won_score = asyncio.run(handle.score(item, [lost, won]))
    assert lost_score.reward == pytest.approx(1 - 8 / 19) and lost_score.components["won"] == 0.0
    assert env_passed(ending_of(lost, lost_score), lost_score) is passed
    assert won_score.components["won"] == 1.0 and env_passed(ending_of(won, won_score), won_score)


def test_splits_are_disjoint_seeds() -> None:
    handle = load_environment_handle(SPEC, {"game": GAME, "num_train": 5, "num_validation": 3, "seed": 2})
    train = {item.payload.metadata["seed"] for item in handle.tasks("train")}  # type: ignore[union-attr]
    validation = {item.payload.metadata["seed"] for item in handle.tasks("validation")}  # type: ignore[union-attr]
    assert train == {2, 3, 4, 5, 6} and validation == {7, 8, 9}


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"game": "GuessTheNumbr-v0"}, r"game = 'GuessTheNumbr-v0' is not a TextArena game; did you mean GuessTheNumber-v0"),
        ({"game": GAME, "colour": 2}, r"could not be made with \{'colour': 2\}: TypeError"),
        ({"game": "Wordle-v0"}, r"'Wordle-v0' could not be made .*LookupError: Resource 'words' not found"),
        ({"game": "Mastermind-v0", "num_train": 0}, r"num_train must be a positive integer"),
        ({"game": GAME, "pass_threshold": "won"}, r"pass_threshold must be a finite number, got 'won'"),
    ],
)  # fmt: skip
def test_bad_games_are_one_line(kwargs: dict, pattern: str) -> None:
    with pytest.raises(EnvironmentLoadError, match=pattern) as raised:
        load_environment_handle(SPEC, kwargs)
    assert "\n" not in str(raised.value)


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="Chess's module imports from Python 3.12 on")
def test_a_game_that_does_not_import_says_so() -> None:
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    pattern = rf"'Chess-v0': TextArena's game does not import on Python {python}: SyntaxError: f-string: unmatched '\['"
    with pytest.raises(EnvironmentLoadError, match=pattern):
        load_environment_handle(SPEC, {"game": "Chess-v0"})


def test_an_offline_word_game_is_refused_without_nltk_noise() -> None:
    """NLTK writes its download failures to the stderr it captured when imported, so only a
    fresh process shows what a user sees."""
    script = (
        "from rollflow.envs.runner import load_environment_handle\n"
        f"load_environment_handle({SPEC!r}, {{'game': 'Wordle-v0'}})\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "could not be made with {}: LookupError: Resource 'words' not found" in result.stderr
    assert not [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("[nltk_data]")]


@pytest.mark.slow
def test_two_steps_of_rollflow_train_on_the_tiny_model(
    tiny_model_dir: Path, tmp_path: Path, prefect_harness: object
) -> None:
    run_dir = train_tiny_on(tiny_model_dir, tmp_path, SPEC, {"game": GAME, "num_train": 4, "num_validation": 2}, max_turns=2)
    con = open_run_sql(run_dir)
    _, rows = run_query(
        con,
        "SELECT e.step, count(*), count_if(e.task_id LIKE 'textarena/GuessTheNumber-v0/%'), count_if(e.error IS NULL) "
        "FROM episodes e JOIN scores s USING (run_id, split, step, episode_id) WHERE e.split = 'train' "
        "GROUP BY ALL ORDER BY ALL",
    )
    assert rows == [(0, 4, 4, 4), (1, 4, 4, 4)]
    _, verdicts = run_query(con, "SELECT count(*), count_if(threshold = 1.0), count_if(passed = (reward >= 1.0)) FROM scores")
    assert verdicts[0][0] > 0 and verdicts[0][0] == verdicts[0][1] == verdicts[0][2]  # a pass is a win
    _, steps = run_query(con, "SELECT count(*) FROM steps")
    assert steps == [(2,)]
