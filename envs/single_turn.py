"""Single-turn environments (``EnvironmentSingleTurn``): one prompt, one reply, one reward.

The reference (doc 000) contrasts two classes: ``EnvironmentSingleTurn`` with
``build_prompt_messages(example)`` (the prompt) and ``score_response(example,
response_text)`` (reward one reply), and ``EnvironmentMultiTurn`` with the episode hooks.
Here the single-turn class *is* a multi-turn one whose episode has exactly one action, so
it runs through the same runner, rollout, scoring, flatten, GRPO and SFT code, and its
episodes land in the same Parquet records (``turns = 1``):

    start_episode(example, prompt_text) = build_prompt_messages(example)
    max_episode_turns(example)          = 1
    step_episode(...)                   = done, final_response_text = the action
    score_episode(example, episode)     = score_response(example, episode.response_text)

Subclass it and implement the two hooks; a ``dataset`` attribute (or an ``examples``
override) gives the rows, exactly as for ``EnvironmentMultiTurn`` (see
``rollflow.envs.hooks``). ``score_response`` may be ``async def``. SFT uses the inherited
``sft_completion``: a scalar ``example.output`` becomes the one assistant reply trained on.

What it simplifies, and why:
- A single-turn reply is the final answer, never a tool call: ``checks_tool_protocol`` is
  False (a stray ``<tool_call>`` in the reply is scored as text, never a parse failure)
  and ``tool_specs`` stays empty. A task that needs tools takes more than one turn: write
  an ``EnvironmentMultiTurn``.
- The four episode hooks are fixed. A subclass that overrides one of them is refused when
  the class is defined, naming the hook, since it would silently stop being single-turn.
- A reply cut off at ``max_completion_tokens`` is still scored as the reply (the episode
  terminates after its one action); the overlong penalty, if configured, applies only to
  ``max_turns`` / ``context_overflow`` endings, as for every environment.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Sequence
from typing import Any

from rollflow.envs.hooks import EnvironmentMultiTurn
from rollflow.envs.types import (
    EnvironmentEpisode,
    EnvironmentStepResult,
    Message,
    RewardResult,
    TaskExample,
    ToolSpec,
)

_FIXED_HOOKS = ("start_episode", "max_episode_turns", "step_episode", "score_episode", "tool_specs")


class EnvironmentSingleTurn(EnvironmentMultiTurn):
    checks_tool_protocol = False  # the reply is the answer, not a tool call

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        overridden = [name for name in _FIXED_HOOKS if name in vars(cls)]
        if overridden:
            raise TypeError(
                f"{cls.__name__} overrides {', '.join(overridden)}: a single-turn environment "
                "implements build_prompt_messages and score_response only; subclass "
                "EnvironmentMultiTurn for episodes with several turns or tools"
            )

    @abc.abstractmethod
    def build_prompt_messages(self, example: TaskExample) -> list[Message]:
        """The prompt the policy answers (e.g. a system prompt and the question)."""

    @abc.abstractmethod
    def score_response(
        self, example: TaskExample, response_text: str
    ) -> RewardResult | Awaitable[RewardResult]:
        """Reward one reply. May be ``async def``."""

    # ------------------------------------------------------------ the one-action episode

    def start_episode(self, example: TaskExample, prompt_text: str) -> list[Message]:
        return self.build_prompt_messages(example)

    def max_episode_turns(self, example: TaskExample) -> int:
        return 1

    def step_episode(
        self, example: TaskExample, messages: list[Message], assistant_response: str
    ) -> EnvironmentStepResult:
        return EnvironmentStepResult(done=True, final_response_text=assistant_response)

    def score_episode(
        self, example: TaskExample, episode: EnvironmentEpisode
    ) -> RewardResult | Awaitable[RewardResult]:
        return self.score_response(example, episode.response_text)

    def tool_specs(self, example: TaskExample) -> Sequence[ToolSpec]:
        return ()
