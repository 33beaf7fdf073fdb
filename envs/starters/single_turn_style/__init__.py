"""A single-turn environment (``EnvironmentSingleTurn``), written by ``rollflow env new``."""

from .environment import load_environment

__all__ = ["load_environment"]
