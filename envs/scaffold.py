"""``rollflow env new NAME --multi-turn|--async|--single-turn``: write a runnable starter environment.

``write_starter(name, dest_dir, style)`` copies one of the starter packages in
``envs/starters/`` to ``dest_dir/NAME/`` (``__init__.py``, ``environment.py``,
``test_environment.py``) and renames its environment class after ``NAME``. The copy is a
package exposing ``load_environment``; its test plays it through the runner with a
scripted policy, and finds it by its own package name, so it works wherever the folder
lands (the working directory -> spec ``NAME:load_environment``, which rollflow imports
from there; ``my_envs/NAME`` -> ``my_envs.NAME:load_environment``; ``starter_spec`` says
which). The written code imports the reference docs' names the way a user's own code
should: ``from rollflow import ...``.

It never writes into rollflow's own package folders (``envs/`` in a checkout is
``rollflow.envs``): a module there sits beside ``envs/types.py``, so ``from envs.types
import ToolResult`` imports a second copy whose ``ToolResult`` is not ``rollflow.ToolResult``
and every return of it is refused.
Beside them goes ``train.toml`` (from ``envs/starters/train.toml``): a config that
``rollflow train`` runs as is, its ``[env].name`` the spec for the working directory.
Each starter keeps validation tasks apart from its training tasks.

The starters are real modules rather than text templates so that they are type-checked
and tested with the rest of the code (``tests/test_scaffold.py`` runs the written copies).
"""

from __future__ import annotations

import importlib.util
import keyword
import re
import sys
from pathlib import Path
from string import Template
from typing import Literal

StarterStyle = Literal["hook", "async", "single"]

_STARTERS = Path(__file__).parent / "starters"
_SOURCES: dict[str, tuple[str, str]] = {  # style -> (folder, class name to rename)
    "hook": ("hook_style", "HookStarterEnv"),
    "async": ("async_style", "AsyncStarterEnv"),
    "single": ("single_turn_style", "SingleTurnStarterEnv"),
}
_FILES = ("__init__.py", "environment.py", "test_environment.py")
CONFIG_FILE = "train.toml"
_NAME = re.compile(r"[a-z][a-z0-9_]*")


def write_starter(name: str, dest_dir: Path, style: StarterStyle) -> list[Path]:
    """Write the starter package ``dest_dir/name``; return the files written, in order.

    Raises ``ValueError`` for a bad name or style and ``FileExistsError`` rather than
    overwrite anything.
    """
    if style not in _SOURCES:
        raise ValueError(
            f"unknown starter style {style!r}; expected 'hook' (--multi-turn), 'async' (--async) "
            "or 'single' (--single-turn)"
        )
    _check_name(name)
    _check_destination(Path(dest_dir))
    package_dir = Path(dest_dir) / name
    if package_dir.exists():
        raise FileExistsError(f"{package_dir} already exists; choose another name or remove it")
    folder, class_name = _SOURCES[style]
    new_class_name = "".join(part.capitalize() for part in name.split("_") if part) + "Env"
    package_dir.mkdir(parents=True)
    written = []
    for file_name in _FILES:
        source = (_STARTERS / folder / file_name).read_text(encoding="utf-8")
        target = package_dir / file_name
        target.write_text(re.sub(rf"\b{class_name}\b", new_class_name, source), encoding="utf-8")
        written.append(target)
    written.append(_write_config(name, Path(dest_dir)))
    return written


def _write_config(name: str, dest_dir: Path) -> Path:
    """``dest_dir/name/train.toml``: the starter config, naming the spec that loads it."""
    spec, run_from = starter_spec(name, dest_dir)
    target = dest_dir / name / CONFIG_FILE
    template = Template((_STARTERS / CONFIG_FILE).read_text(encoding="utf-8"))
    text = template.substitute(
        name=name, spec=spec, config_path=target, run_from="" if run_from is None else f" from {run_from}"
    )
    target.write_text(text, encoding="utf-8")
    return target


def starter_spec(name: str, dest_dir: Path) -> tuple[str, Path | None]:
    """The ``[env].name`` that loads ``dest_dir/name``, and the folder to run from when
    that is not the working directory (``dest_dir`` itself for a folder elsewhere)."""
    dest = Path(dest_dir)
    if dest.is_absolute():
        try:
            dest = dest.resolve().relative_to(Path.cwd().resolve())
        except ValueError:
            return f"{name}:load_environment", Path(dest_dir)
    parts = [part for part in dest.parts if part != "."]
    if not all(part.isidentifier() for part in parts):
        return f"{name}:load_environment", Path(dest_dir)
    return ".".join([*parts, name]) + ":load_environment", None


def _installed_subpackages() -> dict[str, Path]:
    """Each folder installed as a subpackage of rollflow, by name (``ops`` -> ``<checkout>/ops``).

    Found from the installed package rather than listed by hand, so a package added to
    setup.py is guarded the day it lands: a candidate is any folder inside ``rollflow``'s
    own (a regular install) or beside it (a checkout, where ``./envs`` installs as
    ``rollflow.envs``), kept when ``rollflow.<name>`` is imported from exactly that folder.
    """
    import rollflow

    packages = [Path(path).resolve() for path in rollflow.__path__]
    found: dict[str, Path] = {}
    for parent in {where for package in packages for where in (package, package.parent)}:
        for candidate in sorted(parent.iterdir()):
            if not (candidate.name.isidentifier() and (candidate / "__init__.py").is_file()):
                continue
            spec = importlib.util.find_spec(f"rollflow.{candidate.name}")
            locations = [Path(path).resolve() for path in (spec.submodule_search_locations or [])] if spec else []
            if candidate.resolve() in locations:
                found[candidate.name] = candidate.resolve()
    return found


def _own_folders() -> list[Path]:
    """The folders rollflow's own modules are imported from (its package and subpackages)."""
    import rollflow

    return [Path(path).resolve() for path in rollflow.__path__] + list(_installed_subpackages().values())


def _check_destination(dest_dir: Path) -> None:
    target = dest_dir.resolve()
    for own in _own_folders():
        if target == own or own in target.parents:
            raise ValueError(
                f"{dest_dir} is inside rollflow's own package folder {own}: modules there can be imported "
                "under a second name (envs.types.ToolResult beside rollflow.ToolResult); write the "
                "environment into a folder of your own (the working directory, or --dir my_envs)"
            )


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"environment name {name!r} must be a lowercase Python name: a letter, then letters, digits or _"
        )
    if keyword.iskeyword(name) or name in sys.stdlib_module_names or name in {"rollflow", *_installed_subpackages()}:
        raise ValueError(
            f"environment name {name!r} would shadow a Python or rollflow module; choose another"
        )
