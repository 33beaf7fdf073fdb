"""What the episode runner returns for one played episode, whatever the environment style.

Failures and stop reasons are data here, not exceptions: an episode whose environment
raised carries ``error`` and still comes back, so one bad episode never sinks a batch.

Exactly one of these holds for a finished episode:
- ``terminated``: the environment ended it (hook style ``done=True``, async ``terminated``);
- ``truncated`` with a ``truncation_cause``;
- ``error`` is set (the environment or the policy raised; the episode is not trained on).

Token counts come from ``actions``: ``context_tokens`` is the length of the context the
episode ended at (the count restarts at each ``reset``), ``total_tokens`` every token
processed (a reset's re-rendered history counted again).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rollflow.envs.agent import FinishReason
from rollflow.envs.types import Message, TruncationCause


@dataclass(frozen=True)
class ActionTokens:
    """The tokens of one assistant action and the context appended just before it."""

    prompt_delta_ids: tuple[int, ...]  # context since the previous action: mask 0
    reset: bool  # prompt_delta_ids is a whole re-rendered prompt: a new sample starts here
    token_ids: tuple[int, ...]  # sampled: mask 1
    logprobs: tuple[float, ...]  # sampler log-probabilities, one per token_ids entry
    finish_reason: FinishReason

    def __post_init__(self) -> None:
        assert len(self.token_ids) == len(self.logprobs), (
            f"{len(self.token_ids)} action tokens but {len(self.logprobs)} logprobs"
        )


@dataclass(frozen=True)
class EpisodeRollout:
    messages: tuple[Message, ...]  # the whole transcript, opening messages included
    response_text: str  # the text scored (hook style: final_response_text or last action)
    turns: int  # assistant actions sampled
    terminated: bool
    truncated: bool
    truncation_cause: TruncationCause | None
    error: str | None = None  # "ExceptionType: message" from the env or the policy
    env_reward: float | None = None  # async style: the reward of the step that ended it
    env_metrics: Mapping[str, float] = field(default_factory=dict)
    step_metadata: tuple[Mapping[str, Any], ...] = ()  # hook style: each step's metadata
    actions: tuple[ActionTokens, ...] = ()  # empty for policies that give no tokens
    latency_s: float = 0.0  # wall time of the whole episode
    policy_version: int = 0
    sampling_attempts: int = 0  # generation attempts, retries after deadlines included
    # The server (index into the policy's vLLM servers, ``[rollout].base_urls`` or the managed
    # replicas) that sampled its last action; None for policies without servers. Every action
    # of an episode goes to one server unless a failed request was retried on the next.
    replica: int | None = None

    def __post_init__(self) -> None:
        endings = int(self.terminated) + int(self.truncated) + int(self.error is not None)
        assert endings == 1, (
            f"an episode ends exactly one way; got terminated={self.terminated}, "
            f"truncated={self.truncated}, error={self.error!r}"
        )
        assert self.truncated == (self.truncation_cause is not None), (
            "truncation_cause is set exactly when the episode is truncated"
        )

    @property
    def final_context_actions(self) -> tuple[ActionTokens, ...]:
        """The actions whose tokens make up the final context: from the last reset on (a
        reset's delta is the whole re-rendered prompt, so the count restarts there)."""
        resets = [index for index, action in enumerate(self.actions) if action.reset]
        return self.actions[resets[-1] if resets else 0 :]

    @property
    def context_tokens(self) -> int:
        """The context length the episode ended at (what a length budget measures): the
        last sample's tokens, context and sampled. 0 for tokenless (scripted) episodes."""
        return sum(len(a.prompt_delta_ids) + len(a.token_ids) for a in self.final_context_actions)

    @property
    def total_tokens(self) -> int:
        """Tokens processed: every action's context delta and sampled tokens, so each reset
        counts its re-rendered history again (the length of all the episode's samples)."""
        return sum(len(a.prompt_delta_ids) + len(a.token_ids) for a in self.actions)
