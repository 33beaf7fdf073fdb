"""Several environments in one run: a mixture is itself an environment (its handle).

A config gives the members as ``[[env.mixture]]`` tables (``config/run.py`` turns them into
``[env].name = "rollflow.envs.mixture:load_environment"`` with ``kwargs.members``, so the
run folder's frozen config names this loader and every stage loads the mixture like any
other environment):

    [[env.mixture]]
    name = "rollflow.envs.tool_use_game:load_environment"
    weight = 2.0                       # its share of each step's groups (relative)
    [[env.mixture]]
    name = "rollflow.envs.reasoning_gym:load_environment"
    kwargs = { dataset = "basic_arithmetic" }
    label = "arith"                    # default: the module's last name ("reasoning_gym")
    max_turns = 1                      # per-member overrides of [rollout]
    max_completion_tokens = 64

The handle (``MixtureHandle``) lists every member's tasks with ids ``"<label>/<id>"`` and
``TaskItem.env = label``, and routes each episode and each group's scoring to the member
it came from, so a group never mixes environments. What a step draws from each member is
the schedule's (``tasks/schedule.py``: ``draw_step_tasks``, by weight, seeded by the step
so a resumed step draws the same); ``strata`` gives it the members' weights and tasks. A
single environment is the one-member case of the same draw (``strata`` of a plain handle),
with its task ids unprefixed, as before mixtures existed.

Per-member overrides: ``max_turns`` replaces ``[rollout].max_turns`` (and
``[validation].val_max_turns``) for that member's episodes; ``max_completion_tokens``
lowers ``[rollout].max_completion_tokens`` for them (``envs/agent.py``'s
``completion_cap``, which the token sessions honour; an agent member's calls are capped by
the agent's own ``max_tokens``, so the override is refused there).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollflow.envs.agent import Policy, completion_cap
from rollflow.envs.episode import EpisodeRollout
from rollflow.envs.handle import EnvironmentHandle, EpisodeLimits, EpisodeScore, Style, TaskItem
from rollflow.envs.hooks import check_split
from rollflow.envs.types import Split

MIXTURE_SPEC = "rollflow.envs.mixture:load_environment"
MEMBER_KEYS = ("name", "kwargs", "weight", "label", "max_turns", "max_completion_tokens")
_LABEL = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class MixtureMember:
    """One environment of a mixture, as the config gives it."""

    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    weight: float = 1.0
    label: str = ""  # "" = default_label(name)
    max_turns: int | None = None
    max_completion_tokens: int | None = None

    def as_table(self) -> dict[str, Any]:
        """The member as a TOML table (None omitted), as ``parse_members`` reads it back."""
        table = {"name": self.name, "kwargs": dict(self.kwargs), "weight": self.weight, "label": self.label}
        for key in ("max_turns", "max_completion_tokens"):
            if getattr(self, key) is not None:
                table[key] = getattr(self, key)
        return table


def default_label(name: str) -> str:
    """A short name for an environment spec: its module's last name
    (``"rollflow.envs.tool_use_game:load_environment"`` -> ``"tool_use_game"``)."""
    module = name.partition(":")[0]
    return module.rsplit(".", 1)[-1] or name


def parse_members(raw: object, where: str = "[[env.mixture]]") -> list[MixtureMember]:
    """The members of a mixture, checked: every problem a ``ValueError`` naming the member."""
    if not isinstance(raw, list | tuple) or not raw:
        raise ValueError(f"{where} must be a non-empty list of tables (name, kwargs, weight, label); got {raw!r:.80}")
    members = [_member(table, f"{where} #{index + 1}") for index, table in enumerate(raw)]
    seen: dict[str, int] = {}
    for index, member in enumerate(members):
        if member.label in seen:
            raise ValueError(
                f"{where} #{seen[member.label] + 1} and #{index + 1} share the label {member.label!r}: "
                "give each member a distinct label"
            )
        seen[member.label] = index
    return members


def _member(table: object, where: str) -> MixtureMember:
    if not isinstance(table, Mapping):
        raise ValueError(f"{where} must be a table, got {type(table).__name__}")
    for key in table:
        if key not in MEMBER_KEYS:
            close = difflib.get_close_matches(str(key), MEMBER_KEYS, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{where}: unknown key {key!r}{hint}; known keys: {', '.join(MEMBER_KEYS)}")
    name = table.get("name")
    module, sep, function = name.partition(":") if isinstance(name, str) else ("", "", "")
    if not (sep and module and function.isidentifier()):
        raise ValueError(f"{where}: name must be 'module:function' (an environment's loader), got {name!r}")
    if name == MIXTURE_SPEC:
        raise ValueError(f"{where}: a mixture cannot hold a mixture; list its members here instead")
    kwargs = table.get("kwargs", {})
    if not isinstance(kwargs, Mapping):
        raise ValueError(f"{where}: kwargs must be a table, got {type(kwargs).__name__}")
    weight = table.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight) or weight <= 0:
        raise ValueError(f"{where}: weight must be a positive number, got {weight!r}")
    label = table.get("label") or default_label(name)
    if not isinstance(label, str) or not _LABEL.match(label):
        raise ValueError(f"{where}: label must be letters, digits, '_', '.' or '-' (it names metrics), got {label!r}")
    limits = {}
    for key in ("max_turns", "max_completion_tokens"):
        value = table.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{where}: {key} must be a positive integer, got {value!r}")
        limits[key] = value
    return MixtureMember(name, dict(kwargs), float(weight), label, **limits)


@dataclass(frozen=True)
class Stratum:
    """What the schedule draws a step's tasks from: one member's weight and tasks."""

    label: str
    weight: float
    items: list[TaskItem]


class MixtureHandle:
    """The members' tasks under one handle; each episode and group goes to its own member."""

    def __init__(self, members: Sequence[tuple[MixtureMember, EnvironmentHandle]]) -> None:
        self.members = list(members)
        self._by_label = {member.label: (member, handle) for member, handle in self.members}
        self._strata: dict[str, list[Stratum]] = {}
        # "async" when some member has no turn limit of its own and no override: the run's
        # [rollout].max_turns must then be set (schedule.episode_limits asks for it)
        needs_limit = any(h.style == "async" and m.max_turns is None for m, h in self.members)
        self.style: Style = "async" if needs_limit else "hook"

    def tasks(self, split: Split) -> list[TaskItem]:
        return [item for stratum in self.strata(split) for item in stratum.items]

    def strata(self, split: Split) -> list[Stratum]:
        """Each member's tasks for ``split``, ids prefixed by its label, in member order
        (listed once per split: the members' task lists do not change)."""
        check_split(split)
        if split not in self._strata:
            self._strata[split] = [
                Stratum(member.label, member.weight, [
                    TaskItem(f"{member.label}/{item.task_id}", item.payload, env=member.label)
                    for item in handle.tasks(split)
                ])
                for member, handle in self.members
            ]  # fmt: skip
        return [Stratum(s.label, s.weight, list(s.items)) for s in self._strata[split]]

    def member_of(self, item: TaskItem) -> tuple[MixtureMember, EnvironmentHandle, TaskItem]:
        """The member that ``item`` (one of ``tasks``) came from, its handle, and the item as
        the member lists it."""
        label = item.env
        if label not in self._by_label:
            raise KeyError(f"task {item.task_id!r} belongs to no member of this mixture ({', '.join(self._by_label)})")
        member, handle = self._by_label[label]
        return member, handle, TaskItem(item.task_id.removeprefix(f"{label}/"), item.payload)

    async def play(self, item: TaskItem, policy: Policy, limits: EpisodeLimits) -> EpisodeRollout:
        member, handle, inner = self.member_of(item)
        if member.max_turns is not None:
            limits = EpisodeLimits(max_turns=member.max_turns)
        with completion_cap(member.max_completion_tokens):
            return await handle.play(inner, policy, limits)

    async def score(self, item: TaskItem, rollouts: Sequence[EpisodeRollout]) -> list[EpisodeScore]:
        _, handle, inner = self.member_of(item)
        return await handle.score(inner, rollouts)


def strata(handle: EnvironmentHandle, split: Split, label: str) -> list[Stratum]:
    """The strata a step's draw is made from: a mixture's members, else the one environment
    (weight 1, its tasks with their own ids, each marked as ``label``'s)."""
    if isinstance(handle, MixtureHandle):
        return handle.strata(split)
    return [Stratum(label, 1.0, [dataclasses.replace(item, env=label) for item in handle.tasks(split)])]
