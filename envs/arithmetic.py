"""A safe arithmetic evaluator for calculator tools: model text is parsed, never ``eval``-ed.

The expression is parsed with ``ast`` and walked; only number literals, ``+ - * / // %
**`` and unary ``+ -`` are allowed. Everything else (names, calls, attributes, strings,
comparisons, ``^``) is refused with a message the model can read.

Bounds keep a hostile expression cheap: at most ``MAX_EXPRESSION_CHARS`` characters (so
parsing and nesting stay small), an exponent of at most ``MAX_EXPONENT`` in magnitude, and
every intermediate result at most ``MAX_MAGNITUDE``; a power whose result would exceed it
is refused before it is computed. Booleans and complex numbers are not numbers here.

Every failure is an ``ExpressionError`` (a ``ValueError``), so a tool can turn it into
``tool_error: ...`` with one ``except``. ``CalculatorTool`` is that tool, shared by the
bundled environments: it raises, and ``rollflow.envs.tools.execute_tool_calls`` reports it.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
from collections.abc import Callable, Mapping
from typing import Any

from rollflow.envs.types import ToolResult

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 10**30

Number = int | float

_BINARY: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Number], Number]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}


class ExpressionError(ValueError):
    """The expression is not allowed arithmetic, or its value is out of bounds."""


def safe_eval(expression: str) -> Number:
    """The value of an arithmetic expression, or ``ExpressionError`` naming the problem."""
    if not isinstance(expression, str):
        raise ExpressionError(f"expected an expression as text, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(
            f"expression is {len(expression)} characters; the limit is {MAX_EXPRESSION_CHARS}"
        )
    if not expression.strip():
        raise ExpressionError("empty expression")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as exc:
        raise ExpressionError(f"not an arithmetic expression: {expression!r}") from exc
    return _evaluate(tree.body)


def format_number(value: Number) -> str:
    """Integers as integers (``6.0`` -> ``"6"``), other floats to 12 significant digits."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.12g}"


_NUMBER = re.compile(r"-?\d(?:[\d,]*\d)?(?:\.\d+)?")


def last_number(text: str) -> float | None:
    """The last number written in ``text`` (``"1,200"`` reads as 1200), or None."""
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    return float(matches[-1].replace(",", ""))


def _evaluate(node: ast.expr) -> Number:
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ExpressionError(f"only numbers are allowed, not {value!r}")
        return _bounded(value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _bounded(_UNARY[type(node.op)](_evaluate(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError as exc:
            raise ExpressionError("division by zero") from exc
        except OverflowError as exc:
            raise ExpressionError("result too large") from exc
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise ExpressionError("'^' is not a power here; write ** for powers")
    raise ExpressionError(f"{type(node).__name__} is not allowed; only numbers and + - * / // % **")


def _check_power(base: Number, exponent: Number) -> None:
    if abs(exponent) > MAX_EXPONENT:
        raise ExpressionError(f"exponent {format_number(exponent)} is beyond ±{MAX_EXPONENT}")
    if base == 0 and exponent < 0:
        raise ExpressionError("division by zero (zero to a negative power)")
    if abs(base) > 1 and exponent > 0 and exponent * math.log10(abs(base)) > math.log10(MAX_MAGNITUDE):
        raise ExpressionError(f"result too large (beyond 1e{round(math.log10(MAX_MAGNITUDE))})")


def _bounded(value: object) -> Number:
    if isinstance(value, complex):
        raise ExpressionError("the result is a complex number (a negative base to a fractional power)")
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ExpressionError(f"the result is not a number: {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ExpressionError("the result is not finite")
    if abs(value) > MAX_MAGNITUDE:
        raise ExpressionError(f"result too large (beyond 1e{round(math.log10(MAX_MAGNITUDE))})")
    return value


class CalculatorTool:
    """The ``calculator`` tool: ``{"expression": "..."}`` -> its value, via ``safe_eval``.

    ``run`` takes parsed arguments (for writing expert transcripts without an event loop);
    ``execute`` is the async ``Tool`` protocol method.
    """

    name = "calculator"
    description = "Evaluate an arithmetic expression with + - * / // % ** and parentheses."
    parameters_schema: dict[str, Any] = {
        "type": "object",
        "properties": {"expression": {"type": "string"}},
        "required": ["expression"],
        "additionalProperties": False,
    }

    def run(self, arguments: Mapping[str, Any]) -> str:
        return format_number(safe_eval(arguments["expression"]))

    async def execute(self, arguments: str) -> ToolResult:
        return ToolResult(content=self.run(json.loads(arguments)))
