"""The reasoning-gym adapter (envs/reasoning_gym.py) with the real library: episodes played
through rollflow's runner score exactly what the library's own ``score_answer`` gives the
same answers; splits never overlap; a wrong dataset is one line before anything starts."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

reasoning_gym = pytest.importorskip("reasoning_gym", reason="the reasoning-gym extra is not installed")
from reasoning_gym.utils import extract_answer  # noqa: E402

from rollflow.config.run import config_to_toml, load_config  # noqa: E402
from rollflow.envs.handle import EpisodeLimits  # noqa: E402
from rollflow.envs.reasoning_gym import dataset_names, expert_policy, load_environment  # noqa: E402
from rollflow.envs.runner import EnvironmentLoadError, load_environment_handle, play_groups  # noqa: E402
from rollflow.envs.scripted import ScriptedPolicy, latest_user_content  # noqa: E402
from rollflow.storage.query import open_run_sql, run_query  # noqa: E402
from tiny_run import train_tiny_on  # noqa: E402
from rollflow.config.checks import PreflightError  # noqa: E402
from rollflow.ops.preflight import check_environment  # noqa: E402

SPEC = "rollflow.envs.reasoning_gym:load_environment"
REPO = Path(__file__).resolve().parent.parent
KWARGS = {"dataset": "basic_arithmetic", "size": 12, "seed": 3, "num_validation": 6, "max_terms": 3, "max_digits": 2}


def _answers_by_question(handle) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return {
        str(item.payload.input): str(item.payload.metadata["answer"])
        for split in ("train", "validation")
        for item in handle.tasks(split)
    }


def test_episodes_score_what_the_library_scores_for_the_same_answers() -> None:
    handle = load_environment_handle(SPEC, {**KWARGS, "credit": "dataset"})
    items = handle.tasks("train")
    answers = _answers_by_question(handle)
    questions = [str(item.payload.input) for item in items]

    def script(messages, turn):  # type: ignore[no-untyped-def]
        question = latest_user_content(messages)
        index = questions.index(question)
        # right, wrong, right without the tags, right with reasoning around it
        return [
            f"<answer>{answers[question]}</answer>",
            "<answer>12345678</answer>",
            answers[question],
            f"Let me think.\n<answer> {answers[question]} </answer>",
        ][index % 4]

    groups = asyncio.run(play_groups(handle, items, 2, ScriptedPolicy(script), EpisodeLimits(), concurrency=8))
    library = reasoning_gym.create_dataset("basic_arithmetic", size=100, seed=3, max_terms=3, max_digits=2)
    rewards = []
    for index, (item, group) in enumerate(zip(items, groups, strict=True)):
        scores = asyncio.run(handle.score(item, group))
        entry = library[index]  # the library's own entry, made afresh, not the adapter's copy
        assert entry["question"] == item.payload.input
        for rollout, score in zip(group, scores, strict=True):
            assert rollout.terminated and rollout.turns == 1 and rollout.error is None
            expected = library.score_answer(extract_answer(rollout.response_text), entry)
            assert score.reward == expected and score.components["score"] == expected
            assert score.threshold == 1.0 and score.error is None
            rewards.append(score.reward)
    # half the replies are right; an untagged answer scores 0; a wrong number may earn the
    # library's partial credit, a reward that is not a pass (threshold 1.0)
    assert rewards.count(1.0) == 12 and rewards.count(0.0) >= 6 and max(rewards[2::8]) < 1.0


def test_sft_targets_and_the_expert_score_one() -> None:
    env = load_environment(**KWARGS)
    for example in env.examples("train"):
        (target,) = env.sft_completion(example)
        assert target["role"] == "assistant" and env.score_response(example, target["content"]).score == 1.0
    handle = load_environment_handle(SPEC, KWARGS)
    items = handle.tasks("validation")
    groups = asyncio.run(play_groups(handle, items, 1, expert_policy(env), EpisodeLimits(), concurrency=4))
    scores = [s for item, g in zip(items, groups, strict=True) for s in asyncio.run(handle.score(item, g))]
    assert [s.reward for s in scores] == [1.0] * len(items) == [1.0] * 6


def test_raw_answers_are_the_whole_reply() -> None:
    env = load_environment(**KWARGS, answer_format="raw", credit="dataset")
    example = env.examples("train")[0]
    answer = str(example.metadata["answer"])
    assert env.sft_completion(example)[0]["content"] == answer
    assert env.score_response(example, f"  {answer}\n").score == 1.0
    tagged = env.score_response(example, f"<answer>{answer}</answer>")
    assert tagged.score < 1.0 and tagged.score == env.library_dataset.score_answer(f"<answer>{answer}</answer>", env.entry(example))


def _worked_environment():  # type: ignore[no-untyped-def]
    config = load_config(REPO / "configs" / "reasoning_gym.toml")
    return load_environment(**config.env.kwargs)


def test_the_worked_config_gives_a_constant_reply_nothing_it_did_not_solve() -> None:
    """Review 2026-12-07 F2: with the whole reply scored by the dataset's substring credit, a
    constant "123456789" earned 0.073 on the validation questions, most of what 10 steps of
    training showed (0.100). The worked config credits only the right answer: a constant
    reply earns exactly the share of questions whose answer it is."""
    env = _worked_environment()
    validation = env.examples("validation")
    answers = [str(e.metadata["answer"]) for e in validation]
    for reply in ("0123456789", "123456789", "-1-2-3-4-5-6-7-8-9 10 11 12 13 14 15 16 17 18 0"):
        last = reply.split()[-1].split("-")[-1]
        rewards = [env.score_response(e, reply).score for e in validation]
        assert set(rewards) <= {0.0, 1.0}
        assert sum(rewards) == answers.count(last), reply
    assert sum(env.score_response(e, "0123456789").score for e in validation) == 0


@pytest.mark.parametrize(
    ("reply", "answer", "read"),
    [
        ("The answer is 9.", 9, "9"),
        ("7 + 2 = 9", "9", "9"),
        ("9.0", "9", "9"),
        ("1,200 apples", "1200", "1200"),
        ("It is -3", "-3", "-3"),
        ("Let me see: 2 and 3.\n<answer>5</answer> then 7", "5", "5"),  # tags win
        ("no number here", "4", None),
        ("Answer: Paris.", "Paris", "Paris"),
        ("Thinking...\nThe final answer is blue", "blue", "blue"),
        ("", "blue", None),
    ],
)  # fmt: skip
def test_final_answers_are_read_from_the_end_of_the_reply(reply: str, answer: object, read: str | None) -> None:
    env = load_environment(**KWARGS, answer_format="final")
    assert env.extract(reply, answer) == read


def test_exact_credit_is_the_datasets_own_full_marks_and_nothing_less() -> None:
    env = load_environment(**KWARGS, answer_format="final")
    example = env.examples("train")[0]
    answer = str(example.metadata["answer"])
    right = env.score_response(example, f"Let me add them up. The answer is {answer}.")
    assert right.score == 1.0 >= right.threshold and right.components["answered"] == 1.0
    near = env.score_response(example, f"{answer}1")  # holds the answer's digits: partial credit
    assert near.components["dataset_score"] > 0.0 and near.score == 0.0 < near.threshold
    partial = load_environment(**KWARGS, answer_format="raw", credit="dataset")
    assert partial.score_response(example, f"{answer}1").score == near.components["dataset_score"]
    assert env.sft_completion(example)[0]["content"] == answer  # the SFT target is the bare answer
    with pytest.raises(EnvironmentLoadError, match=r"credit must be one of \('exact', 'dataset'\), got 'half'"):
        load_environment_handle(SPEC, {**KWARGS, "credit": "half"})


def test_splits_never_overlap_even_when_questions_repeat() -> None:
    # two one-digit terms: a small question space, so later entries repeat earlier ones
    env = load_environment(
        "basic_arithmetic", size=200, num_validation=40, min_terms=2, max_terms=2, max_digits=1,
        allow_negation=False, allow_parentheses=False, operators=["+"],
    )  # fmt: skip
    train, validation = env.examples("train"), env.examples("validation")
    assert len(train) == 200 and 0 < len(validation) <= 40
    assert not {e.input for e in train} & {e.input for e in validation}
    assert not {e.id for e in train} & {e.id for e in validation}
    assert min(e.metadata["index"] for e in validation) >= 200
    same = load_environment(**KWARGS).examples("validation")
    assert same == load_environment(**KWARGS).examples("validation")  # seeded


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"dataset": "basic_arithmatic"}, r"dataset = 'basic_arithmatic' is not a reasoning-gym dataset; did you mean basic_arithmetic"),
        ({"dataset": "basic_arithmetic", "colour": 1}, r"\[env\].kwargs colour: not a setting of reasoning-gym's 'basic_arithmetic' \(it takes .*max_terms"),
        ({"dataset": "basic_arithmetic", "min_terms": 4, "max_terms": 2}, r"refused .*AssertionError: max_terms must be >= min_terms"),
        ({"dataset": "basic_arithmetic", "size": 0}, r"size must be a positive integer"),
    ],
)  # fmt: skip
def test_bad_arguments_are_one_line_naming_the_setting(kwargs: dict, pattern: str) -> None:
    with pytest.raises(EnvironmentLoadError, match=pattern) as raised:
        load_environment_handle(SPEC, kwargs)
    assert "\n" not in str(raised.value)


@pytest.mark.slow  # 15 s in a loaded suite run (docs/testing.md)
def test_preflight_and_rollflow_train_refuse_a_bad_dataset_in_one_line(tmp_path: Path) -> None:
    config = load_config(REPO / "configs" / "reasoning_gym.toml")
    bad = replace(config, env=replace(config.env, kwargs={"dataset": "no_such_set"}))
    with pytest.raises(PreflightError, match="no_such_set' is not a reasoning-gym dataset; it has"):
        check_environment(bad)
    path = tmp_path / "bad.toml"
    path.write_text(config_to_toml(bad))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PREFECT_API_URL", None)
    done = subprocess.run(
        [sys.executable, "-m", "rollflow.flows.cli", "train", str(path), "--run-dir", str(tmp_path / "run")],
        env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 1
    (line,) = done.stderr.splitlines()
    assert line.startswith("rollflow train: ") and "[env].kwargs dataset = 'no_such_set'" in line
    assert "basic_arithmetic" in line
    assert not (tmp_path / "run").exists()


def test_the_worked_config_loads_fifty_validation_tasks() -> None:
    handle = check_environment(load_config(REPO / "configs" / "reasoning_gym.toml"))
    assert len(handle.tasks("train")) == 200 and len(handle.tasks("validation")) == 50
    assert len(dataset_names()) > 50


@pytest.mark.slow
def test_two_steps_of_rollflow_train_on_the_tiny_model(
    tiny_model_dir: Path, tmp_path: Path, prefect_harness: object
) -> None:
    run_dir = train_tiny_on(tiny_model_dir, tmp_path, SPEC, {**KWARGS, "size": 4, "num_validation": 2}, max_turns=1)
    con = open_run_sql(run_dir)
    _, rows = run_query(
        con,
        "SELECT e.split, e.step, count(*), count_if(e.task_id LIKE 'reasoning_gym/basic_arithmetic/%'), "
        "count_if(s.reward IS NOT NULL) FROM episodes e JOIN scores s USING (run_id, split, step, episode_id) "
        "GROUP BY ALL ORDER BY ALL",
    )
    train = [row for row in rows if row[0] == "train"]
    assert [row[1] for row in train] == [0, 1]
    assert all(row[2] == row[3] == row[4] == 4 for row in train)  # 2 tasks x 2 episodes, all scored
    _, steps = run_query(con, "SELECT count(*) FROM steps")
    assert steps == [(2,)]
