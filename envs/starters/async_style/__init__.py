"""An async-style environment (``Env``), written by ``rollflow env new``."""

from .environment import load_environment

__all__ = ["load_environment"]
