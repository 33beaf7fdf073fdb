"""Argument checks shared by the runner and the bundled environments' loaders.

Bad configuration is an exception raised early, with a message naming the argument.
"""

from __future__ import annotations


def require_int(name: str, value: object, minimum: int) -> int:
    """``value`` when it is an integer (not a bool) of at least ``minimum``; else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = {0: "a non-negative integer", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    return value
