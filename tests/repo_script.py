"""Load one of the repository's scripts (``bench/``, ``scripts/``) as a module, for its tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def load_script(relative_path: str) -> ModuleType:
    """The script at ``REPO / relative_path``, imported under its file name."""
    path = REPO / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there while it loads
    spec.loader.exec_module(module)
    return module
