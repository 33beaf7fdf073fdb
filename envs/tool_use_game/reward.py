"""The game's reward: behaviours, not a script (as the hook-style reference advises).

Four components, each in [0, 1] and each reported:

- ``correct`` (weight 0.8): the final reply (a reply with no tool call) ends with the
  answer. We read the *last* number in it, so "The answer is 23." counts and listing
  guesses does not help: only the last one is read.
- ``lookups`` (0.1): the share of the needed facts fetched with well-formed ``lookup``
  calls naming the exact key.
- ``calculator`` (0.05): at least one well-formed ``calculator`` call whose expression
  evaluates.
- ``tool_call_ok`` (0.05): at least one tool call ran without a ``tool_error`` (a known
  tool, arguments that fit its schema). The first rung: the untouched model's rare calls
  hit a tool_error (docs/results.md); this credit makes such a call worth more than
  prose, so a group has reward variance before any answer is right.

The score is the weighted sum; the threshold is the ``correct`` weight, so an episode
passes exactly when its answer is right. The tool credits are small on purpose: a
135M model makes almost no valid calls at first, and this gives GRPO a gradient towards
them without ever outweighing the answer. A plain function of the transcript, so it is
testable without the runner.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

from rollflow.envs.arithmetic import ExpressionError, last_number, safe_eval
from rollflow.envs.protocol import parse_action
from rollflow.envs.tools import is_tool_error
from rollflow.envs.types import Message, RewardResult

WEIGHTS = {"correct": 0.8, "lookups": 0.1, "calculator": 0.05, "tool_call_ok": 0.05}
ANSWER_TOLERANCE = 1e-6


def score_game(
    needed_keys: Sequence[str], answer: float, messages: Sequence[Message], response_text: str
) -> RewardResult:
    """Score the agent's part of a transcript (``messages`` after the opening ones)."""
    calls = list(_assistant_calls(messages))
    looked_up = {args.get("key") for name, args in calls if name == "lookup"}
    needed = set(needed_keys)
    components = {
        "correct": float(_final_answer_is(response_text, answer)),
        "lookups": len(needed & looked_up) / len(needed) if needed else 1.0,
        "calculator": float(
            any(name == "calculator" and _evaluates(args.get("expression")) for name, args in calls)
        ),
        "tool_call_ok": float(any(m.get("role") == "tool" and not is_tool_error(m) for m in messages)),
    }
    score = sum(WEIGHTS[name] * value for name, value in components.items())
    return RewardResult(score=round(score, 9), threshold=WEIGHTS["correct"], components=components)


def _final_answer_is(response_text: str, answer: float) -> bool:
    parsed = parse_action(response_text)
    if parsed.kind != "final":
        return False
    number = last_number(parsed.content)
    return number is not None and abs(number - answer) <= ANSWER_TOLERANCE


def _assistant_calls(messages: Sequence[Message]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(tool name, arguments) of every well-formed call in the assistant messages."""
    for message in messages:
        if message.get("role") != "assistant":
            continue
        calls = message.get("tool_calls")
        if calls is None:
            calls = list(parse_action(message.get("content", "")).tool_calls)
        for call in calls:
            try:
                arguments = json.loads(call["function"]["arguments"])
            except (ValueError, TypeError, KeyError):
                continue  # not one of our parsed calls: not well formed
            if isinstance(arguments, dict):
                yield call["function"]["name"], arguments


def _evaluates(expression: object) -> bool:
    if not isinstance(expression, str):
        return False
    try:
        safe_eval(expression)
    except ExpressionError:
        return False
    return True
