"""A small TOML writer for the config's values (the standard library only reads TOML).

It writes what a config can hold: tables of strings, booleans, integers, floats, lists,
and nested tables (``[env.kwargs]`` and below). Floats are written with ``repr`` so they
read back bit for bit. No comments, no dates: a config has neither.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


class TomlWriteError(ValueError):
    """A value TOML cannot hold (None, an unsupported type)."""


def toml_document(tables: Mapping[str, Mapping[str, Any]]) -> str:
    """Top-level tables in order, each followed by its nested tables."""
    chunks = [_table(name, body) for name, body in tables.items()]
    return "\n\n".join(chunk for chunk in chunks if chunk) + "\n"


def _table(path: str, body: Mapping[str, Any]) -> str:
    scalars = {k: v for k, v in body.items() if not isinstance(v, Mapping)}
    nested = {k: v for k, v in body.items() if isinstance(v, Mapping)}
    lines = [f"[{path}]"] + [f"{_key(k)} = {_value(v, f'{path}.{k}')}" for k, v in scalars.items()]
    chunks = ["\n".join(lines)]
    chunks += [_table(f"{path}.{_key(k)}", v) for k, v in nested.items()]
    return "\n\n".join(chunks)


def _key(key: object) -> str:
    if not isinstance(key, str):
        raise TomlWriteError(f"table keys must be strings; got {key!r}")
    return key if _BARE_KEY.match(key) else json.dumps(key)


def _value(value: Any, where: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a valid TOML basic string
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(v, where) for v in value) + "]"
    if isinstance(value, Mapping):
        items = ", ".join(f"{_key(k)} = {_value(v, f'{where}.{k}')}" for k, v in value.items())
        return "{" + items + "}"
    raise TomlWriteError(f"{where}: TOML cannot hold {type(value).__name__} {value!r}")
