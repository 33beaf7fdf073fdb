"""The bundled tool-use game (hook style): find hidden facts with tools, then compute.

``load_environment(seed=0, num_train=200, num_validation=50, worked_example=True,
max_turns=6)`` returns a ``ToolUseGame``. See ``environment`` for the episode, ``tasks``
for how questions are generated, ``reward`` for the scoring and ``tools`` for the tools.
"""

from rollflow.envs.tool_use_game.environment import (
    SYSTEM_PROMPT,
    ToolUseGame,
    expert_policy,
    expert_transcript,
    game_task,
    load_environment,
)
from rollflow.envs.tool_use_game.reward import WEIGHTS, score_game
from rollflow.envs.tool_use_game.tasks import WORKED_EXAMPLE, GameTask, generate_examples
from rollflow.envs.tool_use_game.tools import GAME_TOOL_SPECS, game_tools

__all__ = [
    "GAME_TOOL_SPECS",
    "SYSTEM_PROMPT",
    "WEIGHTS",
    "WORKED_EXAMPLE",
    "GameTask",
    "ToolUseGame",
    "expert_policy",
    "expert_transcript",
    "game_task",
    "game_tools",
    "generate_examples",
    "load_environment",
    "score_game",
]
