"""The safe arithmetic evaluator: right values, every refusal named, fuzzed for crashes."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollflow.envs.arithmetic import (
    MAX_EXPRESSION_CHARS,
    ExpressionError,
    format_number,
    last_number,
    safe_eval,
)


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("1 + 2 * 3", 7),
        ("(1 + 2) * 3", 9),
        ("7 / 2", 3.5),
        ("7 // 2", 3),
        ("-7 % 3", 2),
        ("2 ** 10", 1024),
        ("-(3 - 5)", 2),
        ("+4", 4),
        ("1_000 + 0.5", 1000.5),
        ("2 ** -1", 0.5),
    ],
)
def test_values(expression: str, value: float) -> None:
    assert safe_eval(expression) == value


@pytest.mark.parametrize(
    ("expression", "problem"),
    [
        ("__import__('os')", "Call is not allowed"),
        ("x + 1", "Name is not allowed"),
        ("'a' * 3", "only numbers"),
        ("True + 1", "only numbers"),
        ("1j", "only numbers"),
        ("2 ^ 3", "write **"),
        ("1 < 2", "Compare is not allowed"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("2 ** 65", "exponent"),
        ("10 ** 31", "too large"),
        ("(10 ** 20) * (10 ** 20)", "too large"),
        ("(-8) ** 0.5", "complex"),
        ("1e400", "not finite"),
        ("", "empty"),
        ("1 +", "not an arithmetic expression"),
        ("(1 + 2", "not an arithmetic expression"),
        ("1" * (MAX_EXPRESSION_CHARS + 1), "limit"),
        ("\x00", "not an arithmetic expression"),
    ],
)
def test_refusals_name_the_problem(expression: str, problem: str) -> None:
    with pytest.raises(ExpressionError, match=re.escape(problem)):
        safe_eval(expression)


def test_non_text_is_refused() -> None:
    with pytest.raises(ExpressionError, match="as text"):
        safe_eval(12)  # type: ignore[arg-type]


def test_format_number() -> None:
    assert format_number(6) == "6"
    assert format_number(6.0) == "6"
    assert format_number(2.5) == "2.5"
    assert format_number(1 / 3) == "0.333333333333"


def test_last_number() -> None:
    assert last_number("The total is 1,200 crates.") == 1200
    assert last_number("from 3 to -4.5") == -4.5
    assert last_number("no digits") is None


@settings(max_examples=500, deadline=None)
@given(
    st.text(max_size=60)
    | st.lists(st.sampled_from(list("0123456789+-*/%().e_ ") + ["**", "//", "9" * 20]), max_size=40).map(
        "".join
    )
)
def test_never_raises_anything_but_expression_error(expression: str) -> None:
    try:
        value = safe_eval(expression)
    except ExpressionError:
        return
    assert isinstance(value, int | float) and not isinstance(value, bool)


# A tree of operations whose value the test computes itself, node by node.
Tree = int | tuple[str, "Tree", "Tree"]
trees = st.recursive(
    st.integers(0, 999),
    lambda inner: st.tuples(st.sampled_from(["+", "-", "*"]), inner, inner),
    max_leaves=6,
)


def _text(tree: Tree) -> str:
    if isinstance(tree, int):
        return str(tree)
    op, left, right = tree
    return f"({_text(left)} {op} {_text(right)})"


def _value(tree: Tree) -> int:
    if isinstance(tree, int):
        return tree
    op, left, right = tree
    a, b = _value(left), _value(right)
    return a + b if op == "+" else a - b if op == "-" else a * b


@settings(max_examples=200, deadline=None)
@given(trees)
def test_generated_expressions_evaluate_to_their_value(tree: Tree) -> None:
    assert safe_eval(_text(tree)) == _value(tree)
