"""How a config's text becomes section values: keys to fields, values to their types.

``rollflow.config.run`` declares the sections and their rules; this module is the
machinery under them, so that file reads as the list of settings:

- **keys**: ``parse_sections`` maps each ``[section].key`` of a TOML document to a field,
  through the reference's aliases (``ALIASES``), refusing retired settings (``RETIRED``,
  with what to set instead), a key that belongs in another section, and an unknown key
  (with the nearest known one when it looks like a typo);
- **values**: ``check_types`` checks every field of a section object against its type
  hint and normalises it (int -> float, list -> tuple); ``at_least`` and ``in_range`` are
  the bounds the sections' ``__post_init__`` apply;
- **back out**: ``section_dict`` (None omitted: TOML has no null) and ``flatten_into``
  (``"train.learning_rate" -> "2e-05"``, for MLflow params).

Every problem raises ``ConfigError`` naming ``[section].key``.
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal


class ConfigError(ValueError):
    """A config value or key is wrong; the message names ``[section].key``."""


# Reference names that mean the same field: alias -> (section, canonical key).
ALIASES: dict[str, tuple[str, str]] = {
    "group_size": ("rollout", "episodes_per_task"),
    "max_context_tokens": ("rollout", "max_model_length"),
}

# Settings that are gone: (section, key) -> what to set instead.
RETIRED: dict[tuple[str, str], str] = {
    ("pipeline", "gate_z"): (
        "the gate is now an exact one-sided test: set [pipeline].gate_alpha, the false-promotion "
        "rate (gate_z = 1 corresponds to about 0.16, gate_z = 2 to about 0.023; default 0.05)"
    ),
}


# ---------------------------------------------------------------- keys


def read_document(path: Path, *, frozen: bool) -> dict[str, Any]:
    """The TOML file as a mapping; ``frozen``: with retired settings dropped (``load_config``)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path} is not valid TOML: {error}") from None
    if frozen:
        document = {
            section: {k: v for k, v in table.items() if (section, k) not in RETIRED} if isinstance(table, dict) else table
            for section, table in document.items()
        }
    return document


def parse_sections(document: Mapping[str, Any], sections: Mapping[str, type]) -> dict[str, Any]:
    """One section object per name in ``sections`` ("train" -> TrainConfig), from ``document``."""
    for section, table in document.items():
        if section not in sections:
            hint = _suggest(section, list(sections))
            raise ConfigError(f"unknown section [{section}]{hint}; sections: {', '.join(sections)}")
        if not isinstance(table, Mapping):
            raise ConfigError(f"[{section}] must be a table, got {type(table).__name__}")
    return {name: _parse_section(name, document.get(name, {}), sections) for name in sections}


def _parse_section(section: str, table: Mapping[str, Any], sections: Mapping[str, type]) -> Any:
    cls = sections[section]
    known = [f.name for f in dataclasses.fields(cls)]
    values: dict[str, Any] = {}
    for key, value in table.items():
        canonical = _canonical_key(section, key, known, sections)
        if canonical in values and values[canonical] != value:
            raise ConfigError(
                f"[{section}].{key} = {value!r} contradicts [{section}].{canonical} = "
                f"{values[canonical]!r}: they are the same setting; keep one"
            )
        values[canonical] = value
    return cls(**values)


def _canonical_key(section: str, key: str, known: list[str], sections: Mapping[str, type]) -> str:
    if key in known:
        return key
    if (section, key) in RETIRED:
        raise ConfigError(f"[{section}].{key} is no longer a setting: {RETIRED[section, key]}")
    alias = ALIASES.get(key)
    if alias is not None and alias[0] == section:
        return alias[1]
    homes = _home_sections(key, sections)
    if homes:
        where = " or ".join(f"[{home}]" for home in homes)
        raise ConfigError(f"[{section}].{key} belongs in {where}, not [{section}]")
    section_aliases = [a for a, (s, _) in ALIASES.items() if s == section]
    hint = _suggest(key, known + section_aliases)
    raise ConfigError(f"unknown key [{section}].{key}{hint}; known keys: {', '.join(known)}")


def _home_sections(key: str, sections: Mapping[str, type]) -> list[str]:
    """The sections that have ``key`` (``episodes_per_task``: rollout and validation)."""
    if key in ALIASES:
        return [ALIASES[key][0]]
    return [name for name, cls in sections.items() if key in {f.name for f in dataclasses.fields(cls)}]


def _suggest(word: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


# ---------------------------------------------------------------- values


def check_types(section_object: Any, section: str) -> None:
    """Check (and normalise: int -> float, list -> tuple) every field of a section."""
    hints = typing.get_type_hints(type(section_object))
    for f in dataclasses.fields(section_object):
        value = getattr(section_object, f.name)
        normalised = _coerce(value, hints[f.name], f"[{section}].{f.name}")
        if normalised is not value:
            object.__setattr__(section_object, f.name, normalised)


def _coerce(value: Any, hint: Any, where: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], where)
    if origin is Literal:
        if value not in args:
            allowed = ", ".join(repr(a) for a in args)
            raise ConfigError(f"{where} must be one of {allowed}; got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where} must be a list of strings; got {value!r}")
        return tuple(value)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where} must be a table; got {type(value).__name__}")
        return value
    return _coerce_scalar(value, hint, where)


def _coerce_scalar(value: Any, hint: Any, where: str) -> Any:
    if hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if ok and not isinstance(value, float) else value
    elif hint is str:
        ok = isinstance(value, str)
    else:  # pragma: no cover - a field type this module does not know
        raise TypeError(f"{where}: unsupported field type {hint!r}")
    if not ok:
        expected = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
        raise ConfigError(
            f"{where} must be {expected[hint]}; got {type(value).__name__} {value!r}"
        )
    return value


def at_least(section_object: Any, section: str, key: str, minimum: int) -> None:
    value = getattr(section_object, key)
    if value is not None and value < minimum:
        raise ConfigError(f"[{section}].{key} must be at least {minimum}; got {value!r}")


def in_range(
    section_object: Any, section: str, key: str, low: float, high: float | None,
    *, low_open: bool = False,
) -> None:
    value = getattr(section_object, key)
    too_low = value <= low if low_open else value < low
    if too_low or (high is not None and value > high):
        bracket = "(" if low_open else "["
        upper = f"{high}]" if high is not None else "inf)"
        raise ConfigError(f"[{section}].{key} must be in {bracket}{low}, {upper}; got {value!r}")


# ---------------------------------------------------------------- back out


def section_dict(section_object: Any) -> dict[str, Any]:
    """Field values in declaration order, None omitted (TOML has no null; None = default)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(section_object):
        value = getattr(section_object, f.name)
        if value is not None:
            out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def flatten_into(flat: dict[str, str], prefix: str, value: Any) -> None:
    if isinstance(value, Mapping):
        for key, inner in value.items():
            flatten_into(flat, f"{prefix}.{key}", inner)
    elif isinstance(value, list):
        flat[prefix] = ",".join(str(v) for v in value)
    else:
        flat[prefix] = str(value).lower() if isinstance(value, bool) else str(value)
