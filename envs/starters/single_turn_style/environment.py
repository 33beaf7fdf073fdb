"""A starter single-turn environment: answer a sum, scored exactly.

Edit this into your own task. What each hook does:

- ``build_prompt_messages``: the prompt of one example (a system and a user message).
- ``score_response``: grade the one reply. Score behaviours: here mostly the right
  number, a little for answering with a number at all.
- ``dataset``: the rows to play, each ``{"input": ..., "output": ...}``; ``output`` is
  also what ``rollflow sft`` trains the reply to be. One sum in five is held out for
  validation, never trained on.

One reply per episode, no tools: a task that needs tools or several turns is an
``EnvironmentMultiTurn`` (``rollflow env new NAME --multi-turn``). Run
``python -m pytest`` on this folder to play it.
"""

from __future__ import annotations

import random
import re

from rollflow import EnvironmentSingleTurn, Message, RewardResult, TaskExample


def last_number(text: str) -> float | None:
    """The last number written in ``text`` (the reply's answer), or None."""
    found = re.findall(r"-?\d+(?:\.\d+)?", text)
    return float(found[-1]) if found else None


class SingleTurnStarterEnv(EnvironmentSingleTurn):
    def __init__(self, num_examples: int = 32, seed: int = 0) -> None:
        rng = random.Random(seed)
        pairs = rng.sample([(a, b) for a in range(2, 100) for b in range(2, 100)], num_examples)  # no repeats
        rows = [{"input": f"What is {a} + {b}?", "output": str(a + b), "id": f"sum-{i}"}
                for i, (a, b) in enumerate(pairs)]
        split = max(1, num_examples * 4 // 5)
        self.dataset = {"train": rows[:split], "validation": rows[split:]}

    def build_prompt_messages(self, example: TaskExample) -> list[Message]:
        return [
            {"role": "system", "content": "Reply with only the final number."},
            {"role": "user", "content": str(example.input)},
        ]

    def score_response(self, example: TaskExample, response_text: str) -> RewardResult:
        answer = last_number(response_text)
        correct = answer is not None and answer == float(str(example.output))
        answered = answer is not None
        return RewardResult(score=0.9 * correct + 0.1 * answered, threshold=0.9,
                            components={"correct": float(correct), "answered": float(answered)})


def load_environment(**kwargs: int) -> SingleTurnStarterEnv:
    return SingleTurnStarterEnv(**kwargs)
