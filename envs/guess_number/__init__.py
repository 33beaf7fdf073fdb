"""``guess_number``: the hook-style starter game. Guess a secret number; hear higher or lower.

The model replies with a number each turn (the last whole number in its reply is the
guess); the environment answers "Higher." or "Lower." until the guess is right or the
turns run out. Actions are free text, so the environment opts out of tool-call protocol
checks (``checks_tool_protocol = False``): a stray ``<tool_call>`` is just a bad guess.

Reward, from the transcript alone: 0 unless solved; solved scores between 0.5 and 1.0,
1.0 for a first-guess hit and less for each extra guess (``efficiency``). Binary search
over 1..100 needs at most 7 guesses, so the default turn limit is 8.

``binary_search_policy()`` is the expert: a scripted policy that replays the replies in
the transcript to narrow the range and guesses its midpoint.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

from rollflow.envs.checks import require_int
from rollflow.envs.hooks import EnvironmentMultiTurn, check_split
from rollflow.envs.scripted import ScriptedPolicy
from rollflow.envs.types import (
    EnvironmentEpisode,
    EnvironmentStepResult,
    Message,
    RewardResult,
    Split,
    TaskExample,
)

SYSTEM_PROMPT = "We are playing a guessing game. Reply with one whole number each turn."
HIGHER, LOWER = "Higher.", "Lower."
_INTEGER = re.compile(r"-?\d+")
_RANGE = re.compile(r"between (-?\d+) and (-?\d+)")


class GuessNumber(EnvironmentMultiTurn):
    checks_tool_protocol = False  # free-text guesses

    def __init__(
        self, train: Sequence[TaskExample], validation: Sequence[TaskExample], max_turns: int = 8
    ) -> None:
        require_int("max_turns", max_turns, minimum=1)
        self._splits = {"train": tuple(train), "validation": tuple(validation)}
        self.max_turns = max_turns

    def examples(self, split: Split) -> Sequence[TaskExample]:
        check_split(split)
        return self._splits[split]

    def start_episode(self, example: TaskExample, prompt_text: str) -> list[Message]:
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": str(example.input)}]

    def max_episode_turns(self, example: TaskExample) -> int:
        return self.max_turns

    def step_episode(
        self, example: TaskExample, messages: list[Message], assistant_response: str
    ) -> EnvironmentStepResult:
        guess = last_integer(assistant_response)
        secret = int(example.output)
        if guess is None:
            low, high = example.metadata["low"], example.metadata["high"]
            reply = f"Please reply with one whole number between {low} and {high}."
            return EnvironmentStepResult(
                done=False, messages=({"role": "user", "content": reply},), metadata={"guess": None}
            )
        if guess == secret:
            return EnvironmentStepResult(done=True, final_response_text=str(guess), metadata={"guess": guess})
        reply = HIGHER if guess < secret else LOWER
        return EnvironmentStepResult(
            done=False, messages=({"role": "user", "content": reply},), metadata={"guess": guess}
        )

    def score_episode(self, example: TaskExample, episode: EnvironmentEpisode) -> RewardResult:
        guesses = sum(message["role"] == "assistant" for message in episode.messages)
        solved = last_integer(episode.response_text) == int(example.output)
        efficiency = max(0.0, 1.0 - (guesses - 1) / self.max_turns) if solved else 0.0
        score = 0.5 + 0.5 * efficiency if solved else 0.0
        return RewardResult(
            score=score,
            threshold=0.5,
            components={"solved": float(solved), "guesses": float(guesses), "efficiency": efficiency},
        )


def load_environment(
    seed: int = 0,
    num_train: int = 200,
    num_validation: int = 50,
    low: int = 1,
    high: int = 100,
    max_turns: int = 8,
) -> GuessNumber:
    """Secrets drawn uniformly from [low, high] with ``random.Random(seed)``."""
    if not (isinstance(low, int) and isinstance(high, int)) or low >= high:
        raise ValueError(f"need whole numbers low < high, got low={low!r}, high={high!r}")
    require_int("num_train", num_train, minimum=0)
    require_int("num_validation", num_validation, minimum=0)
    rng = random.Random(seed)
    prompt = f"I am thinking of a whole number between {low} and {high}. Guess it!"
    examples = [
        TaskExample(
            input=prompt,
            output=rng.randint(low, high),
            metadata={"low": low, "high": high},
            id=f"guess_number/seed={seed}/{index:05d}",
        )
        for index in range(num_train + num_validation)
    ]
    return GuessNumber(examples[:num_train], examples[num_train:], max_turns=max_turns)


def last_integer(text: str) -> int | None:
    matches = _INTEGER.findall(text)
    return int(matches[-1]) if matches else None


def binary_search_policy() -> ScriptedPolicy:
    """Guesses the midpoint of what the transcript's replies still allow."""

    def script(messages: Sequence[Message], turn: int) -> str:
        low, high = _range_from(messages)
        return str((low + high) // 2)

    return ScriptedPolicy(script)


def _range_from(messages: Sequence[Message]) -> tuple[int, int]:
    bounds = next((_RANGE.search(m["content"]) for m in messages if m["role"] == "user"), None)
    if bounds is None:
        raise ValueError("no 'between LOW and HIGH' in the opening user message")
    low, high = int(bounds.group(1)), int(bounds.group(2))
    guess: int | None = None
    for message in messages:
        if message["role"] == "assistant":
            guess = last_integer(message["content"])
        elif message["role"] == "user" and guess is not None:
            if message["content"] == HIGHER:
                low = max(low, guess + 1)
            elif message["content"] == LOWER:
                high = min(high, guess - 1)
    return low, high
