"""``arithmetic_answer``: the bundled single-turn environment. Answer a sum in one reply.

Each example asks for the value of an integer expression ("What is 37 * 12 - 5?", two or
three operands from 2..99 joined by ``+ - *``, sometimes parenthesised). The policy
answers once (``EnvironmentSingleTurn``: no tools, no second turn) and the reply is scored
exactly: reward 1.0 when its last number (``rollflow.envs.arithmetic.last_number``, so
"The answer is 1,200." reads as 1200) equals the target, else 0.0. Components:
``correct`` and ``answered`` (the reply holds a number at all).

Targets are computed with ``safe_eval`` (never ``eval``) and stored as ``example.output``,
so SFT trains on the bare number as the one assistant reply (the inherited
``sft_completion``).

``expert_policy()`` is the scripted baseline: it evaluates the question's expression and
replies with the result.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

from rollflow.envs.arithmetic import format_number, last_number, safe_eval
from rollflow.envs.checks import require_int
from rollflow.envs.scripted import ScriptedPolicy, latest_user_content
from rollflow.envs.single_turn import EnvironmentSingleTurn
from rollflow.envs.types import Message, RewardResult, TaskExample

SYSTEM_PROMPT = "Answer the arithmetic question. Reply with only the final number."
_QUESTION = re.compile(r"^What is (.+)\?$")


class ArithmeticAnswer(EnvironmentSingleTurn):
    def __init__(self, train: Sequence[TaskExample], validation: Sequence[TaskExample]) -> None:
        self.dataset = {"train": list(train), "validation": list(validation)}

    def build_prompt_messages(self, example: TaskExample) -> list[Message]:
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": str(example.input)}]

    def score_response(self, example: TaskExample, response_text: str) -> RewardResult:
        answer = last_number(response_text)
        correct = answer is not None and answer == float(example.output)
        return RewardResult(
            score=float(correct),
            threshold=1.0,
            components={"correct": float(correct), "answered": float(answer is not None)},
        )


def generate_examples(seed: int, count: int, id_offset: int = 0) -> list[TaskExample]:
    """``count`` questions "What is a op b [op c]?" with integer targets, seeded."""
    rng = random.Random(seed)
    examples = []
    for index in range(id_offset, id_offset + count):
        operands = [str(rng.randint(2, 99)) for _ in range(rng.choice((2, 3)))]
        operators = [rng.choice("+-*") for _ in operands[1:]]
        expression = operands[0]
        for operator, operand in zip(operators, operands[1:], strict=True):
            expression += f" {operator} {operand}"
        if len(operands) == 3 and rng.random() < 0.4:
            expression = f"({operands[0]} {operators[0]} {operands[1]}) {operators[1]} {operands[2]}"
        examples.append(
            TaskExample(
                input=f"What is {expression}?",
                output=safe_eval(expression),
                metadata={"expression": expression},
                id=f"arithmetic_answer/seed={seed}/{index:05d}",
            )
        )
    return examples


def load_environment(seed: int = 0, num_train: int = 200, num_validation: int = 50) -> ArithmeticAnswer:
    require_int("num_train", num_train, minimum=1)
    require_int("num_validation", num_validation, minimum=0)
    examples = generate_examples(seed, num_train + num_validation)
    return ArithmeticAnswer(examples[:num_train], examples[num_train:])


def expert_policy() -> ScriptedPolicy:
    """Replies with the value of the question's expression (the exact answer)."""

    def script(messages: Sequence[Message], turn: int) -> str:
        match = _QUESTION.match(latest_user_content(messages))
        return format_number(safe_eval(match.group(1))) if match else "I don't know."

    return ScriptedPolicy(script)
