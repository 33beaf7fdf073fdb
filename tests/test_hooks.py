"""The hook-style base class: its defaults (score_episodes, sft_completion, examples)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from rollflow.envs.hooks import (
    EnvironmentMultiTurn,
    as_task_example,
    call_hook,
    example_prompt_text,
    messages_from_output,
    overrides,
    score_each,
)
from rollflow.envs.types import (
    EnvironmentEpisode,
    EnvironmentStepResult,
    Message,
    RewardResult,
    TaskExample,
)


class SlowScoringEnv(EnvironmentMultiTurn):
    """Scores an episode by the length of its response; tracks scorers in flight."""

    max_score_concurrency = 2

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_flight = 0
        self.most_in_flight = 0

    def start_episode(self, example: TaskExample, prompt_text: str) -> list[Message]:
        return [{"role": "user", "content": prompt_text}]

    def max_episode_turns(self, example: TaskExample) -> int:
        return 1

    def step_episode(
        self, example: TaskExample, messages: list[Message], assistant_response: str
    ) -> EnvironmentStepResult:
        return EnvironmentStepResult(done=True)

    def score_episode(self, example: TaskExample, episode: EnvironmentEpisode) -> RewardResult:
        with self.lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        time.sleep(0.02)
        with self.lock:
            self.in_flight -= 1
        if episode.response_text == "boom":
            raise RuntimeError("cannot score boom")
        return RewardResult(score=float(len(episode.response_text)))


class AsyncScoringEnv(SlowScoringEnv):
    async def score_episode(self, example: TaskExample, episode: EnvironmentEpisode) -> RewardResult:  # type: ignore[override]
        await asyncio.sleep(0)
        return RewardResult(score=2.0)


EXAMPLE = TaskExample(input="q")


def _episodes(*texts: str) -> list[EnvironmentEpisode]:
    return [EnvironmentEpisode(messages=(), response_text=text) for text in texts]


def test_score_episodes_default_scores_each_in_order_within_the_concurrency_bound() -> None:
    env = SlowScoringEnv()
    results = env.score_episodes(EXAMPLE, _episodes("a", "bb", "ccc", "dddd", "eeeee"))
    assert [r.score for r in results] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert env.most_in_flight == 2


def test_score_episodes_default_raises_the_scorer_error() -> None:
    with pytest.raises(RuntimeError, match="cannot score boom"):
        SlowScoringEnv().score_episodes(EXAMPLE, _episodes("a", "boom"))


def test_score_each_keeps_failures_apart() -> None:
    outcomes = score_each(SlowScoringEnv(), EXAMPLE, _episodes("a", "boom", "cc"))
    assert isinstance(outcomes[1], RuntimeError)
    assert [o.score for o in (outcomes[0], outcomes[2]) if isinstance(o, RewardResult)] == [1.0, 2.0]
    assert score_each(SlowScoringEnv(), EXAMPLE, []) == []


def test_an_async_score_episode_works_with_the_default_and_from_inside_a_loop() -> None:
    async def inside_a_running_loop() -> list[RewardResult]:
        return AsyncScoringEnv().score_episodes(EXAMPLE, _episodes("a", "b"))

    assert [r.score for r in asyncio.run(inside_a_running_loop())] == [2.0, 2.0]


def test_score_episode_returning_the_wrong_type_is_an_error() -> None:
    class Wrong(SlowScoringEnv):
        def score_episode(self, example: TaskExample, episode: EnvironmentEpisode) -> RewardResult:
            return 1.0  # type: ignore[return-value]

    [outcome] = score_each(Wrong(), EXAMPLE, _episodes("a"))
    assert isinstance(outcome, TypeError) and "float, not rollflow.envs.types.RewardResult" in str(outcome)


def test_sft_completion_scalar_becomes_one_assistant_message() -> None:
    env = SlowScoringEnv()
    assert env.sft_completion(TaskExample(input="q", output=42)) == [{"role": "assistant", "content": "42"}]
    assert env.sft_completion(TaskExample(input="q", output="yes")) == [
        {"role": "assistant", "content": "yes"}
    ]


def test_sft_completion_message_list_and_messages_dict_are_the_transcript() -> None:
    transcript = [
        {"role": "assistant", "content": "<tool_call>{}</tool_call>"},
        {"role": "tool", "content": "3", "tool_call_id": "call_0", "name": "calc"},
        {"role": "assistant", "content": "3"},
    ]
    env = SlowScoringEnv()
    assert env.sft_completion(TaskExample(input="q", output=transcript)) == transcript
    assert env.sft_completion(TaskExample(input="q", output={"messages": transcript})) == transcript


@pytest.mark.parametrize(
    ("output", "problem"),
    [
        (None, "no output"),
        ({"answer": 1}, "needs a 'messages' key"),
        ([{"role": "assistant"}], "message 0 needs text 'role' and 'content'"),
        (["just text"], "message 0 is a str"),
        ({1, 2}, "scalar or a list of messages"),
    ],
)
def test_sft_completion_refuses_what_is_not_a_target(output: object, problem: str) -> None:
    with pytest.raises((ValueError, TypeError), match=problem):
        messages_from_output(output, where="example x")


def test_examples_default_reads_a_flat_dataset_for_both_splits() -> None:
    env = SlowScoringEnv()
    env.dataset = [{"input": "a", "output": 1, "difficulty": "easy"}, TaskExample(input="b", id="b1")]  # type: ignore[attr-defined]
    train = env.examples("train")
    assert train == env.examples("validation")
    assert train[0] == TaskExample(input="a", output=1, metadata={"difficulty": "easy"})
    assert train[1].id == "b1"


def test_examples_default_reads_a_split_mapping_and_names_missing_parts() -> None:
    env = SlowScoringEnv()
    env.dataset = {"train": [{"input": "t"}], "validation": [{"input": "v"}]}  # type: ignore[attr-defined]
    assert [e.input for e in env.examples("validation")] == ["v"]
    env.dataset = {"train": [{"input": "t"}]}  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="no 'validation' split"):
        env.examples("validation")
    with pytest.raises(ValueError, match="unknown split 'test'"):
        env.examples("test")  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match="no `dataset` attribute"):
        SlowScoringEnv().examples("train")


def test_a_row_without_input_is_refused() -> None:
    with pytest.raises(ValueError, match=r"rows\[3\] must be a TaskExample or a dict with an 'input' key"):
        as_task_example({"question": "?"}, "rows[3]")


def test_prompt_text_is_the_input_as_text() -> None:
    assert example_prompt_text(TaskExample(input="hello")) == "hello"
    assert example_prompt_text(TaskExample(input={"b": 1, "a": [2]})) == '{"a": [2], "b": 1}'


def test_tool_specs_default_is_empty_and_abstract_hooks_are_required() -> None:
    assert SlowScoringEnv().tool_specs(EXAMPLE) == ()
    assert not overrides(SlowScoringEnv(), "score_episodes")

    class Incomplete(EnvironmentMultiTurn):
        pass

    with pytest.raises(TypeError, match="abstract"):
        Incomplete()  # type: ignore[abstract]


def test_call_hook_runs_plain_hooks_off_the_loop_and_awaits_async_ones() -> None:
    loop_thread = threading.get_ident()

    def plain(x: int) -> tuple[int, bool]:
        return x + 1, threading.get_ident() != loop_thread

    async def coroutine(x: int) -> int:
        return x * 2

    async def both() -> tuple[tuple[int, bool], int]:
        return await call_hook(plain, 1), await call_hook(coroutine, 4)

    assert asyncio.run(both()) == ((2, True), 8)
