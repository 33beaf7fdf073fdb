"""Scoring: penalties, parse failures, group baselines and advantages by hand; the stage."""

from __future__ import annotations

import asyncio
import json
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest

from rollflow.config.run import parse_config
from rollflow.envs.episode import ActionTokens, EpisodeRollout
from rollflow.envs.handle import EpisodeLimits, EpisodeScore
from rollflow.envs.hook_handle import to_environment_episode
from rollflow.envs.hooks import EnvironmentMultiTurn
from rollflow.envs.runner import handle_from_hook
from rollflow.envs.scripted import constant_policy
from rollflow.envs.types import (
    EnvironmentEpisode,
    EnvironmentStepResult,
    Message,
    RewardResult,
    TaskExample,
    TruncationCause,
)
from rollflow.flows.step import run_once
from rollflow.storage.records import EpisodeRecord
from rollflow.storage.runfolder import RunFolder
from rollflow.storage.schemas import episode_records_to_table, table_to_score_records
from rollflow.tasks.scoring import score_stage
from rollflow.tasks.shaping import ScoringError, ScoringSettings, score_episodes_to_records, score_groups

EPS = 1e-6


def rollout(
    cause: TruncationCause | None = None, *, error: str | None = None, tokens: int = 0,
    text: str = "done",
) -> EpisodeRollout:
    actions = (ActionTokens(tuple(range(tokens - 1)), False, (7,), (-0.5,), "stop"),) if tokens else ()
    return EpisodeRollout(
        messages=({"role": "user", "content": "q"}, {"role": "assistant", "content": text}),
        response_text=text, turns=1,
        terminated=cause is None and error is None, truncated=cause is not None,
        truncation_cause=cause, error=error, actions=actions,
    )


def episode(r: EpisodeRollout, task: int = 0, index: int = 0, split: str = "train") -> EpisodeRecord:
    group = f"{split}/0/{task}"
    return EpisodeRecord("run", 0, split, f"task-{task}", group, f"{group}/{index}", index, r)


def group(*rollouts: EpisodeRollout, task: int = 0) -> list[EpisodeRecord]:
    return [episode(r, task, i) for i, r in enumerate(rollouts)]


def env_score(reward: float, threshold: float | None = None, error: str | None = None) -> EpisodeScore:
    return EpisodeScore(reward=reward, threshold=threshold, components={"r": reward}, error=error)


# ---------------------------------------------------------------- rewards and advantages


def test_group_relative_advantages_scaled_by_std() -> None:
    eps = group(rollout(), rollout(), rollout(), rollout())
    records = score_episodes_to_records(eps, [env_score(r) for r in (1.0, 0.0, 1.0, 0.0)], ScoringSettings())
    assert [r.group_mean for r in records] == [0.5] * 4
    assert records[0].group_std == pytest.approx(0.5)  # population std
    assert [r.advantage for r in records] == pytest.approx([0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS)] * 2)
    assert all(r.trained and not r.zero_variance and r.group_size == 4 for r in records)
    assert [r.components for r in records][0] == {"r": 1.0}


def test_mean_centred_only_without_std_scaling() -> None:
    eps = group(rollout(), rollout(), rollout())
    settings = ScoringSettings(scale_advantages_by_std=False)
    records = score_episodes_to_records(eps, [env_score(r) for r in (3.0, 0.0, 0.0)], settings)
    assert [r.advantage for r in records] == pytest.approx([2.0, -1.0, -1.0])


def test_parse_failure_gets_failed_parse_reward_and_overlong_gets_penalty() -> None:
    eps = group(
        rollout(TruncationCause.PARSE_FAILURE, tokens=2000),
        rollout(TruncationCause.CONTEXT_OVERFLOW, tokens=100),
        rollout(TruncationCause.ENV, tokens=2000),
        rollout(),
    )
    settings = ScoringSettings(failed_parse_reward=-0.1, max_model_length=2048, overlong_penalty_factor=0.5)
    records = score_episodes_to_records(eps, [env_score(0.7)] * 4, settings)
    assert [r.reward for r in records] == [0.7] * 4  # the environment's own reward is kept
    assert [r.overlong_penalty for r in records] == pytest.approx([0.0, -0.5, 0.0, 0.0])
    assert [r.final_reward for r in records] == pytest.approx([-0.1, 0.2, 0.7, 0.7])
    finals = [-0.1, 0.2, 0.7, 0.7]
    mean = sum(finals) / 4
    std = math.sqrt(sum((f - mean) ** 2 for f in finals) / 4)
    assert records[0].group_mean == pytest.approx(mean) and records[0].group_std == pytest.approx(std)
    assert records[1].advantage == pytest.approx((0.2 - mean) / (std + EPS))


def test_errored_episodes_leave_the_baseline_and_are_never_trained() -> None:
    eps = group(rollout(), rollout(), rollout(error="RuntimeError: boom"), rollout())
    scores = [env_score(1.0), env_score(0.0), env_score(0.0, error="not scored"), env_score(0.0, error="Scorer: bad")]
    records = score_episodes_to_records(eps, scores, ScoringSettings(scale_advantages_by_std=False))
    assert records[0].group_size == 2 and records[0].group_mean == pytest.approx(0.5)
    assert [r.advantage for r in records] == pytest.approx([0.5, -0.5, 0.0, 0.0])
    assert [r.trained for r in records] == [True, True, False, False]
    assert [r.passed for r in records] == [True, False, False, False]
    assert records[2].scoring_error == "not scored" and records[3].scoring_error == "Scorer: bad"


def test_validation_episodes_are_never_trained() -> None:
    eps = [episode(rollout(), 0, i, split) for split in ("train", "validation") for i in range(2)]
    records = score_episodes_to_records(eps, [env_score(r) for r in (1.0, 0.0, 1.0, 0.0)], ScoringSettings())
    assert [r.trained for r in records] == [True, True, False, False]
    assert [r.advantage != 0.0 for r in records] == [True] * 4  # still scored like a training group


def test_overlong_masking_keeps_truncated_rewards_in_the_baseline() -> None:
    eps = group(rollout(), rollout(TruncationCause.MAX_TURNS), rollout(TruncationCause.ENV))
    settings = ScoringSettings(overlong_masking=True, scale_advantages_by_std=False)
    records = score_episodes_to_records(eps, [env_score(r) for r in (1.0, 0.0, 0.5)], settings)
    assert records[0].group_mean == pytest.approx(0.5) and records[0].group_size == 3
    assert records[0].advantage == pytest.approx(0.5)
    assert [r.trained for r in records] == [True, False, False]  # truncated of any cause


def test_zero_variance_groups_are_marked_and_skipped_only_with_dynamic_sampling() -> None:
    eps = group(rollout(), rollout()) + group(rollout(), rollout(), task=1)
    scores = [env_score(1.0), env_score(1.0), env_score(1.0), env_score(0.0)]
    plain = score_episodes_to_records(eps, scores, ScoringSettings())
    assert [r.zero_variance for r in plain] == [True, True, False, False]
    assert [r.advantage for r in plain[:2]] == [0.0, 0.0]
    assert all(r.trained for r in plain)
    dynamic = score_episodes_to_records(eps, scores, ScoringSettings(dynamic_sampling=True))
    assert [r.trained for r in dynamic] == [False, False, True, True]


def test_group_of_one_is_zero_variance() -> None:
    [record] = score_episodes_to_records(group(rollout()), [env_score(1.0)], ScoringSettings())
    assert record.zero_variance and record.advantage == 0.0 and record.group_size == 1


def test_passed_uses_the_threshold_else_positive_reward() -> None:
    eps = group(rollout(), rollout(), rollout())
    scores = [env_score(0.5, threshold=0.5), env_score(0.4, threshold=0.5), env_score(0.1)]
    assert [r.passed for r in score_episodes_to_records(eps, scores, ScoringSettings())] == [True, False, True]


def test_records_keep_input_order_and_lengths_must_match() -> None:
    eps = group(rollout(), rollout(), task=1) + group(rollout(), rollout(), task=0)
    records = score_episodes_to_records(eps, [env_score(r) for r in (1, 0, 0, 1)], ScoringSettings())
    assert [r.episode_id for r in records] == [e.episode_id for e in eps]
    with pytest.raises(ScoringError, match="3 episodes but 2 scores"):
        score_episodes_to_records(eps[:3], [env_score(0.0)] * 2, ScoringSettings())


# ---------------------------------------------------------------- the stage


class AnswerEnv(EnvironmentMultiTurn):
    """Scores 1 when the answer says 42; counts how often the group scorer is called."""

    dataset = [{"input": "the answer?", "id": "task-0"}, {"input": "again?", "id": "task-1"}]
    group_calls = 0

    def start_episode(self, example: TaskExample, prompt_text: str) -> list[Message]:
        return [{"role": "user", "content": prompt_text}]

    def max_episode_turns(self, example: TaskExample) -> int:
        return 1

    def step_episode(self, example: TaskExample, messages: list[Message], assistant_response: str) -> EnvironmentStepResult:
        return EnvironmentStepResult(done=True)

    def score_episode(self, example: TaskExample, episode: EnvironmentEpisode) -> RewardResult:
        return RewardResult(score=1.0 if "42" in episode.response_text else 0.0, threshold=1.0)

    def score_episodes(self, example: TaskExample, episodes: list[EnvironmentEpisode]) -> list[RewardResult]:
        type(self).group_calls += 1
        return [self.score_episode(example, e) for e in episodes]


def load_environment() -> AnswerEnv:
    return AnswerEnv()


def write_episodes(run_dir: Path, split: str = "train") -> list[EpisodeRecord]:
    eps = [
        episode(rollout(text="42"), 0, 0, split), episode(rollout(text="7"), 0, 1, split),
        episode(rollout(text="42"), 1, 0, split), episode(rollout(TruncationCause.PARSE_FAILURE), 1, 1, split),
    ]
    RunFolder(run_dir).write_stage(episode_records_to_table(eps), 0, "episodes", split)
    return eps


@pytest.mark.parametrize("split", ["train", "validation"])
def test_score_stage_scores_each_group_once_and_writes_scores(tmp_path: Path, split: str) -> None:
    config = parse_config({"env": {"name": f"{__name__}:load_environment"}})
    eps = write_episodes(tmp_path, split)
    AnswerEnv.group_calls = 0
    p = RunFolder(tmp_path).step_paths(0, split)
    path = score_stage(config, p.admitted, p.scores)
    assert AnswerEnv.group_calls == 2
    records = table_to_score_records(RunFolder(tmp_path).read_stage(0, "scores", split))
    assert [r.episode_id for r in records] == [e.episode_id for e in eps]
    assert [r.final_reward for r in records] == pytest.approx([1.0, 0.0, 1.0, -0.1])
    assert [r.passed for r in records] == [True, False, True, False]
    assert run_once(score_stage, config, p.admitted, out=p.scores) == path  # finished: not scored again
    assert AnswerEnv.group_calls == 2


def test_score_stage_accepts_a_prebuilt_handle_and_names_unknown_tasks(tmp_path: Path) -> None:
    write_episodes(tmp_path)
    env = AnswerEnv()
    env.dataset = [{"input": "other", "id": "task-9"}]
    with pytest.raises(ScoringError, match="task 'task-0' is not among the environment's train tasks"):
        p = RunFolder(tmp_path).step_paths(0)
        score_stage(parse_config({}), p.admitted, p.scores, handle=handle_from_hook(env))


# ---------------------------------------------------------------- issue 13: the reward path

PARSE, MAX_TURNS = TruncationCause.PARSE_FAILURE, TruncationCause.MAX_TURNS
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
SORRY = "Sorry, I cannot help."
BROKEN = '<tool_call>{"name": "refund_order", oops}</tool_call>'  # closed, but not JSON


class RefundEnv(EnvironmentMultiTurn):
    """The reference's refund agent: its scorer ``json.loads`` every ``<tool_call>`` block of
    the transcript, so it raises on exactly the episodes that ended in a parse failure."""

    dataset = [{"input": "Refund my last order.", "output": "refund_order", "id": "task-0"}]

    def start_episode(self, example: TaskExample, prompt_text: str) -> list[Message]:
        return [{"role": "system", "content": "Call tools with <tool_call>{...}</tool_call>."},
                {"role": "user", "content": prompt_text}]

    def max_episode_turns(self, example: TaskExample) -> int:
        return 3

    def step_episode(
        self, example: TaskExample, messages: list[Message], assistant_response: str
    ) -> EnvironmentStepResult:
        if TOOL_CALL.findall(assistant_response):
            result: Message = {"role": "user", "content": "<tool_result>ok</tool_result>"}
            return EnvironmentStepResult(done=False, messages=(result,))
        return EnvironmentStepResult(done=True, final_response_text=assistant_response)

    def score_episode(self, example: TaskExample, episode: EnvironmentEpisode) -> RewardResult:
        used = [json.loads(b)["name"] for m in episode.messages
                for b in TOOL_CALL.findall(m["content"]) if m["role"] == "assistant"]
        return RewardResult(score=1.0 if str(example.output) in used else 0.0, threshold=1.0)


class GroupRefundEnv(RefundEnv):
    """Scores the group in one call: one raising episode would error all of them."""

    def score_episodes(self, example: TaskExample, episodes: list[EnvironmentEpisode]) -> list[RewardResult]:
        return [self.score_episode(example, e) for e in episodes]


@pytest.mark.parametrize("env_class", [RefundEnv, GroupRefundEnv])
def test_parse_failures_get_failed_parse_reward_when_the_scorer_raises_on_them(
    env_class: type[RefundEnv],
) -> None:
    env = env_class()
    handle = handle_from_hook(env)
    [item] = handle.tasks("train")
    policies = [constant_policy(SORRY), constant_policy(SORRY), constant_policy(BROKEN), constant_policy(BROKEN)]
    eps = group(*(asyncio.run(handle.play(item, p, EpisodeLimits())) for p in policies))
    assert [e.rollout.truncation_cause for e in eps] == [None, None, PARSE, PARSE]
    with pytest.raises(json.JSONDecodeError):  # the scorer really raises on them
        env.score_episode(item.payload, to_environment_episode(eps[2].rollout))
    scores = asyncio.run(score_groups(handle, "train", eps, concurrency=2))
    settings = ScoringSettings(failed_parse_reward=-0.1, scale_advantages_by_std=False)
    records = score_episodes_to_records(eps, scores, settings)
    assert [r.final_reward for r in records] == pytest.approx([0.0, 0.0, -0.1, -0.1])
    assert [r.scoring_error for r in records] == [None] * 4
    assert records[0].group_size == 4 and not records[0].zero_variance  # trains 0 against -0.1
    assert [r.advantage for r in records] == pytest.approx([0.05, 0.05, -0.05, -0.05])
    assert all(r.trained and not r.passed for r in records)


def test_a_parse_failure_ignores_the_scorers_error() -> None:
    eps = group(rollout(), rollout(PARSE))
    scores = [env_score(0.0), env_score(0.0, error="JSONDecodeError: Expecting value")]
    records = score_episodes_to_records(eps, scores, ScoringSettings(failed_parse_reward=-0.1))
    assert records[1].final_reward == pytest.approx(-0.1) and records[1].scoring_error is None
    assert records[0].group_size == 2 and records[1].trained and records[1].advantage < 0


def rerendered_episode(cause: TruncationCause | None) -> EpisodeRollout:
    """Four actions of 50 sampled tokens; before each later one the chat template re-renders
    the whole 1,100-token prompt (reset). The context ends at 1,150; the deltas sum to 4,600."""
    sampled, logprobs = (7,) * 50, (-0.5,) * 50
    first = ActionTokens(tuple(range(1100)), False, sampled, logprobs, "stop")
    later = ActionTokens(tuple(range(1100)), True, sampled, logprobs, "stop")
    return replace(rollout(cause), turns=4, actions=(first, later, later, later))


def test_overlong_penalty_counts_the_final_context_not_every_rerendered_prompt() -> None:
    settings = ScoringSettings(max_model_length=2048, overlong_buffer_tokens=1024)
    [record] = score_episodes_to_records(group(rerendered_episode(MAX_TURNS)), [env_score(1.0)], settings)
    assert record.overlong_penalty == pytest.approx(-(1150 - 1024) / 1024)  # not -1 for 4,600 tokens
    assert rerendered_episode(MAX_TURNS).context_tokens == 1150


def test_default_buffer_spares_a_short_max_turns_episode() -> None:
    settings = ScoringSettings.from_config(parse_config({"rollout": {"max_model_length": 2048}}))
    eps = group(rollout(MAX_TURNS, tokens=300), rollout(MAX_TURNS, tokens=2000))
    records = score_episodes_to_records(eps, [env_score(0.1)] * 2, settings)
    assert records[0].overlong_penalty == 0.0 and records[0].final_reward == pytest.approx(0.1)
    buffer = 2048 // 5  # DAPO's L_max / 5
    assert records[1].overlong_penalty == pytest.approx(-(2000 - (2048 - buffer)) / buffer)


def test_passed_is_the_environments_verdict_not_the_shaped_reward() -> None:
    eps = group(rollout(MAX_TURNS, tokens=2040), rollout(PARSE), rollout(), rollout(error="RuntimeError: boom"))
    scores = [
        env_score(1.0, 1.0), env_score(1.0, 1.0), env_score(0.9, 1.0), env_score(1.0, 1.0, error="not scored"),
    ]
    settings = ScoringSettings(max_model_length=2048, overlong_buffer_tokens=512, failed_parse_reward=2.0)
    records = score_episodes_to_records(eps, scores, settings)
    assert records[0].final_reward < 1.0 and records[1].final_reward == 2.0
    assert [r.passed for r in records] == [True, False, False, False]
