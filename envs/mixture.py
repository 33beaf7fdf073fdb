"""The loader of a mixture of environments: ``[env].name = "rollflow.envs.mixture:load_environment"``.

The mixture's handle, its members and how a config gives them are ``envs/mixture_handle.py``
(the runner needs the handle's type, and this loader needs the runner: the two live apart
so the import graph has no circle).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rollflow.envs.mixture_handle import MixtureHandle, parse_members
from rollflow.envs.openai_agent import AgentEnvironmentHandle
from rollflow.envs.runner import EnvironmentLoadError, load_environment_handle


def load_environment(members: Sequence[Mapping[str, Any]]) -> MixtureHandle:
    """Load every member (each by its own loader, as a one-environment run would) into one
    handle. A member that fails to load fails the whole, naming the member."""
    try:
        parsed = parse_members(list(members), "[env].kwargs.members")
    except ValueError as exc:
        raise EnvironmentLoadError(str(exc)) from None
    loaded = []
    for member in parsed:
        try:
            handle = load_environment_handle(member.name, member.kwargs)
        except EnvironmentLoadError as exc:
            raise EnvironmentLoadError(f"mixture member {member.label!r}: {exc}") from None
        if member.max_completion_tokens is not None and isinstance(handle, AgentEnvironmentHandle):
            raise EnvironmentLoadError(
                f"mixture member {member.label!r}: max_completion_tokens cannot cap an agent's calls "
                "(the agent sets its own max_tokens, capped by [rollout].max_completion_tokens); remove it"
            )
        loaded.append((member, handle))
    return MixtureHandle(loaded)
