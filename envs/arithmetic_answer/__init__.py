"""``arithmetic_answer``: the bundled single-turn environment. Answer a sum in one reply.

Each example asks for the value of an integer expression ("What is 37 * 12 - 5?", two or
three operands from 2..99 joined by ``+ - *``, sometimes parenthesised; the loader's
keywords choose an easier or harder mix). The policy
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


def generate_examples(
    seed: int,
    count: int,
    id_offset: int = 0,
    *,
    min_operand: int = 2,
    max_operand: int = 99,
    operand_counts: Sequence[int] = (2, 3),
    operators: str = "+-*",
) -> list[TaskExample]:
    """``count`` questions "What is a op b [op c]?" with integer targets, seeded.

    Each question draws its number of operands from ``operand_counts``, each operand from
    ``min_operand..max_operand`` and each operator from ``operators``; a three-operand one
    is parenthesised ("(a op b) op c") with probability 0.4. The defaults are the bundled
    task; smaller ranges give an easier one (``max_operand = 9, operand_counts = [2]``:
    one-digit sums the untouched SmolLM2-135M often gets right when it answers briefly).
    """
    rng = random.Random(seed)
    examples = []
    for index in range(id_offset, id_offset + count):
        operands = [str(rng.randint(min_operand, max_operand)) for _ in range(rng.choice(operand_counts))]
        chosen = [rng.choice(operators) for _ in operands[1:]]
        expression = operands[0]
        for operator, operand in zip(chosen, operands[1:], strict=True):
            expression += f" {operator} {operand}"
        if len(operands) == 3 and rng.random() < 0.4:
            expression = f"({operands[0]} {chosen[0]} {operands[1]}) {chosen[1]} {operands[2]}"
        examples.append(
            TaskExample(
                input=f"What is {expression}?",
                output=safe_eval(expression),
                metadata={"expression": expression},
                id=f"arithmetic_answer/seed={seed}/{index:05d}",
            )
        )
    return examples


def load_environment(
    seed: int = 0,
    num_train: int = 200,
    num_validation: int = 50,
    min_operand: int = 2,
    max_operand: int = 99,
    operand_counts: Sequence[int] = (2, 3),
    operators: str = "+-*",
) -> ArithmeticAnswer:
    """The bundled task, or an easier or harder variant of it (see ``generate_examples``)."""
    require_int("num_train", num_train, minimum=1)
    require_int("num_validation", num_validation, minimum=0)
    require_int("min_operand", min_operand, minimum=0)
    require_int("max_operand", max_operand, minimum=min_operand)
    if isinstance(operand_counts, (str, bytes)) or not isinstance(operand_counts, Sequence) or not operand_counts:
        raise ValueError(f"operand_counts must be a non-empty list of 1, 2 or 3, got {operand_counts!r}")
    for count in operand_counts:
        if isinstance(count, bool) or count not in (1, 2, 3):
            raise ValueError(f"operand_counts must hold only 1, 2 or 3, got {operand_counts!r}")
    if not isinstance(operators, str) or not operators or set(operators) - set("+-*"):
        raise ValueError(f"operators must be a non-empty string of '+', '-' and '*', got {operators!r}")
    examples = generate_examples(
        seed,
        num_train + num_validation,
        min_operand=min_operand,
        max_operand=max_operand,
        operand_counts=tuple(operand_counts),
        operators=operators,
    )
    return ArithmeticAnswer(examples[:num_train], examples[num_train:])


def expert_policy() -> ScriptedPolicy:
    """Replies with the value of the question's expression (the exact answer)."""

    def script(messages: Sequence[Message], turn: int) -> str:
        match = _QUESTION.match(latest_user_content(messages))
        return format_number(safe_eval(match.group(1))) if match else "I don't know."

    return ScriptedPolicy(script)
