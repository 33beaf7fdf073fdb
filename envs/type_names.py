"""Type errors that tell two classes of one name apart.

Inside a checkout, ``envs/`` is both rollflow's ``rollflow.envs`` and, from the working
directory, a top-level ``envs``: ``from envs.types import ToolResult`` then imports a second
module whose ``ToolResult`` is a different class from ``rollflow.ToolResult``. An
``isinstance`` check rightly refuses it, and a message naming the bare class ("returned
ToolResult, not a ToolResult") leaves the author no clue. These helpers name each class with
its module and say what to import when only the modules differ.
"""

from __future__ import annotations


def qualified_name(kind: type) -> str:
    """``module.Name`` (a builtin type by its bare name: ``dict``)."""
    if kind.__module__ == "builtins":
        return kind.__qualname__
    return f"{kind.__module__}.{kind.__qualname__}"


def type_mismatch(value: object, *expected: type) -> str:
    """``"<value's class>, not <expected class>"`` with modules, for "X returned ..." errors;
    with a hint when the value's class is, or derives from, a class of an expected one's
    name from another module (a second import of rollflow's own)."""
    got = type(value)
    text = f"{qualified_name(got)}, not {' or '.join(qualified_name(kind) for kind in expected)}"
    for base in got.__mro__:
        twin = next((kind for kind in expected if kind.__qualname__ == base.__qualname__ and kind is not base), None)
        if twin is not None:
            derives = "" if base is got else f"it derives from {qualified_name(base)}, "
            return text + (
                f" ({derives}a second copy of rollflow's class from module {base.__module__}: "
                f"import it as `from rollflow import {twin.__qualname__}`)"
            )
    return text
