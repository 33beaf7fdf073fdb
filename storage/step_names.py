"""A step's folder name, ``step=000003``: of its outputs, its checkpoint and what is derived from it."""

from __future__ import annotations

import re

_STEP_RE = re.compile(r"^step=(\d+)$")


def step_dirname(step: int) -> str:
    if step < 0:
        raise ValueError(f"steps count from 0, got {step}")
    return f"step={step:06d}"


def parse_step_dirname(name: str) -> int | None:
    match = _STEP_RE.match(name)
    return None if match is None else int(match.group(1))
