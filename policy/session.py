"""What every generation backend shares: seeds, the token session, the finish rule, the error root.

- ``SeededPolicy`` is the base of the three policies (transformers, vLLM, OpenAI). It holds
  the sampling settings, the acting version and the episodes' seed identities
  (``rollflow.policy.sampling.EpisodeSeeds``). Every request draws from
  ``request_seed(episode, turn, attempt)``: the settings' seed, the episode's identity (its
  opening prompt and occurrence), the turn and the attempt. ``reseed`` starts over from a
  new seed, so a step replays the same samples whatever ran in the process before it.
- ``TokenSession`` is one episode of a token-in, token-out backend (transformers, vLLM).
  It renders only what is new with the policy's ``ChatCodec``, checks the episode's context
  budget, asks its backend for tokens (``_sample``) and records them; a backend implements
  only ``_sample`` (and ``_release``, what closing frees).
- ``finish_reason`` is the one rule for why an action ended (below).
- ``GenerationError`` is the root of the backends' errors: every allowed attempt at an
  action failed, or a server refused it. The runner records one on the episode
  (``envs/handle.describe_error``: ``"<class name>: <message> (in <where>)"``).

Budgets, per the runner contract (envs/agent.py), for a token session:
- ``max_new = min(max_completion_tokens, max_model_length - len(context))``;
- a context that leaves no room for a single token returns ``finish_reason="context"``
  with no tokens and no sampling attempt (the prompt is never cut).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

from rollflow.envs.agent import FinishReason, PolicyAction, capped_completion
from rollflow.envs.types import Message, ToolSpec
from rollflow.policy.codec import ChatCodec, TokenState
from rollflow.policy.sampling import EpisodeSeeds, SamplingSettings, request_seed


class GenerationError(RuntimeError):
    """An action could not be generated: attempts ran out, or a server refused or failed."""


def finish_reason(
    *, stopped: bool, cut_by_server: bool, episode_tokens: int | None, max_model_length: int
) -> FinishReason:
    """Why an action ended, the same rule for every backend:

    - ``"stop"``: it ended on a stop token (a server's "stop" or "tool_calls");
    - ``"context"``: the episode's context is full, its tokens with the action's
      (``episode_tokens``) reaching ``max_model_length`` (so also when that and
      ``max_completion_tokens`` coincide), or the server's own context limit cut the action
      short of the tokens it was allowed (``cut_by_server``);
    - ``"length"``: ``max_completion_tokens`` ended it. ``episode_tokens=None`` (a server
      that reports no usage) reads as room left.
    """
    if stopped:
        return "stop"
    if cut_by_server:
        return "context"
    full = episode_tokens is not None and episode_tokens >= max_model_length
    return "context" if full else "length"


class SeededPolicy:
    """Settings, version and seeds of a ``Policy`` (envs/agent.py); the base of every backend."""

    # a request's seed is reduced to this many bits (HTTP servers take 31-bit seeds)
    seed_bits: ClassVar[int] = 63

    def __init__(self, settings: SamplingSettings | None, version: int) -> None:
        self.settings = settings or SamplingSettings()
        self.version = version
        self.episode_seeds = EpisodeSeeds()

    def reseed(self, seed: int) -> None:
        """Sample from ``seed`` from now on, as a fresh policy with that seed would."""
        self.settings = dataclasses.replace(self.settings, seed=seed)
        self.episode_seeds.reset()

    def request_seed(self, episode: tuple[int, int], turn: int, attempt: int) -> int:
        """The seed of one request: attempt ``attempt`` at turn ``turn`` of ``episode``."""
        return request_seed(self.settings.seed, *episode, turn, attempt) % 2**self.seed_bits


class TokenPolicy(SeededPolicy):
    """A ``SeededPolicy`` whose sessions are ``TokenSession``s: it renders with ``codec``."""

    codec: ChatCodec


PolicyT = TypeVar("PolicyT", bound=TokenPolicy)


@dataclass(frozen=True)
class Sampled:
    """What a backend sampled for one action."""

    token_ids: tuple[int, ...]  # the stop token included, when it has one
    logprobs: tuple[float, ...]  # one per token, of the distribution sampled from
    stopped: bool  # the last token is one of the codec's stop tokens
    cut_by_server: bool  # no stop token, and fewer tokens than allowed: the server's context limit
    attempts: int  # sampling attempts used, the successful one included
    replica: int | None = None  # the index of the server that answered (backends with servers)


class TokenSession(Generic[PolicyT]):
    """One episode of a token-in, token-out policy (a ``PolicySession``).

    Owns the episode's token state, its seed identity (from its first prompt), its turn
    counter and whether it is closed. Subclasses implement ``_sample``, and ``_release``
    for what closing frees; ``_history_rewritten`` hears of a template that rewrote history.
    """

    def __init__(self, policy: PolicyT, tool_specs: tuple[ToolSpec, ...]) -> None:
        self._policy = policy
        self._tool_specs = tool_specs
        self._episode: tuple[int, int] | None = None  # seed identity, from the first prompt
        self._state: TokenState | None = None
        self._turn = 0
        self._closed = False

    @property
    def episode(self) -> tuple[int, int]:
        """The episode's seed identity (known once its first prompt is rendered)."""
        assert self._episode is not None, "the episode is known from its first act()"
        return self._episode

    async def act(self, messages: Sequence[Message]) -> PolicyAction:
        if self._closed:
            raise RuntimeError("act() on a closed policy session")
        started = time.perf_counter()
        policy = self._policy
        state, delta, reset = policy.codec.next_prompt(self._state, messages, self._tool_specs)
        self._state = state
        if reset:
            self._history_rewritten()
        if self._episode is None:
            self._episode = policy.episode_seeds.identity(state.text)
        settings = policy.settings
        budget = settings.max_model_length - len(state)
        if budget <= 0:  # not even one token fits: the prompt is never cut
            return PolicyAction(
                text="", prompt_delta_ids=delta, reset=reset, finish_reason="context",
                latency_s=time.perf_counter() - started, sampling_attempts=0,
            )  # fmt: skip
        max_new = min(capped_completion(settings.max_completion_tokens), budget)
        turn, self._turn = self._turn, self._turn + 1
        sampled = await self._sample(state.token_ids, max_new, turn)
        self._state = policy.codec.record_action(state, sampled.token_ids)
        ending = finish_reason(
            stopped=sampled.stopped, cut_by_server=sampled.cut_by_server,
            episode_tokens=len(state) + len(sampled.token_ids), max_model_length=settings.max_model_length,
        )  # fmt: skip
        return PolicyAction(
            text=policy.codec.action_text(sampled.token_ids),
            token_ids=sampled.token_ids,
            logprobs=sampled.logprobs,
            prompt_delta_ids=delta,
            reset=reset,
            finish_reason=ending,
            latency_s=time.perf_counter() - started,
            sampling_attempts=sampled.attempts,
            replica=sampled.replica,
        )

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await self._release()

    async def _sample(self, context_ids: tuple[int, ...], max_new: int, turn: int) -> Sampled:
        """Sample at most ``max_new`` tokens after ``context_ids`` for turn ``turn``."""
        raise NotImplementedError

    async def _release(self) -> None:
        """Free what the session holds (called once, by the first ``close``)."""

    def _history_rewritten(self) -> None:
        """The template rewrote history (``reset``): what was kept of the context is stale."""
