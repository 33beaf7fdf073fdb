"""rollflow: multi-turn GRPO for tool-use agents as a resumable Prefect pipeline.

One import gives environment authors every name the reference docs use::

    from rollflow import EnvironmentMultiTurn, EnvironmentStepResult, RewardResult, TaskExample
    from rollflow import Env, StepResult, Task, Tool, ToolResult, tool_to_spec
    from rollflow import train_multi_turn, GRPOConfig

The project's folders (``envs/``, ``policy/``, ``storage/``, ``config/``, ``generators/``,
``tasks/``, ``ops/``, ``cluster/``, ``flows/``) stay at the top of the repository and
install as subpackages of this one (``rollflow.envs``, ...), so a user's own ``tasks.py`` or ``storage/`` never shadows them.
The environment names are imported eagerly (they are light); ``train_multi_turn`` and
``GRPOConfig`` pull in Prefect and the trainer, so they load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rollflow.envs.env import AsyncEnvSuite, Env
from rollflow.envs.hooks import EnvironmentMultiTurn
from rollflow.envs.protocol import ParsedAction, parse_action, render_tool_calls
from rollflow.envs.single_turn import EnvironmentSingleTurn
from rollflow.envs.tools import execute_tool_calls
from rollflow.envs.types import (
    EnvironmentEpisode,
    EnvironmentStepResult,
    EnvironmentTurn,
    Message,
    RewardResult,
    StepResult,
    Task,
    TaskExample,
    Tool,
    ToolCall,
    ToolResult,
    ToolSpec,
    TruncationCause,
    tool_to_spec,
)

if TYPE_CHECKING:
    from rollflow.flows.api import train_multi_turn
    from rollflow.config.grpo import GRPOConfig

_LAZY = {
    "train_multi_turn": "rollflow.flows.api",
    "GRPOConfig": "rollflow.config.grpo",
}

__all__ = [
    "AsyncEnvSuite",
    "Env",
    "EnvironmentEpisode",
    "EnvironmentMultiTurn",
    "EnvironmentSingleTurn",
    "EnvironmentStepResult",
    "EnvironmentTurn",
    "GRPOConfig",
    "Message",
    "ParsedAction",
    "RewardResult",
    "StepResult",
    "Task",
    "TaskExample",
    "Tool",
    "ToolCall",
    "ToolResult",
    "ToolSpec",
    "TruncationCause",
    "execute_tool_calls",
    "parse_action",
    "render_tool_calls",
    "tool_to_spec",
    "train_multi_turn",
]


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'rollflow' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value
