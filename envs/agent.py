"""What the episode runner needs from a policy: the next assistant action, with its tokens.

The runner owns the transcript; a policy owns tokens. For each episode the runner opens a
``PolicySession`` and, every turn, hands it the whole transcript so far. The session
renders only what is new since its last action (token in, token out: the sampled action is
never decoded and re-encoded) and returns a ``PolicyAction``:

- ``prompt_delta_ids``: the context tokens appended before this action (mask 0 when
  training). Across the actions of an episode they concatenate, with ``token_ids``, into
  exactly the sequence the model saw; when ``reset`` is True the template rewrote earlier
  history, ``prompt_delta_ids`` is a whole fresh prompt and a new training sample starts.
- ``token_ids`` / ``logprobs``: what was sampled and its log-probability under the
  distribution actually sampled from (mask 1 when training).
- ``finish_reason``: ``stop`` (end of turn), ``length`` (``max_completion_tokens`` hit) or
  ``context`` (the episode's context budget is spent; the runner ends the episode as
  ``context_overflow`` and does not step the environment with this action).

Scripted policies (tests, demos) may return text with no tokens at all.

``completion_cap(n)`` lowers the completion budget of the sessions acting inside it (a
mixture member's ``max_completion_tokens``, ``envs/mixture.py``): a context variable, so it
holds for the episode's own task and nothing else; token sessions read it with
``capped_completion``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from rollflow.envs.types import Message, ToolSpec

FinishReason = Literal["stop", "length", "context"]

_COMPLETION_CAP: contextvars.ContextVar[int | None] = contextvars.ContextVar("completion_cap", default=None)


@contextlib.contextmanager
def completion_cap(tokens: int | None) -> Iterator[None]:
    """Sessions acting inside this (this task, and tasks it starts) sample at most ``tokens``
    per action; None changes nothing."""
    if tokens is None:
        yield
        return
    reset = _COMPLETION_CAP.set(tokens)
    try:
        yield
    finally:
        _COMPLETION_CAP.reset(reset)


def capped_completion(max_completion_tokens: int) -> int:
    """The settings' per-action budget, lowered by an enclosing ``completion_cap``."""
    cap = _COMPLETION_CAP.get()
    return max_completion_tokens if cap is None else min(max_completion_tokens, cap)


@dataclass(frozen=True)
class PolicyAction:
    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    prompt_delta_ids: tuple[int, ...] = ()
    reset: bool = False
    finish_reason: FinishReason = "stop"
    latency_s: float = 0.0
    sampling_attempts: int = 1
    replica: int | None = None  # which of the policy's servers sampled it (vLLM); None: no servers

    def __post_init__(self) -> None:
        assert len(self.token_ids) == len(self.logprobs), (
            f"{len(self.token_ids)} sampled tokens but {len(self.logprobs)} logprobs"
        )


class PolicySession(Protocol):
    """One episode's view of the policy. Not shared between episodes."""

    async def act(self, messages: Sequence[Message]) -> PolicyAction: ...

    async def close(self) -> None: ...


class Policy(Protocol):
    version: int  # which checkpoint is acting; recorded on every episode

    def open_session(self, tool_specs: Sequence[ToolSpec]) -> PolicySession: ...
