"""Deterministic synthetic records, for tests and the storage benchmark.

Every field is a pure function of the indices passed in, so a test can recompute what a
record should hold without storing it. The episodes look like a small tool-use game: a
system and user message, one tool call and its result, a final answer; how an episode
ends cycles through every ending so each metric has something to count. Logprobs are
float32 values (see ``storage/arrow_schemas.py``) so round trips are exact.
"""

from __future__ import annotations

import struct

from rollflow.envs.episode import ActionTokens, EpisodeRollout
from rollflow.envs.types import Message, TruncationCause
from rollflow.storage.records import EpisodeRecord, SampleRecord, ScoreRecord

# (terminated, truncation_cause, error): episode i ends the (i mod 8)-th way
_ENDINGS: tuple[tuple[bool, TruncationCause | None, str | None], ...] = (
    (True, None, None),
    (True, None, None),
    (True, None, None),
    (False, TruncationCause.MAX_TURNS, None),
    (False, TruncationCause.CONTEXT_OVERFLOW, None),
    (False, TruncationCause.ENV, None),
    (False, TruncationCause.PARSE_FAILURE, None),
    (False, None, "RuntimeError: the environment fell over"),
)


def as_float32(value: float) -> float:
    """The float32 nearest ``value``, as a Python float (what a float32 column returns)."""
    return float(struct.unpack("f", struct.pack("f", value))[0])


def group_id_for(split: str, step: int, task_index: int) -> str:
    return f"{split}/{step}/{task_index}"


def episode_id_for(split: str, step: int, task_index: int, index_in_group: int) -> str:
    return f"{group_id_for(split, step, task_index)}/{index_in_group}"


def _messages(task_index: int, index_in_group: int) -> tuple[Message, ...]:
    a, b = task_index % 97, index_in_group + 2
    call_id = f"call_{task_index}_{index_in_group}"
    return (
        {"role": "system", "content": "You can call the calculator tool."},
        {"role": "user", "content": f"What is {a} * {b}?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "calculator", "arguments": f'{{"expression": "{a}*{b}"}}'},
                }
            ],
        },
        {"role": "tool", "content": str(a * b), "tool_call_id": call_id, "name": "calculator"},
        {"role": "assistant", "content": str(a * b)},
    )


def _actions(seed: int) -> tuple[ActionTokens, ...]:
    first = ActionTokens(
        prompt_delta_ids=tuple(range(1, 31)),
        reset=False,
        token_ids=(seed % 1000 + 7, 11, 12, 13),
        logprobs=tuple(as_float32(-0.125 * k) for k in range(1, 5)),
        finish_reason="stop",
    )
    second = ActionTokens(
        prompt_delta_ids=(40, 41, 42, 43, 44),
        reset=False,
        token_ids=(21, 22),
        logprobs=(as_float32(-0.5), as_float32(-0.0625)),
        finish_reason="stop",
    )
    return (first, second)


def synthetic_episode(
    run_id: str, step: int, task_index: int, index_in_group: int, split: str = "train"
) -> EpisodeRecord:
    seed = task_index * 31 + index_in_group
    terminated, cause, error = _ENDINGS[seed % len(_ENDINGS)]
    messages = _messages(task_index, index_in_group)
    rollout = EpisodeRollout(
        messages=messages,
        response_text=messages[-1]["content"],
        turns=2,
        terminated=terminated,
        truncated=cause is not None,
        truncation_cause=cause,
        error=error,
        env_reward=float(seed % 2) if terminated else None,
        env_metrics={"tool_calls": 1.0} if terminated else {},
        step_metadata=({"tool": "calculator"}, {"final": True}),
        actions=_actions(seed),
        latency_s=0.25 + 0.01 * (seed % 10),
        policy_version=step,
        sampling_attempts=2,
    )
    return EpisodeRecord(
        run_id=run_id,
        step=step,
        split=split,
        task_id=f"task-{task_index}",
        group_id=group_id_for(split, step, task_index),
        episode_id=episode_id_for(split, step, task_index, index_in_group),
        index_in_group=index_in_group,
        rollout=rollout,
    )


def synthetic_score(episode: EpisodeRecord, reward: float, advantage: float = 0.0) -> ScoreRecord:
    """A score for ``episode``; the group statistics are left for the caller to mean something."""
    return ScoreRecord(
        run_id=episode.run_id,
        step=episode.step,
        split=episode.split,
        task_id=episode.task_id,
        group_id=episode.group_id,
        episode_id=episode.episode_id,
        reward=reward,
        threshold=1.0,
        components={"correct": reward},
        overlong_penalty=0.0,
        final_reward=reward,
        passed=reward >= 1.0,
        group_mean=0.0,
        group_std=0.0,
        group_size=1,
        zero_variance=False,
        advantage=advantage,
        trained=episode.rollout.error is None,
    )


def synthetic_sample(episode: EpisodeRecord, advantage: float) -> SampleRecord:
    """The one training sequence of ``episode``: each action's context then its tokens."""
    input_ids: list[int] = []
    loss_mask: list[int] = []
    logprobs: list[float] = []
    for action in episode.rollout.actions:
        input_ids += [*action.prompt_delta_ids, *action.token_ids]
        loss_mask += [0] * len(action.prompt_delta_ids) + [1] * len(action.token_ids)
        logprobs += [0.0] * len(action.prompt_delta_ids) + list(action.logprobs)
    return SampleRecord(
        run_id=episode.run_id,
        step=episode.step,
        sample_id=f"{episode.episode_id}#0",
        episode_id=episode.episode_id,
        group_id=episode.group_id,
        input_ids=tuple(input_ids),
        loss_mask=tuple(loss_mask),
        advantages=tuple(advantage if m else 0.0 for m in loss_mask),
        sampler_logprobs=tuple(logprobs),
    )
